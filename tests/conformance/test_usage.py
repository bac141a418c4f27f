"""Ordinary Lightning usage outside the listed behaviours, on every rank of pp=2 and pp=2 × dp=2 against one process
(the scenarios: tests/conformance/scenarios_usage.py; the jobs: conftest.py)."""

from __future__ import annotations

import pytest

from lightning_hpp.check.compare import diff_data, diff_hooks
from lightning_hpp.check.hooks import describe
from tests.conformance.compare import diff_all, diff_run, load, report

pytestmark = pytest.mark.slow


def check(problems: list[str]) -> None:
    assert not problems, report(problems)


def hook_problems(o, key: str = "hooks") -> list[str]:
    return [p for r in o.ranks for p in diff_hooks(r.where, r.result[key], o.ref[key], local_rank=r.rank,
                                                     replica=r.replica, replicas=r.layout.dp)]


def test_every_hook_with_its_arguments_on_every_rank(conformance):
    """Every LightningModule, Callback and LightningDataModule hook of fit (with a sanity check, validation, a
    scheduler, checkpoints), validate, test and predict, and of a fit resumed from the last checkpoint: the same calls
    in the same order on every rank as in one process, with the same arguments (the batch a replica's share of it;
    its step outputs its own)."""
    o = load(conformance, "every_hook")
    called = {name for _, name, *_ in o.ref["hooks"] + o.ref["resumed_hooks"]}
    assert {"on_train_epoch_end", "on_validation_epoch_end", "on_train_batch_end", "on_before_optimizer_step",
            "configure_gradient_clipping", "on_predict_batch_end", "on_save_checkpoint", "on_load_checkpoint",
            "load_state_dict", "lr_scheduler_step", "on_sanity_check_start"} <= called
    check(diff_all(o) + hook_problems(o) + hook_problems(o, "resumed_hooks"))


def test_every_hook_with_the_module_s_own_loaders(conformance):
    o = load(conformance, "every_hook_with_the_module_s_own_loaders")
    assert {"train_dataloader", "transfer_batch_to_device"} <= {name for _, name, *_ in o.ref["hooks"]}
    check(diff_all(o) + hook_problems(o))


def test_hooks_when_a_hook_raises(conformance):
    o = load(conformance, "hooks_when_a_hook_raises")
    assert {("callback", "on_exception"),
            ("datamodule", "on_exception")} <= {(owner, name) for owner, name, *_ in o.ref["hooks"]}
    problems = hook_problems(o)
    problems += [f"{r.where}: raised {r.result['raised']!r} (reference {o.ref['raised']!r})" for r in o.ranks
                 if r.result["raised"] != o.ref["raised"]]
    check(problems)


def test_step_outputs_reach_every_rank_with_every_key_and_collected_state_is_there_for_epoch_ends(conformance):
    o = load(conformance, "step_outputs_and_collected_state")
    problems = diff_all(o)
    ref_outputs = o.ref["batch_outputs"]
    assert {"acc", "correct", "preds", "tag"} <= set(ref_outputs[0][1])
    for r in o.ranks:
        got = r.result["batch_outputs"]
        if [k for k, _ in got] != [k for k, _ in ref_outputs]:
            problems.append(f"{r.where}: batch ends {[k for k, _ in got]} (reference {[k for k, _ in ref_outputs]})")
            continue
        for i, ((kind, g), (_, e)) in enumerate(zip(got, ref_outputs)):
            if r.layout.dp == 1:  # the whole batch's outputs: per-sample values whole, means, counts
                problems += [f"{r.where}: {kind} batch end {i} outputs{p}: {d}" for p, d in diff_data(g, e)]
            elif sorted(g) != sorted(e):  # a replica's own outputs: every key
                problems.append(f"{r.where}: {kind} batch end {i} outputs keys {sorted(g)} (reference {sorted(e)})")
        files, ref_files = r.result["files"], o.ref["files"]
        if sorted(files) != sorted(ref_files):
            problems.append(f"{r.where}: global rank zero wrote {sorted(files)} (reference {sorted(ref_files)})")
        for name in sorted(set(files) & set(ref_files)):
            got_values, ref_values = files[name].split(), ref_files[name].split()
            if r.layout.dp > 1:  # gathered replica by replica: the reference's predictions, in another order
                got_values, ref_values = sorted(got_values), sorted(ref_values)
            if got_values != ref_values:
                problems.append(f"{r.where}: {name} holds other predictions than the reference's")
    check(problems)


def test_a_frozen_stage_trains_as_one_process_then_unfrozen_for_a_second_fit_with_a_new_trainer(conformance):
    o = load(conformance, "frozen_stage_then_unfrozen_for_a_second_fit")
    problems = diff_all(o)
    for r in o.ranks:
        problems += diff_run(r.result["first"], o.ref["first"], f"{r.where} (first fit)", r.layout)
    check(problems)


def test_backbone_finetuning_unfreezes_a_stage_in_a_hook_during_the_run(conformance):
    check(diff_all(load(conformance, "backbone_finetuning_unfreezes_in_a_hook")))


