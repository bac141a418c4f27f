"""Rank of a 2-rank job saving FSDP2-sharded stages (DTensor parameters and Adam state) and
loading them under other layouts, through the functions the strategy uses.

Argument: OUT_DIR holding config.json {"root": ROOT, "s3_root": S3_URL (optional)}. The model is ``common.TinyNet`` with
``fully_shard`` on each unit and on the whole (a 2-rank ``dp_shard`` mesh); every rank trains on
the same batches, so the replicated BatchNorm buffers stay equal. Steps, in one job:

1. train 2 AdamW steps, save ``ROOT/step-2`` (synchronous); train a 3rd, save ``ROOT/step-3``
   asynchronously and train a 4th step at once (the save must hold the step-3 state);
2. load step-3 into a fresh FSDP2 model: its local shards equal the saved ones, and one more step
   from it equals the 4th step of the original run (exact resume);
3. load step-3 into a tensor-parallel layout (colwise / rowwise DTensors over the same 2 ranks) and
   into a plain model held whole by both ranks (the data-parallel layout); with ``s3_root``, save the
   step-4 state there and load it into the tensor-parallel layout;
4. rank 0 flips a byte of rank 1's shard file of step-3: both ranks resume ``resume="auto"`` on
   fresh FSDP2 models and must fall back to step-2 together.

Gathers of DTensors (``all_gather_tensor``) are counted while saving and loading sharded stages.
Writes OUT_DIR/rank<r>.json, and OUT_DIR/full-step<N>.pt (rank 0: the whole state at step N, for
the test's one-process load).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_hpp.checkpoint import checkpoint_url, save_sharded, wait_for_pending_save
from lightning_hpp.checkpoint.lightning_state import load_lightning_checkpoint, to_sharded
from lightning_hpp.checkpoint.resume import PendingResume, select_and_load
from lightning_hpp.checkpoint.warning import CheckpointWarning
from tests.ckpt_workers.common import UNITS, TinyNet
from tests.ckpt_workers.damage import _flip

GATHERS = [0]


def count_gathers() -> None:
    """Count every gather of a DTensor's shards (DTensor redistributions call one of these)."""
    for name in ("all_gather_tensor", "all_gather_single"):
        gather = getattr(funcol, name)

        def counting(*args, _gather=gather, **kwargs):
            GATHERS[0] += 1
            return _gather(*args, **kwargs)

        setattr(funcol, name, counting)


