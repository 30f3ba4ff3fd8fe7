"""Build validated AnalysisParams from user-facing option values (CLI, tasks, schedules)."""

from __future__ import annotations

from headatlas.service.params import AnalysisParams, Selection


def build_params(
    *,
    seq_len: int = 128,
    windowing: str = "chunks",
    select: str = "top:0.02",
    gate: float = 4.0,
    include_special: bool = False,
    vectors: str = "pre_wo",
    short_range: int = 4,
    dtype: str = "float32",
    sentences: str = "segmenter",
    attribution: bool = False,
    mixing: list[str] | tuple[str, ...] = (),
    attribution_windows: int = 256,
    csm_bin: int = 8,
) -> AnalysisParams:
    return AnalysisParams(
        seq_len=seq_len,
        windowing=windowing,
        sentences=sentences,
        select=Selection.parse(select),
        gate=gate,
        include_special=include_special,
        vectors=vectors,
        short_range=short_range,
        dtype=dtype,
        attribution=attribution,
        mixing=parse_mixing(mixing),
        attribution_windows=attribution_windows,
        csm_bin=csm_bin,
    )


def parse_mixing(values) -> tuple[str, ...]:
    """``--mixing`` values, repeated and/or comma-separated, deduplicated in canonical order."""
    from headatlas.service.params import MIXING

    given = [part.strip().lower() for value in values for part in str(value).split(",") if part.strip()]
    unknown = [m for m in given if m not in MIXING]
    if unknown:
        from headatlas.service.errors import ParameterError

        raise ParameterError(f"--mixing {unknown[0]!r}: choose from {', '.join(MIXING)} (several allowed)")
    return tuple(m for m in MIXING if m in given)
