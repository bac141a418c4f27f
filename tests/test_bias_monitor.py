"""BiasMonitor: the metrics against brute-force references, the alarms, and real 2-rank DDP runs."""

from __future__ import annotations

import csv
import itertools
import statistics
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_hpp.bias.fingerprint import CodedBiasWarning
from lightning_hpp.bias.monitor import BiasMonitor, _step_metrics, index_overlap_metrics
from lightning_hpp.bias.samplers import DistributedWeightedSampler
from lightning_hpp.errors import BiasConfigError
from tests.harness.launch import Job, run_job

try:
    from bias_workers import monitor_ddp as script
except ImportError:  # tests/ is a package in this checkout
    from tests.bias_workers import monitor_ddp as script


# ------------------------------------------------------------------------------ metric definitions
def brute_force(per_rank, n):
    sets = [set(s) for s in per_rank]
    pairs = list(itertools.combinations(range(len(sets)), 2))
    inter = sum(len(sets[a] & sets[b]) for a, b in pairs)
    union = sum(len(sets[a] | sets[b]) for a, b in pairs)
    k = min(len(s) for s in per_rank)
    agree = sum(per_rank[a][i] == per_rank[b][i] for a, b in pairs for i in range(k)) / (len(pairs) * k)
    return inter / union, len(set().union(*sets)) / n, agree


def test_overlap_coverage_agreement_match_brute_force():
    g = torch.Generator().manual_seed(0)
    per_rank = [torch.randint(0, 50, (30,), generator=g).tolist() for _ in range(3)]
    m = index_overlap_metrics(per_rank, 50)
    jac, cov, agree = brute_force(per_rank, 50)
    assert m["bias/overlap_jaccard"] == pytest.approx(jac)
    assert m["bias/coverage"] == pytest.approx(cov)
    assert m["bias/sequence_agreement"] == pytest.approx(agree)
    same = index_overlap_metrics([per_rank[0], per_rank[0]], 50)
    assert same["bias/overlap_jaccard"] == 1.0 and same["bias/sequence_agreement"] == 1.0
    disjoint = index_overlap_metrics([list(range(25)), list(range(25, 50))], 50)
    assert disjoint["bias/overlap_jaccard"] == 0.0 and disjoint["bias/coverage"] == 1.0
    assert disjoint["bias/overlap_expected"] == 0.0  # no repeats: shards must be disjoint


def test_expected_overlap_matches_independent_draws():
    p = torch.cat([torch.full((10,), 20.0), torch.ones(490)])
    g = torch.Generator().manual_seed(1)
    per_rank = [torch.multinomial(p, 2000, replacement=True, generator=g).tolist() for _ in range(3)]
    m = index_overlap_metrics(per_rank, 500)
    assert m["bias/overlap_jaccard"] > 0.3  # independent ranks overlap a lot with replacement ...
    assert abs(m["bias/overlap_jaccard"] - m["bias/overlap_expected"]) < 0.05  # ... as expected


def test_step_metrics_group_by_stage_and_deduplicate_dp_ranks():
    # World of 4 = 2 stages x 2 dp ranks; the loss reaches every stage of a replica.
    gathered = [
        {"dp_rank": 0, "loss": 1.0, "norms": {0: 0.5}},
        {"dp_rank": 1, "loss": 2.0, "norms": {0: 0.9}},
        {"dp_rank": 0, "loss": 1.0, "norms": {1: 3.0}},
        {"dp_rank": 1, "loss": 2.0, "norms": {1: 3.0}},
    ]
    assert _step_metrics(gathered) == {
        "bias/loss_std": pytest.approx(0.5),
        "bias/grad_norm_std/stage_0": pytest.approx(0.2),
        "bias/grad_norm_std/stage_1": 0.0,
    }


