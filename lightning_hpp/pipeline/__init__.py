"""Running micro-batches through stages with ``torch.distributed.pipelining``.

``schedules``: torch's schedules by name and the checks a plan must pass for one; ``stage``: one
stage of the sequential frontend; ``steps``: the user's Lightning step captured and replayed around
the pipeline; ``runner``: this rank's stages driven through a schedule; ``microbatch``: splitting
batches; ``dims``: the parallel degrees and their arithmetic; ``mesh``: the rank grid, its
``("pp", "dp_replicate", "dp_shard", "tp")`` DeviceMesh and process groups; ``grads``:
handing the schedule's gradients to Lightning's optimizer step (dp all-reduce, local norms); ``data``:
sharding a user's sampler over the data-parallel replicas.
"""
