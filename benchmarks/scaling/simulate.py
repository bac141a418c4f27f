"""PREDICTED scaling of a pipeline × data-parallel job from 8 to 256 devices, by simulation.

Nothing here runs on 256 devices: the numbers are a prediction from

* **measured costs**: the forward and backward time of one model block on one micro-batch, either
  profiled on this machine now (``--profile``, the default: a few seconds, one thread) or taken from
  a telemetry run of ``benchmarks/throughput/main.py`` (``--costs results.json``);
* **a stated network model** (:class:`Network`): devices per node, bandwidth and latency inside a
  node and between nodes; a point-to-point transfer takes ``latency + bytes / bandwidth``, a
  data-parallel gradient all-reduce is a ring: ``2(n-1)/n · bytes / bandwidth + 2(n-1) · latency``;
* **torch's own schedule orders**, replayed by :func:`lightning_hpp.telemetry.model.simulate` with those
  costs, every cross-rank dependency delayed by its link's transfer time.

Ranks are laid out pipeline-outer as :class:`lightning_hpp.pipeline.mesh.Mesh` does (rank = position · dp +
replica), so a stage's data-parallel group is contiguous (inside a node while dp ≤ devices per
node) and neighbouring pipeline positions are dp ranks apart. The global batch and micro-batch
size are fixed; for every device count and pipeline degree, ``m = global / (dp · micro-batch)``.
Assumed, not modelled: compute time linear in micro-batch size, no overlap of the gradient
all-reduce with the pipeline, the optimizer step free, equal blocks on every stage. Memory per
device is estimated (weights, gradients and momentum, plus the activations in flight) and
``--memory-gb`` leaves out the layouts that do not fit.

Usage::

    python benchmarks/scaling/simulate.py                       # profile, CPU-cluster network
    python benchmarks/scaling/simulate.py --compute-scale 100 --network fast
    python benchmarks/scaling/simulate.py --costs benchmarks/throughput/results/results.json
    python benchmarks/scaling/simulate.py --fwd-ms 3.64 --bwd-ms 10.99   # costs measured elsewhere
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "throughput")]

from lightning_hpp.telemetry.model import schedule_actions, simulate  # noqa: E402


@dataclass(frozen=True)
class Network:
    """Links between devices. Bandwidths in GB/s, latencies in microseconds."""

    per_node: int
    intra_gbs: float
    intra_us: float
    inter_gbs: float
    inter_us: float

    def link(self, a: int, b: int) -> tuple[float, float]:
        """(bandwidth in bytes/s, latency in s) between global ranks a and b."""
        same = a // self.per_node == b // self.per_node
        return ((self.intra_gbs if same else self.inter_gbs) * 1e9, (self.intra_us if same else self.inter_us) * 1e-6)

    def p2p_s(self, a: int, b: int, nbytes: float) -> float:
        bw, lat = self.link(a, b)
        return lat + nbytes / bw

    def allreduce_s(self, ranks: list[int], nbytes: float) -> float:
        n = len(ranks)
        if n == 1:
            return 0.0
        nodes = {r // self.per_node for r in ranks}
        bw, lat = self.link(ranks[0], ranks[0]) if len(nodes) == 1 else self.link(0, self.per_node)
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat


NETWORKS = {
    # Ranks that are CPU cores: shared memory inside a node, 25 Gb/s Ethernet between nodes.
    "cpu": Network(per_node=8, intra_gbs=10.0, intra_us=10.0, inter_gbs=3.125, inter_us=30.0),
    # Accelerators: NVLink-class inside a node, 200 Gb/s InfiniBand between nodes.
    "fast": Network(per_node=8, intra_gbs=150.0, intra_us=5.0, inter_gbs=25.0, inter_us=10.0),
}


@dataclass(frozen=True)
class Costs:
    """Per block and micro-batch: forward and backward seconds; bytes of the activation and of a block's parameters."""

    fwd_s: float
    bwd_s: float
    act_bytes: float
    param_bytes: float
    source: str