# ------------------------------------------------------------------------------ alarms
def test_grad_norm_alarm_names_metric_value_and_cause():
    mon = BiasMonitor()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(14):  # the warm-up (10 steps), then four: not yet sustained
            assert mon.check_step_metrics({"bias/grad_norm_std/stage_1": 0.32}, step=step, epoch=0) == []
    with pytest.warns(CodedBiasWarning, match=r"bias/grad_norm_std/stage_1 = 0\.32 exceeds 0\.15.*Likely cause"):
        mon.check_step_metrics({"bias/grad_norm_std/stage_1": 0.32}, step=14, epoch=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mon.check_step_metrics({"bias/grad_norm_std/stage_1": 0.40}, step=15, epoch=0) == []  # once per epoch
        assert mon.check_step_metrics({"bias/grad_norm_std/stage_0": 0.04}, step=16, epoch=1) == []


def noisy(level: float, n: int, seed: int, rel: float = 0.15) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return [level * (1 + rel * float(e)) for e in torch.randn(n, generator=g).clamp(-2, 2)]


def run_monitor(series: dict[str, list[float]]) -> list[tuple[int, str]]:
    """Feed step metrics to a default BiasMonitor; returns (step, metric) of each alarm."""
    mon = BiasMonitor()
    out = []
    for step in range(len(next(iter(series.values())))):
        for msg in mon.check_step_metrics({k: v[step] for k, v in series.items()}, step=step, epoch=0, warn=False):
            out.append((step, msg.split(" =")[0]))
    return out


def test_correct_runs_raise_no_alarm_single_spikes_and_warm_up():
    # Local gradient norms that spread now and then for one step (a hard batch on one rank).
    norms = noisy(0.05, 60, seed=0)
    for i in (9, 23, 41):
        norms[i] = 0.35
    # The loss spread of a model that starts from zeros: tiny in the warm-up, rising to its level over
    # a dozen steps, with one-step spikes. A baseline taken in the warm-up would call that a jump.
    loss = [0.004, 0.005, 0.006, 0.008, 0.01] + [0.01 + 0.03 * min(1.0, i / 12) for i in range(55)]
    loss = [v * f for v, f in zip(loss, noisy(1.0, 60, seed=1))]
    for i in (20, 33, 47):
        loss[i] = 0.3
    assert run_monitor({"bias/grad_norm_std/stage_0": norms, "bias/loss_std": loss}) == []


def test_field_report_shift_is_flagged_within_20_steps():
    # Large, settling spreads in the warm-up; 0.042 until the 17th step (index 16), where the field report
    # saw the jump, then 0.189 (loss_std) and 0.32 (grad_norm_std) -- the field report's numbers.
    warm = [0.3, 0.2, 0.12, 0.08, 0.06, 0.05]
    loss = warm + noisy(0.042, 10, seed=2) + noisy(0.189, 10, seed=3)
    norms = [0.1] * 6 + noisy(0.04, 10, seed=4) + noisy(0.32, 10, seed=5)
    alarms = run_monitor({"bias/grad_norm_std/stage_0": norms, "bias/loss_std": loss})
    first = {metric: step for step, metric in reversed(alarms)}
    assert set(first) == {"bias/loss_std", "bias/grad_norm_std/stage_0"}
    assert all(16 <= step < 20 for step in first.values()), first  # within the first 20 steps
    mon = BiasMonitor(grad_norm_std_threshold=None)
    msgs = [m for i, v in enumerate(loss) for m in mon.check_step_metrics({"bias/loss_std": v}, i, 0, warn=False)]
    assert len(msgs) == 1 and "rolling median" in msgs[0] and "x the baseline 0.04" in msgs[0]


def test_epoch_alarms():
    mon = BiasMonitor(min_coverage=0.9)
    msgs = mon.check_epoch_metrics({"bias/overlap_jaccard": 0.9, "bias/overlap_expected": 0.4, "bias/coverage": 0.5,
                                    "bias/sequence_agreement": 0.95}, epoch=2, warn=False)
    assert [m.split(" =")[0] for m in msgs] == ["bias/overlap_jaccard", "bias/sequence_agreement", "bias/coverage"]
    assert mon.check_epoch_metrics({"bias/overlap_jaccard": 0.45, "bias/overlap_expected": 0.4, "bias/coverage": 0.95,
                                    "bias/sequence_agreement": 0.05}, epoch=3, warn=False) == []


def test_bad_input():
    with pytest.raises(BiasConfigError, match=r"grad_norm_std_threshold=-0.1"):
        BiasMonitor(grad_norm_std_threshold=-0.1)
    with pytest.raises(BiasConfigError, match=r"log_every_n_steps=0"):
        BiasMonitor(log_every_n_steps=0)
    with pytest.raises(BiasConfigError, match=r"loss_std_jump=0.5"):
        BiasMonitor(loss_std_jump=0.5)
    with pytest.raises(BiasConfigError, match=r"warmup_steps=-1"):
        BiasMonitor(warmup_steps=-1)
    with pytest.raises(BiasConfigError, match=r"sustain_steps=0"):
        BiasMonitor(sustain_steps=0)


# ------------------------------------------------------------------------------ real DDP runs
@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """One 2-rank `Trainer(strategy="ddp")` launch running the bug, the fix and the strategy contract."""
    import json

    out = tmp_path_factory.mktemp("monitor")
    run_job(Job(Path(script.__file__).resolve(), str(out), ranks=2, script=True, cwd=out, timeout=240))
    runs = {name: [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in range(2)]
            for name in ("bug", "fix", "contract")}
    return out, runs


def _csv(out: Path, name: str) -> list[dict[str, str]]:
    with open(out / name / "version_0" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def _epochs(history):
    return [h for h in history if "bias/overlap_jaccard" in h]


def test_ddp_field_report_bug_is_flagged(ddp_runs):
    out, runs = ddp_runs
    r0, r1 = runs["bug"]
    epochs = _epochs(r0["history"])
    assert len(epochs) == script.EPOCHS
    assert all(e["bias/overlap_jaccard"] == 1.0 and e["bias/sequence_agreement"] == 1.0 for e in epochs)
    assert all(e["bias/overlap_jaccard"] - e["bias/overlap_expected"] > 0.15 for e in epochs)
    # Identical data on both ranks: identical local gradients and losses.
    steps = [h for h in r0["history"] if "bias/loss_std" in h]
    assert steps and all(h["bias/loss_std"] < 1e-7 and h["bias/grad_norm_std/stage_0"] < 1e-7 for h in steps)
    # The alarm fires as a warning on rank 0, naming the metric and its value.
    assert any(w.startswith("bias/overlap_jaccard = 1.000 exceeds") for w in r0["warnings"])
    assert r1["warnings"] == [] and r1["alarms"] == r0["alarms"]
    # Through Lightning's loggers: the CSV logger on rank 0 has the epoch metric.
    logged = [float(row["bias/overlap_jaccard"]) for row in _csv(out, "bug") if row["bias/overlap_jaccard"]]
    assert logged == [1.0] * script.EPOCHS
    assert r0["sampler_class_restored"] is True


def test_ddp_distributed_weighted_sampler_is_clean(ddp_runs):
    out, runs = ddp_runs
    r0, r1 = runs["fix"]
    assert r0["sampler"] == "DistributedWeightedSampler" and r0["wrapped"] is False and r0["is_dws"] is True
    assert r0["warnings"] == r1["warnings"] == [] and r0["alarms"] == []
    # Epoch metrics equal those of the indices the sampler yields for each rank (computed here).
    for epoch, logged in enumerate(_epochs(r0["history"])):
        shards = []
        for rank in range(2):
            s = DistributedWeightedSampler(script.weights(), seed=script.SEED, num_replicas=2, rank=rank)
            s.set_epoch(epoch)
            shards.append(list(s))
        ref = index_overlap_metrics(shards, script.N)
        assert {k: logged[k] for k in ref} == pytest.approx(ref)
        assert logged["bias/overlap_jaccard"] < 0.6 and logged["bias/sequence_agreement"] < 0.2
    # The first step's spreads against a single-process fp32 reference of each rank's first batch.
    data = script.data()
    model = script.Regressor()
    losses, norms = [], []
    for rank in range(2):
        s = DistributedWeightedSampler(script.weights(), seed=script.SEED, num_replicas=2, rank=rank)
        x, y = data[list(s)[: script.BATCH]]
        model.zero_grad()
        loss = F.mse_loss(model.net(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
    first = r0["history"][0]
    assert first["bias/loss_std"] == pytest.approx(statistics.pstdev(losses), rel=1e-5)
    # Local norms before DDP's all-reduce (after it, both ranks would hold the same gradient).
    assert r0["norm_source"] == "ddp_comm_hook"
    assert first["bias/grad_norm_std/stage_0"] == pytest.approx(statistics.pstdev(norms), rel=1e-5)
    assert first["bias/grad_norm_std/stage_0"] > 1e-3
    rows = _csv(out, "fix")
    assert len([r for r in rows if r["bias/grad_norm_std/stage_0"]]) == script.EPOCHS * script.N // 2 // script.BATCH


def test_ddp_strategy_contract(ddp_runs):
    _, runs = ddp_runs
    r0, _ = runs["contract"]
    assert r0["norm_source"] == "step_stats"
    steps = [h for h in r0["history"] if "bias/loss_std" in h]
    a, b = script.STAGE_NORMS[0]
    assert all(h["bias/grad_norm_std/stage_0"] == pytest.approx(statistics.pstdev([a, b])) for h in steps)
    assert all(h["bias/grad_norm_std/stage_1"] == 0.0 for h in steps)
    assert steps[0]["bias/loss_std"] == pytest.approx(runs["fix"][0]["history"][0]["bias/loss_std"])
    assert any(w.startswith("bias/grad_norm_std/stage_0 = 0.25 exceeds 0.15") for w in r0["warnings"])