class Net(TinyNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head(self.norm(h))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    x, y = batch(step)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def fsdp_model(mesh, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    for name in UNITS:
        if name != "norm":
            fully_shard(model.get_submodule(name), mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def tp_model(mesh, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    plan = {"embed": ColwiseParallel(), "blocks.0": RowwiseParallel(), "blocks.1": ColwiseParallel(),
            "blocks.2": RowwiseParallel()}
    parallelize_module(model, mesh, plan)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def plain_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def lightning_dict(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    """What Lightning's ``dump_checkpoint`` hands the strategy, reduced to what the test needs."""
    return {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "lr_schedulers": [],
            "global_step": step, "epoch": 0, "loops": {"fit_loop": {"step": step}}}


def save(model: nn.Module, opt: torch.optim.Optimizer, root: str, step: int, *, async_save: bool = False):
    rank = dist.get_rank()
    state = to_sharded(lightning_dict(model, opt, step), model, [opt], global_rank=rank, position=0, replica=rank)
    return save_sharded(state, checkpoint_url(root, step), step=step, extra_metadata={"plan": {"layout": "fsdp2"}},
                        async_save=async_save)


def restore(url: str, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    ckpt = load_lightning_checkpoint(url, model, [opt], global_rank=dist.get_rank(), position=0)
    model.load_state_dict(ckpt["state_dict"])
    opt.load_state_dict(ckpt["optimizer_states"][0])
    return ckpt


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The whole state, gathered for comparison only (never by the code under test)."""
    names = {id(p): n for n, p in model.named_parameters()}
    optim = {names[id(p)]: {k: full(v) for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]}
    return {"model": {k: full(v) for k, v in model.state_dict().items()}, "optim": optim}


def local_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """This rank's own shards (the local tensors of DTensors)."""
    loc = lambda t: (t.to_local() if isinstance(t, DTensor) else t).detach().clone()  # noqa: E731
    names = {id(p): n for n, p in model.named_parameters()}
    optim = {names[id(p)]: {k: loc(v) for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]}
    return {"model": {k: loc(v) for k, v in model.state_dict().items()}, "optim": optim}


def differences(got: dict, expected: dict) -> list[str]:
    problems = []
    for part in ("model", "optim"):
        if set(got[part]) != set(expected[part]):
            problems.append(f"{part} keys {sorted(set(got[part]) ^ set(expected[part]))}")
        for name in set(got[part]) & set(expected[part]):
            a, b = got[part][name], expected[part][name]
            pairs = [(name, a, b)] if part == "model" else [(f"{name}.{k}", a.get(k), b[k]) for k in b]
            for what, x, y in pairs:
                if x is None or x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                    problems.append(f"{part} {what}")
    return problems


def main() -> None:
    out = Path(sys.argv[1])
    config = json.loads((out / "config.json").read_text())
    root = config["root"]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    count_gathers()
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    result: dict = {"rank": rank}

    # 1. train, save synchronously at step 2 and asynchronously at step 3
    model, opt = fsdp_model(mesh, seed=0)
    losses = [train_step(model, opt, s) for s in (1, 2)]
    GATHERS[0] = 0
    save(model, opt, root, 2)
    result["save_gathers"] = GATHERS[0]
    ref2 = full_state(model, opt)
    result["control_gathers"] = GATHERS[0]  # the counter sees the gathers of the comparison itself
    losses.append(train_step(model, opt, 3))
    ref3, local3 = full_state(model, opt), local_state(model, opt)
    GATHERS[0] = 0
    pending = save(model, opt, root, 3, async_save=True)
    losses.append(train_step(model, opt, 4))  # changes the weights while the save is written
    info = pending.result()
    result["save_gathers"] += GATHERS[0]
    result["async_step"] = info.step
    result["shards"] = info.metadata["shards"]
    result["losses"] = losses
    if rank == 0:
        torch.save({"step2": ref2, "step3": ref3}, out / "full-state.pt")

    # 2. the same layout: exact shards, exact next step
    GATHERS[0] = 0
    model2, opt2 = fsdp_model(mesh, seed=1)
    ckpt = restore(checkpoint_url(root, 3), model2, opt2)
    result["load_gathers"] = GATHERS[0]
    result["same_layout"] = differences(local_state(model2, opt2), local3)
    result["global_step"] = ckpt["global_step"]
    result["resumed_loss"] = train_step(model2, opt2, 4)
    result["resumed_step"] = differences(local_state(model2, opt2), local_state(model, opt))

    # 3. other layouts: tensor parallel, and the whole model on each rank
    model3, opt3 = tp_model(mesh, seed=2)
    restore(checkpoint_url(root, 3), model3, opt3)
    result["tp_placements"] = sorted({str(p.placements) for p in model3.parameters() if isinstance(p, DTensor)})
    result["tp"] = differences(full_state(model3, opt3), ref3)
    model4, opt4 = plain_model(seed=3)
    restore(checkpoint_url(root, 3), model4, opt4)
    result["replicated"] = differences(full_state(model4, opt4), ref3)

    # S3: the step-4 state through the S3 store, loaded from there into the tensor-parallel layout
    if config.get("s3_root"):
        ref4 = full_state(model, opt)
        save(model, opt, config["s3_root"], 4)
        model6, opt6 = tp_model(mesh, seed=5)
        restore(checkpoint_url(config["s3_root"], 4), model6, opt6)
        result["s3_tp"] = differences(full_state(model6, opt6), ref4)

    # 4. a damaged shard of rank 1: both ranks fall back to step-2 together
    dist.barrier()
    if rank == 0:
        _flip(Path(root) / "step-3" / "__1_0.distcp", 40)
    dist.barrier()
    model5, opt5 = fsdp_model(mesh, seed=4)
    request = PendingResume(root, roots=[root], what="resume='auto'")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        chosen = select_and_load(request, lambda url: restore(url, model5, opt5))
    result["fallback_url"] = chosen.url
    result["fallback_warnings"] = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    result["fallback"] = differences(full_state(model5, opt5), ref2)

    wait_for_pending_save()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
