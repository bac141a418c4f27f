"""load_stage_weights: a materialized stage reads its initial weights, and only those, from disk.

Real checkpoints throughout: a tiny LlamaForCausalLM (tied embeddings) saved with transformers'
``save_pretrained`` in several shards, GPT-2 in one ``model.safetensors``, plain
``safetensors.torch.save_file`` files, and this project's ``save_sharded`` checkpoints. What is read
is measured by wrapping ``safetensors.safe_open`` (and ``torch.distributed.checkpoint.load``) with
spies that record and pass every call through.
"""

from __future__ import annotations

import json
import os

import pytest
import safetensors
import torch
from safetensors.torch import save_file
from torch import nn

from lightning_hpp.checkpoint import save_sharded
from lightning_hpp.checkpoint.entries import parse_key
from lightning_hpp.checkpoint.weights import load_stage_weights
from lightning_hpp.errors import CheckpointError
from tests.harness.zoo.real import SEQ, VOCAB, LMWrapper, gpt2, llama

# installed by scripts/setup.sh: a missing one is a broken environment, not a skip
import transformers  # noqa: F401,E402

LAYERS = 3


# ---------------------------------------------------------------------------- fixtures and spies


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    """A tiny Llama (seed 0) saved in several shards: (directory, the saved model, its weight map)."""
    torch.manual_seed(0)
    model = llama(LAYERS).eval()
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path, max_shard_size="50KB")
    with open(path / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    assert len(set(weight_map.values())) >= 3, "the tiny model must be saved in several shards"
    assert "lm_head.weight" not in weight_map  # save_pretrained dropped the tied duplicate
    return str(path), model, weight_map


def fresh(kind: str = "llama", seed: int = 1, **kw) -> LMWrapper:
    """The user's LightningModule (``self.model = <transformers model>``), initialized differently."""
    return LMWrapper(kind, seed=seed, **kw).eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, -3:] = 0
    return ids, mask


class Reads:
    """Spy on ``safetensors.safe_open``: the files opened and the tensors read (passed through)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened: list[str] = []
        self.tensors: list[str] = []
        real = safetensors.safe_open
        spy = self

        class Handle:
            def __init__(self, path, *args, **kwargs):
                spy.opened.append(os.path.basename(path))
                self._handle = real(path, *args, **kwargs)

            def __enter__(self):
                self._inner = self._handle.__enter__()
                return self

            def __exit__(self, *exc):
                return self._handle.__exit__(*exc)

            def keys(self):
                return self._inner.keys()

            def get_slice(self, name):
                return self._inner.get_slice(name)

            def get_tensor(self, name):
                spy.tensors.append(name)
                return self._inner.get_tensor(name)

        monkeypatch.setattr(safetensors, "safe_open", Handle)


def stage_names(module: nn.Module, layers: tuple[int, ...]) -> list[str]:
    """One stage's names: the embeddings and the given decoder layers."""
    return [n for n in module.state_dict()
            if "embed_tokens" in n or any(f".layers.{i}." in n for i in layers)]


# ---------------------------------------------------------------------------- stage-local loads


def test_stage_reads_only_its_tensors_and_shards(saved_llama, monkeypatch):
    path, saved, weight_map = saved_llama
    module = fresh()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    names = stage_names(module, (0, 1))
    reads = Reads(monkeypatch)

    loaded = load_stage_weights(module, path, names=names, rename="model.")

    assert loaded == names
    in_file = [n.removeprefix("model.") for n in names]
    assert sorted(reads.tensors) == sorted(in_file)  # each wanted tensor read once, nothing else
    needed = {weight_map[n] for n in in_file}
    assert sorted(reads.opened) == sorted(needed)  # each needed shard opened once
    assert set(weight_map.values()) - needed, "some shard holds none of the stage's tensors"
    saved_sd = saved.state_dict()
    after = module.state_dict()
    for name in names:
        assert torch.equal(after[name], saved_sd[name.removeprefix("model.")]), name
    for name, value in after.items():
        if name not in names and name != "model.lm_head.weight":  # the head is the tied embedding
            assert torch.equal(value, before[name]), f"{name} was changed"


