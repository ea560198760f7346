"""The package's layout: no import cycle between moeyard's modules, and the benchmark package imports
neither the JAX side nor the optional runners until they are used."""

import ast
import os
import pathlib
import subprocess
import sys

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"


def import_graph(root: pathlib.Path = SRC) -> dict[str, set[str]]:
    """``{module: moeyard modules it imports}`` over every ``import`` in ``root/moeyard``, those inside
    functions included (a lazy import closes a cycle as well)."""
    modules = {}
    for path in (root / "moeyard").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if package else parts)] = (path, package)

    def known(name: str) -> str | None:  # the module that defines ``name`` (a module, or a name in one)
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, (path, package) in modules.items():
        here = name if package else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
                targets |= subs if len(subs) == len(node.names) else subs | {base}
        graph[name] = {t for t in map(known, targets) if t and t != name and t.startswith("moeyard")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = import_graph()
    assert "moeyard.bench.layer" in graph and "moeyard.layer" in graph["moeyard.bench.layer"]
    assert cycles(graph) == []


def test_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_bench_package_imports_no_runner_and_no_jax():
    code = (
        "import sys, moeyard.bench, moeyard.cli; "
        "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith(('moeyard.bench.e2e', "
        "'moeyard.bench.ep', 'moeyard.bench.jax', 'moeyard.bench.lora', 'moeyard.parallel', 'moeyard.jax'))))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
