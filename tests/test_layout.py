"""Package layout: no import cycles inside ``lightning_hpp``, and Lightning's Trainer stays at the edges.

A static scan: every module under ``lightning_hpp/`` is parsed with :mod:`ast`, nothing is imported.

* Import graph: ``import lightning_hpp.x.y``, ``from lightning_hpp.x import y`` (``y`` a submodule
  if ``x/y.py`` or ``x/y/__init__.py`` exists, else a name of ``x/__init__.py``) and relative
  imports, at any depth (function-level imports included), except those under
  ``if TYPE_CHECKING:``. Importing ``a.b.c`` also runs the ``__init__`` of ``a.b`` unless that package
  is already being imported (it encloses the importer), so such an edge goes to ``a.b`` too. A
  cycle is reported as ``a -> b -> a`` with the file and line of every edge.
* Lightning's ``Trainer`` (and anything from ``lightning.pytorch.trainer``) is imported only by
  ``lightning_hpp/strategy.py`` and ``lightning_hpp/hydra/train.py``; ``TrainerFn`` (anything from
  ``lightning.pytorch.trainer.states``) only by ``strategy.py``. ``TYPE_CHECKING`` imports count
  here. Attribute access such as ``pl.Trainer`` after ``import lightning.pytorch as pl`` is not an
  import and is not looked at.
* Floors: each top-level module or subpackage of ``lightning_hpp`` is a *part*
  (``lightning_hpp.planning.plan`` is in part ``planning``; the package's own ``__init__`` is the
  part ``__init__``), and :data:`FLOORS` puts every part on a floor, lowest first. A part imports
  its own part and parts on lower floors only: an import from a lower floor to a higher one fails,
  and so does one between two parts of the same floor unless the pair is in
  :data:`SIBLING_IMPORTS_ALLOWED`; :data:`FORBIDDEN_IMPORTS` rules out some downward imports too.
  The edges are the import graph's (function-level imports count; ``if TYPE_CHECKING:`` imports
  may go anywhere; an edge to a package ``__init__`` run on the way lands in the imported module's
  part and is judged like the import itself). A module whose part is not in :data:`FLOORS` fails,
  so a new part gets a floor when it is added; a declared part that does not exist is fine.
* No private name crosses modules: ``from lightning_hpp.x import _name`` fails unless ``_name`` is a
  submodule (``from lightning_hpp import _dist``); what another module needs is public where it lives.
* Size: no module of ``lightning_hpp`` over :data:`MAX_MODULE_LINES` lines, and no line of the
  project's Python (:data:`LINE_LIMIT_DIRS`) longer than pyproject's ``[tool.ruff] line-length``.
"""

from __future__ import annotations

import ast
import itertools
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_hpp"

TRAINER = "Trainer"
TRAINER_FN = "TrainerFn"
ALLOWED = {
    TRAINER: ("lightning_hpp/strategy.py", "lightning_hpp/hydra/train.py"),
    TRAINER_FN: ("lightning_hpp/strategy.py",),
}
"""Which files may import Lightning's Trainer, and its ``trainer.states`` (``TrainerFn``)."""

INIT = "__init__"
"""The part of the package's own ``__init__.py`` in a floor table."""

FLOORS: tuple[tuple[str, ...], ...] = (
    ("errors",),  # 0
    ("validation",),  # 1
    ("_dist", "_git", "_timing", "examples_data", "liveness", "redaction"),  # 2
    ("checkpoint",),  # 3
    ("launch",),  # 4
    ("pipeline",),  # 5
    ("planning",),  # 6
    ("model",),  # 7
    ("precision", "telemetry", "bias"),  # 8
    ("options",),  # 9
    ("assembly",),  # 10
    ("strategy",),  # 11
    ("hydra", "torchrun", INIT),  # 12
    ("check",),  # 13: runs a user's module under HPPStrategy (the package's top) and Lightning's DDP
)
"""The parts of ``lightning_hpp`` (top-level modules and subpackages), floor by floor, lowest first."""

SIBLING_IMPORTS_ALLOWED: tuple[tuple[str, str], ...] = (
    # (importer, imported): two parts of one floor; each entry says why the import is needed.
)
"""Imports between two parts of the same floor that are allowed anyway (none so far)."""

