"""Damaged checkpoints: which kinds of damage resume detects, where it falls back, what it keeps.

For each kind of damage in ``tests/ckpt_workers/damage.py``: three checkpoints (``step-1..3``) of a
state with tensors and JSON entries are saved by ``save_sharded`` into a fresh directory, the
newest is damaged, and resume's own path runs on it: :func:`lightning_hpp.checkpoint.resume.select_and_load`
with ``resume="auto"`` (scan on rank 0, sha256 of every file, load, fall back on damage), loading
with ``load_sharded``. Then the run goes on: a new ``step-3`` is saved with ``Retention(keep_last=1)``.

Columns: *sizes alone* is whether the first release's check (``verify(checksums=False)``: presence
and sizes) already refused it; *detected*: a warning line names the checkpoint and the damage;
*fallback*: the step loaded, and whether the loaded values equal that step's saved state;
*preserved*: whether the damaged files still exist byte for byte after the new save and retention,
and where.

Usage::

    python benchmarks/checkpoint/damage.py            # prints the Markdown table
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning_hpp.checkpoint import CheckpointWarning, Retention, load_sharded, save_sharded, verify
from lightning_hpp.checkpoint.resume import PendingResume, select_and_load
from lightning_hpp.checkpoint.discovery import CORRUPT_DIR
from lightning_hpp.checkpoint.storage import checkpoint_url
from lightning_hpp.errors import CorruptCheckpointError
from tests.ckpt_workers.damage import DAMAGES, digest


def state(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {
        "model": {"enc.weight": torch.randn(64, 32, generator=gen), "head.weight": torch.randn(8, 64, generator=gen)},
        "loops": {"fit_loop": {"epoch": step // 4, "batch": step % 4}, "note": f"saved at {step}"},
        "global_step": step,
    }


def template() -> dict:
    return {
        "model": {"enc.weight": torch.zeros(64, 32), "head.weight": torch.zeros(8, 64)},
        "loops": None,
        "global_step": None,
    }


def equal(loaded: dict, step: int) -> bool:
    ref = state(step)
    return (
        all(torch.equal(loaded["model"][k], v) for k, v in ref["model"].items())
        and loaded["loops"] == ref["loops"]
        and loaded["global_step"] == step
    )


def trial(name: str, damage, work: Path) -> dict:
    root = work / "ckpt"
    for step in (1, 2, 3):
        save_sharded(state(step), checkpoint_url(str(root), step), step=step)
    newest = root / "step-3"
    damage(newest)
    damaged = digest(newest)
    try:
        verify(str(newest), checksums=False)
        sizes_alone = False
    except CorruptCheckpointError:
        sizes_alone = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        chosen = select_and_load(
            PendingResume(str(root), roots=[str(root)], what="resume='auto'"), lambda url: load_sharded(url, template())
        )
        lines = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
        # the run goes on from the checkpoint it loaded and saves step-3 again, keeping the last one
        save_sharded(
            state(3),
            checkpoint_url(str(root), 3),
            step=3,
            retention=Retention(keep_last=1),
            protect=[chosen.url] if chosen else [],
        )
    url = f"{root}/step-3"
    line = next((x for x in lines if url in x), "")
    reason = line.replace(f"Skipping checkpoint '{url}': ", "").replace(f"Skipping '{url}': ", "")
    reason = reason.replace(f"'{url}': ", "").replace(f" of '{url}'", "").split(" Moved it")[0]
    kept_at = [p for p in (root / CORRUPT_DIR / "step-3", newest) if p.is_dir() and digest(p) == damaged]
    return {
        "damage": name,
        "sizes alone": "refused" if sizes_alone else "**missed**",
        "detected": "yes" if line else "**no**",
        "line": reason,
        "fallback": (
            f"step-{chosen.info.step}" + ("" if equal(chosen.loaded, chosen.info.step) else " (**wrong values**)")
        )
        if chosen
        else "none",
        "preserved": f"yes, {kept_at[0].relative_to(root)}/" if kept_at else "no (overwritten by the new save)",
    }


def main() -> None:
    rows = []
    for name, damage in DAMAGES.items():
        work = Path(tempfile.mkdtemp(prefix="ckpt-damage-"))
        try:
            rows.append(trial(name, damage, work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    cols = ["damage", "sizes alone", "detected", "fallback", "preserved", "line"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]).replace("|", "\\|") for c in cols) + " |")
    print(
        f"\n{sum(r['detected'] == 'yes' for r in rows)} of {len(rows)} kinds detected; "
        f"{sum(r['sizes alone'] == 'refused' for r in rows)} of them by sizes alone."
    )


if __name__ == "__main__":
    main()
