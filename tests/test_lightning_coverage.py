"""The table of Lightning's surface under HPPStrategy (tests/lightning_coverage.py) cannot fall behind Lightning: every
hook, callback, tuner method, logger and Trainer argument of the installed Lightning has one row, every row names a
test that exists (the hook rows are also checked against the hooks their scenarios recorded:
tests/conformance/test_usage.py), and docs/lightning-coverage.md is the table of the rows."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from tests.lightning_coverage import ROOT, TABLE, VERDICTS, rows, surface, table


def test_every_item_of_lightning_has_exactly_one_row():
    items = {(kind, name) for kind, names in surface().items() for name in names}
    counted = Counter((r.kind, r.name) for r in rows())
    assert not [key for key, n in counted.items() if n > 1], "items with several rows"
    missing = sorted(items - set(counted))
    stale = sorted(set(counted) - items)
    assert not missing, f"Lightning has these without a row in tests/lightning_coverage.py: {missing}"
    assert not stale, f"rows for what Lightning no longer has: {stale}"


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_row_has_a_verdict_and_names_a_test_that_exists():
    problems = []
    for r in rows():
        if r.verdict not in VERDICTS:
            problems.append(f"{r.kind} {r.name}: verdict {r.verdict!r}")
        if r.verdict == "not run here":
            continue
        path, _, name = r.evidence.partition("::")
        if not (ROOT / path).is_file() or name not in _tests_in(ROOT / path):
            problems.append(f"{r.kind} {r.name}: no test {r.evidence}")
    assert not problems, "\n".join(problems)


def test_the_documented_table_is_the_table_of_the_rows():
    assert TABLE.read_text() == table(rows()), \
        "docs/lightning-coverage.md is stale: run `python -m tests.lightning_coverage`"
