"""LightningCLI: HPPStrategy and its typed sections from a YAML file and from command-line flags
(examples/cli/train.py with examples/cli/config.yaml)."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, DistributedSampler

from lightning_hpp import HPPStrategy
from lightning_hpp.examples_data import DigitsDataModule
from lightning_hpp.options import BiasOptions, CheckpointOptions, TelemetryOptions
from lightning_hpp.planning.plan import PLAN_FILENAME, StagePlan, StageSpec
from tests.harness.launch import ROOT, Job, run_job
from tests.harness.trainer import quiet_trainer

EXAMPLE = ROOT / "examples" / "cli"


def _example():
    spec = importlib.util.spec_from_file_location("examples_cli_train", EXAMPLE / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parse(args: list[str]) -> LightningCLI:
    """The CLI of the example, parsed and instantiated without running (no process is started)."""
    argv, sys.argv = sys.argv, [str(EXAMPLE / "train.py")]  # `args` alone, not pytest's own
    try:
        return LightningCLI(_example().DigitsMLP, DigitsDataModule, run=False, args=args)
    finally:
        sys.argv = argv


def test_flags_alone_configure_the_strategy_and_each_section(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    StagePlan([StageSpec(modules=["layers.0-2"]), StageSpec(modules=["layers.3-5"], clip_norm=0.5)]).save(str(plan))
    cli = _parse([
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=lightning_hpp.HPPStrategy",
        f"--trainer.strategy.checkpoint.dir={tmp_path / 'ckpt'}", "--trainer.strategy.checkpoint.keep_last=3",
        f"--trainer.strategy.plan={plan}", "--trainer.strategy.n_microbatches=4", "--trainer.strategy.timeout=30",
        "--trainer.strategy.bias.audit=error", "--trainer.strategy.telemetry.trace_step=1",
    ])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, HPPStrategy)
    assert strategy._checkpoint == CheckpointOptions(dir=str(tmp_path / "ckpt"), keep_last=3)
    assert strategy._bias == BiasOptions(audit="error") and strategy._telemetry == TelemetryOptions(trace_step=1)
    assert strategy.spec.n_microbatches == 4 and strategy._timeout == timedelta(seconds=30)
    assert strategy.spec.plan == StagePlan.load(str(plan))  # the stage_plan.json the flag names
    assert [s.clip_norm for s in strategy.spec.plan.stages] == [None, 0.5]


@pytest.mark.parametrize("flag, message", [
    ("--trainer.strategy.checkpoint.on_error=explode",
     "`CheckpointOptions(on_error='explode')` is not supported; use one of 'raise', 'warn'."),
    ("--trainer.strategy.checkpoint.keep_last=2",
     "`CheckpointOptions(keep_last=...)` applies to the checkpoints in `dir`, but `dir` is not set"),
])
def test_a_bad_section_value_is_refused_with_the_sections_own_message(flag: str, message: str) -> None:
    base = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=lightning_hpp.HPPStrategy"]
    with pytest.raises(ValueError) as caught:
        _parse([*base, flag])
    assert message in str(caught.value)


def _losses(metrics_csv: Path) -> list[float]:
    with open(metrics_csv) as f:
        return [float(row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")]


def _reference_losses(steps: int, out: Path) -> list[float]:
    """The example's model and data in one process under Lightning's own strategy, in the order Lightning's
    distributed sampler (one replica, seed 0) gives the pipeline."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank
    try:
        L.seed_everything(0, verbose=False)
        model = _example().DigitsMLP()
        data = DigitsDataModule(batch_size=32)
        data.setup()
        sampler = DistributedSampler(data.train_set, num_replicas=1, rank=0, shuffle=True, seed=0)
        loader = DataLoader(data.train_set, batch_size=32, sampler=sampler, drop_last=True)
        trainer = quiet_trainer(devices=1, max_steps=steps, logger=CSVLogger(str(out)), log_every_n_steps=1)
        trainer.fit(model, loader)
        return _losses(Path(trainer.logger.log_dir) / "metrics.csv")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_yaml_and_flags_train_two_stages_like_one_process(tmp_path: Path) -> None:
    # the YAML gives the strategy, its plan (2 stages), the checkpoint dir (relative: under the working
    # directory), keep_last=2 and the rest; flags on top of it every_n_steps (a field of the YAML's checkpoint
    # section) and n_microbatches
    steps, ckpt, logs = 3, tmp_path / "checkpoints", tmp_path / "logs"
    cmd = ["fit", "--config", str(EXAMPLE / "config.yaml"),
           "--trainer.strategy.checkpoint.every_n_steps=1", "--trainer.strategy.n_microbatches=4",
           f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
           f"--trainer.logger.init_args.save_dir={logs}",
           f"--trainer.default_root_dir={tmp_path}"]
    proc = run_job(Job(EXAMPLE / "train.py", cmd, ranks=2, script=True, cwd=tmp_path, timeout=300), check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    log_dir = logs / "lightning_logs" / "version_0"
    saved = json.loads((log_dir / PLAN_FILENAME).read_text())
    # the YAML's
    assert [s["modules"] for s in saved["stages"]] == [[f"layers.{i}" for i in u] for u in ((0, 1, 2), (3, 4, 5))]
    assert saved["meta"]["n_microbatches"] == 4 and saved["meta"]["pp_degree"] == 2  # the flag's micro-batches
    # every_n_steps=1 (flag) into dir (YAML, relative), keep_last=2 (YAML): steps 2 and 3 are left
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-3"]
    assert (log_dir / "config.yaml").is_file()  # LightningCLI saved the merged configuration
    hpp = _losses(log_dir / "metrics.csv")
    reference = _reference_losses(steps, tmp_path / "reference")
    assert len(hpp) == steps
    torch.testing.assert_close(torch.tensor(hpp), torch.tensor(reference), rtol=2e-5, atol=2e-5)
