"""The Hydra entry point: ``lightning-hpp-train`` and ``python -m lightning_hpp.hydra.train``.

A single run composes ``configs/train.yaml`` with the command-line overrides, builds every part
with ``hydra.utils.instantiate``, checks the plan against the model's units, writes the experiment
snapshot and calls ``Trainer.fit``. Lightning's subprocess launcher starts ranks 1..N-1 by running
the same command again with the run directory pinned (``hydra.run.dir``), so every rank composes
the same config.

A multirun (``-m``, or ``hparams_search=optuna``) does not train in the sweeping process: Lightning
would re-launch the whole sweep command in every rank (Lightning issue #11300). Instead every trial
is started as a fresh single-run process::

    python -m lightning_hpp.hydra.train <the trial's overrides> hydra.run.dir=<trial dir> hydra.mode=RUN

in a session of its own, with a fresh ``MASTER_PORT``. The sweeper waits for it, ends whatever
it left behind, and reads the metric from the ``result.json`` that the trial's rank 0 writes (the
process side, :mod:`lightning_hpp.hydra.trial_process`).
Trials therefore run one after another and share no process, port or process group. Each trial
dir gets a ``trial.json`` record, which :mod:`lightning_hpp.hydra.summary` reads at the end.

Under the study sweeper (``hparams_search=asha``, :mod:`lightning_hpp.hydra.study`) a trial also
reports to its study and may be pruned (:mod:`lightning_hpp.hydra.trial`); its record then says
``"status": "pruned"``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from lightning_hpp.errors import PlanError, TrainConfigError
from lightning_hpp.hydra.trial import StudyReporter, TrialLink, follow_driver
from lightning_hpp.hydra.trial_process import (
    end_process_group,  # noqa: F401 - where tests and users import it from
    error_line,
    log_tail,
    read_json,
    run_trial_process,
    trial_command,
)
from lightning_hpp.planning.plan import StagePlan, StageSpec
from lightning_hpp.validation import check_int

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
"""The configs/ tree next to the package (an editable install or a source checkout)."""

RESULT_FILE = "result.json"
"""Written by rank 0 of a run: the final metrics."""

TRIAL_FILE = "trial.json"
"""Written by the sweeping process into every trial directory: overrides, status and metrics."""

AUTO = "auto"

_RANK_VARS = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
_LAUNCH_VARS = (*_RANK_VARS, "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT", "PL_GLOBAL_SEED", "PL_SEED_WORKERS")
_CREDENTIAL_SETS = (
    ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
    ("AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"),
    ("AWS_CONTAINER_CREDENTIALS_FULL_URI",),
    ("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",),
)
_OBJECT_STORES = ("s3://", "s3a://")


# --------------------------------------------------------------------------- config targets
def make_model(module: Callable[..., Any], optimizer: Mapping[str, Any] | None = None) -> Any:
    """Build a LightningModule from its class (a ``_partial_``) and its optimizer arguments.

    The model configs keep the optimizer's arguments apart (``model.optimizer.lr``) so sweeps
    name them the same way for every model; they are passed to the constructor.

    Args:
        module: The LightningModule class, or a ``functools.partial`` of it with the architecture
            arguments bound.
        optimizer: Constructor arguments that set up the optimizer (``lr``, ``weight_decay``...).

    Raises:
        TrainConfigError: an argument given both in ``module`` and in ``optimizer``.
    """
    kwargs = dict(optimizer or {})
    bound = getattr(module, "keywords", {}) or {}
    twice = sorted(set(bound) & set(kwargs))
    if twice:
        raise TrainConfigError(
            f"`model.module` and `model.optimizer` both set {twice}; set optimizer arguments only under "
            f"`model.optimizer` (for example `model.optimizer.{twice[0]}=...`)."
        )
    return module(**kwargs)


def uniform_plan(
    unit_names: Sequence[str],
    num_stages: int,
    device: str | None = None,
    precision: str | None = None,
    clip_norm: float | None = None,
) -> StagePlan:
    """The same number of units in every stage (the first ``len(units) % num_stages`` get one more).

    Args:
        unit_names: The model's pipeline units, in order.
        num_stages: Number of stages.
        device, precision, clip_norm: The same value for every stage (see :class:`StageSpec`).

    Raises:
        PlanError: ``num_stages`` is not a positive int or exceeds the number of units.
    """
    names = list(unit_names)
    check_int(num_stages, "plan.num_stages", error=PlanError)
    if num_stages > len(names):
        raise PlanError(
            f"`plan.num_stages={num_stages}` but the model has only {len(names)} units "
            f"({', '.join(names)}); use at most {len(names)} stages."
        )
    sizes = [len(names) // num_stages + (1 if k < len(names) % num_stages else 0) for k in range(num_stages)]
    stages, start = [], 0
    for size in sizes:
        stages.append(
            StageSpec(modules=names[start : start + size], device=device, precision=precision, clip_norm=clip_norm)
        )
        start += size
    return StagePlan(stages)


def auto_plan() -> str:
    """The ``plan`` value for a plan that HPPStrategy profiles and balances at setup."""
    return AUTO


def object_key(path: str) -> str:
    """An object-store key for a local run directory (the ``${hpp.object_key:...}`` resolver).

    Relative to the working directory when the run directory lies below it, else the absolute path
    without its leading slash; the same on every rank, since the run directory is.
    """
    p = Path(str(path)).resolve()
    try:
        rel = p.relative_to(Path.cwd().resolve())
    except ValueError:
        rel = Path(*p.parts[1:])
    return rel.as_posix().strip("/") or "run"


OmegaConf.register_new_resolver("hpp.object_key", object_key, replace=True)


# --------------------------------------------------------------------------- checks
def check_config(cfg: DictConfig) -> dict[str, Any]:
    """Resolve the config and refuse secrets in it and object-store URLs without credentials.

    Returns:
        The resolved config as plain containers.

    Raises:
        TrainConfigError: an unset environment variable the config needs, a secret written in the
            config, or an ``s3://`` URL while the environment has no S3 credentials.
    """
    from lightning_hpp.redaction import redact

    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as err:
        key = getattr(err, "full_key", None) or "the config"
        raise TrainConfigError(
            f"`{key}` could not be resolved: {getattr(err, 'msg', err)}. Set the environment variable it "
            f"names, or override `{key}` on the command line."
        ) from None
    for path, value, clean in _differences(resolved, redact(resolved)):
        raise TrainConfigError(
            f"`{path}` holds a secret ({clean!r} after redaction). Credentials are read from the "
            f"environment only (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN...); "
            f"remove `{path}` from the config and the command line."
        )
    urls = [(path, v) for path, v in _strings(resolved) if v.startswith(_OBJECT_STORES)]
    if urls and not any(all(os.environ.get(v) for v in names) for names in _CREDENTIAL_SETS):
        path, url = urls[0]
        raise TrainConfigError(
            f"`{path}` is {url!r}, but the environment has no S3 credentials. Set AWS_ACCESS_KEY_ID and "
            f"AWS_SECRET_ACCESS_KEY (plus AWS_ENDPOINT_URL for an S3-compatible server), or use a local "
            f"checkpoint (`checkpoint=local`). Credentials are never read from the config."
        )
    return resolved


def _strings(obj: Any, path: str = "") -> list[tuple[str, str]]:
    if isinstance(obj, str):
        return [(path, obj)]
    if isinstance(obj, Mapping):
        return [item for k, v in obj.items() for item in _strings(v, f"{path}.{k}" if path else str(k))]
    if isinstance(obj, (list, tuple)):
        return [item for i, v in enumerate(obj) for item in _strings(v, f"{path}.{i}")]
    return []


def _differences(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return [d for k in a for d in _differences(a[k], b.get(k), f"{path}.{k}" if path else str(k))]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}.{i}")]
    return [] if a == b else [(path, a, b)]


def is_rank_zero() -> bool:
    """Whether this process is global rank 0 of its job, from the launcher's environment."""
    return all(int(os.environ.get(v, "0") or 0) == 0 for v in _RANK_VARS)


