"""A job whose ranks meet one fault after another: a rank that hangs, one killed, a storage endpoint that drops.

Usage: python -m tests.workers.run_faults '<json: {"pp": P, "ranks": N, "timeout": S, "out": DIR, "attempts": [...]}>'

Each attempt starts ``N`` rank processes, forked from this process (which imported torch, Lightning and
lightning_hpp once), with the environment Lightning's launcher gives its ranks (``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``; rank 0 hosts the job's store, as under ``Trainer(devices=N)``), each training an
MLP under ``HPPStrategy(pp_degree=P, timeout=S)`` with a checkpoint every 2 steps. One rank meets the attempt's
fault at its step:

* ``{"fault": "stall", "rank": r, "step": k, "where": "batch_end" | "forward"}``: the rank sleeps 600 s (in
  ``on_train_batch_end``, or in its stage's forward of micro-batch 1);
* ``{"fault": "sigstop" | "kill", ...}``: the rank sends itself ``SIGSTOP`` / ``SIGKILL`` there;
* ``{"fault": "s3", "rank": 0}``: the checkpoint directory is on S3 behind an endpoint that accepts
  connections and never answers (packets dropped), with ``resume="auto"``: rank 0 meets it at setup.

This process watches the ranks (``waitpid``) until every one has ended, at most until the fault's time plus
the timeout plus 60 s; then it records, per rank, when it ended (seconds after the fault) and how (exit code or
signal), its output, the processes still alive (killed afterwards, so that the next attempt starts clean), and
every checkpoint directory that claims to be valid (a ``metadata.json``) with whether it verifies.
``DIR/attempt<i>.json`` holds the record.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

import lightning as L
import torch

from lightning_hpp import HPPStrategy, StagePlan
from lightning_hpp.options import CheckpointOptions
from tests.harness.trainer import quiet_trainer
from tests.harness.zoo import MLP, loaders

SLEEP_S = 600.0
LIMIT_S = 60.0  # beyond the timeout, how long the ranks are watched after the fault


class Fault(L.Callback):
    """The attempt's fault on its rank at its step (``fault_at`` written first, with the wall time)."""

    def __init__(self, attempt: dict, out: Path) -> None:
        self.attempt, self.out = attempt, out

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.attempt.get("where") == "forward" and trainer.global_rank == self.attempt["rank"]:
            calls = {"n": 0}
            unit = next(m for m in pl_module.modules() if isinstance(m, torch.nn.Linear))  # one this rank holds

            def hook(module, args):
                if trainer.global_step == self.attempt["step"] and torch.is_grad_enabled():
                    calls["n"] += 1
                    if calls["n"] == 2:  # its forward of micro-batch 1: inside the schedule
                        self.strike()

            unit.register_forward_pre_hook(hook)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (self.attempt.get("where", "batch_end") == "batch_end" and trainer.global_rank == self.attempt["rank"]
                and trainer.global_step == self.attempt["step"]):
            self.strike()

    def strike(self) -> None:
        (self.out / "fault_at").write_text(str(time.time()))
        fault = self.attempt["fault"]
        if fault == "stall":
            time.sleep(SLEEP_S)
        else:
            os.kill(os.getpid(), signal.SIGSTOP if fault == "sigstop" else signal.SIGKILL)


def train(cfg: dict, attempt: dict, out: Path) -> None:
    L.seed_everything(0)
    model = MLP(depth=4)
    train_loader, _ = loaders(8, n=256)
    ckpt = attempt.get("ckpt_dir") or str(out / "ckpt")
    cuts = {2: ["layers.4"], 4: ["layers.2", "layers.4", "layers.6"]}[cfg["pp"]]  # every stage holds a Linear
    strategy = HPPStrategy(plan=StagePlan.split_at(cuts), n_microbatches=4, timeout=cfg["timeout"],
                           checkpoint=CheckpointOptions(dir=ckpt, every_n_steps=2, resume="auto"),
                           placement={"watch": "off"})
    trainer = quiet_trainer(enable_checkpointing=None, devices=cfg["ranks"], strategy=strategy, max_steps=8,
                            limit_val_batches=0, callbacks=[Fault(attempt, out)])
    trainer.fit(model, train_loader)


