"""Lightning behaviours HPPStrategy does not keep today, compared the way tests/conformance/test_conformance.py
compares the ones it keeps (same jobs, same tolerances).

Each test is a strict xfail: it documents the failure without failing the suite, and turns red (XPASS) once the
behaviour is kept; then move it to test_conformance.py. ``pytest -rx tests/conformance/test_pending.py`` shows
the first lines of each failure; ``--runxfail`` the whole report.
"""

from __future__ import annotations

import pytest

from tests.conformance.compare import diff_all, diff_resumed, load, report

pytestmark = pytest.mark.slow


def check(problems: list[str]) -> None:
    assert not problems, report(problems)


@pytest.mark.xfail(strict=True, reason="epoch-end hooks see no step outputs on ranks without the last stage: "
                                       "their mean is nan, and sync_dist=True spreads it to every rank (epoch 0 "
                                       "also counts what the setup check's run of training_step appended)")
def test_epoch_end_hooks_log_what_the_steps_collected(conformance):
    # training_step / validation_step append per-sample losses; on_*_epoch_end logs their mean (sync_dist=True)
    check(diff_all(load(conformance, "epoch_end_outputs")))


@pytest.mark.xfail(strict=True, reason="a torchmetrics Metric logged with self.log(name, metric) is replayed as the "
                                       "mean of its micro-batch values: not compute() over the epoch, not synced over "
                                       "the replicas, never reset (macro accuracy, a sum)")
def test_torchmetrics_objects_logged_by_name(conformance):
    check(diff_all(load(conformance, "torchmetrics_logged")))


@pytest.mark.xfail(strict=True, reason="resumed from the checkpoint saved when max_steps stopped epoch 0 after 5 of "
                                       "its 12 batches, the run draws epoch 1's order (batches 5-9) while Lightning "
                                       "counts epoch 0")
def test_resume_from_a_max_steps_checkpoint(conformance):
    # Lightning's own resume from this checkpoint also leaves the uninterrupted run (it restarts with epoch 1's
    # order from its first batch: ref["lightning_resumed"]); HPPStrategy promises the uninterrupted run
    check(diff_resumed(load(conformance, "resume_max_steps")))
