"""Planning at scale: choose a placement for a cluster described on the command line, from a
profile file, and compare its predicted throughput with homogeneous alternatives.

    python -m lightning_hpp.planning.cli --profile profile.json --cluster "128xa100,128xh100" \\
        --global-batch 4096

Everything printed is a prediction of the cost model in :mod:`lightning_hpp.planning.partition`; for
kinds the profile did not measure, costs are scaled by datasheet TFLOP/s, which the output says.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lightning_hpp.errors import PartitionError, PlacementError, PlanError, ProfileError
from lightning_hpp.planning.partition import (
    MODELLED_SCHEDULES,
    Cluster,
    DeviceGroup,
    PartitionResult,
    partition,
    uniform_partition,
)
from lightning_hpp.planning.profile import CostProfile


@dataclass
class Alternative:
    """One row of the comparison: a placement on some cluster, or why there is none.

    Attributes:
        label: What the row is (``"auto, mixed"``, ``"all h100"``, ...).
        cluster: The cluster it runs on.
        result: The placement, or ``None`` when no placement fits.
        reason: Why there is no placement.
    """

    label: str
    cluster: Cluster
    result: PartitionResult | None
    reason: str = ""


@dataclass
class ClusterSimulation:
    """The chosen plan for a cluster and the alternatives it is compared with."""

    cluster: Cluster
    global_microbatches: int
    auto: PartitionResult
    alternatives: list[Alternative] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)

    @property
    def rows(self) -> list[Alternative]:
        return [Alternative("auto (this cluster)", self.cluster, self.auto)] + self.alternatives

    def comparison_table(self, markdown: bool = False) -> str:
        """Predicted throughput of every row relative to the auto plan."""
        base = self.auto.samples_per_s or 1.0 / self.auto.step_ms
        head = ["placement", "devices", "pp x dp", "m", "stage kinds", "step ms", "samples/s", "vs auto"]
        rows = [head]
        for alt in self.rows:
            r = alt.result
            if r is None:
                rows.append([alt.label, alt.cluster.describe(), "-", "-", "-", "-", "-", alt.reason])
                continue
            rate = r.samples_per_s or 1.0 / r.step_ms
            kinds = "/".join(_runs(s.device for s in r.stages))
            rows.append([
                alt.label, alt.cluster.describe(), f"{r.pp_degree} x {r.dp_degree}", str(r.n_microbatches), kinds,
                f"{r.step_ms:.1f}", f"{rate:,.0f}" if r.samples_per_s else "-", f"{rate / base:.2f}x",
            ])
        if markdown:
            lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
            return "\n".join(lines)
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)

    def format(self) -> str:
        lines = [f"cluster: {self.cluster.describe()}; global batch: {self.global_microbatches} micro-batches", ""]
        lines += [self.auto.format_table(), "", "predicted throughput (same global batch):", self.comparison_table()]
        if self.assumptions:
            lines += ["", "assumptions:"] + [f"  - {a}" for a in self.assumptions]
        return "\n".join(lines)


def _runs(items) -> list[str]:
    """Collapse repeats: a100, a100, h100 -> ['2 a100', 'h100']."""
    out: list[list] = []
    for it in items:
        if out and out[-1][0] == it:
            out[-1][1] += 1
        else:
            out.append([it, 1])
    return [k if n == 1 else f"{n} {k}" for k, n in out]


def _precision_for(precision: str | Mapping[str, str] | None, cluster: Cluster):
    if isinstance(precision, Mapping):
        return {k: v for k, v in precision.items() if k in cluster.kinds}
    return precision


def simulate_cluster(
    profile: CostProfile,
    cluster: Cluster | str | Mapping[str, int],
    *,
    global_microbatches: int,
    schedule: str = "1f1b",
    precision: str | Mapping[str, str] | None = None,
    optimizer_factor: float = 3.0,
    pp_degree: int | None = None,
    dp_degree: int | str = "auto",
) -> ClusterSimulation:
    """Plan ``cluster`` and compare it with homogeneous alternatives, all on the same global batch.

    The alternatives are: the uniform cut on the devices the auto plan uses; for a mixed cluster,
    each kind alone (only that part of the cluster); and, for every kind, a homogeneous cluster of
    the same total size. Every alternative gets its own best ``pp`` and ``dp``.

    Args:
        profile: Unit costs.
        cluster: The devices, e.g. ``"128xa100,128xh100"``.
        global_microbatches: Micro-batches per step over all replicas.
        schedule, precision, optimizer_factor: As for :func:`~lightning_hpp.planning.partition.partition`.
        pp_degree, dp_degree: Constraints for the auto plan only (default: searched).

    Returns:
        The simulation; ``format()`` renders it.

    Raises:
        PartitionError: no placement of the requested cluster fits (alternatives that do not fit
            are reported as rows instead).
    """
    cluster = Cluster.parse(cluster)
    if dp_degree == "auto":
        auto = partition(
            profile, cluster, schedule=schedule, dp_degree="auto", global_microbatches=global_microbatches,
            pp_degree=pp_degree, precision=precision, optimizer_factor=optimizer_factor,
        )
    else:
        dp = int(dp_degree)
        if global_microbatches % dp:
            raise PartitionError(f"global_microbatches={global_microbatches} is not divisible by dp_degree={dp}.")
        auto = partition(
            profile, cluster, schedule=schedule, dp_degree=dp, n_microbatches=global_microbatches // dp,
            pp_degree=pp_degree, precision=precision, optimizer_factor=optimizer_factor,
        )
    sim = ClusterSimulation(cluster, global_microbatches, auto)

    used = Cluster([g for g in cluster.groups if any(s.device == g.kind for s in auto.stages)])
    if auto.pp_degree > 1:
        try:
            uni = uniform_partition(
                profile, cluster, auto.pp_degree, stage_kinds=[s.device for s in auto.stages], schedule=schedule,
                n_microbatches=auto.n_microbatches, dp_degree=auto.dp_degree, precision=_precision_for(precision, cluster),
                optimizer_factor=optimizer_factor,
            )
            reason = "" if uni.fits else "does not fit in memory"
            sim.alternatives.append(Alternative("uniform cut, same devices", used, uni if uni.fits else None, reason))
        except PartitionError as err:
            sim.alternatives.append(Alternative("uniform cut, same devices", used, None, str(err)))

    def add(label: str, sub: Cluster) -> None:
        try:
            res = partition(
                profile, sub, schedule=schedule, dp_degree="auto", global_microbatches=global_microbatches,
                precision=_precision_for(precision, sub), optimizer_factor=optimizer_factor,
            )
            sim.alternatives.append(Alternative(label, sub, res))
        except PartitionError as err:
            sim.alternatives.append(Alternative(label, sub, None, "no placement fits" if "memory" in str(err) else str(err)))

    groups = [g for g in cluster.groups if g.count > 0]
    if len(groups) > 1:
        for g in groups:
            add(f"only the {g.kind}", Cluster([g]))
    for g in groups:
        add(f"all {g.kind}", Cluster([DeviceGroup(g.kind, cluster.total, g.memory_bytes, g.link_gbps)]))

    srcs = sorted({s for r in sim.rows if r.result for s in (st.cost_source for st in r.result.stages)})
    sim.assumptions = [f"costs: {s}" for s in srcs]
    sim.assumptions += [
        f"link {g.kind}: {g.link_gbps:g} GB/s per device (boundaries and gradient all-reduce, not overlapped)"
        for g in groups
    ]
    note = profile.meta.get("assumptions")
    if isinstance(note, list):
        sim.assumptions += [str(a) for a in note]
    elif note:
        sim.assumptions.append(str(note))
    return sim


def _parse_precision(text: str | None):
    if text is None:
        return None
    if "=" not in text:
        return text
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        kind, sep, prec = item.partition("=")
        if not sep:
            raise PartitionError(f"--precision entry {item!r} is not KIND=PRECISION (e.g. 'h100=bf16-mixed').")
        out[kind.strip()] = prec.strip()
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightning_hpp.planning.cli",
        description="Choose a pipeline placement from a cost profile for a cluster and predict its throughput.",
    )
    p.add_argument("--profile", required=True, help="cost profile JSON (lightning_hpp.planning.profile.CostProfile)")
    p.add_argument("--cluster", required=True, help="devices, e.g. '128xa100,128xh100' or '2xa100:40' (40 GB)")
    p.add_argument("--global-batch", type=int, help="samples per step over all replicas")
    p.add_argument("--global-microbatches", type=int, help="micro-batches per step over all replicas")
    p.add_argument("--schedule", default="1f1b", help=f"{' or '.join(MODELLED_SCHEDULES)} (default 1f1b)")
    p.add_argument("--dp", default="auto", help="data-parallel degree, or 'auto' (default)")
    p.add_argument("--pp", type=int, help="pipeline degree (default: searched)")
    p.add_argument("--precision", help="one precision for all stages, or per kind: 'a100=bf16-mixed,h100=fp8'")
    p.add_argument("--optimizer-factor", type=float, default=3.0, help="gradient+optimizer bytes per parameter byte (Adam: 3)")
    p.add_argument("--link-gbps", type=float, help="GB/s per device for every kind (default 25)")
    p.add_argument("--no-compare", action="store_true", help="print the chosen plan only")
    p.add_argument("--markdown", action="store_true", help="print the comparison as a markdown table")
    p.add_argument("--save-plan", help="write the chosen stage plan (with predictions) to this JSON file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2 on bad input)."""
    args = build_parser().parse_args(argv)
    try:
        profile = CostProfile.load(args.profile)
        cluster = Cluster.parse(args.cluster, link_gbps=args.link_gbps)
        if args.global_microbatches is not None:
            gm = args.global_microbatches
        elif args.global_batch is not None:
            mb = profile.microbatch_size
            if not mb or args.global_batch % mb:
                raise PartitionError(
                    f"--global-batch {args.global_batch} is not a multiple of the profile's micro-batch size {mb!r}; "
                    f"give a multiple, or --global-microbatches."
                )
            gm = args.global_batch // mb
        else:
            raise PartitionError("Give --global-batch (samples) or --global-microbatches, so plans are compared on the same batch.")
        if args.dp == "auto":
            dp: int | str = "auto"
        elif args.dp.isdigit() and int(args.dp) > 0:
            dp = int(args.dp)
        else:
            raise PartitionError(f"--dp {args.dp!r} must be 'auto' or a positive integer.")
        precision = _parse_precision(args.precision)
        if args.no_compare:
            if dp == "auto":
                result = partition(profile, cluster, schedule=args.schedule, dp_degree="auto", global_microbatches=gm,
                                   pp_degree=args.pp, precision=precision, optimizer_factor=args.optimizer_factor)
            else:
                if gm % dp:
                    raise PartitionError(f"global micro-batches {gm} are not divisible by --dp {dp}.")
                result = partition(profile, cluster, schedule=args.schedule, dp_degree=dp, n_microbatches=gm // dp,
                                   pp_degree=args.pp, precision=precision, optimizer_factor=args.optimizer_factor)
            print(result.format_table())
        else:
            sim = simulate_cluster(profile, cluster, global_microbatches=gm, schedule=args.schedule, precision=precision,
                                   optimizer_factor=args.optimizer_factor, pp_degree=args.pp, dp_degree=dp)
            result = sim.auto
            print(sim.format())
            if args.markdown:
                print()
                print(sim.comparison_table(markdown=True))
        if args.save_plan:
            result.plan.save(args.save_plan)
            print(f"\nstage plan written to {args.save_plan}")
    except (PartitionError, ProfileError, PlacementError, PlanError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