def profile(model: str, width: int, seq: int, mb: int, reps: int = 15) -> Costs:
    """Time one block of the benchmark model on one micro-batch, single thread, median of ``reps``."""
    import torch
    from models import Block
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if model == "mlp":
        block, x = nn.Sequential(nn.Linear(width, width), nn.ReLU()), torch.randn(mb, width, requires_grad=True)
    else:
        block, x = Block(width), torch.randn(mb, seq, width, requires_grad=True)
    fwd, bwd = [], []
    for i in range(reps + 3):
        t0 = time.perf_counter()
        y = block(x)
        t1 = time.perf_counter()
        y.backward(torch.ones_like(y))
        t2 = time.perf_counter()
        if i >= 3:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return Costs(
        statistics.median(fwd),
        statistics.median(bwd),
        *block_bytes(model, width, seq, mb),
        f"profiled: one {model} block (width {width}{f', seq {seq}' if seq else ''}), micro-batch {mb}, 1 thread",
    )


def block_bytes(model: str, width: int, seq: int, mb: int) -> tuple[float, float]:
    """(activation bytes per micro-batch, parameter bytes) of one block, fp32."""
    act = mb * width * max(1, seq) * 4
    params = (width * width + width) * 4 if model == "mlp" else (12 * width**2 + 13 * width) * 4
    return float(act), float(params)


def from_results(path: Path, model: str, mb: int) -> Costs:
    """Costs from a telemetry run of the throughput benchmark (its ``hpp 1f1b`` row of ``model``)."""
    data = json.loads(path.read_text())
    rows = data["models"][model]
    row = next(r for r in rows if r["cfg"]["kind"] == "hpp" and r["cfg"]["schedule"] == "1f1b" and "stages" in r)
    from models import SIZES

    size = SIZES[model][data.get("size", "cpu")]
    stages = row["stages"].values()
    per_sample_block = 1e-3 / (size.batch * size.blocks)
    fwd = sum(s["fwd_ms"] for s in stages) * per_sample_block * mb
    bwd = sum(s["bwd_ms"] for s in stages) * per_sample_block * mb
    act, params = block_bytes(model, size.width, size.seq, mb)
    return Costs(
        fwd, bwd, act, params, f"telemetry of {path} ({row['label']}, width {size.width}), scaled to micro-batch {mb}"
    )


@dataclass
class Row:
    devices: int
    pp: int
    dp: int
    m: int
    step_s: float
    bubble: float
    comm_share: float
    samples_s: float
    memory_gb: float
    efficiency: float = 0.0


def predict(
    costs: Costs, net: Network, devices: int, pp: int, blocks: int, global_batch: int, mb: int, schedule: str
) -> Row | None:
    """One configuration's predicted step, or None where the batch does not fit the layout."""
    dp = devices // pp
    if global_batch % (dp * mb):
        return None
    m = global_batch // (dp * mb)
    per_stage = blocks // pp
    f, b = costs.fwd_s * per_stage, costs.bwd_s * per_stage
    params = costs.param_bytes * per_stage
    if pp == 1:
        pipe, free = m * (f + b), m * (f + b)
        bubble = 0.0
    else:
        if m < pp:
            return None
        orders = schedule_actions(schedule, pp, m)
        cost = lambda a: f if a.kind == "F" else b  # noqa: E731
        ideal = simulate(orders, cost)
        pipe = simulate(
            orders, cost, latency=lambda src, dst, a: net.p2p_s(src * dp, dst * dp, costs.act_bytes)
        ).makespan
        free, bubble = ideal.makespan, ideal.bubble
    reduce = max(net.allreduce_s([r * dp + d for d in range(dp)], params) for r in range(pp))
    step = pipe + reduce
    # Weights, gradients and SGD momentum, plus the activations the first stage holds: 1F1B keeps
    # at most pp micro-batches in flight, GPipe all m; without a pipeline, m micro-batches are
    # accumulated one at a time. Each block keeps about two activations per micro-batch.
    in_flight = 1 if pp == 1 else (m if schedule == "gpipe" else min(m, pp))
    memory = 3 * params + in_flight * per_stage * 2 * costs.act_bytes
    return Row(devices, pp, dp, m, step, bubble, (step - free) / step, global_batch / step, memory / 1e9)


