"""A model measured in this process, nothing stored: ``inspect`` (one text's attention, z and
similarity matrices) and ``effects`` (which heads the model needs)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from headatlas.service.analysis_options import DEFAULTS
from headatlas.service.api.tables import Table
from headatlas.service.api.terms import in_python_terms
from headatlas.service.operations.models import kept_model

if TYPE_CHECKING:
    from headatlas.service.engine.model import LoadedModel
    from headatlas.service.reports.inspection import InspectedText


@in_python_terms
def inspect(
    text: str,
    model: str | LoadedModel = DEFAULTS["model"],
    seq_len: int = DEFAULTS["seq_len"],
    *,
    device: str = DEFAULTS["device"],
) -> InspectedText:
    """One text through a model, nothing stored: the first window's token ids and tokens,
    ``attention`` ``[layer, head, query, key]``, ``z`` ``[layer, head, pos, d_head]`` (each head's
    output before W_O) and ``csm(layer, head)`` ``[n, n]`` (``C = z zᵀ``, ``C_ii = 0``), as numpy
    arrays; ``model``, ``causal``, ``n_layers``, ``n_heads``. The window is the one ``analyze``
    would make first (``seq_len`` tokens at most, specials included); ``truncated`` says whether
    the text went on. ``model``: a spec as ``--model`` takes it (the last one loaded is kept for
    the next call) or a model from ``headatlas.service.engine.model.load_model``."""
    from headatlas.service.operations.inspection import read
    from headatlas.service.operations.requests import InspectionRequest

    return read(InspectionRequest.build(text, model=model, seq_len=seq_len, device=device, keep_model=True))


# the model kept for the next call (service/operations/models.py), by the name its tests know
_inspect_model = kept_model


@in_python_terms
def effects(
    corpus: str | Path,
    model: str | LoadedModel = DEFAULTS["model"],
    *,
    kinds: str = "zero,mean",
    windows: int = 16,
    reference: int = 256,
    seq_len: int = DEFAULTS["seq_len"],
    batch_size: int = 4,
    device: str = DEFAULTS["device"],
    check_top: int = 0,
) -> Table:
    """Which heads the model needs (SPEC §9), measured on ``corpus`` in this process, nothing
    stored: one row per head with ``effect_zero``/``effect_mean`` (O(ablated) − O(intact), the
    model's own objective) and ``importance`` (``kinds`` with ``gradient``), each with its 95%
    interval (``_lo``, ``_hi``), ``effect_atp`` (``kinds`` with ``atp``: attribution patching, the
    first-order estimate of ``effect_mean``), and the output drift of each ablation. ``.notes``
    says what the effects are measured against; ``check_top`` K > 0 (with ``atp``): AtP checked
    against exact mean ablation (Spearman's ρ over the heads, top-K recall, the exact effects of
    AtP's top K), in ``.notes``. The same as ``headatlas effects``."""
    from headatlas.service.operations.effects import measure
    from headatlas.service.operations.requests import EffectsRequest

    request = EffectsRequest.build(
        corpus,
        kinds=kinds,
        windows=windows,
        reference=reference,
        keep_model=True,
        model=model,
        seq_len=seq_len,
        batch_size=batch_size,
        device=device,
        check_top=check_top,
    )
    result = measure(request)
    notes = [result.note()] + ([result.check.describe(result.unit)] if result.check is not None else [])
    return Table.of(result.columns, result.rows, what=f"head effects: {result.model}", notes=notes)