# --------------------------------------------------------------------------- building a run
@dataclass
class Run:
    """Everything a single run builds from its config, before ``fit``."""

    trainer: Any
    model: Any
    datamodule: Any
    strategy: Any
    plan: StagePlan | str | None
    """What the strategy receives: a plan, ``"auto"``, or None (the ``@stage`` decorators)."""
    resolved_plan: StagePlan | str | None
    """The plan with every stage's units spelled out (``"auto"`` until the strategy has run)."""
    callbacks: list[Any] = field(default_factory=list)
    loggers: list[Any] = field(default_factory=list)


def build_plan(node: DictConfig | None, model: Any) -> tuple[StagePlan | str | None, StagePlan | str | None]:
    """Build the plan group's value and check it against the model's units.

    Args:
        node: The ``plan`` config (a ``StagePlan`` target, a ``_partial_`` factory called with the
            unit names, or ``auto_plan``), or None for the model's ``@stage`` decorators.
        model: The LightningModule.

    Returns:
        ``(plan for the strategy, plan with units spelled out)``.

    Raises:
        TrainConfigError: the plan names units the model does not have, misses some, or is not a plan.
    """
    from lightning_hpp.model.units import find_units

    units = find_units(model)
    names = [n for n, _ in units]
    choice = _choice("plan")
    if node is None:
        plan = StagePlan.from_decorators(units)
        if plan is None:
            raise TrainConfigError(
                f"`~plan` (no plan group) uses the model's `@stage` decorators, but `{type(model).__name__}` has none. "
                f"Pick a plan (plan=uniform, plan=auto, or a plan listing the units {names})."
            )
        return None, plan.with_modules(plan.resolve(names))
    try:
        plan = hydra.utils.instantiate(node)
        if callable(plan) and not isinstance(plan, (StagePlan, str)):
            plan = plan(names)
        if plan == AUTO:
            return AUTO, AUTO
        if not isinstance(plan, StagePlan):
            raise TrainConfigError(
                f"`plan={choice}` built {type(plan).__name__}; a plan config must build a `StagePlan`, a "
                f"factory called with the unit names, or `auto_plan`."
            )
        return plan, plan.with_modules(plan.resolve(names))
    except PlanError as err:
        units = "" if ", ".join(names) in str(err) else f" The model's units are: {', '.join(names)}."
        raise TrainConfigError(
            f"The plan `plan={choice}` does not fit the model `{type(model).__name__}`: {err}{units} Choose a "
            f"plan made for this model, or plan=uniform."
        ) from None


