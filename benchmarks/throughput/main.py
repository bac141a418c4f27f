"""Throughput, peak memory and pipeline bubble: HPPStrategy vs raw torch pipelining, DDP and FSDP.

One invocation runs, per model and on the same global batch and data:

* ``hpp``  — Lightning + :class:`lightning_hpp.HPPStrategy` (gpipe, 1f1b, interleaved1f1b, zbv),
* ``raw``  — ``torch.distributed.pipelining`` in a plain loop, the same schedules and cuts,
* ``ddp``  — Lightning's DDPStrategy,
* ``fsdp`` — on CPU torch's ``fully_shard`` over gloo in a plain loop; on GPU Lightning's
  FSDPStrategy,

and a micro-batch sweep of HPPStrategy 1F1B (m = 4, 8, 16).

Figures. Samples/s: global batch over the median step time after warm-up (the slowest rank's).
Every pipeline run records telemetry on every other timed step: the throughput uses the steps
without recording, the bubble and communication share come from the recorded ones, and the median
ratio of neighbouring recorded / unrecorded steps is the telemetry's overhead. "HPP ÷ raw" comes
from a third, paired run in which every HPPStrategy step is followed by one raw step on the same
batch, so that both see the same load of a shared machine; it is the median of the per-step
throughput ratios. Peak memory is per rank and configuration (CPU: the RSS high-water mark above
the process's RSS when the configuration started, via /proc/self/clear_refs; GPU: the caching
allocator's peak).

Each model runs in one launch of ``--devices`` processes (this file, ``--worker``) that go through
every configuration in turn.

Usage::

    python benchmarks/throughput/main.py                      # CPU, 2 ranks, both models
    python benchmarks/throughput/main.py --accelerator gpu --size gpu --steps 20
"""

from __future__ import annotations

import abc
import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT)]

PIPELINE_SCHEDULES = ["gpipe", "1f1b", "interleaved1f1b", "zbv"]
MULTI = {"interleaved1f1b", "zbv", "interleaved_zb", "dualpipev", "looped_bfs"}


# ============================================================================================ configs
def configs(m: int, sweep: list[int], schedules: list[str], paired_only: bool = False,
            compile_rounds: int = 0) -> list[dict[str, Any]]:
    """Every configuration one model runs, in order (only the paired HPP/raw runs with ``paired_only``; with
    ``compile_rounds``, HPPStrategy eager and with ``compile`` (inductor) in turn, that many rounds)."""
    out: list[dict[str, Any]] = []
    if compile_rounds:
        return [{"kind": "hpp", "schedule": s, "m": m, "compile": c}
                for _ in range(compile_rounds) for s in schedules for c in (False, True)]
    if paired_only:
        return [{"kind": "paired", "schedule": s, "m": m} for s in schedules]
    for s in schedules:
        out += [{"kind": k, "schedule": s, "m": m} for k in ("hpp", "raw", "paired")]
    out += [{"kind": "ddp"}, {"kind": "fsdp"}]
    out += [{"kind": "hpp", "schedule": "1f1b", "m": k, "sweep": True} for k in sweep if k != m]
    return out


def label(cfg: dict[str, Any]) -> str:
    if cfg["kind"] in ("hpp", "raw", "paired"):
        return f"{cfg['kind']} {cfg['schedule']} m={cfg['m']}" + (" compiled" if cfg.get("compile") else "")
    return cfg["kind"]


