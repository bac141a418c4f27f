"""``torchrun`` whose workers start with torch, Lightning and lightning_hpp already imported.

``python -m lightning_hpp.torchrun [torchrun options] script.py [script args]`` (or ``lightning-hpp-torchrun``;
``-m package.module`` too) takes torchrun's options and runs torch's own elastic agent: the rendezvous,
``--max-restarts``, the monitoring, ``--log-dir``/``--redirects``/``--tee``. What it changes is how a worker
process starts. torchrun execs ``python script.py`` per worker, so every worker, and every worker of every
restart, imports torch and Lightning again: on a 2-core CPU host 6–7 s of a 7–8 s restart after ``kill -9``
(1.3–1.6 s here; ``benchmarks/checkpoint/RECOVERY.md``). Here the workers are forks of a multiprocessing
*forkserver* that imported those modules (and ``--preload`` ones) once, when the job started; a worker sets
its environment (``RANK``, ``LOCAL_RANK``, ``TORCHELASTIC_*``, ...), then runs the script as ``__main__``
with ``runpy`` (``sys.argv`` and ``sys.path[0]`` as ``python`` sets them). The forkserver outlives the
workers, so a restart after a failed or killed rank costs the agent's detection and rendezvous, a fork and
the script, not the imports.

What a worker shares with its forkserver: the modules it preloaded, imported once with the launcher's
environment. Per-worker state those modules read at import is set again here: Lightning's
``rank_zero_only.rank`` (read from ``RANK`` at import), torch's thread count (``OMP_NUM_THREADS``), the
global NumPy generator (reseeded from the OS, as a fresh process would be); multiprocessing's default start
method is the platform's again, as in a fresh process (the script's DataLoader workers start as they would
under torchrun). A preloaded library that caches other per-process environment variables at import would
see the launcher's values; leave it out of ``--preload`` (the script's own imports always run in the worker).
Preloaded modules are not reloaded between restarts: a change to their files on disk takes effect with the
next launch, the script's with the next restart. Python's string-hash seed is the forkserver's, shared by the
job's workers (with ``PYTHONHASHSEED`` unset, ``python`` would draw one per process).
"""

from __future__ import annotations

import atexit
import importlib.util
import multiprocessing
import os
import runpy
import sys
from collections.abc import Sequence

PRELOAD = ("torch", "torch.distributed", "lightning.pytorch", "lightning_hpp")
"""What the forkserver imports before it forks the first worker (``--preload`` adds more)."""


def _worker(kind: str, target: str, *script_args: str) -> None:
    """A worker: per-worker state of the preloaded modules, then the script or module as ``__main__``."""
    for stream in (sys.stdout, sys.stderr):  # torchrun runs ``python -u``
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    _reset_preloaded_state()
    # starting this process made the forkserver multiprocessing's default here; a fresh ``python`` has the
    # platform's (fork on Linux before Python 3.14). Left so, the script's own processes (DataLoader workers)
    # would start as forkserver children that run the script again as ``__mp_main__``: seconds per worker,
    # and a script without an ``if __name__ == "__main__"`` guard fails
    multiprocessing.set_start_method(None, force=True)
    sys.argv = [target, *script_args]
    try:
        if kind == "module":  # as ``python -m``: the working directory first on the path, argv[0] the module's file
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(target))
            runpy.run_path(target, run_name="__main__")
    finally:
        # a multiprocessing worker ends in os._exit, which skips atexit: run its handlers as an interpreter's
        # exit would (lightning_hpp's finishes a background checkpoint upload and closes the process groups)
        atexit._run_exitfuncs()


def _reset_preloaded_state() -> None:
    """What the preloaded modules read from the launcher's process at import, read again in this worker."""
    if "lightning.fabric" in sys.modules:
        from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

        rank_zero_only.rank = _get_rank() or 0
    if "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        import torch

        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    if "numpy" in sys.modules:
        import numpy

        numpy.random.seed()  # from the OS, as the import of a fresh process does


def _given(argv: Sequence[str], script: str, *names: str) -> bool:
    """Whether a launcher option (one before the script: the rest are the script's) is on the command line."""
    options = argv[: argv.index(script)] if script in argv else argv
    return any(arg.split("=", 1)[0] in names for arg in options)


def main(argv: Sequence[str] | None = None) -> None:
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = torchrun.get_args_parser()
    parser.prog = "lightning-hpp-torchrun"
    parser.add_argument("--preload", action="append", default=[], metavar="MODULES",
                        help="more modules for the forkserver to import before the first worker (comma-separated; "
                             f"always: {', '.join(PRELOAD)})")
    args = parser.parse_args(argv)
    if args.no_python:
        parser.error("--no-python: lightning-hpp-torchrun forks Python workers from a forkserver; run a binary with "
                     "torchrun itself")
    if _given(argv, args.training_script, "--start-method", "--start_method") and args.start_method != "forkserver":
        parser.error(f"--start-method {args.start_method}: lightning-hpp-torchrun starts workers from a preloaded "
                     f"forkserver; for {args.start_method!r} workers use torchrun itself")
    extra = [m.strip() for group in args.preload for m in group.split(",") if m.strip()]
    missing = [m for m in extra if _find_spec(m) is None]
    if missing:
        parser.error(
            f"--preload {','.join(missing)}: no such module here (sys.path {sys.path[:3]}...); name importable "
            f"modules, e.g. --preload transformers"
        )
    script = args.training_script
    kind = "module" if args.module else "path"
    if kind == "path":
        if not os.path.isfile(script):
            parser.error(f"training script {script!r} not found (cwd {os.getcwd()!r})")
        script = os.path.abspath(script)
    multiprocessing.set_forkserver_preload([*PRELOAD, *extra])
    args.start_method = "forkserver"
    config_from_args = torchrun.config_from_args

    def worker_config(parsed):  # torch's own config; the entrypoint is this module's worker
        config, _, _ = config_from_args(parsed)
        return config, _worker, [kind, script, *parsed.training_script_args]

    torchrun.config_from_args = worker_config
    try:
        record(torchrun.run)(args)
    finally:
        torchrun.config_from_args = config_from_args


def _find_spec(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


if __name__ == "__main__":
    main()
