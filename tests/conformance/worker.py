"""Run every conformance scenario of one layout, one after another in the same processes.

Usage: python -m tests.conformance.worker '<json: {"layout": "ref" | "pp2" | "pp2dp2", "out": DIR, "only": [names]}>'

Each scenario saves what each rank recorded to DIR/<scenario>/<layout>/rank{r}.pt. The pipeline layouts
start their ranks through Lightning (the script is launched again per rank) or are started by a launcher
(``Job(start="forked")`` of tests.harness.launch); the reference job runs every scenario's reference with
Lightning's default strategy, then the one-process HPPStrategy scenarios (layout ``single``).
"""

import json
import sys

from tests.conformance import scenarios, scenarios_coverage, scenarios_usage  # noqa: F401 - registers the scenarios
from tests.conformance import shape_scenarios  # noqa: F401 - and the scenarios of changing shapes
from tests.conformance.harness import run_layout


def main(spec: dict) -> None:
    run_layout(spec["layout"], spec["out"], spec.get("only"))
    if spec["layout"] == "ref":
        run_layout("single", spec["out"], spec.get("only"))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
