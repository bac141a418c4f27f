"""Out to inference: a sharded checkpoint exported to one Lightning ``.ckpt`` (every name of a tied tensor, so that
``load_from_checkpoint`` loads strictly) or, with ``--hf``, to transformers' ``save_pretrained`` format, and a
sharded directory handed to a one-file loader.

One 2-rank job (tests/workers/run_export.py) trains a GPT-2 (LM head tied to the embedding, the head in the second
stage) and an untied Llama in 2 stages with ``ModelCheckpoint(save_last=True)``; every rank saves the weights it
trained. The exports of ``last.ckpt`` are compared with those weights, tensor for tensor (bitwise: an export
copies), on every rank; the ``--hf`` directory with what ``save_pretrained`` writes for the same weights, file for
file and byte for byte. The single-process tests write their checkpoints with the strategy's own conversion
(:func:`~lightning_hpp.checkpoint.lightning_state.to_sharded`).
"""

from __future__ import annotations

import filecmp
import os
import re
import weakref
from pathlib import Path

import fsspec
import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_hpp.checkpoint import checkpoint_keys, export_to_pretrained, model_source, save_sharded
from lightning_hpp.checkpoint.export import main as export_main
from lightning_hpp.checkpoint.lightning_state import TIED, to_sharded
from lightning_hpp.checkpoint.pretrained import find_pretrained, save_keys
from lightning_hpp.checkpoint.warning import CheckpointWarning
from lightning_hpp.errors import CheckpointError, ShardedCheckpointError
from tests.harness.launch import Job, run_job
from tests.harness.results import load_rank
from tests.harness.zoo import MLP
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
    run_job(Job("tests.workers.run_export", {"runs": runs}, ranks=2, start="forked", timeout=600))
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


# ============================================================================ --hf: save_pretrained's format


@pytest.mark.slow
def test_hf_export_is_what_save_pretrained_writes_and_loads_with_from_pretrained(trained: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel, LlamaForCausalLM

    classes = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM}
    for name, shard_size in (("gpt2", "50KB"), ("llama", "50GB")):  # GPT-2 in 6 files with an index, Llama in one
        out = tmp_path / name
        assert export_main([_last(trained, name), str(out), "--hf", "--module", MODULE,
                            "--max-shard-size", shard_size]) == 0
        for loader in (AutoModelForCausalLM, classes[name]):
            loaded = loader.from_pretrained(str(out))
            assert type(loaded) is classes[name]
            _assert_trained(loaded.state_dict(), trained / name, prefix="model.")
        # the reference: the same trained weights in the same module, written by transformers itself
        reference = ExportLM(name, tie=name == "gpt2")
        reference.load_state_dict({k: v for r in (0, 1) for k, v in load_rank(trained / name, r)["state"].items()})
        reference.model.save_pretrained(str(tmp_path / f"{name}-reference"), max_shard_size=shard_size)
        files = sorted(os.listdir(out))
        assert files == sorted(os.listdir(tmp_path / f"{name}-reference"))
        assert ("model.safetensors.index.json" in files) == (name == "gpt2")
        _, mismatch, errors = filecmp.cmpfiles(out, tmp_path / f"{name}-reference", files, shallow=False)
        assert not mismatch and not errors, f"{name}: files that differ from save_pretrained's: {mismatch + errors}"
    tied = AutoModelForCausalLM.from_pretrained(str(tmp_path / "gpt2"))
    assert tied.lm_head.weight is tied.transformer.wte.weight


