"""Bad input ends real multi-process jobs early with a clear message, and never hangs."""

from __future__ import annotations

import pytest

from lightning_hpp import HPPStrategy, PlanError
from tests.harness.launch import Job, run_jobs
from tests.harness.trainer import quiet_trainer
from tests.workers import refusals
from tests.workers.run_errors import PLANTED_ENV, PLANTED_HPARAMS

pytestmark = pytest.mark.slow


def test_constructor_rejects_unknown_schedule_and_bad_microbatches():
    with pytest.raises(PlanError, match="schedule='pipedream'\\)` is unknown. Valid schedules: gpipe, 1f1b"):
        HPPStrategy(schedule="pipedream")
    with pytest.raises(PlanError, match="n_microbatches=0\\)`: must be a positive integer"):
        HPPStrategy(n_microbatches=0)
    with pytest.raises(PlanError, match="must be None .*got int"):
        HPPStrategy(plan=3)


@pytest.mark.parametrize("old, value, home", [
    ("checkpoint_dir", "x", "checkpoint=CheckpointOptions(dir=...)"),
    ("save_every_n_steps", 5, "checkpoint=CheckpointOptions(every_n_steps=...)"),
    ("save_on_error", "warn", "checkpoint=CheckpointOptions(on_error=...)"),
    ("resume", "auto", "checkpoint=CheckpointOptions(resume=...)"),
    ("deterministic", True, "bias=BiasOptions(deterministic=...)"),
    ("auto_profile", "p.json", "placement=PlacementOptions(profile=...)"),
    ("fp8_backend", "emulate", "HPPPrecision(fp8_backend=...)"),
])
def test_old_flat_options_name_their_new_home(old, value, home):
    import re

    with pytest.raises(PlanError, match=f"unexpected keyword argument '{old}'. It moved: .*{re.escape(home)}"):
        HPPStrategy(**{old: value})


def test_option_sections_refuse_unknown_keys_and_wrong_types():
    from lightning_hpp.errors import BiasConfigError, CheckpointError
    from lightning_hpp.options import CheckpointOptions

    with pytest.raises(CheckpointError,
                       match=r"`HPPStrategy\(checkpoint=...\)` has unknown keys \['every_n_step'\]; "
                             r"`CheckpointOptions` takes"):
        HPPStrategy(checkpoint={"dir": "x", "every_n_step": 5})
    with pytest.raises(CheckpointError,
                       match=r"`CheckpointOptions\(async_save='false'\)`: must be True or False \(not a str\)"):
        CheckpointOptions(async_save="false")
    with pytest.raises(CheckpointError, match=r"`CheckpointOptions\(async_save='false'\)`"):  # also as a dict
        HPPStrategy(checkpoint={"dir": "x", "async_save": "false"})
    with pytest.raises(BiasConfigError, match=r"`HPPStrategy\(bias='error'\)`: pass a `BiasOptions\(...\)`"):
        HPPStrategy(bias="error")
    # well-formed sections are taken as instances or as dicts of their fields
    HPPStrategy(checkpoint=CheckpointOptions(dir="x", every_n_steps=5), bias={"audit": "error", "deterministic": False})


BAD_SETUPS = [
    ("too_many_stages", 2, "The plan has 3 stages \\(pp_degree=3\\) but the job has 2 processes"),
    ("pp_not_divisor", 3, "World size 3 is not divisible by pp_degree=2"),
    ("non_sequential", 2, "`forward` is not sequential at unit 'layers.4'"),
    ("int_boundary", 2, "boundary after unit 'layers.3' carries Tensor\\(shape=\\(4, 16\\), dtype=torch.int64\\)"),
    ("batch_not_divisible", 2, "Batch size 10 is not divisible by n_microbatches=4"),
    ("pp_exceeds_world", 2,
     "`HPPStrategy\\(pp_degree=3\\)` needs at least 3 processes, one per pipeline position, but the job has 2"),
    ("device_map_rank7", 2,
     "`PlacementOptions\\(device_map='0:cpu,7:cpu'\\)` names rank\\(s\\) \\[7\\], but the job has 2 processes"),
]


