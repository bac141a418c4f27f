"""No secret in any artifact or log line: hyperparameters reach every logger redacted, and a secret
on the entry point's command line is refused before Hydra echoes it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from lightning_hpp.hydra.train import main
from lightning_hpp.redaction import redact_loggers, secret_overrides
from tests.harness.launch import Job, run_job
from tests.workers.run_errors import PLANTED_ENV, PLANTED_HPARAMS

ROOT = Path(__file__).resolve().parents[1]
SECRETS = [*PLANTED_ENV.values(), *PLANTED_HPARAMS.values()]


def _leaks(files: list[Path], *texts: str) -> list[str]:
    found = [f"{p} holds {s!r}" for p in files for s in SECRETS if s.encode() in p.read_bytes()]
    return found + [f"output holds {s!r}" for t in texts for s in SECRETS if s in t]


@pytest.mark.slow
def test_planted_secrets_reach_no_logger_file_and_no_log_line(tmp_path):
    proc = run_job(Job("tests.workers.run_errors", {"out": str(tmp_path), "raise_rank": -1, "timeout": 120},
                       env=PLANTED_ENV))
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name.startswith("events.out.tfevents") for p in files)  # TensorBoard wrote its events
    assert not _leaks(files, proc.stdout, proc.stderr)
    for logger in ("csv", "tb"):
        hparams = yaml.safe_load(next((tmp_path / logger).rglob("hparams.yaml")).read_text())
        # the secrets are masked, everything else is kept as the model gave it
        assert {k: hparams[k] for k in PLANTED_HPARAMS} == dict.fromkeys(PLANTED_HPARAMS, "***")
        assert hparams["storage_options"] == {
            "key": "***",
            "secret": "***",
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
        }
        assert hparams["lr"] == 0.1 and hparams["raise_rank"] == -1
    metrics = (next((tmp_path / "csv").rglob("metrics.csv"))).read_text()
    assert "train_loss" in metrics  # the run trained and logged


def test_a_logger_redacts_what_the_user_logs_too(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import CSVLogger
    from omegaconf import OmegaConf

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", PLANTED_ENV["AWS_SECRET_ACCESS_KEY"])
    logger = CSVLogger(tmp_path, name="csv")
    redact_loggers([logger])
    redact_loggers([logger])  # wrapping twice changes nothing
    cfg = OmegaConf.create(
        {"hf_token": "hf_abcdefgh", "note": f"key={PLANTED_ENV['AWS_SECRET_ACCESS_KEY']}", "depth": 4}
    )
    logger.log_hyperparams({"cfg": cfg, "pad_token": "<pad>"})
    logger.save()
    assert yaml.safe_load((Path(logger.log_dir) / "hparams.yaml").read_text()) == {
        "cfg": {"hf_token": "***", "note": "key=***", "depth": 4},
        "pad_token": "<pad>",
    }


def test_secret_overrides_are_found_by_name_nested_key_and_environment_value(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", PLANTED_ENV["AWS_SECRET_ACCESS_KEY"])
    args = [
        "-m",
        "experiment=mlp_tiny",
        "model.optimizer.lr=0.1,0.2",
        "+model.api_key=abc123456",
        "++model.hf_token=a,b",
        "+model.storage={secret: xyz12345, region: eu}",
        f"data.note={PLANTED_ENV['AWS_SECRET_ACCESS_KEY']}",
        "model.tokenizer.pad_token=<pad>",
        "hydra.run.dir=/tmp/run",
    ]
    assert secret_overrides(args) == [
        ("model.api_key", "+model.api_key=***"),
        ("model.hf_token", "++model.hf_token=***"),
        ("model.storage", "+model.storage=***"),
        ("data.note", "data.note=***"),
    ]


def test_a_secret_override_is_refused_before_hydra_echoes_it(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "lightning-hpp-train",
            "experiment=mlp_tiny",
            f"+model.api_token={SECRETS[2]}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
    )
    with pytest.raises(SystemExit) as exit_info:
        main()
    out = capfd.readouterr()
    assert "TrainConfigError: The command line holds a secret in `model.api_token` ('+model.api_token=***'" in str(
        exit_info.value
    )
    assert not _leaks([p for p in tmp_path.rglob("*") if p.is_file()], out.out, out.err, str(exit_info.value))
    assert not (tmp_path / "run").exists()  # refused before Hydra composed or ran anything


def test_the_entry_point_redacts_the_loggers_of_every_strategy(tmp_path):
    from lightning_hpp.hydra.train import build
    from tests.test_configs import compose_cfg

    run = build(compose_cfg(tmp_path, "experiment=mlp_tiny", "strategy=ddp", "logger=many"))
    assert {type(lg).__name__ for lg in run.loggers} == {"CSVLogger", "TensorBoardLogger"}
    for logger in run.loggers:
        logger.log_hyperparams({**PLANTED_HPARAMS, "lr": 0.1})
        logger.save()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len([p for p in files if p.name == "hparams.yaml"]) == 2 and not _leaks(files)
