"""The conformance jobs, shared by the tests of tests/conformance/test_conformance.py.

Three jobs side by side (tests.launch.run_scripts): pp=2 on 2 ranks, pp=2 × dp=2 on 4 ranks, and one process
running every scenario's reference with Lightning's default strategy (then the one-process HPPStrategy
scenario). Each runs every scenario of its layout one after another; the tests only load and compare.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

JOBS = ("ref", "pp2", "pp2dp2")


@pytest.fixture(scope="session")
def conformance(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory holding ``<scenario>/<layout>/rank<r>.pt`` for every scenario (and ``seconds.json``: when each
    job ended, from the start of the three)."""
    from tests.launch import run_scripts

    root = tmp_path_factory.mktemp("conformance")
    # one thread per process: 7 processes of tiny models share the CPUs (both sides of every comparison run so)
    single = {"OMP_NUM_THREADS": "1"}
    done = run_scripts([("tests.conformance.worker", {"layout": job, "out": str(root)}, single) for job in JOBS], timeout=600)
    seconds = {job: round(proc.seconds, 1) for job, proc in zip(JOBS, done)}
    (root / "seconds.json").write_text(json.dumps(seconds))
    print(f"conformance jobs ended after (s): {seconds}")
    return root
