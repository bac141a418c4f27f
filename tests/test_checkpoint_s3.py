"""Checkpoints on S3: a real moto server on loopback, through s3fs, credentials from the environment."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import fsspec
import pytest
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem

from lightning_hpp.checkpoint import (
    CheckpointWarning,
    Retention,
    RetryPolicy,
    checkpoint_url,
    latest_valid,
    list_checkpoints,
    load_sharded,
    redact,
    s3_storage_options,
    save_sharded,
    verify,
)
from lightning_hpp.checkpoint.resume import PendingResume, check_checkpoint_dir, select_and_load
from lightning_hpp.checkpoint.commit import read_metadata
from lightning_hpp.checkpoint.discovery import scan
from lightning_hpp.checkpoint.storage import filesystem, route_storage
from lightning_hpp.errors import CheckpointError, CheckpointSaveError, S3ConfigError
from tests.ckpt_workers.common import big_state
from tests.s3_server import FaultProxy, S3Env, fault_proxy, s3_env  # noqa: F401

FAST = RetryPolicy(attempts=3, base_delay=0.02, max_delay=0.1)
BOTOCORE_RETRY = "Retry needed, retrying request"  # botocore.retries.standard's debug line


@pytest.fixture(autouse=True)
def _short_botocore_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore waits up to 2**attempt seconds (throttling errors such as 503) between the tries of a request;
    the tests count the tries and read botocore's retry lines, not the waits: 1 ms each."""
    from botocore.retries.standard import ExponentialBackoff

    monkeypatch.setattr(ExponentialBackoff, "delay_amount", lambda self, context: 0.001)


