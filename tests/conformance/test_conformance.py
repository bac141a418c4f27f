"""Lightning behaviours HPPStrategy keeps: on every rank of pp=2 (2 ranks) and pp=2 × dp=2 (4 ranks), what the
Trainer and the module hold equals one process under Lightning's default strategy (tests/conformance/harness.py
for the data order, scenarios.py for what each scenario runs; the jobs run once: conftest.py).

Each test loads one scenario's results and checks, unless it says otherwise, everything every rank recorded
(:func:`tests.conformance.compare.diff_all`): global step and epoch, ``callback_metrics`` / ``logged_metrics`` /
``progress_bar_metrics``, the parameters the rank holds, the learning rates, and per step, validation and logger
call what the reference recorded at the same point.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from tests.conformance.compare import (
    close,
    diff_all,
    diff_held,
    diff_metric_lists,
    diff_resumed,
    diff_run,
    diff_state,
    diff_steps,
    diff_values,
    load,
    report,
)

pytestmark = pytest.mark.slow


def check(problems: list[str]) -> None:
    assert not problems, report(problems)


def replica_losses(outcome) -> list[str]:
    """With dp > 1, the loss ``on_train_batch_end`` receives is the replica's own (as under DDP): the reference
    probe's loss of that replica's rows of the batch."""
    probe, problems = outcome.ref["probe"], []
    for r in outcome.ranks:
        if r.layout.dp == 1:
            continue
        for i, (step, want) in enumerate(zip(r.result["steps"], probe["train"])):
            if not close(step["loss"], want[r.replica]):
                problems.append(f"{r.where} batch {i}: loss {step['loss']:.7g} (replica {r.replica} of the reference "
                                f"batch: {want[r.replica]:.7g})")
    return problems


# ---------------------------------------------------------------------------------------------- fit


def test_fit_parameters_and_every_step_loss(conformance):
    o = load(conformance, "fit")
    assert len(o.ref["steps"]) == 24
    check(diff_all(o) + replica_losses(o))


def test_accumulate_grad_batches(conformance):
    o = load(conformance, "accumulate")
    assert o.ref["global_step"] == 12  # 24 batches, 2 per optimizer step
    check(diff_all(o))


def test_gradient_clip_val_is_one_norm_over_all_stages(conformance):
    o = load(conformance, "gradient_clip")
    # HPPStrategy adds the clipped stages' norms (grad_norm/stage_k, grad_norm/spread; README "Clipping") to the
    # logged values; everything Lightning itself holds is compared
    check(diff_all(o, skip=("grad_norm/",)))
    # the threshold binds: the global norm (over both stages, as logged on every rank) exceeds 0.05
    norms = [math.hypot(s["callback"]["grad_norm/stage_0"],
                        s["callback"]["grad_norm/stage_1"]) for s in o.ranks[0].result["steps"]]
    assert max(norms) > 0.05, norms


def test_limit_train_and_val_batches(conformance):
    o = load(conformance, "limit_batches")
    assert o.ref["global_step"] == 15
    check(diff_all(o))


def test_check_val_every_n_epoch(conformance):
    o = load(conformance, "val_every_n_epochs")
    assert [v["epoch"] for v in o.ref["validations"]] == [1, 3]
    check(diff_all(o))


def test_val_check_interval_validates_mid_epoch(conformance):
    o = load(conformance, "val_check_interval")
    assert [v["global_step"] for v in o.ref["validations"]] == [6, 12, 18, 24]
    check(diff_all(o))


def test_drop_last_false_trains_the_smaller_last_batch(conformance):
    o = load(conformance, "drop_last_false")
    assert o.ref["global_step"] == 26  # 100 samples: 12 batches of 8 and one of 4, per epoch
    check(diff_all(o))


def test_max_steps_stops_mid_epoch(conformance):
    o = load(conformance, "max_steps")
    assert o.ref["global_step"] == 7
    check(diff_all(o))


def test_max_time_stops_every_rank_at_the_same_step(conformance):
    o = load(conformance, "max_time")
    problems = []
    for layout in sorted({r.layout.name for r in o.ranks}):
        ranks = o.layout(layout)
        stopped = {r.result["global_step"] for r in ranks}
        if len(stopped) != 1 or not all(r.result["should_stop"] for r in ranks):
            problems.append(f"{layout}: ranks stopped at steps {[r.result['global_step'] for r in ranks]}, should_stop "
                            f"{[r.result['should_stop'] for r in ranks]}")
            continue
        step = stopped.pop()
        if not 0 < step < 200:  # the reference (no max_time) runs the 200 steps
            problems.append(f"{layout}: stopped at step {step}, not by max_time")
            continue
        for r in ranks:  # every step up to the stop, and the parameters there, as the reference's at that step
            problems += diff_steps(r.where, r.result["steps"], o.ref["steps"][:step], losses=r.layout.dp == 1)
            problems += diff_state(r.where, r.result["state"], o.ref["states"][step])
    check(problems)


def test_several_validation_dataloaders(conformance):
    o = load(conformance, "val_dataloaders")
    assert {"val_loss/dataloader_idx_0", "val_loss/dataloader_idx_1"} <= set(o.ref["callback"])
    check(diff_all(o))


def test_reduce_fx_sum_max_min_mean(conformance):
    o = load(conformance, "reduce_fx")
    check(diff_all(o))


def test_on_step_and_on_epoch(conformance):
    o = load(conformance, "on_step_on_epoch")
    assert {"a_step", "b_epoch", "c_both_step", "c_both_epoch", "v_both_epoch", "v_epoch"} <= set(o.ref["callback"])
    check(diff_all(o))


def test_sync_dist_reduces_over_replicas_and_unsynced_values_stay_per_replica(conformance):
    o = load(conformance, "sync_dist")
    probe, problems = o.ref["probe"], []
    local = ("loss_local", "val_local")
    for r in o.ranks:
        if r.layout.dp == 1:  # one replica: every value is the reference's
            problems += diff_run(r.result, o.ref, r.where, r.layout)
            continue
        # sync_dist=True values (and everything else) are the reference's; the others are the replica's own
        problems += diff_run(r.result, o.ref, r.where, r.layout, skip=local)
        mine = [batch[r.replica] for batch in probe["train"]]
        for i, step in enumerate(r.result["steps"]):
            if not close(step["callback"]["loss_local_step"], mine[i]):
                problems.append(f"{r.where} batch {i}: loss_local_step {step['callback']['loss_local_step']:.7g} "
                                f"(replica {r.replica}: {mine[i]:.7g})")
        epoch = statistics.fmean(mine[-12:])
        if not close(r.result["callback"]["loss_local_epoch"], epoch):
            problems.append(f"{r.where}: loss_local_epoch {r.result['callback']['loss_local_epoch']:.7g} "
                            f"(replica: {epoch:.7g})")
        for v, (val, batches) in enumerate(zip(r.result["validations"], probe["val"])):
            want = statistics.fmean(b[r.replica] for b in batches)
            if not close(val["callback"]["val_local"], want):
                problems.append(f"{r.where} validation {v}: val_local {val['callback']['val_local']:.7g} "
                                f"(replica: {want:.7g})")
    # the replicas do differ, so the per-replica values say something
    assert probe["train"][0][0] != probe["train"][0][1]
    check(problems + replica_losses(o))


def test_callback_logged_and_progress_bar_metrics_whole(conformance):
    o = load(conformance, "metrics_dicts")
    ref = o.ref
    assert "hidden" in ref["callback"] and "hidden" not in ref["logged"] and "bar_only" in ref["progress"]
    check(diff_all(o))


# ---------------------------------------------------------------------------------------------- callbacks


def _checkpoint_problems(o) -> list[str]:
    want, problems = o.ref["checkpoint"], []
    for r in o.ranks:
        got = r.result["checkpoint"]
        for key in ("best_model_path", "last_model_path", "files"):
            if got[key] != want[key]:
                problems.append(f"{r.where}: ModelCheckpoint {key} {got[key]} (reference {want[key]})")
        for key in ("best_model_score", "kth_value"):
            g, e = got[key], want[key]
            if (g is None) != (e is None) or (g is not None and not (g == e or close(g, e))):
                problems.append(f"{r.where}: ModelCheckpoint {key} {g} (reference {e})")
        if sorted(got["best_k_models"]) != sorted(want["best_k_models"]):
            problems.append(f"{r.where}: ModelCheckpoint best_k_models {sorted(got['best_k_models'])} "
                            f"(reference {sorted(want['best_k_models'])})")
        else:
            problems += [f"{r.where}: best_k_models[{k!r}] {got['best_k_models'][k]} (reference {v})"
                         for k, v in want["best_k_models"].items() if not close(got["best_k_models"][k], v)]
    return problems


def test_model_checkpoint_save_top_k_monitoring_val_loss(conformance):
    o = load(conformance, "checkpoint_top_k")
    assert o.ref["checkpoint"]["files"] == ["epoch=2-step=18.ckpt", "epoch=3-step=24.ckpt"]  # two were dropped
    check(diff_all(o) + _checkpoint_problems(o))


def test_model_checkpoint_every_n_train_steps(conformance):
    o = load(conformance, "checkpoint_every_n_steps")
    assert o.ref["checkpoint"]["files"] == ["epoch=0-step=12.ckpt", "epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt",
                                            "epoch=0-step=9.ckpt"]
    check(diff_all(o) + _checkpoint_problems(o))


def test_early_stopping_stops_at_the_reference_epoch(conformance):
    o = load(conformance, "early_stopping")
    assert o.ref["epoch"] < 12  # it did stop early
    problems = diff_all(o)
    for r in o.ranks:
        for key, value in o.ref["early"].items():
            got = r.result["early"][key]
            if not (got == value or close(got, value)):
                problems.append(f"{r.where}: EarlyStopping {key} {got} (reference {value})")
    check(problems)


def test_learning_rate_monitor(conformance):
    o = load(conformance, "lr_monitor")
    lrs = [m["lr-SGD"] for _, m in o.ref["logger"] if "lr-SGD" in m]
    assert len(lrs) == 12 and len(set(lrs)) == 3
    check(diff_all(o))  # the logger's calls, lr-SGD included, on every rank


def test_reduce_lr_on_plateau_monitoring_val_loss(conformance):
    o = load(conformance, "reduce_lr_on_plateau")
    assert len({tuple(e["lr"]) for e in o.ref["epochs"]}) > 1  # the plateau did lower the LR
    check(diff_all(o))


def test_step_interval_scheduler(conformance):
    o = load(conformance, "step_scheduler")
    assert len({tuple(s["lr"]) for s in o.ref["steps"]}) == 5  # 12 steps, halved after every 3
    check(diff_all(o))


# ---------------------------------------------------------------------------------------------- entry points


def test_predict_returns_the_predictions_in_order(conformance):
    o = load(conformance, "predict")
    problems = diff_all(o)
    for r in o.ranks:
        got, want = r.result["predictions"], o.ref["predictions"][r.layout.dp][r.replica]
        if [tuple(p.shape) for p in got] != [tuple(p.shape) for p in want]:
            problems.append(f"{r.where}: prediction batches {[tuple(p.shape) for p in got]} "
                            f"(reference {[tuple(p.shape) for p in want]})")
            continue
        problems += [f"{r.where}: prediction batch {i} differs by up to {(g - w).abs().max():.3g}"
                     for i, (g, w) in enumerate(zip(got, want)) if not torch.allclose(g, w, rtol=1e-5, atol=1e-6)]
    check(problems)


def test_validate_before_and_after_fit(conformance):
    o = load(conformance, "validate_around_fit")
    problems = diff_all(o)
    for r in o.ranks:
        for when in ("before", "after"):
            problems += diff_metric_lists(r.where, f"validate() {when} fit", r.result[when], o.ref[when])
    check(problems)


def test_test_before_and_after_fit(conformance):
    o = load(conformance, "trainer_test_around_fit")
    problems = diff_all(o)
    for r in o.ranks:
        for when in ("before", "after"):
            problems += diff_metric_lists(r.where, f"test() {when} fit", r.result[when], o.ref[when])
    check(problems)


# ---------------------------------------------------------------------------------------------- resume


def test_resume_from_last_epoch_end_checkpoint(conformance):
    o = load(conformance, "resume_last")
    assert o.ranks[0].result["first"]["global_step"] == 24 and o.ref["global_step"] == 36
    # Lightning's own resume from the same checkpoint equals the uninterrupted run too
    assert not diff_state("lightning", o.ref["lightning_resumed"]["state"], o.ref["state"])
    check(diff_resumed(o))


def test_resume_auto_from_the_strategy_checkpoints(conformance):
    o = load(conformance, "resume_auto")
    problems = diff_resumed(o)
    problems += [f"{r.where}: step checkpoints {r.result['checkpoints']}" for r in o.ranks
                 if r.result["checkpoints"] != ["step-12", "step-24", "step-36"]]
    check(problems)


def test_resume_from_a_mid_epoch_checkpoint(conformance):
    # against the run without interruption: HPPStrategy skips the batches the epoch had used (README, "Checkpointing
    # and resuming"), which Lightning itself does only for a resumable (stateful) loader; with this plain loader its own
    # resume starts the epoch's data again and ends elsewhere (ref["lightning_resumed"])
    o = load(conformance, "resume_mid_epoch")
    assert o.ranks[0].result["first"]["global_step"] == 12
    check(diff_resumed(o))


def test_resume_mid_epoch_with_dataloader_workers(conformance):
    o = load(conformance, "resume_workers")
    check(diff_resumed(o))


# ---------------------------------------------------------------------------------------------- models and setups


def test_unseeded_model_replicas_start_from_rank_0_weights(conformance):
    o = load(conformance, "unseeded")
    problems = diff_all(o)  # the reference (LOCAL_RANK unset: seed 1000) started from what rank 0 built
    for layout in sorted({r.layout.name for r in o.ranks}):
        ranks = o.layout(layout)
        initial = [r.result["initial"] for r in ranks]
        if any(not torch.equal(initial[0][k], v) for k, v in o.ref["initial"].items()):
            problems.append(f"{layout}: rank 0 built other weights than the reference started from")
        # every other rank built weights of its own, so equal ends mean the replicas were made equal
        problems += [f"{r.where}: built rank 0's weights (the scenario proves nothing)" for r, init in zip(
            ranks[1:], initial[1:])
                     if torch.equal(init["layers.0.weight"], initial[0]["layers.0.weight"])]
    check(problems)


def test_single_device_without_a_plan(conformance):
    o = load(conformance, "single_device")
    problems = diff_all(o)
    problems += [f"{r.where}: stages {r.result['stage_ids']}" for r in o.ranks if r.result["stage_ids"] != [0]]
    check(problems)


def test_validate_before_fit_on_the_traced_frontend_trains_with_dropout(conformance):
    o = load(conformance, "traced_dropout")
    # dropout changes the loss, so a run that trained in eval mode could not log the reference's first loss
    assert not close(o.ref["steps"][0]["loss"], o.ref["eval_mode_first_loss"])
    problems = diff_all(o)
    for r in o.ranks:
        problems += diff_metric_lists(r.where, "validate() before fit", r.result["before"], o.ref["before"])
    check(problems)


# --------------------------------------------------------------- epoch ends, torchmetrics, max_steps resume


def test_epoch_end_hooks_log_what_the_steps_collected(conformance):
    # training_step / validation_step append per-sample losses; on_*_epoch_end logs their mean (sync_dist=True):
    # on ranks without the last stage the lists stay empty, and the last stage's values must reach them
    check(diff_all(load(conformance, "epoch_end_outputs")))


def test_torchmetrics_objects_logged_by_name(conformance):
    # macro accuracy through forward (step values over the whole step, epoch value by compute()), macro accuracy
    # and a sum through update (computed, synced over the replicas and reset each epoch as Lightning does)
    outcome = load(conformance, "torchmetrics_logged")
    problems = []
    for r in outcome.ranks:
        # under dp > 1 a Metric's step value is its replica's own batch's, as under DDP (forward does not sync):
        # the step values are left out there, the epoch values (synced) compared
        per_replica = ("train_acc",) if r.layout.dp > 1 else ()
        problems += diff_run(r.result, outcome.ref, r.where, r.layout, per_replica)
        if per_replica:
            problems += diff_values(r.where, "callback_metrics",
                                    {k: r.result["callback"][k] for k in ("train_acc_epoch",)},
                                    {k: outcome.ref["callback"][k] for k in ("train_acc_epoch",)})
    for layout in sorted({r.layout.name for r in outcome.ranks}):
        problems += diff_held(outcome, layout)
        ranks = outcome.layout(layout)
        for a in ranks:  # the ranks of one replica log the same step values
            for b in (b for b in ranks if b.replica == a.replica and b.rank > a.rank):
                for i, (x, y) in enumerate(zip(a.result["steps"], b.result["steps"])):
                    if not close(x["callback"]["train_acc_step"], y["callback"]["train_acc_step"]):
                        problems.append(f"{layout} batch {i}: train_acc_step {x['callback']['train_acc_step']} on rank "
                                        f"{a.rank}, {y['callback']['train_acc_step']} on rank {b.rank} (one replica)")
    check(problems)


def test_resume_from_a_max_steps_checkpoint(conformance):
    # Lightning's own resume from this checkpoint also leaves the uninterrupted run (it restarts with epoch 1's
    # order from its first batch: ref["lightning_resumed"]); HPPStrategy promises the uninterrupted run
    check(diff_resumed(load(conformance, "resume_max_steps")))
