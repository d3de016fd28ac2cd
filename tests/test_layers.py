"""The layers of docs/architecture.md, enforced: import-linter's contracts in pyproject.toml, run over
the package as it installs (``llmd`` with ``daemon/``, ``kernels/``, ``quant/`` and ``tui/`` inside it,
per pyproject's package-dir; import-linter reads the tree on disk, where the checkout keeps them
apart), and a broken contract is caught."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def installed_tree(dest: Path) -> Path:
    """The package's Python files laid out as installed, with pyproject.toml beside them."""
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in package_dirs.items():
        shutil.copytree(ROOT / folder, dest.joinpath(*package.split(".")),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "cpu", "*.tcss", "service_files"),
                        dirs_exist_ok=True)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"], cwd=tree,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=300)


def test_the_import_contracts_hold(tmp_path: Path) -> None:
    result = lint_imports(installed_tree(tmp_path / "tree"))
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert f"{len(contracts)} kept, 0 broken" in result.stdout


def test_a_reach_up_is_caught(tmp_path: Path) -> None:
    """A kernel importing the runtime breaks two contracts (the layers, and the kernels' own)."""
    tree = installed_tree(tmp_path / "tree")
    (tree / "llmd" / "kernels" / "reach_up.py").write_text("from llmd.daemon import attention\n")
    result = lint_imports(tree)
    assert result.returncode != 0
    assert "runtime > quant > kernels BROKEN" in result.stdout
    assert "kernels import nothing from llmd but its errors BROKEN" in result.stdout
