"""Shapes that change between batches, the parts that need no pipeline (the traced capture's input dimensions, a
stage's refusal of a shape the next stage does not expect, the loss weights, the telemetry's accounting), and the
2-rank jobs that end on a batch the model cannot take (every rank names the dimension, both shapes and the fix).

The pipelines that train on such batches equal to one process are in tests/conformance/test_shapes.py.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.pipelining._utils import _TensorMeta

from lightning_hpp.errors import PlanError, ShapeError
from lightning_hpp.model import traced as T
from lightning_hpp.pipeline.loss import LossWeights, step_loss
from lightning_hpp.pipeline.shapes import StageBoundary, signature
from lightning_hpp.telemetry.model import schedule_actions
from lightning_hpp.telemetry.recorder import RankStep, ScheduleInfo, analyze, mean_metrics


# ---------------------------------------------------------------------------------------------- traced capture
class Tagger(nn.Module):
    """Token ids and a mask, two blocks; ``table``: a position table of 11 positions (``"fixed"``: added whole, which
    fixes the length; ``"bounded"``: sliced by the length, which bounds it)."""

    def __init__(self, table: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.table = nn.Embedding(10, 4), nn.Linear(4, 3), table
        self.pos = nn.Parameter(torch.randn(11, 4))
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, ids, mask):
        h = self.emb(ids)
        if self.table == "fixed":
            h = h + self.pos
        elif self.table == "bounded":
            h = h + self.pos[: ids.size(1)]
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h) * mask[..., None]


def _inputs(batch: int, length: int, mask_length: int | None = None) -> tuple:
    return torch.randint(0, 10, (batch, length)), torch.ones(batch, length if mask_length is None else mask_length)


def test_one_capture_runs_every_length():
    model = Tagger()
    traced = T.trace(model, _inputs(4, 11), {}, ["blocks.1"], train=True)
    assert traced.dims.dims[0][1] == traced.dims.dims[1][1] and isinstance(traced.dims.dims[0][1], str)  # free, tied
    for length in (2, 7, 11, 30):
        ids, mask = _inputs(6, length)
        x = traced.flatten_inputs((ids, mask), {})
        for stage in traced.stages:
            x = stage(*x) if isinstance(x, tuple) else stage(x)
        torch.testing.assert_close(traced.unflatten_output(x), model(ids, mask), rtol=0, atol=0)


FIXED = (r"fixes dim 1 of input `ids` to 11: torch.export specialised it .* This batch gives `ids` the shape "
         r"\(8, 12\); the capture saw \(4, 11\). Fix: pad every batch to 11 along dim 1")
BOUNDED = (r"Dim 1 of input `ids` is 12 in this batch \(shape \(8, 12\); captured with \(4, 9\)\), but the traced "
           r"model allows 2..11 there \(a bound the model sets\). Fix: keep that dimension within 2..11")
ONE = r"Dim 1 of input `ids` is 1 in this batch .* allows 2.. there \(sizes 0 and 1 are special to torch.export\)"


@pytest.mark.parametrize("table, length, message", [("fixed", 12, FIXED), ("bounded", 12, BOUNDED), (None, 1, ONE)])
def test_a_length_the_capture_cannot_run_is_refused_before_the_pipeline_runs(table, length, message):
    traced = T.trace(Tagger(table), _inputs(4, 11 if table == "fixed" else 9), {}, ["blocks.1"], train=True)
    traced.flatten_inputs(_inputs(8, 11 if table == "fixed" else 9), {})  # the captured length runs
    with pytest.raises(ShapeError, match=message):
        traced.flatten_inputs(_inputs(8, length), {})


def test_dimensions_the_capture_ties_must_agree():
    traced = T.trace(Tagger(), _inputs(4, 9), {}, ["blocks.1"], train=True)
    tied = r"Dim 1 of input `mask` is 8 but dim 1 of `ids` is 9 in this batch; the traced model ties them"
    with pytest.raises(ShapeError, match=tied):
        traced.flatten_inputs(_inputs(4, 9, mask_length=8), {})


def test_a_branch_on_a_length_is_kept_as_a_condition_on_the_inputs():
    class SizeBranch(Tagger):  # torch.export keeps the length free and guards the branch it took
        def forward(self, ids, mask):
            out = super().forward(ids, mask)
            return out if ids.size(1) % 3 == 0 else out * 2

    model = SizeBranch()
    traced = T.trace(model, _inputs(4, 9), {}, ["blocks.1"], train=True)
    traced.flatten_inputs(_inputs(8, 12), {})  # the branch the capture took
    broken = (r"captured under the condition `ids.size\(\)\[1\] % 3 == 0` .* this batch's inputs "
              r"\[\(8, 10\), \(8, 10\)\] break it .* Fix: give every batch sizes")
    with pytest.raises(ShapeError, match=broken):
        traced.flatten_inputs(_inputs(8, 10), {})


def test_a_model_that_cannot_be_captured_with_free_lengths_keeps_the_batch_free_and_says_why(monkeypatch):
    export = torch.export.export

    def batch_only(*args, dynamic_shapes=None, **kwargs):  # a model whose capture fails with its lengths free
        if any(1 in spec for spec in dynamic_shapes.values() if spec):
            raise RuntimeError("Could not guard on data-dependent expression u0 < s1")
        return export(*args, dynamic_shapes=dynamic_shapes, **kwargs)

    monkeypatch.setattr(torch.export, "export", batch_only)
    traced = T.trace(Tagger(), _inputs(4, 9), {}, ["blocks.1"], train=True)
    assert isinstance(traced.dims.dims[0][0], str) and traced.dims.dims[0][1] == 9
    why = (r"\(the capture with every dimension free failed: RuntimeError: Could not guard on data-dependent "
           r"expression u0 < s1; the batch dimension alone is free\)")
    with pytest.raises(ShapeError, match=why):
        traced.flatten_inputs(_inputs(4, 10), {})


def test_evaluation_capture_fixes_count_too():
    a = T.InputDims(["x"], [(2, 5)], [("s0", "s1")], {"s0": (2, None), "s1": (2, None)})
    b = T.InputDims(["x"], [(2, 5)], [("s0", 5)], {"s0": (2, None)})
    merged = a.merged(b)
    assert merged.dims == [("s0", 5)]
    with pytest.raises(ShapeError, match="fixes dim 1 of input `x` to 5"):
        merged.check([torch.zeros(2, 6)])


# ---------------------------------------------------------------------------------------------- a stage's sends
def _stage(outputs: list[torch.Tensor], expected: list[tuple[int, ...]], last: bool = False) -> SimpleNamespace:
    metas = tuple(_TensorMeta(torch.Size(s), (1,) * len(s), torch.float32, True) for s in expected)
    return SimpleNamespace(stage_index=0, is_last=last, group_rank=0, stage_index_to_group_rank={0: 0, 1: 1},
                           fwd_cache={3: (tuple(outputs), [])}, _stage_meta=SimpleNamespace(outputs=metas))


def test_a_stage_refuses_to_send_a_shape_the_next_stage_does_not_expect():
    stage = _stage([torch.zeros(4, 7, 16)], [(4, 9, 16)])
    boundary = StageBoundary(stage)
    with pytest.raises(ShapeError, match=re.escape(
            "Stage 0 would pass on output 0 of shape (4, 7, 16) for micro-batch 3, but the next stage expects "
            "(4, 9, 16) (what the pipeline recorded for this batch's input shapes)")):
        boundary.send(3)
    boundary.fresh = True  # a step of new shapes: micro-batch 0 told the next stage its shapes
    differ = r"expects \(4, 9, 16\) \(micro-batch 0 of this batch gave it\). Boundary shapes must be the same for every"
    with pytest.raises(ShapeError, match=differ):
        boundary.send(3)
    StageBoundary(_stage([torch.zeros(4, 9, 16)], [(4, 9, 16)])).send(3)  # the expected shape passes


def test_signature_names_shapes_and_dtypes():
    ids = torch.zeros(4, 9, dtype=torch.long)
    assert signature((ids, torch.ones(4, 9))) == (((4, 9), torch.long), ((4, 9), torch.float32))
    assert signature((ids,)) != signature((ids[:, :8],))


# ---------------------------------------------------------------------------------------------- loss weights
def test_the_default_step_loss_is_the_micro_batches_mean():
    losses = [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(4.0)]
    assert float(step_loss(losses, None)) == pytest.approx(7 / 3)


def test_loss_weights_make_the_token_mean_of_the_whole_batch():
    # two micro-batches of 3 and 1 valid tokens, each loss its own token mean: the step's loss is the batch's token
    # mean, and each backward starts from its share (scale 2: the fp16 loss scale over accumulation steps)
    labels = [torch.tensor([[1, 2, -100], [3, -100, -100]]), torch.tensor([[4, -100, -100], [-100, -100, -100]])]
    token_losses = [torch.tensor([0.5, 1.0, 2.0]), torch.tensor([4.0])]
    weights = LossWeights(lambda mb: (mb["labels"] != -100).sum())
    weights.start([{"labels": x} for x in labels], scale=2.0, device=torch.device("cpu"))
    means = [t.mean() for t in token_losses]
    assert float(weights.combine(means)) == pytest.approx(float(torch.cat(token_losses).mean()))
    assert [float(weights.seed(m, i)) for i, m in enumerate(means)] == pytest.approx([2 * 3 / 4, 2 * 1 / 4])
    assert weights.seed(torch.ones(1), 0).shape == (1,)
    with pytest.raises(PlanError, match=r"returned 'many' for a micro-batch; it must give the number of units"):
        LossWeights(lambda mb: "many").start([{}], 1.0, torch.device("cpu"))
    with pytest.raises(PlanError, match=r"must be a function of a batch"):
        LossWeights(3)


# ---------------------------------------------------------------------------------------------- telemetry
def test_telemetry_counts_a_step_of_new_shapes_and_what_it_cost():
    info = ScheduleInfo("gpipe", 2, 1, 2, schedule_actions("gpipe", 2, 1))

    def step(n: int, shape: tuple) -> list[RankStep]:
        return [RankStep(rank=r, replica=0, position=r, step=n, start=0, end=100, spans=[("F", r, 0, 0, 50, None)],
                         shape=shape) for r in (0, 1)]

    new = analyze(step(0, (True, 3_000_000, 2**20)), info)
    assert (new.new_shape, new.shape_ms, new.shape_alloc_mb) == (1.0, 3.0, 2.0)  # the slowest rank; every rank's MB
    seen = analyze(step(1, (False, 0, 0)), info)
    logged = mean_metrics([new, seen])
    assert logged["pipeline/new_shape"] == 0.5 and logged["pipeline/shape_ms"] == 1.5


# ---------------------------------------------------------------------------------------------- 2-rank jobs
@pytest.fixture(scope="module")
def shape_jobs(tmp_path_factory):
    """The jobs of tests/workers/run_shapes.py, side by side: {case: finished process (``out``: its directory)}."""
    from tests.harness.launch import Job, run_jobs

    cases = ("sequential_bounded", "traced_bounded", "microbatches_differ", "schedules")
    outs = {c: tmp_path_factory.mktemp(c) for c in cases}
    done = run_jobs([Job("tests.workers.run_shapes", {"case": c, "out": str(outs[c])}, ranks=2, timeout=400)
                     for c in cases], check=False)
    for c, proc in zip(cases, done):
        proc.out = outs[c]
    return dict(zip(cases, done))


@pytest.mark.slow
def test_every_schedule_hands_the_shapes_over_and_trains_alike(shape_jobs):
    # 6 steps of batches 11, 15, 10, ... long and a validation on batches of 12, on 2 ranks; 1F1B equals one process
    # (tests/conformance/test_shapes.py), and each way torch drives a schedule, receiving in its own order, equals 1F1B
    from tests.workers.run_shapes import SCHEDULES

    proc = shape_jobs["schedules"]
    assert proc.returncode == 0, proc.stderr[-4000:]

    def merged(name: str) -> tuple[dict, float]:
        parts = [torch.load(proc.out / f"{name}_rank{r}.pt") for r in (0, 1)]
        return {k: v for p in parts for k, v in p["state"].items()}, parts[0]["val_loss"]

    want, want_val = merged("1f1b")
    for name in SCHEDULES[1:]:
        got, val = merged(name)
        assert sorted(got) == sorted(want), name
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")
        assert val == pytest.approx(want_val, rel=1e-5), name


def _last_lines(proc) -> dict[int, str]:
    return {r: [line for line in proc.stderr.splitlines() if line.startswith(f"[rank{r}]: ")][-1] for r in (0, 1)}


REFUSED = {
    # stage 1 (rank 1) runs the first batch, 11 long, and fails on the second, 15 long, in its position table
    "sequential_bounded": (1, (r"Stage 1 cannot run on this batch's shapes: its inputs are \[\(4, 15, 16\)\] "
                               r"\(the last batch it ran had \[\(4, 11, 16\)\]: dim 1 of input 0: 11 -> 15\), and "
                               r"its forward fails on them \(RuntimeError: The size of tensor a \(15\) must match "
                               r".*\)\. .*Fix: ")),
    # the capture bounded the length: the first stage's rank refuses the batch before anything is sent
    "traced_bounded": (0, (r"Dim 1 of input `input_ids` is 15 in this batch \(shape \(8, 15\); captured with "
                           r"\(4, 9\)\), but the traced model allows 2..11 there .* Fix: ")),
    # stage 0 drops the padding its micro-batch does not need: its output's length depends on the values (torch's
    # metadata pass at the first step ran on zeros: all padding)
    "microbatches_differ": (0, (r"Stage 0 would pass on output 0 of shape \(4, \d+, 16\) for micro-batch 0, but the "
                                r"next stage expects \(4, 0, 16\) .* shapes that depend on values .*within one stage")),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_batch_the_model_cannot_take_ends_every_rank_naming_the_dimension_and_the_fix(shape_jobs, case):
    failing, message = REFUSED[case]
    proc = shape_jobs[case]
    assert proc.returncode != 0, proc.stderr[-3000:]
    last = _last_lines(proc)
    peer = 1 - failing
    assert re.search(rf"lightning_hpp\.errors\.ShapeError: {message}", last[failing]), proc.stderr[-3000:]
    # the other rank ends with the same error, named as the first (not a torch message after a TransferError)
    assert last[peer].startswith(f"[rank{peer}]: lightning_hpp.errors.RankFailedError: rank {failing} failed first: "
                                 f"ShapeError: "), proc.stderr[-3000:]
    assert last[failing].split("ShapeError: ", 1)[1][:200] in last[peer], (last[failing], last[peer])


# ---------------------------------------------------------------------------------------------- plan="auto"
def test_plan_auto_profiles_on_the_batch_the_user_gives(caplog):
    from lightning_hpp.assembly.build import _profile_batch
    from lightning_hpp.errors import PlacementError
    from lightning_hpp.options import PlacementOptions

    first = {"input_ids": torch.zeros(8, 9, dtype=torch.long)}
    longest = {"input_ids": torch.zeros(8, 64, dtype=torch.long)}
    default = SimpleNamespace(placement=PlacementOptions(), device=torch.device("cpu"))
    assert _profile_batch(default, first) is first  # the loader's first batch
    given = SimpleNamespace(placement=PlacementOptions(profile_batch=longest), device=torch.device("cpu"))
    assert _profile_batch(given, first)["input_ids"].shape == (8, 64)
    bigger = SimpleNamespace(placement=PlacementOptions(profile_batch={"input_ids": torch.zeros(16, 64)}),
                             device=torch.device("cpu"))
    with pytest.raises(PlacementError, match=r"holds 16 samples, but the training loader's batches hold 8"):
        _profile_batch(bigger, first)
