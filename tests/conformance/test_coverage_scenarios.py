"""Trainer arguments and Lightning callbacks, each on every rank of pp=2 against one process (the scenarios:
tests/conformance/scenarios_coverage.py; the jobs: conftest.py). Cited by the rows of tests/lightning_coverage.py."""

from __future__ import annotations

import pytest

from lightning_hpp.check.compare import diff_data
from tests.conformance.compare import diff_all, diff_state, load, report

pytestmark = pytest.mark.slow


def check(problems: list[str]) -> None:
    assert not problems, report(problems)


def extras(o, *keys: str) -> list[str]:
    return [
        f"{r.where}: {key}{p}: {d}" for r in o.ranks for key in keys for p, d in diff_data(r.result[key], o.ref[key])]


@pytest.mark.parametrize("name", ["overfit_batches", "fast_dev_run", "min_epochs_and_min_steps", "log_every_n_steps",
                                  "reload_dataloaders_every_n_epochs", "gradient_accumulation_scheduler",
                                  "spike_detection", "gradient_clip_by_value", "without_the_distributed_sampler"])
def test_runs_as_one_process(conformance, name):
    # HPPStrategy logs grad_norm/stage_<k> and grad_norm/spread where something clips (README "Clipping")
    check(diff_all(load(conformance, name), skip=("grad_norm/",)))


def test_limit_test_and_predict_batches(conformance):
    o = load(conformance, "limit_test_and_predict_batches")
    assert len(o.ref["predicted"]) == 3
    check(diff_all(o) + extras(o, "tested", "predicted"))


def test_detect_anomaly_and_inference_mode_off(conformance):
    o = load(conformance, "detect_anomaly_and_inference_mode_off")
    check(diff_all(o) + extras(o, "validated"))


def test_profiler_simple(conformance):
    o = load(conformance, "profiler_simple")
    assert o.ref["profiled"]
    check(diff_all(o) + extras(o, "profiled"))


def test_barebones(conformance):
    o = load(conformance, "barebones")
    check([p for r in o.ranks for p in diff_state(r.where, r.result["state"],
                                                  o.ref["state"])] + extras(o, "global_step"))


def test_deterministic_and_benchmark(conformance):
    o = load(conformance, "deterministic_and_benchmark")
    assert o.ref["deterministic"]
    check(diff_all(o) + extras(o, "deterministic"))


def test_enable_autolog_hparams_and_default_root_dir(conformance):
    o = load(conformance, "enable_autolog_hparams_and_default_root_dir")
    check(diff_all(o) + extras(o, "hparams"))


def test_lambda_callback(conformance):
    o = load(conformance, "lambda_callback")
    check(diff_all(o) + extras(o, "seen"))


def test_learning_rate_finder_callback(conformance):
    o = load(conformance, "learning_rate_finder_callback")
    check(diff_all(o) + extras(o, "suggestion", "module_lr"))


def test_scale_batch_size_is_refused_on_every_rank_as_under_ddp(conformance):
    o = load(conformance, "scale_batch_size")
    assert o.ref["found"] > 2 and o.ref["refused"] is None
    check([f"{r.where}: {r.result['refused']!r}" for r in o.ranks
           if "not supported with distributed strategies" not in (r.result["refused"] or "")
           or r.result["global_step"]])


def test_device_stats_and_throughput_monitors_log_the_same_keys(conformance):
    o = load(conformance, "device_stats_and_throughput_monitors")
    assert any("cpu_percent" in k for k in o.ref["keys"]) and "train/samples" in o.ref["keys"]
    # ThroughputMonitor writes on global rank zero only, as under DDP; DeviceStatsMonitor on every rank
    problems = extras(o, "callback_keys")
    for r in o.ranks:
        want = [k for k in o.ref["keys"] if r.rank == 0 or not k.startswith(("train/", "validate/"))]
        problems += [f"{r.where}: logged keys{p}: {d}" for p, d in diff_data(r.result["keys"], want)]
    problems += [p for r in o.ranks for p in diff_state(r.where, r.result["state"], o.ref["state"])]
    check(problems)


def test_on_exception_checkpoint_is_written_and_resumes(conformance):
    o = load(conformance, "on_exception_checkpoint")
    problems = []
    for r in o.ranks:
        problems += diff_state(r.where, r.result["state"], o.ref["uninterrupted"])
        if r.result["written"] != ["on_exception.ckpt"] or r.result["raised"] != "raised by the test":
            problems.append(f"{r.where}: wrote {r.result['written']}, raised {r.result.get('raised')!r}")
        if r.result["global_step"] != 5:
            problems.append(f"{r.where}: resumed run ended at step {r.result['global_step']} (5)")
    check(problems)


def test_progress_bars_show_what_one_process_shows(conformance):
    o = load(conformance, "progress_bars")
    assert set(o.ref["shown"]) == {"TQDMProgressBar", "RichProgressBar"}
    check(diff_all(o) + extras(o, "shown"))
