"""Planning at scale for the field report's model: CNN encoder -> Transformer -> classifier.

Two jobs:

* ``--write-profile PATH`` writes the cost profile ``field_report_profile.json`` from an analytic
  roofline of the model on A100 and H100 (datasheet numbers, see ASSUMPTIONS). No hardware is
  measured: every number this script prints is a prediction.
* without it, the script loads the profile and prints, for several A100/H100 mixes, the placement
  the partitioner chooses and its predicted throughput against homogeneous alternatives.

    python benchmarks/placement/simulate.py --write-profile benchmarks/placement/field_report_profile.json
    python benchmarks/placement/simulate.py --markdown
"""

from __future__ import annotations

import argparse
import os
import sys

from lightning_hpp.planning.cli import simulate_cluster
from lightning_hpp.planning.devices import DEVICE_SPECS
from lightning_hpp.planning.profile import CostProfile, ProfileEntry, UnitCost

HERE = os.path.dirname(os.path.abspath(__file__))
PROFILE = os.path.join(HERE, "field_report_profile.json")

MICROBATCH = 8  # images of 3x224x224 per micro-batch
GLOBAL_BATCH = 4096  # images per optimizer step
D, HEADS, MLP, BLOCKS, CLASSES = 768, 12, 3072, 12, 10
COMPUTE_EFF = 0.5  # achieved fraction of dense peak TFLOP/s for convolutions and matmuls
MEMORY_EFF = 0.7  # achieved fraction of HBM bandwidth for element-wise work
ACT_BYTES = 2  # bf16 activations
PARAM_BYTES = 4  # fp32 master weights (mixed precision); fp8 keeps them too

ASSUMPTIONS = [
    "device speeds are datasheet numbers, dense (no sparsity): A100 SXM4 80GB 312 bf16 TFLOP/s, 2039 GB/s HBM; "
    "H100 SXM5 989.4 bf16 / 1978.9 fp8 TFLOP/s, 3350 GB/s HBM; 80 GB each",
    f"achieved: {COMPUTE_EFF:.0%} of peak for convolutions and matmuls, {MEMORY_EFF:.0%} of HBM bandwidth for "
    f"element-wise work, per op max(flop time, byte time) (roofline)",
    "fp8 (Transformer Engine) speeds up the transformer's Linear layers only; convolutions and attention stay bf16",
    "activations for the backward: 34*s*h bytes per transformer block (flash attention), 3 tensors per convolution",
    "Adam (optimizer_factor 3) on fp32 master weights; backward = 2x forward flops",
]


def _conv(ops, b, hin, cin, cout, k, stride):
    """Append a conv + batch-norm + ReLU; return the output spatial size."""
    hout = hin // stride
    out = b * hout * hout * cout
    ops.append(
        ("mm", 2 * out * cin * k * k, ACT_BYTES * (b * hin * hin * cin + out), cin * cout * k * k, b * hin * hin * cin)
    )
    ops.append(("ew", 0, ACT_BYTES * out * 4, 2 * cout, 2 * out))  # bn read+write, relu read+write
    return hout


def _bottleneck(ops, b, h, cin, mid, cout, stride):
    h1 = _conv(ops, b, h, cin, mid, 1, 1)
    h2 = _conv(ops, b, h1, mid, mid, 3, stride)
    h3 = _conv(ops, b, h2, mid, cout, 1, 1)
    if stride != 1 or cin != cout:
        _conv(ops, b, h, cin, cout, 1, stride)
    ops.append(("ew", 0, ACT_BYTES * b * h3 * h3 * cout * 3, 0, 0))  # residual add
    return h3


