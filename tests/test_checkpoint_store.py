"""Checkpoint directories on local disk: commit marker, discovery, verification, retention, retries."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
from pathlib import Path

import pytest
import torch
from botocore.exceptions import ClientError

from lightning_hpp.checkpoint import (
    METADATA_FILE,
    CheckpointWarning,
    Retention,
    RetryPolicy,
    checkpoint_url,
    is_transient,
    latest_valid,
    list_checkpoints,
    load_sharded,
    save_sharded,
    verify,
)
from lightning_hpp.checkpoint.resume import PendingResume, check_checkpoint_dir, check_run, select_and_load
from lightning_hpp.checkpoint.commit import CheckpointInfo
from lightning_hpp.checkpoint.discovery import CORRUPT_DIR, scan, step_dirs
from lightning_hpp.errors import CheckpointError, CheckpointSaveError, CorruptCheckpointError
from lightning_hpp.options import CheckpointOptions
from tests.ckpt_workers.damage import (
    delete_metadata_json,
    digest,
    flip_tensor_byte,
    truncate_metadata_json,
    truncate_shard,
)


def _state(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(32, generator=gen)}, "step": step}


def _save(root: Path, step: int, **metrics: float) -> str:
    url = checkpoint_url(str(root), step)
    save_sharded(_state(step), url, step=step, extra_metadata={"metrics": metrics})
    return url


def _steps(infos: list[CheckpointInfo]) -> list[int]:
    return [i.step for i in infos]


def _shard(url: str) -> Path:
    return Path(url) / "__0_0.distcp"


# ----------------------------------------------------------------------------- commit, discovery


def test_metadata_json_describes_every_file_and_is_written_last(tmp_path: Path) -> None:
    url = checkpoint_url(str(tmp_path), 7)
    save_sharded(
        _state(7),
        url,
        step=7,
        extra_metadata={"plan": {"stages": [{"modules": ["a"]}]}, "metrics": {"val/loss": 0.25}, "run": "x"},
    )
    meta = json.loads((Path(url) / METADATA_FILE).read_text())
    assert meta["step"] == 7 and meta["format_version"] == 1 and meta["world_size"] == 1
    assert meta["plan"] == {"stages": [{"modules": ["a"]}]} and meta["fingerprint"] is None
    assert meta["metrics"] == {"val/loss": 0.25} and meta["extra"] == {"run": "x"}
    files = {p.name for p in Path(url).iterdir()} - {METADATA_FILE}
    assert {s["path"] for s in meta["shards"]} == files == {".metadata", "__0_0.distcp"}
    for shard in meta["shards"]:
        data = (Path(url) / shard["path"]).read_bytes()
        assert shard["size"] == len(data)
        assert shard["sha256"] == hashlib.sha256(data).hexdigest()
        assert (Path(url) / shard["path"]).stat().st_mtime_ns <= (Path(url) / METADATA_FILE).stat().st_mtime_ns


def test_unfinished_save_is_not_a_checkpoint(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step)
    (_shard(checkpoint_url(str(tmp_path), 3)).parent / METADATA_FILE).unlink()  # as if killed before commit
    assert _steps(list_checkpoints(str(tmp_path))) == [1, 2]
    with pytest.warns(CheckpointWarning, match=r"step-3.*did not finish"):
        assert latest_valid(str(tmp_path)).step == 2
    with pytest.raises(CheckpointError, match="did not finish"):
        load_sharded(checkpoint_url(str(tmp_path), 3), {"model": None})


def test_missing_root_has_no_checkpoints(tmp_path: Path) -> None:
    assert list_checkpoints(str(tmp_path / "nothing-here")) == []
    assert latest_valid(str(tmp_path / "nothing-here")) is None


def _truncate(url: str) -> None:
    path = _shard(url)
    path.write_bytes(path.read_bytes()[:-100])


def _remove(url: str) -> None:
    _shard(url).unlink()


def _flip(url: str) -> None:
    path = _shard(url)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _garble(url: str) -> None:
    (Path(url) / METADATA_FILE).write_text("{not json")


@pytest.mark.parametrize(
    ("damage", "reason"),
    [(_remove, "is missing"), (_truncate, "truncated"), (_flip, "checksum"), (_garble, "not valid JSON")],
)
def test_latest_valid_skips_corrupt_checkpoints(tmp_path: Path, damage, reason: str) -> None:
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    bad = _save(tmp_path, 3)
    damage(bad)
    with pytest.raises(CorruptCheckpointError, match=reason):
        verify(bad)
    with pytest.warns(CheckpointWarning, match=reason):
        newest = latest_valid(str(tmp_path))
    assert newest.step == 2
    loaded = load_sharded(newest.url, {"model": None})
    torch.testing.assert_close(loaded["model"]["w"], _state(2)["model"]["w"], rtol=0, atol=0)


def test_size_check_alone_misses_a_flipped_byte(tmp_path: Path) -> None:
    url = _save(tmp_path, 1)
    _flip(url)
    assert verify(url, checksums=False).step == 1  # same size: only the checksum can tell
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        verify(url, checksums=True)


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    url = checkpoint_url(str(tmp_path), 5)
    save_sharded(_state(1), url, step=5)
    save_sharded(_state(2), url, step=5)
    assert verify(url).step == 5
    loaded = load_sharded(url, {"model": None})
    assert torch.equal(loaded["model"]["w"], _state(2)["model"]["w"])


# ----------------------------------------------------------------------------- retention


def _infos(steps_and_losses: list[tuple[int, float]]) -> list[CheckpointInfo]:
    return [CheckpointInfo(url=f"/r/step-{s}", step=s, metadata={"metrics": {"loss": v}}) for s, v in steps_and_losses]


def test_retention_select_keeps_last_and_best() -> None:
    infos = _infos([(1, 0.9), (2, 0.1), (3, 0.5), (4, 0.7), (5, 0.8)])
    kept, dropped = Retention(keep_last=2, keep_best=1, monitor="loss", mode="min").select(infos)
    assert _steps(kept) == [2, 4, 5] and _steps(dropped) == [1, 3]
    kept, _ = Retention(keep_best=2, monitor="loss", mode="max").select(infos)
    assert _steps(kept) == [1, 5]
    kept, _ = Retention(keep_last=1).select(infos, protect=["/r/step-1"], newest_valid="/r/step-3")
    assert _steps(kept) == [1, 3, 5]


def test_retention_never_deletes_resumed_from_nor_newest_valid(tmp_path: Path) -> None:
    urls = {step: _save(tmp_path, step) for step in (1, 2, 3, 4, 5)}
    _truncate(urls[5])  # newest committed is corrupt: step 4 is the newest valid one
    incomplete_old = Path(checkpoint_url(str(tmp_path), 0))
    incomplete_old.mkdir()
    (incomplete_old / "__0_0.distcp").write_bytes(b"partial")
    with pytest.warns(CheckpointWarning, match="truncated"):
        deleted = Retention(keep_last=1).apply(str(tmp_path), protect=[urls[2]])
    assert sorted(deleted) == sorted([urls[1], urls[3], str(incomplete_old)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-4", "step-5"]


def test_save_applies_retention_after_commit(tmp_path: Path) -> None:
    retention = Retention(keep_last=2)
    first = checkpoint_url(str(tmp_path), 1)
    for step in (1, 2, 3, 4):
        url = checkpoint_url(str(tmp_path), step)
        save_sharded(_state(step), url, step=step, retention=retention, protect=[first])
    assert _steps(list_checkpoints(str(tmp_path))) == [1, 3, 4]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"keep_best": 2}, "needs `monitor=`"),
        ({"keep_last": 0}, "keep_last"),
        ({"keep_last": 2, "mode": "avg"}, r"`Retention\(mode='avg'\)` is not supported; use one of 'min', 'max'"),
    ],
)
def test_retention_rejects_bad_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        Retention(**kwargs)


# ----------------------------------------------------------------------------- retries


def _client_error(status: int, code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


def test_transient_errors_are_told_apart() -> None:
    wrapped = OSError(getattr(errno, "EREMOTEIO", 121), "remote I/O")
    wrapped.__cause__ = _client_error(500, "InternalError")
    assert is_transient(ConnectionResetError(errno.ECONNRESET, "reset"))
    assert is_transient(socket.timeout("timed out"))
    assert is_transient(_client_error(503, "SlowDown"))
    assert is_transient(wrapped)
    assert not is_transient(_client_error(403, "AccessDenied"))
    assert not is_transient(FileNotFoundError("gone"))
    assert not is_transient(PermissionError(errno.EACCES, "no"))


def test_retry_policy_backs_off_exponentially_and_gives_up() -> None:
    policy = RetryPolicy(attempts=3, base_delay=0.01, multiplier=2.0, max_delay=0.03, jitter=0.0)
    assert [policy.delay(i) for i in (1, 2, 3, 4)] == [0.01, 0.02, 0.03, 0.03]
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError(errno.ECONNRESET, "reset by peer")
        return "ok"

    assert policy.call(flaky, what="test") == "ok" and len(calls) == 3

    calls.clear()

    def always() -> None:
        calls.append(1)
        raise ConnectionResetError(errno.ECONNRESET, "reset by peer")

    with pytest.raises(ConnectionResetError):
        policy.call(always, what="test")
    assert len(calls) == 3

    calls.clear()

    def denied() -> None:
        calls.append(1)
        raise PermissionError(errno.EACCES, "denied")

    with pytest.raises(PermissionError):
        policy.call(denied, what="test")
    assert len(calls) == 1  # not transient: no retry
    with pytest.raises(CheckpointError, match="attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(CheckpointError, match="s3_mode"):
        RetryPolicy(s3_mode="legacy")
    # off S3 the whole operation is retried by this policy; on S3 botocore retries each request
    assert policy.for_url("/some/dir") is policy and policy.for_url("file:///some/dir") is policy
    assert policy.for_url("s3://bucket/run").attempts == 1


def test_failed_save_raises_or_warns_and_keeps_earlier_checkpoints(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    blocker = tmp_path / "step-2"
    blocker.write_text("a file where the checkpoint directory should go")
    url = checkpoint_url(str(tmp_path), 2)
    with pytest.raises(CheckpointSaveError, match="Earlier checkpoints are untouched"):
        save_sharded(_state(2), url, step=2, retry=RetryPolicy(attempts=2, base_delay=0.01))
    with pytest.warns(CheckpointWarning, match="step-2"):
        assert save_sharded(_state(2), url, step=2, on_error="warn", retry=RetryPolicy(attempts=1)) is None
    assert verify(checkpoint_url(str(tmp_path), 1)).step == 1
    assert _steps(list_checkpoints(str(tmp_path))) == [1]


def test_failed_async_save_is_reported_once(tmp_path: Path) -> None:
    (tmp_path / "step-2").write_text("a file where the checkpoint directory should go")
    once = RetryPolicy(attempts=1)
    pending = save_sharded(_state(2), checkpoint_url(str(tmp_path), 2), step=2, async_save=True, retry=once)
    with pytest.raises(CheckpointSaveError, match="step-2"):
        pending.result()
    _save(tmp_path, 3)  # the failure was already handed over: the next save goes ahead
    save_sharded(_state(2), checkpoint_url(str(tmp_path), 2), step=2, async_save=True, retry=once)
    with pytest.raises(CheckpointSaveError, match="step-2"):  # never collected: the next save reports it
        _save(tmp_path, 4)
    assert _steps(list_checkpoints(str(tmp_path))) == [3]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"step": -1}, r"`save_sharded\(step=-1\)`: must be an integer >= 0"),
        ({"step": 1, "on_error": "ignore"},
         r"`save_sharded\(on_error='ignore'\)` is not supported; use one of 'raise', 'warn'"),
    ],
)
def test_save_rejects_bad_arguments(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        save_sharded(_state(1), str(tmp_path / "x"), **kwargs)
    assert not os.path.exists(tmp_path / "x")


# ----------------------------------------------------------------------------- damage, run ids, explicit paths


def _load_step(url: str) -> dict:
    return load_sharded(url, {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}, "step": None})


def test_retention_moves_checkpoints_it_cannot_verify_aside_instead_of_deleting_them(tmp_path: Path) -> None:
    urls = {step: _save(tmp_path, step) for step in (1, 2, 3, 4)}
    flip_tensor_byte(Path(urls[1]))  # same size: only the checksum can tell
    truncate_metadata_json(Path(urls[2]))  # not committed any more, yet not an unfinished save
    damaged = {1: digest(Path(urls[1])), 2: digest(Path(urls[2]))}
    with pytest.warns(CheckpointWarning, match=r"Retention kept a damaged checkpoint") as caught:
        deleted = Retention(keep_last=1).apply(str(tmp_path))
    assert deleted == [urls[3]]
    assert sorted(p.name for p in tmp_path.iterdir()) == [CORRUPT_DIR, "step-4"]
    for step, files in damaged.items():
        assert digest(tmp_path / CORRUPT_DIR / f"step-{step}") == files
    text = " ".join(str(w.message) for w in caught)
    assert "step-1" in text and "sha256" in text and "step-2" in text and "not valid JSON" in text


def test_resume_prefers_the_run_that_saved_last_and_fresh_runs_refuse_other_runs_dirs(tmp_path: Path) -> None:
    for step in (4, 8, 12):
        save_sharded(_state(step), checkpoint_url(str(tmp_path), step), step=step, extra_metadata={"run_id": "old"})
    # a new run started there on purpose: ModelCheckpoint names its step-4 "step-4-v1" since step-4 exists
    newer = str(tmp_path / "step-4-v1")
    save_sharded(_state(4), newer, step=4, extra_metadata={"run_id": "new"})
    found = scan([str(tmp_path)])
    assert [c.url for c in found.committed][:2] == [newer, checkpoint_url(str(tmp_path), 12)]
    assert (4, newer) in step_dirs(str(tmp_path))  # retention sees it too
    chosen = select_and_load(PendingResume(str(tmp_path), roots=[str(tmp_path)], what="resume='auto'"), _load_step)
    assert chosen.url == newer and chosen.info.run_id == "new"
    with pytest.raises(CheckpointError, match=r"holds 4 checkpoint\(s\) of another run .*new_run=True"):
        check_run(str(tmp_path), "fresh", resumed_from=None, new_run=False)
    check_run(str(tmp_path), "fresh", resumed_from=None, new_run=True)
    check_run(str(tmp_path), "new", resumed_from=newer, new_run=False)  # resumed from them: continues there
    elsewhere = _save(tmp_path / "elsewhere", 3)
    with pytest.raises(CheckpointError, match=r"holds 4 checkpoint\(s\) of another run .*resumed from"):
        check_run(str(tmp_path), None, resumed_from=elsewhere, new_run=False)
    with pytest.raises(CheckpointError, match="new_run"):
        CheckpointOptions(dir=str(tmp_path), new_run="yes")
    with pytest.raises(CheckpointError, match=r"new_run=True.*`dir` is not set"):
        CheckpointOptions(new_run=True)


def test_explicit_ckpt_path_errors_name_the_real_cause(tmp_path: Path) -> None:
    urls = {step: _save(tmp_path / "run", step) for step in (1, 2)}
    truncate_shard(Path(urls[2]))
    with pytest.raises(CorruptCheckpointError, match=r"is damaged: .*'__0_0.distcp' has \d+ bytes, metadata.json says"):
        select_and_load(urls[2], _load_step)
    assert (tmp_path / "run" / "step-2").is_dir()  # an explicit checkpoint is left where it is
    # its parent directory: the newest valid checkpoint in it, past the damaged one
    with pytest.warns(CheckpointWarning, match=r"Skipping checkpoint .*step-2.*truncated.*Falling back to .*step-1"):
        chosen = select_and_load(str(tmp_path / "run"), _load_step)
    assert chosen.url == urls[1] and torch.equal(chosen.loaded["model"]["w"], _state(1)["model"]["w"])
    a_file = tmp_path / "model.ckpt"
    a_file.write_bytes(b"not a directory")
    with pytest.raises(CheckpointError, match=r"ckpt_path .*model.ckpt' is a file; .*directories"):
        select_and_load(str(a_file), _load_step)
    with pytest.raises(CheckpointError, match=r"does not exist"):
        select_and_load(str(tmp_path / "nowhere"), _load_step)
    with pytest.raises(CheckpointError, match=r"`CheckpointOptions\(dir=.*model.ckpt'\)` is a file"):
        check_checkpoint_dir(str(a_file))
    check_checkpoint_dir(str(tmp_path / "not-yet"))  # created on the first save


def test_metadata_json_missing_is_named_when_skipped(tmp_path: Path) -> None:
    urls = {step: _save(tmp_path, step) for step in (1, 2, 3)}
    delete_metadata_json(Path(urls[3]))  # a save killed before its commit ...
    os.remove(Path(urls[3]) / ".metadata")  # ... before its index, too
    with pytest.warns(CheckpointWarning,
                      match=r"Skipping .*step-3': it has no metadata.json, so its save did not finish"):
        chosen = select_and_load(PendingResume(str(tmp_path), roots=[str(tmp_path)], what="resume='auto'"), _load_step)
    assert chosen.url == urls[2]
    assert (tmp_path / "step-3").is_dir()  # an unfinished save is not damage: the next save of step 3 reuses it
