"""Checkpoint I/O throughput: save, load and verify to local disk and to an S3 server.

Measures ``save_sharded`` / ``load_sharded`` / ``verify`` (sha256 of every file) for a float32
state of ``--mparams`` million parameters in one process, and the training stall of an
asynchronous save (time until ``save_sharded(..., async_save=True)`` returns) next to the
synchronous one. S3 is moto's standalone server started on loopback in its own process, reached
through s3fs exactly as a real endpoint would be (``AWS_ENDPOINT_URL``), so its figures measure
this package plus s3fs plus a Python S3 server, not AWS.

    python benchmarks/checkpoint/bench_io.py --mparams 100 --repeats 3

Prints a markdown table of medians over ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable

import torch

from lightning_hpp.checkpoint import checkpoint_url, load_sharded, save_sharded, verify
from lightning_hpp.checkpoint.commit import delete_checkpoint


def make_state(mparams: int) -> dict:
    """``mparams`` million float32 parameters in 4M-element tensors, like a stack of layers."""
    n_tensors = max(1, round(mparams / 4))
    per = mparams * 1_000_000 // n_tensors
    gen = torch.Generator().manual_seed(0)
    return {"model": {f"layers.{i}.weight": torch.randn(per, generator=gen) for i in range(n_tensors)}}


def _median(fn: Callable[[int], float], repeats: int) -> float:
    return statistics.median(fn(i) for i in range(repeats))


def bench_target(name: str, root: str, state: dict, repeats: int) -> list[tuple[str, str, float, float]]:
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    template = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    rows = []

    def save(i: int) -> float:
        url = checkpoint_url(root, i)
        start = time.perf_counter()
        save_sharded(state, url, step=i)
        return time.perf_counter() - start

    def load(i: int) -> float:
        start = time.perf_counter()
        load_sharded(checkpoint_url(root, i), template)
        return time.perf_counter() - start

    def check(i: int) -> float:
        start = time.perf_counter()
        verify(checkpoint_url(root, i))
        return time.perf_counter() - start

    def async_stall(i: int) -> float:
        url = checkpoint_url(root, 100 + i)
        start = time.perf_counter()
        pending = save_sharded(state, url, step=100 + i, async_save=True)
        stall = time.perf_counter() - start
        pending.result()
        return stall

    t_save = _median(save, repeats)
    t_load = _median(load, repeats)
    assert all(torch.equal(template["model"][k], v) for k, v in state["model"].items())
    t_verify = _median(check, repeats)
    t_async = _median(async_stall, repeats)
    for i in [*range(repeats), *range(100, 100 + repeats)]:
        delete_checkpoint(checkpoint_url(root, i))
    rows.append((name, "save (sync)", t_save, nbytes / t_save / 1e6))
    rows.append((name, "load", t_load, nbytes / t_load / 1e6))
    rows.append((name, "verify (sha256)", t_verify, nbytes / t_verify / 1e6))
    rows.append((name, "async save: training stall", t_async, float("nan")))
    return rows


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    return proc, endpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mparams", type=int, default=100, help="millions of float32 parameters")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="local directory (default: a temporary one)")
    parser.add_argument("--no-s3", action="store_true")
    args = parser.parse_args()

    state = make_state(args.mparams)
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    local = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)
    rows = bench_target("local disk", local, state, args.repeats)
    shutil.rmtree(local, ignore_errors=True)

    if not args.no_s3:
        import boto3

        proc, endpoint = start_moto()
        try:
            os.environ.update(
                AWS_ENDPOINT_URL=endpoint,
                AWS_ACCESS_KEY_ID="AKIAIOSFODNN7EXAMPLE",
                AWS_SECRET_ACCESS_KEY="bench-not-a-secret",
                AWS_DEFAULT_REGION="us-east-1",
            )
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
            rows += bench_target("S3 (moto, loopback)", "s3://bench/run", state, args.repeats)
        finally:
            proc.terminate()
            proc.wait()

    print(f"state: {args.mparams}M float32 parameters = {nbytes / 1e6:.0f} MB in {len(state['model'])} tensors; "
          f"medians of {args.repeats}; torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.machine()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print()
    print("| target | operation | median time (s) | throughput (MB/s) |")
    print("|---|---|---:|---:|")
    for target, op, seconds, mbps in rows:
        print(f"| {target} | {op} | {seconds:.2f} | {'' if mbps != mbps else f'{mbps:.0f}'} |")


if __name__ == "__main__":
    main()
