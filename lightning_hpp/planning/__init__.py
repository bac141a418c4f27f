"""Stage plans and where they come from.

``plan``: ``StageSpec`` / ``StagePlan`` / ``@stage`` and the JSON form; ``devices``: device kinds and
matching stages to ranks; ``profile``: a model's per-unit costs as data; ``measure``: measuring them;
``speeds``: several ranks' profiles and a slow rank's own speed; ``cache``: the profile file reused while it
matches; ``calibrate``: the step's other costs (schedule, loss, optimizer, send/recv); ``cluster``: the devices a
plan may use; ``costs``: the cost model; ``memory``: what a stage holds; ``replay``: a schedule's order
replayed; ``solver``: the cuts of one structure; ``search``: the whole-plan search behind ``plan="auto"`` and
the CLI; ``result``: what the planner answers; ``cli``: planning clusters one does not have.
"""
