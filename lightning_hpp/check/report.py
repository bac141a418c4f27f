"""A pipeline run's records against the reference's, rank by rank, and the report a user reads.

The reference of a layout with ``dp`` replicas is Lightning's DDP with ``dp`` processes (one process for
``dp = 1``): each pipeline rank is compared with the DDP process of its replica, which drew the same batches
(both shard the data with Lightning's ``DistributedSampler``) and computed what its replica computes.
"""

from __future__ import annotations

from lightning_hpp.check.compare import diff_data, diff_hooks

_METRICS = (("callback", "callback_metrics"), ("logged", "logged_metrics"), ("progress", "progress_bar_metrics"))


def differences(layout: str, dp: int, ranks: dict[int, dict], reference: dict[int, dict]) -> list[tuple[str, str, str]]:
    """``(where, what, how)`` for everything a pipeline rank recorded that differs from its replica's reference."""
    found: list[tuple[str, str, str]] = []

    def add(where: str, what: str, pairs: list[tuple[str, str]]) -> None:
        found.extend((where, f"{what}{path}", how) for path, how in pairs)

    for g, got in sorted(ranks.items()):
        ref, where = reference[g % dp], f"{layout} rank {g}"
        for key in ("global_step", "epoch"):
            add(where, key, diff_data(got[key], ref[key]))
        for key, what in _METRICS:
            add(where, what, diff_data(got[key], ref[key]))
        held = {k: v for k, v in got["state"].items()}
        add(where, "parameters", diff_data(held, {k: ref["state"][k] for k in held if k in ref["state"]}))
        extra = sorted(set(held) - set(ref["state"]))
        if extra:
            found.append((where, "parameters", f"holds {extra}, which the reference does not"))
        add(where, "training batches", diff_data(got["steps"], ref["steps"]))
        add(where, "validations", diff_data(got["validations"], ref["validations"]))
        if got["files"] is not None:  # global rank zero's
            add(where, "files", diff_data(got["files"], ref["files"]))
        found.extend((where, "hook calls", problem.split(": ", 1)[1])
                     for problem in diff_hooks(where, got["hooks"], ref["hooks"], local_rank=g))
    for replica in range(dp):
        held = set().union(*(set(r["state"]) for g, r in ranks.items() if g % dp == replica))
        missing = sorted(set(reference[replica]["state"]) - held)
        if missing:
            found.append((f"{layout} replica {replica}", "parameters", f"no rank holds {missing}"))
    return found


def render(results: dict[str, list[tuple[str, str, str]]], limit: int = 60) -> str:
    """``equal`` per layout, or a table of what differs and where."""
    lines = []
    for layout, found in results.items():
        if not found:
            lines.append(f"{layout}: equal to the reference on every rank")
            continue
        lines.append(f"{layout}: {len(found)} difference(s)")
        lines.append("| where | what | difference |")
        lines.append("|---|---|---|")
        lines.extend(f"| {w} | {what} | {how} |" for w, what, how in found[:limit])
        if len(found) > limit:
            lines.append(f"... and {len(found) - limit} more")
    return "\n".join(lines)
