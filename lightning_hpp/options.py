"""The typed option sections of :class:`~lightning_hpp.HPPStrategy`, one per concern.

``HPPStrategy`` keeps the pipeline's own options (plan, schedule, micro-batches, pp degree,
timeout, backend) and takes every other concern as one of these sections; precision lives in
:class:`~lightning_hpp.HPPPrecision` alone. Each section is validated when it is built, before any
process starts, and a plain ``dict`` of its fields (a Hydra config, say) is accepted wherever a
section is::

    HPPStrategy(schedule="1f1b", n_microbatches=8,
                checkpoint=CheckpointOptions(dir="s3://bucket/run", every_n_steps=500, keep_last=3, resume="auto"),
                bias=BiasOptions(deterministic=True, audit="error"),
                telemetry=TelemetryOptions(trace_step=20),
                placement=PlacementOptions(device_map="0:a100,1:h100"),
                sharding=ShardingOptions(data_parallel="fsdp"))
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

from lightning_hpp.errors import BiasConfigError, CheckpointError, PlacementError, ShardingError, TelemetryError
from lightning_hpp.pipeline.dims import DATA_PARALLEL, ParallelDims
from lightning_hpp.planning.devices import ENV_VAR as DEVICE_KIND_ENV
from lightning_hpp.planning.devices import normalize_kind, parse_device_map
from lightning_hpp.telemetry.slowdown import watch_options
from lightning_hpp.validation import check_bool, check_choice, check_int, check_path

POLICIES = ("warn", "error", "off")


@dataclass(frozen=True)
class CheckpointOptions:
    """The strategy's own sharded ``step-<N>`` checkpoints (``ModelCheckpoint`` callbacks and
    ``ckpt_path=`` work without this section; their checkpoints are sharded too)."""

    dir: str | None = None
    """Where ``step-<N>`` checkpoints go: any fsspec URL (local path, ``file://``, ``s3://``)."""
    every_n_steps: int | None = None
    """Save every this many optimizer steps; ``None``: at the end of every epoch."""
    keep_last: int | None = None
    """Keep only the newest this many checkpoints in ``dir`` (never the one the run resumed from)."""
    async_save: bool = False
    """Write in the background (at most one save in flight)."""
    on_error: Literal["raise", "warn"] = "raise"
    """A save that still fails after its retries raises, or warns and training goes on."""
    resume: str | None = None
    """``"auto"`` (newest valid checkpoint in ``dir``, else start fresh), a checkpoint path/URL, or ``None``."""
    new_run: bool = False
    """Start a new run in a ``dir`` that holds another run's checkpoints (refused otherwise); ``resume="auto"``
    then prefers the checkpoints of the run that saved last."""

    error: ClassVar[type[ValueError]] = CheckpointError
    """The error class of this section's checks."""

    def __post_init__(self) -> None:
        name, error = "CheckpointOptions", self.error
        object.__setattr__(self, "dir", check_path(self.dir, f"{name}(dir=...)", optional=True, error=error))
        check_int(self.every_n_steps, f"{name}(every_n_steps=...)", optional=True, error=error)
        check_int(self.keep_last, f"{name}(keep_last=...)", optional=True, error=error)
        check_bool(self.async_save, f"{name}(async_save=...)", error=error)
        check_bool(self.new_run, f"{name}(new_run=...)", error=error)
        check_choice(self.on_error, f"{name}(on_error=...)", ("raise", "warn"), error=error)
        if self.resume is not None and not isinstance(self.resume, str):
            raise error(f"`{name}(resume={self.resume!r})`: must be None, 'auto' or a checkpoint path/URL.")
        if self.dir is None:
            for field in ("every_n_steps", "keep_last"):
                if getattr(self, field) is not None:
                    raise error(
                        f"`{name}({field}=...)` applies to the checkpoints in `dir`, but `dir` is not set; set `dir=`."
                    )
            if self.resume == "auto":
                raise error(
                    f"`{name}(resume='auto')` looks for checkpoints in `dir`, but `dir` is not set; set `dir=`."
                )
            if self.new_run:
                raise error(
                    f"`{name}(new_run=True)` applies to the checkpoints in `dir`, but `dir` is not set; set `dir=`."
                )


@dataclass(frozen=True)
class BiasOptions:
    """Guards against coded bias: skew that comes from code, not data."""

    audit: Literal["warn", "error", "off"] = "warn"
    """The data-loading audit before the first step (samplers, seeds, workers, pipeline peers)."""
    fingerprint: Literal["warn", "error", "off"] = "warn"
    """The environment-fingerprint comparison across ranks and against a resumed checkpoint."""
    deterministic: bool = False
    """Deterministic algorithms, PYTHONHASHSEED for the ranks the strategy launches, per-replica worker seeds."""
    seed: int | None = None
    """Seed used by ``deterministic`` (default: ``PL_GLOBAL_SEED`` from ``seed_everything``)."""

    error: ClassVar[type[ValueError]] = BiasConfigError
    """The error class of this section's checks."""

    def __post_init__(self) -> None:
        name, error = "BiasOptions", self.error
        check_choice(self.audit, f"{name}(audit=...)", POLICIES, error=error)
        check_choice(self.fingerprint, f"{name}(fingerprint=...)", POLICIES, error=error)
        check_bool(self.deterministic, f"{name}(deterministic=...)", error=error)
        check_int(self.seed, f"{name}(seed=...)", minimum=None, optional=True, error=error)


@dataclass(frozen=True)
class TelemetryOptions:
    """Per-stage forward/backward/communication/idle times and the measured bubble, logged
    (:class:`~lightning_hpp.telemetry.PipelineTelemetry`)."""

    every_n_steps: int | None = None
    """Steps between two exchanges and logs; default the Trainer's ``log_every_n_steps``."""
    trace_step: int | None = None
    """The training batch (0-based) whose Chrome trace and PNG timeline rank 0 writes."""
    trace_dir: str | None = None
    """Where the pictures go; default the Trainer's ``log_dir``."""

    error: ClassVar[type[ValueError]] = TelemetryError
    """The error class of this section's checks."""

    def __post_init__(self) -> None:
        check_int(self.every_n_steps, "TelemetryOptions(every_n_steps=...)", optional=True, error=self.error)
        check_int(self.trace_step, "TelemetryOptions(trace_step=...)", minimum=0, optional=True, error=self.error)


@dataclass(frozen=True)
class PlacementOptions:
    """Which device kind each rank has, and what ``plan="auto"`` plans with."""

    device_map: Any = None
    """Override of the ranks' device kinds: ``"0:a100,1:h100"``, ``{0: "a100"}`` or a list; also
    ``HPP_DEVICE_KIND`` in the environment. Stages with ``device=`` go to ranks of that kind."""
    profile: str | None = None
    """A cost-profile JSON for ``plan="auto"`` instead of measuring the units."""
    watch: Any = "warn"
    """The straggler watch (:mod:`lightning_hpp.telemetry.watch`): ``"warn"`` (default), ``"stop"``
    (checkpoint with the measured speeds, exit code 75), ``"replan"`` (the same, exit code 76; started
    again with ``resume="auto"``, ``plan="auto"`` plans with those speeds), ``"off"``, or a
    :class:`~lightning_hpp.telemetry.slowdown.WatchOptions` (or a dict of its fields)."""
    memory: Any = None
    """Memory per device, in bytes, by device kind, that ``plan="auto"`` must fit every rank's stages in
    (``{"a100": 40e9}``): kinds not named have their datasheet's (``cpu``: unlimited). Where no ddp plan
    fits and ``sharding`` is not given, the plan may shard the stages (``data_parallel="fsdp"``)."""
    tp_across_hosts: bool = False
    """Let ``plan="auto"`` split a stage's layers over ranks of several hosts (tensor parallel's per-layer
    all-reduces then cross the hosts' network); by default a tensor-parallel group stays on one host."""
    profile_batch: Any = None
    """The batch ``plan="auto"`` profiles the model on, as the training loader gives it (same batch size): by
    default the loader's first batch. Where sequence lengths change from batch to batch, give one at the length
    the plan should be balanced and sized for (the longest, so that every batch fits the memory it assumed)."""

    error: ClassVar[type[ValueError]] = PlacementError
    """The error class of this section's checks."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory", _memory_by_kind(self.memory))
        if self.device_map is not None and not isinstance(self.device_map, (str, dict, list, tuple)):
            raise PlacementError(
                f"`PlacementOptions(device_map={self.device_map!r})`: use a string such as '0:a100,1:h100', "
                f"a dict {{rank: kind}} or a list of kinds."
            )
        try:
            parse_device_map(self.device_map)
        except PlacementError as err:
            raise PlacementError(f"`PlacementOptions(device_map={self.device_map!r})`: {err}") from None
        check_path(
            self.profile,
            "PlacementOptions(profile=...)",
            optional=True,
            error=PlacementError,
            kind="the path of a cost-profile JSON",
        )
        object.__setattr__(self, "watch", watch_options(self.watch))
        check_bool(self.tp_across_hosts, "PlacementOptions(tp_across_hosts=...)", error=PlacementError)

    def check_world(self, world_size: int) -> None:
        """Refuse a ``device_map`` (or ``$HPP_DEVICE_KIND`` map) whose ranks do not match a job of ``world_size``.

        Raises:
            PlacementError: a rank outside ``0..world_size-1``, or a rank of the job without a kind.
        """
        env = os.environ.get(DEVICE_KIND_ENV, "").strip()
        if self.device_map is not None:
            source, mapping = f"`PlacementOptions(device_map={self.device_map!r})`", parse_device_map(self.device_map)
        elif ":" in env:
            source, mapping = f"${DEVICE_KIND_ENV}={env!r}", parse_device_map(env)
        else:
            return
        outside = sorted(r for r in mapping if r >= world_size)
        if outside:
            raise PlacementError(
                f"{source} names rank(s) {outside}, but the job has {world_size} processes (ranks 0-{world_size - 1}). "
                f"Give one kind per rank of this job, e.g. {_example_map(world_size)!r}."
            )
        missing = [r for r in range(world_size) if r not in mapping]
        if missing:
            raise PlacementError(
                f"{source} gives no kind for rank(s) {missing} of the {world_size} processes. Give one kind per rank, "
                f"e.g. {_example_map(world_size)!r}."
            )


def _memory_by_kind(memory: Any) -> dict[str, float] | None:
    """``PlacementOptions(memory=...)`` as ``{kind: bytes}``, kinds normalized.

    Raises:
        PlacementError: not a mapping, a kind that is no kind name, or bytes that are not a number > 0.
    """
    if memory is None:
        return None
    example = "e.g. {'a100': 40e9, 'cpu': 16e9}"
    if not hasattr(memory, "items") or isinstance(memory, str):
        raise PlacementError(f"`PlacementOptions(memory={memory!r})`: give the bytes per device by kind, {example}.")
    out: dict[str, float] = {}
    for kind, value in dict(memory).items():
        name = normalize_kind(kind, "`PlacementOptions(memory=...)` kind")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise PlacementError(
                f"`PlacementOptions(memory={{{kind!r}: {value!r}}})`: the memory of a {name!r} device "
                f"must be a number of bytes > 0, {example}."
            )
        out[name] = float(value)
    return out


def _example_map(world_size: int) -> str:
    return ",".join(f"{r}:a100" for r in range(world_size))


@dataclass(frozen=True)
class InitOptions:
    """Initial weights of a model built on the meta device (``configure_model()`` or
    ``Trainer.init_module(empty_init=True)``): each rank materializes only its own stages."""

    weights: str | None = None
    """Load them from disk, reading only this rank's tensors: a ``.safetensors`` file, a transformers
    checkpoint directory (``model.safetensors`` or a sharded ``model.safetensors.index.json``), or a
    sharded checkpoint of this project. ``None``: each module's own initializer."""
    rename: str | None = None
    """A prefix of the model's parameter names that the file does not have (``"model."`` for a
    LightningModule holding ``self.model = LlamaForCausalLM(...)`` loading what ``save_pretrained`` wrote)."""
    seed: int | None = None
    """Base seed of the initializers (each module seeded by it and its name); default ``PL_GLOBAL_SEED`` or 0."""

    error: ClassVar[type[ValueError]] = CheckpointError
    """The error class of this section's checks (it names the weights to load)."""

    def __post_init__(self) -> None:
        for field in ("weights", "rename"):
            value = getattr(self, field)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise self.error(f"`InitOptions({field}={value!r})`: must be a path / string or None.")
        if self.weights is not None:
            object.__setattr__(self, "weights", os.fspath(self.weights))
        check_int(self.seed, "InitOptions(seed=...)", minimum=None, optional=True, error=self.error)


@dataclass(frozen=True)
class ShardingOptions:
    """How the replicas of each stage share its work (the data-parallel mode) and split it (tensor parallel).

    The job's ``world_size`` ranks form a ``pp × dp × tp`` layout: ``pp`` pipeline positions, ``dp``
    data-parallel replicas of each stage (each reads its own part of every batch), ``tp`` ranks per
    replica splitting the stage's layers. torch's ``DeviceMesh`` of the job has the dimensions
    ``("pp", "dp_replicate", "dp_shard", "tp")`` (size 1 where unused; ``"dp"`` is the flattened pair), and
    the LightningModule reads it as ``self.device_mesh`` (as under Lightning's ``ModelParallelStrategy``).

    The hsdp shape rule: ``dp = world_size / (pp × tp)`` replicas are ``dp_replicate`` groups of
    ``dp_shard = dp / dp_replicate`` ranks; each stage is sharded over the ``dp_shard`` ranks of a group and
    replicated over the groups (``dp_replicate`` must divide ``dp``). ``"ddp"`` is ``dp_replicate = dp,
    dp_shard = 1``, ``"fsdp"`` ``dp_replicate = 1, dp_shard = dp``.
    """

    data_parallel: Literal["ddp", "fsdp", "hsdp"] = "ddp"
    """``"ddp"``: every replica holds the whole stage, gradients all-reduced (the default); ``"fsdp"``: each
    stage's parameters, gradients and optimizer state sharded over its replicas (FSDP2 ``fully_shard`` on each
    unit and on the stage); ``"hsdp"``: sharded over ``dp_shard`` ranks, replicated ``dp_replicate`` times."""
    tp_degree: int = 1
    """Ranks that split each stage replica's layers by tensor parallelism (1: none)."""
    reshard_after_forward: bool | None = None
    """FSDP2's choice of freeing the gathered parameters after each forward. ``None``: ``False``, the right
    default for a micro-batched schedule: the stage's parameters are gathered once per step and stay gathered
    until its last backward, instead of once per forward and once per backward of every micro-batch (what
    ``True`` costs, in exchange for holding only the shards between micro-batches)."""
    dp_replicate: int | None = None
    """``"hsdp"`` only, and required there: the number of replica groups (see the shape rule above)."""

    error: ClassVar[type[ValueError]] = ShardingError
    """The error class of this section's checks."""

    def __post_init__(self) -> None:
        name, error = "ShardingOptions", self.error
        check_choice(self.data_parallel, f"{name}(data_parallel=...)", DATA_PARALLEL, error=error)
        check_int(self.tp_degree, f"{name}(tp_degree=...)", error=error)
        check_bool(self.reshard_after_forward, f"{name}(reshard_after_forward=...)", optional=True, error=error)
        check_int(self.dp_replicate, f"{name}(dp_replicate=...)", optional=True, error=error)
        if self.data_parallel == "hsdp" and self.dp_replicate is None:
            raise error(
                f"`{name}(data_parallel='hsdp')` shards each stage over `dp / dp_replicate` ranks and replicates "
                f"it `dp_replicate` times, but `dp_replicate` is not set. Give it, e.g. "
                f"`{name}(data_parallel='hsdp', dp_replicate=2)`."
            )
        if self.data_parallel != "hsdp" and self.dp_replicate is not None:
            raise error(
                f"`{name}(dp_replicate={self.dp_replicate})` applies to data_parallel='hsdp' only, but "
                f"data_parallel={self.data_parallel!r}. Drop `dp_replicate`, or use data_parallel='hsdp'."
            )
        if self.data_parallel == "ddp" and self.reshard_after_forward is not None:
            raise error(
                f"`{name}(reshard_after_forward={self.reshard_after_forward})` applies to sharded stages "
                f"(data_parallel='fsdp' or 'hsdp'), but data_parallel='ddp'. Drop it, or shard the stages."
            )

    @property
    def sharded(self) -> bool:
        """Whether each stage is sharded over (some of) its replicas."""
        return self.data_parallel != "ddp"

    def dims(self, world_size: int, pp: int, origin: str | None = None) -> ParallelDims:
        """The degrees of ``world_size`` ranks in ``pp`` pipeline positions under these options (the shape rule of
        the class docstring), checked by :meth:`~lightning_hpp.pipeline.dims.ParallelDims.resolve`.

        Raises:
            PlanError: ``pp × tp_degree`` more than the processes or not dividing them (``origin``: what set ``pp``).
            ShardingError: ``dp_replicate`` does not divide the replicas.
        """
        return ParallelDims.resolve(
            world_size,
            pp,
            tp=self.tp_degree,
            data_parallel=self.data_parallel,
            dp_replicate=self.dp_replicate,
            origin=origin,
        )


Section = TypeVar(
    "Section", CheckpointOptions, BiasOptions, TelemetryOptions, PlacementOptions, InitOptions, ShardingOptions
)


def section(cls: type[Section], value: Any, arg: str) -> Section:
    """``value`` as a ``cls``: an instance, a dict of its fields, or ``None`` (the defaults).

    Raises:
        ``cls.error``: unknown keys in the dict, or a value that is none of these.
    """
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict) or hasattr(value, "items"):
        if type(value).__module__.startswith("omegaconf"):  # a Hydra node: plain containers all the way down
            from omegaconf import OmegaConf

            value = OmegaConf.to_container(value, resolve=True)
        data = {k: v for k, v in dict(value).items() if k != "_target_"}
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise cls.error(
                f"`HPPStrategy({arg}=...)` has unknown keys {unknown}; `{cls.__name__}` takes {sorted(fields)}."
            )
        return cls(**data)
    raise cls.error(f"`HPPStrategy({arg}={value!r})`: pass a `{cls.__name__}(...)`, a dict of its fields, or None.")


# the flat options of the first release, and where each one lives now
_MOVED = {
    **{
        k: f"HPPStrategy(checkpoint=CheckpointOptions({v}=...))"
        for k, v in (
            ("checkpoint_dir", "dir"),
            ("resume", "resume"),
            ("save_every_n_steps", "every_n_steps"),
            ("keep_last", "keep_last"),
            ("async_save", "async_save"),
            ("save_on_error", "on_error"),
        )
    },
    **{k: f"HPPStrategy(bias=BiasOptions({k}=...))" for k in ("deterministic", "seed", "audit", "fingerprint")},
    **{
        k: f"HPPStrategy(placement=PlacementOptions({v}=...))"
        for k, v in (("device_map", "device_map"), ("auto_profile", "profile"))
    },
    **{k: f"Trainer(plugins=[HPPPrecision({k}=...)])" for k in ("clip", "fp8_backend", "fp8_recipe", "nonfinite")},
}


def moved_option_hint(name: str) -> str:
    """Where a keyword argument of the first release's ``HPPStrategy`` lives now ("" if it never existed)."""
    return f" It moved: use `{_MOVED[name]}`." if name in _MOVED else ""
