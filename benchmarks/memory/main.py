"""Per-rank peak memory under a per-rank memory cap: HPPStrategy pp=4 (meta path, with and without
activation checkpointing), the non-meta path and DDP, on MLPs 1×, 2× and 4× the cap.

Model: ``--blocks`` × ``nn.Sequential(nn.Linear(W, W), nn.ReLU())`` and a ``Linear(W, 10)`` head in
one ``nn.Sequential`` (``self.model``), cross-entropy on random data, fp32, SGD (momentum 0.9 by
default: parameters + gradients + momentum = 3 × 4 bytes per parameter), ``--steps`` steps of a
fixed global batch (``--batch``; HPPStrategy: ``--m`` micro-batches, 1F1B; DDP: batch / 4 per rank).

The cap. ``C`` is the training footprint (parameters + gradients + optimizer state) of the smallest
model (``--blocks-1x``); the other sizes are ``--scales`` × C (default 1, 2, 4). Every rank runs in
its own cgroup-v1 memory group with ``memory.limit_in_bytes = B + (1 + headroom) × C``, where ``B`` is
the measured idle baseline of one process (torch + Lightning + lightning_hpp imported, cgroup
charge). The 4× model cut into 4 equal stages puts exactly C of state on every rank; the headroom
(default 25% of C) is what it has for activations, buffers and the runtime.

Configurations per size, each in 4 fresh processes (one launch per configuration):

* ``hpp``       — ``HPPStrategy`` pp=4, 1F1B, model built in ``configure_model()`` (meta path);
* ``hpp_ckpt``  — the same with ``activation_checkpointing=True``;
* ``hpp_eager`` — the same HPPStrategy, model built in ``__init__`` (non-meta path: whole on every rank);
* ``ddp``       — Lightning ``DDPStrategy`` (gloo, defaults), model built in ``__init__``;
* ``hpp_probe`` — diagnostic: ``hpp`` plus ``optimizer.zero_grad(set_to_none=True)`` in
  ``on_train_batch_start``, which shows what the previous step's gradients, held by
  ``GradHandover.during_step`` across the schedule, cost (README, finding 1);
* ``pp2_ddp``   — ``HPPStrategy`` pp=2 × 2 whole replicas per stage (meta path);
* ``pp2_fsdp``  — pp=2 × ``ShardingOptions(data_parallel="fsdp")``: each stage sharded over its 2 replicas
  (FSDP2, gathered once per step: ``reshard_after_forward`` defaults to False);
* ``pp2_fsdp_raf`` — the same with ``reshard_after_forward=True`` (blocks freed after each forward; with
  several micro-batches the stage's gradients are whole and its blocks gathered when its last backward starts);
* ``fsdp``      — pp=1 × fsdp 4, ``reshard_after_forward=True``: FSDP alone (Lightning's FSDPStrategy
  refuses CPU, so FSDP2 runs through HPPStrategy's one-stage path), ``--m`` micro-batches a step;
* ``fsdp_m1``   — the same with one micro-batch a step (the whole batch at once, as FSDP alone runs): the
  stage's last backward reshards block by block, so one block is gathered at a time, as in ``fsdp_plain``;
* ``fsdp_plain`` — FSDP2 as users run it alone, outside pipelining and outside Lightning:
``init_process_group("gloo")``,
  the MLP built on the meta device, ``fully_shard(block, reshard_after_forward=True)`` per block and then on the root,
  ``to_empty`` + the initializers HPPStrategy's materialization runs (the same weights), ``--optimizer``, and
  ``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)`` on the rank's batch / 4.

``--optimizer adam`` trains with Adam (two moments: 16 bytes a parameter with its gradient).

Each rank process joins its own group as the first thing it does (``join_group``: the group of
``LOCAL_RANK``, so it works the same under Lightning's own launcher, which re-runs the script per
rank with ``LOCAL_RANK`` set; here the benchmark starts the 4 ranks itself, as
``benchmarks/throughput`` does, so that it gets every rank's exit status and ``ru_maxrss`` from
``wait4``). Per rank: the group's ``memory.max_usage_in_bytes`` (the peak over the whole run, setup
included), ``memory.failcnt``, the OOM-kill count of ``memory.oom_control``, the exit status and
``ru_maxrss``; and the predicted footprint of its stage (see :func:`predict`).

Usage::

    python benchmarks/memory/main.py                          # ~6-8 minutes on 2 cores
    python benchmarks/memory/main.py --scales 1 4 --configs hpp ddp --steps 3 --out /tmp/mem
    python benchmarks/memory/main.py --optimizer adam --configs pp2_ddp pp2_fsdp pp2_fsdp_raf fsdp ddp \
        --malloc-mmap-threshold 1048576 --out benchmarks/memory/results/sharded   # the sharded table
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
GROUP_ENV = "HPP_MEM_CGROUP"  # path prefix of the rank groups; a rank joins f"{prefix}{LOCAL_RANK}"
CONFIGS = ("hpp", "hpp_ckpt", "hpp_eager", "ddp", "hpp_probe", "pp2_ddp", "pp2_fsdp", "pp2_fsdp_raf", "fsdp", "fsdp_m1",
           "fsdp_plain")
# the sharded configurations: (pipeline stages, ShardingOptions) on the 4 ranks; the others are pp=4 (hpp*) or DDP
SHARDED = {
    "pp2_ddp": (2, {"data_parallel": "ddp"}),
    "pp2_fsdp": (2, {"data_parallel": "fsdp"}),
    "pp2_fsdp_raf": (2, {"data_parallel": "fsdp", "reshard_after_forward": True}),
    "fsdp": (1, {"data_parallel": "fsdp", "reshard_after_forward": True}),
    "fsdp_m1": (1, {"data_parallel": "fsdp", "reshard_after_forward": True}),  # and one micro-batch a step
    "fsdp_plain": (1, {"data_parallel": "fsdp", "reshard_after_forward": True}),  # FSDP2 alone (plain_fsdp_worker)
}
ONE_MICROBATCH = ("fsdp_m1", "fsdp_plain")  # FSDP as FSDP runs alone: the whole batch in one forward and backward
LABELS = {
    "hpp": "HPP pp=4, meta (configure_model)",
    "hpp_ckpt": "HPP pp=4, meta + activation ckpt",
    "hpp_eager": "HPP pp=4, non-meta (__init__)",
    "ddp": "DDP ×4 (__init__)",
    "hpp_probe": "probe: HPP meta, .grad freed before each step",
    "pp2_ddp": "HPP pp=2 × ddp 2 (meta)",
    "pp2_fsdp": "HPP pp=2 × fsdp 2 (meta)",
    "pp2_fsdp_raf": "HPP pp=2 × fsdp 2, reshard_after_forward (meta)",
    "fsdp": "HPP pp=1 × fsdp 4, reshard_after_forward (meta)",
    "fsdp_m1": "HPP pp=1 × fsdp 4, reshard_after_forward, m=1 (meta)",
    "fsdp_plain": "FSDP2 alone × 4, reshard_after_forward (meta, no Lightning)",
}
SHORT = {
    "hpp": "HPP\nmeta",
    "hpp_ckpt": "HPP meta\n+ ckpt",
    "hpp_eager": "HPP\nnon-meta",
    "ddp": "DDP",
    "hpp_probe": "probe:\ngrads freed",
    "pp2_ddp": "pp2 ×\nddp2",
    "pp2_fsdp": "pp2 ×\nfsdp2",
    "pp2_fsdp_raf": "pp2 × fsdp2\nreshard",
    "fsdp": "fsdp4",
    "fsdp_m1": "fsdp4\nm=1",
    "fsdp_plain": "FSDP2\nalone",
}
CLASSES = 10
MB = 2**20


# ============================================================================================ model and prediction
def model_bytes(width: int, blocks: int) -> dict[str, int]:
    """fp32 parameter bytes of one block and of the head."""
    return {"block": 4 * (width * width + width), "head": 4 * (width * CLASSES + CLASSES)}


def optimizer_states(optimizer: str, momentum: float) -> int:
    """Optimizer tensors per parameter: Adam's two moments, SGD's momentum buffer (none without momentum)."""
    return 2 if optimizer == "adam" else (1 if momentum else 0)


def footprint(width: int, blocks: int, momentum: float, optimizer: str = "sgd") -> int:
    """Training footprint of the whole model: parameters + gradients + optimizer state."""
    b = model_bytes(width, blocks)
    params = blocks * b["block"] + b["head"]
    return params * (2 + optimizer_states(optimizer, momentum))


def stage_blocks(blocks: int, pp: int, stage: int) -> range:
    k = blocks // pp
    return range(stage * k, (stage + 1) * k)


def predict(cfg: str, blocks: int, rank: int, job: dict[str, Any]) -> dict[str, int]:
    """Predicted bytes this rank holds at its peak: parameters + gradients + optimizer state + activations.

    Activations are counted per tensor autograd (and torch pipelining) keeps, in units of one
    micro-batch activation ``a = mb × W × 4`` bytes (``mb`` = batch / m; DDP: the per-rank batch):

    * a ``Linear → ReLU`` block keeps one tensor: ReLU saves its output, which is also the next
      Linear's saved input (the pre-ReLU output is freed at once); so a stage of ``k`` blocks keeps
      ``k·a`` per micro-batch in flight, and 1F1B has ``f = min(m, pp - s)`` in flight on stage ``s``;
    * stage inputs: ``m·a`` — stage 0 holds the whole batch, a later stage torch pipelining's ``m``
      forward receive buffers (allocated per micro-batch, kept across steps); stages before the last
      also keep ``m·a`` of gradient receive buffers;
    * in the backward ``2a`` transient (the gradients of a unit's output and input); with activation
      checkpointing ``2a`` more for the one unit being recomputed. Per-unit checkpointing saves each
      unit's input, which for these one-tensor blocks is what the blocks kept anyway: it changes the
      count by nothing but the recompute;
    * the head's logits (mb × 10) are left out (< 1 KB).

    DDP: the whole model and ``(blocks + 1)·a + 2a`` with ``a`` of the per-rank batch; DDP's own
    gradient buckets (another gradient-sized buffer by default) are *not* in the prediction.
    """
    w, m, pp, n = job["width"], job["m"], job["pp"], job["ranks"]
    b = model_bytes(w, blocks)
    states = optimizer_states(job.get("optimizer", "sgd"), job["momentum"])
    if cfg in SHARDED:
        return predict_sharded(cfg, blocks, rank, job, states)
    if cfg == "ddp":
        params = blocks * b["block"] + b["head"]
        a = (job["batch"] // n) * w * 4
        act = (blocks + 1) * a + 2 * a
    else:
        k = len(stage_blocks(blocks, pp, rank))
        params = k * b["block"] + (b["head"] if rank == pp - 1 else 0)
        a = (job["batch"] // m) * w * 4
        f = min(m, pp - rank)
        act = f * k * a + m * a + (m * a if rank < pp - 1 else 0) + 2 * a + (2 * a if cfg == "hpp_ckpt" else 0)
    opt = params * states
    return {"params": params, "grads": params, "optimizer": opt, "activations": act, "total": 2 * params + opt + act}


def predict_sharded(cfg: str, blocks: int, rank: int, job: dict[str, Any], states: int) -> dict[str, int]:
    """The sharded configurations: ``pp`` stages × ``dp = 4 / pp`` replicas (rank ``r`` holds position ``r // dp``).

    Parameters, gradients and optimizer state per rank are the stage's ``/ dp`` under FSDP (whole under
    ddp); while a step runs FSDP2 holds ``gathered`` bytes as well (``lightning_hpp.planning.memory``:
    the whole stage's parameters and gradients with several micro-batches; with one, the parameters and one
    block's gradients, or two blocks' worth with ``reshard_after_forward``). Activations as :func:`predict`'s
    1F1B count, with ``a`` of a micro-batch of the replica's batch. ``fsdp_plain`` (pp=1, m=1, no pipelining)
    is the same count: a quarter of the state, one block's parameters and gradients gathered at a time, and
    DDP's ``(blocks + 1)·a + 2a`` of the rank's batch / 4.
    """
    from lightning_hpp.planning.memory import gathered_bytes

    pp, options = SHARDED[cfg]
    w, m, n = job["width"], job["m"], job["ranks"]
    dp = n // pp
    s = rank // dp
    b = model_bytes(w, blocks)
    k = len(stage_blocks(blocks, pp, s))
    stage = k * b["block"] + (b["head"] if s == pp - 1 else 0)
    shards = dp if options["data_parallel"] == "fsdp" else 1
    raf = bool(options.get("reshard_after_forward"))
    gathered = int(
        gathered_bytes(stage, shards, n_microbatches=m, reshard_after_forward=raf, largest_unit_bytes=b["block"])
    )
    a = (job["batch"] // dp // m) * w * 4
    act = min(m, pp - s) * k * a + m * a + (m * a if s < pp - 1 else 0) + 2 * a
    local = stage // shards
    opt = local * states
    return {"params": local, "grads": local, "optimizer": opt, "gathered": gathered, "activations": act,
            "total": 2 * local + opt + gathered + act}


# ============================================================================================ cgroups
def _read(path: Path) -> str:
    return path.read_text().strip()


def group_stats(group: Path) -> dict[str, Any]:
    """The memory group's peak, current usage, failcnt and OOM-kill count."""
    oom = dict(line.split() for line in _read(group / "memory.oom_control").splitlines())
    stat = dict(line.split() for line in _read(group / "memory.stat").splitlines())
    return {
        "max_usage": int(_read(group / "memory.max_usage_in_bytes")),
        "usage": int(_read(group / "memory.usage_in_bytes")),
        "failcnt": int(_read(group / "memory.failcnt")),
        "oom_kill": int(oom.get("oom_kill", 0)),
        "cache_left": int(stat.get("total_cache", 0)),
    }


class RankGroups:
    """One cgroup-v1 memory group per rank, ``<root>/hpp_mem_<pid>_<tag>_rank<r>``, removed on exit.

    Args:
        tag: Part of the group names.
        n: Ranks.
        limit: ``memory.limit_in_bytes`` of every group (``None``: no limit).
    """

    def __init__(self, tag: str, n: int, limit: int | None) -> None:
        self.prefix = str(CGROUP_ROOT / f"hpp_mem_{os.getpid()}_{tag}_rank")
        self.groups = [Path(f"{self.prefix}{r}") for r in range(n)]
        self.limit = limit
        self.made: list[Path] = []

    def __enter__(self) -> RankGroups:  # noqa: PYI034
        try:
            for g in self.groups:
                g.mkdir()
                self.made.append(g)
                if self.limit is not None:
                    (g / "memory.limit_in_bytes").write_text(str(self.limit))
                try:  # what a rank allocated before it joined moves with it (deprecated, may be absent)
                    (g / "memory.move_charge_at_immigrate").write_text("3")
                except OSError:
                    pass
        except BaseException:
            self.__exit__()
            raise
        return self

    def stats(self) -> list[dict[str, Any]]:
        return [group_stats(g) for g in self.groups]

    def __exit__(self, *exc: object) -> None:
        for g in reversed(self.made):
            for attempt in range(50):
                try:
                    g.rmdir()
                    break
                except OSError as err:
                    if attempt == 49:
                        left = (g / "cgroup.procs").read_text().split() if g.exists() else []
                        print(f"warning: could not remove {g}: {err} (processes left: {left})", file=sys.stderr)
                    time.sleep(0.1)
        self.made = []


def join_group() -> str | None:
    """Join this rank's memory group (``$HPP_MEM_CGROUP`` + ``$LOCAL_RANK``); call before importing torch."""
    prefix = os.environ.get(GROUP_ENV)
    if not prefix:
        return None
    group = f"{prefix}{int(os.environ.get('LOCAL_RANK', '0'))}"
    with open(f"{group}/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))
    return group


# ============================================================================================ rank side
class Progress:
    """The rank's record, rewritten at every phase: what the group held then, and where it got to.

    A rank the OOM killer ends leaves its last phase behind, which says where it was killed.
    """

    def __init__(self, path: Path, group: str | None) -> None:
        self.path = path
        self.group = Path(group) if group else None
        self.t0 = time.time()
        self.data: dict[str, Any] = {"phases": []}

    def mark(self, phase: str, **extra: Any) -> None:
        import resource

        entry: dict[str, Any] = {"phase": phase, "t": round(time.time() - self.t0, 2),
                                 "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if self.group is not None:
            entry["usage_mb"] = int(_read(self.group / "memory.usage_in_bytes")) / MB
            entry["max_usage_mb"] = int(_read(self.group / "memory.max_usage_in_bytes")) / MB
        self.data["phases"].append(entry)
        self.data.update(extra)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        tmp.replace(self.path)


def baseline_worker(out: str) -> None:
    """An idle rank: torch, Lightning and lightning_hpp imported, one thread; its group's charge is the baseline."""
    group = join_group()
    import resource

    import lightning.pytorch  # noqa: F401
    import torch

    import lightning_hpp  # noqa: F401

    torch.set_num_threads(1)
    torch.ones(1).add_(1)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    Path(out, f"baseline_rank{rank}.json").write_text(json.dumps({
        "group": group, "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "usage_mb": int(_read(Path(group) / "memory.usage_in_bytes")) / MB if group else None}))


def build_mlp(width: int, blocks: int) -> Any:
    from torch import nn

    return nn.Sequential(
        *(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)), nn.Linear(width, CLASSES)
    )


def lightning_module(job: dict[str, Any], in_configure_model: bool) -> Any:
    import lightning as L
    import torch
    import torch.nn.functional as F

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None if in_configure_model else build_mlp(job["width"], job["blocks"])

        def configure_model(self) -> None:
            if self.model is None:  # HPPStrategy runs this on the meta device
                self.model = build_mlp(job["width"], job["blocks"])

        def forward(self, x):
            return self.model(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self):
            if job.get("optimizer") == "adam":
                return torch.optim.Adam(self.parameters(), lr=job["lr"])
            return torch.optim.SGD(self.parameters(), lr=job["lr"], momentum=job["momentum"])

    return MLP()


def worker(job: dict[str, Any]) -> None:
    group = join_group()  # before torch is imported: everything the rank ever allocates is charged to it
    rank = int(os.environ["LOCAL_RANK"])
    progress = Progress(Path(job["out"]) / f"rank{rank}.json", group)
    import warnings
    from datetime import timedelta

    import lightning as L
    import torch
    from lightning.pytorch import Callback
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hpp import HPPPrecision, HPPStrategy, StagePlan

    torch.set_num_threads(1)
    os.chdir(job["out"])  # stage_plan.json, fingerprints.json
    progress.mark("imported")
    cfg = job["cfg"]
    torch.manual_seed(0)
    if cfg == "fsdp_plain":
        plain_fsdp_worker(job, rank, progress)
        return
    model = lightning_module(job, in_configure_model=cfg in ("hpp", "hpp_ckpt", "hpp_probe", *SHARDED))
    progress.mark("model built" if model.model is not None else "module built (model in configure_model)")

    if cfg == "ddp":
        strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=job["timeout"]))
        per_rank = job["batch"] // job["ranks"]
    elif cfg in SHARDED:
        pp, sharding = SHARDED[cfg]
        k = job["blocks"] // pp
        plan = StagePlan.split_at([f"model.{s * k}" for s in range(1, pp)]) if pp > 1 else None
        warnings.filterwarnings("ignore", message="NaN/Inf in the", category=RuntimeWarning)
        strategy = HPPStrategy(plan=plan, pp_degree=pp, schedule="1f1b", n_microbatches=job["m"], sharding=sharding,
                               timeout=job["timeout"], precision_plugin=HPPPrecision(nonfinite="warn"))
        per_rank = job["batch"] // (job["ranks"] // pp)
    else:
        k = job["blocks"] // job["pp"]
        plan = StagePlan.split_at([f"model.{s * k}" for s in range(1, job["pp"])])
        # torch's shape inference runs a stage once on uninitialized tensors; as in benchmarks/throughput,
        # the non-finite guard warns instead of raising on that garbage
        warnings.filterwarnings("ignore", message="NaN/Inf in the", category=RuntimeWarning)
        strategy = HPPStrategy(
            plan=plan,
            schedule="1f1b",
            n_microbatches=job["m"],
            activation_checkpointing=cfg == "hpp_ckpt",
            timeout=job["timeout"],
            precision_plugin=HPPPrecision(nonfinite="warn"),
        )
        per_rank = job["batch"]

    class Record(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.step_s: list[float] = []
            self._t = 0.0

        def on_fit_start(self, trainer, pl_module):
            progress.mark("setup done (cut, materialized, optimizer built)")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if cfg == "hpp_probe":  # what Lightning's zero_grad does before backward, done before the step instead
                for opt in trainer.optimizers:
                    opt.zero_grad(set_to_none=True)
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.step_s.append(time.perf_counter() - self._t)
            self.losses.append(float(outputs["loss"]))
            progress.mark(f"step {batch_idx + 1}")

    record = Record()
    g = torch.Generator().manual_seed(0)
    n = job["steps"] * job["batch"]
    data = TensorDataset(torch.randn(n, job["width"], generator=g), torch.randint(0, CLASSES, (n,), generator=g))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=job["ranks"],
        strategy=strategy,
        max_steps=job["steps"],
        callbacks=[record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=job["out"],
    )
    trainer.fit(model, DataLoader(data, batch_size=per_rank, drop_last=True))

    params = [p for p in model.parameters() if not p.is_meta]
    opt = trainer.optimizers[0]
    def local(t):  # a DTensor's bytes on this rank
        t = getattr(t, "_local_tensor", t)
        return t.numel() * t.element_size()

    state_bytes = sum(local(t) for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    progress.mark("done", losses=record.losses, step_s=record.step_s,
                  stages=list(getattr(trainer.strategy, "_stage_ids", [])) or "all",
                  param_bytes=sum(local(p) for p in params),
                  grad_bytes=sum(local(p.grad) for p in params if p.grad is not None),
                  optimizer_state_bytes=state_bytes,
                  meta_params_left=sum(p.is_meta for p in model.parameters()))


def plain_fsdp_worker(job: dict[str, Any], rank: int, progress: Progress) -> None:
    """``fsdp_plain``: FSDP2 on its own, as a user runs it without pipelining and without Lightning (whose
    FSDPStrategy refuses CPU), on the launcher's ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``."""
    import zlib
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_hpp.model.materialize import _whole

    dist.init_process_group("gloo", timeout=timedelta(seconds=job["timeout"]))
    mesh = init_device_mesh("cpu", (job["ranks"],))
    with torch.device("meta"):  # the same LightningModule, used as a plain module: its MLP and its optimizer
        module = lightning_module(job, in_configure_model=False)
    progress.mark("model built on meta")
    mlp = module.model
    for block in list(mlp)[:-1]:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(mlp, mesh=mesh, reshard_after_forward=True)  # the root: the head
    mlp.to_empty(device="cpu")
    # the initial values HPPStrategy's materialization gives (lightning_hpp.model.materialize): each module's
    # reset_parameters on the whole tensor, seeded by its name, each rank keeping its shard
    with torch.no_grad():
        for name, mod in module.named_modules():
            if hasattr(mod, "reset_parameters") and any(True for _ in mod.parameters(recurse=False)):
                torch.manual_seed(zlib.crc32(name.encode()) % 2**63)
                with _whole(mod):
                    mod.reset_parameters()
    opt = module.configure_optimizers()
    progress.mark("setup done (cut, materialized, optimizer built)")

    g = torch.Generator().manual_seed(0)
    n = job["steps"] * job["batch"]
    data = TensorDataset(torch.randn(n, job["width"], generator=g), torch.randint(0, CLASSES, (n,), generator=g))
    sampler = DistributedSampler(data, num_replicas=job["ranks"], rank=rank, shuffle=False)  # what Lightning's DDP adds
    losses: list[float] = []
    step_s: list[float] = []
    for i, (x, y) in enumerate(
        DataLoader(data, batch_size=job["batch"] // job["ranks"], sampler=sampler, drop_last=True)
    ):
        t = time.perf_counter()
        loss = F.cross_entropy(mlp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
        progress.mark(f"step {i + 1}")

    def local(t):  # a DTensor's bytes on this rank
        t = getattr(t, "_local_tensor", t)
        return t.numel() * t.element_size()

    params = list(mlp.parameters())
    state_bytes = sum(local(t) for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    progress.mark(
        "done",
        losses=losses,
        step_s=step_s,
        stages="all",
        param_bytes=sum(local(p) for p in params),
        grad_bytes=sum(local(p.grad) for p in params if p.grad is not None),
        optimizer_state_bytes=state_bytes,
        meta_params_left=sum(p.is_meta for p in params),
    )
    dist.destroy_process_group()


# ============================================================================================ launcher side
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(extra: dict[str, str]) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        **extra,
    }


def supervise(procs: list[subprocess.Popen], timeout: float, grace: float) -> list[dict[str, Any]]:
    """Reap every rank with ``wait4`` (exit status and ``ru_maxrss``, killed ranks included).

    After the first rank fails the others get ``grace`` seconds to end on their own (a rank whose
    peer died fails in its next collective; with the model built in ``__init__`` each rank meets
    its own cap); then, or after ``timeout``, the benchmark kills the survivors (its own children).
    """
    t0 = time.time()
    out: list[dict[str, Any] | None] = [None] * len(procs)
    first_fail: float | None = None
    stopped: set[int] = set()
    while any(o is None for o in out):
        for r, p in enumerate(procs):
            if out[r] is not None:
                continue
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid == 0:
                continue
            rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            p.returncode = rc  # reaped here; keep Popen from waiting again
            out[r] = {"rc": rc, "ru_maxrss_mb": usage.ru_maxrss / 1024, "exit_s": round(time.time() - t0, 1),
                      "stopped_by_benchmark": r in stopped}
            if rc != 0 and first_fail is None:
                first_fail = time.time()
        now = time.time()
        late = first_fail is not None and now - first_fail > grace
        if late or now - t0 > timeout:
            for r, p in enumerate(procs):
                if out[r] is None and r not in stopped:
                    stopped.add(r)
                    p.kill()
        time.sleep(0.1)
    return out  # type: ignore[return-value]


def launch(job: dict[str, Any], tag: str, limit: int | None, *, baseline: bool = False,
           script: Path | None = None) -> dict[str, Any]:
    """Start ``job['ranks']`` processes of ``script`` (default this file; ``--worker JOB``), each in its own memory
    group; return what each did."""
    n = job["ranks"]
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(n), "NODE_RANK": "0"}
    args = ["--baseline", str(out)] if baseline else ["--worker", json.dumps(job)]
    with RankGroups(tag, n, limit) as groups:
        procs: list[subprocess.Popen] = []
        logs = []
        try:
            for r in range(n):
                log = open(out / f"rank{r}.log", "w")  # noqa: SIM115  (closed below, also on failure)
                logs.append(log)
                env = _rank_env(
                    {**common, **job.get("env", {}), GROUP_ENV: groups.prefix, "RANK": str(r), "LOCAL_RANK": str(r)}
                )
                procs.append(subprocess.Popen([sys.executable, str(script or Path(__file__).resolve()), *args], env=env,
                                              stdout=log, stderr=subprocess.STDOUT, cwd=out))
            exits = supervise(procs, job.get("run_timeout", 600), job.get("grace", 30))
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()
        stats = groups.stats()
    return {"exits": exits, "groups": stats}


def classify(exits: list[dict[str, Any]], stats: list[dict[str, Any]]) -> list[str]:
    oom_anywhere = any(s["oom_kill"] for s in stats)
    outcome = []
    for e, s in zip(exits, stats):
        if e["rc"] == 0:
            outcome.append("finished")
        elif s["oom_kill"]:
            outcome.append("OOM-killed")
        elif e["stopped_by_benchmark"]:
            outcome.append("stopped (peer OOM-killed)" if oom_anywhere else "stopped (timeout)")
        elif oom_anywhere:
            outcome.append("failed (peer OOM-killed)")
        else:
            outcome.append(f"error (exit {e['rc']})")
    return outcome


def measure_baseline(out: Path, env: dict[str, str]) -> dict[str, Any]:
    """4 idle processes at once, each in its own unlimited group: torch + Lightning + lightning_hpp imported."""
    # warm the page cache from this (unmeasured) process first, so no group is charged for reading libraries
    warm = (
        "import torch, lightning.pytorch, lightning_hpp, torch.distributed.pipelining, torch._subclasses.fake_tensor, "
        "torch.nn.parallel"
    )
    subprocess.run([sys.executable, "-c", warm], env=_rank_env(env), check=True)
    job = {"ranks": 4, "out": str(out / "logs" / "baseline"), "env": env}
    res = launch(job, "baseline", None, baseline=True)
    if any(e["rc"] for e in res["exits"]):
        raise SystemExit(f"the baseline processes failed: {res['exits']}; see {out / 'logs' / 'baseline'}")
    peaks = [s["max_usage"] / MB for s in res["groups"]]
    return {"max_usage_mb": peaks, "ru_maxrss_mb": [e["ru_maxrss_mb"] for e in res["exits"]], "baseline_mb": max(peaks)}


def run_all(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    env = {"MALLOC_MMAP_THRESHOLD_": str(args.malloc_mmap_threshold)} if args.malloc_mmap_threshold else {}
    base = measure_baseline(out, env)
    B = base["baseline_mb"] * MB
    C = footprint(args.width, args.blocks_1x, args.momentum, args.optimizer)
    limit = int(B + (1 + args.headroom) * C)
    print(
        f"baseline B = {B / MB:.0f} MB per process (cgroup charge; ru_maxrss {max(base['ru_maxrss_mb']):.0f} MB); "
        f"cap C = {C / MB:.0f} MB; memory.limit_in_bytes = B + {1 + args.headroom:g}·C = {limit / MB:.0f} MB per rank",
        flush=True,
    )
    runs = []
    for scale in args.scales:
        blocks = args.blocks_1x * scale
        if blocks % args.pp:
            raise SystemExit(
                f"{blocks} blocks do not cut into {args.pp} equal stages; choose --blocks-1x divisible by {args.pp}."
            )
        for cfg in args.configs:
            tag = f"{scale}x_{cfg}"
            job = {
                "cfg": cfg,
                "width": args.width,
                "blocks": blocks,
                "batch": args.batch,
                "m": 1 if cfg in ONE_MICROBATCH else args.m,
                "pp": args.pp,
                "ranks": args.pp,
                "steps": args.steps,
                "lr": args.lr,
                "momentum": args.momentum,
                "optimizer": args.optimizer,
                "timeout": args.timeout,
                "grace": args.grace,
                "run_timeout": args.run_timeout,
                "out": str(out / "logs" / tag),
                "env": env,
            }
            t0 = time.time()
            res = launch(job, tag, limit)
            wall = time.time() - t0
            ranks = []
            for r, (e, s, outcome) in enumerate(
                zip(res["exits"], res["groups"], classify(res["exits"], res["groups"]))
            ):
                rec_path = Path(job["out"]) / f"rank{r}.json"
                rec = json.loads(rec_path.read_text()) if rec_path.exists() else {"phases": []}
                pred = predict(cfg, blocks, r, job)
                peak = s["max_usage"]
                ranks.append({
                    "rank": r, "outcome": outcome, **e, **s, "peak_mb": peak / MB, "predicted": pred,
                    "predicted_mb": (B + pred["total"]) / MB, "ratio": peak / (B + pred["total"]),
                    "last_phase": rec["phases"][-1]["phase"] if rec["phases"] else "(before joining its group)",
                    "record": rec,
                })
            row = {
                "scale": scale,
                "blocks": blocks,
                "cfg": cfg,
                "label": LABELS[cfg],
                "wall_s": round(wall, 1),
                "ranks": ranks,
                "params": blocks * (args.width**2 + args.width) + args.width * CLASSES + CLASSES,
                "footprint_mb": footprint(args.width, blocks, args.momentum, args.optimizer) / MB,
            }
            runs.append(row)
            print(
                f"{scale}x ({blocks} blocks) {LABELS[cfg]}: "
                + ", ".join(
                    f"r{x['rank']} {x['outcome']} {x['peak_mb']:.0f} MB ({x['ratio']:.2f}, {x['last_phase']})"
                    for x in ranks
                )
                + f"  [{wall:.0f} s]",
                flush=True,
            )
    return {"baseline": base, "B_mb": B / MB, "C_mb": C / MB, "limit_mb": limit / MB, "runs": runs}


# ============================================================================================ report
def table(res: dict[str, Any]) -> str:
    short = {
        "finished": "ok",
        "OOM-killed": "**OOM**",
        "failed (peer OOM-killed)": "peer†",
        "stopped (peer OOM-killed)": "stop†",
        "stopped (timeout)": "timeout",
    }
    lines = [
        (
            "| size | configuration | outcome per rank | peak MB per rank (cgroup) | ru_maxrss MB | B + predicted MB | "
            "peak ÷ (B + predicted) | failcnt | OOM-killed during | s |"
        ),
        "|---|---|---|---|---|---|---|---|---|---:|",
    ]
    for run in res["runs"]:
        rk = run["ranks"]

        def per_rank(fmt: str, key: str, rk: list[dict[str, Any]] = rk) -> str:
            return " / ".join(format(x[key], fmt) for x in rk)

        outcomes = " / ".join(short.get(x["outcome"], x["outcome"]) for x in rk)
        where = sorted({killed_during(x["last_phase"]) for x in rk if x["outcome"] == "OOM-killed"})
        lines.append(
            f"| {run['scale']}× ({run['blocks']} blocks) | {run['label']} | {outcomes} | {per_rank('.0f', 'peak_mb')} "
            "| "
            f"{per_rank('.0f', 'ru_maxrss_mb')} | {per_rank('.0f', 'predicted_mb')} | {per_rank('.2f', 'ratio')} | "
            f"{per_rank('d', 'failcnt')} | {'; '.join(where) or '—'} | {run['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def killed_during(last_phase: str) -> str:
    """What a rank was doing when it was killed, from the last phase it recorded."""
    if last_phase.startswith("step "):
        return f"step {int(last_phase.split()[1]) + 1}"
    return {"imported": "model construction", "model built": "setup (cut / DDP wrap)",
            "module built (model in configure_model)": "setup (trace, cut, materialize)",
            "model built on meta": "setup (shard, materialize)",
            "setup done (cut, materialized, optimizer built)": "step 1"}.get(last_phase, last_phase)


def breakdown(res: dict[str, Any]) -> str:
    """The predicted terms per rank of the HPP meta runs (MB)."""
    lines = [
        "| size | config | rank | params | grads | optimizer | gathered (FSDP2) | activations | predicted | measured "
        "peak − B |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in res["runs"]:
        if run["cfg"] not in ("hpp", "ddp", *SHARDED):
            continue
        for x in run["ranks"]:
            p = {k: v / MB for k, v in x["predicted"].items()}
            lines.append(
                f"| {run['scale']}× | {run['cfg']} | {x['rank']} | {p['params']:.1f} | {p['grads']:.1f} | "
                f"{p['optimizer']:.1f} | "
                f"{p.get('gathered', 0.0):.1f} | {p['activations']:.2f} | {p['total']:.1f} | "
                f"{x['peak_mb'] - res['B_mb']:.1f} |"
            )
    return "\n".join(lines)


def largest(res: dict[str, Any]) -> str:
    """Per configuration: the largest model every rank trained to the end under the cap, and the median
    step time (steps after the first, the slowest rank's) at each size it trained."""
    import statistics

    def step_s(run: dict[str, Any]) -> float | None:
        per_rank = [x["record"].get("step_s", [])[1:] for x in run["ranks"]]
        if len(per_rank) != len(run["ranks"]) or not all(per_rank):
            return None
        return max(statistics.median(t) for t in per_rank)

    cfgs = list(dict.fromkeys(r["cfg"] for r in res["runs"]))
    scales = sorted({r["scale"] for r in res["runs"]})
    head = "| configuration | largest model trained | " + " | ".join(f"step s at {sc}×" for sc in scales) + " |"
    lines = [head, "|---|---|" + "---:|" * len(scales)]
    for cfg in cfgs:
        runs = {r["scale"]: r for r in res["runs"] if r["cfg"] == cfg}
        ok = [sc for sc, r in runs.items() if all(x["outcome"] == "finished" for x in r["ranks"])]
        best = max(ok) if ok else None
        size = f"{best}× ({runs[best]['params'] / 1e6:.1f} M params)" if best else "none"
        times = [step_s(runs[sc]) if sc in runs and sc in ok else None for sc in scales]
        lines.append(
            f"| {LABELS[cfg]} | {size} | " + " | ".join("—" if t is None else f"{t:.2f}" for t in times) + " |"
        )
    return "\n".join(lines)


def chart(res: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    scales = sorted({r["scale"] for r in res["runs"]})
    fig = Figure(figsize=(5.2 * len(scales), 5.2))
    FigureCanvasAgg(fig)
    colors = {
        "hpp": "#4C72B0",
        "hpp_ckpt": "#64B5CD",
        "hpp_eager": "#8172B2",
        "ddp": "#DD8452",
        "hpp_probe": "#55A868",
        "pp2_ddp": "#C44E52",
        "pp2_fsdp": "#937860",
        "pp2_fsdp_raf": "#DA8BC3",
        "fsdp": "#8C8C8C",
        "fsdp_m1": "#CCB974",
        "fsdp_plain": "#2F4F4F",
    }
    top = max(max(x["peak_mb"] for r in res["runs"] for x in r["ranks"]), res["limit_mb"]) * 1.12
    for col, scale in enumerate(scales):
        ax = fig.add_subplot(1, len(scales), 1 + col)
        runs = [r for r in res["runs"] if r["scale"] == scale]
        ticks, names = [], []
        for i, run in enumerate(runs):
            n = len(run["ranks"])
            for x in run["ranks"]:
                pos = i * (n + 1) + x["rank"]
                killed = x["outcome"] != "finished"
                ax.bar(pos, res["B_mb"], color="#D9D9D9")
                ax.bar(
                    pos,
                    x["peak_mb"] - res["B_mb"],
                    bottom=res["B_mb"],
                    color=colors[run["cfg"]],
                    hatch="//" if killed else None,
                    edgecolor="#C44E52" if killed else "none",
                    linewidth=1.2 if killed else 0,
                )
                if x["predicted_mb"] < top:
                    ax.plot([pos - 0.4, pos + 0.4], [x["predicted_mb"]] * 2, color="black", linewidth=1.5)
                elif x["rank"] == 0:  # the prediction is off the chart: say it under the top
                    ax.text(
                        pos + (n - 1) / 2,
                        top * 0.995,
                        f"B + predicted: {x['predicted_mb']:.0f} ↑",
                        ha="center",
                        va="top",
                        fontsize=6,
                    )
                if x["outcome"] == "OOM-killed":
                    ax.text(
                        pos,
                        x["peak_mb"] + top * 0.01,
                        "OOM",
                        ha="center",
                        va="bottom",
                        fontsize=6,
                        color="#C44E52",
                        rotation=90,
                    )
            ticks.append(i * (n + 1) + (n - 1) / 2)
            names.append(SHORT[run["cfg"]])
        ax.axhline(res["limit_mb"], color="#C44E52", linestyle="--", linewidth=1)
        ax.axhline(res["B_mb"], color="gray", linestyle=":", linewidth=1)
        ax.text(-0.5, res["limit_mb"], f" cap {res['limit_mb']:.0f} MB", va="bottom", fontsize=7, color="#C44E52")
        ax.text(-0.5, res["B_mb"], f" idle baseline B {res['B_mb']:.0f} MB", va="top", fontsize=7, color="dimgray")
        ax.set_xticks(ticks, names, fontsize=6.5)
        ax.set_ylim(0, top)
        ax.set_ylabel("peak memory per rank, MB (cgroup max_usage)", fontsize=8)
        fp = runs[0]["footprint_mb"]
        ax.set_title(
            f"{scale}× C: {runs[0]['blocks']} blocks, {runs[0]['params'] / 1e6:.0f}M params, state {fp:.0f} MB",
            fontsize=9,
        )
    fig.legend(handles=[Patch(facecolor="#D9D9D9", label="idle baseline B"),
                        Patch(facecolor="white", edgecolor="#C44E52", hatch="//", label="killed / did not finish"),
                        Patch(facecolor="black", label="black tick: B + predicted (rank's stage)")],
               loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle("Per-rank peak memory under a per-rank cgroup memory cap (4 ranks; bars = ranks 0..3)", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    fig.savefig(path, dpi=120)


def environment() -> dict[str, Any]:
    import lightning
    import torch

    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "kernel": platform.release(),
        "load_average_start": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--width", type=int, default=2048, help="W of the Linear(W, W) blocks")
    p.add_argument("--blocks-1x", type=int, default=8, help="blocks of the 1× model (its footprint is the cap C)")
    p.add_argument("--scales", type=int, nargs="+", default=[1, 2, 4], help="model sizes, in multiples of C")
    p.add_argument("--headroom", type=float, default=0.25, help="the cap above the baseline is (1 + headroom)·C")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--batch", type=int, default=32, help="global batch (DDP: batch / 4 per rank)")
    p.add_argument("--m", type=int, default=4, help="micro-batches (1F1B)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (0: plain SGD, no optimizer state)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="adam: two moments per parameter (16 bytes a parameter with its gradient), --momentum unused")
    p.add_argument("--timeout", type=float, default=120, help="collective timeout of the strategies, s")
    p.add_argument("--grace", type=float, default=30, help="s the other ranks get to end on their own after one failed")
    p.add_argument("--run-timeout", type=float, default=300, help="s one configuration may take before it is killed")
    p.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="diagnostic: MALLOC_MMAP_THRESHOLD_ for the ranks (glibc then mmaps every block of this size or "
        "larger and returns it on free; default: glibc's own, dynamic threshold)",
    )
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--baseline", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.baseline:
        baseline_worker(args.baseline)
        return
    args.pp = 4
    if args.batch % args.m or args.batch % args.pp:
        raise SystemExit(f"--batch {args.batch} must be divisible by --m {args.m} and by 4 (DDP's ranks).")
    try:
        probe = CGROUP_ROOT / f"hpp_mem_{os.getpid()}_probe"
        probe.mkdir()
        probe.rmdir()
    except OSError as err:
        raise SystemExit(f"This benchmark needs a writable cgroup-v1 memory hierarchy at {CGROUP_ROOT} (root): {err}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # a SIGTERM ends the benchmark through the same clean-up as an error: ranks killed, groups removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    env = environment()
    started = time.time()
    res = run_all(args, out)
    env.update(
        load_average_end=os.getloadavg(),
        wall_s=round(time.time() - started, 1),
        command=" ".join(
            [
                "python",
                os.path.relpath(sys.argv[0], ROOT) if not os.path.isabs(sys.argv[0]) else sys.argv[0],
                *sys.argv[1:],
            ]
        ),
    )
    res["environment"] = env
    res["args"] = {k: v for k, v in vars(args).items() if k not in ("worker", "baseline")}
    text = table(res)
    print(f"\n{text}\n\n{largest(res)}\n\n{breakdown(res)}")
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "results.md").write_text(
        f"Environment: {json.dumps(env)}\n\nB = {res['B_mb']:.0f} MB, C = {res['C_mb']:.0f} MB, "
        f"cap {res['limit_mb']:.0f} MB\n\n{text}\n\n{largest(res)}\n\n{breakdown(res)}\n"
    )
    chart(res, out / "memory.png")
    print(f"\nwrote {out / 'results.json'}, results.md and memory.png in {env['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
