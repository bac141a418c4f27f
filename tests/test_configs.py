"""Every config of configs/ composed and instantiated (no training, no processes), and the
pieces of the entry point that need no process: plans, checks, snapshots, sweep summaries."""

from __future__ import annotations

import functools
import json
import math
import subprocess
from collections.abc import Callable
from pathlib import Path

import hydra
import lightning as L
import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint, ModelSummary
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from omegaconf import DictConfig, open_dict

from lightning_hpp import HPPPrecision, HPPStrategy, PlanError, StagePlan
from lightning_hpp.errors import SweepError, TrainConfigError
from lightning_hpp.hydra.snapshot import code_version, scrub_hydra_files, write_snapshot
from lightning_hpp.hydra.summary import SweepSummary, load_trials, summarize, swept_parameters
from lightning_hpp.hydra.train import CONFIG_DIR, build, build_plan, check_config, make_model, object_key, uniform_plan
from lightning_hpp.options import BiasOptions, CheckpointOptions, PlacementOptions, TelemetryOptions
from tests.harness.zoo import MLP

import sklearn  # noqa: F401,E402 - installed by scripts/setup.sh: a missing one is a broken environment, not a skip

SECRET = "hpp-test-Secret-3c9f1e7a5b"


@pytest.fixture(autouse=True)
def _clean_hydra(monkeypatch):
    monkeypatch.setenv("HPP_S3_BUCKET", "hpp-bucket")
    yield
    GlobalHydra.instance().clear()
    HydraConfig.instance().cfg = None


