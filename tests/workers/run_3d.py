"""The 8-rank job: every configuration that needs pipeline × data parallel × tensor parallel at once, in turn, in the
same processes (each with its own Trainer and model).

A configuration with ``"worker": "resume"`` runs :func:`tests.workers.run_resume.main` (the checkpoint chain's
steps), any other :func:`tests.workers.run_sharded.run` (a real model, its shards and collectives recorded); one
with ``"refused": true`` records each rank's error (:mod:`tests.workers.refusals`) and the job goes on.
Usage: python -m tests.workers.run_3d '<json: {"devices": 8, "runs": [config, ...]}>'
"""

import functools
import json
import sys

from tests.workers import run_resume, run_sharded
from tests.workers.refusals import exit_status, try_case


def one(cfg: dict, devices: int) -> None:
    if cfg.get("worker") == "resume":
        run_resume.main({**cfg, "devices": devices})
    else:
        run_sharded.run(cfg, devices)


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    records = []
    for cfg in spec["runs"]:
        if cfg.get("refused"):
            records.append(try_case(cfg["out"], spec["devices"], functools.partial(one, cfg, spec["devices"])))
        else:
            one(cfg, spec["devices"])
    sys.exit(exit_status(records))
