"""Real third-party models (transformers, from tiny configs: no download) and a nanoGPT-style model,
each wrapped in an ordinary LightningModule the way users wrap them, plus their data.

``LMWrapper.training_step`` is what a user writes; ``reference_microbatches`` makes the same step
average its loss over equal micro-batches, so one process reproduces exactly what the pipeline
computes (the reference for the parity tests).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ = 64, 16


def gpt2(layers: int = 4) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=layers, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def llama(layers: int = 3, kv_heads: int = 2, tie: bool = True) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=SEQ,
                      tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def bert(layers: int = 2) -> nn.Module:
    """A masked LM whose attention blocks hold a module named ``self`` (``encoder.layer.N.attention.self``)."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(cfg)


def vit(layers: int = 4) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=layers,
                    num_attention_heads=4, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(cfg)


class Block(nn.Module):
    """A nanoGPT block: pre-norm causal self-attention and MLP, with residuals."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's shape: ``x = wte(idx) + wpe(pos)``, blocks, ``ln_f``, ``lm_head`` tied to ``wte``."""

    def __init__(self, layers: int = 4, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, d), wpe=nn.Embedding(SEQ, d),
            h=nn.ModuleList(Block(d, heads) for _ in range(layers)), ln_f=nn.LayerNorm(d)))
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def forward(self, idx):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def bn_mlp() -> nn.Module:
    """A chain with BatchNorm: the sequential frontend runs it as written (units ``model.0`` ...)."""
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16), nn.BatchNorm1d(16),
                         nn.Tanh(),
                         nn.Linear(16, 4))


def deep_mlp(blocks: int = 8, width: int = 64) -> nn.Module:
    """Linear blocks of one width (the memory tests scale ``width``); units ``model.0`` ... ``model.<blocks+1>``."""
    return nn.Sequential(nn.Linear(8, width),
                         *(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)),
                         nn.Linear(width, 4))


BUILDERS = {"gpt2": gpt2, "bert": bert, "llama": llama, "vit": vit, "nanogpt": NanoGPT, "bn_mlp": bn_mlp,
            "deep_mlp": deep_mlp}
IMAGE_LIKE = ("vit", "bn_mlp", "deep_mlp")  # batches of (x, y)


class LMWrapper(L.LightningModule):
    """``self.model = <third-party model>``; forward passes keyword arguments as users write them."""

    def __init__(self, kind: str, lr: float = 0.05, reference_microbatches: int = 1, seed: int = 0,
                 in_configure_model: bool = False, **kw) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.kind, self.kw = kind, kw
        # a big model is built in configure_model(), which HPPStrategy runs on the meta device
        self.model = None if in_configure_model else BUILDERS[kind](**kw)
        self.lr = lr
        self.reference_microbatches = reference_microbatches

    def configure_model(self):
        if self.model is None:
            self.model = BUILDERS[self.kind](**self.kw)

    def forward(self, x, attention_mask=None):
        if self.kind == "vit":
            return self.model(pixel_values=x).logits
        if self.kind in ("nanogpt", "bn_mlp", "deep_mlp"):
            return self.model(x)
        return self.model(input_ids=x, attention_mask=attention_mask).logits

    def _loss(self, batch):
        if self.kind in IMAGE_LIKE:
            x, y = batch
            return F.cross_entropy(self(x), y)
        if self.kind == "nanogpt":
            ids, _, labels = batch
            logits = self(ids)
        else:
            ids, mask, labels = batch
            logits = self(ids, attention_mask=mask)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))

    def training_step(self, batch, batch_idx):
        n = self.reference_microbatches
        if n > 1:  # the same step, averaged over equal micro-batches (single-process reference only)
            loss = torch.stack([self._loss([t.chunk(n)[i] for t in batch]) for i in range(n)]).mean()
        else:
            loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class SplitMLP(LMWrapper):
    """``deep_mlp`` whose stages a tensor-parallel job splits in the LightningModule's own hook: each pair of
    consecutive blocks of a stage as a colwise then a rowwise Linear (Megatron's MLP: the Tanh between acts on
    each rank's columns, the rowwise all-reduce makes the stage's output whole). Elsewhere it is ``deep_mlp``."""

    def __init__(self, **kw) -> None:
        super().__init__("deep_mlp", **kw)
        self.split_calls: list[list[str]] = []

    def parallelize_stage(self, module, mesh):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        blocks = [(n, u) for n, u in zip(module.names, module.units) if isinstance(u, nn.Sequential)]
        for (_, a), (_, b) in zip(blocks[0::2], blocks[1::2]):
            parallelize_module(a[0], mesh, ColwiseParallel())
            parallelize_module(b[0], mesh, RowwiseParallel())
        self.split_calls.append(list(module.names))


