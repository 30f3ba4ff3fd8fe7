"""docs/usage.md's "Which heads matter: effects", followed as a newcomer would: every line of its
```bash blocks and every ```python block, in order, in a fresh folder, on the shipped excerpt, each
step using what the one before stored. A step that fails, or a ``nan`` anywhere in what any step
prints, fails the test (the sequence once printed NaN for every interval and made a new run where
the user had one).

In place of the real models (minutes to hours of effects on 2 cores): ``random:tiny`` (MiniLM's BERT
family and tokenizer) where a line names no model, ``random:llama`` (SmolLM2's family and
tokenizer) for ``smollm2``, on at most 4 windows (``--effect-windows``, ``--windows``)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from headatlas.cli.main import app

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SECTION = "Which heads matter: effects"
MODELS = {"smollm2": "random:llama", "default": "random:tiny"}
WINDOW_OPTIONS = ("--effect-windows", "--windows")
DECODER_WINDOWS = 4
NAN = re.compile(r"\bnan\b", re.IGNORECASE)


def steps() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    (section,) = [s for s in re.split(r"^## ", text, flags=re.MULTILINE) if s.startswith(SECTION)]
    out: list[tuple[str, str]] = []
    for language, body in re.findall(r"```(\w+)\n(.*?)```", section, flags=re.DOTALL):
        if language == "bash":
            out += [("bash", line) for line in body.splitlines() if line.strip()]
        elif language == "python":
            out.append(("python", body))
    return out


def args_of(line: str) -> list[str]:
    words = shlex.split(line, comments=True)
    assert words[0] == "headatlas", line
    args = [MODELS.get(a, a) if words[i - 1] in ("--model", "-m") else a for i, a in enumerate(words[1:], 1)]
    if args[0] == "analyze" and "--model" not in args:
        args += ["--model", MODELS["default"]]
    if "smollm2" in words:  # a decoder's windows each cost a vocabulary's softmax per ablated copy: 4 of them
        args = [str(min(int(a), DECODER_WINDOWS)) if args[i - 1] in WINDOW_OPTIONS else a for i, a in enumerate(args)]
    return args


def test_the_sections_steps_are_the_newcomers_sequence():
    found = steps()
    commands = [args_of(line)[0] for language, line in found if language == "bash"]
    assert commands[:2] == ["analyze", "effects"] and "prune" in commands and "compare" in commands
    assert any(language == "python" for language, _ in found)


def test_the_effects_section_runs_top_to_bottom_without_nan(tmp_path, monkeypatch, demo_corpus):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text(demo_corpus.read_text(encoding="utf-8"), encoding="utf-8")
    for language, code in steps():
        if language == "python":
            import headatlas

            namespace = {"headatlas": headatlas}
            lines = code.strip().splitlines()
            exec(compile("\n".join(lines[:-1]), "usage.md", "exec"), namespace)
            value = eval(compile(lines[-1].split("  #")[0], "usage.md", "eval"), namespace)  # what a notebook shows
            shown = value.to_string() if hasattr(value, "to_string") else repr(value)
            assert not NAN.search(shown), (code, shown)
            continue
        args = args_of(code)
        result = CliRunner().invoke(app, args, env={"COLUMNS": "100", "NO_COLOR": "1"})
        output = result.stdout + result.stderr
        assert result.exit_code == 0, (code, output[-2000:])
        assert not NAN.search(output), (code, [line for line in output.splitlines() if NAN.search(line)])