def compose_cfg(tmp_path: Path, *overrides: str, keep_hydra: bool = False) -> DictConfig:
    """Compose configs/train.yaml as the entry point would, with HydraConfig set."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name="test"):
        cfg = compose("train", overrides=[*overrides, f"paths.output_dir={tmp_path}"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    if not keep_hydra:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


def _units(model) -> list[str]:
    from lightning_hpp.model.units import find_units

    return [n for n, _ in find_units(model)]


# ------------------------------------------------------------------ one check per config file
def check_train(tmp_path):
    run = build(compose_cfg(tmp_path))
    assert isinstance(run.strategy, HPPStrategy) and run.strategy is run.trainer.strategy
    assert type(run.model).__name__ == "HybridVisionModel"
    assert [s.precision for s in run.plan.stages] == ["16-mixed", "fp8", "bf16-mixed"]
    assert run.trainer.max_epochs == 8 and run.trainer.num_devices == 3
    assert type(run.datamodule).__name__ == "DigitsDataModule" and run.datamodule.n_microbatches == 4


def _trainer(tmp_path, *overrides):
    cfg = compose_cfg(tmp_path, *overrides)
    return hydra.utils.instantiate(cfg.trainer)


def check_trainer_default(tmp_path):
    trainer = _trainer(tmp_path, "trainer=default")
    assert trainer.num_devices == 1 and trainer.max_epochs == 8 and trainer.default_root_dir == str(tmp_path)


def check_trainer_cpu(tmp_path):
    trainer = _trainer(tmp_path, "trainer=cpu", "trainer.devices=2")
    assert trainer.num_devices == 2 and type(trainer.accelerator).__name__ == "CPUAccelerator"


def check_trainer_gpu(tmp_path):
    cfg = compose_cfg(tmp_path, "trainer=gpu")
    factory = hydra.utils.instantiate(cfg.trainer, _partial_=True)
    assert factory.func is L.Trainer
    assert factory.keywords["accelerator"] == "gpu" and factory.keywords["devices"] == 3
    if not torch.cuda.is_available():
        with pytest.raises(Exception, match="(?i)gpu|cuda"):
            factory()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_trainer_runs_on_cuda(tmp_path):
    trainer = _trainer(tmp_path, "trainer=gpu", "trainer.devices=1")
    assert trainer.strategy.root_device.type == "cuda" and trainer.num_devices == 1


def _stage_precision(strategy: HPPStrategy) -> HPPPrecision:
    """The HPPPrecision the strategy runs its stages with: the one it was given, else (a Lightning
    default plugin from the Trainer's ``precision``) a default ``HPPPrecision()`` installed at setup."""
    plugin = strategy.precision_plugin
    return plugin if isinstance(plugin, HPPPrecision) else HPPPrecision()


def check_strategy_hpp(tmp_path):
    # strategy/hpp.yaml lists only overrides of the constructor's defaults: other options are added with `+`
    cfg = compose_cfg(tmp_path, "experiment=mlp_tiny", "strategy.n_microbatches=8", "+strategy.schedule=gpipe")
    assert set(cfg.strategy) == {"_target_", "_convert_", "plan", "n_microbatches", "timeout", "schedule"}
    run = build(cfg)
    assert isinstance(run.strategy, HPPStrategy)
    assert run.strategy.schedule == "gpipe" and run.strategy.n_microbatches == 8
    precision = _stage_precision(run.strategy)
    assert precision.clip == "global" and precision.fp8_backend is None
    assert run.strategy.spec.plan is run.plan and run.plan.num_stages == 2


def test_hpp_option_sections_from_the_command_line(tmp_path):
    # nested option sections reach HPPStrategy as plain dicts and lists (`_convert_: all`), a
    # `_target_`ed section or precision plugin as the object it names
    cfg = compose_cfg(
        tmp_path, "experiment=mlp_tiny", f"+strategy.checkpoint.dir={tmp_path / 'ckpt'}",
        "+strategy.checkpoint.keep_last=2",
        "+strategy.bias._target_=lightning_hpp.options.BiasOptions", "+strategy.bias.audit=error",
        "+strategy.placement.device_map=[cpu,cpu]", "+strategy.telemetry.trace_step=3",
        "+strategy.precision_plugin._target_=lightning_hpp.HPPPrecision", "+strategy.precision_plugin.clip=global",
    )
    run = build(cfg)
    assert run.strategy._checkpoint == CheckpointOptions(dir=str(tmp_path / "ckpt"), keep_last=2)
    # mlp_tiny has no checkpoint group; the strategy's own dir turns checkpointing on
    assert run.trainer.checkpoint_callbacks
    assert run.strategy._bias == BiasOptions(audit="error")
    assert run.strategy._placement == PlacementOptions(device_map=["cpu", "cpu"])
    assert run.strategy._telemetry == TelemetryOptions(trace_step=3)
    assert isinstance(run.strategy.precision_plugin, HPPPrecision) and run.strategy.precision_plugin.clip == "global"
    with pytest.raises(Exception, match=r"`CheckpointOptions\(async_save='no'\)`: must be True or False"):
        build(compose_cfg(tmp_path, "experiment=mlp_tiny", "+strategy.checkpoint.async_save='no'"))


DDP_KEYS = {"_target_", "process_group_backend", "find_unused_parameters"}


def check_strategy_hpp_fp8_emulate(tmp_path):
    run = build(compose_cfg(tmp_path, "experiment=mlp_tiny", "strategy=hpp_fp8_emulate", "n_microbatches=2"))
    assert isinstance(run.strategy, HPPStrategy) and run.strategy.n_microbatches == 2
    assert _stage_precision(run.strategy).fp8_backend == "emulate"


def check_strategy_ddp(tmp_path):
    for experiment in ("mlp_tiny", "hybrid_vision"):
        cfg = compose_cfg(tmp_path, f"experiment={experiment}", "strategy=ddp")
        assert set(cfg.strategy) == DDP_KEYS  # nothing HPP-specific leaks into DDP's kwargs
        run = build(cfg)
        assert type(run.strategy) is DDPStrategy and run.trainer.strategy is run.strategy
        assert run.strategy._ddp_kwargs == {"find_unused_parameters": False}


def check_strategy_fsdp(tmp_path):
    cfg = compose_cfg(tmp_path, "experiment=mlp_tiny", "strategy=fsdp")
    strategy = hydra.utils.instantiate(cfg.strategy)
    assert isinstance(strategy, FSDPStrategy)
    if not torch.cuda.is_available():
        with pytest.raises(TrainConfigError, match="strategy=ddp"):
            build(cfg)


def check_plan_hybrid(tmp_path):
    cfg = compose_cfg(tmp_path, "plan=hybrid", "plan.stages.1.clip_norm=0.7")
    model = hydra.utils.instantiate(cfg.model)
    plan, resolved = build_plan(cfg.plan, model)
    assert isinstance(plan, StagePlan)
    assert [s.modules for s in resolved.stages] == [["encoder"], ["transformer"], ["classifier"]]
    assert [s.precision for s in plan.stages] == ["16-mixed", "fp8", "bf16-mixed"]
    assert [s.clip_norm for s in plan.stages] == [1.0, 0.7, 1.0]
    assert [s.device for s in plan.stages] == ["a100", "h100", "h100"]


def check_plan_uniform(tmp_path):
    cfg = compose_cfg(tmp_path, "experiment=mlp_tiny", "plan=uniform", "plan.clip_norm=0.5")
    model = hydra.utils.instantiate(cfg.model)
    plan, resolved = build_plan(cfg.plan, model)
    assert [s.modules for s in plan.stages] == [[f"layers.{i}" for i in range(4)], [f"layers.{i}" for i in range(4, 7)]]
    assert all(s.clip_norm == 0.5 for s in plan.stages) and resolved.to_dict() == plan.to_dict()


def check_plan_auto(tmp_path):
    cfg = compose_cfg(tmp_path, "experiment=mlp_tiny", "plan=auto")
    model = hydra.utils.instantiate(cfg.model)
    assert build_plan(cfg.plan, model) == ("auto", "auto")
    strategy = HPPStrategy(plan="auto")
    assert strategy.plan is None  # resolved at setup from a measured profile (tests/test_placement_strategy.py)


def check_plan_mlp(tmp_path):
    cfg = compose_cfg(tmp_path, "experiment=mlp_tiny", "plan=mlp")
    model = hydra.utils.instantiate(cfg.model)
    _, resolved = build_plan(cfg.plan, model)
    assert [len(s.modules) for s in resolved.stages] == [4, 3]
    assert sum((s.modules for s in resolved.stages), []) == _units(model)


def check_model_hybrid_vision(tmp_path):
    cfg = compose_cfg(tmp_path, "model=hybrid_vision", "model.optimizer.lr=1e-4")
    model = hydra.utils.instantiate(cfg.model)
    assert _units(model) == ["encoder", "transformer", "classifier"]
    assert model.hparams.lr == 1e-4 and model.hparams.weight_decay == 0.05 and model.hparams.image_size == 8
    assert sum(p.numel() for p in model.parameters()) == 70794


def check_model_hybrid_vision_small(tmp_path):
    cfg = compose_cfg(tmp_path, "model=hybrid_vision_small")
    model = hydra.utils.instantiate(cfg.model)
    assert model.hparams.dim == 32 and model.hparams.channels == 16 and model.hparams.lr == 3e-3
    assert sum(p.numel() for p in model.parameters()) < 70794 / 3
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


def check_model_mlp(tmp_path):
    cfg = compose_cfg(tmp_path, "experiment=mlp_tiny", "model.optimizer.lr=0.25", "seed=3")
    model = hydra.utils.instantiate(cfg.model)
    assert isinstance(model, MLP) and model.lr == 0.25
    torch.testing.assert_close(model.layers[0].weight, MLP(seed=3).layers[0].weight)


def check_data_digits(tmp_path):
    cfg = compose_cfg(tmp_path, "data=digits", "strategy.n_microbatches=8")
    dm = hydra.utils.instantiate(cfg.data)
    assert dm.n_microbatches == 8  # follows the strategy
    cfg = compose_cfg(tmp_path, "data=digits", "strategy=ddp", "n_microbatches=16")
    assert hydra.utils.instantiate(cfg.data).n_microbatches == 16
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (64, 1, 8, 8) and y.shape == (64,)


def check_data_synthetic(tmp_path):
    cfg = compose_cfg(tmp_path, "experiment=mlp_tiny")
    dm = hydra.utils.instantiate(cfg.data)
    assert isinstance(dm, L.LightningDataModule)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, 8) and int(y.max()) < 4
    assert len(dm.val_dataloader().dataset) == 64


