"""Lightning's surface, enumerated from Lightning itself, with what HPPStrategy does with each item.

:func:`surface` reads the items from the installed Lightning: every hook of ``LightningModule``, ``Callback`` and
``LightningDataModule`` (:mod:`lightning_hpp.check.hooks`, as Lightning's own ``test_hooks.py`` finds them), every
class in ``lightning.pytorch.callbacks``, the ``Tuner``'s methods, every logger in ``lightning.pytorch.loggers`` and
every argument of ``Trainer.__init__``. :data:`ROWS` gives each its verdict:

* ``"equal"``: equal to one process on every rank, with the test that shows it (a hook's test also checks that the
  scenario it cites really called the hook);
* ``"refused"``: refused at setup on every rank, with the test that shows the refusal and the message's start;
* ``"not run here"``: a logger whose service cannot run on this machine (no network), with the reason.

``tests/test_lightning_coverage.py`` fails when an item has no row (a Lightning upgrade that adds a hook, a callback,
a logger or an argument), when a row names a test that does not exist, and when ``docs/lightning-coverage.md``
(written by ``python -m tests.lightning_coverage``) is not the table of these rows.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "lightning-coverage.md"

USAGE = "tests/conformance/test_usage.py"
COVERAGE = "tests/conformance/test_coverage_scenarios.py"
CONFORMANCE = "tests/conformance/test_conformance.py"

HOOKS = f"{USAGE}::test_every_hook_with_its_arguments_on_every_rank"
OWN_LOADERS = f"{USAGE}::test_every_hook_with_the_module_s_own_loaders"
RAISES = f"{USAGE}::test_hooks_when_a_hook_raises"
HOOK_SCENARIOS = {HOOKS: ("every_hook", ("hooks", "resumed_hooks")),
                  OWN_LOADERS: ("every_hook_with_the_module_s_own_loaders",
                  ("hooks",)), RAISES: ("hooks_when_a_hook_raises", ("hooks",))}
"""The tests whose scenarios record hooks: ``test -> (scenario, the result keys holding its hook logs)``."""


@dataclass(frozen=True)
class Row:
    kind: str
    name: str
    verdict: str
    evidence: str
    """The test (``path::name``, for ``equal`` and ``refused``), or the reason (``not run here``)."""
    note: str = ""


VERDICTS = ("equal", "refused", "not run here")


def surface() -> dict[str, list[str]]:
    """Every item of Lightning's surface, by kind, read from the installed Lightning."""
    import lightning.pytorch.callbacks as callbacks
    import lightning.pytorch.loggers as loggers
    from lightning.pytorch import Trainer
    from lightning.pytorch.tuner import Tuner

    from lightning_hpp.check.hooks import callback_hooks, datamodule_hooks, module_hooks

    return {
        "LightningModule hook": module_hooks(),
        "Callback hook": callback_hooks(),
        "LightningDataModule hook": datamodule_hooks(),
        "callback": sorted(callbacks.__all__),
        "tuner": sorted(n for n, _ in inspect.getmembers(Tuner, inspect.isfunction) if not n.startswith("_")),
        "logger": sorted(loggers.__all__),
        "Trainer argument": [p for p in inspect.signature(Trainer.__init__).parameters if p != "self"],
    }


# -------------------------------------------------------------------------------------------------------- hooks
_HOOK_EVIDENCE = {
    ("LightningModule hook", "train_dataloader"): OWN_LOADERS,
    ("LightningModule hook", "val_dataloader"): OWN_LOADERS,
    ("LightningModule hook", "test_dataloader"): OWN_LOADERS,
    ("LightningModule hook", "predict_dataloader"): OWN_LOADERS,
    ("LightningModule hook", "on_before_batch_transfer"): OWN_LOADERS,
    ("LightningModule hook", "transfer_batch_to_device"): OWN_LOADERS,
    ("LightningModule hook", "on_after_batch_transfer"): OWN_LOADERS,
    ("LightningModule hook", "configure_sharded_model"): OWN_LOADERS,
    ("Callback hook", "on_exception"): RAISES,
    ("LightningDataModule hook", "on_exception"): RAISES,
}
_HOOK_NOTES = {
    "backward": ("refused", f"{USAGE}::test_what_cannot_be_kept_is_refused_at_setup_on_every_rank",
                 "the schedule runs every micro-batch's backward; an override is refused naming the hook"),
    "configure_gradient_clipping": ("equal", HOOKS,
                                    "called once per stage a rank holds (twice on a V schedule's ranks)"),
}
_HOOK_ORDER_NOTE = "the setup's first `*_dataloader` call comes before `configure_model` (the cut needs one batch)"


