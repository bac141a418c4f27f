"""fp8 scaling state in checkpoints: saved as tensors and JSON, restored exactly, pickles refused.

* A resume of emulated fp8 stages (both frontends, 2 ranks): every amax history after the resume's
  load equals, bit for bit, what the checkpoint holds and what the interrupted run had, and the
  continued run's losses and parameters equal an uninterrupted run's exactly (same operations on the
  same values in the same order on the same machine, so no tolerance is needed).
* A pickle in an ``_extra_state`` entry (Transformer Engine's format) is refused on load, and on save.
* Transformer Engine's extra-state dict converts to the checkpoint layout and back; a module that
  looks like TE's (same ``fp8_meta`` structure and methods, see ``_FakeTELinear``) saves before and
  after its first fp8 forward with one layout, and is restored. The real-TE variant runs on GPUs.
"""

from __future__ import annotations

import copy
import io
import enum
import importlib.util
import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_hpp.checkpoint import checkpoint_keys, load_sharded, save_sharded
from lightning_hpp.checkpoint import fp8_state as fs
from lightning_hpp.precision import fp8_slots as fslots
from lightning_hpp.checkpoint import entries
from lightning_hpp.checkpoint.lightning_state import load_lightning_checkpoint, to_sharded
from lightning_hpp.checkpoint.weights import load_stage_weights
from lightning_hpp.errors import CheckpointError, CorruptCheckpointError
from lightning_hpp.precision.fp8_recipe import FP8Recipe

HAS_TE = importlib.util.find_spec("transformer_engine") is not None
STEPS, MORE = 3, 3  # save after STEPS, resume and train MORE
FRONTENDS = ("sequential", "traced")


# ============================================================================ resume, 2 ranks
def _run(out: Path, name: str, frontend: str, steps: int, **ckpt) -> dict:
    # tests.harness.zoo.MLP: layers.2 (stage 0) and layers.4 (stage 1) are 16x16 GEMMs that run in fp8;
    # layers.0 (8->16) and layers.6 (16->4) stay in fp32 (fp8 needs multiples of 16)
    return {"model": "mlp", "points": ["layers.4"], "precision": ["fp8", "fp8"], "fp8_backend": "emulate",
            "frontend": frontend, "schedule": "1f1b", "n_micro": 2, "batch": 8, "steps": steps, "out": str(out / name),
            **ckpt}


def two_rank_runs(out: Path) -> list[dict]:
    """Per frontend, in one job of 2 ranks (tests/conftest.py ``real_model_jobs``): STEPS+MORE steps
    uninterrupted (``full``), STEPS steps with a checkpoint at the end (``first``), then STEPS+MORE
    steps resumed from it (``resumed``)."""
    runs = []
    for frontend in FRONTENDS:
        ckpt = {"ckpt_dir": str(out / f"{frontend}_ckpt"), "every": STEPS}
        runs += [_run(out, f"{frontend}_full", frontend, STEPS + MORE),
                 _run(out, f"{frontend}_first", frontend, STEPS, **ckpt),
                 _run(out, f"{frontend}_resumed", frontend, STEPS + MORE, resume="auto", **ckpt)]
    return runs


@pytest.fixture(scope="module")
def resumed(real_model_jobs) -> Path:
    """This module's training outputs from the shared ``run_real`` jobs."""
    return real_model_jobs.fp8_state


