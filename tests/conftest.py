"""Shared fixtures. Models are loaded once per test session (loading MiniLM takes seconds)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def real_model():
    """The default model (all-MiniLM-L6-v2, real weights), float32 on CPU."""
    from headatlas.service.engine.model import load_model

    return load_model("default", device="cpu")


@pytest.fixture(scope="session")
def tiny_model():
    """A randomly initialised 2-layer, 4-head BERT (seeded) with the default tokenizer."""
    from headatlas.service.engine.model import load_model

    return load_model("random:tiny", device="cpu")


@pytest.fixture(scope="session")
def demo_corpus() -> Path:
    from headatlas.service.engine.corpus import demo_corpus_path

    return demo_corpus_path()


@pytest.fixture()
def small_corpus(tmp_path, demo_corpus) -> Path:
    """The first two documents of the shipped excerpt: a quick real-text corpus."""
    docs = demo_corpus.read_text(encoding="utf-8").split("\n\n")[:2]
    path = tmp_path / "small.txt"
    path.write_text("\n\n".join(d.strip() for d in docs) + "\n", encoding="utf-8")
    return path


def headatlas_cmd() -> list[str]:
    """The installed console script, running this checkout's code."""
    script = Path(sys.executable).parent / "headatlas"
    return [str(script)] if script.exists() else [sys.executable, "-m", "headatlas.cli.main"]


def run_cli(
    *args: str, env: dict | None = None, input: str | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    return subprocess.run(
        [*headatlas_cmd(), *args], capture_output=True, text=True, env=full_env, input=input, timeout=timeout, cwd=ROOT
    )


@pytest.fixture()
def cli():
    return run_cli


@contextmanager
def attention_inputs(model) -> Iterator[dict[int, torch.Tensor]]:
    """Record, per layer, the hidden states each attention module receives (after any pre-norm):
    what the adapter's ``values`` turns into v, for parity checks against ``A @ v``."""
    adapter = model.adapter
    inputs: dict[int, torch.Tensor] = {}
    handles = [
        adapter.attention(block).register_forward_pre_hook(
            lambda _m, args, kwargs, layer=layer: inputs.__setitem__(layer, adapter.attention_input(args, kwargs)),
            with_kwargs=True,
        )
        for layer, block in enumerate(adapter.blocks(model.model))
    ]
    try:
        yield inputs
    finally:
        for handle in handles:
            handle.remove()


@pytest.fixture(scope="session")
def lake_template(tmp_path_factory):
    """A lake migrated to the head revision, copied for each test (lake_support)."""
    import lake_support

    why = lake_support.unavailable()
    if why:
        pytest.skip(why)
    from headatlas.service.storage import db

    template = lake_support.new_lake(tmp_path_factory.mktemp("lake-template"))
    db.upgrade(template.backend())
    template.release()
    yield template
    lake_support.remove_lake(template)


@pytest.fixture()
def lake(lake_template, tmp_path, monkeypatch):
    """A lake of this test's own (catalogue in PostgreSQL, data under tmp_path), dropped after;
    HEADATLAS_DATA_PATH names its data folder for the test."""
    import lake_support

    made = lake_support.new_lake(tmp_path, template=lake_template)
    monkeypatch.setenv("HEADATLAS_DATA_PATH", str(made.data_path))
    yield made
    lake_support.remove_lake(made)
