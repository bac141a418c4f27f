"""The determinism switch: flags, hash seed, per-rank worker seeding, bitwise-reproducible HPP runs."""

from __future__ import annotations

import os
import pickle
import random
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_hpp.bias import determinism
from lightning_hpp.bias.determinism import (
    CUBLAS_WORKSPACE,
    enable_determinism,
    ensure_hash_seed,
    hash_seed_effective,
    worker_init_fn,
)
from lightning_hpp.bias.fingerprint import HASH_PROBE, CodedBiasWarning
from lightning_hpp.errors import BiasConfigError
from tests.harness.launch import Job, run_jobs

WORKER = "tests.bias_workers.determinism_worker"


def fresh_hash(seed: str) -> int:
    """hash(HASH_PROBE) in a new interpreter started with PYTHONHASHSEED=seed."""
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", f"print(hash({HASH_PROBE!r}))"], env=env, capture_output=True,
                         text=True, check=True)
    return int(out.stdout)


@pytest.fixture(autouse=True)
def _restore(monkeypatch):
    """Keep the global switches of this process as they were."""
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    for var in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.setenv(var, os.environ[var]) if var in os.environ else monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(determinism, "_warned_hash_seed", False)
    rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
    yield
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[2], flags[3]
    torch.set_rng_state(rng[0])
    random.setstate(rng[1])
    np.random.set_state(rng[2])


# ------------------------------------------------------------------------------ in-process switches
def test_enable_determinism_sets_flags_seeds_and_hash_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    with pytest.warns(CodedBiasWarning, match="keeps a random string-hash seed"):
        settings = enable_determinism(5)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["PYTHONHASHSEED"] == "5" == settings.hash_seed
    assert os.environ["PL_GLOBAL_SEED"] == "5" and os.environ["PL_SEED_WORKERS"] == "1"
    # cuBLAS needs a fixed workspace only on CUDA builds of torch.
    assert settings.cublas_workspace_config == (CUBLAS_WORKSPACE if torch.version.cuda else None)
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == settings.cublas_workspace_config
    first = torch.rand(3)
    enable_determinism(5, warn=False)
    assert torch.equal(torch.rand(3), first)  # torch seeded from the seed


def test_hash_seed_from_the_shell_is_kept(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "11")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ensure_hash_seed(3) == "11"  # the value the launched ranks inherit is not changed
    assert os.environ["PYTHONHASHSEED"] == "11"
    warned = [w for w in caught if issubclass(w.category, CodedBiasWarning)]
    assert len(warned) == (0 if hash_seed_effective("11") else 1)


@pytest.mark.parametrize("value", [None, "random"])
def test_unset_or_random_hash_seed_is_replaced_for_children(monkeypatch, value):
    monkeypatch.setenv("PYTHONHASHSEED", value) if value else monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ensure_hash_seed(2**32 + 9) == "9"  # PYTHONHASHSEED accepts 0 .. 2**32 - 1
    assert os.environ["PYTHONHASHSEED"] == "9"
    # This process warns exactly when it did not itself start with PYTHONHASHSEED=9.
    warned = [w for w in caught if issubclass(w.category, CodedBiasWarning)]
    assert len(warned) == (0 if hash_seed_effective("9") else 1)
    assert hash_seed_effective("9") == (fresh_hash("9") == hash(HASH_PROBE))


@pytest.mark.parametrize("seed", [-1, 1.5, True, "7", None])
def test_bad_seed_is_refused(seed):
    with pytest.raises(BiasConfigError,
                       match=rf"`enable_determinism\(seed={re.escape(repr(seed))}\)`: must be an integer >= 0"):
        enable_determinism(seed)
    with pytest.raises(BiasConfigError, match=re.escape(f"seed={seed!r}")):
        ensure_hash_seed(seed)


def test_worker_init_fn_rejects_a_bad_rank():
    with pytest.raises(BiasConfigError, match="rank=-1"):
        worker_init_fn(0, -1)


