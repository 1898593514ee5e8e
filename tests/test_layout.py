"""``tests/`` mirrors the package (docs/design.md §6): each folder under it is named after a
package area, and hardware and process model are markers (``gpu``, ``slow``), never a folder
or a file-name suffix.

A package area is a subpackage of ``hybrid_dist`` (``formats``, ``kernels``, ...) or a
top-level folder of Python sources beside it (the integrations installed as
``hybrid_dist.<name>``, ``examples``, ``benchmarks``); tests of the core modules sit in
``tests/`` itself, multi-process tests in ``tests_distributed/``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
NOT_AREAS = {"tests", "tests_distributed", "hybrid_dist"}
PLACE_SUFFIXES = ("_gpu.py", "_cuda.py", "_nccl.py", "_interpreter.py")  # where a test runs, not what it tests


def _package_areas() -> set[str]:
    subpackages = {p.parent.name for p in (REPO / "hybrid_dist").glob("*/__init__.py")}
    top_level = {d.name for d in REPO.iterdir()
                 if d.is_dir() and not d.name.startswith(".") and d.name not in NOT_AREAS and any(d.glob("*.py"))}
    return subpackages | top_level


def _test_dirs() -> list[Path]:
    """Folders of ``tests/`` holding Python files (one left with only ``__pycache__`` after a
    move holds no tests)."""
    return sorted(d for d in TESTS.iterdir() if d.is_dir() and any(d.rglob("*.py")))


def test_the_areas_are_found():
    assert {"formats", "kernels", "moe", "launch"} <= _package_areas(), sorted(_package_areas())


def test_no_gpu_folder():
    assert TESTS / "gpu" not in _test_dirs(), "GPU tests carry pytest.mark.gpu and sit in the folder of their package"


def test_every_test_folder_is_a_package_area():
    areas = _package_areas()
    bad = [d.name for d in _test_dirs() if d.name not in areas]
    assert not bad, f"tests/ folders that are no package area: {bad} (areas: {sorted(areas)})"


def test_no_test_file_is_named_by_where_it_runs():
    files = sorted([*TESTS.rglob("test_*.py"), *(REPO / "tests_distributed").rglob("test_*.py")])
    bad = [str(p.relative_to(REPO)) for p in files if p.name.endswith(PLACE_SUFFIXES)]
    assert not bad, (f"test files named by where they run ({', '.join(PLACE_SUFFIXES)}): {bad}; "
                     "name them by what they check and mark them gpu or slow")


def test_every_package_folder_is_installed():
    """A wheel holds only the packages ``pyproject.toml`` lists: every folder with an
    ``__init__.py`` under ``hybrid_dist/`` and the integration folders must be listed."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {pkg: REPO / path for pkg, path in cfg["package-dir"].items()}
    dirs["hybrid_dist"] = REPO / "hybrid_dist"
    found = set()
    for pkg, root in dirs.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).parts
            found.add(".".join((pkg, *rel)))
    missing = sorted(found - set(cfg["packages"]))
    assert not missing, f"packages missing from pyproject.toml [tool.setuptools] packages: {missing}"
