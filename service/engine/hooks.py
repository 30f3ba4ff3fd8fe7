"""Scoped hooks on named hook points, for every model family through its adapter.

A hook point is named (``service.engine.adapters.points``): ``embed``, ``blocks.L.resid_pre``,
``blocks.L.attn_in``, ``blocks.L.attn.z``, ``blocks.L.attn.pattern``, ``blocks.L.attn_out``,
``blocks.L.resid_post``, ``unembed``; the model's adapter says where each one is
(``ModelAdapter.hook_point``). ``hooks(model, {name: fn})`` attaches ``fn`` to each point for the
duration of a ``with`` block: ``fn(value)`` reads the activation, and a tensor it returns replaces
it (intervention). Captured activations are keyed by the same names (``act_name``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch

from headatlas.service.engine.adapters import ModelAdapter, adapter_for
from headatlas.service.engine.adapters.points import HookFn, HookPoint, attached, hook_names, parse_hook_name

KINDS = ("z", "pattern")

__all__ = [
    "HookFn",
    "HookPoint",
    "act_name",
    "block_calls",
    "capture_attention",
    "hook_names",
    "hooks",
    "parse_hook_name",
]


def act_name(kind: str, layer: int) -> str:
    """The hook point of layer ``layer``'s head outputs (``z``) or attention probabilities (``pattern``)."""
    if kind not in KINDS:
        raise ValueError(f"unknown activation kind {kind!r}; expected one of {KINDS}")
    return f"blocks.{layer}.attn.{kind}"


@contextmanager
def hooks(model: torch.nn.Module, fns: Mapping[str, HookFn], adapter: ModelAdapter | None = None) -> Iterator[None]:
    """Inside: ``fns[name]`` attached to each named hook point of ``model`` (the base model), in
    the order given; removed on exit. ``fn(value)`` returning a tensor replaces the value."""
    adapter = adapter or adapter_for(model)
    points = [(adapter.hook_point(model, name), fn) for name, fn in fns.items()]
    with attached(points):
        yield


@contextmanager
def block_calls(model: torch.nn.Module, adapter: ModelAdapter | None = None) -> Iterator[list]:
    """Inside: every block's call recorded, at its ``blocks.L.resid_pre`` point, as ``(args,
    kwargs)`` in the yielded list (index: the layer; None until the block runs)."""
    adapter = adapter or adapter_for(model)
    n_layers = len(adapter.blocks(model))
    calls: list = [None] * n_layers

    def keep(layer: int):
        def fn(args: tuple, kwargs: dict) -> None:
            calls[layer] = (args, kwargs)

        return fn

    handles = []
    try:
        for layer in range(n_layers):
            handles.append(adapter.hook_point(model, f"blocks.{layer}.resid_pre").attach_call(keep(layer)))
        yield calls
    finally:
        for handle in handles:
            handle.remove()


LayerCallback = Callable[[int, torch.Tensor, torch.Tensor], None]


@contextmanager
def capture_attention(
    model: torch.nn.Module, on_layer: LayerCallback | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """Capture each layer's ``blocks.L.attn.z`` ``[batch, pos, head·d_head]`` and
    ``blocks.L.attn.pattern`` ``[batch, head, pos, key]`` while the block runs; hooks are removed
    on exit.

    Without ``on_layer`` the activations are kept in the yielded dict under their names. With it,
    ``on_layer(layer, z, pattern)`` is called as soon as a layer has given both and nothing is
    kept: the next layer reuses the memory, so a forward pass holds one layer's attention map at a
    time instead of all of them.

    Needs eager attention: under sdpa the probabilities are never materialised.
    """
    store: dict[str, torch.Tensor] = {}
    adapter = adapter_for(model)
    adapter.ensure_eager(model)
    fns: dict[str, HookFn] = {}
    for layer in range(len(adapter.blocks(model))):
        pending: dict[str, torch.Tensor] = {}
        for kind in KINDS:
            fns[act_name(kind, layer)] = _take(store, pending, layer, kind, on_layer)
    with hooks(model, fns, adapter):
        yield store


def _take(store: dict, pending: dict, layer: int, kind: str, on_layer: LayerCallback | None) -> HookFn:
    """The reader of one layer's z or pattern: once both have come (in whichever order the
    family's modules give them), the pair goes to ``on_layer`` or into ``store``."""

    def take(value: torch.Tensor) -> None:
        if on_layer is None:
            store[act_name(kind, layer)] = value
            return
        pending[kind] = value
        if len(pending) == len(KINDS):
            z, pattern = pending.pop("z"), pending.pop("pattern")
            on_layer(layer, z, pattern)

    return take