# ------------------------------------------------------------------------------ worker seeding
class _Draws(Dataset):
    """Each item is what the worker's three generators produce."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i):
        return torch.tensor([float(torch.rand(())), random.random(), float(np.random.rand())], dtype=torch.float64)


def _draw(seed: int, rank: int, epochs: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(123)  # the loader's base seeds: same on every rank
    loader = DataLoader(_Draws(), batch_size=1, num_workers=2, worker_init_fn=worker_init_fn(seed, rank),
                        generator=g, multiprocessing_context="fork")
    return [torch.cat(list(loader)) for _ in range(epochs)]


def test_worker_streams_differ_by_rank_worker_and_epoch_and_repeat_by_seed():
    r0, r0_again, r1, other_seed = _draw(0, 0), _draw(0, 0), _draw(0, 1), _draw(1, 0)
    for a, b in zip(r0, r0_again):
        assert torch.equal(a, b)  # same seed, same rank: same streams
    ep0, ep1 = r0
    values = ep0.flatten().tolist()
    assert len(set(values)) == len(values)  # workers 0 and 1 and the three generators all differ
    assert not torch.equal(ep0, ep1)  # a new epoch draws new base seeds
    assert not set(ep0.flatten().tolist()) & set(r1[0].flatten().tolist())  # ranks differ
    assert not torch.equal(ep0, other_seed[0])  # seeds differ
    seeder = pickle.loads(pickle.dumps(worker_init_fn(3, 2)))  # spawn-started workers need pickling
    assert (seeder.seed, seeder.rank) == (3, 2)


# ------------------------------------------------------------------------------ real 2-rank runs
@pytest.mark.slow
def test_same_seed_gives_bitwise_identical_parameters_under_hpp(tmp_path):
    # Two independent launches (fresh interpreters, started without PYTHONHASHSEED), run side by side.
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    run_jobs([Job(WORKER, {"out": str(a), "seeds": [7, 8]}, ranks=2, env={"PYTHONHASHSEED": None}, timeout=300),
              Job(WORKER, {"out": str(b), "seeds": [7]}, ranks=2, env={"PYTHONHASHSEED": None}, timeout=300)])
    ra = [torch.load(a / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    rb = [torch.load(b / f"rank{r}.pt", weights_only=False) for r in (0, 1)]

    names = set()
    for rank in (0, 1):
        s7a, s7b, s8 = ra[rank]["runs"][7], rb[rank]["runs"][7], ra[rank]["runs"][8]
        assert s7a["global_step"] == s7b["global_step"] == 6
        assert s7a["state"].keys() == s7b["state"].keys() and s7a["state"]
        names |= set(s7a["state"])
        for k in s7a["state"]:
            assert torch.equal(s7a["state"][k], s7b["state"][k]), f"rank {rank} {k} differs between runs"
        # Not trivially equal: training moved the parameters, and another seed ends elsewhere.
        assert any(not torch.equal(s7a["state"][k], s7a["initial"][k]) for k in s7a["state"])
        assert any(not torch.equal(s7a["state"][k], s8["state"][k]) for k in s7a["state"])
        # workers are seeded per data-parallel replica (both stages of replica 0 alike), not per global rank
        assert s7a["worker_init_fn"] == "WorkerSeeder(seed=7, rank=0)"
        for r in (ra[rank], rb[rank]):
            assert r["deterministic_algorithms"] and r["cudnn_deterministic"] and not r["cudnn_benchmark"]
            assert r["pl_seed_workers"] == "1" and r["env_hash_seed"] == "7"
    assert names == {f"layers.{i}.{p}" for i in (0, 2, 4, 6) for p in ("weight", "bias")}  # both stages compared

    # The hash seed reached the launched rank: it hashes like a fresh interpreter with PYTHONHASHSEED=7,
    # in both runs. The launching rank 0 started without it and says so.
    expected = fresh_hash("7")
    assert ra[1]["hash_probe"] == rb[1]["hash_probe"] == expected
    assert ra[1]["runs"][7]["settings"]["hash_seed_effective"] is True
    assert ra[0]["runs"][7]["settings"]["hash_seed_effective"] is False
    assert ra[0]["hash_probe"] != expected
