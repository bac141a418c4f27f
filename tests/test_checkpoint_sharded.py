"""Sharded save/load: resharding across real gloo processes, exact round trips, safety, export."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_hpp.checkpoint import checkpoint_keys, export_to_lightning_ckpt, load_sharded, save_sharded, verify
from lightning_hpp.checkpoint.export import main as export_main
from lightning_hpp.checkpoint.commit import build_metadata, write_metadata
from lightning_hpp.errors import CheckpointError
from tests.ckpt_workers.common import HPARAMS, UNITS, reference_model, rng_equal, rng_state, stage_state
from tests.harness.launch import Job, run_job
from tests.harness.results import rank_results

WORKERS = Path(__file__).parent / "ckpt_workers"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Checkpoints written by 2 real ranks: pp2/step-10, dp2/step-10 and pp2/step-11 (async)."""
    out = tmp_path_factory.mktemp("save")
    root = tmp_path_factory.mktemp("ckpts")
    (out / "config.json").write_text(json.dumps({"root": str(root), "step": 10}))
    run_job(Job(WORKERS / "save_worker.py", str(out), ranks=2, start="per_rank", script=True, cwd=out, timeout=300))
    results = rank_results(out, 2)
    return {"root": root, "ranks": results}


def _full_reference(step: int) -> dict:
    """Union of both pp2 stages: what a single rank holding everything should load."""
    merged = stage_state("pp1", 0, rank=0, step=step)
    merged.pop("rng")
    return merged


def test_each_rank_writes_only_its_part_and_replicas_are_written_once(saved: dict) -> None:
    root = saved["root"]
    pp2 = json.loads((root / "pp2" / "step-10" / "metadata.json").read_text())
    dp2 = json.loads((root / "dp2" / "step-10" / "metadata.json").read_text())
    assert {s["path"] for s in pp2["shards"]} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert pp2["world_size"] == 2 and pp2["plan"] == {"layout": "pp2"}
    keys = checkpoint_keys(str(root / "pp2" / "step-10"))
    model_keys = {k[1] for k in keys if k[0] == "model"}
    assert model_keys == set(reference_model().state_dict())
    # dp2: both ranks hold the whole model, yet the tensors are stored once (deduplicated)
    data = lambda meta: sum(s["size"] for s in meta["shards"] if s["path"] != ".metadata")  # noqa: E731
    assert data(dp2) < 1.25 * data(pp2)


def test_ranks_disagreeing_on_a_shared_key_are_refused(saved: dict) -> None:
    for rank_result in saved["ranks"]:
        assert "both save 'loops/@json' but with different values" in rank_result["conflict"]
    assert not (saved["root"] / "bad").exists()  # refused before anything was written


def test_reshard_two_stage_and_dp2_checkpoints_into_three_ranks(saved: dict, tmp_path: Path) -> None:
    root = saved["root"]
    urls = [str(root / "pp2" / "step-10"), str(root / "dp2" / "step-10"), str(root / "pp2" / "step-11")]
    (tmp_path / "config.json").write_text(json.dumps({"urls": urls}))
    run_job(Job(WORKERS / "load_worker.py", str(tmp_path), ranks=3, start="per_rank", script=True, cwd=tmp_path,
                timeout=300))
    results = rank_results(tmp_path, 3)
    names = [n for r in results for n in r["names"]]
    assert sorted(names) == sorted(reference_model().state_dict())  # 3 different subsets, all keys
    for r in results:
        assert len(r["checks"]) == 3
        for check in r["checks"]:
            assert check["problems"] == [], (r["rank"], check)
            assert check["in_place"] and check["rng_ok"] and check["n_model"] == len(r["names"])
    # the async save holds the state at the call, not the +1 applied right after it
    assert all(r["checks"][2]["problems"] == [] for r in results)
    # one rank asking for a missing key: that rank says which, the others that it failed
    assert "'model/no.such.weight'" in results[2]["missing"]
    assert all("rank 2 failed" in r["missing"] for r in results[:2])


