"""``python -m lightning_hpp.torchrun``'s refusals (its restarts are in ``test_resume.py``)."""

import pytest

from lightning_hpp import torchrun


@pytest.mark.parametrize(("argv", "said"), [
    (["--no-python", "train.sh"], "--no-python: lightning-hpp-torchrun forks Python workers"),
    (["--start-method", "spawn", "-m", "json.tool"], "--start-method spawn: lightning-hpp-torchrun starts workers from a preloaded forkserver"),
    (["--preload", "json,no_such_module_xyz", "-m", "json.tool"], "--preload no_such_module_xyz: no such module here"),
    (["--nproc-per-node", "2", "no/such/train.py"], "training script 'no/such/train.py' not found"),
])
def test_bad_launches_are_refused_before_any_worker_starts(argv, said, capsys):
    with pytest.raises(SystemExit) as exc:
        torchrun.main(argv)
    assert exc.value.code == 2
    assert said in capsys.readouterr().err


def test_a_script_option_named_like_a_launcher_option_is_the_script_s():
    assert not torchrun._given(["--nproc-per-node", "2", "train.py", "--start-method", "x"], "train.py", "--start-method")
    assert torchrun._given(["--start_method=spawn", "train.py"], "train.py", "--start-method", "--start_method")