FORBIDDEN_IMPORTS: tuple[tuple[str, str], ...] = (
    ("bias", "planning"),  # the coded-bias guards read the pipeline through its view, never the planner
)
"""(importer, imported): downward imports the design rules out."""

MAX_MODULE_LINES = 600
"""The most lines a module of ``lightning_hpp`` may have: past it, it holds more than one concept."""

LINE_LIMIT_DIRS = ("lightning_hpp", "tests", "benchmarks", "examples", "scripts", "hydra_plugins")
"""The directories whose ``.py`` files keep pyproject's line length."""

_LIGHTNING_TOPS = ("lightning", "lightning.pytorch", "pytorch_lightning")
_TRAINER_PACKAGES = ("lightning.pytorch.trainer", "pytorch_lightning.trainer")


# ---------------------------------------------------------------------------------------- scanning
@dataclass(frozen=True)
class ImportStmt:
    module: str
    """Dotted name: the imported module, or a ``from`` import's (resolved, absolute) source."""
    names: tuple[str, ...]
    """Names of a ``from`` import; empty for ``import module``."""
    line: int
    source: str
    type_checking: bool


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    rel: str
    """Path relative to the scan root, ``/``-separated (``lightning_hpp/strategy.py``)."""
    is_package: bool


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    rel: str
    line: int
    source: str
    via: bool
    """True when the edge is the ``__init__`` of a package on the way to the imported module."""