def _callbacks(tmp_path, *overrides) -> dict:
    cfg = compose_cfg(tmp_path, *overrides)
    return {k: hydra.utils.instantiate(v) for k, v in cfg.callbacks.items()}


def check_callbacks_default(tmp_path):
    cbs = _callbacks(tmp_path, "callbacks=default")
    assert set(cbs) == {"early_stopping", "lr_monitor"}
    assert isinstance(cbs["lr_monitor"], LearningRateMonitor)


def check_callbacks_none(tmp_path):
    cfg = compose_cfg(tmp_path, "experiment=mlp_tiny", "callbacks=none")
    assert not cfg.callbacks
    assert not any(isinstance(c, (EarlyStopping, LearningRateMonitor)) for c in build(cfg).callbacks)


def check_callbacks_early_stopping(tmp_path):
    es = _callbacks(tmp_path, "experiment=mlp_tiny")["early_stopping"]
    assert isinstance(es, EarlyStopping) and es.monitor == "val_loss" and es.mode == "min" and es.check_finite
    assert es._check_on_train_epoch_end is False  # after a validation: a run ending before one has nothing to check


def check_callbacks_lr_monitor(tmp_path):
    cfg = compose_cfg(tmp_path, "experiment=mlp_tiny", "~logger")
    assert isinstance(hydra.utils.instantiate(cfg.callbacks.lr_monitor), LearningRateMonitor)
    # without a logger the entry point leaves it out (Lightning refuses it)
    assert not any(isinstance(c, LearningRateMonitor) for c in build(cfg).callbacks)