@pytest.mark.slow
def test_hf_export_streams_one_tensor_at_a_time_from_s3_to_s3(trained: Path, tmp_path: Path,
                                                               s3_env: S3Env,  # noqa: F811
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    fs = fsspec.filesystem("s3", endpoint_url=s3_env.endpoint)
    src, dst = f"{s3_env.root}/ckpt/last.ckpt", f"{s3_env.root}/hf"
    fs.put(_last(trained, "gpt2"), src.removeprefix("s3://"), recursive=True)
    reads: list[int] = []
    alive: list[weakref.ref] = []
    real = model_source.load_sharded

    def spying(url, state, *args, **kwargs):
        model = state.get("model")
        if model is not None:  # a read of the model's tensors: every one read before must be gone
            assert not [r for r in alive if r() is not None], "an earlier tensor is still held"
            reads.append(len(model))
        loaded = real(url, state, *args, **kwargs)
        alive.extend(weakref.ref(t) for t in (loaded.get("model") or {}).values())
        return loaded

    monkeypatch.setattr(model_source, "load_sharded", spying)
    summary = export_to_pretrained(src, dst, ExportLM, max_shard_size="50KB")
    assert reads == [1] * summary["tensors"] and summary["tensors"] == 52  # GPT-2's 53 names less the tied head
    fs.get(dst.removeprefix("s3://"), str(tmp_path / "hf"), recursive=True)
    assert sorted(os.listdir(tmp_path / "hf")) == sorted(summary["files"])
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    _assert_trained(loaded.state_dict(), trained / "gpt2", prefix="model.")


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
    with pytest.raises(CheckpointError, match=message):
        export_to_pretrained(broken, str(tmp_path / "broken-hf"), ExportLM)
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


def test_hf_export_refuses_what_it_cannot_write(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    mlp = _saved(tmp_path / "mlp", MLP())
    gpt2 = _saved(tmp_path / "gpt2", ExportLM("gpt2"))
    dst = str(tmp_path / "hf")
    cases = [
        ([mlp, dst, "--hf", "--module", "tests.harness.zoo:MLP"], "MLP holds no transformers `PreTrainedModel`"),
        ([gpt2, dst, "--hf"], "--hf needs --module package.module:MyModule"),
        ([gpt2, dst, "--hf", "--module", MODULE, "--hf-prefix", "model.lm_head"],
         "ExportLM.model.lm_head is a Linear, not a transformers `PreTrainedModel`"),
        ([gpt2, dst, "--hf", "--module", MODULE, "--max-shard-size", "a lot"], "max_shard_size='a lot' is not a size"),
        ([gpt2, dst, "--hf-prefix", "model"], "apply to the --hf export only"),
        ([gpt2, dst, "--hf", "--module", "tests.harness.zoo:NoSuchModule"], "cannot be imported"),
    ]
    for argv, message in cases:
        assert export_main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not os.path.exists(dst)

    class TwoModels(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student, self.teacher = ExportLM("gpt2").model, ExportLM("gpt2").model

    with pytest.raises(CheckpointError, match=r"several transformers models: \['student', 'teacher'\]"):
        find_pretrained(TwoModels())
    assert find_pretrained(TwoModels(), "teacher")[0] == "teacher"
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1)
    with torch.device("meta"):
        moe = MixtralForCausalLM(config)
    with pytest.raises(CheckpointError, match="transformers converts this model's weights when saving"):
        save_keys(moe)


# ============================================================================ a directory handed to one-file loaders


def test_a_sharded_directory_handed_to_one_file_loaders_names_the_export_command(tmp_path: Path) -> None:
    last = tmp_path / "ckpt" / "last.ckpt"
    state = to_sharded({"state_dict": MLP().state_dict(), "global_step": 1, "epoch": 0}, MLP(), [], global_rank=0,
                       position=0, replica=0)
    save_sharded(state, str(last), step=1)
    save_sharded(state, str(tmp_path / "root" / "step-1"), step=1)
    loaders = {
        "torch.load": lambda p: torch.load(p),
        "torch.load(str, weights_only=True)": lambda p: torch.load(str(p), weights_only=True),
        "load_from_checkpoint": lambda p: MLP.load_from_checkpoint(str(p)),
        "TorchCheckpointIO (Trainer ckpt_path)": lambda p: TorchCheckpointIO().load_checkpoint(str(p)),
    }
    for path in (last, tmp_path / "root"):  # a ModelCheckpoint path, a root of step-<N> checkpoints
        command = f"python -m lightning_hpp.checkpoint.export {path} model.ckpt"
        for what, load in loaders.items():
            with pytest.raises(ShardedCheckpointError, match=re.escape(command)) as info:
                load(path)
            assert isinstance(info.value, IsADirectoryError), what  # code that caught the old error still does
            assert isinstance(info.value.__cause__, OSError), what
    # every other call is as before
    with pytest.raises(IsADirectoryError) as info:
        torch.load(tmp_path / "ckpt")  # a directory that is no checkpoint
    assert not isinstance(info.value, ShardedCheckpointError)
    with pytest.raises(FileNotFoundError):
        torch.load(tmp_path / "missing.ckpt")
    torch.save({"a": 1}, tmp_path / "file.pt")
    assert torch.load(tmp_path / "file.pt") == {"a": 1}
    # and the command it names makes a file they load
    assert export_main([str(last), str(tmp_path / "model.ckpt")]) == 0
    MLP.load_from_checkpoint(str(tmp_path / "model.ckpt"))