def find_modules(root: Path, package: str) -> dict[str, Module]:
    """Every ``.py`` file under ``root/package``, by dotted module name."""
    modules: dict[str, Module] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        name = ".".join(parts)
        modules[name] = Module(name, path, path.relative_to(root).as_posix(), is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _absolute(module: Module, node: ast.ImportFrom) -> str | None:
    if not node.level:
        return node.module
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        return None  # above the top-level package: Python refuses it too
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def scan_imports(module: Module) -> list[ImportStmt]:
    """Every import statement of a module, at any depth, marked when under ``if TYPE_CHECKING:``."""
    tree = ast.parse(module.path.read_text(encoding="utf-8"), filename=str(module.path))
    found: list[ImportStmt] = []

    def visit(node: ast.AST, tc: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, tc)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(ImportStmt(alias.name, (), node.lineno, ast.unparse(node), tc))
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            if base is not None:
                names = tuple(a.name for a in node.names)
                found.append(ImportStmt(base, names, node.lineno, ast.unparse(node), tc))
        for child in ast.iter_child_nodes(node):
            visit(child, tc)

    visit(tree, False)
    return found


def _encloses(package: str, module: Module) -> bool:
    """Whether ``package`` is already being imported when ``module`` runs: itself or an ancestor."""
    return module.name == package or module.name.startswith(package + ".")


def import_edges(modules: dict[str, Module]) -> list[Edge]:
    """Module-level dependency edges inside the scanned package (TYPE_CHECKING imports left out)."""
    edges: list[Edge] = []
    for mod in modules.values():
        for imp in scan_imports(mod):
            if imp.type_checking:
                continue
            if imp.names:  # from X import a, b
                targets = [
                    f"{imp.module}.{n}" if f"{imp.module}.{n}" in modules else imp.module for n in imp.names
                ]
            else:  # import X.Y.Z
                targets = [imp.module]
            for target in dict.fromkeys(targets):
                while target and target not in modules:  # `import pkg.mod.attr` style: nearest module
                    target = target.rpartition(".")[0]
                if not target:
                    continue  # outside the package
                parts = target.split(".")
                for i in range(1, len(parts)):  # packages run on the way to the target
                    pkg = ".".join(parts[:i])
                    if pkg in modules and not _encloses(pkg, mod):
                        edges.append(Edge(mod.name, pkg, mod.rel, imp.line, imp.source, True))
                edges.append(Edge(mod.name, target, mod.rel, imp.line, imp.source, False))
    return [e for e in edges if e.src != e.dst]


def find_cycles(edges: list[Edge]) -> list[list[Edge]]:
    """One shortest cycle through each module that is on a cycle, duplicates (rotations) removed."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        graph.setdefault(e.src, {}).setdefault(e.dst, e)  # first statement that makes the edge
        graph.setdefault(e.dst, {})

    # Tarjan's strongly connected components
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            components.append(comp)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    cycles: dict[tuple[str, ...], list[Edge]] = {}
    for comp in components:
        if len(comp) < 2:
            continue
        for start in sorted(comp):
            # breadth-first search from start back to start, inside the component
            parent: dict[str, str] = {}
            frontier = [start]
            seen = {start}
            closing: str | None = None
            while frontier and closing is None:
                nxt = []
                for v in frontier:
                    for w in sorted(graph[v]):
                        if w == start:
                            closing = v
                            break
                        if w in comp and w not in seen:
                            seen.add(w)
                            parent[w] = v
                            nxt.append(w)
                    if closing is not None:
                        break
                frontier = nxt
            assert closing is not None
            path = [closing]
            while path[-1] != start:
                path.append(parent[path[-1]])
            path.reverse()  # start ... closing
            i = path.index(min(path))
            key = tuple(path[i:] + path[:i])
            if key not in cycles:
                nodes = list(key) + [key[0]]
                cycles[key] = [graph[a][b] for a, b in itertools.pairwise(nodes)]
    return [cycles[k] for k in sorted(cycles)]


def format_cycle(cycle: list[Edge]) -> str:
    chain = " -> ".join([e.src for e in cycle] + [cycle[0].src])
    lines = [chain]
    for e in cycle:
        how = f"(runs package {e.dst}'s __init__ on the way)" if e.via else f"imports {e.dst}"
        lines.append(f"    {e.rel}:{e.line}: `{e.source}` {how}")
    return "\n".join(lines)


def _trainer_kinds(imp: ImportStmt) -> set[str]:
    """Which of Lightning's Trainer / TrainerFn (trainer.states) an import statement brings in."""

    def of_module(name: str) -> str | None:
        for pkg in _TRAINER_PACKAGES:
            if name == pkg + ".states" or name.startswith(pkg + ".states."):
                return TRAINER_FN
            if name == pkg or name.startswith(pkg + "."):
                return TRAINER
        return None

    if not imp.names:
        kind = of_module(imp.module)
        return {kind} if kind else set()
    kinds: set[str] = set()
    for n in imp.names:
        if imp.module in _LIGHTNING_TOPS and n == "Trainer":
            kinds.add(TRAINER)
        elif kind := of_module(f"{imp.module}.{n}" if imp.module in _LIGHTNING_TOPS + _TRAINER_PACKAGES
                               else imp.module):
            kinds.add(kind)
    return kinds


def trainer_offenders(modules: dict[str, Module], allowed: dict[str, tuple[str, ...]]) -> list[str]:
    """``path:line`` messages for every Trainer / TrainerFn import outside its allowed files."""
    out = []
    for mod in modules.values():
        for imp in scan_imports(mod):
            for kind in sorted(_trainer_kinds(imp)):
                if mod.rel not in allowed[kind]:
                    where = " (under TYPE_CHECKING)" if imp.type_checking else ""
                    out.append(
                        f"{mod.rel}:{imp.line}: module {mod.name} imports Lightning's {kind}{where}: "
                        f"`{imp.source}`; only {', '.join(allowed[kind])} may"
                    )
    return out


def part_of(name: str, package: str) -> str:
    """The part a module of ``package`` belongs to: its top-level module or subpackage, or INIT."""
    return INIT if name == package else name[len(package) + 1 :].split(".")[0]


def floor_offenders(
    modules: dict[str, Module],
    package: str,
    floors: tuple[tuple[str, ...], ...],
    siblings_allowed: tuple[tuple[str, str], ...] = (),
    forbidden: tuple[tuple[str, str], ...] = (),
) -> list[str]:
    """``path:line`` messages for imports that break the floor table, and for undeclared parts.

    ``floors`` lists the parts floor by floor, lowest first; ``siblings_allowed`` and ``forbidden``
    are (importer, imported) pairs of parts. Imports to or from an undeclared part are not judged:
    the part itself is reported, once, at its first file.
    """
    floor: dict[str, int] = {}
    for i, parts in enumerate(floors):
        for part in parts:
            assert part not in floor, f"part {part} is on floor {floor[part]} and on floor {i}"
            floor[part] = i

    out: list[str] = []
    undeclared: dict[str, Module] = {}
    for mod in modules.values():
        undeclared.setdefault(part_of(mod.name, package), mod)
    for part, mod in undeclared.items():
        if part not in floor:
            what = "subpackage" if mod.is_package and mod.name.count(".") == 1 else "module"
            out.append(
                f"{mod.rel}: {what} {package}.{part} is not in any floor: add `{part!r}` to FLOORS in "
                f"tests/test_layout.py at the floor it belongs on (above every part it imports, below "
                f"every part that imports it)"
            )

    seen: set[tuple[str, int, str]] = set()
    judged: list[tuple[str, int, str]] = []
    for e in import_edges(modules):  # via edges land in the imported module's part
        a, b = part_of(e.src, package), part_of(e.dst, package)
        if a == b or a not in floor or b not in floor or (e.rel, e.line, b) in seen:
            continue
        seen.add((e.rel, e.line, b))
        fa, fb = floor[a], floor[b]
        if fa < fb:
            why = ""
        elif fa == fb and (a, b) not in siblings_allowed:
            why = " on the same floor"
        elif (a, b) in forbidden:
            why = ", which is ruled out (FORBIDDEN_IMPORTS)"
        else:
            continue
        msg = f"{e.rel}:{e.line}: `{e.source}`: part {a} (floor {fa}) imports part {b} (floor {fb}){why}"
        judged.append((e.rel, e.line, msg))
    return out + [msg for *_, msg in sorted(judged)]


def private_imports(modules: dict[str, Module], package: str) -> list[str]:
    """``path:line`` messages for every ``from <package module> import _name`` where ``_name`` is not a
    submodule (a private module such as ``_dist`` may be imported; a private name of another module may not)."""
    out = []
    for mod in modules.values():
        for imp in scan_imports(mod):
            if not imp.names or not (imp.module == package or imp.module.startswith(package + ".")):
                continue
            for name in imp.names:
                private = name.startswith("_") and not name.startswith("__")
                if private and f"{imp.module}.{name}" not in modules and imp.module != mod.name:
                    out.append(f"{mod.rel}:{imp.line}: `{imp.source}` imports {imp.module}'s private name {name}")
    return out


def long_lines(root: Path, dirs: tuple[str, ...], limit: int) -> list[str]:
    """``path:line (n characters)`` for every line of a ``.py`` file under ``root/dirs`` longer than ``limit``."""
    out = []
    for top in dirs:
        for path in sorted((root / top).rglob("*.py")):
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if len(line) > limit:
                    out.append(f"{path.relative_to(root).as_posix()}:{i} ({len(line)} characters)")
    return out


# ------------------------------------------------------------------------------------------- tests
_CYCLE_HINT = (
    "Break it: import the leaf module rather than the package `__init__`, or move the shared piece "
    "into a module both can import. Moving the import into a function does not break it here "
    "(function-level imports count); `if TYPE_CHECKING:` is fine for annotation-only imports."
)
_FLOOR_HINT = (
    "Fix it: move the shared piece down to a floor both can import, pass the value in from the "
    "layer above (an argument or attribute set by the caller), or hand a callback down. Moving the "
    "import into a function does not hide it (function-level imports count); `if TYPE_CHECKING:` "
    "is fine for annotation-only imports."
)
_TRAINER_HINT = (
    "Annotate with `pl.Trainer` after `import lightning.pytorch as pl` (or `Any`), and take what is "
    "needed from the trainer object passed in; compare `trainer.state.fn` with strings (\"fit\", ...)."
)


def test_no_import_cycles_inside_lightning_hpp():
    cycles = find_cycles(import_edges(find_modules(ROOT, PACKAGE)))
    assert not cycles, (
        f"{len(cycles)} import cycle(s) inside {PACKAGE}:\n"
        + "\n".join(format_cycle(c) for c in cycles)
        + "\n"
        + _CYCLE_HINT
    )


def test_trainer_imported_only_by_strategy_and_hydra_entry():
    offenders = trainer_offenders(find_modules(ROOT, PACKAGE), ALLOWED)
    assert not offenders, "\n".join(offenders) + "\n" + _TRAINER_HINT


def test_no_import_from_a_lower_floor_to_a_higher_one():
    offenders = floor_offenders(
        find_modules(ROOT, PACKAGE), PACKAGE, FLOORS, SIBLING_IMPORTS_ALLOWED, FORBIDDEN_IMPORTS
    )
    assert not offenders, (
        f"{len(offenders)} import(s) against the floors of {PACKAGE}:\n" + "\n".join(offenders) + "\n" + _FLOOR_HINT
    )


def test_scan_finds_a_known_cycle_and_trainer_import(tmp_path):
    files = {
        "toypkg/__init__.py": "from toypkg.a import A\n",
        # a -> b (a submodule named in a from-import) and b -> a (relative, inside a function)
        "toypkg/a.py": "from toypkg import b\nA = 1\n",
        "toypkg/b.py": "def f():\n    from .a import A\n    return A\n",
        # child imports a name from its parent package's __init__, which imports the child
        "toypkg/sub/__init__.py": "from .leaf import X\nY = 2\n",
        "toypkg/sub/leaf.py": "X = 1\nfrom toypkg.sub import Y\n",
        # importing toypkg.g.mod runs toypkg/g/__init__.py, which imports h back
        "toypkg/g/__init__.py": "from toypkg.h import H\n",
        "toypkg/g/mod.py": "M = 1\n",
        "toypkg/h.py": "H = 1\nfrom toypkg.g.mod import M\n",
        # TYPE_CHECKING: no cycle c <-> d, but the Trainer import is still found
        "toypkg/c.py": textwrap.dedent(
            """\
            from typing import TYPE_CHECKING
            import typing
            if TYPE_CHECKING:
                from toypkg.d import D
                from lightning.pytorch import Trainer
            if typing.TYPE_CHECKING:
                import toypkg.d
            else:
                import lightning.pytorch as pl
            """
        ),
        "toypkg/d.py": "import toypkg.c\nD = 1\n",
        "toypkg/e.py": "def g():\n    from lightning.pytorch.trainer.states import TrainerFn\n",
        "toypkg/f.py": "import pytorch_lightning.trainer.trainer\nfrom lightning import Trainer as T\n",
        "toypkg/strategy.py": "from lightning.pytorch import Trainer\n"
                              "from lightning.pytorch.trainer.states import TrainerFn\n",
        "toypkg/entry.py": "from lightning.pytorch.trainer import Trainer, states\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)

    modules = find_modules(tmp_path, "toypkg")
    cycles = find_cycles(import_edges(modules))
    chains = sorted(format_cycle(c).splitlines()[0] for c in cycles)
    assert chains == [
        "toypkg.a -> toypkg.b -> toypkg.a",
        "toypkg.g -> toypkg.h -> toypkg.g",
        "toypkg.sub -> toypkg.sub.leaf -> toypkg.sub",
    ], "\n".join(format_cycle(c) for c in cycles)
    ab = next(c for c in cycles if c[0].src == "toypkg.a")
    assert [(e.rel, e.line) for e in ab] == [("toypkg/a.py", 1), ("toypkg/b.py", 2)]

    allowed = {TRAINER: ("toypkg/strategy.py", "toypkg/entry.py"), TRAINER_FN: ("toypkg/strategy.py",)}
    offenders = trainer_offenders(modules, allowed)
    where = sorted((o.split(": module")[0], o.split("Lightning's ")[1].split()[0].rstrip(":")) for o in offenders)
    assert where == [
        ("toypkg/c.py:5", TRAINER),
        ("toypkg/e.py:2", TRAINER_FN),
        ("toypkg/entry.py:1", TRAINER_FN),
        ("toypkg/f.py:1", TRAINER),
        ("toypkg/f.py:2", TRAINER),
    ], "\n".join(offenders)
    assert any("under TYPE_CHECKING" in o and o.startswith("toypkg/c.py:5") for o in offenders)


def test_floor_check_reports_upward_sibling_and_forbidden_imports(tmp_path):
    files = {
        "toypkg/__init__.py": "VERSION = '1'\n",
        # upward at module level; upward under TYPE_CHECKING is allowed
        "toypkg/base.py": textwrap.dedent(
            """\
            X = 1
            from toypkg.mid import M
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from toypkg.top import core
            """
        ),
        # upward inside a function, into a subpackage: the via edge to toypkg/top/__init__.py
        # is the same import, reported once
        "toypkg/low/__init__.py": "",
        "toypkg/low/inner.py": "def f():\n    from toypkg.top.core import T\n    return T\n",
        # same floor: mid -> side is not allowed, side -> mid is (the allow-list);
        # side -> the package __init__ is upward
        "toypkg/mid.py": "from toypkg import side\nM = 1\n",
        "toypkg/side.py": "import toypkg.mid\nfrom toypkg import VERSION\n",
        # downward: top -> base is forbidden, top -> mid is fine
        "toypkg/top/__init__.py": "",
        "toypkg/top/core.py": "from toypkg.base import X\nfrom toypkg.mid import M\nT = X + M\n",
        # a subpackage in no floor: reported once; its imports are not judged
        "toypkg/extra/__init__.py": "",
        "toypkg/extra/x.py": "from toypkg.top.core import T\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)

    floors = (("base", "low", "ghost"), ("mid", "side"), ("top", INIT))  # "ghost" does not exist
    siblings_allowed, forbidden = (("side", "mid"),), (("top", "base"),)
    offenders = floor_offenders(find_modules(tmp_path, "toypkg"), "toypkg", floors, siblings_allowed, forbidden)
    assert offenders == [
        "toypkg/extra/__init__.py: subpackage toypkg.extra is not in any floor: add `'extra'` to FLOORS in "
        "tests/test_layout.py at the floor it belongs on (above every part it imports, below every part "
        "that imports it)",
        "toypkg/base.py:2: `from toypkg.mid import M`: part base (floor 0) imports part mid (floor 1)",
        "toypkg/low/inner.py:2: `from toypkg.top.core import T`: part low (floor 0) imports part top (floor 2)",
        "toypkg/mid.py:1: `from toypkg import side`: part mid (floor 1) imports part side (floor 1) on the same floor",
        "toypkg/side.py:2: `from toypkg import VERSION`: part side (floor 1) imports part __init__ (floor 2)",
        "toypkg/top/core.py:1: `from toypkg.base import X`: part top (floor 2) imports part base (floor 0), "
        "which is ruled out (FORBIDDEN_IMPORTS)",
    ], "\n".join(offenders)

    # a top-level module in no floor is named as a module
    (tmp_path / "toypkg/stray.py").write_text("")
    floors += (("extra",),)
    offenders = floor_offenders(find_modules(tmp_path, "toypkg"), "toypkg", floors, siblings_allowed, forbidden)
    assert offenders[0].startswith("toypkg/stray.py: module toypkg.stray is not in any floor: add `'stray'` to FLOORS")
    assert len(offenders) == 6


def test_no_private_name_imported_across_modules():
    offenders = private_imports(find_modules(ROOT, PACKAGE), PACKAGE)
    assert not offenders, (
        f"{len(offenders)} private name(s) imported from another module:\n" + "\n".join(offenders) + "\n"
        "Fix it: make the name public (no leading underscore, a docstring) in the module that owns it, or move "
        "what both modules need into a small module of its own."
    )


def test_private_import_check_reports_names_not_private_modules(tmp_path):
    files = {
        "toypkg/__init__.py": "",
        "toypkg/_low.py": "X = 1\n_Y = 2\n",
        "toypkg/a.py": "from toypkg import _low\nfrom toypkg._low import X\nfrom toypkg._low import _Y\n",
        "toypkg/b.py": "def f():\n    from .a import _helper\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    offenders = private_imports(find_modules(tmp_path, "toypkg"), "toypkg")
    assert offenders == [
        "toypkg/a.py:3: `from toypkg._low import _Y` imports toypkg._low's private name _Y",
        "toypkg/b.py:2: `from .a import _helper` imports toypkg.a's private name _helper",
    ], "\n".join(offenders)


def test_no_module_of_lightning_hpp_over_the_size_limit():
    sizes = {m.rel: len(m.path.read_text(encoding="utf-8").splitlines()) for m in find_modules(ROOT, PACKAGE).values()}
    over = sorted((n, rel) for rel, n in sizes.items() if n > MAX_MODULE_LINES)
    assert not over, (
        f"{len(over)} module(s) over {MAX_MODULE_LINES} lines: "
        + ", ".join(f"{rel} ({n})" for n, rel in over)
        + ". Split each by concept into modules named for what they hold."
    )


def test_no_line_over_the_project_line_length():
    limit = int(re.search(r"^line-length\s*=\s*(\d+)", (ROOT / "pyproject.toml").read_text(), re.M).group(1))
    offenders = long_lines(ROOT, LINE_LIMIT_DIRS, limit)
    assert not offenders, (
        f"{len(offenders)} line(s) over {limit} characters (pyproject's [tool.ruff] line-length):\n"
        + "\n".join(offenders[:50]) + ("\n..." if len(offenders) > 50 else "") + "\nWrap them."
    )
