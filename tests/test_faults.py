"""A rank that hangs, dies or waits on storage that does not answer ends every rank, fast, with an error naming it.

Two jobs side by side (tests/workers/run_faults.py), pp=2 x dp=2 and pp=4 on 4 ranks each with
``HPPStrategy(timeout=10)``, meet one fault after another, each at step 3 and each pipeline position once: a
rank that stalls (sleeps in a callback or in its stage's forward), one that is stopped (``SIGSTOP``, rank 0,
which hosts the job's store, among them), one killed (``kill -9``), and an S3 endpoint that drops every packet
at start-up. After each, every rank must have ended within the timeout plus 30 s, the ranks that could print
with an error naming the rank (host, pid, pipeline position, step) and what it was doing, no rank process may
be left, and every checkpoint that claims to be valid must verify and be older than the fault.
"""

from __future__ import annotations

import json
import socket

import pytest

from tests.harness.launch import Job, run_jobs

pytestmark = pytest.mark.slow

TIMEOUT_S = 10
BOUND_S = TIMEOUT_S + 30
LAYOUTS = {
    "pp2xdp2": {"pp": 2, "attempts": [
        {"fault": "sigstop", "rank": 0, "step": 3, "where": "forward"},  # position 0; the store's host
        {"fault": "stall", "rank": 3, "step": 3},  # position 1, in on_train_batch_end
        {"fault": "kill", "rank": 2, "step": 3, "where": "forward"},
        {"fault": "s3", "rank": 0},
    ]},
    "pp4": {"pp": 4, "attempts": [
        {"fault": "stall", "rank": 0, "step": 3, "where": "forward"},  # the store's host, inside the schedule
        {"fault": "sigstop", "rank": 1, "step": 3},
        {"fault": "sigstop", "rank": 2, "step": 3, "where": "forward"},
        {"fault": "stall", "rank": 3, "step": 3, "where": "forward"},
        {"fault": "kill", "rank": 2, "step": 3},
    ]},
}
CASES = [(layout, i) for layout, spec in LAYOUTS.items() for i in range(len(spec["attempts"]))]


@pytest.fixture(scope="module")
def fault_jobs(tmp_path_factory):
    outs = {name: tmp_path_factory.mktemp(f"faults_{name}") for name in LAYOUTS}
    jobs = [Job("tests.workers.run_faults", {"pp": spec["pp"], "ranks": 4, "timeout": TIMEOUT_S, "out": str(outs[name]),
                                             "attempts": spec["attempts"]}, ranks=4, timeout=900)
            for name, spec in LAYOUTS.items()]
    run_jobs(jobs)
    return outs


def _position(layout: str, rank: int) -> int:
    return rank // 2 if layout == "pp2xdp2" else rank


@pytest.mark.parametrize("layout, index", CASES, ids=[f"{lay}-{LAYOUTS[lay]['attempts'][i]['fault']}-rank"
                                                      f"{LAYOUTS[lay]['attempts'][i]['rank']}" for lay, i in CASES])
def test_a_rank_that_hangs_or_dies_ends_every_rank_naming_it(fault_jobs, layout, index):
    record = json.loads((fault_jobs[layout] / f"attempt{index}.json").read_text())
    attempt = record["attempt"]
    fault, culprit = attempt["fault"], attempt["rank"]
    pp = LAYOUTS[layout]["pp"]
    assert record["fault_at"] is not None, record["stderr"]
    assert record["left"] == [], f"rank processes left behind: {record['left']}"
    ended = {int(r): e for r, e in record["ended"].items()}
    assert sorted(ended) == [0, 1, 2, 3]
    for rank, end in ended.items():
        assert end["after_fault_s"] <= BOUND_S, (rank, end, record["stderr"][str(rank)][-3000:])
    pid = record["pids"][str(culprit)]
    named = f"RankFailedError: rank {culprit} (host {socket.gethostname()}, pid {pid}, pipeline position " \
            f"{_position(layout, culprit)} of {pp}"
    doing = {"stall": "`time.sleep(SLEEP_S)`", "kill": " is gone (its process ended",
             "s3": "S3 endpoint http://127.0.0.1:", "sigstop": " is stopped (SIGSTOP" if culprit != 0 else ""}[fault]
    for rank in ended:
        if rank == culprit and fault in ("kill", "sigstop"):
            assert ended[rank]["how"] == "signal 9", ended[rank]  # killed by the test, or by a peer once stopped
            continue
        lines = [line for line in record["stderr"][str(rank)].splitlines()
                 if line.startswith(f"[rank{rank}]: lightning_hpp.errors.")]
        assert lines, record["stderr"][str(rank)][-3000:]
        assert named in lines[-1] and doing in lines[-1], lines[-1]
        if fault == "stall":
            assert "stopped answering at step 3: for " in lines[-1], lines[-1]
        assert ended[rank]["how"] == "exit 1", ended[rank]
    for ckpt in record["checkpoints"]:  # what claims to be a valid checkpoint is one, and from before the fault
        assert ckpt["error"] is None, ckpt
        assert int(ckpt["dir"].split("-")[1]) < attempt["step"], ckpt