def _rank_main(cfg: dict, attempt: dict, out: Path, rank: int, port: int, env: dict) -> None:
    """A forked rank: Lightning's child-rank environment, output to files, then :func:`train`; never returns. It stays
    in this process's group, so that a test that kills this job's group kills its ranks too."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(out / f"rank{rank}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack, for a hang
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(cfg["ranks"]),
                       "NODE_RANK": "0", "LOCAL_RANK": str(rank), "PYTHONUNBUFFERED": "1", **env})
    code = 0
    try:
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        rank_zero_only.rank = rank
        train(cfg, attempt, out)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed as an uncaught error would be, then the exit code says it
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


class BlackHole:
    """An S3 endpoint that accepts connections and never answers (what a client sees of dropped packets)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.first: float | None = None
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.first = self.first or time.time()
            self.held.append(conn)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _checkpoints(root: Path) -> list[dict]:
    """Every directory under ``root`` that claims to be a valid checkpoint, and whether it verifies."""
    from lightning_hpp.checkpoint.checksums import verify

    found = []
    for meta in sorted(root.rglob("metadata.json")) if root.exists() else []:
        try:
            verify(str(meta.parent))
            ok = None
        except Exception as exc:  # noqa: BLE001 - reported, the test decides
            ok = f"{type(exc).__name__}: {exc}"
        found.append({"dir": meta.parent.name, "error": ok})
    return found


def run_attempt(cfg: dict, index: int, attempt: dict) -> dict:
    out = Path(cfg["out"]) / f"attempt{index}"
    out.mkdir(parents=True, exist_ok=True)
    env: dict[str, str] = {}
    hole = None
    if attempt["fault"] == "s3":
        hole = BlackHole()
        attempt = {**attempt, "ckpt_dir": "s3://bucket/run"}
        env = {"AWS_ENDPOINT_URL": hole.endpoint, "AWS_ACCESS_KEY_ID": "AKIAFAULTTESTKEY0000",
               "AWS_SECRET_ACCESS_KEY": "fault-test-secret-key-0000", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"}
    port = _free_port()
    started = time.time()
    pids = {}
    for rank in range(cfg["ranks"]):
        pid = os.fork()
        if pid == 0:
            _rank_main(cfg, attempt, out, rank, port, env)
        pids[rank] = pid
    ended: dict[int, tuple[float, str]] = {}
    deadline = started + 180.0
    while len(ended) < len(pids) and time.time() < deadline:
        for rank, pid in pids.items():
            if rank in ended:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
                ended[rank] = (time.time(), how)
        fault_at = _fault_time(out, hole)
        if fault_at is not None:
            deadline = min(deadline, fault_at + cfg["timeout"] + LIMIT_S)
        time.sleep(0.05)
    left = []
    for rank, pid in pids.items():
        if rank not in ended:
            left.append(rank)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    fault_at = _fault_time(out, hole)
    record = {
        "attempt": attempt, "started": started, "fault_at": fault_at, "left": left, "host": socket.gethostname(),
        "pids": pids,
        "ended": {r: {"after_fault_s": round(t - fault_at, 1) if fault_at else None, "how": how}
                  for r, (t, how) in ended.items()},
        "stderr": {r: (out / f"rank{r}.stderr").read_text(errors="replace")[-6000:] for r in pids},
        "checkpoints": _checkpoints(out / "ckpt"),
    }
    (Path(cfg["out"]) / f"attempt{index}.json").write_text(json.dumps(record, indent=1))
    if hole is not None:
        hole.sock.close()
    return record


def _fault_time(out: Path, hole: BlackHole | None) -> float | None:
    if hole is not None:
        return hole.first
    path = out / "fault_at"
    return float(path.read_text()) if path.exists() and path.read_text() else None


def main(cfg: dict) -> None:
    for i, attempt in enumerate(cfg["attempts"]):
        try:
            run_attempt(cfg, i, attempt)
        except Exception:  # noqa: BLE001 - the next attempt still runs; the test finds this one's record missing
            traceback.print_exc()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
