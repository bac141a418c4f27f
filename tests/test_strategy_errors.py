"""Bad input ends real multi-process jobs early with a clear message, and never hangs."""

from __future__ import annotations

import time

import pytest

from lightning_hpp import HPPStrategy, PlanError
from tests.launch import run_script
from tests.workers.run_errors import PLANTED_ENV

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
    from lightning_hpp.options import CheckpointOptions

    with pytest.raises(PlanError, match=r"`HPPStrategy\(checkpoint=...\)` has unknown keys \['every_n_step'\]; `CheckpointOptions` takes"):
        HPPStrategy(checkpoint={"dir": "x", "every_n_step": 5})
    with pytest.raises(PlanError, match=r"`CheckpointOptions\(async_save='false'\)`: must be True or False \(not a str\)"):
        CheckpointOptions(async_save="false")
    with pytest.raises(PlanError, match=r"`CheckpointOptions\(async_save='false'\)`"):  # also as a dict
        HPPStrategy(checkpoint={"dir": "x", "async_save": "false"})
    with pytest.raises(PlanError, match=r"`HPPStrategy\(bias='error'\)`: pass a `BiasOptions\(...\)`"):
        HPPStrategy(bias="error")
    # well-formed sections are taken as instances or as dicts of their fields
    HPPStrategy(checkpoint=CheckpointOptions(dir="x", every_n_steps=5), bias={"audit": "error", "deterministic": False})


BAD_SETUPS = [
    ("too_many_stages", 2, "The plan has 3 stages \\(pp_degree=3\\) but the job has 2 processes"),
    ("pp_not_divisor", 3, "World size 3 is not divisible by pp_degree=2"),
    ("non_sequential", 2, "`forward` is not sequential at unit 'layers.4'"),
    ("int_boundary", 2, "boundary after unit 'layers.3' carries Tensor\\(shape=\\(4, 16\\), dtype=torch.int64\\)"),
    ("batch_not_divisible", 2, "Batch size 10 is not divisible by n_microbatches=4"),
    ("pp_exceeds_world", 2, "`HPPStrategy\\(pp_degree=3\\)` needs at least 3 processes, one per pipeline position, but the job has 2"),
    ("device_map_rank7", 2, "`PlacementOptions\\(device_map='0:cpu,7:cpu'\\)` names rank\\(s\\) \\[7\\], but the job has 2 processes"),
]


@pytest.fixture(scope="module")
def bad_setup_jobs(tmp_path_factory):
    """One job per world size whose ranks try every bad setup of that size in turn, each case in its own
    Trainer (tests/workers/refusals.py): ``launch(devices)`` starts it once and returns (process, out dir)."""
    jobs = {}

    def launch(devices: int):
        if devices not in jobs:
            out = tmp_path_factory.mktemp(f"bad_setups_{devices}")
            cases = [case for case, d, _ in BAD_SETUPS if d == devices]
            proc = run_script("tests.workers.run_cases", {"cases": cases, "devices": devices, "out": str(out)}, check=False,
                              timeout=60 + 60 * len(cases))
            jobs[devices] = proc, out
        return jobs[devices]

    return launch


@pytest.mark.parametrize("case, devices, message", BAD_SETUPS)
def test_bad_setup_fails_before_training_without_hanging(bad_setup_jobs, case, devices, message):
    import re

    from tests.workers import refusals

    proc, out = bad_setup_jobs(devices)
    assert proc.returncode != 0
    # refused on every rank, each with its own error (no rank was left waiting in a collective), before the
    # first optimizer step and well before any timeout
    for record in refusals.read(out / case, devices):
        assert (record["error"] or "").startswith("lightning_hpp.errors."), (record, proc.stderr[-3000:])
        assert re.search(message, record["error"]), record
        assert record["global_step"] == 0
        assert record["seconds"] < 60, record
    assert "Epoch 0" not in proc.stdout


@pytest.mark.parametrize("failing", [0, 1], ids=["rank0-hosts-the-store", "rank1-child"])
def test_the_first_error_ends_every_rank(tmp_path, failing):
    # One rank raises in training_step at step 2 while its peer waits on the pipeline. The peer must
    # end with an error naming that rank and repeating its exception (not gloo's "Connection closed
    # by peer"), long before the 300 s collective timeout.
    import re

    peer = 1 - failing
    start = time.monotonic()
    proc = run_script("tests.workers.run_errors", {"out": str(tmp_path), "raise_rank": failing, "raise_step": 2, "timeout": 300},
                      check=False, timeout=280, env=PLANTED_ENV)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    own = [line for line in proc.stderr.splitlines() if line.startswith(f"[rank{failing}]: ")]
    assert own[-1] == f"[rank{failing}]: RuntimeError: boom on rank {failing} at step 2", proc.stderr[-3000:]
    last = [line for line in proc.stderr.splitlines() if line.startswith(f"[rank{peer}]: ")][-1]
    assert re.match(rf"\[rank{peer}\]: lightning_hpp.errors.RankFailedError: rank {failing} failed first: "
                    rf"RuntimeError: boom on rank {failing} at step 2 \(rank {peer} stopped because", last), proc.stderr[-3000:]
    assert elapsed < 240, f"the job took {elapsed:.0f}s to end"


def test_registered_with_lightning_as_hpp():
    import lightning as L

    trainer = L.Trainer(strategy="hpp", accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, HPPStrategy)
    assert trainer.strategy.schedule == "1f1b" and trainer.strategy.n_microbatches == 4
