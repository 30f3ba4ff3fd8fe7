"""One import package: installed, headatlas brings `headatlas` and nothing else to the top level."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the source: setuptools builds in the source's build/ folder,
    and two builds there at once (two test workers) failed copying files the other had moved."""
    import shutil

    out, source = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("source") / "headatlas"
    skip = shutil.ignore_patterns(".git", ".venv", "build", "__pycache__", "*.egg-info", ".*_cache", "*.duckdb*")
    shutil.copytree(ROOT, source, ignore=skip)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    # the configuration declares every package and its data: setuptools has nothing to warn of
    # (a data folder missing from `packages` drew some 40 lines of warnings in `make demo`)
    assert "Warning" not in done.stdout + done.stderr, done.stdout + done.stderr
    return next(out.glob("headatlas-*.whl"))


def test_the_wheel_holds_one_top_level_package_with_its_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"headatlas"}
    for needed in (
        "headatlas/__init__.py",
        "headatlas/service/api/__init__.py",
        "headatlas/service/api/views.py",
        "headatlas/service/operations/embedded_run.py",
        "headatlas/service/measures/mixing.py",
        "headatlas/service/reports/queries.py",
        "headatlas/service/storage/db.py",
        "headatlas/cli/main.py",
        "headatlas/workers/tasks.py",
        "headatlas/migrations/env.py",
        "headatlas/migrations/versions/0001_initial.py",
        "headatlas/service/data/wiki_excerpt.txt",
        "headatlas/service/data/ATTRIBUTION.md",
        "headatlas/service/web/static/app.js",
        "headatlas/service/web/static/style.css",
    ):
        assert needed in names, needed


def test_installed_only_headatlas_imports(wheel, tmp_path):
    """Unpacked away from the checkout (dependencies from this environment): `import cli`,
    `service`, `workers`, `migrations` fail; `headatlas` and its CLI work."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import importlib, sys\n"
        "sys.path[:0] = [sys.argv[1]]\n"
        "for name in ('cli', 'service', 'workers', 'migrations'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    sys.exit(f'{name} is importable')\n"
        "import headatlas, headatlas.cli.main, headatlas.service.api\n"
        "assert headatlas.service.api.__file__.startswith(sys.argv[1]), headatlas.service.api.__file__\n"
        "assert callable(headatlas.connect) and callable(headatlas.analyze)\n"
        "from headatlas.service.engine.corpus import demo_corpus_path\n"
        "assert demo_corpus_path().is_file() and demo_corpus_path().is_relative_to(sys.argv[1]), demo_corpus_path()\n"
        "from typer.testing import CliRunner\n"
        "result = CliRunner().invoke(headatlas.cli.main.app, ['--help'], prog_name='headatlas')\n"
        "assert result.exit_code == 0 and 'analyze' in result.output, result.output\n"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", code, str(site)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