def check_callbacks_model_summary(tmp_path):
    cbs = _callbacks(tmp_path, "callbacks=model_summary")
    assert set(cbs) == {"early_stopping", "lr_monitor", "model_summary"}
    assert isinstance(cbs["model_summary"], ModelSummary)


def _loggers(tmp_path, *overrides) -> dict:
    cfg = compose_cfg(tmp_path, *overrides)
    return {k: hydra.utils.instantiate(v) for k, v in cfg.logger.items()}


def check_logger_csv(tmp_path):
    csv = _loggers(tmp_path, "logger=csv")["csv"]
    assert isinstance(csv, CSVLogger) and Path(csv.log_dir) == tmp_path / "csv"


def check_logger_tensorboard(tmp_path):
    tb = _loggers(tmp_path, "logger=tensorboard")["tensorboard"]
    assert isinstance(tb, TensorBoardLogger) and Path(tb.log_dir) == tmp_path / "tensorboard"


def check_logger_many(tmp_path):
    loggers = _loggers(tmp_path, "logger=many")
    assert {type(v) for v in loggers.values()} == {CSVLogger, TensorBoardLogger}


def check_checkpoint_local(tmp_path):
    cfg = compose_cfg(tmp_path, "experiment=mlp_tiny", "checkpoint=local")
    run = build(cfg)
    ckpt = [c for c in run.callbacks if isinstance(c, ModelCheckpoint)]
    assert len(ckpt) == 1 and ckpt[0].dirpath == str(tmp_path / "checkpoints") and ckpt[0].monitor == "val_loss"
    assert run.trainer.checkpoint_callback is ckpt[0]


