"""A mixed A100 + H100 pair simulated on 2 CPU ranks, meeting several cases in turn (one launch).

Usage: python -m tests.workers.run_cluster '<json: {"out": DIR, "cases": [NAME, ...]}>'

The ranks' kinds come from ``PlacementOptions(device_map=["a100", "h100"])`` and their capabilities from
``HPP_SIMULATED_DEVICES`` (set per case in this process, read at setup): rank 0 an A100 (compute capability
8.0, no Transformer Engine), rank 1 an H100 with or without Transformer Engine. Each case runs its ``fit``
(and what follows it) through :func:`tests.workers.refusals.try_case`, which records on every rank how it
ended; a case that trains also writes ``OUT/<case>/rank{r}.pt`` (its parameters, its plan's labels and what
the case measured). The cases:

* ``fp8_te_simulated``: stage 0 (``a100``, fp32), stage 1 (``h100``, fp8) with Transformer Engine asked for;
  the H100 rank has it (the emulation stands in): trains;
* ``fp8_emulated``: the same with ``HPPPrecision(fp8_backend="emulate")`` (the numerics to equal);
* ``fp8_no_te``: no Transformer Engine on the H100 rank: refused at setup, on both ranks;
* ``fp8_te_recompute``: Transformer Engine with activation checkpointing: refused at setup, on both ranks;
* ``fit_then_test``: ``fit`` then ``test`` on the same Trainer: where the stages' parameters are at each entry
  point's start, and the moves the module got between them;
* ``setup_bytes``: what the start-up broadcast held staged at once on the group's device (an allocation hook
  on :func:`lightning_hpp._dist.stage`, copying as a device would), with 20 KB buckets, against the model; the
  fit writes asynchronous checkpoints (the background save has a group of its own), and every process group's
  timeout is recorded (every case records them).
"""

from __future__ import annotations

import json
import os
import sys
import weakref
from pathlib import Path

import lightning as L
import torch

from lightning_hpp import HPPPrecision, HPPStrategy, StagePlan, StageSpec
from lightning_hpp import _dist
from lightning_hpp.options import CheckpointOptions
from tests.harness.zoo import MLP, loaders
from tests.workers.refusals import exit_status, try_case
from tests.harness.trainer import quiet_trainer

TIMEOUT_S = 120  # also what the ranks' start-up may take on a loaded machine (rank 1 imports Lightning after rank 0)
KINDS = ["a100", "h100"]
SIMULATED = {
    "te": {"a100": {}, "h100": {"te": True}},
    "no_te": {"a100": {}, "h100": {}},
}
BUCKET = 20 * 1024


