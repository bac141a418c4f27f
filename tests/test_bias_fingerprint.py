"""Environment fingerprints: collection, cross-rank comparison, policies, resume checks."""

from __future__ import annotations

import copy
import json
import subprocess
import warnings

import pytest
import torch

from lightning_hpp.bias.fingerprint import (
    HASH_PROBE,
    CodedBiasWarning,
    collect_fingerprint,
    compare_fingerprints,
    compare_with_saved,
    enforce,
    format_ranks,
    gather_fingerprints,
    load_fingerprints,
    save_fingerprints,
)
from lightning_hpp.errors import BiasConfigError, FingerprintMismatchError


@pytest.fixture(scope="module")
def base_fp() -> dict:
    return collect_fingerprint()


def test_collect_records_this_process(base_fp, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    monkeypatch.setenv("NCCL_IB_DISABLE", "1")
    fp = collect_fingerprint()
    assert json.loads(json.dumps(fp)) == fp  # JSON-serialisable as is
    assert fp["torch"] == torch.__version__
    assert fp["cuda_version"] == torch.version.cuda
    assert fp["env"]["PYTHONHASHSEED"] == "7"
    assert fp["env"]["NCCL_IB_DISABLE"] == "1"
    assert fp["hash_probe"] == hash(HASH_PROBE)
    assert fp["determinism"]["deterministic_algorithms"] == torch.are_deterministic_algorithms_enabled()
    if not torch.cuda.is_available():
        assert fp["compute_capability"] is None and fp["cudnn_version"] is None and fp["nccl_version"] is None
    assert len(fp["packages_digest"]) == 16


def test_deterministic_flag_is_recorded():
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert collect_fingerprint()["determinism"]["deterministic_algorithms"] is True
    finally:
        torch.use_deterministic_algorithms(before)


def test_git_commit_and_dirty_digest(tmp_path):
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                       check=True, capture_output=True)

    assert collect_fingerprint(cwd=str(tmp_path))["git_commit"] is None  # not a git tree
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "init")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    clean = collect_fingerprint(cwd=str(tmp_path))
    assert clean["git_commit"] == head and clean["git_dirty_digest"] is None
    (tmp_path / "a.py").write_text("x = 2\n")
    dirty1 = collect_fingerprint(cwd=str(tmp_path))["git_dirty_digest"]
    (tmp_path / "a.py").write_text("x = 3\n")
    dirty2 = collect_fingerprint(cwd=str(tmp_path))["git_dirty_digest"]
    assert dirty1 is not None and dirty2 is not None and dirty1 != dirty2


def test_fingerprint_and_snapshot_report_the_same_dirty_digest(tmp_path):
    from lightning_hpp.hydra.snapshot import code_version

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                       check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").write_text("y = 1\n")
    git("add", "a.py", "sub/b.py")
    git("commit", "-q", "-m", "init")
    (tmp_path / "a.py").write_text("x = 2\n")  # a modified tracked file
    (tmp_path / "new.py").write_text("z = 1\n")  # an untracked file
    for cwd in (tmp_path, tmp_path / "sub"):  # any directory of the tree
        fp, version = collect_fingerprint(cwd=str(cwd)), code_version(cwd)
        assert version["dirty"] and fp["git_dirty_digest"] is not None
        assert fp["git_dirty_digest"] == version["dirty_digest"]
        assert fp["git_commit"] == version["commit"]
    before = version["dirty_digest"]
    (tmp_path / "new.py").write_text("z = 2\n")  # only the untracked file's content changes
    fp, version = collect_fingerprint(cwd=str(tmp_path)), code_version(tmp_path)
    assert fp["git_dirty_digest"] == version["dirty_digest"] != before


def _world(base: dict, n: int) -> list[dict]:
    return [copy.deepcopy(base) for _ in range(n)]


def test_cross_rank_difference_is_reported_by_field_and_rank(base_fp):
    fps = _world(base_fp, 8)
    for r in range(8):
        fps[r]["cuda_version"] = "11.7.1" if r < 4 else "11.7.0"
        fps[r]["hostname"] = f"node{r // 4}"  # differs by design: never reported
    diffs = compare_fingerprints(fps)
    assert [str(d) for d in diffs] == ["cuda_version_mismatch: 11.7.1 (ranks 0-3) vs 11.7.0 (ranks 4-7) [skew]"]
    assert diffs[0].ranks == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert compare_fingerprints(_world(base_fp, 8)) == []


