"""Which heads a model needs, measured on a corpus in this process and stored nowhere: the one
sequence behind ``headatlas effects`` and ``headatlas.effects`` (SPEC §9).

The corpus is read through first (a missing or unreadable file is said before any model loads),
then the model is checked and loaded (or the one given checked), what the measurement will cost
told, and every head removed in turn on the windows asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from headatlas.service.operations.events import Estimate, Sink, WindowsMeasured, ignore
from headatlas.service.operations.models import model_for
from headatlas.service.operations.requests import EffectsRequest
from headatlas.service.wording import counted

if TYPE_CHECKING:
    from headatlas.service.operations.effect_runs import EffectTable


def measure(request: EffectsRequest, events: Sink = ignore) -> EffectTable:
    """Every head's effects on ``request``'s corpus (``service.operations.effect_runs``); ``events``
    hears the cost before it starts (``Estimate``) and each batch of windows measured."""
    from headatlas.service.engine.corpus import iter_documents
    from headatlas.service.operations.effect_runs import measure_effects

    corpus = request.corpus
    if not corpus.is_stdin:  # a missing or unreadable corpus is said before the model loads (one line)
        for _ in iter_documents(corpus.spec, text_field=corpus.text_field, encoding=corpus.encoding):
            pass
    loaded = model_for(request.model, device=request.device, seq_len=request.params.seq_len, keep=request.keep_model)
    # gradient, atp: one backward pass; --check-top measures mean ablation beside atp
    ablations = len({k for k in request.kinds if k in ("zero", "mean")} | ({"mean"} if request.check_top else set()))
    passes = loaded.n_heads * (loaded.n_layers + 1) / 2 * ablations
    events(
        Estimate(
            (
                f"measuring {', '.join(request.kinds)} on {counted(request.windows, 'window')}: "
                f"about {passes:.0f} forward passes' worth per window",
            )
        )
    )
    return measure_effects(
        corpus.spec,
        loaded,
        request.params,
        kinds=request.kinds,
        windows=request.windows,
        reference=request.reference,
        batch_size=request.batch_size,
        text_field=corpus.text_field,
        encoding=corpus.encoding,
        on_batch=lambda done, total: events(WindowsMeasured(done, total)),
        check_top=request.check_top,
    )
