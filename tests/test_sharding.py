"""Sharded stages (``ShardingOptions``): the option section refused early with value, context and fix, and
accepted as a section or a dict like the others."""

from __future__ import annotations

import pytest

from lightning_hpp import HPPStrategy, PlanError, ShardingOptions
from lightning_hpp.errors import ShardingError
from tests.harness.trainer import quiet_trainer


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: ShardingOptions(data_parallel="zero3"),
         r"`ShardingOptions\(data_parallel='zero3'\)`.*'ddp', 'fsdp', 'hsdp'"),
        (lambda: ShardingOptions(tp_degree=0), r"`ShardingOptions\(tp_degree=0\)`: must be a positive integer"),
        (lambda: ShardingOptions(tp_degree="2"), r"`ShardingOptions\(tp_degree='2'\)`"),
        (lambda: ShardingOptions(data_parallel="fsdp", reshard_after_forward="no"),
         r"`ShardingOptions\(reshard_after_forward='no'\)`: must be True, False or None"),
        (lambda: ShardingOptions(data_parallel="hsdp"),
         r"data_parallel='hsdp'.*`dp_replicate` is not set.*dp_replicate=2"),
        (lambda: ShardingOptions(data_parallel="fsdp", dp_replicate=2),
         r"`ShardingOptions\(dp_replicate=2\)` applies to data_parallel='hsdp' only.*Drop `dp_replicate`"),
        (lambda: ShardingOptions(data_parallel="hsdp", dp_replicate=0), r"`ShardingOptions\(dp_replicate=0\)`"),
        (lambda: ShardingOptions(reshard_after_forward=True),
         r"`ShardingOptions\(reshard_after_forward=True\)` applies to sharded stages.*data_parallel='ddp'"),
        (lambda: HPPStrategy(sharding={"data_parallel": "fsdp", "shards": 2}),
         r"`HPPStrategy\(sharding=...\)` has unknown keys \['shards'\]; `ShardingOptions` takes"),
        (lambda: HPPStrategy(sharding="fsdp"), r"`HPPStrategy\(sharding='fsdp'\)`: pass a `ShardingOptions\(...\)`"),
        (lambda: HPPStrategy(sharding={"data_parallel": "hsdp"}), r"`dp_replicate` is not set"),
    ],
)
def test_bad_sharding_options_are_refused_at_construction(build, message):
    with pytest.raises(ShardingError, match=message) as info:
        build()
    assert isinstance(info.value, PlanError)  # a plan error like every other layout error


def test_sharding_is_taken_as_a_section_or_a_dict():
    assert HPPStrategy()._sharding is None  # not given: ddp, or fsdp where plan="auto" fits only sharded stages
    assert HPPStrategy(sharding={"data_parallel": "fsdp"})._sharding == ShardingOptions(data_parallel="fsdp")
    given = ShardingOptions(data_parallel="hsdp", dp_replicate=2, reshard_after_forward=True)
    assert HPPStrategy(sharding=given)._sharding is given
    assert not ShardingOptions().sharded and ShardingOptions(data_parallel="fsdp").sharded


@pytest.mark.parametrize("options, world, pp, dims", [
    (ShardingOptions(), 8, 2, (2, 4, 1, 1)),
    (ShardingOptions(data_parallel="fsdp"), 8, 2, (2, 1, 4, 1)),
    (ShardingOptions(data_parallel="hsdp", dp_replicate=2), 8, 2, (2, 2, 2, 1)),
    (ShardingOptions(data_parallel="hsdp", dp_replicate=1), 4, 2, (2, 1, 2, 1)),
    (ShardingOptions(data_parallel="fsdp", tp_degree=2), 8, 2, (2, 1, 2, 2)),
    (ShardingOptions(tp_degree=2), 8, 2, (2, 2, 1, 2)),
])
def test_the_data_parallel_shape_rule(options, world, pp, dims):
    got = options.dims(world, pp)
    assert got.shape == dims and got.world_size == world and got.dp == world // (pp * options.tp_degree)


