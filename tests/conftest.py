"""Jobs shared by several test modules.

Every ``tests.workers.run_real`` configuration of test_real_models, test_traced_stages,
test_big_models and test_fp8_state runs in one of four jobs (one per number of ranks and kind) instead of nine, and
every ``tests.workers.run_hpp`` configuration of test_correctness, test_precision and
test_placement_strategy in one of three instead of five. A job runs its configurations one after
another, each with its own Trainer and model; jobs that share nothing run side by side
(:func:`tests.harness.launch.run_jobs`). The 3- and 4-rank ``run_hpp`` jobs' ranks are forked from one process that
imported Lightning (``Job(start="forked")``: ``lightning_hpp.torchrun``), the others start through
Lightning's launcher (forking the ``run_real`` jobs saved nothing). Each module keeps its own directory and its own
assertions; its fixtures take what they need from :func:`real_model_jobs` or :func:`hpp_jobs`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.fixture(scope="session")
def real_model_jobs(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The ``run_real`` jobs, started by the first test that needs one of them, in two rounds:

    1. 2 ranks: real models traced and the BatchNorm chain (test_real_models), tied-weight checkpoints,
       per-stage precisions and V schedules (test_traced_stages), the meta-device chain (test_big_models),
       the emulated fp8 checkpoints resumed (test_fp8_state), compiled blocks (test_compile);
       4 ranks: GPT-2 pp=2 x dp=2 (test_real_models), the meta-device Llama in 4 stages (test_big_models),
       Llama (eager, and on the meta device reading test_big_models' weights) and an MLP pp=2 x tp=2
       (test_tensor_parallel);
    2. 3 ranks: Llama in 3 stages (test_real_models), the GPT-2 checkpoint of round 1 resumed under 3
       stages (test_traced_stages); 2 ranks: the traced GPT-2s whose setup must fail, tried in turn by
       the same ranks (test_traced_stages, tests/workers/refusals.py).

    Returns the modules' directories (``real``, ``traced``, ``big``, ``refused``, ``fp8_state``, ``tp``,
    ``compiled``), the refusal job's
    finished process (``refusals``) and what test_big_models wrote the weights of (``llama``, ``chain``).
    """
    from tests import test_big_models as big
    from tests import test_compile as compiled
    from tests import test_fp8_state as fp8_state
    from tests import test_real_models as real
    from tests import test_tensor_parallel as tp
    from tests import test_traced_stages as traced
    from tests.harness.launch import Job, run_jobs
    from tests.harness.runs import Runs

    root = tmp_path_factory.mktemp("real_model_jobs")
    dirs = {name: root / name for name in ("real", "traced", "big", "refused", "fp8_state", "tp", "compiled")}
    for d in dirs.values():
        d.mkdir()
    llama, chain = big.write_weights(dirs["big"])

    def job(devices: int, runs: list[dict], timeout: float) -> Job:
        return Job("tests.workers.run_real", Runs.of(devices, "real", runs), ranks=devices, timeout=timeout)

    run_jobs([
        job(2, real.two_rank_runs(dirs["real"]) + traced.two_rank_runs(dirs["traced"]) + big.two_rank_runs(dirs["big"])
            + fp8_state.two_rank_runs(dirs["fp8_state"]) + compiled.two_rank_runs(dirs["compiled"]), 900),
        job(4, real.four_rank_runs(dirs["real"]) + big.four_rank_runs(dirs["big"])
            + tp.four_rank_runs(dirs["tp"], dirs["big"] / "hf"), 900),
    ])
    resumed, refusals = run_jobs([
        job(3, real.three_rank_runs(dirs["real"]) + traced.three_rank_runs(dirs["traced"]), 600),
        job(2, traced.refused_runs(dirs["refused"]) + tp.refused_runs(dirs["refused"]), 600),
    ], check=False)
    assert resumed.returncode == 0, f"--- stdout\n{resumed.stdout[-4000:]}\n--- stderr\n{resumed.stderr[-8000:]}"
    return SimpleNamespace(**dirs, refusals=refusals, llama=llama, chain=chain)


