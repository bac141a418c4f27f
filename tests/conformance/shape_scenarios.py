"""Conformance scenarios for batches whose shapes change: token sequences padded to each batch's longest (as
transformers' ``DataCollatorWithPadding`` pads), so the length changes from batch to batch, and evaluation
batches of another size and length range.

The models: :class:`SeqNet`, a plain chain (an embedding, a causal running mean over the sequence, a
per-token MLP) cut by either frontend, and :class:`LlamaLM`, a transformers Llama from a tiny config, traced,
fed the attention mask. Their steps average the loss either per sequence (the mean over sequences of each
one's token mean: the micro-batches' plain mean is one process's loss, the default) or over the batch's tokens
(``cross_entropy(..., ignore_index=-100)``: equal to one process only through
``HPPStrategy(loss_weight=...)``, which the scenarios pass).

Right padding leaves every real position's value as it is (the models are causal, Llama also masks the
padded keys), so a replica's half-batch padded to its own longest computes what the reference's rows of it
do. What the reference records besides the run (:class:`TokenProbe`): each replica's training loss on its rows
``r::2`` of the reference batch (dp = 2).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from tests.conformance.harness import GLOBAL_BATCH, Ctx, scenario, snapshot

VOCAB = 64  # tests.harness.zoo.real.VOCAB: the Llama's vocabulary
TRAIN = {"n": 96, "lengths": (3, 15), "seed": 0}
EVAL = {"n": 48, "lengths": (5, 16), "seed": 1}  # longer than the training sequences; 16: the Llama's position table
EVAL_BATCH = 12  # evaluation batches of another size than the training batches (GLOBAL_BATCH)
PREDICT = {"n": 44, "lengths": (4, 14), "seed": 2}  # a smaller last batch


def tokens(batch: dict) -> torch.Tensor:
    """The units a token-mean loss averages over: the labelled tokens (``HPPStrategy(loss_weight=tokens)``)."""
    return (batch["labels"] != -100).sum()


class TokenSeqs(Dataset):
    """``n`` sequences of token ids, lengths in ``lengths`` (inclusive) skewed to the short ones as text corpora are
    (``u ** 6`` of a uniform ``u``), so the longest of 8 differs from batch to batch; the target of each token is
    the next."""

    def __init__(self, n: int, lengths: tuple[int, int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        lo, hi = lengths
        sizes = (lo + (hi - lo + 1) * torch.rand(n, generator=g) ** 6).long().clamp(max=hi)
        self.seqs = [torch.randint(1, VOCAB, (int(k),), generator=g) for k in sizes]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.seqs[i]


def pad_batch(seqs: list[torch.Tensor], multiple_of: int = 1) -> dict[str, torch.Tensor]:
    """Right-pad to the batch's longest, rounded up to ``multiple_of`` (transformers' ``pad_to_multiple_of``):
    ``input_ids`` (0 at padding), ``attention_mask``, ``labels`` (the next token; -100 at padding and at each
    sequence's last token)."""
    longest = -(-max(len(s) for s in seqs) // multiple_of) * multiple_of
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    labels = torch.full((len(seqs), longest), -100, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)], labels[i, : len(s) - 1] = s, 1, s[1:]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def train_loader(ctx: Ctx, collate: Callable = pad_batch) -> DataLoader:
    """As :meth:`Ctx.train_loader`: Lightning's shuffling sampler sharded over the replicas; the reference draws
    the same order with the global batch."""
    ds = TokenSeqs(**TRAIN)
    if ctx.hpp:
        return DataLoader(ds, batch_size=GLOBAL_BATCH // ctx.dp, drop_last=True, collate_fn=collate)
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(ds, batch_size=GLOBAL_BATCH, sampler=sampler, drop_last=True, collate_fn=collate)


def eval_loader(ctx: Ctx, spec: dict = EVAL, collate: Callable = pad_batch) -> DataLoader:
    return DataLoader(TokenSeqs(**spec), batch_size=EVAL_BATCH // ctx.dp, collate_fn=collate)


def per_sequence_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean over sequences of each sequence's mean over its tokens."""
    ce = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")  # (B, T)
    valid = (labels != -100).float()
    return ((ce * valid).sum(1) / valid.sum(1)).mean()


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean over the batch's tokens (padding left out)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)


class _Steps(L.LightningModule):
    """The steps both models share; ``token_mean`` picks the training loss."""

    token_mean = False

    def logits(self, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch, batch_idx):
        logits = self.logits(batch)
        if self.token_mean:  # logged values keep their micro-batch reduction: the loss is compared as returned
            return token_loss(logits, batch["labels"])
        loss = per_sequence_loss(logits, batch["labels"])
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", per_sequence_loss(self.logits(batch), batch["labels"]), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", per_sequence_loss(self.logits(batch), batch["labels"]), sync_dist=True)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        # each sequence's mean logits over its own tokens: the same however long the batch is padded
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return (self.logits(batch) * mask).sum(1) / mask.sum(1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class CausalMean(nn.Module):
    """Each position's mean over itself and the positions before it: the sequence length reaches every boundary."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, h.size(1) + 1, device=h.device, dtype=h.dtype)
        return h.cumsum(1) / steps[:, None]


class SeqNet(_Steps):
    """Units ``layers.0`` ... ``layers.4``: the conformance cut (harness.STAGES) puts the embedding and the causal
    mean on stage 0, the MLP and the head on stage 1."""

    def __init__(self, token_mean: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.token_mean = token_mean
        self.layers = nn.Sequential(nn.Embedding(VOCAB, 16), CausalMean(), nn.Linear(16, 16), nn.Tanh(),
                                    nn.Linear(16, VOCAB))

    def forward(self, input_ids):
        return self.layers(input_ids)

    def logits(self, batch: dict) -> torch.Tensor:
        return self(batch["input_ids"])


class LlamaLM(_Steps):
    """A transformers Llama of 3 layers (tied embedding and head), fed the attention mask; cut before layer 1."""

    CUT = "model.model.layers.1"

    def __init__(self, token_mean: bool = True) -> None:
        super().__init__()
        from tests.harness.zoo.real import llama

        torch.manual_seed(0)
        self.token_mean = token_mean
        self.model = llama()

    def forward(self, input_ids, attention_mask=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def logits(self, batch: dict) -> torch.Tensor:
        return self(batch["input_ids"], attention_mask=batch["attention_mask"])


class TokenProbe(Callback):
    """Reference only: the training loss replica ``r`` of ``dp`` computes on its rows ``r::dp`` of each batch, with
    the parameters the step sees."""

    def __init__(self, dp: int = 2) -> None:
        self.dp = dp
        self.train: list[list[float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        losses = []
        with torch.no_grad():
            for r in range(self.dp):
                rows = {k: v[r :: self.dp] for k, v in batch.items()}
                loss_fn = token_loss if pl_module.token_mean else per_sequence_loss
                losses.append(float(loss_fn(pl_module.logits(rows), rows["labels"])))
        self.train.append(losses)


def _fit(ctx: Ctx, model: _Steps, strategy_kw: dict, epochs: int = 2, entry_points: bool = False,
         telemetry: bool = False, collate: Callable = pad_batch) -> dict:
    """Fit with validation every epoch (then, with ``entry_points``, ``test`` and ``predict``) and record; with
    ``telemetry`` (pipelines only) what ``PipelineTelemetry`` measured of each step's shapes."""
    from lightning_hpp.telemetry.callback import PipelineTelemetry

    probe = [] if ctx.hpp else [TokenProbe()]
    watch = [PipelineTelemetry(every_n_steps=1)] if ctx.hpp and telemetry else []
    strategy = ctx.strategy(**strategy_kw) if ctx.hpp else None
    trainer = ctx.trainer(callbacks=probe + watch, strategy=strategy, max_epochs=epochs)
    trainer.fit(model, train_loader(ctx, collate), eval_loader(ctx, collate=collate))
    extra: dict = {"probe": probe[0].train if probe else None}
    if watch:
        extra["shapes"] = [(m.step, m.new_shape, m.shape_ms, m.shape_alloc_mb) for m in watch[0].history]
    if entry_points:
        extra["test"] = trainer.test(model, eval_loader(ctx), verbose=False)
        if ctx.hpp:
            extra["predictions"] = [p.clone() for p in trainer.predict(model, eval_loader(ctx, PREDICT))]
        else:  # what each replica of dp = 1 and dp = 2 predicts: Lightning's unrepeated sampler gives it samples r::dp
            ds = TokenSeqs(**PREDICT)

            def share(dp: int, r: int) -> DataLoader:
                return DataLoader(Subset(ds, range(r, len(ds), dp)), batch_size=EVAL_BATCH // dp, collate_fn=pad_batch)

            extra["predictions"] = {dp: [[p.clone() for p in trainer.predict(model, share(dp, r))] for r in range(dp)]
                                    for dp in (1, 2)}
    return snapshot(trainer, model, **extra)


@scenario()
def shapes_sequential(ctx):
    """SeqNet on the sequential frontend, a loss averaged per sequence: fit, validate, test and predict on batches
    whose length changes every batch."""
    return _fit(ctx, SeqNet(), {"frontend": "sequential"}, entry_points=True, telemetry=True)


@scenario()
def shapes_traced_tokens(ctx):
    """SeqNet on the traced frontend, a loss averaged over the batch's tokens, declared with ``loss_weight``."""
    return _fit(ctx, SeqNet(token_mean=True), {"frontend": "traced", "loss_weight": tokens})


@scenario()
def shapes_llama_tokens(ctx):
    """A transformers Llama (traced, attention masks), a loss averaged over the batch's tokens with ``loss_weight``:
    fit, validate, test and predict."""
    from lightning_hpp import StagePlan

    kw = {"plan": StagePlan.split_at([LlamaLM.CUT]), "frontend": "traced", "loss_weight": tokens}
    return _fit(ctx, LlamaLM(), kw, epochs=1, entry_points=True)


BUCKET = 8  # transformers' pad_to_multiple_of


@scenario()
def shapes_traced_buckets(ctx):
    """SeqNet on the traced frontend, each batch padded to a multiple of 8 (two buckets, 8 and 16, in training and in
    validation): with telemetry, and each ``torch.export`` call of the run counted."""
    calls = []
    export = torch.export.export

    def counted(*args, **kwargs):
        calls.append(1)
        return export(*args, **kwargs)

    torch.export.export = counted
    try:
        out = _fit(ctx, SeqNet(), {"frontend": "traced"}, epochs=1, telemetry=True,
                   collate=functools.partial(pad_batch, multiple_of=BUCKET))
    finally:
        torch.export.export = export
    out["exports"] = len(calls)
    return out