def test_stage_built_on_meta_loads_what_it_materialized(saved_llama, monkeypatch):
    path, saved, weight_map = saved_llama
    torch.manual_seed(1)
    with torch.device("meta"):
        module = LMWrapper("llama", seed=1)
    inner = module.model.model
    for part in (inner.embed_tokens, inner.layers[0], inner.layers[1]):
        part.to_empty(device="cpu")  # this rank's stage; the rest stays on meta
    reads = Reads(monkeypatch)

    loaded = load_stage_weights(module, path, rename="model.")  # default names: not on meta

    expected = [n for n, v in module.state_dict().items() if not v.is_meta]
    assert loaded == expected and loaded == stage_names(module, (0, 1))
    assert sorted(reads.tensors) == sorted(n.removeprefix("model.") for n in loaded)
    assert "model.norm.weight" not in reads.tensors
    assert weight_map["model.layers.2.mlp.down_proj.weight"] not in reads.opened
    saved_sd = saved.state_dict()
    for name in loaded:
        assert torch.equal(module.state_dict()[name], saved_sd[name.removeprefix("model.")])
    assert module.model.model.layers[2].mlp.down_proj.weight.is_meta


def test_full_load_gives_the_saved_models_outputs(saved_llama):
    path, saved, _ = saved_llama
    module = fresh()
    ids, mask = batch()
    with torch.no_grad():
        expected = saved(input_ids=ids, attention_mask=mask).logits
        assert not torch.equal(module(ids, attention_mask=mask), expected)
    params = {n: p for n, p in module.named_parameters(remove_duplicate=False)}

    loaded = load_stage_weights(module, path, rename="model.", check_unexpected=True)

    assert loaded == list(module.state_dict())
    assert "model.lm_head.weight" in loaded  # filled from the tied embedding, which the file holds
    with torch.no_grad():
        assert torch.equal(module(ids, attention_mask=mask), expected)
    # copied in place: the same Parameter objects, the tie intact
    assert all(p is params[n] for n, p in module.named_parameters(remove_duplicate=False))
    assert module.model.lm_head.weight is module.model.model.embed_tokens.weight


def test_tied_name_alone_is_read_from_its_alias(saved_llama, monkeypatch):
    path, saved, _ = saved_llama
    module = fresh()
    reads = Reads(monkeypatch)
    assert load_stage_weights(module, path, names=["model.lm_head.weight"], rename="model.") == ["model.lm_head.weight"]
    assert reads.tensors == ["model.embed_tokens.weight"]
    assert torch.equal(module.model.lm_head.weight, saved.lm_head.weight)