def build_strategy(node: DictConfig, plan: StagePlan | str | None, trainer_node: DictConfig) -> Any:
    """Instantiate the strategy; HPPStrategy receives the plan.

    Raises:
        TrainConfigError: FSDP on a CPU trainer (Lightning runs FSDP on CUDA only).
    """
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_hpp.strategy import HPPStrategy

    factory = hydra.utils.instantiate(node, _partial_=True)
    cls = factory.func if isinstance(factory, functools.partial) else factory
    if isinstance(cls, type) and issubclass(cls, HPPStrategy):
        return factory(plan=plan)
    if isinstance(cls, type) and issubclass(cls, FSDPStrategy) and _runs_on_cpu(trainer_node):
        raise TrainConfigError(
            f"`strategy={_choice('strategy')}` (FSDP) needs CUDA devices in Lightning, but the trainer runs on "
            f"the CPU (`trainer.accelerator={trainer_node.get('accelerator')!r}`). Use strategy=ddp as the CPU "
            f"baseline, or trainer=gpu."
        )
    return factory()


def _runs_on_cpu(trainer_node: DictConfig) -> bool:
    accelerator = str(trainer_node.get("accelerator", "auto")).lower()
    if accelerator == "auto":
        import torch

        return not torch.cuda.is_available()
    return accelerator == "cpu"


def _choice(group: str) -> str:
    if HydraConfig.initialized():
        return str(HydraConfig.get().runtime.choices.get(group, "?"))
    return "?"


def _instantiate_all(node: DictConfig | None) -> dict[str, Any]:
    if not node:
        return {}
    return {name: hydra.utils.instantiate(sub) for name, sub in node.items() if sub is not None}


