"""The conformance jobs, shared by the tests of tests/conformance/test_conformance.py.

Three jobs side by side (tests.harness.launch.run_jobs): pp=2 on 2 ranks (started by Lightning's launcher), pp=2 × dp=2
on 4 ranks (under lightning-hpp-torchrun), and one process running every scenario's reference with Lightning's
default strategy (then the one-process HPPStrategy scenario). Each runs every scenario of its layout one after
another; the tests only load and compare.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

JOBS = ("ref", "pp2", "pp2dp2")


@pytest.fixture(scope="session")
def conformance(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory holding ``<scenario>/<layout>/rank<r>.pt`` for every scenario (and ``seconds.json``: when each
    job ended, from the start of the three)."""
    from tests.harness.launch import Job, run_jobs

    if os.environ.get("HPP_CONFORMANCE_RESULTS"):  # results of an earlier run of the jobs (to iterate on the tests)
        return Path(os.environ["HPP_CONFORMANCE_RESULTS"])
    root = tmp_path_factory.mktemp("conformance")
    # one thread per process: 7 processes of tiny models share the CPUs (both sides of every comparison run so)
    single = {"OMP_NUM_THREADS": "1"}
    # pp=2 starts its ranks through Lightning's launcher; pp=2 x dp=2's are forks of one process that imported
    # Lightning (lightning_hpp.torchrun): three imports of Lightning fewer on the job's critical path
    done = run_jobs([
        Job("tests.conformance.worker", {"layout": job, "out": str(root)}, env=single, timeout=600,
            **({"ranks": 4, "start": "forked"} if job == "pp2dp2" else {"ranks": 1 if job == "ref" else 2}))
        for job in JOBS
    ])
    seconds = {job: round(proc.seconds, 1) for job, proc in zip(JOBS, done)}
    (root / "seconds.json").write_text(json.dumps(seconds))
    print(f"conformance jobs ended after (s): {seconds}")
    return root
