"""Scoped capture of per-layer activations.

Every captured activation has one canonical name, built by ``act_name``:
``blocks.{layer}.attn.hook_z`` (head outputs, the context layer before W_O) and
``blocks.{layer}.attn.hook_pattern`` (attention probabilities).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from service.model import encoder_layers

KINDS = ("z", "pattern")


def act_name(kind: str, layer: int) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown activation kind {kind!r}; expected one of {KINDS}")
    return f"blocks.{layer}.attn.hook_{kind}"


@contextmanager
def capture_attention(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Capture each layer's context ``[batch, pos, head·d_head]`` and probabilities
    ``[batch, head, pos, key]`` while the block runs; hooks are removed on exit.

    Needs eager attention: under sdpa the probabilities are never materialised.
    """
    store: dict[str, torch.Tensor] = {}
    handles = []
    try:
        for layer, block in enumerate(encoder_layers(model)):
            handles.append(block.attention.self.register_forward_hook(_hook(store, layer)))
        yield store
    finally:
        for handle in handles:
            handle.remove()


def _hook(store: dict[str, torch.Tensor], layer: int):
    def hook(_module, _inputs, output):
        context, probs = output[0], output[1]
        if probs is None:
            raise RuntimeError("attention probabilities were not returned; load the model with eager attention")
        store[act_name("z", layer)] = context
        store[act_name("pattern", layer)] = probs

    return hook