def check_checkpoint_s3(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    cfg = compose_cfg(tmp_path, "experiment=mlp_tiny", "checkpoint=s3")
    ckpt = hydra.utils.instantiate(cfg.checkpoint)
    assert isinstance(ckpt, ModelCheckpoint)
    assert ckpt.dirpath == f"s3://hpp-bucket/checkpoints/{tmp_path.name}"
    assert ckpt.save_last and ckpt.monitor == "val_loss"  # inherited from checkpoint/local.yaml
    check_config(cfg)


def check_hparams_search_optuna(tmp_path):
    from optuna.distributions import FloatDistribution
    from optuna.samplers import TPESampler

    from lightning_hpp.hydra.space import search_space

    cfg, options = _study_sweeper(tmp_path, "hparams_search=optuna", "experiment=mlp_tiny")
    assert cfg.hydra.mode.name == "MULTIRUN" and cfg.optimized_metric == "val_loss"
    assert cfg.hydra.sweeper._target_ == "hydra_plugins.lightning_hpp_sweeper.StudySweeper"  # ours, not a plugin's
    assert cfg.hydra.sweep.dir == "outputs/mlp_tiny/studies/mlp_tiny_optuna"
    sampler = hydra.utils.instantiate(options["sampler"])
    assert isinstance(sampler, TPESampler) and sampler._constant_liar
    assert options["pruner"] is None and options["direction"] == "minimize" and options["n_trials"] == 20
    space, fixed = search_space([f"{k}={v}" for k, v in options["params"].items()])
    assert space == {
        "model.optimizer.lr": FloatDistribution(1e-5, 1e-2, log=True),
        "plan.stages.1.clip_norm": FloatDistribution(0.1, 5.0),
    } and fixed == {}


def _study_sweeper(tmp_path, *overrides):
    from hydra_plugins.lightning_hpp_sweeper import StudySweeper

    cfg = compose_cfg(tmp_path, *overrides, keep_hydra=True)
    options = {k: v for k, v in cfg.hydra.sweeper.items() if not k.startswith("_")}
    sweeper = StudySweeper(**options)
    sweeper.config = cfg
    return cfg, sweeper._checked()


def check_hparams_search_asha(tmp_path):
    from optuna.pruners import SuccessiveHalvingPruner

    from lightning_hpp.hydra.space import search_space
    from lightning_hpp.hydra.trial import build_pruner

    cfg, options = _study_sweeper(tmp_path, "hparams_search=asha", "experiment=mlp_sweep")
    assert (
        cfg.hydra.mode.name == "MULTIRUN"
        and cfg.hydra.sweeper._target_ == "hydra_plugins.lightning_hpp_sweeper.StudySweeper"
    )
    assert cfg.hydra.sweep.dir == "outputs/mlp_sweep/studies/mlp_sweep_asha"  # no timestamp: the same command resumes
    assert options["direction"] == "minimize" and options["n_trials"] == 32 and options["max_retry"] == 1
    assert options["storage"] == f"sqlite:///{(Path(cfg.hydra.sweep.dir) / 'study.db').resolve()}"
    pruner = build_pruner(options["pruner"])
    assert isinstance(pruner, SuccessiveHalvingPruner) and pruner._reduction_factor == 4
    space, _ = search_space([f"{k}={v}" for k, v in options["params"].items()])
    optuna_cfg = compose_cfg(tmp_path, "hparams_search=optuna", "experiment=mlp_tiny", keep_hydra=True)
    assert space == search_space([f"{k}={v}" for k, v in optuna_cfg.hydra.sweeper.params.items()])[0]
    journal = f"journal://{tmp_path / 'study.log'}"
    assert _study_sweeper(tmp_path, "hparams_search=asha", f"hydra.sweeper.storage={journal}")[1]["storage"] == journal
    with pytest.raises(SweepError, match=r"names a relative journal file; give an absolute path"):
        _study_sweeper(tmp_path, "hparams_search=asha", "hydra.sweeper.storage=journal://study.log")
    with pytest.raises(SweepError, match=r"`hydra.sweeper.direction='best'` is not valid"):
        _study_sweeper(tmp_path, "hparams_search=asha", "experiment=mlp_sweep", "hydra.sweeper.direction=best")
    with pytest.raises(SweepError, match=r"`hydra.sweeper.storage='not a url'` is not an SQLAlchemy URL"):
        _study_sweeper(tmp_path, "hparams_search=asha", "experiment=mlp_sweep", "hydra.sweeper.storage='not a url'")
    with pytest.raises(SweepError, match="must build an Optuna pruner"):
        _study_sweeper(tmp_path, "hparams_search=asha", "hydra.sweeper.pruner={_target_:collections.OrderedDict}")


def check_hparams_search_hyperband(tmp_path):
    from optuna.pruners import HyperbandPruner

    from lightning_hpp.hydra.trial import build_pruner

    cfg, options = _study_sweeper(tmp_path, "hparams_search=hyperband", "experiment=mlp_sweep")
    assert options["study_name"] == "mlp_sweep_hyperband" and cfg.hydra.sweep.dir.endswith("mlp_sweep_hyperband")
    pruner = build_pruner(options["pruner"])
    assert isinstance(pruner, HyperbandPruner) and pruner._max_resource == 96 and pruner._reduction_factor == 3
    assert options["params"] == compose_cfg(tmp_path, "hparams_search=asha", keep_hydra=True).hydra.sweeper.params


def _check_experiment(tmp_path, name, strategy_type, devices, model_name, stages):
    run = build(compose_cfg(tmp_path, f"experiment={name}"))
    assert type(run.strategy) is strategy_type and run.trainer.num_devices == devices
    assert type(run.model).__name__ == model_name
    if stages is not None:
        assert isinstance(run.plan, StagePlan) and run.plan.num_stages == stages
    return run


def check_experiment_hybrid_vision(tmp_path):
    run = _check_experiment(tmp_path, "hybrid_vision", HPPStrategy, 3, "HybridVisionModel", 3)
    assert run.strategy.n_microbatches == 8 and run.datamodule.n_microbatches == 8
    assert _stage_precision(run.strategy).fp8_backend == "emulate"  # fp8 stage on CPU
    cfg = compose_cfg(tmp_path, "experiment=hybrid_vision", keep_hydra=True)
    assert cfg.hydra.job.env_set.HPP_DEVICE_KIND == "0:a100,1:h100,2:h100"


def check_experiment_hybrid_vision_ddp(tmp_path):
    run = _check_experiment(tmp_path, "hybrid_vision_ddp", DDPStrategy, 2, "HybridVisionModel", None)
    assert run.strategy._ddp_kwargs == {"find_unused_parameters": False}
    assert run.trainer.max_epochs == 8  # inherited from experiment/hybrid_vision.yaml


def check_experiment_mlp_tiny(tmp_path):
    run = _check_experiment(tmp_path, "mlp_tiny", HPPStrategy, 2, "MLP", 2)
    assert run.trainer.max_steps == 6 and run.trainer.checkpoint_callback is None


def check_experiment_mlp_sweep(tmp_path):
    run = _check_experiment(tmp_path, "mlp_sweep", HPPStrategy, 2, "MLP", 2)
    assert run.trainer.max_steps == 96 and run.trainer.val_check_interval == 4 and run.trainer.max_epochs == 12
    assert not any(isinstance(c, EarlyStopping) for c in run.callbacks)  # trials end at max_steps or when pruned


CASES: dict[str, Callable] = {
    "train.yaml": check_train,
    "trainer/default.yaml": check_trainer_default,
    "trainer/cpu.yaml": check_trainer_cpu,
    "trainer/gpu.yaml": check_trainer_gpu,
    "strategy/hpp.yaml": check_strategy_hpp,
    "strategy/hpp_fp8_emulate.yaml": check_strategy_hpp_fp8_emulate,
    "strategy/ddp.yaml": check_strategy_ddp,
    "strategy/fsdp.yaml": check_strategy_fsdp,
    "plan/hybrid.yaml": check_plan_hybrid,
    "plan/uniform.yaml": check_plan_uniform,
    "plan/auto.yaml": check_plan_auto,
    "plan/mlp.yaml": check_plan_mlp,
    "model/hybrid_vision.yaml": check_model_hybrid_vision,
    "model/hybrid_vision_small.yaml": check_model_hybrid_vision_small,
    "model/mlp.yaml": check_model_mlp,
    "data/digits.yaml": check_data_digits,
    "data/synthetic.yaml": check_data_synthetic,
    "callbacks/default.yaml": check_callbacks_default,
    "callbacks/none.yaml": check_callbacks_none,
    "callbacks/early_stopping.yaml": check_callbacks_early_stopping,
    "callbacks/lr_monitor.yaml": check_callbacks_lr_monitor,
    "callbacks/model_summary.yaml": check_callbacks_model_summary,
    "logger/csv.yaml": check_logger_csv,
    "logger/tensorboard.yaml": check_logger_tensorboard,
    "logger/many.yaml": check_logger_many,
    "checkpoint/local.yaml": check_checkpoint_local,
    "checkpoint/s3.yaml": check_checkpoint_s3,
    "hparams_search/optuna.yaml": check_hparams_search_optuna,
    "hparams_search/asha.yaml": check_hparams_search_asha,
    "hparams_search/hyperband.yaml": check_hparams_search_hyperband,
    "experiment/hybrid_vision.yaml": check_experiment_hybrid_vision,
    "experiment/hybrid_vision_ddp.yaml": check_experiment_hybrid_vision_ddp,
    "experiment/mlp_tiny.yaml": check_experiment_mlp_tiny,
    "experiment/mlp_sweep.yaml": check_experiment_mlp_sweep,
}


def test_every_config_file_has_a_case():
    files = {p.relative_to(CONFIG_DIR).as_posix() for p in CONFIG_DIR.rglob("*.yaml")}
    assert files == set(CASES), f"configs without a test: {sorted(files - set(CASES))}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_instantiates(name, tmp_path, monkeypatch):
    check = CASES[name]
    if "monkeypatch" in check.__code__.co_varnames[: check.__code__.co_argcount]:
        check(tmp_path, monkeypatch)
    else:
        check(tmp_path)


# ------------------------------------------------------------------ plans, model, checks
def test_uniform_plan_cuts_and_errors():
    assert [s.modules for s in uniform_plan(list("abcde"), 3).stages] == [["a", "b"], ["c", "d"], ["e"]]
    with pytest.raises(PlanError, match=r"`plan.num_stages=4` but the model has only 3 units"):
        uniform_plan(["a", "b", "c"], 4)
    with pytest.raises(PlanError, match="positive integer"):
        uniform_plan(["a"], 0)


def test_plan_that_does_not_fit_the_model_names_the_units(tmp_path):
    cfg = compose_cfg(tmp_path, "experiment=mlp_tiny", "plan=hybrid")
    with pytest.raises(TrainConfigError) as err:
        build(cfg)
    msg = str(err.value)
    assert "`plan=hybrid`" in msg and "'encoder'" in msg and "layers.6" in msg and "plan=uniform" in msg


def test_decorator_plan_when_plan_group_is_null(tmp_path):
    cfg = compose_cfg(tmp_path, "~plan")
    model = hydra.utils.instantiate(cfg.model)
    plan, resolved = build_plan(None, model)
    assert plan is None and [s.precision for s in resolved.stages] == ["16-mixed", "fp8", None]
    with pytest.raises(TrainConfigError, match="has none"):
        build_plan(None, MLP())


def test_make_model_refuses_an_argument_given_twice():
    with pytest.raises(TrainConfigError, match=r"model.optimizer.lr"):
        make_model(functools.partial(MLP, lr=0.1), {"lr": 0.2})
    assert make_model(functools.partial(MLP, depth=3), {"lr": 0.3}).lr == 0.3


def test_s3_checkpoint_without_credentials_is_refused(tmp_path, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ROLE_ARN", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
        monkeypatch.delenv(name, raising=False)
    cfg = compose_cfg(tmp_path, "experiment=mlp_tiny", "checkpoint=s3")
    with pytest.raises(TrainConfigError, match=r"`checkpoint.dirpath` is 's3://hpp-bucket/.*AWS_SECRET_ACCESS_KEY"):
        check_config(cfg)
    monkeypatch.delenv("HPP_S3_BUCKET")
    with pytest.raises(TrainConfigError, match="HPP_S3_BUCKET"):
        check_config(compose_cfg(tmp_path, "experiment=mlp_tiny", "checkpoint=s3"))


def test_secret_in_the_config_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    cfg = compose_cfg(tmp_path, "experiment=mlp_tiny", "+checkpoint.aws_secret_access_key=abcdefgh")
    with pytest.raises(TrainConfigError, match=r"`checkpoint.aws_secret_access_key` holds a secret"):
        check_config(cfg)
    cfg = compose_cfg(tmp_path, "experiment=mlp_tiny", "+tags=[${oc.env:AWS_SECRET_ACCESS_KEY}]")
    with pytest.raises(TrainConfigError) as err:
        check_config(cfg)
    assert SECRET not in str(err.value)


def test_object_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert object_key(str(tmp_path / "outputs" / "run1")) == "outputs/run1"
    assert object_key("/elsewhere/run") == "elsewhere/run"


# ------------------------------------------------------------------ snapshot
def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_code_version_digest_follows_uncommitted_changes(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    clean = code_version(repo)
    assert clean["commit"] == head and clean["dirty"] is False and clean["dirty_digest"] is None
    (repo / "a.py").write_text("x = 2\n")
    first = code_version(repo)
    (repo / "a.py").write_text("x = 3\n")
    second = code_version(repo)
    assert first["dirty"] and first["dirty_digest"] != second["dirty_digest"] and first["changed"] == ["a.py"]
    (repo / "a.py").write_text("x = 2\n")
    assert code_version(repo)["dirty_digest"] == first["dirty_digest"]
    (repo / "new.py").write_text("y = 1\n")  # untracked files count too
    assert code_version(repo)["dirty_digest"] != first["dirty_digest"]


def test_snapshot_contents_and_redaction(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    config = {"checkpoint": {"dirpath": "s3://b/x", "token": "tok-123456"}, "note": f"key={SECRET}"}
    plan = StagePlan.from_dict({"stages": [{"modules": ["a"]}, {"modules": ["b"], "clip_norm": 0.3}]})
    out = write_snapshot(tmp_path, config, plan=plan, overrides=["+db.password=hunter22", "x=1"])
    names = {p.name for p in out.iterdir()}
    assert names == {"config.yaml", "stage_plan.json", "snapshot.json", "packages.txt"}
    text = "".join(p.read_text() for p in out.iterdir())
    assert SECRET not in text and "tok-123456" not in text and "hunter22" not in text
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["checkpoint"] == {"dirpath": "s3://b/x", "token": "***"}
    assert StagePlan.from_json((out / "stage_plan.json").read_text()).stages[1].clip_norm == 0.3
    info = json.loads((out / "snapshot.json").read_text())
    assert info["overrides"] == ["+db.password=***", "x=1"]
    assert info["code"]["cwd"]["commit"] is None or len(info["code"]["cwd"]["commit"]) == 40
    assert f"torch=={torch.__version__}" in (out / "packages.txt").read_text().splitlines()
    assert info["fingerprint"] is not None and info["fingerprint"]["torch"] == torch.__version__


def test_scrub_hydra_files(tmp_path):
    hydra_dir = tmp_path / ".hydra"
    hydra_dir.mkdir()
    (hydra_dir / "overrides.yaml").write_text("- experiment=mlp_tiny\n- +checkpoint.secret_key=abcdefgh\n")
    (hydra_dir / "config.yaml").write_text("seed: 0\n")
    assert scrub_hydra_files(tmp_path) == [hydra_dir / "overrides.yaml"]
    assert yaml.safe_load(
        (hydra_dir / "overrides.yaml").read_text()) == ["experiment=mlp_tiny", "+checkpoint.secret_key=***"]


# ------------------------------------------------------------------ sweep summary
def _trial(root: Path, num: int, lr: str, clip: str, value: float | None, status: str = "ok") -> None:
    d = root / str(num)
    d.mkdir(parents=True)
    record = {
        "num": num,
        "overrides": ["experiment=mlp_tiny", f"model.optimizer.lr={lr}", f"plan.stages.1.clip_norm={clip}"],
        "status": status,
        "value": value,
        "metrics": {} if value is None else {"val_loss": value, "val_acc": 1 - value / 10},
        "seconds": 1.5,
        "error": None if status == "ok" else "boom",
    }
    (d / "trial.json").write_text(json.dumps(record))


def test_sweep_summary_ranks_tables_and_plots(tmp_path):
    values = {0: 0.9, 1: 0.4, 2: None, 3: 0.7}
    for num, (lr, clip) in enumerate([("1e-4", "0.3"), ("1e-4", "1.0"), ("1e-2", "0.3"), ("1e-2", "1.0")]):
        _trial(tmp_path, num, lr, clip, values[num], "ok" if values[num] is not None else "failed")
    trials = load_trials(tmp_path)
    assert swept_parameters(trials) == ["model.optimizer.lr", "plan.stages.1.clip_norm"]
    text = summarize(tmp_path, "val_loss", "min")
    md = (tmp_path / "summary.md").read_text().splitlines()
    rows = [line for line in md if line.startswith("| ") and not line.startswith("| rank")]
    assert [r.split("|")[2].strip() for r in rows] == ["1", "3", "0", "2"]  # best first, failed last
    assert rows[-1].split("|")[3].strip() == "failed"
    assert "Best: trial 1, val_loss=0.4" in "\n".join(md) and "val_acc" in md[2]
    assert [r["trial"] for r in json.loads((tmp_path / "summary.json").read_text())["trials"]] == ["1", "3", "0", "2"]
    png = (tmp_path / "summary.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert text.splitlines()[0].startswith("Sweep") and "3/4 trial(s) completed" in text
    summarize(tmp_path, "val_loss", "max")
    first = json.loads((tmp_path / "summary.json").read_text())["trials"][0]
    assert first["trial"] == "0" and math.isclose(float(first["val_loss"]), 0.9)


def test_sweep_summary_callback_fails_when_no_trial_completed(tmp_path):
    _trial(tmp_path, 0, "1e-3", "0.3", None, "failed")
    cfg = DictConfig({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    with pytest.raises(SystemExit, match="None of the 1 trial.*Trial 0: boom"):
        SweepSummary("val_loss").on_multirun_end(cfg)
    with pytest.raises(SweepError, match="No trial records"):
        summarize(tmp_path / "nothing", "val_loss")
    with pytest.raises(SweepError, match="'best'"):
        SweepSummary("val_loss", mode="best")