class Placed(MLP):
    """Records every ``to(...)`` the module gets, and where its parameters are when an entry point starts."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.moves: list[tuple[str, str]] = []
        self.devices_at: dict[str, list[str]] = {}

    def to(self, *args, **kwargs):
        trainer = self._trainer
        fn = trainer.state.fn.value if trainer is not None and trainer.state.fn is not None else "none"
        device = next((str(a) for a in args if isinstance(a, (torch.device, str))), str(kwargs.get("device")))
        self.moves.append((fn, device))
        return super().to(*args, **kwargs)

    def on_fit_start(self):
        self.devices_at["fit"] = sorted({str(p.device) for p in self.parameters()})

    def on_test_start(self):
        self.devices_at["test"] = sorted({str(p.device) for p in self.parameters()})


def _plan(precisions: list[str], units: int = 7) -> StagePlan:
    half = units // 2 + 1
    return StagePlan([StageSpec(modules=[f"layers.0-{half - 1}"], device=KINDS[0], precision=precisions[0]),
                      StageSpec(modules=[f"layers.{half}-{units - 1}"], device=KINDS[1], precision=precisions[1])])


def run_case(case: str, out: Path) -> None:
    L.seed_everything(0)
    os.environ["HPP_SIMULATED_DEVICES"] = json.dumps(SIMULATED["no_te" if case == "fp8_no_te" else "te"])
    precision = HPPPrecision(fp8_backend="emulate" if case == "fp8_emulated" else None)
    fp8 = case.startswith("fp8")
    plan = _plan(["32-true", "fp8"] if fp8 else ["32-true", "32-true"], units=11 if case == "setup_bytes" else 7)
    kw: dict = {}
    callbacks = []
    if case == "setup_bytes":
        kw["checkpoint"] = CheckpointOptions(dir=str(out / "ckpt"), every_n_steps=2, async_save=True)
    trainer_kw = dict(enable_checkpointing=case == "setup_bytes", default_root_dir=str(out))
    strategy = HPPStrategy(plan=plan, n_microbatches=4, timeout=TIMEOUT_S, placement={"device_map": KINDS},
                           precision_plugin=precision, activation_checkpointing=case == "fp8_te_recompute", **kw)
    model = Placed(depth=6, hidden=64) if case == "setup_bytes" else Placed()
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=4,
                            num_sanity_val_steps=0, limit_val_batches=0, limit_test_batches=2, callbacks=callbacks,
                            **trainer_kw)
    train, _ = loaders(16)
    staged = _watch_staging() if case == "setup_bytes" else None

    def run() -> None:
        trainer.fit(model, train)
        if case == "fit_then_test":
            trainer.test(model, train, verbose=False)

    saved = getattr(_dist, "stage", None), getattr(_dist, "BROADCAST_BUCKET_BYTES", None)
    try:
        record = try_case(out, 2, run, trainer)
    finally:
        _dist.stage, _dist.BROADCAST_BUCKET_BYTES = saved
    if record["error"] is not None:
        return
    rank = trainer.global_rank
    result = {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items() if "layers" in k},
        "plan_meta": {k: strategy._pipeline.plan.meta.get(k) for k in ("precision", "device_kinds")},
        "moves": model.moves,
        "devices_at": model.devices_at,
        "root_device": str(strategy.root_device),
        "timeouts": _timeouts(),
        "groups": len(torch.distributed.distributed_c10d._world.pg_map),
    }
    if staged is not None:
        result["staged_peak"] = staged["peak"]
        result["staged_total"] = staged["total"]
        whole = MLP(depth=6, hidden=64)  # the model before the cut
        result["model_bytes"] = sum(t.numel() * t.element_size() for t in (*whole.parameters(), *whole.buffers()))
        result["largest_tensor"] = max(p.numel() * p.element_size() for p in whole.parameters())
    torch.save(result, out / f"rank{rank}.pt")


def _timeouts() -> list[str]:
    """The timeouts of every process group of this process (their gloo backends' options), read from torch."""
    found = set()
    for group in list(torch.distributed.distributed_c10d._world.pg_map):
        found.add(str(group._get_backend(torch.device("cpu")).options._timeout))
    return sorted(found)


def _watch_staging() -> dict:
    """Count the bytes the start-up broadcast holds staged on the group's device at once: every staged bucket is
    counted until it is freed."""
    seen = {"live": 0, "peak": 0, "total": 0}
    _dist.BROADCAST_BUCKET_BYTES = BUCKET

    stage_on_device = getattr(_dist, "stage", None)

    def stage(bucket: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        copy = stage_on_device(bucket, device)
        n = copy.numel() * copy.element_size()
        seen["live"] += n
        seen["total"] += n
        seen["peak"] = max(seen["peak"], seen["live"])
        weakref.finalize(copy, lambda: seen.__setitem__("live", seen["live"] - n))
        return copy

    _dist.stage = stage
    return seen


def main(cfg: dict) -> int:
    records = []
    for case in cfg["cases"]:
        folder = Path(cfg["out"]) / case
        folder.mkdir(parents=True, exist_ok=True)
        run_case(case, folder)
        records.append(json.loads((folder / f"refusal_rank{int(os.environ.get('LOCAL_RANK', 0))}.json").read_text()))
    return exit_status(records)


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
