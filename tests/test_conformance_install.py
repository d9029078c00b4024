"""The conformance suite as an implementer gets it: the built wheel, in a fresh virtual environment
outside the repository, run through its installed ``ckpt conformance`` against the reference adapters.

The wheel is built from a copy of the sources (so the repository gets no build/ or egg-info) and
installed with ``--no-deps``; its dependencies come from this environment through a path line in a
``.pth`` file (a path line, so this environment's editable-install hooks do not run). The installed
suite must generate a vector tree byte-identical to the committed one (a wheel cannot carry its
symlinks), then pass a selection of vectors that covers both directions, the symlinked and hidden-file
vectors and every writer scenario. ``CKPTFMT_CONFORMANCE_INSTALL_FULL=1`` runs every vector instead
(about a minute more on 2 cores).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest
from ckptfmt.conformance.suite import tree_digest

pytestmark = pytest.mark.slow  # multi-process: left out by -m "not slow" (README)

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "conformance" / "vectors"
SOURCES = ["pyproject.toml", "README.md", "MANIFEST.in", "ckptfmt", "cli", "conformance"]
SELECTION = ["valid/weights", "stray-files", "PTH-3", "path-hidden-segment", "chunks-overlap", "writer/*"]


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"{argv}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _wheel(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(tmp / "dist"), str(src)], tmp)
    (wheel,) = (tmp / "dist").glob("ckptfmt-*.whl")
    return wheel


def _venv(tmp: Path, wheel: Path) -> Path:
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
         tmp)  # fmt: skip
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp).stdout.strip()
    Path(site, "zz-base-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def test_the_built_wheel_runs_the_suite_from_a_clean_venv_outside_the_repository(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "ckptfmt/conformance/runner.py" in names and "ckptfmt/conformance/coverage.json" in names
    assert "ckptfmt/cli/conformance.py" in names
    packages = [p.parent.relative_to(ROOT).as_posix() for p in sorted((ROOT / "ckptfmt").rglob("__init__.py"))]
    missing = [p for p in packages if f"{p}/__init__.py" not in names]
    assert not missing, f"add them to [tool.setuptools] packages in pyproject.toml: {missing}"
    assert not [n for n in names if "/vectors/" in n or n.startswith(("conformance/", "cli/", "tests/"))]

    venv = _venv(tmp_path, wheel)
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["CKPTFMT_CONFORMANCE_CACHE"] = str(tmp_path / "cache")
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    where = _run(
        ["python", "-c", "import ckptfmt, importlib.util as u; "
         "print(ckptfmt.__file__, u.find_spec('conformance'), u.find_spec('cli'))"],
        work, env,
    ).stdout.split()  # fmt: skip
    assert where[0].startswith(str(venv)) and where[1:] == ["None", "None"]  # no top-level conformance or cli

    generated = Path(_run(["ckpt", "conformance", "vectors"], work, env).stdout.strip())
    assert generated.parent == tmp_path / "cache"
    assert tree_digest(generated) == tree_digest(VECTORS), "the installed suite generates other vectors"
    assert (generated / "invalid" / "symlink-directory" / "checkpoint" / "weights").is_symlink()
    assert _run(["python", "-m", "ckptfmt.conformance", "vectors"], work, env).stdout.strip() == str(generated)
    _run(["ckpt", "conformance", "vectors", "--out", "copy"], work, env)
    assert tree_digest(work / "copy") == tree_digest(generated)

    full = os.environ.get("CKPTFMT_CONFORMANCE_INSTALL_FULL") == "1"
    selection = [] if full else [arg for pattern in SELECTION for arg in ("--only", pattern)]
    proc = _run(
        ["ckpt", "conformance", "run", "--reader", "ckpt dump --canonical",
         "--writer", "python -m ckptfmt.conformance.reference_writer", *selection, "--junit-xml", "junit.xml"],
        work, env,
    )  # fmt: skip
    lines = proc.stdout.splitlines()
    assert lines[0].endswith(f"vectors {tree_digest(VECTORS)} at {generated}"), lines[0]
    cases = ET.parse(work / "junit.xml").getroot().findall("./testsuite/testcase")
    assert lines[-1] == f"{len(cases)} passed, 0 failed"
    kinds = {c.get("classname") for c in cases}
    pairs = [("reader", "valid"), ("reader", "invalid"), ("writer", "valid"), ("writer", "writer")]
    assert kinds == {f"ckptfmt-conformance.{direction}.{kind}" for direction, kind in pairs}
    assert len(cases) >= (150 if full else 10)