@pytest.mark.parametrize("layout", ["pp2", "dp2"])
def test_reshard_into_one_rank(saved: dict, layout: str) -> None:
    url = str(saved["root"] / layout / "step-10")
    state = dict.fromkeys(["model", "optimizer", "rng", "loops", "hyper_parameters"]) | {"epoch": 0, "global_step": 0}
    loaded = load_sharded(url, state)
    assert loaded is state
    expected = _full_reference(10)
    assert set(loaded["model"]) == set(expected["model"])
    for name, tensor in expected["model"].items():
        assert loaded["model"][name].dtype == tensor.dtype and torch.equal(loaded["model"][name], tensor), name
    for name, slot in expected["optimizer"]["state"].items():
        assert torch.equal(loaded["optimizer"]["state"][name]["exp_avg"], slot["exp_avg"]), name
    for key in ("loops", "hyper_parameters", "epoch", "global_step"):
        assert loaded[key] == expected[key]
    assert set(loaded["rng"]) == {"rank0", "rank1"}
    assert all(rng_equal(loaded["rng"][f"rank{r}"], rng_state(r)) for r in (0, 1))


# ----------------------------------------------------------------------------- single process


def test_non_tensor_state_round_trips_exactly(tmp_path: Path) -> None:
    random.seed(3)
    np.random.seed(3)
    callback_key = "ModelCheckpoint{'monitor': 'val/loss', 'mode': 'min'}"
    state = {
        "model": {"enc.0.weight": torch.randn(4, 3), "enc.0.bias": torch.zeros(4, dtype=torch.bfloat16)},
        "callbacks": {
            callback_key: {"best_model_score": torch.tensor(0.25), "best_model_path": "/a/b.ckpt", "best_k_models": {}}
        },
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        "misc": {
            1: ("a", 2, None),
            "floats": [math.inf, -0.0, 1e-300],
            "arr": np.arange(6, dtype=np.int16).reshape(2, 3),
            "dtype": torch.float16,
            "np_scalar": np.float32(1.5),
            "__tuple__": "a key that looks like a tag",
        },
        "empty": [],
    }
    url = str(tmp_path / "step-1")
    save_sharded(state, url, step=1)
    loaded = load_sharded(url, {"model": None, "callbacks": None, "rng": None, "misc": None, "empty": None})
    assert loaded["model"]["enc.0.bias"].dtype == torch.bfloat16
    assert torch.equal(loaded["model"]["enc.0.weight"], state["model"]["enc.0.weight"])
    cb = loaded["callbacks"][callback_key]
    assert torch.equal(cb["best_model_score"], torch.tensor(0.25))
    assert cb["best_model_path"] == "/a/b.ckpt" and cb["best_k_models"] == {}
    assert rng_equal(loaded["rng"], state["rng"])
    random.setstate(loaded["rng"]["python"])
    np.random.set_state(loaded["rng"]["numpy"])
    draws = (random.random(), np.random.rand())
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    assert draws == (random.random(), np.random.rand())
    misc = loaded["misc"]
    assert misc[1] == ("a", 2, None) and misc["floats"] == [math.inf, -0.0, 1e-300]
    assert misc["arr"].dtype == np.int16 and np.array_equal(misc["arr"], state["misc"]["arr"])
    assert misc["dtype"] is torch.float16 and misc["np_scalar"] == 1.5
    assert misc["__tuple__"] == "a key that looks like a tag"
    assert loaded["empty"] == []


def test_load_checks_the_request_and_leaves_state_alone_on_error(tmp_path: Path) -> None:
    url = str(tmp_path / "step-1")
    save_sharded({"model": {"w": torch.ones(2, 3)}, "epoch": 4}, url, step=1)
    wrong_shape = {"model": {"w": torch.zeros(3, 2)}, "epoch": 0}
    with pytest.raises(CheckpointError, match=r"'model/w': saved \[2, 3\], requested \[3, 2\]"):
        load_sharded(url, wrong_shape)
    missing = {"model": {"w": torch.zeros(2, 3), "v": torch.zeros(1)}, "epoch": 0}
    with pytest.raises(CheckpointError, match=r"no entry for 1 requested key\(s\): \['model/v'\]"):
        load_sharded(url, missing)
    assert torch.equal(missing["model"]["w"], torch.zeros(2, 3)) and missing["epoch"] == 0
    with pytest.raises(CheckpointError, match="dict with str keys"):
        load_sharded(url, [torch.zeros(2, 3)])  # type: ignore[arg-type]


