"""Shared by the checkpoint workers and tests: a tiny model, stage layouts and the reference
values every rank can rebuild on its own (so results are compared, not copied).

Lightning is not imported here (it is slow to import); ``tiny_module.TinyLM`` is the
LightningModule with the same parameter names, for the export test."""

from __future__ import annotations

import random
import zlib
from typing import Any

import numpy as np
import torch
import torch.nn as nn

HPARAMS = {"width": 8, "n_blocks": 3}


def build_units(module: nn.Module, width: int, n_blocks: int) -> None:
    """The units of the test model, registered on ``module`` (plain or Lightning)."""
    module.embed = nn.Linear(6, width)
    module.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(n_blocks)])
    module.norm = nn.BatchNorm1d(width)
    module.head = nn.Linear(width, 3)


class TinyNet(nn.Module):
    def __init__(self, width: int = 8, n_blocks: int = 3) -> None:
        super().__init__()
        build_units(self, width, n_blocks)


UNITS = ["embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head"]
LAYOUTS = {
    "pp1": [UNITS],
    "pp2": [UNITS[:3], UNITS[3:]],
    "pp3": [UNITS[:2], UNITS[2:4], UNITS[4:]],
}


def reference_model() -> TinyNet:
    torch.manual_seed(0)
    model = TinyNet(**HPARAMS)
    with torch.no_grad():
        model.norm.running_mean.normal_()
        model.norm.running_var.uniform_(0.5, 2.0)
        model.norm.num_batches_tracked.fill_(7)
    return model


def _unit(name: str) -> str:
    return next(u for u in UNITS if name.startswith(u + "."))


def stage_names(layout: str, stage: int) -> list[str]:
    units = LAYOUTS[layout][stage]
    return [n for n in reference_model().state_dict() if _unit(n) in units]


def exp_avg(name: str, shape: torch.Size) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen)


def rng_state(rank: int) -> dict[str, Any]:
    torch.manual_seed(1000 + rank)
    np.random.seed(1000 + rank)
    random.seed(1000 + rank)
    torch.rand(3), np.random.rand(3), random.random()  # move off the seed point
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def stage_state(layout: str, stage: int, rank: int, step: int) -> dict[str, Any]:
    """What a rank holding ``stage`` of ``layout`` saves (rank-keyed RNG, shared loop state)."""
    model = reference_model()
    full = model.state_dict()
    params = dict(model.named_parameters())
    names = stage_names(layout, stage)
    return {
        "model": {n: full[n] for n in names},
        "optimizer": {
            "state": {
                n: {"exp_avg": exp_avg(n, full[n].shape),
                    "step": torch.tensor(float(step))} for n in names if n in params
            },
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}],
        },
        "rng": {f"rank{rank}": rng_state(rank)},
        "loops": {"fit_loop": {"epoch": 1, "batch_idx": 5, "total": {"ready": step, "completed": step}}},
        "hyper_parameters": dict(HPARAMS),
        "epoch": 1,
        "global_step": step,
    }


def rng_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    na, nb = a["numpy"], b["numpy"]
    return (
        torch.equal(a["torch"], b["torch"])
        and na[0] == nb[0]
        and np.array_equal(na[1], nb[1])
        and na[1].dtype == nb[1].dtype
        and tuple(na[2:]) == tuple(nb[2:])
        and a["python"] == b["python"]
    )


def compare_stage(loaded: dict[str, Any], layout: str, stage: int, step: int) -> list[str]:
    """Differences between a loaded stage state and the reference (empty list: equal)."""
    ref = stage_state(layout, stage, rank=0, step=step)
    problems = []
    for n, t in ref["model"].items():
        got = loaded["model"].get(n)
        if got is None or got.dtype != t.dtype or not torch.equal(got, t):
            problems.append(f"model {n}")
    for n, s in ref["optimizer"]["state"].items():
        got = loaded["optimizer"]["state"].get(n, {})
        same_avg = torch.equal(got.get("exp_avg", torch.empty(0)), s["exp_avg"])
        if not (same_avg and torch.equal(got.get("step"), s["step"])):
            problems.append(f"optimizer {n}")
    for key in ("loops", "hyper_parameters", "epoch", "global_step"):
        if loaded.get(key) != ref[key]:
            problems.append(f"{key}: {loaded.get(key)!r} != {ref[key]!r}")
    if loaded["optimizer"]["param_groups"] != ref["optimizer"]["param_groups"]:
        problems.append("param_groups")
    return problems


def big_state(step: int, mib: int = 6) -> dict[str, Any]:
    """A state of ``mib`` MiB of float32 weights, a function of ``step`` only."""
    gen = torch.Generator().manual_seed(step)
    return {
        "model": {f"layers.{i}.weight": torch.randn(512, 512, generator=gen) for i in range(mib)},
        "global_step": step,
    }
