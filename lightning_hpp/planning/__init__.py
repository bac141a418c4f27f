"""Stage plans and where they come from.

``plan``: ``StageSpec`` / ``StagePlan`` / ``@stage`` and the JSON form; ``devices``: device kinds
and matching stages to ranks; ``profile``: measured per-unit costs; ``calibrate``: the step's other
costs (schedule, loss, optimizer, send/recv); ``partition``: the exact cut-and-kind partitioner;
``search``: the whole-plan search behind ``plan="auto"`` (pp x dp, micro-batches, schedule, cuts);
``placement``: ``plan="auto"`` on a running job; ``report``: predicted against measured stage times;
``cli``: planning clusters one does not have.
"""