def _hook_rows(kind: str, names: list[str]) -> list[Row]:
    rows = []
    for name in names:
        verdict, evidence, note = _HOOK_NOTES.get(name, ("equal", _HOOK_EVIDENCE.get((kind, name), HOOKS), ""))
        if kind != "Callback hook" and name.endswith("_dataloader") and not note:
            note = _HOOK_ORDER_NOTE
        if name == "prepare_data":
            note = "on each node's local rank 0, as under DDP"
        rows.append(Row(kind, name, verdict, evidence, note))
    return rows


# -------------------------------------------------------------------------------------------------------- the rest
def _equal(kind: str, name: str, test: str, note: str = "") -> Row:
    return Row(kind, name, "equal", test, note)


_CALLBACKS = [
    _equal("callback", "BackboneFinetuning",
           f"{USAGE}::test_backbone_finetuning_unfreezes_a_stage_in_a_hook_during_the_run",
           "a rank without the backbone adds the same param group, empty"),
    _equal("callback", "BaseFinetuning",
           f"{USAGE}::test_backbone_finetuning_unfreezes_a_stage_in_a_hook_during_the_run",
           "the base of BackboneFinetuning"),
    _equal("callback", "BasePredictionWriter",
           f"{USAGE}::test_prediction_writer_writes_each_replica_s_predictions_once",
           "its write hooks run on one rank per replica (the pipeline's first): each prediction is written once, "
           "as under DDP with one process per replica"),
    Row("callback", "BatchSizeFinder", "refused",
        f"{COVERAGE}::test_scale_batch_size_is_refused_on_every_rank_as_under_ddp",
        "refused by Lightning under every distributed strategy, DDP included: 'Tuning the batch size is currently not "
        "supported with distributed strategies'"),
    _equal("callback", "Callback", HOOKS, "every hook, see the hook rows"),
    _equal("callback", "Checkpoint", f"{CONFORMANCE}::test_model_checkpoint_save_top_k_monitoring_val_loss",
           "the base of ModelCheckpoint"),
    _equal("callback", "DeviceStatsMonitor", f"{COVERAGE}::test_device_stats_and_throughput_monitors_log_the_same_keys",
           "the same keys; the values are this rank's device's measurements"),
    _equal("callback", "EarlyStopping", f"{CONFORMANCE}::test_early_stopping_stops_at_the_reference_epoch"),
    _equal("callback", "GradientAccumulationScheduler", f"{COVERAGE}::test_runs_as_one_process"),
    _equal("callback", "LambdaCallback", f"{COVERAGE}::test_lambda_callback"),
    _equal("callback", "LearningRateFinder", f"{COVERAGE}::test_learning_rate_finder_callback"),
    _equal("callback", "LearningRateMonitor", f"{CONFORMANCE}::test_learning_rate_monitor"),
    _equal("callback", "ModelCheckpoint", f"{CONFORMANCE}::test_model_checkpoint_save_top_k_monitoring_val_loss"),
    Row("callback", "ModelPruning", "refused", f"{USAGE}::test_what_cannot_be_kept_is_refused_at_setup_on_every_rank",
        "pruning re-registers each pruned weight as `weight_orig` and a mask mid-run, which the stages' "
        "parameters, the "
        "gradient buckets and the checkpoints were fixed without"),
    _equal("callback", "ModelSummary", f"{USAGE}::test_model_summary_shows_the_whole_model",
           "the whole model's table, gathered from the ranks"),
    _equal("callback", "OnExceptionCheckpoint", f"{COVERAGE}::test_on_exception_checkpoint_is_written_and_resumes"),
    _equal("callback", "ProgressBar", f"{COVERAGE}::test_progress_bars_show_what_one_process_shows",
           "the base of both bars"),
    _equal("callback", "RichModelSummary", f"{USAGE}::test_model_summary_shows_the_whole_model"),
    _equal("callback", "RichProgressBar", f"{COVERAGE}::test_progress_bars_show_what_one_process_shows"),
    _equal("callback", "SpikeDetection", f"{COVERAGE}::test_runs_as_one_process"),
    _equal("callback", "StochasticWeightAveraging", f"{USAGE}::test_stochastic_weight_averaging",
           "its copy of the module is cut as the module is"),
    _equal("callback", "TQDMProgressBar", f"{COVERAGE}::test_progress_bars_show_what_one_process_shows"),
    _equal("callback", "ThroughputMonitor", f"{COVERAGE}::test_device_stats_and_throughput_monitors_log_the_same_keys",
           "the same keys; the values are this run's measurements"),
    _equal("callback", "Timer", f"{CONFORMANCE}::test_max_time_stops_every_rank_at_the_same_step",
           "`max_time` is the Timer callback"),
    _equal("callback", "EMAWeightAveraging", f"{USAGE}::test_ema_weight_averaging"),
    _equal("callback", "WeightAveraging", f"{USAGE}::test_ema_weight_averaging", "the base of EMAWeightAveraging"),
]