CLIP_NORMS = (0.02, 0.03)
"""The ``@stage(clip_norm=...)`` of :class:`DecoratedMLP`'s two stages."""


def _decorated(stage_id: int):
    from lightning_hpp import stage

    @stage(stage_id, clip_norm=CLIP_NORMS[stage_id])
    class Half(nn.Module):
        """A Megatron MLP half: ``fc1`` (colwise under tensor parallel), Tanh, ``fc2`` (rowwise)."""

        def __init__(self, d_in: int, hidden: int, d_out: int) -> None:
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out)

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)))

    Half.__name__ = Half.__qualname__ = f"Half{stage_id}"
    return Half


class DecoratedMLP(LMWrapper):
    """``deep_mlp``'s data on two halves whose classes carry ``@stage(k, clip_norm=...)`` (:data:`CLIP_NORMS`):
    each stage clips its own gradient norm. Under tensor parallel its hook splits each half as Megatron's MLP."""

    def __init__(self, **kw) -> None:
        super().__init__("deep_mlp", **kw)
        torch.manual_seed(0)
        self.model = nn.Sequential(_decorated(0)(8, 32, 16), _decorated(1)(16, 32, 4))

    def parallelize_stage(self, module, mesh):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for unit in module.units:
            parallelize_module(unit, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})



class PerHalfClipped(DecoratedMLP):
    """:class:`DecoratedMLP` that clips in its own ``configure_gradient_clipping``: in one process each half at its
    stage's limit (what the decorators ask of a pipeline); in a pipeline, handed one stage at a time, through
    ``self.clip_gradients`` (the plugin applies that stage's ``clip_norm`` with the norm over its shards)."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if getattr(optimizer, "stage", None) is not None:
            self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val)
            return
        for half, limit in zip(self.model, CLIP_NORMS):
            torch.nn.utils.clip_grad_norm_(half.parameters(), limit)


def uncompared(reference: dict[str, torch.Tensor], compared: set[str]) -> set[str]:
    """The names of ``reference`` (a state dict) left out of ``compared`` that are not tied to a compared name.

    A name is tied when its tensor is the very tensor of a compared name (GPT-2's ``lm_head.weight`` is
    ``wte.weight``): it is equal by construction. Any other name left out, an untied head included, is
    a parameter nobody checked.
    """
    compared_storage = {(reference[k].data_ptr(), tuple(reference[k].shape)) for k in compared if k in reference}
    return {k for k, v in reference.items()
            if k not in compared and (v.data_ptr(), tuple(v.shape)) not in compared_storage}


def dataset(kind: str, n: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    if kind == "vit":
        return TensorDataset(torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 5, (n,), generator=g))
    if kind in ("bn_mlp", "deep_mlp"):
        return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    mask = torch.ones(n, SEQ, dtype=torch.long)
    mask[::3, SEQ - 4:] = 0  # padded samples: the mask reaches every layer
    return TensorDataset(ids, mask, torch.randint(0, VOCAB, (n, SEQ), generator=g))


def loader(kind: str, batch: int, n: int = 32, shuffle_like_lightning: bool = False) -> DataLoader:
    ds = dataset(kind, n)
    if shuffle_like_lightning:  # Lightning shuffles every distributed training loader (seed 0)
        from torch.utils.data import DistributedSampler

        return DataLoader(ds, batch_size=batch,
                          sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0), drop_last=True)
    return DataLoader(ds, batch_size=batch, drop_last=True)