def _state(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    model = {"enc.weight": torch.randn(128, 64, generator=gen), "enc.bias": torch.randn(64, generator=gen)}
    return {"model": model, "global_step": step}


def _assert_loads(url: str, step: int) -> None:
    loaded = load_sharded(url, {"model": None, "global_step": None}, retry=FAST)
    for name, tensor in _state(step)["model"].items():
        assert torch.equal(loaded["model"][name], tensor), name
    assert loaded["global_step"] == step


def test_round_trip_discovery_and_retention_on_s3(s3_env: S3Env) -> None:
    root = s3_env.root
    for step in (1, 2, 3):
        meta = {"metrics": {"loss": 1.0 / step}}
        save_sharded(_state(step), checkpoint_url(root, step), step=step, extra_metadata=meta)
    s3_env.client().delete_object(Bucket=s3_env.bucket, Key="run/step-3/metadata.json")  # killed before commit
    assert [c.step for c in list_checkpoints(root)] == [1, 2]
    with pytest.warns(CheckpointWarning, match="step-3.*did not finish"):
        newest = latest_valid(root)
    assert newest.url == f"{root}/step-2" and verify(newest.url).step == 2
    _assert_loads(newest.url, 2)
    with pytest.warns(CheckpointWarning):
        Retention(keep_last=1).apply(root)
    keys = set(s3_env.objects())
    assert not any(k.startswith("run/step-1/") for k in keys)
    assert {"run/step-2/metadata.json", "run/step-2/.metadata", "run/step-2/__0_0.distcp"} <= keys


@pytest.mark.parametrize("kind", ["reset", "503"])
def test_transient_errors_are_retried(
    s3_env: S3Env, fault_proxy: FaultProxy, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    # on S3 botocore retries each request (configured by lightning_hpp); the save is not re-run whole
    url = checkpoint_url(s3_env.root, 1)
    fault_proxy.fail_next(2, kind, methods=("PUT",))
    with caplog.at_level(logging.DEBUG):
        info = save_sharded(_state(1), url, step=1, retry=RetryPolicy(attempts=4, base_delay=0.02))
    assert fault_proxy.faults == 2 and info.step == 1
    assert BOTOCORE_RETRY in caplog.text
    assert "Transient storage error" not in caplog.text  # no whole-save retry on top
    assert verify(url).step == 1
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        fault_proxy.fail_next(2, "503", methods=("GET",))
        _assert_loads(url, 1)
        assert fault_proxy.faults == 4
        # discovery and verification (LIST, HEAD, GET) go through the same configured filesystem
        fault_proxy.fail_next(3, "503")
        assert latest_valid(s3_env.root).step == 1
        assert fault_proxy.faults == 7
    assert BOTOCORE_RETRY in caplog.text and "Transient storage error" not in caplog.text


def test_persistent_errors_raise_or_warn_and_keep_earlier_checkpoints(s3_env: S3Env, fault_proxy: FaultProxy) -> None:
    root = s3_env.root
    save_sharded(_state(1), checkpoint_url(root, 1), step=1)
    fault_proxy.fail_always("500", methods=("PUT", "POST"))
    with pytest.raises(CheckpointSaveError,
                       match=r"step-2.*after up to 3 tries of each request.*Earlier checkpoints are untouched"):
        save_sharded(_state(2), checkpoint_url(root, 2), step=2, retry=FAST)
    assert fault_proxy.faults >= 3
    with pytest.warns(CheckpointWarning, match="step-2"):
        assert save_sharded(_state(2), checkpoint_url(root, 2), step=2, retry=FAST, on_error="warn") is None
    fault_proxy.clear()
    assert [c.step for c in list_checkpoints(root)] == [1]
    assert latest_valid(root).step == 1
    _assert_loads(checkpoint_url(root, 1), 1)


def test_async_saves_snapshot_the_state_and_never_overlap(s3_env: S3Env, fault_proxy: FaultProxy) -> None:
    root = s3_env.root
    state = big_state(2, mib=2)
    expected = {k: v.clone() for k, v in state["model"].items()}
    fault_proxy.throttle(2 * 2**20)  # ~1 s per save
    first = save_sharded(state, checkpoint_url(root, 2), step=2, async_save=True)
    assert not first.done()
    with torch.no_grad():
        for tensor in state["model"].values():
            tensor.zero_()  # training goes on and changes the weights
    second = save_sharded(state, checkpoint_url(root, 3), step=3, async_save=True)
    assert first.done() and first.result().step == 2  # the second save waited for the first
    assert second.result().step == 3
    loaded = load_sharded(checkpoint_url(root, 2), {"model": None})
    assert all(torch.equal(loaded["model"][k], v) for k, v in expected.items())
    loaded = load_sharded(checkpoint_url(root, 3), {"model": None})
    assert all(torch.count_nonzero(v) == 0 for v in loaded["model"].values())


@pytest.mark.parametrize("moment", ["shard upload", "metadata.json upload"])
def test_kill_during_async_save_never_yields_a_valid_checkpoint(
    s3_env: S3Env, fault_proxy: FaultProxy, moment: str, tmp_path: Path
) -> None:
    root = s3_env.root
    save_sharded(_state(1), checkpoint_url(root, 1), step=1)
    if moment == "shard upload":
        fault_proxy.throttle(2**20)  # the 6 MiB shard takes ~6 s
        started = fault_proxy.bytes_up
        reached = lambda: fault_proxy.bytes_up - started > 2**20  # noqa: E731
    else:
        fault_proxy.hold("PUT", "/step-2/metadata.json")  # every shard is written, the commit stalls
        reached = lambda: bool(fault_proxy.held)  # noqa: E731
    from tests.harness.launch import Job, finish, start

    proc = start(Job("tests.ckpt_workers.async_kill_worker", [checkpoint_url(root, 2), "2"], start="plain",
                     timeout=120), tmp_path / "logs")
    try:
        deadline = time.monotonic() + 90
        while not reached() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, finish(proc).stdout
        assert reached(), "the save never got to the point of the kill"
        os.kill(proc.pid, signal.SIGKILL)
        assert finish(proc, deadline=time.monotonic() + 30).returncode == -signal.SIGKILL
    finally:
        proc.kill()
        fault_proxy.throttle(None)
        fault_proxy.release()
    assert [c.step for c in list_checkpoints(root)] == [1]
    if moment == "metadata.json upload":
        assert {"run/step-2/__0_0.distcp", "run/step-2/.metadata"} <= set(s3_env.objects())
        with pytest.warns(CheckpointWarning, match="step-2' has no metadata.json"):
            assert latest_valid(root).step == 1
    else:
        assert latest_valid(root).step == 1
    _assert_loads(checkpoint_url(root, 1), 1)


def test_secrets_never_reach_checkpoints_metadata_or_logs(
    s3_env: S3Env, fault_proxy: FaultProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, recwarn: pytest.WarningsRecorder,
) -> None:
    secret = "Zq9SeCrEt-4f1d2c3b-never-write-me"
    token = "tok-8c7b6a5f-session-never-write-me"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    config = {"storage": {"endpoint": s3_env.endpoint, "aws_secret_access_key": secret, "note": f"token={token}"}}
    state = {**_state(1), "config": config}
    meta = {"config": config, "metrics": {"loss": 0.5}}
    with caplog.at_level(logging.DEBUG, logger="lightning_hpp"):
        save_sharded(state, checkpoint_url(s3_env.root, 1), step=1, extra_metadata=meta)
        save_sharded(state, checkpoint_url(str(tmp_path), 1), step=1, extra_metadata=meta)
        save_sharded(state, checkpoint_url(s3_env.root, 2), step=2, extra_metadata=meta, async_save=True).result()
        fault_proxy.fail_always("500", methods=("PUT",))
        save_sharded(state, checkpoint_url(s3_env.root, 3), step=3, extra_metadata=meta, retry=FAST, on_error="warn")
        fault_proxy.clear()
        loaded = load_sharded(checkpoint_url(s3_env.root, 1), {"config": None})
    assert loaded["config"]["storage"]["aws_secret_access_key"] == "***"
    assert loaded["config"]["storage"]["note"] == "token=***"
    written = {str(p): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    written.update({f"s3://{k}": v for k, v in s3_env.objects().items()})
    assert any(k.endswith("metadata.json") for k in written) and len(written) >= 9
    for name, data in written.items():
        assert secret.encode() not in data and token.encode() not in data, name
    assert b'"aws_secret_access_key": "***"' in written[f"{tmp_path}/step-1/metadata.json"]
    messages = caplog.text + "".join(str(w.message) for w in recwarn)
    assert "step-3" in messages  # the failed save was reported...
    assert secret not in messages and token not in messages  # ...without the secrets


def test_missing_root_is_empty_but_a_missing_bucket_is_an_error(s3_env: S3Env) -> None:
    assert list_checkpoints(f"s3://{s3_env.bucket}/not-yet") == []
    with pytest.raises(CheckpointError, match="bucket 'no-such-bucket-x1' does not exist"):
        latest_valid("s3://no-such-bucket-x1/run")


def test_s3_options_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"AWS_ENDPOINT_URL": "http://a:1", "AWS_ENDPOINT_URL_S3": "http://b:2", "AWS_REGION": "eu-west-1",
           "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEYID0001", "AWS_SECRET_ACCESS_KEY": "very-secret-value"}
    options = s3_storage_options(env)
    assert options == {
        "client_kwargs": {"endpoint_url": "http://b:2", "region_name": "eu-west-1"},
        "config_kwargs": {"retries": {"total_max_attempts": 4, "mode": "standard"}},
    }
    assert s3_storage_options({"AWS_ENDPOINT_URL": "http://a:1"})["client_kwargs"]["endpoint_url"] == "http://a:1"
    with pytest.raises(S3ConfigError, match=r"AWS_ENDPOINT_URL='localhost:9000' is not an endpoint URL"):
        s3_storage_options({"AWS_ENDPOINT_URL": "localhost:9000"})
    with pytest.raises(S3ConfigError,
                       match=r"`s3_storage_options\(retry_mode='legacy'\)` is not supported; use one of 'standard'"):
        s3_storage_options({}, retry_mode="legacy")
    with pytest.raises(S3ConfigError, match=r"`s3_storage_options\(max_attempts=0\)`: must be a positive integer"):
        s3_storage_options({}, max_attempts=0)
    # the filesystem every read and write goes through carries the RetryPolicy's botocore retries
    # (explicit, so AWS_MAX_ATTEMPTS in the environment does not turn them off) and s3fs's own count
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    fs, _ = filesystem("s3://some-bucket/run", RetryPolicy(attempts=2, s3_mode="adaptive"))
    assert fs.config_kwargs["retries"] == {"total_max_attempts": 2, "mode": "adaptive"}
    assert fs.retries == 2
    assert RetryPolicy(attempts=5).for_url("s3://b/run").attempts == 1  # no whole-operation retry on S3
    dirty = {"url": "s3://AKIAX:pw@bucket/x", "secret": "very-secret-value", "msg": "k=very-secret-value"}
    assert redact(dirty, env=env) == {"url": "s3://***@bucket/x", "secret": "***", "msg": "k=***"}


def test_reads_and_lookups_retry_like_writes_when_botocore_does_not(
    s3_env: S3Env, fault_proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    # one try per S3 request (botocore and s3fs retries off): every retry below is lightning_hpp's own
    policy = RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.05, s3_per_request=False)
    root = s3_env.root
    first, second = checkpoint_url(root, 1), checkpoint_url(root, 2)
    save_sharded(_state(1), first, step=1, retry=policy)
    fault_proxy.fail_next(1, "503", methods=("GET",))
    with pytest.raises(OSError):  # the control: one 503 fails a lookup without that retry
        read_metadata(first, retry=replace(policy, attempts=1))
    template = {"model": {"enc.weight": torch.zeros(128, 64), "enc.bias": torch.zeros(64)}, "global_step": None}
    with caplog.at_level(logging.DEBUG):
        fault_proxy.fail_next(2, "503", methods=("PUT",))
        save_sharded(_state(2), second, step=2, retry=policy)  # writes
        for kind in ("503", "reset"):
            fault_proxy.fail_next(2, kind)
            assert [c.step for c in scan([root], retry=policy).committed] == [2, 1]  # LIST + GET metadata.json
            fault_proxy.fail_next(2, kind)
            assert verify(second, retry=policy).step == 2  # GET metadata.json, LIST sizes, GET for sha256
            fault_proxy.fail_next(2, kind)
            loaded = load_sharded(second, dict(template), retry=policy)  # metadata, index, shards
            assert torch.equal(loaded["model"]["enc.weight"], _state(2)["model"]["enc.weight"])
            fault_proxy.fail_next(2, kind)
            request = PendingResume(root, roots=[root], what="resume='auto'")
            chosen = select_and_load(request, lambda url: load_sharded(url, dict(template), retry=policy), retry=policy)
            assert chosen.url == second and chosen.loaded["global_step"] == 2
    assert fault_proxy.faults == 1 + 2 + 2 * 4 * 2
    assert "Transient storage error" in caplog.text and BOTOCORE_RETRY not in caplog.text
    # damage on S3: the next resume falls back and moves the damaged objects under run/corrupt/
    s3 = s3_env.client()
    key = "run/step-2/.metadata"
    garbage = bytes(len(s3.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read()))
    s3.put_object(Bucket=s3_env.bucket, Key=key, Body=garbage)
    with pytest.warns(CheckpointWarning,
                      match=r"step-2.*'.metadata' fails its sha256.*Moved it to .*run/corrupt/step-2"):
        chosen = select_and_load(request, lambda url: load_sharded(url, dict(template), retry=policy), retry=policy)
    assert chosen.url == first
    objects = s3_env.objects()
    assert objects["run/corrupt/step-2/.metadata"] == garbage
    assert "run/corrupt/step-2/metadata.json" in objects and not any(k.startswith("run/step-2/") for k in objects)


LIST_V2 = "list-type=2"  # the query of every ListObjectsV2 request


def test_lightnings_own_filesystem_retries_as_configured_while_storage_is_routed(
    s3_env: S3Env, fault_proxy: FaultProxy) -> None:
    # ModelCheckpoint.file_exists: fs.exists on a name not taken yet (HEAD 404, then ListObjectsV2 for a directory),
    # on the filesystem Lightning makes itself (get_filesystem). botocore's retries are off in the environment.
    save_sharded(_state(1), checkpoint_url(s3_env.root, 1), step=1)
    target = f"{s3_env.root}/epoch=0-step=2.ckpt"
    fault_proxy.fail_next(1, "500", methods=("GET",), path_part=LIST_V2)
    with pytest.raises(OSError):  # the control: one 500 on ListObjectsV2 fails Lightning's lookup
        get_filesystem(target).exists(target)
    attempts = 3
    restore = route_storage(RetryPolicy(attempts=attempts, s3_mode="adaptive"))
    try:
        fs = get_filesystem(target)
        assert fs.config_kwargs["retries"] == {"total_max_attempts": attempts, "mode": "adaptive"}
        for failures, survives in ((attempts - 1, True), (attempts, False)):
            fs.invalidate_cache()
            fault_proxy.fail_next(failures, "500", methods=("GET",), path_part=LIST_V2)
            if survives:
                assert fs.exists(target) is False and fs.exists(f"{s3_env.root}/step-1/metadata.json")
            else:
                with pytest.raises(OSError):
                    fs.exists(target)
            assert fault_proxy.matched == attempts  # the configured count of tries, no more, no fewer
    finally:
        restore()
    assert "s3" not in fsspec.config.conf  # the process's defaults are put back
    assert get_filesystem(target).config_kwargs == {}


@pytest.mark.slow
def test_injected_500s_on_list_objects_during_model_checkpoint_do_not_end_a_run(s3_env: S3Env, tmp_path: Path) -> None:
    # 2 ranks, 2 stages; ModelCheckpoint on S3 saves at steps 2 and 4 (top-1): before each save its file_exists
    # lookup meets attempts - 1 injected 500s on ListObjectsV2, with botocore's retries off in the environment
    from tests.harness.launch import Job, run_job

    failures = RetryPolicy().attempts - 1  # the strategy's one policy: this many failures of a request survive
    cfg = {"moto_port": s3_env.port, "root": s3_env.root, "out": str(tmp_path), "failures": failures, "steps": 4,
           "every": 2}
    run_job(Job("tests.workers.run_s3_faults", cfg, ranks=2, timeout=300))  # rank 0 starts the proxy the others inherit
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["global_step"] == 4 and result["armed"] == 2
    assert result["faults"] == 2 * failures  # every injected 500 was met, and retried
    assert result["best_model_path"] == f"{s3_env.root}/epoch=0-step=4.ckpt"
    names = {key.split("/")[1] for key in s3_env.objects()}
    assert names == {"epoch=0-step=4.ckpt"}  # the step-2 checkpoint was removed by the top-1 rule
    assert verify(result["best_model_path"]).step == 4


def test_s3_without_credentials_is_refused_early_with_the_variables_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    expected = (r"'s3://ckpt-bucket/run' is on S3, but no S3 credentials were found\. "
                r"Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    with pytest.raises(S3ConfigError, match=expected):
        check_checkpoint_dir("s3://ckpt-bucket/run")  # what the strategy runs at setup, before any save
    with pytest.raises(S3ConfigError, match=expected):
        select_and_load(PendingResume("s3://ckpt-bucket/run", roots=["s3://ckpt-bucket/run"], what="resume='auto'"),
                        len)
    with pytest.raises(S3ConfigError, match="no S3 credentials"):
        select_and_load("s3://ckpt-bucket/run/step-1", len)
