"""What only a GPU shows of the cluster paths (run by scripts/gpu_check.sh; skipped without CUDA).

* the fp8 verdict from a real device's report (compute capability, Transformer Engine) beside a simulated A100;
* NCCL's abort of every communicator after the job's first error, and the process ending at once;
* ``fit`` then ``test`` on one Trainer: the stages on the GPU at the second entry point (Lightning's teardown
  moved them to the CPU);
* the start-up broadcast holding one bucket on the GPU at a time, measured by CUDA's allocator;
* CUDA-event timing of asynchronous kernels, where the host clock times their launch.

A peer blocked in an NCCL kernel while another rank aborts, and the link calibration over NVLink or a network,
need two GPUs: they are not here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _run(code: str, timeout: float = 120) -> dict:
    """``code`` in a fresh process (its own NCCL world of one rank); it prints one JSON line last."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_NCCL_WORLD = """
    import datetime, json, os, time, torch, torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30),
                            device_id=torch.device("cuda", 0))
    from lightning_hpp import _dist
    _dist.set_timeout(datetime.timedelta(seconds=30))
"""


def test_the_fp8_verdict_takes_the_real_devices_report_beside_a_simulated_a100():
    from lightning_hpp.precision import fp8
    from lightning_hpp.precision.fp8_verdict import decide, local_capability

    real = local_capability(1, "h100", torch.device("cuda", 0), {})
    assert not real.simulated and real.capability == torch.cuda.get_device_capability(0)
    ok, reason = fp8.fp8_capable(torch.device("cuda", 0))
    assert real.runs_te == ok and real.reason == reason
    a100 = local_capability(0, "a100", torch.device("cpu"), {"HPP_SIMULATED_DEVICES": '{"a100": {}}'})
    if ok:  # an H100/H200 with Transformer Engine: the stage it holds runs TE itself, not the stand-in
        verdict = decide([1], {0: [0], 1: [1]}, [a100, real], None, "delayed")[1]
        assert (verdict.backend, verdict.run_as) == ("te", "te")
        assert verdict.label.startswith("fp8 (Transformer Engine ")
    else:
        with pytest.raises(Exception, match="Stage 1 has precision 'fp8' but runs on device 'cuda'"):
            decide([1], {0: [0], 1: [1]}, [a100, real], None, "delayed")


def test_the_first_error_aborts_the_nccl_communicators_and_the_process_ends():
    out = _run(_NCCL_WORLD + """
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    what = _dist.abort_groups()
    print(json.dumps({"what": what, "initialized": dist.is_initialized(), "seconds": time.monotonic() - t0}))
    """, timeout=60)
    assert out["what"] == "nccl: every communicator aborted" and not out["initialized"], out
    assert out["seconds"] < 10, out


def test_the_stages_are_on_the_gpu_at_the_second_entry_point():
    out = _run("""
    import json, lightning as L, torch
    from lightning_hpp import HPPStrategy
    from tests.harness.trainer import quiet_trainer
    from tests.harness.zoo import MLP, loaders

    seen = {}

    class Model(MLP):
        def on_test_start(self):
            seen["test"] = sorted({str(p.device) for p in self.parameters()})

    model = Model()
    trainer = quiet_trainer(accelerator="gpu", devices=1, strategy=HPPStrategy(n_microbatches=2), max_steps=2,
                            limit_val_batches=0, limit_test_batches=1)
    train, _ = loaders(8)
    trainer.fit(model, train)
    seen["after_fit"] = sorted({str(p.device) for p in model.parameters()})  # Lightning's teardown: the CPU
    trainer.test(model, train, verbose=False)
    print(json.dumps(seen))
    """, timeout=300)
    assert out["after_fit"] == ["cpu"] and out["test"] == ["cuda:0"], out


def test_the_startup_broadcast_holds_one_bucket_on_the_gpu_at_a_time():
    out = _run(_NCCL_WORLD + """
    tensors = [torch.randn(8 << 20) for _ in range(16)]  # 16 x 32 MB on the host: 512 MB
    copies = [t.clone() for t in tensors]
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _dist.broadcast_in_buckets(tensors, 0, None, bucket_bytes=64 << 20)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    same = all(torch.equal(a, b) for a, b in zip(tensors, copies))
    print(json.dumps({"peak": peak, "same": same}))
    """, timeout=120)
    assert out["same"], out
    assert out["peak"] <= (64 << 20) + (8 << 20), out  # one 64 MB bucket (and the allocator's rounding), not 512 MB


def test_cuda_events_time_the_kernels_where_the_host_clock_times_their_launch():
    from lightning_hpp._timing import device_clock

    a = torch.randn(8192, 8192, device="cuda")
    a @ a  # cuBLAS's set-up, on the host, is not what is timed
    torch.cuda.synchronize()

    def work() -> None:
        for _ in range(20):
            a @ a

    clock = device_clock("cuda")
    host0 = time.perf_counter()
    t0 = clock.mark()
    work()
    t1 = clock.mark()
    host_launch = time.perf_counter() - host0  # what a host clock around the launches sees
    events_s = clock.elapsed_ns([(t0, t1)]) / 1e9
    torch.cuda.synchronize()
    wall = time.perf_counter() - host0
    assert events_s > 5 * host_launch, (events_s, host_launch)
    assert 0.8 * wall <= events_s <= 1.05 * wall, (events_s, wall)