_TUNER = [
    _equal("tuner", "lr_find", f"{USAGE}::test_tuner_lr_find_then_fit", "on pp=2; under dp the finder reads a "
           "replica's loss, as under DDP"),
    Row("tuner", "scale_batch_size", "refused",
        f"{COVERAGE}::test_scale_batch_size_is_refused_on_every_rank_as_under_ddp",
        "refused by Lightning under every distributed strategy, DDP included"),
]

_LOGGERS = [
    _equal("logger", "CSVLogger", f"{USAGE}::test_loggers_write_what_one_process_writes"),
    _equal("logger", "TensorBoardLogger", f"{USAGE}::test_loggers_write_what_one_process_writes"),
    _equal("logger", "MLFlowLogger", f"{USAGE}::test_loggers_write_what_one_process_writes", "with a file store"),
    _equal("logger", "Logger", f"{CONFORMANCE}::test_callback_logged_and_progress_bar_metrics_whole",
           "the base class: a logger of the tests' own receives every call one process's receives"),
    Row("logger", "CometLogger", "not run here", "needs `comet_ml` and Comet's service (no network here)"),
    Row("logger", "WandbLogger", "not run here", "needs `wandb` and its service (no network here)"),
    Row("logger", "LitLogger", "not run here", "needs `litlogger` and the Lightning platform (no network here)"),
]

_TRAINER = [
    _equal("Trainer argument", "accelerator", f"{CONFORMANCE}::test_fit_parameters_and_every_step_loss", "cpu here; "
           "cuda in scripts/gpu_check.sh"),
    _equal("Trainer argument", "strategy", f"{CONFORMANCE}::test_fit_parameters_and_every_step_loss",
           "HPPStrategy() or 'hpp'"),
    _equal("Trainer argument", "devices", f"{CONFORMANCE}::test_single_device_without_a_plan"),
    _equal("Trainer argument", "num_nodes",
           "tests/test_lightning_integration.py::test_two_node_torchrun_matches_single_process",
           "two torchrun node agents on loopback"),
    _equal("Trainer argument", "precision", "tests/test_sharding.py::"
           "test_pp2_fsdp2_with_a_bf16_stage_equals_one_process_with_the_same_stage_precisions",
           "the stages' default precision; per stage in the plan"),
    _equal("Trainer argument", "logger", f"{USAGE}::test_loggers_write_what_one_process_writes"),
    _equal("Trainer argument", "callbacks", HOOKS),
    _equal("Trainer argument", "fast_dev_run", f"{COVERAGE}::test_runs_as_one_process"),
    _equal("Trainer argument", "max_epochs", f"{CONFORMANCE}::test_fit_parameters_and_every_step_loss"),
    _equal("Trainer argument", "min_epochs", f"{COVERAGE}::test_runs_as_one_process"),
    _equal("Trainer argument", "max_steps", f"{CONFORMANCE}::test_max_steps_stops_mid_epoch"),
    _equal("Trainer argument", "min_steps", f"{COVERAGE}::test_runs_as_one_process"),
    _equal("Trainer argument", "max_time", f"{CONFORMANCE}::test_max_time_stops_every_rank_at_the_same_step"),
    _equal("Trainer argument", "limit_train_batches", f"{CONFORMANCE}::test_limit_train_and_val_batches"),
    _equal("Trainer argument", "limit_val_batches", f"{CONFORMANCE}::test_limit_train_and_val_batches"),
    _equal("Trainer argument", "limit_test_batches", f"{COVERAGE}::test_limit_test_and_predict_batches"),
    _equal("Trainer argument", "limit_predict_batches", f"{COVERAGE}::test_limit_test_and_predict_batches"),
    _equal("Trainer argument", "overfit_batches", f"{COVERAGE}::test_runs_as_one_process"),
    _equal("Trainer argument", "val_check_interval", f"{CONFORMANCE}::test_val_check_interval_validates_mid_epoch"),
    _equal("Trainer argument", "check_val_every_n_epoch", f"{CONFORMANCE}::test_check_val_every_n_epoch"),
    _equal("Trainer argument", "num_sanity_val_steps", HOOKS),
    _equal("Trainer argument", "log_every_n_steps", f"{COVERAGE}::test_runs_as_one_process"),
    _equal("Trainer argument", "enable_checkpointing", f"{CONFORMANCE}::test_model_checkpoint_every_n_train_steps"),
    _equal("Trainer argument", "enable_progress_bar", f"{COVERAGE}::test_progress_bars_show_what_one_process_shows"),
    _equal("Trainer argument", "enable_model_summary", f"{USAGE}::test_model_summary_shows_the_whole_model"),
    _equal("Trainer argument", "accumulate_grad_batches", f"{CONFORMANCE}::test_accumulate_grad_batches"),
    _equal("Trainer argument", "gradient_clip_val",
           f"{CONFORMANCE}::test_gradient_clip_val_is_one_norm_over_all_stages",
           "one norm over all stages; `grad_norm/stage_<k>` and `grad_norm/spread` are logged besides"),
    _equal("Trainer argument", "gradient_clip_algorithm", f"{COVERAGE}::test_runs_as_one_process",
           "'norm' (one norm over all stages) and 'value'"),
    _equal("Trainer argument", "deterministic", f"{COVERAGE}::test_deterministic_and_benchmark"),
    _equal("Trainer argument", "benchmark", f"{COVERAGE}::test_deterministic_and_benchmark",
           "cuDNN's autotuner; no-op on CPU"),
    _equal("Trainer argument", "inference_mode", f"{COVERAGE}::test_detect_anomaly_and_inference_mode_off"),
    _equal("Trainer argument", "use_distributed_sampler", f"{COVERAGE}::test_runs_as_one_process",
           "False: every rank reads the loader as built, so the ranks of one replica must draw the same batches "
           "(the coded-bias audit warns where replicas draw the same ones)"),
    _equal("Trainer argument", "profiler", f"{COVERAGE}::test_profiler_simple"),
    _equal("Trainer argument", "detect_anomaly", f"{COVERAGE}::test_detect_anomaly_and_inference_mode_off"),
    _equal("Trainer argument", "barebones", f"{COVERAGE}::test_barebones"),
    _equal("Trainer argument", "plugins", "tests/test_sharding.py::"
           "test_pp2_fsdp2_gpt2_with_global_clipping_and_validation_equals_one_process",
           "HPPPrecision; a CheckpointIO plugin is refused (the strategy writes sharded checkpoints)"),
    Row("Trainer argument", "sync_batchnorm", "refused",
        f"{USAGE}::test_what_cannot_be_kept_is_refused_at_setup_on_every_rank",
        "BatchNorm under a pipeline normalises each micro-batch; SyncBatchNorm over the replicas (GPU only in torch) "
        "is not composed with that in this version"),
    _equal("Trainer argument", "reload_dataloaders_every_n_epochs", f"{COVERAGE}::test_runs_as_one_process"),
    _equal("Trainer argument", "default_root_dir", f"{COVERAGE}::test_enable_autolog_hparams_and_default_root_dir"),
    _equal("Trainer argument", "enable_autolog_hparams",
           f"{COVERAGE}::test_enable_autolog_hparams_and_default_root_dir"),
    Row("Trainer argument", "model_registry", "not run here",
        "uploads to Lightning's model registry (no network here); "
        "HPPStrategy's checkpoints are directories: export one first (`python -m lightning_hpp.checkpoint.export`)"),
]