def build(cfg: DictConfig) -> Run:
    """Build model, data, plan, strategy, callbacks, loggers and Trainer from a composed config.

    Raises:
        TrainConfigError: a plan that does not fit the model, FSDP on CPU.
    """
    from lightning.pytorch.callbacks import LearningRateMonitor

    from lightning_hpp.redaction import redact_loggers

    datamodule = hydra.utils.instantiate(cfg.data)
    model = hydra.utils.instantiate(cfg.model)
    plan, resolved = build_plan(cfg.get("plan"), model)
    strategy = build_strategy(cfg.strategy, plan, cfg.trainer)
    loggers = list(_instantiate_all(cfg.get("logger")).values())
    redact_loggers(loggers)  # HPPStrategy does it too; the DDP and FSDP baselines need it here
    callbacks = []
    for name, callback in _instantiate_all(cfg.get("callbacks")).items():
        if isinstance(callback, LearningRateMonitor) and not loggers:
            log.info("callbacks.%s dropped: LearningRateMonitor needs a logger (~logger).", name)
            continue
        callbacks.append(callback)
    link = TrialLink.from_env()
    if link is not None:  # a trial of a study sweep: report to the study, stop when pruned
        callbacks.append(StudyReporter(link, str(cfg.optimized_metric)))
    checkpoint = hydra.utils.instantiate(cfg.checkpoint) if cfg.get("checkpoint") else None
    if checkpoint is not None:
        callbacks.append(checkpoint)
    # HPPStrategy's own step-<N> checkpoints (`strategy.checkpoint.dir`) need checkpointing on as well
    own_dir = OmegaConf.select(cfg, "strategy.checkpoint.dir", default=None)
    trainer = hydra.utils.instantiate(cfg.trainer, _partial_=True)(
        strategy=strategy,
        callbacks=callbacks,
        logger=loggers or False,
        enable_checkpointing=checkpoint is not None or own_dir is not None,
    )
    return Run(trainer, model, datamodule, strategy, plan, resolved, callbacks, loggers)


# --------------------------------------------------------------------------- one run
def run(cfg: DictConfig) -> float | None:
    """Train once (this process is one rank of the job) and return ``optimized_metric``.

    Rank 0 writes the snapshot before ``fit`` and ``result.json`` after it.
    """
    import lightning as L
    import torch

    from lightning_hpp.hydra.snapshot import scrub_hydra_files, write_snapshot

    run_dir = Path(cfg.paths.output_dir)
    follow_driver(TrialLink.from_env())
    if is_rank_zero():
        scrub_hydra_files(run_dir)
    resolved = check_config(cfg)
    if cfg.get("torch_threads"):
        torch.set_num_threads(int(cfg.torch_threads))
    L.seed_everything(cfg.seed, workers=True)
    built = build(cfg)
    if is_rank_zero():
        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
        write_snapshot(run_dir, resolved, plan=built.resolved_plan, overrides=overrides)
    built.trainer.fit(built.model, datamodule=built.datamodule, ckpt_path=cfg.get("ckpt_path"))
    trainer = built.trainer
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
    value = metrics.get(cfg.optimized_metric)
    if trainer.is_global_zero:
        result = {
            "metric": cfg.optimized_metric,
            "value": value,
            "metrics": metrics,
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "should_stop": bool(trainer.should_stop),
        }
        reporter = next((c for c in built.callbacks if isinstance(c, StudyReporter)), None)
        if reporter is not None:
            result["study"] = reporter.state()
        (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=2))
    # a sweep fails the trial with this (launch_trial); a single run does not need it
    if value is None and trainer.is_global_zero:
        log.info("optimized_metric %r was not logged; logged: %s", cfg.optimized_metric, sorted(metrics))
    return value


