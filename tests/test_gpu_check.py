"""benchmarks/gpu_check.py (`make gpu-check`) runs, in its small mode on the CPU, and refuses to
report a ratio from fewer windows than asked."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check  # noqa: E402


def test_small_mode_measures_each_shape(capsys):
    gpu_check.main(["--small", "--device", "cpu", "--dtype", "float32", "--windows", "24", "--decoder-windows", "12"])
    out = capsys.readouterr().out
    for shape in ("BERT-base shape", "SmolLM2 shape"):
        (line,) = [s for s in out.splitlines() if s.startswith(f"gpu-check, {shape}") and "the bare forward" in s]
        windows = int(re.search(r"([\d,]+) windows in", line).group(1).replace(",", ""))
        assert windows >= (24 if shape.startswith("BERT") else 12), line
        assert re.search(r": [\d,]+ windows/s;", line) and "done" in line, line
        shares = [
            s.split("share of the run: ")[1]
            for s in out.splitlines()
            if s.startswith(f"gpu-check, {shape}") and "share" in s
        ]
        stages = [s.rsplit(": ", 1)[0] for s in shares]
        assert stages[0] == "analysis (forward, hooks, statistics)" and stages[1].startswith("preparation"), shares
        assert stages[2:] == ["storing", "bare forward (timed alone)"], shares
        assert all(re.fullmatch(r"[\d.]+ s, \d+%", s.rsplit(": ", 1)[1]) for s in shares), shares


def test_fewer_windows_than_asked_are_refused(small_corpus):
    args = ["--small", "--device", "cpu", "--dtype", "float32", "--corpus", str(small_corpus), "--only", "encoder"]
    with pytest.raises(SystemExit, match=r"gives [\d,]+ windows of the 5,000 asked: no ratio"):
        gpu_check.main([*args, "--windows", "5000"])