@pytest.fixture(scope="session")
def hpp_jobs(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The ``run_hpp`` jobs, side by side, started by the first test that needs one of them: 2 ranks
    (test_correctness, test_precision, test_placement_strategy), 3 ranks (test_correctness) and 4 ranks
    (test_correctness, test_placement_strategy).
    Returns the modules' directories: ``correctness / f"ranks{n}"``, ``precision``, ``placement``."""
    from tests import test_correctness as correctness
    from tests import test_placement_strategy as placement
    from tests import test_precision as precision
    from tests.harness.launch import Job, run_jobs
    from tests.harness.runs import Runs

    root = tmp_path_factory.mktemp("hpp_jobs")
    dirs = {name: root / name for name in ("correctness", "precision", "placement")}
    for d in dirs.values():
        d.mkdir()
    ranks = {n: dirs["correctness"] / f"ranks{n}" for n in (2, 3, 4)}
    two = (correctness.two_rank_runs(ranks[2]) + precision.two_rank_runs(dirs["precision"])
           + placement.two_rank_runs(dirs["placement"]))
    four = correctness.four_rank_runs(ranks[4]) + placement.four_rank_runs(dirs["placement"])
    run_jobs([
        Job("tests.workers.run_hpp", Runs.of(2, "hpp", two), ranks=2, timeout=600),  # through Lightning's launcher
        Job("tests.workers.run_hpp", Runs.of(3, "hpp", correctness.three_rank_runs(ranks[3])), ranks=3,
            start="forked", timeout=600),
        Job("tests.workers.run_hpp", Runs.of(4, "hpp", four), ranks=4, start="forked", timeout=600),
    ])
    return SimpleNamespace(**dirs)


@pytest.fixture(scope="session")
def eight_rank_job(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The one 8-rank job (``tests.workers.run_3d``, ranks forked from one process that imported Lightning):
    pipeline × data parallel × tensor parallel on real models, with clipping, tied weights on a V schedule and
    the refused combinations (test_parallel_3d), then the first two layouts of the checkpoint chain, saved under
    pp2 × fsdp2 × tp2 and resumed under pp4 × tp2 (test_checkpoint_reshard_chain, which goes on on 4 ranks).

    Returns the modules' directories (``three_d``, ``chain``), the job's finished process (``proc``, its exit
    status 1 from the refused cases) and its wall time in seconds (``seconds``).
    """
    from tests import test_checkpoint_reshard_chain as chain
    from tests import test_parallel_3d as three_d
    from tests.harness.launch import Job, run_job

    root = tmp_path_factory.mktemp("eight_rank_job")
    dirs = {name: root / name for name in ("three_d", "chain")}
    for d in dirs.values():
        d.mkdir()
    runs = three_d.eight_rank_runs(dirs["three_d"]) + chain.eight_rank_runs(dirs["chain"])
    proc = run_job(Job("tests.workers.run_3d", {"devices": 8, "runs": runs}, ranks=8, start="forked", timeout=1500),
                   check=False)
    return SimpleNamespace(**dirs, proc=proc, seconds=proc.seconds)


@pytest.fixture(scope="session")
def coded_bias_gloo(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, ...]:
    """The 2-rank gloo run shared by the fingerprint and audit tests (tests/bias_workers/gloo_worker.py): rank 0
    starts with PYTHONHASHSEED=1 and rank 1 with PYTHONHASHSEED=2. Returns each rank's JSON result."""
    from pathlib import Path

    from tests.harness.launch import Job, run_job
    from tests.harness.results import rank_results

    out = tmp_path_factory.mktemp("coded_bias_gloo")
    run_job(Job(Path(__file__).parent / "bias_workers" / "gloo_worker.py", str(out), ranks=2, start="per_rank",
                script=True, cwd=out, rank_env={0: {"PYTHONHASHSEED": "1"}, 1: {"PYTHONHASHSEED": "2"}}, timeout=120))
    return tuple(rank_results(out, 2))