# ============================================================================================ memory
def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class PeakMemory:
    """Peak memory of this process over one configuration.

    CPU: freed heap is handed back to the kernel (``malloc_trim``), the kernel's RSS high-water
    mark is reset (``/proc/self/clear_refs``) and the RSS then is the baseline; the configuration's
    figure is its high-water mark above that baseline. GPU: the caching allocator's peak.
    """

    def __init__(self, device: Any) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.device = device
        self.torch = torch
        self.baseline = 0.0

    def reset(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = self.torch.cuda.memory_allocated(self.device) / 2**20
            return
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
        except OSError:
            pass
        self.baseline = _vm("VmRSS") / 2**20

    def peak_mb(self) -> float:
        """Peak above the baseline, MB."""
        if self.cuda:
            return self.torch.cuda.max_memory_allocated(self.device) / 2**20 - self.baseline
        return _vm("VmHWM") / 2**20 - self.baseline


# ============================================================================================ worker
def worker(job: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from models import SIZES, Size

    torch.set_num_threads(job["threads"])
    rank = int(os.environ["RANK"])
    gpu = job["accelerator"] == "gpu"
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if gpu else torch.device("cpu")
    dist.init_process_group("nccl" if gpu else "gloo", device_id=device if gpu else None)
    size = Size(**job["size"]) if isinstance(job["size"], dict) else SIZES[job["model"]][job["size"]]
    import lightning  # noqa: F401  (imported before the baseline is taken, as every configuration needs it)

    baseline_mb = _vm("VmRSS") / 2**20 if os.path.exists("/proc/self/status") else 0.0
    results = []
    for cfg in job["configs"]:
        run = {"hpp": run_hpp, "raw": run_raw, "paired": run_paired, "ddp": run_ddp, "fsdp": run_fsdp,
               "lengths": run_lengths}[cfg["kind"]]
        t0 = time.perf_counter()
        res = run(job, cfg, size, device)
        res.update(cfg=cfg, label=label(cfg), rank=rank, wall_s=time.perf_counter() - t0, baseline_mb=baseline_mb)
        results.append(res)
        dist.barrier()
    out = Path(job["out"]) / f"{job['model']}_rank{rank}.json"
    out.write_text(json.dumps(results))
    dist.destroy_process_group()


def _timing(times: list[float], warmup: int, record: bool) -> dict[str, Any]:
    """Split the timed steps: with recording, even steps ran without it and odd steps with it."""
    timed = times[warmup:]
    res: dict[str, Any] = {"times": times, "plain": timed[0::2] if record else timed}
    if record:
        res["recorded"] = timed[1::2]
        res["pairs"] = [b / a for a, b in zip(timed[0::2], timed[1::2])]
    return res


def _history(history: list[Any]) -> dict[str, Any]:
    """What each recorded step measured (bubble, theory, expected, communication, per-stage ms)."""
    return {
        "steps": [
            {"bubble": m.bubble, "bubble_theory": m.bubble_theory, "bubble_expected": m.bubble_expected,
             "bubble_replayed": m.bubble_replayed,
             "comm_share": m.comm_share, "step_ms": m.step_ms, "stages": {k: vars(t) for k, t in m.stages.items()}}
            for m in history
        ]
    }


def _lightning_timer(job: dict[str, Any], memory: PeakMemory, telemetry: Any = None, sync_start: bool = False) -> Any:
    """A callback timing each training batch, ``on_train_batch_start`` to ``on_train_batch_end``; with
    ``sync_start`` every rank leaves a barrier first (not timed)."""
    import torch
    from lightning.pytorch import Callback

    warmup = job["warmup"]

    class Timer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._t = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if telemetry is not None and telemetry.recorder is not None:
                telemetry.recorder.enabled = batch_idx >= warmup and (batch_idx - warmup) % 2 == 1
            if memory.cuda:
                torch.cuda.synchronize()
            if sync_start:
                torch.distributed.barrier()
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if memory.cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._t)

    return Timer()


def _trainer(job: dict[str, Any], strategy: Any, callbacks: list[Any], **kw: Any) -> Any:
    """The benchmark's Trainer (no logger, no checkpoints unless ``kw`` turns them on)."""
    import lightning as L

    return L.Trainer(**{
        "accelerator": job["accelerator"],
        "devices": job["devices"],
        "strategy": strategy,
        "max_steps": job["warmup"] + job["steps"],
        "callbacks": callbacks,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "use_distributed_sampler": True,
        **kw,
    })


def _loader(job: dict[str, Any], size: Any, per_rank_batch: int) -> Any:
    from models import dataset
    from torch.utils.data import DataLoader

    n = (job["warmup"] + job["steps"]) * job.get("dp", 1)  # every replica draws warmup + steps batches
    return DataLoader(dataset(job["model"], size, n), batch_size=per_rank_batch, drop_last=True)


def run_hpp(job: dict[str, Any], cfg: dict[str, Any], size: Any, device: Any) -> dict[str, Any]:
    from models import build, split

    from lightning_hpp import HPPStrategy, StagePlan, StageSpec
    from lightning_hpp.telemetry.callback import PipelineTelemetry

    n_stages = job["devices"] // job.get("dp", 1) * (2 if cfg["schedule"] in MULTI else 1)
    plan = StagePlan([StageSpec(modules=u) for u in split(job["model"], size, n_stages)])
    memory = PeakMemory(device)
    memory.reset()
    telemetry = PipelineTelemetry(every_n_steps=10**9)
    timer = _lightning_timer(job, memory, telemetry)
    # each block compiled by inductor (its C++ code on CPUs) after the cut
    compiled = {"compile": {"backend": "inductor"}} if cfg.get("compile") else {}
    strategy = HPPStrategy(plan=plan, schedule=cfg["schedule"], n_microbatches=cfg["m"], timeout=300, **compiled,
                           frontend=job.get("frontend", "auto"),
                           **_hpp_options())
    trainer = _trainer(job, strategy, [telemetry, timer])
    trainer.fit(build(job["model"], size), _loader(job, size, size.batch))
    return {**_timing(timer.times, job["warmup"], True), "peak_mb": memory.peak_mb(), **_history(telemetry.history)}


def run_lengths(job: dict[str, Any], cfg: dict[str, Any], size: Any, device: Any) -> dict[str, Any]:
    """The LM under HPPStrategy on batches of ``cfg["lengths"]`` (lengths.py), every step recorded by the telemetry;
    the traced frontend's captures (``torch.export`` at setup) counted and timed."""
    from lengths import Cut, Indexed
    from lightning.pytorch import Callback
    from models import build, dataset, split
    from torch.utils.data import DataLoader

    from lightning_hpp import HPPStrategy, StagePlan, StageSpec
    from lightning_hpp.model import traced
    from lightning_hpp.telemetry.callback import PipelineTelemetry

    captures: list[float] = []
    trace = traced.trace

    def timed_trace(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return trace(*args, **kwargs)
        finally:
            captures.append(time.perf_counter() - t0)

    class Lengths(Callback):
        def __init__(self) -> None:
            self.lengths: list[int] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.lengths.append(int(batch[0].shape[1]))

    plan = StagePlan([StageSpec(modules=u) for u in split(job["model"], size, job["devices"] // job.get("dp", 1))])
    telemetry = PipelineTelemetry(every_n_steps=10**9)  # every step recorded, exchanged once at the end
    timer, lengths = _lightning_timer(job, PeakMemory(device)), Lengths()
    strategy = HPPStrategy(plan=plan, schedule=cfg["schedule"], n_microbatches=cfg["m"], frontend=cfg["frontend"],
                           timeout=300, **_hpp_options())
    trainer = _trainer(job, strategy, [telemetry, lengths, timer])
    n = (job["warmup"] + job["steps"]) * job.get("dp", 1)
    loader = DataLoader(Indexed(dataset(job["model"], size, n).tensors), batch_size=size.batch, drop_last=True,
                        collate_fn=Cut(cfg["lengths"], size.seq))
    traced.trace = timed_trace
    try:
        trainer.fit(build(job["model"], size), loader)
    finally:
        traced.trace = trace
    shapes = [(m.new_shape, m.shape_ms, m.shape_alloc_mb) for m in telemetry.history]
    return {"times": timer.times, "lengths": lengths.lengths, "shapes": shapes, "captures": captures, "peak_mb": 0.0}


def _hpp_options(**precision: Any) -> dict[str, Any]:
    """HPPStrategy keyword arguments of a benchmark run: its HPPPrecision, with ``precision`` options."""
    # torch's shape inference runs each stage once on uninitialized tensors in the first step; a
    # non-finite guard that raises can trip on that garbage, so the benchmark asks it to warn. The
    # check itself (and its cost) is the same.
    import warnings

    from lightning_hpp import HPPPrecision

    warnings.filterwarnings("ignore", message="NaN/Inf in the", category=RuntimeWarning)
    return {"precision_plugin": HPPPrecision(nonfinite="warn", **precision)}


def run_ddp(job: dict[str, Any], cfg: dict[str, Any], size: Any, device: Any) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy
    from models import build

    memory = PeakMemory(device)
    memory.reset()
    timer = _lightning_timer(job, memory)
    backend = "nccl" if device.type == "cuda" else "gloo"
    trainer = _trainer(job, DDPStrategy(process_group_backend=backend), [timer])
    trainer.fit(build(job["model"], size), _loader(job, size, size.batch // job["devices"]))
    return {**_timing(timer.times, job["warmup"], False), "peak_mb": memory.peak_mb()}


def run_fsdp(job: dict[str, Any], cfg: dict[str, Any], size: Any, device: Any) -> dict[str, Any]:
    if device.type == "cuda":
        return _run_fsdp_lightning(job, size, device)
    import torch
    import torch.distributed as dist
    from models import build, dataset, loss_fn
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    memory = PeakMemory(device)
    memory.reset()
    model = build(job["model"], size)
    net = nn.Sequential(*model.units())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in net:
        fully_shard(unit, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=model.lr, momentum=0.9)
    ds = dataset(job["model"], size, job["warmup"] + job["steps"])
    per = size.batch // dist.get_world_size()
    rank = dist.get_rank()
    times = []
    for i in range(job["warmup"] + job["steps"]):
        lo = i * size.batch + rank * per
        x, y = ds.tensors[0][lo : lo + per], ds.tensors[1][lo : lo + per]
        t0 = time.perf_counter()
        loss_fn(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return {**_timing(times, job["warmup"], False), "peak_mb": memory.peak_mb()}


def _run_fsdp_lightning(job: dict[str, Any], size: Any, device: Any) -> dict[str, Any]:
    from lightning.pytorch.strategies import FSDPStrategy
    from models import Block, build

    memory = PeakMemory(device)
    memory.reset()
    timer = _lightning_timer(job, memory)
    model = build(job["model"], size)
    wrap = {Block} if job["model"] == "lm" else {type(model.blocks[0])}
    trainer = _trainer(job, FSDPStrategy(auto_wrap_policy=wrap), [timer])
    trainer.fit(model, _loader(job, size, size.batch // job["devices"]))
    return {**_timing(timer.times, job["warmup"], False), "peak_mb": memory.peak_mb()}


class _PlainLoop(abc.ABC):
    """A training step outside Lightning on this replica's part of the benchmark's global batch ``i``: the
    subclass's forward and backward (``_backward``), then SGD's step and ``zero_grad``, timed."""

    def step(self, i: int) -> float:
        """Train on global batch ``i``; return the step's wall time in seconds."""
        lo = (i * self.dp + self.replica) * self.batch
        x, y = (t[lo : lo + self.batch].to(self.device) for t in self.data)
        cuda = self.device.type == "cuda"
        if cuda:
            self.torch.cuda.synchronize()
        t0 = time.perf_counter()
        self._backward(x, y)
        self.opt.step()
        self.opt.zero_grad()
        if cuda:
            self.torch.cuda.synchronize()
        return time.perf_counter() - t0

    @abc.abstractmethod
    def _backward(self, x: Any, y: Any) -> None:
        """Forward and backward of one step on inputs ``x`` and targets ``y``."""


class RawPipeline(_PlainLoop):
    """The same model, cut and schedule as the HPPStrategy run, driven by torch pipelining alone."""

    def __init__(self, job: dict[str, Any], cfg: dict[str, Any], size: Any, device: Any, record: bool) -> None:
        import torch
        import torch.distributed as dist
        from models import build, dataset, loss_fn, split
        from torch import nn
        from torch.distributed.pipelining import PipelineStage

        from lightning_hpp.pipeline.schedules import SCHEDULES
        from lightning_hpp.telemetry.recorder import PipelineRecorder

        kind = SCHEDULES[cfg["schedule"]]
        self.dp = dp = job.get("dp", 1)
        pp, rank = dist.get_world_size() // dp, dist.get_rank()
        group, self.dp_group, position, self.replica = None, None, rank, 0
        if dp > 1:  # pp x dp: a pipeline per replica, the gradients all-reduced over the replicas after the step
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (pp, dp), mesh_dim_names=("pp", "dp"))
            group, self.dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
            position, self.replica = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
        n_stages = pp * (2 if kind.multi else 1)
        cuts = split(job["model"], size, n_stages)
        mine = _stages_of(position, pp, n_stages, kind.style)
        model = build(job["model"], size)
        stages = [
            PipelineStage(nn.Sequential(*[model.get_submodule(n) for n in cuts[k]]).to(device), k, n_stages, device,
                          group=group)
            for k in mine
        ]
        self.sched = kind.cls(stages if kind.multi else stages[0], cfg["m"], loss_fn=loss_fn, scale_grads=True)
        self.recorder = PipelineRecorder(rank, 0, rank, cfg["schedule"]) if record else None
        if self.recorder is not None:
            self.recorder.instrument(self.sched)
        self.params = params = [p for st in stages for p in st.submod.parameters()]
        self.opt = torch.optim.SGD(params, lr=model.lr, momentum=0.9)
        self.data = dataset(job["model"], size, (job["warmup"] + job["steps"]) * dp).tensors
        self.first, self.last = 0 in mine, n_stages - 1 in mine
        self.batch, self.device, self.torch = size.batch, device, torch
        del model  # the units of the other ranks

    def _backward(self, x: Any, y: Any) -> None:
        self.sched.step(*((x,) if self.first else ()), target=y if self.last else None)
        if self.dp_group is not None:  # one all-reduce of the flattened gradients, after the schedule (not overlapped)
            from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

            grads = [p.grad for p in self.params]
            flat = _flatten_dense_tensors(grads)
            self.torch.distributed.all_reduce(flat, group=self.dp_group)
            flat /= self.dp
            for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)


class PlainDDP(_PlainLoop):
    """The same model in torch's ``DistributedDataParallel`` in a plain loop (``--paired-with ddp``, pp = 1): each
    rank trains on its replica's part of the batch the HPPStrategy run draws, as the raw pipeline does."""

    def __init__(self, job: dict[str, Any], size: Any, device: Any) -> None:
        import torch
        import torch.distributed as dist
        from models import build, dataset, loss_fn
        from torch.nn.parallel import DistributedDataParallel

        model = build(job["model"], size).to(device)
        self.ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=model.lr, momentum=0.9)
        self.dp, self.replica = dist.get_world_size(), dist.get_rank()
        self.data = dataset(job["model"], size, (job["warmup"] + job["steps"]) * self.dp).tensors
        self.batch, self.device, self.torch, self.loss_fn = size.batch, device, torch, loss_fn

    def _backward(self, x: Any, y: Any) -> None:
        self.loss_fn(self.ddp(x), y).backward()


def run_raw(job: dict[str, Any], cfg: dict[str, Any], size: Any, device: Any) -> dict[str, Any]:
    from lightning_hpp.telemetry.recorder import collect

    memory = PeakMemory(device)
    memory.reset()
    raw = RawPipeline(job, cfg, size, device, record=True)
    times = []
    for i in range(job["warmup"] + job["steps"]):
        raw.recorder.enabled = i >= job["warmup"] and (i - job["warmup"]) % 2 == 1
        times.append(raw.step(i))
    history = collect(raw.recorder)
    raw.recorder.close()
    return {**_timing(times, job["warmup"], True), "peak_mb": memory.peak_mb(), **_history(history)}


def run_paired(job: dict[str, Any], cfg: dict[str, Any], size: Any, device: Any) -> dict[str, Any]:
    """HPPStrategy steps, each followed by one raw torch pipelining step on the same batch.

    Neighbouring steps share the machine's load of the moment, so the median of the per-step
    ratios compares the two far more steadily than two separate runs on a shared machine do.

    With ``job["paired_start"] == "barrier"`` (the default) every rank leaves a barrier (not timed) before
    each HPP step and each raw step, so that both are timed from the same synchronised start to the last
    rank's end. Without it (``"free"``) each rank starts a step when it finished the previous one: a raw
    step's ranks end apart (the last stage finishes before the first stage's last backward), and the HPP
    step that follows, timed on the rank that finished first, is charged that gap.
    """
    from lightning.pytorch import Callback
    from models import build, split

    from lightning_hpp import HPPStrategy, StagePlan, StageSpec

    # more steps than the other runs: single steps scatter +-20% here, and the median ratio is the figure read
    job = {**job, "steps": job.get("paired_steps") or job["steps"]}
    n_stages = job["devices"] // job.get("dp", 1) * (2 if cfg["schedule"] in MULTI else 1)
    plan = StagePlan([StageSpec(modules=u) for u in split(job["model"], size, n_stages)])
    memory = PeakMemory(device)
    sync = job.get("paired_start", "barrier") == "barrier"
    timer = _lightning_timer(job, memory, sync_start=sync)
    probes = None
    if job.get("probe"):  # before the raw loop and the model are built: their loss function is looked up then
        from probes import Probes

        probes = Probes()
        probes.install()
    raw = (
        PlainDDP(job, size, device)
        if job.get("paired_with") == "ddp"
        else RawPipeline(job, cfg, size, device, record=False)
    )

    class RawAfterEach(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if probes is not None and batch_idx == job["warmup"]:
                probes.reset()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if sync:
                raw.torch.distributed.barrier()
            if probes is not None:
                probes.side = "raw"
            self.times.append(raw.step(batch_idx))
            if probes is not None:
                probes.side = "hpp"

    paired = RawAfterEach()
    strategy = HPPStrategy(plan=plan, schedule=cfg["schedule"], n_microbatches=cfg["m"], timeout=300,
                           frontend=job.get("frontend", "auto"), **_hpp_options())
    trainer = _trainer(job, strategy, [timer, paired])
    try:
        trainer.fit(build(job["model"], size), _loader(job, size, size.batch))
    finally:
        if probes is not None:
            probes.remove()
    w = job["warmup"]
    hpp, raw_times = timer.times[w:], paired.times[w:]
    res = {"plain": hpp, "raw": raw_times, "ratios": [h / r for h, r in zip(hpp, raw_times)], "peak_mb": 0.0}
    if probes is not None:
        res["probe"] = probes.summary(len(timer.times) - w)
    return res


def _stages_of(rank: int, pp: int, n_stages: int, style: str) -> list[int]:
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    mapping = generate_stage_to_rank_mapping(pp, n_stages, style=style)
    return sorted(s for s, r in mapping.items() if r == rank)


# ============================================================================================ launch
def launch_ranks(
    script: str | Path, job: dict[str, Any], n: int, *, flag: str = "--worker", prefix: str = "rank",
    threads: int = 1, rank_env: Any = None,
) -> list[Any]:
    """Run ``python script flag '<job json>'`` as ranks 0..n-1 of one gloo job on this machine.

    Each rank logs to ``OUT/<prefix><r>.log`` and writes its results to ``OUT/<prefix><r>.json``
    (``OUT`` = ``job['out']``); the results are returned in rank order. ``rank_env(r)`` adds
    per-rank environment variables. A failed rank ends the benchmark with its log's tail.
    """
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    out = Path(job["out"])
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_network_port()), "WORLD_SIZE": str(n),
           "NODE_RANK": "0", "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = []
    try:
        for r in range(n):
            penv = {**env, "RANK": str(r), "LOCAL_RANK": str(r), **(rank_env(r) if rank_env else {})}
            log = open(out / f"{prefix}{r}.log", "w")
            procs.append((subprocess.Popen([sys.executable, str(script), flag, json.dumps(job)], env=penv,
                                           stdout=log, stderr=subprocess.STDOUT), log))
        codes = [p.wait() for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    if any(codes):
        bad = next(r for r, c in enumerate(codes) if c)
        tail = (out / f"{prefix}{bad}.log").read_text()[-4000:]
        raise SystemExit(f"rank {bad} of {Path(script).name} failed (exit codes {codes}):\n{tail}")
    return [json.loads((out / f"{prefix}{r}.json").read_text()) for r in range(n)]


def launch(job: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Run one model's configurations in ``job['devices']`` fresh processes; return each rank's results."""
    return launch_ranks(__file__, job, job["devices"], prefix=f"{job['model']}_rank", threads=job["threads"])


def merge(per_rank: list[list[dict[str, Any]]], batch: int) -> list[dict[str, Any]]:
    """One row per configuration (repeated runs pooled).

    Step time: per rank the median of its pooled unrecorded steps, then the slowest rank. Peak
    memory: per rank, the largest of its runs. Bubble and communication share: medians over the
    recorded steps. Telemetry overhead: median over ranks and step pairs of recorded / unrecorded - 1.
    """
    groups: dict[str, list[list[dict[str, Any]]]] = {}
    paired: dict[tuple[str, int], dict[str, float]] = {}
    for results in zip(*per_rank):
        cfg = results[0]["cfg"]
        if cfg["kind"] == "paired":
            hpp = [max(ts) for ts in zip(*(r["plain"] for r in results))]  # the slowest rank, step by step
            raw = [max(ts) for ts in zip(*(r["raw"] for r in results))]
            paired[(cfg["schedule"], cfg["m"])] = {
                "hpp_over_raw": statistics.median(r / h for h, r in zip(hpp, raw)),
                "hpp_ms": statistics.median(hpp) * 1e3,
                "raw_ms": statistics.median(raw) * 1e3,
                **({"probe": [r["probe"] for r in results]} if "probe" in results[0] else {}),
            }
            continue
        groups.setdefault(results[0]["label"], []).append(list(results))
    rows = []
    for name, runs in groups.items():
        ranks = list(zip(*runs))  # per rank: its runs
        step = max(statistics.median([t for run in rank_runs for t in run["plain"]]) for rank_runs in ranks)
        r0 = runs[0][0]
        row: dict[str, Any] = {
            "label": name,
            "cfg": r0["cfg"],
            "runs": len(runs),
            "step_ms": step * 1e3,
            "samples_s": batch / step,
            "peak_mb": [max(run["peak_mb"] for run in rank_runs) for rank_runs in ranks],
            "wall_s": sum(max(r["wall_s"] for r in run) for run in runs),
            "idle_mb": [rank_runs[0]["baseline_mb"] for rank_runs in ranks],
        }
        steps = [st for run in runs for st in run[0].get("steps", [])]
        if steps:
            med = lambda key: statistics.median(st[key] for st in steps)  # noqa: E731
            row.update(
                bubble=med("bubble"), bubble_theory=steps[0]["bubble_theory"], bubble_expected=med("bubble_expected"),
                bubble_replayed=med("bubble_replayed"),
                comm_share=med("comm_share"), sched_ms=med("step_ms"), stages=steps[len(steps) // 2]["stages"],
            )
            row["telemetry_overhead"] = statistics.median(p for run in runs for r in run for p in r["pairs"]) - 1
        key = (row["cfg"].get("schedule"), row["cfg"].get("m"))
        if row["cfg"]["kind"] == "hpp" and key in paired:
            row["paired"] = paired.pop(key)
        rows.append(row)
    for (schedule, m), pair in paired.items():  # paired runs without an unpaired HPP run of their own (--paired-only)
        rows.append(
            {
                "label": f"paired {schedule} m={m}",
                "cfg": {"kind": "paired", "schedule": schedule, "m": m},
                "step_ms": pair["hpp_ms"],
                "samples_s": batch / (pair["hpp_ms"] / 1e3),
                "peak_mb": [],
                "paired": pair,
            }
        )
    return rows


# ============================================================================================ report
def table(model: str, rows: list[dict[str, Any]], baseline: str = "raw") -> str:
    ddp = next((r["samples_s"] for r in rows if r["cfg"]["kind"] == "ddp"), None)
    lines = [
        f"| {model} | samples/s | × DDP | HPP ÷ {'DDP' if baseline == 'ddp' else 'raw'} (paired) | step ms | in "
        "schedule ms | peak MB per rank | bubble (theory / expected / replayed) | comm share | telemetry overhead |",
        "|---|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for r in rows:
        vs_raw = f"{r['paired']['hpp_over_raw']:.3f}" if "paired" in r else ""
        bubble = (
            f"{r['bubble']:.3f} ({r['bubble_theory']:.3f} / {r['bubble_expected']:.3f} / {r['bubble_replayed']:.3f})"
            if "bubble" in r
            else ""
        )
        comm = f"{r['comm_share']:.3f}" if "comm_share" in r else ""
        sched = f"{r['sched_ms']:.0f}" if "sched_ms" in r else ""
        over = f"{100 * r['telemetry_overhead']:+.1f}%" if "telemetry_overhead" in r else ""
        vs_ddp = f"{r['samples_s'] / ddp:.2f}" if ddp else ""
        lines.append(
            f"| {r['label']} | {r['samples_s']:.1f} | {vs_ddp} | {vs_raw} | {r['step_ms']:.0f} | {sched} | "
            f"{' / '.join(f'{m:.0f}' for m in r['peak_mb'])} | {bubble} | {comm} | {over} |"
        )
    for r in rows:
        if "probe" in r.get("paired", {}):
            from probes import table as probe_table

            lines += ["", f"Probes of paired {r['cfg']['schedule']} m={r['cfg']['m']} (--probe):", "",
                      probe_table(r["paired"]["probe"], "DDP" if baseline == "ddp" else "raw")]
    return "\n".join(lines)


def chart(all_rows: dict[str, list[dict[str, Any]]], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    models = list(all_rows)
    fig = Figure(figsize=(6 * len(models), 9))
    FigureCanvasAgg(fig)
    for col, model in enumerate(models):
        rows = [r for r in all_rows[model] if not r["cfg"].get("sweep")]
        names = [r["label"].replace(" m=", "\nm=") for r in rows]
        colors = [
            {"hpp": "#4C72B0", "raw": "#8C8C8C", "ddp": "#DD8452", "fsdp": "#55A868"}[r["cfg"]["kind"]] for r in rows
        ]
        ax = fig.add_subplot(3, len(models), 1 + col)
        ax.bar(range(len(rows)), [r["samples_s"] for r in rows], color=colors)
        for i, r in enumerate(rows):
            if "bubble" in r:
                ax.text(i, r["samples_s"], f"b={r['bubble']:.2f}", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(rows)), names, fontsize=6, rotation=90)
        ax.set_title(f"{model}: samples/s (median step)", fontsize=9)
        ax = fig.add_subplot(3, len(models), 1 + len(models) + col)
        ax.bar(range(len(rows)), [max(r["peak_mb"]) for r in rows], color=colors)
        ax.set_xticks(range(len(rows)), names, fontsize=6, rotation=90)
        ax.set_title(f"{model}: peak memory, largest rank (MB)", fontsize=9)
        sweep = sorted(
            (r for r in all_rows[model] if r["cfg"]["kind"] == "hpp" and r["cfg"]["schedule"] == "1f1b"),
            key=lambda r: r["cfg"]["m"],
        )
        ax = fig.add_subplot(3, len(models), 1 + 2 * len(models) + col)
        ms = [r["cfg"]["m"] for r in sweep]
        ax.plot(ms, [r["bubble"] for r in sweep], "o-", label="bubble (measured)")
        ax.plot(ms, [r["bubble_theory"] for r in sweep], "o--", label="bubble (theory)")
        ax.plot(ms, [r["comm_share"] for r in sweep], "s-", label="communication share")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("micro-batches (HPPStrategy 1f1b, same global batch)", fontsize=8)
        ax.set_title(f"{model}: micro-batch sweep", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def environment(job: dict[str, Any]) -> dict[str, Any]:
    import lightning
    import torch

    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), cpu)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "threads_per_rank": job["threads"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="+", default=["mlp", "lm"], choices=["mlp", "lm"])
    p.add_argument("--size", default="cpu", help="size preset of models.SIZES (tiny, cpu, gpu; the LM also vocab)")
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--devices", type=int, default=2, help="ranks (pipeline ranks x --dp for the pipeline runs)")
    p.add_argument(
        "--dp", type=int, default=1, help="replicas of the pipeline in the hpp, raw and paired runs (pp x dp)"
    )
    p.add_argument("--m", type=int, default=8, help="micro-batches of the main comparison")
    p.add_argument("--sweep", type=int, nargs="*", default=[4, 8, 16], help="micro-batch counts of the 1f1b sweep")
    p.add_argument("--schedules", nargs="+", default=PIPELINE_SCHEDULES)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    p.add_argument("--paired-steps", type=int, default=60,
                   help="timed steps of the paired HPP/raw runs (the median of per-step ratios; 10 scatter by +-5%%)")
    p.add_argument("--paired-only", action="store_true", help="only the paired HPP/raw runs (HPP ÷ raw per schedule)")
    p.add_argument("--paired-with", choices=["raw", "ddp"], default="raw",
                   help="what each paired HPP step is compared with: raw torch pipelining (default), or at pp = 1 "
                        "(--devices equal to --dp) torch's DistributedDataParallel in a plain loop")
    p.add_argument("--paired-start", choices=["barrier", "free"], default="barrier",
                   help="barrier: time each paired HPP and raw step from a barrier every rank leaves (default); free: "
                        "from the end of the rank's previous step (charges an HPP step the raw step's end skew)")
    p.add_argument("--probe", action="store_true",
                   help="with --paired-only: time each stage action, the loss, the guard and the schedule step on both "
                        "sides of the paired run, per rank (probes.py)")
    p.add_argument("--compile", type=int, default=0, metavar="ROUNDS",
                   help="only HPPStrategy eager and HPPStrategy(compile=inductor), in turn, ROUNDS times: "
                        "compiled ÷ eager")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="torch threads per rank")
    p.add_argument("--frontend", default="auto", choices=["auto", "sequential", "traced"],
                   help="HPPStrategy(frontend=...) of the hpp and paired runs (auto: sequential for both models)")
    p.add_argument("--lengths", action="store_true",
                   help="only the LM on batches of one length and of lengths drawn anew each step, 1f1b, sequential "
                        "and traced frontends (lengths.py), and what a capture costs")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.lengths and (args.models != ["lm"] or args.paired_only or args.dp != 1):
        p.error("--lengths runs the LM alone on one pipeline: give --models lm, without --paired-only or --dp")
    if args.paired_with == "ddp" and (not args.paired_only or args.devices != args.dp):
        p.error(f"--paired-with ddp compares a pp = 1 run with DDP: it needs --paired-only and --devices equal to --dp "
                f"(got --devices {args.devices} --dp {args.dp})")
    if args.probe and not args.paired_only:
        p.error("--probe times the paired runs: it needs --paired-only")
    if args.dp > 1 and (not args.paired_only or args.devices % args.dp):
        p.error(f"--dp {args.dp}: pp x dp runs are paired only (--paired-only) and --devices {args.devices} must be a "
                f"multiple of it, e.g. --devices 4 --dp 2 --paired-only")
    from models import SIZES, build, n_params

    for model in args.models:
        if args.size not in SIZES[model]:
            p.error(f"--size {args.size}: the {model} model has the presets {sorted(SIZES[model])} "
                    f"(the LM's 'vocab' preset runs with --models lm)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    all_rows: dict[str, list[dict[str, Any]]] = {}
    env: dict[str, Any] = {}
    started = time.time()
    for model in args.models:
        size = SIZES[model][args.size]
        job = {
            "model": model,
            "size": args.size,
            "accelerator": args.accelerator,
            "devices": args.devices,
            "dp": args.dp,
            "warmup": args.warmup,
            "steps": args.steps,
            "paired_steps": args.paired_steps,
            "paired_start": args.paired_start,
            "paired_with": args.paired_with,
            "probe": args.probe,
            "frontend": args.frontend,
            "threads": args.threads,
            "out": str(out),
            "configs": configs(args.m, args.sweep, args.schedules, args.paired_only, args.compile),
        }
        env = environment(job)
        if args.lengths:
            from lengths import bounds, capture_costs, length_configs, lengths_table, mean_length, merge_lengths

            job["configs"] = length_configs(args.m)
            rows = merge_lengths(launch(job), size.batch, args.warmup)
            lo, hi = bounds(size.seq)
            costs = capture_costs(size, [lo, mean_length(size.seq), hi], args.m)
            all_rows[model] = rows + [{"label": "capture", "cfg": {"kind": "capture"}, **costs}]
            print(f"\n{model}: {vars(size)}, variable lengths {lo}..{hi}\n{lengths_table(rows, costs)}", flush=True)
            continue
        rows = merge(launch(job), size.batch)
        all_rows[model] = rows
        print(
            f"\n{model}: {n_params(build(model, size)) / 1e6:.1f}M parameters, global batch {size.batch}, {vars(size)}"
        )
        print(table(model, rows, args.paired_with), flush=True)
        for s in args.schedules if args.compile else []:
            eager, comp = (next(r for r in rows if r["label"] == f"hpp {s} m={args.m}{c}") for c in ("", " compiled"))
            print(f"HPP compiled ÷ HPP eager, {s} m={args.m}: {comp['samples_s'] / eager['samples_s']:.3f} "
                  f"({eager['runs']} runs each, alternating)", flush=True)
    env["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    env["wall_s"] = time.time() - started
    env["command"] = " ".join([Path(sys.executable).name, *sys.argv])
    (out / "results.json").write_text(json.dumps({"environment": env, "size": args.size, "models": all_rows}, indent=1))
    md = [f"Environment: {json.dumps(env)}", ""]
    for model, rows in all_rows.items():
        if args.lengths:
            from lengths import lengths_table

            md += [lengths_table(rows[:-1], rows[-1]), ""]
            continue
        md += [table(model, rows, args.paired_with), ""]
    (out / "results.md").write_text("\n".join(md))
    if not args.paired_only and not args.compile and not args.lengths:
        chart(all_rows, out / "throughput.png")
    png = "" if args.paired_only or args.compile or args.lengths else ", " + str(out / "throughput.png")
    print(f"\nwrote {out / 'results.md'}, {out / 'results.json'}{png} "
          f"in {env['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