def test_casts_to_the_destination_dtype(saved_llama):
    path, saved, _ = saved_llama
    module = fresh().to(torch.bfloat16)
    load_stage_weights(module, path, rename="model.")
    for name, value in module.state_dict().items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, saved.state_dict()[name.removeprefix("model.")].to(torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_copies_to_the_destination_device(saved_llama):
    path, saved, _ = saved_llama
    module = fresh().cuda()
    load_stage_weights(module, path, rename="model.")
    ids, mask = batch()
    with torch.no_grad():
        got = module(ids.cuda(), attention_mask=mask.cuda()).float().cpu()
        expected = saved(input_ids=ids, attention_mask=mask).logits
    assert module.model.lm_head.weight.device.type == "cuda"
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_callable_rename_and_non_strict_skip(saved_llama):
    path, saved, _ = saved_llama
    module = fresh()
    norm_before = module.model.model.norm.weight.clone()

    def rename(name: str) -> str | None:
        return None if name.endswith("model.norm.weight") else name.removeprefix("model.")

    loaded = load_stage_weights(module, path, rename=rename, strict=False)
    assert "model.model.norm.weight" not in loaded and len(loaded) == len(module.state_dict()) - 1
    assert torch.equal(module.model.model.norm.weight, norm_before)
    assert torch.equal(module.model.model.layers[2].mlp.up_proj.weight, saved.model.layers[2].mlp.up_proj.weight)


def test_gpt2_single_file_directory(tmp_path):
    torch.manual_seed(0)
    saved = gpt2(2).eval()
    saved.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    module = fresh("gpt2", layers=2)
    load_stage_weights(module, str(tmp_path), rename="model.", check_unexpected=True)
    ids, mask = batch()
    with torch.no_grad():
        assert torch.equal(module(ids, attention_mask=mask), saved(input_ids=ids, attention_mask=mask).logits)
    assert module.model.lm_head.weight is module.model.transformer.wte.weight


# ---------------------------------------------------------------------------- plain safetensors files


def small_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    net.train()(torch.randn(16, 4))  # running statistics and num_batches_tracked differ from init
    return net.eval()


def test_single_safetensors_file_with_buffers_and_cast(tmp_path):
    src = small_net(0)
    file = tmp_path / "net.safetensors"
    save_file({k: v.half() if v.is_floating_point() else v for k, v in src.state_dict().items()}, file)
    dst = small_net(1)
    loaded = load_stage_weights(dst, file, check_unexpected=True)  # a PathLike works too
    assert loaded == list(src.state_dict())
    for name, value in dst.state_dict().items():
        ref = src.state_dict()[name]
        assert value.dtype == ref.dtype
        assert torch.equal(value, ref.half().to(ref.dtype) if ref.is_floating_point() else ref), name


def test_index_file_as_source(saved_llama):
    path, saved, _ = saved_llama
    module = fresh()
    names = stage_names(module, (2,))
    load_stage_weights(module, os.path.join(path, "model.safetensors.index.json"), names=names, rename="model.")
    assert torch.equal(module.model.model.layers[2].self_attn.q_proj.weight,
                       saved.model.layers[2].self_attn.q_proj.weight)


# ---------------------------------------------------------------------------- this project's checkpoints


def test_sharded_checkpoint_round_trip(saved_llama, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    _, saved, _ = saved_llama
    holder = fresh(seed=0)  # a LightningModule whose weights are the saved model's
    holder.model.load_state_dict(saved.state_dict())
    model_state = dict(holder.state_dict())
    model_state.pop("model.lm_head.weight")  # a tied tensor is saved once, under its first name
    url = str(tmp_path / "step-7")
    save_sharded({"model": model_state, "epoch": 1, "optim": {"0": {}}}, url, step=7)

    requests: list[set[str]] = []
    real_load = dcp.load

    def spy(state_dict, *args, **kwargs):
        requests.append(set(state_dict))
        return real_load(state_dict, *args, **kwargs)

    monkeypatch.setattr(dcp, "load", spy)

    stage = fresh().to(torch.bfloat16)  # another dtype, like a bf16 stage
    names = stage_names(stage, (1,))
    assert load_stage_weights(stage, url, names=names) == names
    assert [{parse_key(k)[1] for k in r} for r in requests] == [set(names)]  # the template: wanted entries only
    for name in names:
        assert torch.equal(stage.state_dict()[name], model_state[name].to(torch.bfloat16))

    module = fresh()
    load_stage_weights(module, url, check_unexpected=True)
    ids, mask = batch()
    with torch.no_grad():
        assert torch.equal(module(ids, attention_mask=mask), saved(input_ids=ids, attention_mask=mask).logits)


def test_sharded_checkpoint_without_model_is_refused(tmp_path):
    url = str(tmp_path / "step-1")
    save_sharded({"epoch": 1, "extra": {"w": torch.zeros(2)}}, url, step=1)
    with pytest.raises(CheckpointError, match="without model tensors"):
        load_stage_weights(small_net(0), url)


def test_uncommitted_sharded_checkpoint_is_refused(tmp_path):
    url = tmp_path / "step-2"
    save_sharded({"model": small_net(0).state_dict()}, str(url), step=2)
    (url / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match="holds no weights"):
        load_stage_weights(small_net(1), str(url))


# ---------------------------------------------------------------------------- errors


def test_missing_names_are_listed_with_the_rename_fix(saved_llama):
    path, _, _ = saved_llama
    module = fresh()
    before = module.model.model.norm.weight.clone()
    with pytest.raises(CheckpointError) as info:
        load_stage_weights(module, path)  # forgot rename="model."
    text = str(info.value)
    total = len(module.state_dict())
    assert f"missing ({total})" in text and f"and {total - 10} more" in text
    assert path in text and "rename='model.'" in text and "strict=False" in text
    assert torch.equal(module.model.model.norm.weight, before)  # nothing copied on error


def test_missing_names_under_a_prefix_of_the_file(saved_llama):
    path, saved, _ = saved_llama
    torch.manual_seed(1)
    body = llama(LAYERS).model  # the bare LlamaModel: the file's names carry "model."
    with pytest.raises(CheckpointError, match=r"rename=lambda n: 'model\.' \+ n"):
        load_stage_weights(body, path)
    load_stage_weights(body, path, rename=lambda n: "model." + n, check_unexpected=False)
    assert torch.equal(body.norm.weight, saved.model.norm.weight)


def test_missing_outside_the_prefix_is_an_error_unless_not_strict(saved_llama):
    path, _, _ = saved_llama
    module = fresh()
    module.extra = nn.Linear(2, 2)  # not part of the saved model
    with pytest.raises(CheckpointError, match=r"missing \(2\): 'extra.weight' \(rename gave None\)"):
        load_stage_weights(module, path, rename="model.")
    loaded = load_stage_weights(module, path, rename="model.", strict=False)
    assert "extra.weight" not in loaded and "model.model.norm.weight" in loaded


def test_wrong_shapes_name_both_shapes(saved_llama):
    path, _, _ = saved_llama
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      tie_word_embeddings=True)
    module = nn.Module()
    module.model = LlamaForCausalLM(cfg)
    before = module.model.model.embed_tokens.weight.clone()
    with pytest.raises(CheckpointError) as info:
        load_stage_weights(module, path, rename="model.")
    text = str(info.value)
    assert f"wrong shape ({3 * LAYERS})" in text
    assert "'model.model.layers.0.mlp.gate_proj.weight' (file 'model.layers.0.mlp.gate_proj.weight'): " \
           "file [64, 32], module [48, 32]" in text
    assert "another configuration" in text and "missing" not in text
    assert torch.equal(module.model.model.embed_tokens.weight, before)


def test_unexpected_only_when_asked(saved_llama):
    path, saved, _ = saved_llama
    module = fresh(layers=LAYERS - 1)  # a model with fewer layers: the file holds more
    load_stage_weights(module, path, rename="model.")  # a stage: the rest of the file is not an error
    with pytest.raises(CheckpointError) as info:
        load_stage_weights(module, path, rename="model.", check_unexpected=True)
    text = str(info.value)
    assert "unexpected (9): 'model.layers.2." in text and "check_unexpected=False" in text


def test_bad_sources(tmp_path, saved_llama):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_stage_weights(small_net(0), str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match="`source` is None"):
        load_stage_weights(small_net(0), None)  # type: ignore[arg-type]
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02")
    with pytest.raises(CheckpointError, match=r"holds no weights.*config\.json.*never read \(a pickle\)"):
        load_stage_weights(small_net(0), str(tmp_path))
    with pytest.raises(CheckpointError, match="never pickles"):
        load_stage_weights(small_net(0), str(tmp_path / "pytorch_model.bin"))
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_stage_weights(small_net(0), str(broken))


def test_directory_of_checkpoints_points_to_one(tmp_path):
    save_sharded({"model": small_net(0).state_dict()}, str(tmp_path / "step-3"), step=3)
    with pytest.raises(CheckpointError, match=r"step-3.*latest_valid"):
        load_stage_weights(small_net(1), str(tmp_path))


def test_missing_shard_is_reported(saved_llama, tmp_path):
    path, _, weight_map = saved_llama
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))  # the index without its shards
    with pytest.raises(CheckpointError, match="does not exist. The checkpoint is incomplete"):
        load_stage_weights(fresh(), str(tmp_path), rename="model.")


