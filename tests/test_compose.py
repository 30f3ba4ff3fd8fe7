"""docker-compose.yml: the services a distributed deployment needs, and a file Compose accepts."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from conftest import ROOT

from headatlas.service.config import Settings

COMPOSE = ROOT / "docker-compose.yml"


def _compose_cli() -> list[str] | None:
    """`docker compose` (v2 plugin) or Debian's `docker-compose`, when one is installed."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_compose_file_is_accepted_by_compose():
    cli = _compose_cli()
    if cli is None:
        pytest.skip(
            "neither the `docker compose` plugin nor `docker-compose` is installed here (the docker client alone cannot parse compose files)"
        )
    result = subprocess.run(
        [*cli, "-f", str(COMPOSE), "--profile", "cpu", "--profile", "schedule", "--profile", "lake", "config", "-q"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr


def test_compose_services_and_settings():
    yaml = pytest.importorskip("yaml")
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert {"redis", "writer", "worker", "worker-cpu", "beat"} <= services.keys()
    assert "--appendonly" in services["redis"]["command"]
    assert services["writer"]["deploy"]["replicas"] == 1
    assert services["writer"]["command"] == ["headatlas", "writer"]
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert services["worker-cpu"]["profiles"] == ["cpu"]
    assert {"db", "redis-data"} <= spec["volumes"].keys()
    # every HEADATLAS_* variable the file sets is a real setting
    known = {var for var, _default, _help in Settings.help()}
    for name, service in services.items():
        for var in service.get("environment") or {}:
            if var.startswith("HEADATLAS_"):
                assert var in known, f"{name}: {var} is not a setting (see `headatlas config`)"
    # only the writer and beat (short claim transactions for schedule fires) mount the database
    # read-write, each as a single replica
    assert services["beat"]["command"] == ["headatlas", "beat"]
    assert services["beat"]["deploy"]["replicas"] == 1
    for name, service in services.items():
        for volume in service.get("volumes", []):
            if volume.startswith("db:") and name not in ("writer", "beat"):
                assert volume.endswith(":ro"), f"{name} mounts the database read-write"
    # profile lake: PostgreSQL holds the catalogue, a volume the Parquet files, and several writers store
    lake = services["writer-lake"]
    assert services["postgres"]["profiles"] == lake["profiles"] == ["lake"]
    assert (
        lake["environment"]["HEADATLAS_DB"].startswith("ducklake:postgres:")
        and "host=postgres" in (lake["environment"]["HEADATLAS_DB"])
    )
    assert lake["environment"]["HEADATLAS_DATA_PATH"] == "/lake/" and "lake-data:/lake" in lake["volumes"]
    assert lake["deploy"]["replicas"] > 1 and "postgres" in lake["depends_on"]
    assert {"pg-data", "lake-data"} <= spec["volumes"].keys()
