"""Planning at scale: choose the plan for a cluster described on the command line, from a profile file, and
compare its predicted throughput with homogeneous alternatives.

    lightning-hpp-plan --profile profile.json --cluster "128xa100,128xh100" --global-batch 4096

It answers with the search behind ``plan="auto"`` (:func:`~lightning_hpp.planning.search.search_plan`: the
degrees pp × dp × tp and the sharding of the replicas, the schedule, micro-batches, cuts and kinds) and its cost
model, so ``--save-plan`` writes the plan a running job would choose for the same profile and ranks. For a
structure with more than :data:`~lightning_hpp.planning.solver.EXACT_CUTS` cuts the search starts from the
exact bottleneck cut (a dynamic programme, :func:`~lightning_hpp.planning.solver.bottleneck`) and refines it
locally: that is what answers a cluster of hundreds of devices in seconds. Everything printed is a prediction;
for kinds the profile did not measure, costs are scaled by datasheet TFLOP/s, which the output says.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lightning_hpp.errors import PartitionError, PlacementError, PlanError, ProfileError
from lightning_hpp.planning.cluster import DEFAULT_DEVICES_PER_HOST, Cluster, DeviceGroup
from lightning_hpp.planning.profile import CostProfile
from lightning_hpp.planning.result import PlanResult
from lightning_hpp.planning.search import DATA_PARALLEL_MODES, SEARCHED_SCHEDULES, evaluate_plan, search_plan


@dataclass
class Alternative:
    """One row of the comparison: a plan on some cluster, or why there is none.

    Attributes:
        label: What the row is (``"auto, mixed"``, ``"all h100"``, ...).
        cluster: The cluster it runs on.
        result: The plan, or ``None`` when no plan fits.
        reason: Why there is no plan.
    """

    label: str
    cluster: Cluster
    result: PlanResult | None
    reason: str = ""


@dataclass
class ClusterSimulation:
    """The chosen plan for a cluster and the alternatives it is compared with."""

    cluster: Cluster
    global_batch: int
    auto: PlanResult
    alternatives: list[Alternative] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)

    @property
    def rows(self) -> list[Alternative]:
        return [Alternative("auto (this cluster)", self.cluster, self.auto)] + self.alternatives

    def comparison_table(self, markdown: bool = False) -> str:
        """Predicted throughput of every row relative to the auto plan."""
        base = self.auto.samples_per_s or 1.0 / self.auto.step_ms
        head = ["placement", "devices", "pp x dp x tp", "m", "schedule", "stage kinds", "step ms", "samples/s",
                "vs auto"]
        rows = [head]
        for alt in self.rows:
            r = alt.result
            if r is None:
                rows.append([alt.label, alt.cluster.describe(), "-", "-", "-", "-", "-", "-", alt.reason])
                continue
            rate = r.samples_per_s or 1.0 / r.step_ms
            kinds = "/".join(_runs(s.device for s in r.stages))
            rows.append([
                alt.label, alt.cluster.describe(), f"{r.pp_degree} x {r.dp_degree} x {r.tp_degree}",
                str(r.n_microbatches), r.schedule, kinds, f"{r.step_ms:.1f}",
                f"{rate:,.0f}" if r.samples_per_s else "-", f"{rate / base:.2f}x",
            ])
        if markdown:
            lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
            return "\n".join(lines)
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)

    def format(self) -> str:
        lines = [f"cluster: {self.cluster.describe()}; global batch: {self.global_batch} samples", ""]
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


def plan_cluster(profile: CostProfile, cluster: Cluster | str | Mapping[str, int], *, global_batch: int,
                 devices_per_host: int = DEFAULT_DEVICES_PER_HOST, **constraints) -> PlanResult:
    """The plan ``plan="auto"`` would choose on a job of every device of ``cluster``: :func:`search_plan` on its
    ranks (kind after kind, ``devices_per_host`` to a host), with the global batch of one data group.

    Args:
        profile: Unit costs.
        cluster: The devices, e.g. ``"128xa100,128xh100"``.
        global_batch: Samples per step over all replicas.
        devices_per_host: Devices of one host (a tensor-parallel group stays on one unless ``tp_across_hosts``).
        **constraints: Further keyword arguments of :func:`search_plan` (``pp_degree``, ``tp_degree``,
            ``schedule``, ``data_parallel``, ...).

    Raises:
        PartitionError: no plan fits (the message says why).
    """
    cluster = Cluster.parse(cluster)
    groups = [g for g in cluster.groups if g.count > 0]
    if not groups:
        raise PartitionError(f"The cluster ({cluster.describe()}) has no devices.")
    cluster = Cluster(groups)
    return search_plan(profile, cluster.rank_kinds(), batch_size=global_batch, memory_bytes=cluster.memory_bytes(),
                       link_gbps=min(g.link_gbps for g in groups), hosts=cluster.hosts(devices_per_host), **constraints)


def simulate_cluster(
    profile: CostProfile,
    cluster: Cluster | str | Mapping[str, int],
    *,
    global_batch: int,
    precision: str | Mapping[str, str] | None = None,
    devices_per_host: int = DEFAULT_DEVICES_PER_HOST,
    **constraints,
) -> ClusterSimulation:
    """Plan ``cluster`` and compare it with alternatives, all on the same global batch.

    The alternatives are: the uniform cut at the auto plan's layout (:func:`evaluate_plan`); for a mixed
    cluster, each kind alone (only that part of the cluster); and, for every kind, a homogeneous cluster of the
    same total size. Every alternative gets its own best plan.

    Args:
        profile: Unit costs.
        cluster: The devices, e.g. ``"128xa100,128xh100"``.
        global_batch: Samples per step over all replicas.
        precision: As for :func:`search_plan`.
        devices_per_host: As for :func:`plan_cluster`.
        **constraints: Constraints for the auto plan only (``pp_degree``, ``tp_degree``, ``schedule``, ...).

    Returns:
        The simulation; ``format()`` renders it.

    Raises:
        PartitionError: no plan of the requested cluster fits (alternatives that do not fit are rows instead).
    """
    cluster = Cluster.parse(cluster)
    auto = plan_cluster(profile, cluster, global_batch=global_batch, precision=precision,
                        devices_per_host=devices_per_host, **constraints)
    sim = ClusterSimulation(cluster, global_batch, auto)
    free = {k: constraints[k] for k in ("tp_degree", "data_parallel", "dp_replicate", "tp_across_hosts",
                                        "optimizer_factor") if k in constraints}

    if auto.pp_degree > 1:
        n, S = len(profile.unit_names), len(auto.stages)
        sizes = [n // S + (1 if s < n % S else 0) for s in range(S)]
        bounds = [sum(sizes[:s]) for s in range(S + 1)]
        kinds = [next(st.device for st, r in zip(auto.stages, auto.positions) if r == q) for q in range(auto.pp_degree)]
        try:
            uni = evaluate_plan(
                profile, Cluster(list(cluster.groups)).rank_kinds(),
                [profile.unit_names[bounds[s]:bounds[s + 1]] for s in range(S)], kinds,
                schedule=auto.schedule, n_microbatches=auto.n_microbatches, batch_size=global_batch,
                tp_degree=auto.tp_degree, data_parallel=auto.data_parallel,
                dp_replicate=auto.dp_degree // auto.dp_shard if auto.data_parallel == "hsdp" else None,
                precision=precision, memory_bytes=cluster.memory_bytes(), label="uniform",
                optimizer_factor=constraints.get("optimizer_factor", 3.0),
                link_gbps=min(g.link_gbps for g in cluster.groups))
            sim.alternatives.append(Alternative("uniform cut, same layout", cluster, uni if uni.fits else None,
                                                "" if uni.fits else "does not fit in memory"))
        except PartitionError as err:
            sim.alternatives.append(Alternative("uniform cut, same layout", cluster, None, str(err)))

    def add(label: str, sub: Cluster) -> None:
        try:
            res = plan_cluster(profile, sub, global_batch=global_batch, precision=_precision_for(precision, sub),
                               devices_per_host=devices_per_host, **free)
            sim.alternatives.append(Alternative(label, sub, res))
        except PartitionError as err:
            sim.alternatives.append(Alternative(label, sub, None, "no plan fits" if "memory" in str(err) else str(err)))

    groups = [g for g in cluster.groups if g.count > 0]
    if len(groups) > 1:
        for g in groups:
            add(f"only the {g.kind}", Cluster([g]))
    for g in groups:
        add(f"all {g.kind}", Cluster([DeviceGroup(g.kind, cluster.total, g.memory_bytes, g.link_gbps)]))

    srcs = sorted({s for r in sim.rows if r.result for s in (st.cost_source for st in r.result.stages)})
    sim.assumptions = [f"costs: {s}" for s in srcs]
    sim.assumptions += [f"link {g.kind}: {g.link_gbps:g} GB/s per device where the profile measured none"
                        for g in groups]
    sim.assumptions.append(f"{devices_per_host} devices per host; a tensor-parallel group stays on one host"
                           + (" (here: allowed across hosts)" if constraints.get("tp_across_hosts") else ""))
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


def _parse_degrees(text: str, option: str) -> int | list[int] | None:
    """``auto`` (``None``), one degree, or a comma-separated list of them."""
    if text == "auto":
        return None
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise PartitionError(f"{option} {text!r} must be 'auto', a positive integer or a list of them ('1,2,4').")
    return int(parts[0]) if len(parts) == 1 else [int(p) for p in parts]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-hpp-plan",
        description="Choose the plan (pp x dp x tp, sharding, schedule, micro-batches, cuts, kinds) for a cluster "
                    "from a cost profile and predict its throughput, with the search and cost model of "
                    "plan='auto' (lightning_hpp.planning.search.search_plan): --save-plan writes the plan a job "
                    "on these devices would choose. Layouts with more than 4096 cuts start from the exact "
                    "bottleneck cut (a dynamic programme) and are refined locally: that is what answers a "
                    "256-GPU cluster in seconds.",
    )
    p.add_argument("--profile", required=True, help="cost profile JSON (lightning_hpp.planning.profile.CostProfile)")
    p.add_argument("--cluster", required=True, help="devices, e.g. '128xa100,128xh100' or '2xa100:40' (40 GB)")
    p.add_argument("--global-batch", type=int, help="samples per step over all replicas")
    p.add_argument("--global-microbatches", type=int,
                   help="the global batch in micro-batches of the profile's size (instead of --global-batch)")
    p.add_argument("--schedule", help=f"fix the schedule: {', '.join(SEARCHED_SCHEDULES)} (default: searched)")
    p.add_argument("--microbatches", type=int, help="fix the micro-batches per replica (default: searched)")
    p.add_argument("--pp", type=int, help="fix the pipeline degree (default: searched)")
    p.add_argument("--dp", type=int, help="fix the data-parallel degree (default: searched)")
    p.add_argument("--tp", default="auto", help="tensor-parallel degree(s): 'auto' (the degrees the profile records "
                                                "for the model, else 1; the default), N, or a list '1,2,4'")
    p.add_argument("--data-parallel", default="auto", choices=("auto", *DATA_PARALLEL_MODES),
                   help="how each stage's replicas share it: 'auto' (ddp, fsdp where only it fits; the default)")
    p.add_argument("--dp-replicate", type=int, help="hsdp's replica groups")
    p.add_argument("--devices-per-host", type=int, default=DEFAULT_DEVICES_PER_HOST,
                   help=f"devices of one host (default {DEFAULT_DEVICES_PER_HOST}): a tp group stays on one")
    p.add_argument("--tp-across-hosts", action="store_true", help="let a tensor-parallel group span hosts")
    p.add_argument("--precision", help="one precision for all stages, or per kind: 'a100=bf16-mixed,h100=fp8'")
    p.add_argument(
        "--optimizer-factor", type=float, default=3.0, help="gradient+optimizer bytes per parameter byte (Adam: 3)"
    )
    p.add_argument("--link-gbps", type=float, help="GB/s per device where the profile measured none (default 25)")
    p.add_argument("--no-compare", action="store_true", help="print the chosen plan only")
    p.add_argument("--markdown", action="store_true", help="print the comparison as a markdown table")
    p.add_argument("--save-plan", help="write the chosen stage plan (with predictions) to this JSON file")
    return p


def constraints_of(args: argparse.Namespace) -> dict:
    """The :func:`search_plan` constraints the command line fixes."""
    if args.data_parallel == "hsdp" and args.dp_replicate is None:
        raise PartitionError("--data-parallel hsdp needs --dp-replicate (its number of replica groups).")
    return {
        "schedule": args.schedule,
        "n_microbatches": args.microbatches,
        "pp_degree": args.pp,
        "dp_degree": args.dp,
        "tp_degree": _parse_degrees(args.tp, "--tp"),
        "data_parallel": None if args.data_parallel == "auto" else args.data_parallel,
        "dp_replicate": args.dp_replicate,
        "tp_across_hosts": args.tp_across_hosts,
        "optimizer_factor": args.optimizer_factor,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2 on bad input)."""
    args = build_parser().parse_args(argv)
    try:
        profile = CostProfile.load(args.profile)
        cluster = Cluster.parse(args.cluster, link_gbps=args.link_gbps)
        if args.global_batch is not None:
            batch = args.global_batch
        elif args.global_microbatches is not None:
            if not profile.microbatch_size:
                raise PartitionError("--global-microbatches needs the profile's micro-batch size; give --global-batch.")
            batch = args.global_microbatches * profile.microbatch_size
        else:
            raise PartitionError(
                "Give --global-batch (samples) or --global-microbatches, so plans are compared on the same batch."
            )
        constraints = constraints_of(args)
        precision = _parse_precision(args.precision)
        if args.no_compare:
            result = plan_cluster(
                profile,
                cluster,
                global_batch=batch,
                precision=precision,
                devices_per_host=args.devices_per_host,
                **constraints,
            )
            print(result.format_table())
        else:
            sim = simulate_cluster(
                profile,
                cluster,
                global_batch=batch,
                precision=precision,
                devices_per_host=args.devices_per_host,
                **constraints,
            )
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
