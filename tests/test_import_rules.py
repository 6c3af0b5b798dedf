"""The import rules of docs/architecture.md, checked on the source: every import counts, also one
inside a function or under TYPE_CHECKING."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "cdc_apply"
RUNNERS = {"cdc_apply.pipeline", "cdc_apply.live", "cdc_apply.replay", "cdc_apply.cli", "cdc_apply.airflow",
           "cdc_apply.demo", "cdc_apply.stream_job", "cdc_apply.decode_cli", "cdc_apply.status", "cdc_apply.resync",
           "cdc_apply.follow_changelog"}
# The composition root (cdc_apply/parts.py) and the parts it wires, which stand apart below it.
ROOT = "cdc_apply.parts"
COPY = "cdc_apply.snapshot"  # the initial copy: snapshot/copier.py, snapshot/pgcopy.py
CHANGELOG = "cdc_apply.changelog"  # the change log: log, its files, the applier from it, follow-changelog
# The log itself, which the copy and the applier write and read through.
THE_LOG = ("cdc_apply.changelog.log", "cdc_apply.changelog.log_files", "cdc_apply.changelog.log_collapse")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module -> every cdc_apply module or third-party top-level package it imports."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                found.add(base)
                found |= {f"{base}.{alias.name}" for alias in node.names}
        graph[module] = found
    modules = set(graph)
    return {m: {i for i in imports if i in modules or not i.startswith("cdc_apply")} for m, imports in graph.items()}


GRAPH = _imports()


def _violations(source_prefix: str, target_prefixes: tuple[str, ...] | set[str]) -> list[str]:
    return sorted(f"{m} -> {i}" for m, imports in GRAPH.items() if m == source_prefix or m.startswith(source_prefix + ".")
                  for i in imports if any(i == t or i.startswith(t + ".") for t in target_prefixes))


@pytest.mark.parametrize("source,targets", [
    ("cdc_apply.apply", ("cdc_apply.sources",)),
    ("cdc_apply.apply", tuple(RUNNERS)),
    ("cdc_apply.apply", ("cdc_apply.spark",)),  # the session and the data source drive apply, not the reverse
    ("cdc_apply.config", ("cdc_apply.apply",)),
    ("cdc_apply.pgtypes", ("cdc_apply.pgoutput",)),
    ("cdc_apply.pgoutput", ("pyspark", "delta")),
    ("cdc_apply.pgtypes", ("pyspark", "delta")),
    ("cdc_apply.assemble", ("pyspark", "delta")),
    # the lake (where files live, the pipeline's state) sits below apply, the copy, the change log and Spark
    ("cdc_apply.lake", ("cdc_apply.apply", "cdc_apply.spark", "cdc_apply.sources", "pyspark", "delta", *RUNNERS)),
    # the sink names the copy and the change log as ports; the root hands them in
    ("cdc_apply.sink", (COPY, CHANGELOG, ROOT, *RUNNERS)),
    # spark/ is the session, the jars and the pgoutput data source: it drives apply and the sink,
    # and the copy and the change log stand on it
    ("cdc_apply.spark", (COPY, CHANGELOG, ROOT, *RUNNERS)),
    ("cdc_apply.snapshot", ("cdc_apply.changelog.applier", ROOT, *RUNNERS)),
    *((log, (COPY, "cdc_apply.changelog.applier", ROOT, *RUNNERS)) for log in THE_LOG),
    ("cdc_apply.changelog.applier", (COPY, "cdc_apply.changelog.follower", ROOT, *RUNNERS)),
    ("cdc_apply.changelog.follower", (COPY, ROOT, *RUNNERS)),
    ("cdc_apply.parts", tuple(RUNNERS)),
])
def test_forbidden_imports(source: str, targets: tuple[str, ...]) -> None:
    assert _violations(source, targets) == []


def _constructions(name: str, keyword: str | None = None) -> set[str]:
    """The modules that call ``name(...)`` (with ``keyword=...`` when given)."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name and (
                    keyword is None or any(k.arg == keyword for k in node.keywords)):
                found.add(_module_name(path))
    return found


def test_one_composition_root() -> None:
    """A run's sink, copier and source-backed applier are built in cdc_apply/parts.py only. Elsewhere:
    the default sink of a user's own foreach_batch query (cdc_apply.spark.foreach, below the root) and
    the replay's (no source to copy from or to ask); a BatchApplier without the source's lookup (the
    replay, the change log's) or in a new session of its own."""
    assert _constructions("Snapshotter") == {ROOT}
    assert _constructions("DeltaSink") == {ROOT, "cdc_apply.spark.foreach", "cdc_apply.replay"}
    assert _constructions("BatchApplier", keyword="missing_value") == {ROOT, "cdc_apply.spark.foreach"}


def test_no_import_cycle_among_cdc_apply_modules() -> None:
    internal = {m: {i for i in imports if i in GRAPH and i != m} for m, imports in GRAPH.items()}
    # A package's __init__ importing its own submodules is not a cycle of logic: leave those edges out.
    for module, imports in internal.items():
        internal[module] = {i for i in imports if not (i.startswith(module + ".") and
                                                       (PACKAGE.parent / module.replace(".", "/")).is_dir())}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(internal[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(internal):
        if module not in state:
            visit(module)
    assert cycles == []


def _modules_using(name: str) -> set[str]:
    """Modules whose code names ``name`` (a call, an attribute or a bare name), docstrings aside."""
    using = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Name) and node.id == name) or (isinstance(node, ast.Attribute) and node.attr == name):
                using.add(_module_name(path))
                break
    return using


def test_one_replication_core() -> None:
    """The confirm invariant is decided in one module, and every runner assembles through it."""
    assert _modules_using("safe_confirm_lsn") == {"cdc_apply.replication"}
    # The decode benchmark times the assembler alone, without a sink.
    assert _modules_using("Assembler") - {"cdc_apply.assemble"} <= {"cdc_apply.replication", "cdc_apply.bench.decode"}
    assert "cdc_apply.replication" in _modules_using("Assembler")


# docs/architecture.md, "Folders": each imports only the folders before it here.
FOLDER_ORDER = ("pgoutput", "pgtypes", "sources", "changerows", "lake", "apply", "spark", "changelog", "snapshot")


def test_folders_import_only_the_folders_before_them() -> None:
    def folder(module: str) -> str:
        return module.split(".")[1] if module.count(".") >= 1 else module

    backwards = sorted(f"{m} -> {i}" for m, imports in GRAPH.items() if folder(m) in FOLDER_ORDER
                       for i in imports if i.startswith("cdc_apply.") and folder(i) in FOLDER_ORDER
                       and FOLDER_ORDER.index(folder(i)) > FOLDER_ORDER.index(folder(m)))
    assert backwards == []