# --------------------------------------------------------------------------- one trial of a sweep
def launch_trial(cfg: DictConfig) -> float:
    """Run one trial of a multirun as a fresh process and return its ``optimized_metric``.

    A failed trial returns NaN (Optuna records it as failed; the summary lists it last).

    Raises:
        TrainConfigError: the trial's config fails the checks of :func:`check_config`.
    """
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    from lightning_hpp.hydra.snapshot import scrub_hydra_files
    from lightning_hpp.redaction import redact

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    scrub_hydra_files(run_dir)
    scrub_hydra_files(Path(hc.sweep.dir))
    check_config(cfg)
    port = find_free_network_port()
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(MASTER_ADDR=env.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(port))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    cmd = trial_command(hc, str(run_dir))
    (run_dir / RESULT_FILE).unlink(missing_ok=True)
    timeout = cfg.sweep.get("trial_timeout")
    grace = float(cfg.sweep.get("kill_grace", 10))
    started_at, start = time.time(), time.monotonic()
    log.info("trial %s: %s (MASTER_PORT=%d)", hc.job.num, " ".join(hc.overrides.task), port)
    status, returncode, leftovers = run_trial_process(cmd, env, run_dir / "trial.log", timeout, grace)
    seconds = time.monotonic() - start
    result = read_json(run_dir / RESULT_FILE)
    value = result.get("value") if result else None
    error, tail = None, log_tail(run_dir / "trial.log")
    if status == "ok" and returncode != 0:
        status, error = "failed", error_line(tail) or f"the trial exited with {returncode}"
    elif status == "ok" and ((result or {}).get("study") or {}).get("pruned"):
        status = "pruned"
    elif status == "ok" and value is None:
        status = "failed"
        error = f"metric {cfg.optimized_metric!r} was not logged; logged: {sorted((result or {}).get('metrics', {}))}"
    elif status == "timeout":
        error = f"the trial ran longer than sweep.trial_timeout={timeout}s and was ended"
    record = {
        "num": hc.job.num,
        "overrides": redact(list(hc.overrides.task)),
        "status": status,
        "returncode": returncode,
        "metric": cfg.optimized_metric,
        "value": value,
        "metrics": (result or {}).get("metrics", {}),
        "global_step": (result or {}).get("global_step"),
        "seconds": round(seconds, 3),
        "started_at": started_at,
        "ended_at": time.time(),
        "master_port": port,
        "leftover_processes": leftovers,
        "study": (result or {}).get("study"),
        "run_dir": str(run_dir),
        "error": redact(error),
        "log_tail": redact(tail) if status not in ("ok", "pruned") else None,
    }
    (run_dir / TRIAL_FILE).write_text(json.dumps(record, indent=2))
    if status == "pruned":
        log.info("trial %s: pruned at step %s", hc.job.num, result["study"]["pruned_at_step"])
        return math.nan if value is None else float(value)
    if status != "ok":
        log.error("trial %s %s: %s", hc.job.num, status, error)
        return math.nan
    log.info("trial %s: %s=%.6g in %.1fs", hc.job.num, cfg.optimized_metric, value, seconds)
    return float(value)


# --------------------------------------------------------------------------- entry point
def task(cfg: DictConfig) -> float | None:
    """Hydra's task function: a trial launcher in a multirun, a training run otherwise."""
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return launch_trial(cfg)
    return run(cfg)


def refuse_secret_overrides(args: Sequence[str]) -> None:
    """Exit with a :class:`TrainConfigError` line when a command-line argument holds a secret.

    Runs before Hydra parses the command line: Hydra's own error report (``Error executing job
    with overrides: [...]``) would print the secret.
    """
    from lightning_hpp.redaction import secret_overrides

    found = secret_overrides(args)
    if found:
        shown = ", ".join(repr(arg) for _, arg in found)
        error = TrainConfigError(
            f"The command line holds a secret in `{found[0][0]}` ({shown} after redaction). Credentials are read "
            f"from the environment only (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN...); remove "
            f"the override and set the variable in the environment instead."
        )
        sys.exit(f"{type(error).__name__}: {error}")


_HARMLESS_WARNINGS = (
    # Lightning 2.6.6 calls a torch pytree API that torch 2.13 deprecates (once per rank and loader)
    r".*isinstance\(treespec, LeafSpec\)` is deprecated",
    # LightningDataModule.from_datasets asks for pinned memory; on a CPU trainer torch ignores it
    r"'pin_memory' argument is set as true but no accelerator is found",
)


def main() -> None:
    """Hydra parses ``sys.argv`` (overrides, ``-m``, ``--cfg``...) and runs :func:`task`."""
    import warnings

    for message in _HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    # `_target_`s may live in the working directory (examples/, a user's project), as with `python -m`.
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    refuse_secret_overrides(sys.argv[1:])
    hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")(task)()


def cli() -> None:
    """Console script ``lightning-hpp-train`` (and ``python -m lightning_hpp.hydra.train``).

    Every rank must hash strings alike (else set iteration order differs between ranks and the bias
    guards note it): with ``PYTHONHASHSEED`` unset, the command restarts itself once with
    ``PYTHONHASHSEED=0``, as ``scripts/demo.sh`` sets it; the ranks Lightning starts and the trials of
    a sweep inherit it. A value the user set is kept.
    """
    if "PYTHONHASHSEED" not in os.environ and not any(v in os.environ for v in _RANK_VARS):
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    main()


if __name__ == "__main__":
    cli()