def test_values_that_need_pickle_are_refused_at_save(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"state\['callbacks'\]\['fn'\] is a builtins.function"):
        save_sharded({"model": {"w": torch.ones(1)}, "callbacks": {"fn": lambda: 0}}, str(tmp_path / "s"), step=1)
    with pytest.raises(CheckpointError, match="never pickled objects"):
        save_sharded({"config": {"path": Path("/x")}}, str(tmp_path / "s"), step=1)
    assert not (tmp_path / "s").exists()


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _recommit(url: Path) -> None:
    """Re-sign a tampered checkpoint so that only the loader's own checks can catch it."""
    shards = []
    for path in url.iterdir():
        if path.name != "metadata.json":
            data = path.read_bytes()
            shards.append({"path": path.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    write_metadata(str(url), build_metadata(step=1, shards=shards, world_size=1))


def test_pickled_callable_in_the_index_is_refused(tmp_path: Path) -> None:
    url = tmp_path / "step-1"
    save_sharded({"model": {"w": torch.ones(2)}}, str(url), step=1)
    marker = tmp_path / "code-ran"
    (url / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    _recommit(url)
    assert verify(str(url)).step == 1  # checksums match: the attacker re-signed it
    with pytest.raises(CheckpointError, match=r"pickled reference to (posix|os)\.system"):
        load_sharded(str(url), {"model": None})
    with pytest.raises(CheckpointError, match="refused"):
        checkpoint_keys(str(url))
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_with_pickled_objects_is_refused(tmp_path: Path) -> None:
    url = tmp_path / "step-1"
    foreign = {"model/w": torch.ones(2), "callbacks/@json": torch.ones(1, dtype=torch.uint8), "hook": os.system}
    dcp.save(foreign, checkpoint_id=str(url))  # torch pickles the function into the checkpoint
    _recommit(url)
    with pytest.raises(CheckpointError, match="stores 'hook' as a pickled Python object"):
        load_sharded(str(url), {"model": None})


# ----------------------------------------------------------------------------- export


def test_export_loads_with_plain_lightning(saved: dict, tmp_path: Path) -> None:
    from tests.ckpt_workers.tiny_module import TinyLM

    dst = tmp_path / "model.ckpt"
    summary = export_to_lightning_ckpt(str(saved["root"] / "pp2" / "step-10"), str(dst), module_cls=TinyLM)
    assert summary["step"] == 10 and summary["tensors"] == len(reference_model().state_dict())
    model = TinyLM.load_from_checkpoint(str(dst))
    assert dict(model.hparams) == HPARAMS
    expected = reference_model().state_dict()
    assert list(model.state_dict()) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(model.state_dict()[name], tensor), name
    ckpt = torch.load(dst, weights_only=True)
    assert ckpt["global_step"] == 10 and ckpt["epoch"] == 1 and "pytorch-lightning_version" in ckpt


def test_export_refuses_a_module_that_does_not_match(saved: dict, tmp_path: Path) -> None:
    from tests.ckpt_workers.tiny_module import TinyLM

    class Wider(TinyLM):
        def __init__(self, width: int = 8, n_blocks: int = 3) -> None:
            super().__init__(width=16, n_blocks=n_blocks)

    with pytest.raises(CheckpointError, match=r"does not match Wider: .*embed.weight: \[8, 6\] vs \[16, 6\]"):
        export_to_lightning_ckpt(str(saved["root"] / "pp2" / "step-10"), str(tmp_path / "x.ckpt"), module_cls=Wider)
    with pytest.raises(CheckpointError, match="neither a committed checkpoint"):
        export_to_lightning_ckpt(str(tmp_path / "empty"), str(tmp_path / "x.ckpt"))
    assert not (tmp_path / "x.ckpt").exists()


def test_export_command_picks_the_newest_valid_checkpoint(
    saved: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    dst = tmp_path / "cli.ckpt"
    args = [str(saved["root"] / "pp2"), str(dst), "--module", "tests.ckpt_workers.tiny_module:TinyLM"]
    assert export_main(args) == 0
    assert "step-11 (step 11" in capsys.readouterr().out
    assert export_main([str(tmp_path / "empty"), str(tmp_path / "y.ckpt")]) == 2
    assert "error: export source" in capsys.readouterr().err
    ckpt = torch.load(dst, weights_only=True)
    assert ckpt["global_step"] == 10  # the state's own counter: step-11 re-saved the step-10 state
    for name, tensor in reference_model().state_dict().items():
        assert torch.equal(ckpt["state_dict"][name], tensor), name
    assert [n.split(".")[0] for n in ckpt["state_dict"]][:1] == [UNITS[0]]
