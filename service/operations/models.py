"""The model of a measurement in this process (``inspect``, ``effects``): a spec checked (its
shape and memory, ``seq_len`` against its positions) and loaded, or a model already loaded;
either way checked against ``seq_len`` once it is there.

A notebook calls ``headatlas.inspect`` and ``headatlas.effects`` again and again with one spec:
``keep`` holds the last model loaded for the next call with the same spec and device, checked
once, when it was loaded (its memory is then in use: checking it again would refuse it).
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from headatlas.service.engine.model import LoadedModel


def model_for(model: str | LoadedModel, *, device: str, seq_len: int, keep: bool = False) -> LoadedModel:
    """``model`` loaded on ``device`` (a spec as ``--model`` takes it) or as given, able to read
    windows of ``seq_len`` tokens; ``keep``: the last one loaded is kept for the next call."""
    from headatlas.service.engine.model import LoadedModel, load_model
    from headatlas.service.engine.model_check import check_loaded, check_model_spec

    if isinstance(model, LoadedModel):
        loaded = model
    elif keep:
        loaded = kept_model(model, device)
    else:
        check_model_spec(model, seq_len=seq_len, device=device)  # before the weights load
        loaded = load_model(model, device=device)
    check_loaded(loaded, seq_len)
    return loaded


@lru_cache(maxsize=1)
def kept_model(spec: str, device: str) -> LoadedModel:
    """The model of ``spec`` on ``device``, loaded once for consecutive calls with the same two."""
    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.model_check import check_model_spec

    check_model_spec(spec, seq_len=2, device=device)  # the shape and memory; seq_len is checked per call
    return load_model(spec, device=device)
