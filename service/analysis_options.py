"""Build validated AnalysisParams from user-facing option values (CLI, tasks, schedules)."""

from __future__ import annotations

from service.params import AnalysisParams, Selection


def build_params(*, seq_len: int = 128, windowing: str = "chunks", select: str = "top:0.02", gate: float = 4.0,
                 include_special: bool = False, vectors: str = "pre_wo", short_range: int = 4,
                 dtype: str = "float32", sentences: str = "punct") -> AnalysisParams:
    return AnalysisParams(
        seq_len=seq_len, windowing=windowing, sentences=sentences, select=Selection.parse(select), gate=gate,
        include_special=include_special, vectors=vectors, short_range=short_range, dtype=dtype,
    )