def test_one_value_owns_the_degree_arithmetic():
    from lightning_hpp.pipeline.dims import ParallelDims

    dims = ParallelDims(pp=2, dp_replicate=1, dp_shard=2, tp=2)
    assert (dims.dp, dims.width, dims.world_size, dims.data_parallel) == (2, 4, 8, "fsdp")
    # pipeline-outer: the ranks of a position contiguous, a replica's tp ranks neighbours
    assert dims.default_grid() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [dims.replica_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    # a grid of tp groups (what the kinds place) expands to neighbouring ranks per group
    assert dims.expand_tp([[0, 1], [2, 3]]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ParallelDims(dp_replicate=2, dp_shard=2).data_parallel == "hsdp"
    with pytest.raises(PlanError, match=r"`ParallelDims\(tp=0\)`: every degree must be an integer >= 1"):
        ParallelDims(tp=0)


@pytest.mark.parametrize("world, pp, options, message", [
    (4, 8, ShardingOptions(), r"`HPPStrategy\(pp_degree=8\)` needs at least 8 processes, one per pipeline position"),
    (6, 4, ShardingOptions(), r"World size 6 is not divisible by pp_degree=4; world_size must equal pp_degree × "
                              r"dp_degree. Use devices × num_nodes = a multiple of 4, or change pp_degree."),
    (6, 2, ShardingOptions(tp_degree=2), r"World size 6 is not divisible by pp_degree=2 × tp_degree=2.*or tp_degree"),
])
def test_degrees_the_world_cannot_form_are_refused_naming_the_sizes(world, pp, options, message):
    with pytest.raises(PlanError, match=message):
        options.dims(world, pp)
    with pytest.raises(PlanError, match=r"The plan has 6 stages \(pp_degree=6\) but the job has 4 processes"):
        ShardingOptions().dims(4, 6, "The plan has 6 stages")


def test_hsdp_replicas_that_do_not_split_evenly_are_refused():
    with pytest.raises(ShardingError, match=r"dp_replicate=2\)`: each stage has 3 replicas.*divides 3 \(\[1, 3\]\)"):
        ShardingOptions(data_parallel="hsdp", dp_replicate=2).dims(6, 2)


# ============================================================================ sharded stages in real processes
# One 4-rank job (tests/workers/run_sharded.py) runs every configuration below in turn; each test reads its outputs.
# Every run is compared with one process training the same LightningModule under Lightning's own strategy on the
# same samples (the pipeline's replicas together see the one process's batch): the mean loss of every step and
# every parameter at the end (each FSDP2 shard gathered with DTensor.full_tensor), to 1e-5.

TOL = dict(rtol=1e-5, atol=1e-5)
GPT2_CUT, LLAMA_CUT = ["model.transformer.h.2"], ["model.model.layers.1"]
FSDP = {"sharding": {"data_parallel": "fsdp"}}
RUNS = {
    # pp2 x fsdp2, the tied embedding / LM head on both stages, Trainer(gradient_clip_val): the norm over shards and
    # stages; a validation pass after every step (the stages gathered for it, and sharded again for the next step)
    "gpt2_fsdp": {"model": "gpt2", "points": GPT2_CUT, "gradient_clip_val": 0.5, "limit_val_batches": 1,
                  "val_check_interval": 1, "strategy": {**FSDP, "telemetry": {"every_n_steps": 1}}},
    # pp2 x fsdp2 Llama (RoPE, grouped-query attention), per-stage clipping and activation checkpointing, its
    # blocks freed after every forward (reshard_after_forward=True)
    "llama_fsdp": {"model": "llama", "model_kw": {"tie": False}, "points": LLAMA_CUT, "gradient_clip_val": 0.3,
                   "clip": "per-stage",
                   "strategy": {"sharding": {"data_parallel": "fsdp", "reshard_after_forward": True},
                                                     "activation_checkpointing": True}},
    # a bf16-mixed stage 0 (autocast, fp32 parameters, a bf16 boundary), fp32 stage 1
    "gpt2_bf16": {"model": "gpt2", "points": GPT2_CUT, "precision": ["bf16-mixed", "32-true"], "steps": 4, "n": 8,
                  "strategy": FSDP},
    # an fp16 stage whose gradients overflow at the first loss scale: the one decision skips the step on every rank
    "gpt2_fp16_overflow": {"model": "gpt2", "points": GPT2_CUT, "precision": ["16-mixed", "32-true"], "steps": 1,
                           "init_scale": 2.0**60, "strategy": FSDP},
    # pp1 x hsdp: 2 replica groups x 2 shards of the whole model
    "gpt2_hsdp": {"model": "gpt2", "points": None, "pp": 1, "strategy": {"sharding": {"data_parallel": "hsdp",
                                                                                         "dp_replicate": 2}}},
}
DEFAULTS = {"schedule": "1f1b", "pp": 2, "n_micro": 2, "steps": 3, "batch": 4}
# what sharded stages cannot keep yet, refused at setup on every rank (tried last, by the same ranks)
REFUSED = {
    "bias_monitor": {"model": "gpt2", "points": GPT2_CUT, "bias_monitor": True, "strategy": FSDP},
}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from tests.harness.launch import Job, run_job

    out = tmp_path_factory.mktemp("sharded")
    runs = [{**DEFAULTS, **cfg, "name": name, "out": str(out / name)} for name, cfg in RUNS.items()]
    runs += [{**DEFAULTS, **cfg, "name": name, "out": str(out / name),
              "refused": True} for name, cfg in REFUSED.items()]
    # the 4 ranks forked from one process that imported Lightning (lightning_hpp.torchrun), not 4 imports
    proc = run_job(Job("tests.workers.run_sharded", {"devices": 4, "runs": runs}, ranks=4, start="forked",
                       timeout=1800), check=False)
    return out, proc


@pytest.fixture(scope="module")
def sharded_runs(job):
    out, proc = job
    missing = [n for n in RUNS if not all((out / n / f"rank{r}.pt").exists() for r in range(4))]
    assert not missing, f"runs {missing} did not finish\n--- stderr\n{proc.stderr[-8000:]}"
    return out


def _ranks(out, name):
    from tests.harness.results import load_rank

    return [load_rank(out / name, r) for r in range(4)]


def one_process(model, steps: int, batch: int, n: int = 32, clip: float | None = None):
    """``model`` trained in one process under Lightning's own strategy: (its state, the loss of every step)."""
    import lightning as L
    import torch

    from tests.harness.zoo.real import loader

    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            losses.append(float(trainer.callback_metrics["train/loss"]))

    trainer = quiet_trainer(devices=1, max_steps=steps, callbacks=[Record()], num_sanity_val_steps=0,
                            limit_val_batches=0, gradient_clip_val=clip)
    trainer.fit(model, loader(model.kind, batch, n=n, shuffle_like_lightning=True))
    return {k: v.detach() for k, v in model.state_dict().items()}, torch.tensor(losses)


def replica_mean_losses(outs, replicas: list[int]):
    """The global batch's loss per step: the mean of each replica's own (Lightning logs each replica's)."""
    import torch

    by_replica = {o["replica"]: torch.tensor(o["losses"]) for o in outs}
    return torch.stack([by_replica[r] for r in replicas]).mean(0)


def assert_params(outs, want: dict, tol=TOL):
    import torch

    from tests.harness.zoo.real import uncompared

    got = {}
    for o in outs:  # every copy (each replica's, each stage's of a tied weight) equals the reference
        for name, value in o["state"].items():
            torch.testing.assert_close(value, want[name], **tol, msg=lambda m, n=name: f"{n}: {m}")
            got[name] = value
    assert set(got) <= set(want), sorted(set(got) - set(want))
    missing = uncompared(want, set(got))
    assert not missing, f"not compared (and not tied to a compared one): {missing}"


def _stage_names(outs) -> list[set[str]]:
    return [set(next(o for o in outs if o["position"] == p)["state"]) for p in (0, 1)]


class PerStageClipped:
    """A LightningModule clipping each stage's parameters to their own norm, as ``HPPPrecision(clip="per-stage")``."""

    @staticmethod
    def make(kind: str, stages: list[set[str]], **kw):
        import torch

        from tests.harness.zoo.real import LMWrapper

        class Clipped(LMWrapper):
            def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
                named = dict(self.named_parameters())
                for names in stages:
                    torch.nn.utils.clip_grad_norm_([named[n] for n in sorted(names) if n in named], gradient_clip_val)

        return Clipped(kind, **kw)


@pytest.mark.slow
def test_pp2_fsdp2_gpt2_with_global_clipping_and_validation_equals_one_process(sharded_runs):
    import lightning as L
    import torch

    from tests.harness.zoo.real import LMWrapper

    outs = _ranks(sharded_runs, "gpt2_fsdp")
    L.seed_everything(0)
    want, want_losses = one_process(LMWrapper("gpt2", reference_microbatches=4), 3, 8, clip=0.5)
    assert_params(outs, want)
    torch.testing.assert_close(replica_mean_losses(outs, [0, 1]), want_losses, **TOL)
    # the clip clipped: the pipeline's norm (at least its largest stage's) was above 0.5 at the last step
    assert all(max(o["metrics"]["grad_norm/stage_0"], o["metrics"]["grad_norm/stage_1"]) > 0.5 for o in outs)
    assert outs[0]["device_mesh_dims"] == ["pp", "dp_replicate", "dp_shard", "tp"]
    assert outs[0]["device_mesh_shape"] == [2, 1, 2, 1]
    assert "val/loss" in outs[0]["metrics"]
    # telemetry times the sharded stages like any others
    assert 0 <= outs[0]["metrics"]["pipeline/bubble"] < 1 and outs[0]["metrics"]["pipeline/stage_1/fwd_ms"] > 0


@pytest.mark.slow
def test_pp2_fsdp2_llama_with_per_stage_clipping_and_activation_checkpointing_equals_one_process(sharded_runs):
    import lightning as L
    import torch

    outs = _ranks(sharded_runs, "llama_fsdp")
    stages = _stage_names(outs)
    assert not stages[0] & stages[1]  # untied: each parameter on one stage
    L.seed_everything(0)
    want, want_losses = one_process(PerStageClipped.make("llama", stages, reference_microbatches=4, tie=False), 3, 8,
                                   clip=0.3)
    assert_params(outs, want)
    torch.testing.assert_close(replica_mean_losses(outs, [0, 1]), want_losses, **TOL)
    # per-stage clipping is not global clipping: the reference clipping the whole model's norm ends elsewhere
    from tests.harness.zoo.real import LMWrapper

    L.seed_everything(0)
    globally, _ = one_process(LMWrapper("llama", reference_microbatches=4, tie=False), 3, 8, clip=0.3)
    assert max(float((want[k] - globally[k]).abs().max()) for k in want) > 1e-4


@pytest.mark.slow
def test_each_rank_holds_one_shard_of_its_stage_and_reduces_once_per_step(sharded_runs):
    for name, shard in (("gpt2_fsdp", 2), ("llama_fsdp", 2), ("gpt2_hsdp", 2)):
        for o in _ranks(sharded_runs, name):
            assert o["dp_shard"] == shard
            for pname, n in o["local"].items():
                # parameter, gradient and optimizer state (SGD momentum): 1/dp_shard of the stage's each
                assert n["dtensor"] and n["param"] * shard == n["full"], (name, pname, n)
                assert n["grad"] * shard == n["full"] and n["optim"] * shard == n["full"], (name, pname, n)
            # one reduce-scatter per FSDP2 group each step (after the first, whose shape inference runs a pass of
            # its own), not one per micro-batch (n_micro = 2); one all-gather too (reshard_after_forward=None), more
            # where the blocks are freed after every forward (llama_fsdp: reshard_after_forward=True)
            for step in o["collectives"][1:]:
                assert step["reduce_scatter_single"] == o["fsdp_groups"], (name, o["collectives"], o["fsdp_groups"])
                if name == "llama_fsdp":
                    assert step["all_gather_single"] > o["fsdp_groups"], (name, o["collectives"], o["fsdp_groups"])
                else:  # gpt2_fsdp validates after every step: one more gather of each group for that pass
                    passes = 2 if name == "gpt2_fsdp" else 1
                    assert step["all_gather_single"] == passes * o["fsdp_groups"], (name, o["collectives"])
            # each block of the model's block list is a group of its own (and the stage keeps the rest)
            assert o["fsdp_groups"] >= (3 if name == "gpt2_hsdp" else 2), (name, o["fsdp_groups"])


@pytest.mark.slow
def test_hsdp_replicate2_x_shard2_equals_one_process(sharded_runs):
    import lightning as L
    import torch

    from tests.harness.zoo.real import LMWrapper

    outs = _ranks(sharded_runs, "gpt2_hsdp")
    assert sorted((o["dp_replicate"], o["dp_shard"]) for o in outs) == [(2, 2)] * 4
    assert outs[0]["device_mesh_shape"] == [1, 2, 2, 1]
    L.seed_everything(0)
    want, want_losses = one_process(LMWrapper("gpt2", reference_microbatches=8), 3, 16)
    assert_params(outs, want)
    torch.testing.assert_close(replica_mean_losses(outs, [0, 1, 2, 3]), want_losses, **TOL)


@pytest.mark.slow
def test_an_fp16_overflow_skips_the_step_on_every_rank_of_a_sharded_pipeline(sharded_runs):
    import lightning as L

    from tests.harness.zoo.real import LMWrapper

    outs = _ranks(sharded_runs, "gpt2_fp16_overflow")
    for o in outs:  # the stage-0 shards overflowed; the stage-1 ranks skipped with them
        assert o["skipped_steps"] == 1 and o["loss_scale"] == 2.0**59, (o["position"], o["replica"])
    L.seed_everything(0)
    initial = {k: v.detach() for k, v in LMWrapper("gpt2").state_dict().items()}
    assert_params(outs, initial, tol={"rtol": 0, "atol": 0})


def _replica_ordered_staged_reference(run: dict, replicas: int, bf16: bool = True):
    """:func:`tests.test_traced_stages.staged_reference` with the one process's micro-batches those of the pipeline:
    replica ``d`` reads samples ``d, d + replicas, ...`` of each global batch (Lightning's distributed sampler) and
    cuts its part into ``n_micro`` micro-batches; the one process runs the same micro-batches (bf16 rounds each
    micro-batch's gradient, so which samples share one matters)."""
    import contextlib

    import lightning as L
    import torch

    from tests.harness.zoo.real import loader
    from tests.test_traced_stages import StagedGPT2, _bf16_autocast

    class ReplicaOrdered(StagedGPT2):
        def training_step(self, batch, batch_idx):
            order = [i for d in range(replicas) for i in range(d, len(batch[0]), replicas)]
            return super().training_step([t[order] for t in batch], batch_idx)

    L.seed_everything(0)
    contexts, wire = ([_bf16_autocast, contextlib.nullcontext], torch.bfloat16) if bf16 else (
        [contextlib.nullcontext] * 2, torch.float32)
    model = ReplicaOrdered(run["points"][0], contexts, wire, run["n_micro"] * replicas)
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            losses.append(float(trainer.callback_metrics["train/loss"]))

    trainer = quiet_trainer(devices=1, max_steps=run["steps"], callbacks=[Record()], num_sanity_val_steps=0,
                            limit_val_batches=0)
    trainer.fit(model, loader("gpt2", run["batch"] * replicas, n=run["n"], shuffle_like_lightning=True))
    return {k: v.detach() for k, v in model.state_dict().items()}, torch.tensor(losses)


@pytest.mark.slow
def test_pp2_fsdp2_with_a_bf16_stage_equals_one_process_with_the_same_stage_precisions(sharded_runs):
    import torch

    outs = _ranks(sharded_runs, "gpt2_bf16")
    run = {**DEFAULTS, **RUNS["gpt2_bf16"]}
    want, want_losses = _replica_ordered_staged_reference(run, replicas=2)
    # to 1e-5 as in fp32: the one process runs the pipeline's micro-batches, so bf16 rounds the same sums
    assert_params(outs, want)
    torch.testing.assert_close(replica_mean_losses(outs, [0, 1]), want_losses, **TOL)
    for o in outs:
        assert o["plan"]["meta"]["precision"] == ["bf16-mixed", "32-true"]
        assert o["plan"]["meta"]["boundary_dtypes"] == ["bfloat16"]
    # bf16 did run: fp32 training of the same samples ends further away than the bound
    fp32 = _replica_ordered_staged_reference(run, replicas=2, bf16=False)[0]
    assert max(float((want[k] - fp32[k]).abs().max()) for k in want) > TOL["atol"]  # measured: 7.9e-5


def test_what_sharded_stages_cannot_keep_is_refused_at_setup_on_every_rank(job):
    from tests.workers import refusals

    out, proc = job
    assert proc.returncode == 1, proc.stderr[-4000:]  # the refused cases, and nothing else, failed
    expected = {
        "bias_monitor": ("ShardingError", "`BiasMonitor` compares each replica's gradient norm"),
    }
    for name, (kind, text) in expected.items():
        records = refusals.read(out / name, 4)
        for r in records:
            assert r["error"] is not None and kind in r["error"] and text in r["error"], (name, r)
            assert r["seconds"] < refusals.BOUND_S, (name, r)  # each rank raised itself, none waited


# ============================================================================ the memory model
def test_sharded_stages_count_one_shard_of_params_grads_and_optimizer_state_plus_what_is_gathered():
    from lightning_hpp.planning.memory import stage_memory_bytes

    # unsharded: params x (1 + factor) + in-flight activations, as before
    assert stage_memory_bytes(1000, 3.0, 2, 10) == 4000 + 20
    # sharded over 4: a quarter of params, grads and Adam state, plus what is gathered or unsharded. Several
    # micro-batches: the whole stage's parameters and gradients (every backward but the last keeps them, whatever
    # reshard_after_forward)
    for m in (2, 8):
        for raf in (False, True):
            assert stage_memory_bytes(1000, 3.0, 2, 10, dp_shard=4, n_microbatches=m, reshard_after_forward=raf,
                                      largest_unit_bytes=100) == 1000 + 2000 + 20
    # one micro-batch: the last backward reshards unit by unit, so the parameters and one unit's gradients, or
    # with reshard_after_forward one unit's parameters and gradients (benchmarks/memory: fsdp_m1 as fsdp_plain)
    one = dict(dp_shard=4, n_microbatches=1, largest_unit_bytes=100)
    assert stage_memory_bytes(1000, 3.0, 1, 10, **one) == 1000 + 1100 + 10
    assert stage_memory_bytes(1000, 3.0, 1, 10, reshard_after_forward=True, **one) == 1000 + 200 + 10
    # the largest unit not given: counted whole
    assert stage_memory_bytes(1000, 3.0, 1, 10, dp_shard=4, n_microbatches=1, reshard_after_forward=True) == (
        1000 + 2000 + 10)


def test_a_bias_monitor_keeps_plan_auto_on_unsharded_stages():
    from lightning_hpp.assembly.compose import sharding_refusals
    from lightning_hpp.bias.monitor import BiasMonitor

    assert sharding_refusals([]) == []
    assert "BiasMonitor" in sharding_refusals([BiasMonitor()])[0]