@pytest.fixture(scope="module")
def bad_setup_jobs(tmp_path_factory):
    """One job per world size (2 and 3, side by side: they share nothing) whose ranks try every bad setup of
    that size in turn, each case in its own Trainer (tests/workers/refusals.py). {devices: (process, out dir)}."""
    sizes = sorted({d for _, d, _ in BAD_SETUPS})
    outs = {d: tmp_path_factory.mktemp(f"bad_setups_{d}") for d in sizes}
    jobs = [Job("tests.workers.run_cases", {"cases": [c for c, n, _ in BAD_SETUPS if n == d], "devices": d,
                                            "out": str(outs[d]), "timeout": refusals.COLLECTIVE_TIMEOUT_S},
                ranks=d, start="forked", timeout=600) for d in sizes]
    procs = run_jobs(jobs, check=False)
    return {d: (proc, outs[d]) for d, proc in zip(sizes, procs)}


@pytest.mark.parametrize("case, devices, message", BAD_SETUPS)
def test_bad_setup_fails_before_training_without_hanging(bad_setup_jobs, case, devices, message):
    import re

    proc, out = bad_setup_jobs[devices]
    assert proc.returncode != 0
    # refused on every rank, each with its own error (no rank was left waiting in a collective), before the
    # first optimizer step and far below the collective timeout
    for record in refusals.read(out / case, devices):
        assert (record["error"] or "").startswith("lightning_hpp.errors."), (record, proc.stderr[-3000:])
        assert re.search(message, record["error"]), record
        assert record["global_step"] == 0
        assert record["seconds"] < refusals.BOUND_S, record
    assert "Epoch 0" not in proc.stdout


@pytest.fixture(scope="module")
def first_error_jobs(tmp_path_factory):
    """The two jobs of test_the_first_error_ends_every_rank, side by side (they share nothing): rank 0, then
    rank 1, raises at step 2. {failing rank: finished process}."""
    outs = [tmp_path_factory.mktemp(f"first_error_{r}") for r in (0, 1)]
    jobs = [Job("tests.workers.run_errors", {"out": str(outs[r]), "raise_rank": r, "raise_step": 2, "timeout": 300},
                ranks=2, env=PLANTED_ENV, timeout=280) for r in (0, 1)]
    done = dict(enumerate(run_jobs(jobs, check=False)))
    for r, proc in done.items():
        proc.out = outs[r]
    return done


@pytest.mark.parametrize("failing", [0, 1], ids=["rank0-hosts-the-store", "rank1-child"])
def test_the_first_error_ends_every_rank(first_error_jobs, failing):
    # One rank raises in training_step at step 2 while its peer waits on the pipeline. The peer must
    # end with an error naming that rank and repeating its exception (not gloo's "Connection closed
    # by peer"), long before the 300 s collective timeout.
    import re

    peer = 1 - failing
    proc = first_error_jobs[failing]
    elapsed = proc.seconds
    assert proc.returncode != 0
    own = [line for line in proc.stderr.splitlines() if line.startswith(f"[rank{failing}]: ")]
    assert own[-1] == f"[rank{failing}]: RuntimeError: boom on rank {failing} at step 2", proc.stderr[-3000:]
    last = [line for line in proc.stderr.splitlines() if line.startswith(f"[rank{peer}]: ")][-1]
    assert re.match(rf"\[rank{peer}\]: lightning_hpp.errors.RankFailedError: rank {failing} failed first: "
                    rf"RuntimeError: boom on rank {failing} at step 2 \(rank {peer} stopped because",
                    last), proc.stderr[-3000:]
    assert elapsed < 240, f"the job took {elapsed:.0f}s to end"


def test_a_run_that_raises_leaks_no_secret(first_error_jobs):
    # the planted AWS keys (environment) and hyperparameters (token, password, storage options) reach no
    # logger file and no line of the failing job's output: tracebacks and the first error included
    secrets = [*PLANTED_ENV.values(), *PLANTED_HPARAMS.values()]
    for failing, proc in first_error_jobs.items():
        assert proc.returncode != 0 and "RankFailedError" in proc.stderr
        files = [p for p in proc.out.rglob("*") if p.is_file()]
        assert files  # the loggers wrote before the error
        leaks = [f"{p} holds {s!r}" for p in files for s in secrets if s.encode() in p.read_bytes()]
        leaks += [f"output holds {s!r}" for s in secrets if s in proc.stdout + proc.stderr]
        assert not leaks, (failing, leaks)


def test_registered_with_lightning_as_hpp():

    trainer = quiet_trainer(enable_model_summary=None, enable_checkpointing=None, strategy="hpp", devices=2)
    assert isinstance(trainer.strategy, HPPStrategy)
    assert trainer.strategy.schedule == "1f1b" and trainer.strategy.n_microbatches == 4
