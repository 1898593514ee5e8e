"""Dependencies point one way (docs/design.md §5): the static import graph has no cycle, the
formats never import the kernels, the core never imports an integration, no package imports
another's private modules or names, and every module imports alone in a fresh interpreter.

The graph holds every ``import`` of the package's sources, module-level and function-local
alike; an import of ``a.b.c`` is an edge to ``a.b.c`` (not to its parent packages), and
``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = "hybrid_dist"
INTEGRATIONS = ("fsdp2", "tensor_parallel", "moe", "launch", "integrations")  # installed as hybrid_dist.<name>
# The package root assembles the library: it imports the kernels (which fill the kernel
# registry) and hybrid_dist.fsdp2 (which registers the FSDP2 hooks), so it is exempt from
# the core's layering rule. Everything else in the core is below every integration.
ASSEMBLY = (ROOT,)


def _package_dirs() -> dict[str, Path]:
    dirs = {}
    for pkg in (ROOT, *(f"{ROOT}.{name}" for name in INTEGRATIONS)):
        spec = importlib.util.find_spec(pkg)
        assert spec is not None and spec.submodule_search_locations, f"{pkg} is not installed"
        dirs[pkg] = Path(list(spec.submodule_search_locations)[0])
    return dirs


def _module_files() -> dict[str, Path]:
    """Every module of the installed package, by dotted name."""
    files = {}
    dirs = _package_dirs()
    for pkg, top in dirs.items():
        for path in sorted(top.rglob("*.py")):
            rel = path.relative_to(top).with_suffix("")
            if any(p in dirs.values() for p in path.parents if p != top and top in p.parents):
                continue  # an integration folder nested under another package's folder
            parts = [p for p in rel.parts if p != "__init__"]
            if any(not (d / "__init__.py").exists() for d in path.parents if top in d.parents):
                continue  # not inside a package
            files[".".join([pkg, *parts])] = path
    return files


def _is_private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split(".")[1:])


def _group(module: str) -> str:
    """Which package a module belongs to: the core (``hybrid_dist`` with formats and
    kernels) or one integration."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in INTEGRATIONS else ROOT


def _imports(files: dict[str, Path]) -> list[tuple[str, str, str, int]]:
    """``(importer, imported module, imported name or "", line)`` for every import of
    hybrid_dist, module-level and function-local."""
    out = []
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out += [(mod, a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == ROOT]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against the importer's package
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                if base.split(".")[0] != ROOT:
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in files:
                        out.append((mod, sub, "", node.lineno))
                    else:
                        out.append((mod, base, a.name, node.lineno))
    return out


FILES = _module_files()
IMPORTS = _imports(FILES)


def _where(src: str, line: int) -> str:
    return f"{FILES[src]}:{line}"


def test_the_package_is_found():
    assert f"{ROOT}.formats._quantizer" in FILES and f"{ROOT}.fsdp2" in FILES, sorted(FILES)[:10]


def test_no_import_cycle():
    graph: dict[str, set[str]] = {m: set() for m in FILES}
    for src, dst, _, _ in IMPORTS:
        if dst in FILES and dst != src:
            graph[src].add(dst)
    # Tarjan's strongly connected components; any component of 2+ modules is a cycle
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles (each line one strongly connected set of modules; its edges):\n" + "\n".join(
        f"{' '.join(c)}\n    " + "; ".join(f"{s} -> {d} ({_where(s, ln)})" for s, d, _, ln in IMPORTS
                                           if s in c and d in c and s != d)
        for c in cycles)


def test_formats_never_import_kernels():
    bad = [f"{s} -> {d} ({_where(s, ln)})" for s, d, _, ln in IMPORTS
           if s.startswith(f"{ROOT}.formats") and d.startswith(f"{ROOT}.kernels")]
    assert not bad, "the formats consult hybrid_dist._kernel_registry, never the kernels:\n" + "\n".join(bad)


def test_the_core_never_imports_an_integration():
    bad = [f"{s} -> {d} ({_where(s, ln)})" for s, d, _, ln in IMPORTS
           if _group(s) == ROOT and s not in ASSEMBLY and _group(d) != ROOT]
    assert not bad, "core modules importing hybrid_dist.{fsdp2,tensor_parallel,moe,launch}:\n" + "\n".join(bad)


def test_no_module_imports_transformers():
    """Hugging Face ``transformers`` is an optional extra (``[hf]``) for tests only."""
    bad = []
    for mod, path in FILES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{mod} ({path}:{node.lineno})" for n in names if n.split(".")[0] == "transformers"]
    assert not bad, "modules importing transformers:\n" + "\n".join(bad)


def test_no_private_import_across_packages():
    bad = [f"{s} -> {d}{'.' + n if n else ''} ({_where(s, ln)})" for s, d, n, ln in IMPORTS
           if _group(s) != _group(d) and (_is_private(d) or n.startswith("_"))]
    assert not bad, "private modules or names imported from another package:\n" + "\n".join(bad)


# --- every module alone, in a fresh interpreter -----------------------------------------
# A forked child of an interpreter that has imported only torch is a fresh interpreter for
# hybrid_dist (nothing of it is loaded) at a fraction of a full start's cost.
_DRIVER = r"""
import importlib, os, sys, traceback
import torch  # noqa: F401  (shared by every child; nothing of hybrid_dist is loaded)

modules = sys.argv[1:]
failed = []
for name in modules:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code, msg = 0, b""
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != "triton" or importlib.util.find_spec("triton") is not None:
                code, msg = 1, traceback.format_exc().encode()
        except BaseException:
            code, msg = 1, traceback.format_exc().encode()
        os.write(w, msg)
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        msg = f.read()
    _, status = os.waitpid(pid, 0)
    if status:
        failed.append(f"--- import {name} ---\n{msg.decode()}")
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the driver forks one child per module")
def test_each_module_imports_alone_in_a_fresh_interpreter():
    modules = sorted(FILES)
    halves = [modules[0::2], modules[1::2]]  # two drivers: one per core of CI
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, "-c", _DRIVER, *half], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=env, text=True) for half in halves]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    failed = [out for p, out in zip(procs, outs) if p.returncode]
    assert not failed, "modules that fail to import alone:\n" + "\n".join(failed)


def test_module_finders_run_at_import_only():
    """Dynamo refuses to trace ``importlib.util.find_spec`` / ``importlib.import_module``, so
    such a call inside a function that a compiled graph reaches is a graph break (one in
    ``moe.grouped_operands`` broke every compiled MoE block on CUDA): availability checks are
    module-level constants. The launcher's flag parsing and layout checks run before any
    model exists and are exempt."""
    finders = {"find_spec", "import_module"}
    setup_only = {"hybrid_dist.launch.config._recipe_module", "hybrid_dist.launch.parallelize.missing_api"}
    calls = []
    for name, path in _module_files().items():
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        node.func.attr in finders and f"{name}.{fn.name}" not in setup_only:
                    calls.append(f"{name}.{fn.name} (line {node.lineno}): {node.func.attr}")
    assert not calls, "module finders called inside functions:\n" + "\n".join(calls)