def test_tied_weights_in_plain_modules_across_stages(conformance):
    check(diff_all(load(conformance, "tied_weights_in_plain_modules")))


def test_tuner_lr_find_then_fit(conformance):
    o = load(conformance, "tuner_lr_find_then_fit")
    problems = diff_all(o)
    for r in o.ranks:
        for key in ("suggestion", "module_lr", "lr_find_losses", "left_behind"):
            problems += [f"{r.where}: {key}{p}: {d}" for p, d in diff_data(r.result[key], o.ref[key])]
    check(problems)


def test_stochastic_weight_averaging(conformance):
    check(diff_all(load(conformance, "stochastic_weight_averaging")))


def test_ema_weight_averaging(conformance):
    check(diff_all(load(conformance, "ema_weight_averaging")))


def test_loggers_write_what_one_process_writes(conformance):
    o = load(conformance, "loggers")
    assert {"csv", "tensorboard", "mlflow", "mlflow_params"} <= set(o.ref["files"]), sorted(o.ref["files"])
    problems = diff_all(o)
    for r in o.ranks:
        problems += [f"{r.where}: files{p}: {d}" for p, d in diff_data(r.result["files"], o.ref["files"])]
    check(problems)


def test_prediction_writer_writes_each_replica_s_predictions_once(conformance):
    """The files one process writes, each prediction once: with one replica the same files; with two, each replica's
    file holds its share (rows ``r::2`` of each batch), written by the rank of the pipeline's first position."""
    import torch

    o = load(conformance, "prediction_writer")
    ref = o.ref["files"]
    problems = []
    for layout in sorted({r.layout.name for r in o.ranks}):
        ranks = o.layout(layout)
        files, dp = ranks[0].result["files"], ranks[0].layout.dp
        if any(r.result["files"].keys() != files.keys() for r in ranks):
            problems.append(f"{layout}: the ranks read different files")
        expected = {}
        for name, value in ref.items():
            for replica in range(dp):
                if name.endswith("_epoch.pt"):
                    predictions, indices = value
                    value_r = ([p[replica::dp] for p in predictions], [[i for i in b][replica::dp] for b in indices[0]])
                    expected[name.replace("rank0", f"rank{replica}")] = value_r
                else:
                    expected[name.replace("rank0", f"rank{replica}")] = value[replica::dp]
        if sorted(files) != sorted(expected):
            problems.append(f"{layout}: wrote {sorted(files)} (expected {sorted(expected)})")
            continue
        for name in sorted(expected):
            got, want = files[name], expected[name]
            if name.endswith("_epoch.pt"):
                got = ([p for p in got[0]], [list(b) for b in got[1][0]])
            problems += [f"{layout} {name}{p}: {d}" for p, d in diff_data(describe(got), describe(want))]
    assert torch is not None
    check(problems)


def test_model_summary_shows_the_whole_model(conformance):
    o = load(conformance, "model_summary")
    assert set(o.ref["tables"]) == {"ModelSummary", "RichModelSummary"}
    assert o.ref["tables"]["ModelSummary"]["trainable"] < o.ref["tables"]["ModelSummary"]["total"]  # a frozen stage
    problems = []
    for r in o.ranks:
        want = o.ref["tables"] if r.rank == 0 else {k: {} for k in o.ref["tables"]}  # printed by global rank zero
        problems += [f"{r.where}: tables{p}: {d}" for p, d in diff_data(r.result["tables"], want)]
    check(problems)


@pytest.mark.parametrize(("case", "says"), [
    ("pruning", "`ModelPruning` prunes weights during training"),
    ("sync_batchnorm", "`Trainer(sync_batchnorm=True)`"),
    ("backward", "`OwnBackward.backward` is overridden"),
])
def test_what_cannot_be_kept_is_refused_at_setup_on_every_rank(conformance, case, says):
    o = load(conformance, "refused_setups")
    assert o.ref[case]["refused"] is None and o.ref[case]["global_step"] == 2
    check([f"{r.where}: {r.result[case]}" for r in o.ranks
           if says not in (r.result[case]["refused"] or "") or r.result[case]["global_step"] != 0])


def test_every_hook_row_is_called_in_the_scenario_it_cites(conformance):
    """Each hook row of tests/lightning_coverage.py that says *equal* cites a test whose scenario records hooks: one
    process called the hook there (so the per-rank comparison of that test covers it)."""
    from tests.lightning_coverage import HOOK_SCENARIOS, rows

    owners = {"LightningModule hook": "module", "Callback hook": "callback", "LightningDataModule hook": "datamodule"}
    called = {}
    for test, (name, keys) in HOOK_SCENARIOS.items():
        ref = load(conformance, name).ref
        called[test] = {(owner, hook) for key in keys for owner, hook, *_ in ref[key]}
    missing = [f"{r.kind} {r.name} (cites {r.evidence.partition('::')[2]})" for r in rows()
               if r.kind in owners and r.verdict == "equal" and (owners[r.kind], r.name) not in called[r.evidence]]
    assert not missing, f"hooks their scenario never called: {missing}"
