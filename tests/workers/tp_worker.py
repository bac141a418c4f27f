"""One rank of the tensor-parallel test (2 gloo ranks, one ``tp`` mesh of both): a tiny Llama split by its own
plan, three ways, and what this rank saw. Writes ``OUT/rank{r}.json`` and, for rank 0, ``OUT/<case>.pt``.

* ``eager``: the user's modules split in place (:func:`apply_tensor_parallel` on the LightningModule), trained
  with AdamW on the same batches as the one-process reference;
* ``traced``: the model captured at its local width (:func:`at_local_width`) as one traced stage (in training
  and in eval mode), both captures split, trained alike, then the eval capture run on the first batch;
* ``meta_weights`` / ``meta_init``: the Llama built on the meta device, split (meta shards), then
  materialized: its shards read from a sharded ``save_pretrained`` directory (the bytes each rank reads
  counted by wrapping ``safetensors.safe_open``), or drawn by the modules' own initializers.

Usage (RANK, WORLD_SIZE, MASTER_ADDR/PORT set): python tests/workers/tp_worker.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import safetensors
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_hpp.model.frontend import cut_model
from lightning_hpp.model.materialize import init_on_meta, materialize_stages
from lightning_hpp.model.units import find_units
from lightning_hpp.pipeline.stage import StageModule
from lightning_hpp.pipeline.tensor_parallel import apply_tensor_parallel, at_local_width, local_numel, resolve_tp_plan
from lightning_hpp.planning.plan import StagePlan, StageSpec
from tests.harness.zoo.real import LMWrapper, dataset

STEPS, LR = 3, 1e-3


def batches():
    ids, mask, labels = dataset("llama", 8).tensors
    return [(ids[i:i + 4], mask[i:i + 4], labels[i:i + 4]) for i in (0, 4, 0)][:STEPS]


def train(model, forward) -> list[float]:
    """AdamW steps of the token-mean cross entropy (the reference runs the same in one process)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids, mask, labels in batches():
        logits = forward(ids, mask)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v,
                                              DTensor) else v).detach().clone() for k, v in model.state_dict().items()}


def shard_report(model) -> dict:
    """Per parameter: local shape, and the dimension it is split on (``None``: whole on this rank)."""
    from torch.distributed.tensor import DTensor

    return {n: {"local": list(p.to_local().shape) if isinstance(p, DTensor) else list(p.shape),
                "dim": next((pl.dim for pl in p.placements if pl.is_shard()), None) if isinstance(p, DTensor) else None}
            for n, p in model.named_parameters()}


class CountingOpen:
    """``safetensors.safe_open`` that counts the bytes of what is read through it (whole tensors and slices)."""

    def __init__(self, real) -> None:
        self.real, self.read = real, 0

    def __call__(self, *args, **kwargs):
        outer = self

        class Handle:
            def __init__(self, inner):
                self.inner = inner

            def __enter__(self):
                self.handle = self.inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def keys(self):
                return self.handle.keys()

            def get_tensor(self, name):
                t = self.handle.get_tensor(name)
                outer.read += t.numel() * t.element_size()
                return t

            def get_slice(self, name):
                sl = self.handle.get_slice(name)

                class Slice:
                    def get_shape(self):
                        return sl.get_shape()

                    def __getitem__(self, index):
                        t = sl[index]
                        outer.read += t.numel() * t.element_size()
                        return t

                return Slice()

        return Handle(self.real(*args, **kwargs))


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", torch.arange(dist.get_world_size()), mesh_dim_names=("tp",))
    cfg = json.loads((out / "cases.json").read_text())
    report: dict = {}

    # eager: the user's own modules split in place
    torch.manual_seed(0)
    model = LMWrapper("llama", layers=2)
    plan = resolve_tp_plan(model, 2)
    split = apply_tensor_parallel(model, mesh, plan.styles)
    losses = train(model, lambda ids, mask: model(ids, attention_mask=mask))
    report["eager"] = {"losses": losses, "split": split, "shards": shard_report(model)}
    state = full_state(model)
    if rank == 0:
        torch.save(state, out / "eager.pt")

    # traced: captured at its local width as one stage, the stage split
    torch.manual_seed(0)
    model = LMWrapper("llama", layers=2)
    plan = resolve_tp_plan(model, 2)
    ids, mask, _ = batches()[0]
    one_stage = StagePlan([StageSpec(modules=[n for n, _ in find_units(model)])])
    with at_local_width(model, plan, 2):
        cut = cut_model(model, one_stage, ((ids,), {"attention_mask": mask}), frontend="traced",
                        modes=("train", "eval"))
    stage, evaluate = (StageModule(cut.plan.stages[0].modules, cut.bodies[mode][0], 0, spread=cut.spread[0],
                                   captured=True)
                       for mode in ("train", "eval"))
    split = apply_tensor_parallel(stage, mesh, plan.styles, kinds=plan.kinds)
    assert evaluate.units[0] is not stage.units[0]  # captured apart, on the same parameters
    apply_tensor_parallel(evaluate, mesh, plan.styles, kinds=plan.kinds)
    losses = train(model, lambda ids, mask: cut.unflatten(stage(*cut.flatten((ids,), {"attention_mask": mask}))))
    report["traced"] = {"losses": losses, "split": split, "frontend": cut.frontend, "shards": shard_report(model)}
    state = full_state(model)
    with torch.no_grad():
        state["eval_logits"] = cut.unflatten(evaluate(*cut.flatten((ids,), {"attention_mask": mask}))).clone()
    if rank == 0:
        torch.save(state, out / "traced.pt")

    # meta: split on the meta device, then each rank materializes its shards (read from disk, or initialized)
    for case in ("meta_weights", "meta_init"):
        with init_on_meta():
            model = LMWrapper("llama", in_configure_model=True, layers=cfg["meta_layers"])
            model.configure_model()
        plan = resolve_tp_plan(model, 2)
        apply_tensor_parallel(model, mesh, plan.styles)
        counting = CountingOpen(safetensors.safe_open)
        safetensors.safe_open = counting
        try:
            weights = cfg["weights"] if case == "meta_weights" else None
            n = materialize_stages(model, torch.device("cpu"), seed=0, weights=weights,
                                   rename="model." if weights else None)
        finally:
            safetensors.safe_open = counting.real
        unique = {id(p): p for p in model.parameters()}.values()
        report[case] = {"materialized": n, "read_bytes": counting.read, "shards": shard_report(model),
                        "local_bytes": sum(local_numel(p) * p.element_size() for p in unique),
                        "meta_left": [name for name, p in model.named_parameters() if p.is_meta]}
        from torch.distributed.tensor import DTensor

        local = {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
                 for k, v in model.state_dict().items()}
        torch.save(local, out / f"{case}.rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