def test_device_fields_may_differ_between_device_kinds_but_not_within_a_dp_group(base_fp):
    fps = _world(base_fp, 4)
    names = ["NVIDIA A100", "NVIDIA A100", "NVIDIA H100", "NVIDIA H100"]
    caps = ["8.0", "8.0", "9.0", "9.0"]
    for fp, name, cap in zip(fps, names, caps):
        fp["device_name"], fp["compute_capability"] = name, cap
    stages, kinds = [0, 0, 1, 1], ["a100", "a100", "h100", "h100"]
    assert compare_fingerprints(fps, stages, kinds) == []
    # Without device kinds nothing says the difference is expected.
    assert {d.code for d in compare_fingerprints(fps)} == {"device_name_mismatch", "compute_capability_mismatch"}
    # Rank 3 was meant to be an H100 but got an A100: stage 1's data-parallel group disagrees.
    fps[3]["device_name"], fps[3]["compute_capability"] = "NVIDIA A100", "8.0"
    text = [str(d) for d in compare_fingerprints(fps, stages, kinds)]
    assert "device_name_mismatch in device kind 'h100': NVIDIA H100 (rank 2) vs NVIDIA A100 (rank 3) [skew]" in text
    assert "compute_capability_mismatch in device kind 'h100': 9.0 (rank 2) vs 8.0 (rank 3) [skew]" in text
    # The same kinds on one stage's ranks but different devices: reported within the stage's group.
    fps2 = _world(base_fp, 2)
    fps2[0]["device_name"], fps2[1]["device_name"] = "X", "Y"
    text2 = [str(d) for d in compare_fingerprints(fps2, [0, 0], ["a100", "h100"])]
    assert text2 == ["device_name_mismatch in stage 0's data-parallel group: X (rank 0) vs Y (rank 1) [skew]"]
    # Non-device fields are always reported, whatever the kinds.
    fps[2]["torch"] = "2.12.0"
    assert "torch_mismatch" in {d.code for d in compare_fingerprints(fps, stages, kinds)}


