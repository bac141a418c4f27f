"""Stage plans and where they come from.

``plan``: ``StageSpec`` / ``StagePlan`` / ``@stage`` and the JSON form; ``devices``: device kinds
and matching stages to ranks; ``profile``: measured per-unit costs; ``partition``: the exact
partitioner behind ``plan="auto"``; ``placement``: ``plan="auto"`` on a running job; ``report``:
predicted against measured stage times; ``cli``: planning clusters one does not have.
"""
