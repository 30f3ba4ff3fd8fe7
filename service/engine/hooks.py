"""Scoped capture of per-layer activations, for every model family through its adapter.

Every captured activation has one canonical name, built by ``act_name``:
``blocks.{layer}.attn.hook_z`` (head outputs, the context layer before W_O) and
``blocks.{layer}.attn.hook_pattern`` (attention probabilities).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from headatlas.service.engine.adapters import adapter_for

KINDS = ("z", "pattern")


def act_name(kind: str, layer: int) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown activation kind {kind!r}; expected one of {KINDS}")
    return f"blocks.{layer}.attn.hook_{kind}"


LayerCallback = Callable[[int, torch.Tensor, torch.Tensor], None]


@contextmanager
def capture_attention(
    model: torch.nn.Module, on_layer: LayerCallback | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """Capture each layer's context ``[batch, pos, head·d_head]`` and probabilities
    ``[batch, head, pos, key]`` while the block runs; hooks are removed on exit.

    Without ``on_layer`` the activations are kept in the yielded dict under their canonical
    names. With it, ``on_layer(layer, context, probs)`` is called as each layer finishes and
    nothing is kept: the next layer reuses the memory, so a forward pass holds one layer's
    attention map at a time instead of all of them.

    Needs eager attention: under sdpa the probabilities are never materialised.
    """
    store: dict[str, torch.Tensor] = {}
    adapter = adapter_for(model)
    adapter.ensure_eager(model)
    handles = []
    try:
        for layer, block in enumerate(adapter.blocks(model)):
            handles += adapter.capture(block, _emit(store, layer, on_layer))
        yield store
    finally:
        for handle in handles:
            handle.remove()


def _emit(store: dict[str, torch.Tensor], layer: int, on_layer: LayerCallback | None):
    def emit(context: torch.Tensor, probs: torch.Tensor) -> None:
        if on_layer is not None:
            on_layer(layer, context, probs)
            return
        store[act_name("z", layer)] = context
        store[act_name("pattern", layer)] = probs

    return emit