def test_bad_names_and_meta_destinations(saved_llama):
    path, _, _ = saved_llama
    with torch.device("meta"):
        module = LMWrapper("llama")
    assert load_stage_weights(module, path, rename="model.") == []  # nothing materialized
    with pytest.raises(CheckpointError) as info:
        load_stage_weights(module, path, names=["model.model.norm.weight", "model.nope"], rename="model.")
    text = str(info.value)
    assert "not a parameter or buffer of the module (1): 'model.nope'" in text
    assert "still on the meta device (1): 'model.model.norm.weight'" in text and "to_empty" in text
    with pytest.raises(CheckpointError, match="iterable of names"):
        load_stage_weights(module, path, names="model.model.norm.weight")
    with pytest.raises(CheckpointError, match="`rename` is 3"):
        load_stage_weights(module, path, rename=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["safetensors", "sharded"])
def test_two_tensors_renamed_to_one_entry_both_filled(tmp_path, kind):
    # e.g. a tied head duplicated as a Parameter of its own: both names map to the one saved tensor
    torch.manual_seed(0)
    saved = {"shared.weight": torch.randn(3, 4), "shared.bias": torch.randn(3)}
    if kind == "safetensors":
        source = str(tmp_path / "w.safetensors")
        save_file(saved, source)
    else:
        source = str(tmp_path / "step-1")
        save_sharded({"model": saved}, source, step=1)
    module = nn.ModuleDict({"a": nn.Linear(4, 3), "b": nn.Linear(4, 3)})
    loaded = load_stage_weights(module, source, rename=lambda n: "shared." + n.split(".", 1)[1])
    assert loaded == ["a.weight", "a.bias", "b.weight", "b.bias"]
    for part in (module["a"], module["b"]):
        assert torch.equal(part.weight, saved["shared.weight"]) and torch.equal(part.bias, saved["shared.bias"])
