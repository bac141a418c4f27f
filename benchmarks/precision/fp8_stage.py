"""One pipeline stage in fp8 against the same stage in bf16: numerics and step time, on one GPU.

The stage is a :class:`~lightning_hpp.pipeline.stage.StageModule` of ``--blocks`` transformer MLP
blocks (``LayerNorm → Linear(h, 4h) → GELU → Linear(4h, h)``, residual), set up by
:meth:`HPPPrecision.configure_stages` exactly as under ``HPPStrategy``: once as ``"fp8"``
(Transformer Engine, ``--recipe`` scaling), once as ``"bf16-mixed"``, and once as ``"32-true"``
for the numerics reference; all three start from the same weights.

* **numerics** — after ``--warmup`` steps (delayed scaling fills its amax history), the relative
  Frobenius error of the output and of the first and last weight gradients, fp8 vs bf16 and each
  vs fp32, on one fixed micro-batch;
* **step time** — forward + backward of one micro-batch of ``--tokens`` tokens, median of
  ``--steps`` steps after the warm-up (CUDA events), and bf16 ÷ fp8 (the goal: ≥ 1.3 at
  hidden ≥ 4096).

``--device cpu --backend emulate`` runs the same code on a CPU with the fp8 emulation (a check of
the script, not an fp8 figure). Results: ``<out>/fp8_stage.json`` and ``fp8_stage.md``.

Usage::

    python benchmarks/precision/fp8_stage.py --hidden 4096 --out $OUT            # H100/H200, TE
    python benchmarks/precision/fp8_stage.py --device cpu --backend emulate --hidden 128 --tokens 256 --steps 3
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning_hpp import HPPPrecision, StagePlan, StageSpec
from lightning_hpp.pipeline.stage import StageModule
from lightning_hpp.precision.plugin import StageView


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


def build_stage(blocks: list[nn.Module], precision: str, device: torch.device, args: Any) -> StageModule:
    names = [f"blocks.{i}" for i in range(len(blocks))]
    stage = StageModule(names, blocks, 0, spread=True).to(device)
    plan = StagePlan([StageSpec(modules=names, precision=precision)])
    plugin = HPPPrecision(fp8_backend=args.backend, fp8_recipe=args.recipe)
    kind = "h200" if device.type == "cuda" else "cpu"
    view = StageView({0: stage})
    plugin.configure_stages(plan, view, "32-true", device, kind)
    stage.bench_label, stage.bench_checks = plan.meta["precision"][0], view.step_checks
    return stage


def step(stage: StageModule, x: torch.Tensor) -> torch.Tensor:
    for check in stage.bench_checks:  # the boundary guard, decided per step as the runner does
        check.reset()
    stage.zero_grad(set_to_none=True)
    out = stage(x)
    out.float().pow(2).mean().backward()
    for check in stage.bench_checks:  # a NaN/Inf at the boundary raises here
        check.resolve([float(check.flag())])
    return out.detach()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def timed(stage: StageModule, x: torch.Tensor, warmup: int, steps: int) -> float:
    cuda = x.device.type == "cuda"
    for _ in range(warmup):
        step(stage, x)
    times = []
    for _ in range(steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(stage, x)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step(stage, x)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch")
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="te", choices=["te", "emulate"])
    p.add_argument("--recipe", default="delayed", choices=["delayed", "current"])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=str(ROOT / "runs" / "fp8_stage"))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    blocks = [Block(args.hidden) for _ in range(args.blocks)]
    stages = {prec: build_stage(copy.deepcopy(blocks), prec, device, args) for prec in ("32-true", "bf16-mixed", "fp8")}
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, device=device, generator=g)

    for _ in range(args.warmup):
        step(stages["fp8"], x)
    outs, grads = {}, {}
    for prec, stage in stages.items():
        outs[prec] = step(stage, x)
        grads[prec] = [stage.units[0].up.weight.grad.clone(), stage.units[-1].down.weight.grad.clone()]
    numerics = {
        "output fp8 vs bf16": rel(outs["fp8"], outs["bf16-mixed"]),
        "output fp8 vs fp32": rel(outs["fp8"], outs["32-true"]),
        "output bf16 vs fp32": rel(outs["bf16-mixed"], outs["32-true"]),
        "grad first up fp8 vs bf16": rel(grads["fp8"][0], grads["bf16-mixed"][0]),
        "grad last down fp8 vs bf16": rel(grads["fp8"][1], grads["bf16-mixed"][1]),
    }
    ms = {prec: timed(stages[prec], x, args.warmup, args.steps) for prec in ("bf16-mixed", "fp8")}
    result = {
        "config": vars(args),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "labels": {prec: stage.bench_label for prec, stage in stages.items()},
        "numerics": numerics,
        "numerics_ok": bool(
            1e-4 < numerics["output fp8 vs bf16"] < 0.1 and numerics["grad first up fp8 vs bf16"] < 0.25
        ),
        "step_ms": ms,
        "bf16_over_fp8": ms["bf16-mixed"] / ms["fp8"],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_stage.json").write_text(json.dumps(result, indent=2))
    lines = [
        (
            f"# fp8 stage vs bf16 stage ({result['device']}, hidden {args.hidden}, {args.blocks} blocks, "
            f"{args.tokens} tokens, backend {args.backend}, {args.recipe} scaling)"
        ),
        "",
        "| relative error | value |",
        "|---|---:|",
        *(f"| {k} | {v:.4f} |" for k, v in numerics.items()),
        "",
        "| stage | step ms (median) |",
        "|---|---:|",
        *(f"| {k} | {v:.2f} |" for k, v in ms.items()),
        "",
        (
            f"bf16 ÷ fp8 step time: **{result['bf16_over_fp8']:.2f}** (goal ≥ 1.3); numerics "
            f"{'within' if result['numerics_ok'] else 'OUTSIDE'} the bounds (output < 0.1, gradient < 0.25)."
        ),
    ]
    (out / "fp8_stage.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
