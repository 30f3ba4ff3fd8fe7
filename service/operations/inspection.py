"""One text through a model in this process, stored nowhere: the one sequence behind ``headatlas
inspect`` and ``headatlas.inspect``.

The text is read (from the request, or the first document of its file), the model checked and
loaded (or the one given checked against ``seq_len``), the layer and head asked for checked
against the model, and the text's first window read through it: every head's attention and z
(``read``), and for the figures each head's similarity matrix and high-similarity set too
(``inspect``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from headatlas.service.operations.models import model_for
from headatlas.service.operations.requests import InspectionRequest

if TYPE_CHECKING:
    from headatlas.service.engine.model import LoadedModel
    from headatlas.service.reports.inspection import InspectedText, Inspection


def read(request: InspectionRequest) -> InspectedText:
    """The text's first window through the model: token ids and tokens, attention and z."""
    from headatlas.service.reports.inspection import read_text

    text, loaded = _text_and_model(request)
    return read_text(loaded, text, request.params)


def inspect(request: InspectionRequest) -> Inspection:
    """The text's first window through the model, with every head's matrices (the figures')."""
    from headatlas.service.reports.inspection import inspect_text

    text, loaded = _text_and_model(request)
    return inspect_text(loaded, text, request.params)


def _text_and_model(request: InspectionRequest) -> tuple[str, LoadedModel]:
    from headatlas.service.layer_head import check_layer_head
    from headatlas.service.reports.inspection import read_text_file

    if request.file is not None:
        source = request.file
        text = read_text_file(source.spec, text_field=source.text_field, encoding=source.encoding)
    else:
        text = request.text or ""
    loaded = model_for(request.model, device=request.device, seq_len=request.params.seq_len, keep=request.keep_model)
    check_layer_head(request.layer, request.head, n_layers=loaded.n_layers, n_heads=loaded.n_heads, whose="the model")
    return text, loaded
