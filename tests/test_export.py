"""Out to inference: a sharded checkpoint exported to one Lightning ``.ckpt``, every name of a tied tensor in it, so
that ``load_from_checkpoint`` loads strictly.

One 2-rank job (tests/workers/run_export.py) trains a GPT-2 (LM head tied to the embedding, the head in the second
stage) and an untied Llama in 2 stages with ``ModelCheckpoint(save_last=True)``; every rank saves the weights it
trained. The exports of ``last.ckpt`` are compared with those weights, tensor for tensor (bitwise: an export
copies), on every rank. The single-process tests write their checkpoints with the strategy's own conversion
(:func:`~lightning_hpp.checkpoint.lightning_state.to_sharded`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lightning_hpp.checkpoint import checkpoint_keys, save_sharded
from lightning_hpp.checkpoint.export import main as export_main
from lightning_hpp.checkpoint.lightning_state import TIED, to_sharded
from lightning_hpp.checkpoint.store import CheckpointWarning
from lightning_hpp.errors import CheckpointError
from tests.launch import forked, load_rank, run_scripts
from tests.s3_server import S3Env, s3_env  # noqa: F401
from tests.workers.run_export import ExportLM

MODULE = "tests.workers.run_export:ExportLM"
WTE, HEAD = "model.transformer.wte.weight", "model.lm_head.weight"
RUNS = {"gpt2": {"kind": "gpt2", "points": ["model.transformer.h.2"]},
        "llama": {"kind": "llama", "tie": False, "points": ["model.model.layers.1"]}}
STEPS = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job's directory: ``<name>/rank{r}.pt`` (each rank's trained weights), ``<name>/ckpt/last.ckpt``."""
    out = tmp_path_factory.mktemp("export_job")
    runs = [{**cfg, "name": name, "steps": STEPS, "out": str(out / name)} for name, cfg in RUNS.items()]
    run_scripts([forked("tests.workers.run_export", {"runs": runs}, 2)], timeout=600)
    return out


def _last(trained: Path, name: str) -> str:
    return str(trained / name / "ckpt" / "last.ckpt")


def _assert_trained(state: dict[str, torch.Tensor], out: Path, prefix: str = "") -> None:
    """``state`` (the LightningModule's names less ``prefix``) holds every rank's trained tensors, bitwise, and
    nothing else."""
    names = set()
    for r in (0, 1):
        for name, value in load_rank(out, r)["state"].items():
            key = name.removeprefix(prefix)
            names.add(key)
            assert key in state, f"{key} (rank {r}) is not in the export"
            assert torch.equal(state[key], value), f"{key} differs from rank {r}'s trained tensor"
    assert set(state) == names


# ============================================================================ one .ckpt, every name


@pytest.mark.slow
def test_tied_gpt2_and_untied_llama_export_to_one_ckpt_that_loads_strictly(trained: Path, tmp_path: Path) -> None:
    gpt2 = _last(trained, "gpt2")
    keys = checkpoint_keys(gpt2)
    assert ("model", WTE) in keys and ("model", HEAD) not in keys  # the tied tensor is saved once
    for name in RUNS:
        dst = tmp_path / f"{name}.ckpt"
        assert export_main([_last(trained, name), str(dst)]) == 0
        model = ExportLM.load_from_checkpoint(str(dst))  # strict, as Lightning loads by default
        _assert_trained(model.state_dict(), trained / name)
        ckpt = torch.load(dst, weights_only=True)
        assert ckpt["global_step"] == STEPS and ckpt["hyper_parameters"] == {"kind": name, "tie": name == "gpt2"}
        # --module: the module built on the meta device checks the export and gives it its key order
        checked = tmp_path / f"{name}-checked.ckpt"
        assert export_main([_last(trained, name), str(checked), "--module", MODULE]) == 0
        in_order = torch.load(checked, weights_only=True)["state_dict"]
        assert list(in_order) == list(model.state_dict())
        assert all(torch.equal(v, ckpt["state_dict"][k]) for k, v in in_order.items())
    tied = ExportLM.load_from_checkpoint(str(tmp_path / "gpt2.ckpt")).model
    assert tied.lm_head.weight is tied.transformer.wte.weight
    assert torch.equal(torch.load(tmp_path / "gpt2.ckpt", weights_only=True)["state_dict"][HEAD],
                       load_rank(trained / "gpt2", 1)["state"][HEAD])
    untied = ExportLM.load_from_checkpoint(str(tmp_path / "llama.ckpt")).model
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


# ============================================================================ one process: refusals, older checkpoints


def _saved(tmp_path: Path, module, edit=None) -> str:
    """``module``'s weights as one rank of HPPStrategy writes them, at ``tmp_path/step-2``."""
    hparams = dict(getattr(module, "hparams", {}))
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": hparams, "hparams_name": "kwargs",
                  "epoch": 0, "global_step": 2}
    state = to_sharded(checkpoint, module, [], global_rank=0, position=0, replica=0)
    if edit is not None:
        edit(state)
    url = str(tmp_path / "step-2")
    save_sharded(state, url, step=2)
    return url


def test_a_tied_name_whose_saved_tensor_is_missing_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lightning_hpp.checkpoint import export_to_lightning_ckpt

    model = ExportLM("gpt2")
    whole = _saved(tmp_path / "whole", model)
    assert export_main([whole, str(tmp_path / "whole.ckpt")]) == 0
    ExportLM.load_from_checkpoint(str(tmp_path / "whole.ckpt"))  # strictly

    broken = _saved(tmp_path / "broken", model, edit=lambda state: state["model"].pop(WTE))
    message = re.escape(f"records tied names whose saved tensor is missing: '{HEAD}' -> '{WTE}'")
    for module_cls in (None, ExportLM):
        with pytest.raises(CheckpointError, match=message):
            export_to_lightning_ckpt(broken, str(tmp_path / "broken.ckpt"), module_cls)
    assert export_main([broken, str(tmp_path / "broken.ckpt")]) == 2
    assert "error: " in capsys.readouterr().err
    assert not (tmp_path / "broken.ckpt").exists()


def test_a_checkpoint_without_tied_names_warns_and_the_module_restores_them(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    from lightning_hpp.checkpoint import export_to_lightning_ckpt

    older = _saved(tmp_path, ExportLM("gpt2"), edit=lambda state: state["position_pp0"].pop(TIED))
    with pytest.warns(CheckpointWarning, match="did not record the other names of tied tensors"):
        export_to_lightning_ckpt(older, str(tmp_path / "plain.ckpt"))
    assert HEAD not in torch.load(tmp_path / "plain.ckpt", weights_only=True)["state_dict"]
    assert export_main([older, str(tmp_path / "plain.ckpt")]) == 0
    assert "warning: " in capsys.readouterr().err  # the command says it too
    assert export_main([older, str(tmp_path / "checked.ckpt"), "--module", MODULE]) == 0
    model = ExportLM.load_from_checkpoint(str(tmp_path / "checked.ckpt"))
    assert model.model.lm_head.weight is model.model.transformer.wte.weight