def _rank(out: Path, name: str, rank: int) -> dict:
    return torch.load(out / name / f"rank{rank}.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_emulated_fp8_resume_restores_every_amax_history_bitwise_and_matches_the_uninterrupted_run(resumed, frontend):
    url = str(resumed / f"{frontend}_ckpt" / f"step-{STEPS}")
    saved = load_sharded(url, {fs.STATE_KEY: None})[fs.STATE_KEY]["dp0"]
    owners = {"sequential": ["layers.2", "layers.4"], "traced": ["layers.2.weight", "layers.4.weight"]}[frontend]
    assert sorted(saved) == owners  # one amax history per fp8 GEMM, under its layer's (weight's) name
    for name in owners:
        assert saved[name]["meta"] == {"backend": "emulate", "recipe": fslots.recipe_fields(FP8Recipe("delayed"))}
        assert saved[name]["amax_history"].shape == (1024, 3)
    got = {}
    for rank in (0, 1):
        first, again = _rank(resumed, f"{frontend}_first", rank), _rank(resumed, f"{frontend}_resumed", rank)
        assert again["resumed_from"] == url
        assert sorted(first["fp8_end"]) == sorted(again["fp8_start"])
        for name, state in again["fp8_start"].items():
            history = saved[name]["amax_history"]
            # 2 micro-batches x STEPS steps recorded: input, weight and grad_output amaxes, then zeros
            assert (history[: 2 * STEPS] > 0).all() and (history[2 * STEPS:] == 0).all(), name
            assert torch.equal(first["fp8_end"][name]["amax_history"], history), name  # what the run had ...
            assert torch.equal(state["amax_history"], history), name  # ... is what the resume starts from
            got[name] = rank
    assert sorted(got) == owners
    # the continued run is the uninterrupted one, bit for bit
    full, again = _rank(resumed, f"{frontend}_full", 0), _rank(resumed, f"{frontend}_resumed", 0)
    assert len(again["losses"]) == MORE and again["losses"] == full["losses"][STEPS:]
    for rank in (0, 1):
        full, again = _rank(resumed, f"{frontend}_full", rank), _rank(resumed, f"{frontend}_resumed", rank)
        assert sorted(full["state"]) == sorted(again["state"])
        for k, v in full["state"].items():
            assert torch.equal(v, again["state"][k]), f"rank {rank}: {k}"
        for name, state in full["fp8_end"].items():
            assert torch.equal(state["amax_history"], again["fp8_end"][name]["amax_history"]), name


# ============================================================================ pickles refused
class _WritesFile:
    """Unpickling this writes a file: the proof that a loader ran the pickle."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (Path(self.path), "pwned"))


class _UnpicklingExtraState(nn.Linear):
    """A layer whose extra state behaves like Transformer Engine's: an empty uint8 tensor before its
    first fp8 forward (``size`` 0), pickled bytes after it (``size`` of them), and a
    ``set_extra_state`` that unpickles what it is given."""

    loads = 0

    def __init__(self, n: int, size: int = 0) -> None:
        super().__init__(n, n)
        self.size = size

    def get_extra_state(self) -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if isinstance(state, torch.Tensor) and state.numel():
            type(self).loads += 1
            pickle.loads(state.numpy().tobytes())


def _pickled(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


@pytest.mark.parametrize("after_forward", [False, True], ids=["fresh", "after_a_forward"])
def test_a_pickle_in_extra_state_is_refused_on_load_and_never_unpickled(tmp_path, monkeypatch, after_forward):
    marker = tmp_path / "pwned"
    payload = _pickled(_WritesFile(str(marker)))
    # after a forward, the live extra state can have the saved one's size: the template then matches it
    net = nn.Sequential(_UnpicklingExtraState(16, payload.numel() if after_forward else 0))
    weight = torch.full((16, 16), 0.5)
    state = {"model": {"0.weight": weight, "0.bias": torch.zeros(16), "0._extra_state": payload}}

    # saving it is refused ...
    with pytest.raises(CheckpointError, match=r"\['model'\]\['0._extra_state'\].* is a pickle.*never hold pickles"):
        save_sharded(state, str(tmp_path / "refused"), step=1)
    # ... so write it as an older version (or a hand) would have: without that check
    url = str(tmp_path / "crafted")
    with monkeypatch.context() as m:
        m.setattr(entries, "holds_pickle", lambda value: False)
        save_sharded(state, url, step=1)

    with pytest.raises(CheckpointError) as refused:
        load_lightning_checkpoint(url, net, [], global_rank=0, position=0)
    message = str(refused.value)
    for part in ("'model/0._extra_state'", "holds a pickle", "loading refuses pickles", "was not unpickled",
                 "saves fp8 scaling state as tensors under 'fp8/'", "load_stage_weights"):
        assert part in message, message
    assert not marker.exists() and _UnpicklingExtraState.loads == 0

    # a weights file never hands `_extra_state` to a module: the weights load, the pickle stays unread
    fresh = nn.Sequential(_UnpicklingExtraState(16))
    assert load_stage_weights(fresh, url) == ["0.weight", "0.bias"]
    assert torch.equal(fresh[0].weight, weight) and not marker.exists() and _UnpicklingExtraState.loads == 0


def test_holds_pickle_reads_opcodes_only():
    for obj in (None, {"scale": [1.0]}, _WritesFile("/nonexistent")):
        for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
            data = pickle.dumps(obj, protocol=protocol)
            assert entries.holds_pickle(torch.frombuffer(bytearray(data), dtype=torch.uint8)), (obj, protocol)
            assert entries.holds_pickle(data + b"trailing bytes pickle.loads ignores")
    buffer = io.BytesIO()
    torch.save({"a": 1}, buffer)
    assert entries.holds_pickle(buffer.getvalue())  # a torch.save archive holds one
    assert not entries.holds_pickle(torch.empty(0, dtype=torch.uint8))
    assert not entries.holds_pickle(torch.arange(200, dtype=torch.uint8))
    assert not entries.holds_pickle(torch.frombuffer(bytearray(json.dumps({"a": 1}).encode()), dtype=torch.uint8))
    assert not entries.holds_pickle(torch.zeros(3))


# ============================================================================ TE's dict
class Format(enum.Enum):  # transformer_engine.common.recipe.Format, the member this project uses
    HYBRID = "hybrid"


@dataclass
class DelayedScaling:  # transformer_engine.common.recipe.DelayedScaling, the fields read here
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def delayed(self) -> bool:
        return True


@dataclass
class Float8CurrentScaling:
    fp8_format: Format = Format.HYBRID


def _te_dict(history: int = 4, gemms: int = 1, seed: int = 0) -> dict:
    """A dict shaped like the one TE 2.x's `TransformerEngineBaseModule.get_extra_state` pickles
    (transformer_engine/pytorch/module/base.py): recipe, delayed-scaling tensors, plain fp8_meta values."""
    g = torch.Generator().manual_seed(seed)
    return {
        "recipe": DelayedScaling(margin=1, amax_history_len=history, amax_compute_algo="most_recent"),
        "scale_fwd": torch.rand(3 * gemms, generator=g) * 100,
        "amax_history_fwd": torch.rand(history, 3 * gemms, generator=g),
        "scale_bwd": torch.rand(2 * gemms, generator=g) * 100,
        "amax_history_bwd": torch.rand(history, 2 * gemms, generator=g),
        "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": gemms, "fp8_max_fwd": 448.0,
                                "fp8_max_bwd": 57344.0, "global_fp8_buffer_pos_fwd_recompute": [3],
                                "autocast_key": ("a", 1)},
    }


def test_te_extra_state_converts_to_tensors_and_json_and_back():
    te = _te_dict(history=4, gemms=2)
    data = fslots.te_extra_state_to_data(te)
    assert data["meta"] == {
        "backend": "te", "initialized": True,
        "recipe": {"format": "HYBRID", "scaling": "delayed", "margin": 1, "amax_history_len": 4,
                   "amax_compute_algo": "most_recent"},
        # process-local positions are dropped (TE's own set_extra_state drops them too)
        "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": 2, "fp8_max_fwd": 448.0, "fp8_max_bwd": 57344.0,
                                "autocast_key": ("a", 1)},
    }
    assert {k: tuple(v.shape) for k, v in data.items() if k != "meta"} == {
        "scale_fwd": (6,), "scale_inv_fwd": (6,), "amax_history_fwd": (4, 6),
        "scale_bwd": (4,), "scale_inv_bwd": (4,), "amax_history_bwd": (4, 4)}
    assert torch.equal(data["scale_inv_fwd"], 1 / te["scale_fwd"])  # TE 2.x keeps none: 1 / scale
    # it is checkpoint data: tensors, and JSON for the rest (no pickle anywhere)
    tensors, docs = entries.flatten_state({"fp8": data})
    assert sorted(tensors) == sorted(f"fp8/{k}" for k in data if k != "meta") and list(docs) == ["fp8/meta/@json"]

    back = fslots.te_extra_state_from_data(data, te["recipe"])
    assert back["recipe"] is te["recipe"]
    for k in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
        assert torch.equal(back[k], te[k]), k
    assert back["extra_fp8_variables"] == data["meta"]["extra_fp8_variables"]

    # TE 1.x: scale_inv saved, no recipe in the dict
    old = {k: v for k, v in te.items() if k != "recipe"}
    old["scale_inv_fwd"], old["scale_inv_bwd"] = torch.full((6,), 0.25), torch.full((4,), 0.5)
    data1 = fslots.te_extra_state_to_data(old, recipe=te["recipe"])
    for d in ("fwd", "bwd"):
        assert torch.equal(data1[f"scale_inv_{d}"], old[f"scale_inv_{d}"]), d
    with pytest.raises(CheckpointError, match="without a recipe"):
        fslots.te_extra_state_to_data(old)
    # current scaling keeps no tensors
    current = fslots.te_extra_state_to_data({"recipe": Float8CurrentScaling(), "extra_fp8_variables": {}})
    assert current == {"meta": {"backend": "te", "initialized": True, "extra_fp8_variables": {},
                                "recipe": {"format": "HYBRID", "scaling": "current"}}}
    # refused: another recipe, shapes the recipe does not give
    with pytest.raises(CheckpointError, match="cannot be restored under"):
        fslots.te_extra_state_from_data(data, DelayedScaling(amax_history_len=8))
    bad = {**data, "amax_history_bwd": torch.zeros(4, 3)}
    with pytest.raises(CorruptCheckpointError, match="amax_history_bwd"):
        fslots.te_extra_state_from_data(bad, te["recipe"])


class _Meta:  # TE 2.x's DelayedScalingRecipeState: `scale` and `amax_history`
    def __init__(self, n: int, history: int) -> None:
        self.scale, self.amax_history = torch.ones(n), torch.zeros(history, n)


class _FakeTELinear(nn.Linear):
    """What of ``transformer_engine.pytorch.Linear`` the checkpoint code touches: ``fp8_meta`` (no
    recipe and no tensors until the first fp8 forward), ``fp8_meta_tensors_initialized``,
    ``init_fp8_meta_tensors(recipe)`` (keeps tensors already there, as TE's does for delayed scaling),
    and a ``get_extra_state`` that pickles (TE's format)."""

    __module__ = "transformer_engine.pytorch.module.linear"

    def __init__(self, n: int) -> None:
        super().__init__(n, n)
        self.fp8_meta = {"fp8_checkpoint": False, "fp8_group": None}
        self.fp8_meta_tensors_initialized = False

    def init_fp8_meta_tensors(self, recipe) -> None:
        for d, per in (("fwd", 3), ("bwd", 2)):
            if f"scaling_{d}" not in self.fp8_meta:
                self.fp8_meta[f"scaling_{d}"] = _Meta(per * self.fp8_meta["num_gemms"], recipe.amax_history_len)
        self.fp8_meta_tensors_initialized = True

    def fp8_forward(self, x: torch.Tensor, recipe) -> torch.Tensor:
        """One fp8 forward and backward, as far as the scaling state goes: record amaxes, update scales."""
        self.fp8_meta.update(recipe=recipe, num_gemms=1, fp8_checkpoint=True, fp8_max_fwd=448.0, fp8_max_bwd=57344.0)
        self.init_fp8_meta_tensors(recipe)
        for d in ("fwd", "bwd"):
            meta = self.fp8_meta[f"scaling_{d}"]
            meta.amax_history = torch.roll(meta.amax_history, 1, 0)
            meta.amax_history[0] = x.abs().amax() * torch.arange(1, meta.scale.numel() + 1)
            meta.scale.copy_(448.0 / meta.amax_history.amax(0))
        return self(x)

    def get_extra_state(self) -> torch.Tensor:
        if not self.fp8_meta["fp8_checkpoint"]:
            return torch.empty(0, dtype=torch.uint8)
        return _pickled({"recipe": self.fp8_meta["recipe"], "scale_fwd": self.fp8_meta["scaling_fwd"].scale})

    def set_extra_state(self, state) -> None:
        assert state is None, "the checkpoint code must never hand TE's set_extra_state anything but None"


_FakeTELinear.__name__ = "Linear"  # TE's class name, which tells its number of GEMMs


def _save_and_resume(tmp_path: Path, name: str, model: nn.Module, recipe) -> tuple[nn.Module, dict]:
    """Save ``model`` (its LightningModule-like parts) as HPPStrategy does, load it into a fresh copy."""
    slots = fslots.fp8_slots(model, recipe)
    ckpt = {"state_dict": model.state_dict(), "global_step": 1}
    state = to_sharded(ckpt, model, [], global_rank=0, position=0, replica=0, fp8=slots)
    url = str(tmp_path / name)
    save_sharded(state, url, step=1)
    fresh = nn.Sequential(_FakeTELinear(16))
    loaded = load_lightning_checkpoint(url, fresh, [], global_rank=0, position=0, fp8=fslots.fp8_slots(fresh, recipe))
    fresh.load_state_dict(loaded["state_dict"])  # what HPPStrategy.load_model_state_dict does
    return fresh, {k: v for k, v in checkpoint_keys(url).items() if k[0] in ("fp8", "model")}


def test_a_module_shaped_like_transformer_engine_saves_one_layout_before_and_after_its_first_fp8_forward(
        tmp_path, monkeypatch):
    recipe = FP8Recipe("delayed", amax_history_len=4)
    te_recipe = DelayedScaling(amax_history_len=4)
    # the TE recipe object HPPPrecision's context uses
    monkeypatch.setattr(fslots, "te_recipe_of", lambda rc: te_recipe)
    torch.manual_seed(0)
    model = nn.Sequential(_FakeTELinear(16))

    fresh, before = _save_and_resume(tmp_path, "before", model, recipe)
    assert not fresh[0].fp8_meta_tensors_initialized  # nothing to restore before the first fp8 forward
    for step in range(3):
        model[0].fp8_forward(torch.randn(8, 16) * (step + 1), te_recipe)
    restored, after = _save_and_resume(tmp_path, "after", model, recipe)

    # one layout, fixed by the recipe: a fresh model's template asks for what was saved (no "architecture differs")
    assert sorted(before) == sorted(after)
    def shapes(keys: dict) -> dict:
        return {k: v.shape for k, v in keys.items() if v.kind == "tensor"}

    assert shapes(before) == shapes(after)
    assert ("model", "0._extra_state") not in after  # TE's pickle is not saved
    assert {k[2:] for k in after if k[0] == "fp8"} == {
        ("0", "scale_fwd"), ("0", "scale_inv_fwd"), ("0", "amax_history_fwd"),
        ("0", "scale_bwd"), ("0", "scale_inv_bwd"), ("0", "amax_history_bwd"), ("0", "meta")}
    assert after[("fp8", "dp0", "0", "amax_history_fwd")].shape == (4, 3)
    live, got = model[0].fp8_meta, restored[0].fp8_meta
    assert got["recipe"] is te_recipe and got["num_gemms"] == 1 and got["fp8_max_bwd"] == 57344.0
    for d in ("fwd", "bwd"):
        assert torch.equal(got[f"scaling_{d}"].scale, live[f"scaling_{d}"].scale), d
        assert torch.equal(got[f"scaling_{d}"].amax_history, live[f"scaling_{d}"].amax_history), d
    assert (live["scaling_fwd"].amax_history[:3] > 0).all()
    x = torch.randn(8, 16)
    assert torch.equal(restored[0].fp8_forward(x, te_recipe), model[0].fp8_forward(x, te_recipe))
    assert torch.equal(restored[0].fp8_meta["scaling_bwd"].scale, model[0].fp8_meta["scaling_bwd"].scale)


def test_a_resume_under_another_recipe_warns_and_starts_its_scaling_afresh(tmp_path):
    from lightning_hpp.precision.fp8_emulation import EmulatedFP8Linear

    saved = nn.Sequential(EmulatedFP8Linear(16, 16, recipe=FP8Recipe("delayed", amax_history_len=4)))
    saved(torch.randn(8, 16))
    url = str(tmp_path / "ckpt")
    state = to_sharded({"state_dict": saved.state_dict()}, saved, [], global_rank=0, position=0, replica=0,
                       fp8=fslots.fp8_slots(saved))
    save_sharded(state, url, step=1)
    for recipe in (FP8Recipe("delayed", amax_history_len=8), "current"):
        other = nn.Sequential(EmulatedFP8Linear(16, 16, recipe=recipe))
        with pytest.warns(UserWarning, match=r"not restored.*'0' \(it was saved with the recipe"):
            load_lightning_checkpoint(url, other, [], global_rank=0, position=0, fp8=fslots.fp8_slots(other))
        assert (other[0].amax_history == 0).all()
    same = nn.Sequential(EmulatedFP8Linear(16, 16, recipe=FP8Recipe("delayed", amax_history_len=4)))
    load_lightning_checkpoint(url, same, [], global_rank=0, position=0, fp8=fslots.fp8_slots(same))
    assert torch.equal(same[0].amax_history, saved[0].amax_history)
    assert (same[0].amax_history[0, :2] > 0).all()  # input and weight (no backward ran)


# ============================================================================ real Transformer Engine
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not HAS_TE, reason="needs transformer_engine")
def test_transformer_engine_delayed_scaling_state_resumes_exactly(tmp_path):
    from lightning_hpp.precision.fp8 import convert_module_to_fp8, fp8_autocast_context, fp8_capable

    ok, reason = fp8_capable("cuda")
    if not ok:
        pytest.skip(reason)
    recipe = FP8Recipe("delayed", amax_history_len=16)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32)).cuda()
    model = convert_module_to_fp8(copy.deepcopy(plain), "te", recipe)
    fresh_model = convert_module_to_fp8(copy.deepcopy(plain), "te", recipe)

    def step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with fp8_autocast_context("te", recipe):
            out = m(x)
        out.float().pow(2).mean().backward()
        return out.detach()

    xs = [torch.randn(32, 64, device="cuda") * (i + 1) for i in range(4)]
    for x in xs[:3]:
        step(model, x)
    slots = fslots.fp8_slots(model, recipe)
    assert sorted(slots) == ["0", "2"]
    state = to_sharded({"state_dict": model.state_dict()}, model, [], global_rank=0, position=0, replica=0, fp8=slots)
    assert not any(k.endswith("_extra_state") for k in state["model"])
    url = str(tmp_path / "ckpt")
    save_sharded(state, url, step=3)
    loaded = load_lightning_checkpoint(url, fresh_model, [], global_rank=0, position=0,
                                       fp8=fslots.fp8_slots(fresh_model, recipe))
    fresh_model.load_state_dict(loaded["state_dict"])
    for name in ("0", "2"):
        live, got = model.get_submodule(name).fp8_meta, fresh_model.get_submodule(name).fp8_meta
        for d in ("fwd", "bwd"):
            assert torch.equal(got[f"scaling_{d}"].scale, live[f"scaling_{d}"].scale), (name, d)
            assert torch.equal(got[f"scaling_{d}"].amax_history, live[f"scaling_{d}"].amax_history), (name, d)
        assert (live["scaling_fwd"].amax_history != 0).any() and (live["scaling_fwd"].scale != 1).any()
    assert torch.equal(step(fresh_model, xs[3]), step(model, xs[3]))