def test_compare_with_saved_reports_changed_environment(base_fp):
    saved = copy.deepcopy(base_fp)
    current = copy.deepcopy(base_fp)
    current["torch"] = "9.9.9"
    current["env"]["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    current["hostname"] = "elsewhere"
    text = [str(d) for d in compare_with_saved(saved, current)]
    was = _show(saved["env"]["CUBLAS_WORKSPACE_CONFIG"])
    assert text == [
        f"env.CUBLAS_WORKSPACE_CONFIG_mismatch: {was} (saved) vs :4096:8 (current) [skew]",
        f"torch_mismatch: {saved['torch']} (saved) vs 9.9.9 (current) [skew]",
    ]
    assert compare_with_saved(saved, copy.deepcopy(saved)) == []


def _show(v):
    return "unset" if v is None else str(v)


def test_save_and_load_round_trip(base_fp, tmp_path):
    path = str(tmp_path / "run" / "fingerprint.json")
    (tmp_path / "run").mkdir()
    save_fingerprints([base_fp, base_fp], path)
    assert load_fingerprints(path) == [base_fp, base_fp]
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(FingerprintMismatchError, match="not a fingerprint file"):
        load_fingerprints(str(tmp_path / "bad.json"))


def test_policies_follow_the_severity(base_fp, caplog):
    fps = _world(base_fp, 2)
    fps[1]["torch"] = "0.0.1"
    fps[1]["hash_probe"] = fps[0]["hash_probe"] + 1  # PYTHONHASHSEED unset: each process hashes its own way
    diffs = compare_fingerprints(fps)
    assert [(d.code, d.severity) for d in diffs] == [("hash_probe_mismatch", "reproducibility"),
                                                     ("torch_mismatch", "skew")]
    assert diffs[1].to_dict()["severity"] == "skew" and diffs[1].to_dict()["values"][1] == "0.0.1"
    with pytest.raises(FingerprintMismatchError,
                       match=r"torch_mismatch: .* \(rank 0\) vs 0\.0\.1 \(rank 1\) \[skew\]") as err:
        enforce(diffs, "error")
    assert "hash_probe" not in str(err.value)
    with caplog.at_level("INFO", logger="lightning_hpp.bias.fingerprint"), pytest.warns(CodedBiasWarning) as caught:
        enforce(diffs, "warn")
    assert len(caught) == 1
    assert "torch_mismatch" in str(caught[0].message) and "hash_probe" not in str(caught[0].message)
    assert [r.getMessage().split(":")[1].strip() for r in caplog.records] == ["hash_probe_mismatch"]
    with pytest.raises(FingerprintMismatchError, match=r"hash_probe_mismatch: .*\[reproducibility\]"):
        enforce(diffs, "error", deterministic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enforce(diffs, "off")
        enforce([], "error")
        enforce(diffs[:1], "error")  # a note only


def test_bad_input():
    with pytest.raises(BiasConfigError, match=r"'strict'"):
        enforce([], "strict")
    with pytest.raises(BiasConfigError, match=r"`stage_of_rank` has 1 entries"):
        compare_fingerprints([{}, {}], stage_of_rank=[0])
    assert issubclass(BiasConfigError, ValueError) and issubclass(FingerprintMismatchError, ValueError)


def test_format_ranks():
    assert format_ranks([5]) == "rank 5"
    assert format_ranks([3, 0, 1, 2, 6]) == "ranks 0-3, 6"


def test_gather_without_process_group_returns_own(base_fp):
    assert gather_fingerprints(fingerprint=base_fp) == [base_fp]


def test_gloo_ranks_with_different_pythonhashseed(coded_bias_gloo):
    # Two real processes over gloo, started with PYTHONHASHSEED=1 and PYTHONHASHSEED=2.
    r0, r1 = (r["fingerprint"] for r in coded_bias_gloo)
    assert r0["diffs"] == r1["diffs"]  # every rank reaches the same verdict
    assert r0["diffs"][0] == "env.PYTHONHASHSEED_mismatch: 1 (rank 0) vs 2 (rank 1) [reproducibility]"
    assert r0["severities"] == ["reproducibility", "reproducibility"]
    assert r0["codes"] == ["env.PYTHONHASHSEED_mismatch", "hash_probe_mismatch"]
    # The gathered fingerprints are the ranks' own.
    assert [fp["hash_probe"] for fp in r0["fingerprints"]] == [r0["own_probe"], r1["own_probe"]]
    assert r0["fingerprints"][1]["env"]["PYTHONHASHSEED"] == "2"
    assert r0["raised"] and r1["raised"] and "PYTHONHASHSEED" in r0["raised"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fields():
    fp = collect_fingerprint()
    major, minor = torch.cuda.get_device_capability()
    assert fp["compute_capability"] == f"{major}.{minor}"
    assert fp["device_name"] == torch.cuda.get_device_name()
    assert fp["cuda_version"] == torch.version.cuda and fp["cudnn_version"] is not None
    assert fp["driver_version"] is not None


# ------------------------------------------------------------------------ the installed-packages cache
def _install(site, name: str, version: str) -> None:
    """What an installer leaves: a ``<name>-<version>.dist-info`` directory with its METADATA."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_installed_packages_are_cached_across_processes_and_read_again_when_the_path_changes(tmp_path, monkeypatch):
    import importlib.metadata
    import os
    import sys

    from lightning_hpp.bias import packages

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    site = tmp_path / "site"
    site.mkdir()
    _install(site, "Fake_Dist", "1.0")
    plain = tmp_path / "project"  # a script's directory: it holds no distributions
    plain.mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(site), str(plain)])
    monkeypatch.setattr(packages, "_memo", {})
    first = packages.installed_packages()
    assert first == packages.read_installed_packages() and "fake-dist==1.0" in first
    assert packages.cache_path().is_file()

    # another process (no memo) with the same path reads the file, not the metadata, even after the script's
    # directory changed (logs, checkpoints)
    (plain / "train.log").write_text("step 1\n")
    os.utime(plain, ns=(os.stat(plain).st_atime_ns, os.stat(plain).st_mtime_ns + 1_000_000))
    monkeypatch.setattr(packages, "_memo", {})
    distributions = importlib.metadata.distributions

    def unread():
        raise AssertionError("the metadata was read again")

    monkeypatch.setattr(importlib.metadata, "distributions", unread)
    assert packages.installed_packages() == first
    monkeypatch.setattr(importlib.metadata, "distributions", distributions)

    # an upgrade (the old dist-info removed, a new one added) changes the directory's time: read again
    digest = packages.packages_digest()
    (site / "Fake_Dist-1.0.dist-info" / "METADATA").unlink()
    (site / "Fake_Dist-1.0.dist-info").rmdir()
    _install(site, "Fake_Dist", "2.0")
    os.utime(site, ns=(os.stat(site).st_atime_ns, os.stat(site).st_mtime_ns + 1_000_000))  # coarse clocks
    monkeypatch.setattr(packages, "_memo", {})
    now = packages.installed_packages()
    assert "fake-dist==2.0" in now and "fake-dist==1.0" not in now and packages.packages_digest() != digest
    assert collect_fingerprint()["packages_digest"] == packages.packages_digest()

    # a damaged cache file is read past, and replaced
    packages.cache_path().write_text("{not json")
    monkeypatch.setattr(packages, "_memo", {})
    assert packages.installed_packages() == now
    assert json.loads(packages.cache_path().read_text())["packages"] == now
