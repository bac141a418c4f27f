"""``python -m lightning_hpp.torchrun``'s refusals (its restarts are in ``test_resume.py``)."""

import json
import subprocess
import sys

import pytest

from lightning_hpp import torchrun
from tests.harness.launch import Job, run_job


@pytest.mark.parametrize(("argv", "said"), [
    (["--no-python", "train.sh"], "--no-python: lightning-hpp-torchrun forks Python workers"),
    (["--start-method", "spawn", "-m", "json.tool"],
     "--start-method spawn: lightning-hpp-torchrun starts workers from a preloaded forkserver"),
    (["--preload", "json,no_such_module_xyz", "-m", "json.tool"], "--preload no_such_module_xyz: no such module here"),
    (["--nproc-per-node", "2", "no/such/train.py"], "training script 'no/such/train.py' not found"),
])
def test_bad_launches_are_refused_before_any_worker_starts(argv, said, capsys):
    with pytest.raises(SystemExit) as exc:
        torchrun.main(argv)
    assert exc.value.code == 2
    assert said in capsys.readouterr().err


def test_a_script_option_named_like_a_launcher_option_is_the_script_s():
    assert not torchrun._given(["--nproc-per-node", "2", "train.py", "--start-method", "x"], "train.py",
                               "--start-method")
    assert torchrun._given(["--start_method=spawn", "train.py"], "train.py", "--start-method", "--start_method")


SCRIPT = '''
import atexit, json, multiprocessing, os, sys
preloaded = "lightning" in sys.modules
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch.utils.data import DataLoader
# DataLoader workers at the top level, without a __main__ guard: fine where they fork, as under torchrun
total = sum(int(b.sum()) for b in DataLoader(torch.arange(64), batch_size=8, num_workers=2))
seen = {"name": __name__, "argv": sys.argv, "path0": sys.path[0], "preloaded": preloaded,
        "rank_zero_only": rank_zero_only.rank, "rank": int(os.environ["RANK"]),
        "start_method": multiprocessing.get_start_method(), "loaded": total}
atexit.register(lambda: open(os.path.join(sys.argv[1], f"rank{seen['rank']}.json"), "w").write(json.dumps(seen)))
'''


def test_workers_run_the_script_as_python_would_with_lightning_imported_and_atexit_run(tmp_path):
    script = tmp_path / "scripts" / "train.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    proc = run_job(Job((sys.executable, "-m", "lightning_hpp.torchrun", "--standalone", "--nproc-per-node", "2"),
                       [str(script.relative_to(tmp_path)), str(out), "--flag"], ranks=2, script=True, cwd=tmp_path,
                       timeout=240), check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # what a fresh interpreter starts processes with (fork on Linux before Python 3.14), not the launcher's forkserver
    fresh = subprocess.run([sys.executable, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    for rank in (0, 1):
        seen = json.loads((out / f"rank{rank}.json").read_text())  # written by the script's atexit handler
        # forkserver DataLoader workers ran this unguarded script again, and failed
        assert seen == {"name": "__main__", "argv": [str(script), str(out), "--flag"], "path0": str(script.parent),
                        "preloaded": True, "rank_zero_only": rank, "rank": rank, "start_method": fresh,
                        "loaded": sum(range(64))}