def table(rows: list[Row], title: str) -> str:
    lines = [
        f"**{title}**",
        "",
        "| devices | pp × dp | micro-batches | step s | bubble | communication share | samples/s | scaling efficiency "
        "| memory per device GB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    best = {}
    for r in rows:
        if r.devices not in best or r.samples_s > best[r.devices].samples_s:
            best[r.devices] = r
    for r in rows:
        mark = " **best**" if best[r.devices] is r else ""
        lines.append(
            f"| {r.devices} | {r.pp} × {r.dp} | {r.m} | {r.step_s:.3f} | {r.bubble:.3f} | {r.comm_share:.3f} | "
            f"{r.samples_s:.1f} | {r.efficiency:.2f}{mark} | {r.memory_gb:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description="Predicted pp × dp scaling, by simulation (a prediction, not a measurement)."
    )
    p.add_argument("--model", default="mlp", choices=["mlp", "lm"])
    p.add_argument("--width", type=int, default=1792, help="block width (mlp hidden size / lm d_model)")
    p.add_argument("--seq", type=int, default=64, help="lm sequence length")
    p.add_argument("--blocks", type=int, default=32, help="blocks of the simulated model")
    p.add_argument("--global-batch", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved1f1b", "zbv"])
    p.add_argument("--devices", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    p.add_argument("--network", default="cpu", choices=list(NETWORKS))
    p.add_argument(
        "--compute-scale", type=float, default=1.0, help="divide the measured compute costs (faster devices)"
    )
    p.add_argument("--memory-gb", type=float, help="leave out layouts that need more memory per device")
    p.add_argument(
        "--fwd-ms", type=float, help="forward ms of one block on one micro-batch (with --bwd-ms: skip the profile)"
    )
    p.add_argument("--bwd-ms", type=float, help="backward ms of one block on one micro-batch")
    p.add_argument("--costs", type=Path, help="results.json of benchmarks/throughput/main.py instead of profiling")
    args = p.parse_args(argv)
    if args.schedule in ("interleaved1f1b", "zbv"):
        raise SystemExit(f"--schedule {args.schedule!r}: this table places one stage per device; use gpipe or 1f1b.")
    seq = args.seq if args.model == "lm" else 0
    if args.fwd_ms is not None and args.bwd_ms is not None:
        costs = Costs(
            args.fwd_ms / 1e3,
            args.bwd_ms / 1e3,
            *block_bytes(args.model, args.width, seq, args.micro_batch),
            "given on the command line",
        )
    elif args.costs:
        costs = from_results(args.costs, args.model, args.micro_batch)
    else:
        costs = profile(args.model, args.width, seq, args.micro_batch)
    if args.compute_scale != 1.0:
        costs = Costs(
            costs.fwd_s / args.compute_scale,
            costs.bwd_s / args.compute_scale,
            costs.act_bytes,
            costs.param_bytes,
            costs.source + f", compute ÷ {args.compute_scale:g}",
        )
    net = NETWORKS[args.network]
    rows: list[Row] = []
    for devices in args.devices:
        for pp in (1, 2, 4, 8, 16, 32, 64):  # powers of two up to the block count
            if devices % pp or pp > args.blocks or args.blocks % pp:
                continue
            row = predict(costs, net, devices, pp, args.blocks, args.global_batch, args.micro_batch, args.schedule)
            if row is not None and (args.memory_gb is None or row.memory_gb <= args.memory_gb):
                rows.append(row)
    if not rows:
        raise SystemExit("No layout fits: raise --memory-gb or --global-batch, or lower --micro-batch.")
    smallest = min(r.devices for r in rows)
    base = max(r.samples_s for r in rows if r.devices == smallest) / smallest
    for r in rows:
        r.efficiency = r.samples_s / r.devices / base
    print("PREDICTION by simulation — not measured on these device counts.")
    print(
        f"costs: fwd {costs.fwd_s * 1e3:.3f} ms, bwd {costs.bwd_s * 1e3:.3f} ms per block and micro-batch; "
        f"activation {costs.act_bytes / 1e3:.1f} kB, block parameters {costs.param_bytes / 1e6:.2f} MB ({costs.source})"
    )
    print(f"network {args.network!r}: {asdict(net)}")
    print(
        f"model: {args.blocks} blocks, global batch {args.global_batch}, micro-batch {args.micro_batch}, schedule "
        f"{args.schedule}\n"
    )
    print(table(rows, f"Predicted scaling ({args.model}, network {args.network!r}, compute ÷ {args.compute_scale:g})"))


if __name__ == "__main__":
    main()
