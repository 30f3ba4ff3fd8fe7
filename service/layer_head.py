"""A layer and a head named by a user, checked against a model's shape: the one check behind every
front end's ``layer``/``head`` (a stored run's, an inspected text's model, run A of a comparison).

A leaf (it reads only the errors), so that the reports beneath the operations and the operations
themselves refuse a layer or head the same way, in each front end's terms: ``--layer 7`` on the
command line, ``layer=7`` in Python, ``?layer=7`` in the web app.
"""

from __future__ import annotations

from collections.abc import Sequence

from headatlas.service.errors import Param, ParameterError, Part, Placeholder


def check_layer_head(
    layer: int | None,
    head: int | None,
    *,
    n_layers: int,
    n_heads: int,
    whose: str,
) -> None:
    """``layer`` and ``head`` (0-based; None: not named) within ``n_layers`` × ``n_heads``, refused
    naming whose shape it is (``whose``: ``run 3``, ``the model``)."""
    if layer is not None and not 0 <= layer < n_layers:
        raise ParameterError(Param("layer", layer), f": {whose} has layers 0..{n_layers - 1} (0-based)")
    if head is not None and not 0 <= head < n_heads:
        raise ParameterError(Param("head", head), f": {whose} has heads 0..{n_heads - 1} (0-based)")


# what follows ``--head H needs --layer``: where the layer is asked for as a number, and where a
# head alone would mean something else (every head of that index)
PASS_LAYER: tuple[Part, ...] = (": pass ", Param("layer", Placeholder("L")), " (0-based) as well")
NAMED_BY_LAYER: tuple[Part, ...] = (": a head is named by its layer and its index",)


def check_head_has_layer(layer: int | None, head: int | None, *, then: Sequence[Part] = PASS_LAYER) -> None:
    """A head is named by its layer: ``head`` without ``layer`` is refused, ``then`` saying why."""
    if head is not None and layer is None:
        raise ParameterError(Param("head", head), " needs ", Param("layer"), *then)