def rows() -> list[Row]:
    """Every row: the hooks' from Lightning's hook lists, the rest as written above."""
    items = surface()
    out = [row for kind in ("LightningModule hook", "Callback hook", "LightningDataModule hook")
           for row in _hook_rows(kind, items[kind])]
    return out + _CALLBACKS + _TUNER + _LOGGERS + _TRAINER


def table(all_rows: list[Row]) -> str:
    """The Markdown table of the rows, with the counts per verdict."""
    counts = {v: sum(r.verdict == v for r in all_rows) for v in VERDICTS}
    lines = [
        "# Lightning's surface under HPPStrategy",
        "",
        "Generated by `python -m tests.lightning_coverage` from the installed Lightning (every hook of "
        "`LightningModule`, "
        "`Callback` and `LightningDataModule`, every class in `lightning.pytorch.callbacks`, the `Tuner`, every logger "
        "in `lightning.pytorch.loggers`, every argument of `Trainer`); `tests/test_lightning_coverage.py` fails "
        "when an "
        "item has no row. *equal*: equal to one process on every rank of pp=2 (and of pp=2 × dp=2 where the test runs "
        "there), shown by the test named; *refused*: refused at setup on every rank, shown by the test named.",
        "",
        f"{len(all_rows)} rows: " + ", ".join(f"{counts[v]} {v}" for v in VERDICTS) + ".",
        "",
        "| kind | name | verdict | test or reason | note |",
        "|---|---|---|---|---|",
    ]
    for r in all_rows:
        lines.append(f"| {r.kind} | `{r.name}` | {r.verdict} | `{r.evidence}` | {r.note} |"
                     if r.verdict != "not run here"
                     else f"| {r.kind} | `{r.name}` | {r.verdict} | {r.evidence} | {r.note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    TABLE.parent.mkdir(exist_ok=True)
    TABLE.write_text(table(rows()))
    print(f"wrote {TABLE.relative_to(ROOT)}", file=sys.stderr)