def units(b: int):
    """``(name, ops, output_elements)`` per unit; an op is (kind, flops, bytes, params, saved_elements)."""
    out = []
    ops = []
    h = _conv(ops, b, 224, 3, 64, 7, 2)
    h //= 2  # max-pool
    ops.append(("ew", 0, ACT_BYTES * b * 112 * 112 * 64 * 1.25, 0, 0))
    out.append(("encoder.stem", ops, b * h * h * 64))
    cin = 64
    for name, mid, cout, n, stride in (
        ("layer1", 64, 256, 3, 1),
        ("layer2", 128, 512, 4, 2),
        ("layer3", 256, 1024, 6, 2),
    ):
        ops = []
        for i in range(n):
            h = _bottleneck(ops, b, h, cin, mid, cout, stride if i == 0 else 1)
            cin = cout
        out.append((f"encoder.{name}", ops, b * h * h * cout))
    s = h * h  # 196 tokens
    ops = []
    ops.append(("mm", 2 * b * s * cin * D, ACT_BYTES * b * s * (cin + D), cin * D + D, b * s * cin))
    out.append(("encoder.proj", ops, b * s * D))
    for i in range(BLOCKS):
        t = b * s
        ops = [
            ("ew", 0, ACT_BYTES * t * D * 2, 2 * D, 0),  # layer norm
            ("linear", 2 * t * D * 3 * D, ACT_BYTES * t * 4 * D, 3 * D * D + 3 * D, 0),  # qkv
            ("mm", 2 * 2 * b * HEADS * s * s * (D // HEADS), ACT_BYTES * t * 4 * D, 0, 0),  # attention (flash)
            ("linear", 2 * t * D * D, ACT_BYTES * t * 2 * D, D * D + D, 0),  # out projection
            ("ew", 0, ACT_BYTES * t * D * 5, 2 * D, 0),  # residual + layer norm
            ("linear", 2 * t * D * MLP, ACT_BYTES * t * (D + MLP), D * MLP + MLP, 0),  # fc1
            ("ew", 0, ACT_BYTES * t * MLP * 2, 0, 0),  # gelu
            ("linear", 2 * t * MLP * D, ACT_BYTES * t * (D + MLP), MLP * D + D, 0),  # fc2
            ("ew", 0, ACT_BYTES * t * D * 3, 0, 34 * t * D // ACT_BYTES),  # residual; saved: 34 s b h bytes
        ]
        out.append((f"transformer.{i}", ops, t * D))
    ops = [
        ("ew", 0, ACT_BYTES * b * s * D * 3, 2 * D, b * s * D),  # layer norm + mean pool
        ("mm", 2 * b * D * CLASSES, ACT_BYTES * b * (D + CLASSES), D * CLASSES + CLASSES, b * D),
    ]
    out.append(("classifier", ops, b * CLASSES))
    return out


def _time_ms(ops, kind: str, precision: str) -> float:
    spec = DEVICE_SPECS[kind]
    total = 0.0
    for op, flops, nbytes, _, _ in ops:
        peak = spec.tflops["fp8" if (op == "linear" and precision == "fp8") else "bf16"] * 1e12
        t_flop = flops / (COMPUTE_EFF * peak)
        t_mem = nbytes / (MEMORY_EFF * spec.hbm_gbps * 1e9)
        total += max(t_flop, t_mem)
    return total * 1e3


def build_profile() -> CostProfile:
    """The analytic profile on (a100, bf16-mixed), (h100, bf16-mixed) and (h100, fp8)."""
    us = units(MICROBATCH)
    params = [sum(o[3] for o in ops) for _, ops, _ in us]
    entries = []
    for kind, prec in (("a100", "bf16-mixed"), ("h100", "bf16-mixed"), ("h100", "fp8")):
        costs = []
        for (name, ops, out_elems), n_params in zip(us, params):
            fwd = _time_ms(ops, kind, prec)
            saved = sum(o[4] for o in ops) * ACT_BYTES
            costs.append(UnitCost(name, fwd, 2 * fwd, n_params * PARAM_BYTES, out_elems * ACT_BYTES, saved))
        entries.append(ProfileEntry(kind, prec, costs, source="roofline estimate from datasheet numbers"))
    return CostProfile(
        model="FieldReportHybrid",
        unit_names=[u[0] for u in us],
        param_counts=params,
        input_shapes=[[MICROBATCH, 3, 224, 224]],
        entries=entries,
        meta={
            "description": "ResNet-50 stem..layer3 + 1x1 projection -> 12 ViT-B blocks (d=768, 196 tokens) -> "
            "LayerNorm, mean pool, Linear(768, 10); 8 images of 3x224x224 per micro-batch",
            "assumptions": ASSUMPTIONS,
            "generated_by": "python benchmarks/placement/simulate.py --write-profile "
            "benchmarks/placement/field_report_profile.json",
        },
    )


CLUSTERS = ["128xa100,128xh100", "192xa100,64xh100", "64xa100,192xh100", "8xa100,8xh100"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-profile", help="write the analytic profile to this path and exit")
    ap.add_argument("--profile", default=PROFILE)
    ap.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    ap.add_argument("--markdown", action="store_true", help="print comparison tables as markdown")
    args = ap.parse_args(argv)
    if args.write_profile:
        build_profile().save(args.write_profile)
        print(f"wrote {args.write_profile}")
        return 0
    profile = CostProfile.load(args.profile)
    for title, precision in (("precision follows the device (fp8 on H100)", None), ("bf16 everywhere", "bf16-mixed")):
        for spec in CLUSTERS:
            sim = simulate_cluster(profile, spec, global_batch=args.global_batch, precision=precision)
            print(f"\n### {spec}, {title}, global batch {args.global_batch}\n")
            print("```")
            print(sim.auto.format_table())
            print("```\n")
            print(sim.comparison_table(markdown=args.markdown))
    print("\nAssumptions (predictions, not measurements):")
    for a in [
        *ASSUMPTIONS,
        "link 25 GB/s per device (200 Gb/s InfiniBand) for stage boundaries and gradient all-reduce, not overlapped",
    ]:
        print(f"- {a}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
