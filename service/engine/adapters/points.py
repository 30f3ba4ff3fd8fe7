"""Hook points: the named activations of a model, and where a forward pass exposes them.

A name says *what* is read or replaced; the family's adapter says *where* (``hook_point``: a
module and which of its values). Per layer ``L``:

- ``blocks.L.resid_pre``: the residual stream entering block L (the block's input);
- ``blocks.L.attn_in``: what the attention module receives (``resid_pre``, after the norm in a
  pre-norm block);
- ``blocks.L.attn.z``: the per-head outputs before W_O, ``[batch, pos, head·d_head]``;
- ``blocks.L.attn.pattern``: the attention probabilities ``[batch, head, pos, key]`` (eager attention);
- ``blocks.L.attn.mask``: the attention mask the attention module is handed, ``[batch, 1, pos, key]``
  (additive: 0 where a query sees a key, the dtype's minimum where it does not; or bool, True seen;
  None where the model passes none); a tensor of ``[batch, head, pos, key]`` put in its place masks
  each head apart (the streaming restriction of SPEC §10);
- ``blocks.L.attn_out``: the output projection's output, ``z @ W_O.T + b_O``;
- ``blocks.L.resid_post``: the block's output;

and for the model: ``embed`` (the embedding output: exactly what block 0 receives) and
``unembed`` (the final hidden states, what an LM or masked-LM head reads; for an encoder without a
head, the final states that are pooled).

This module holds the one place a forward hook is registered (``HookPoint.attach``), so that a
name reads and replaces alike whichever module a family exposes it on. It imports nothing of
headatlas: the adapters' registry, the conformance checks and ``service.engine.hooks`` all build
on it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.utils.hooks import RemovableHandle

LAYER_POINTS = ("resid_pre", "attn_in", "attn.mask", "attn.z", "attn.pattern", "attn_out", "resid_post")
MODEL_POINTS = ("embed", "unembed")
# where on its module a point's value is: what the module receives (its first positional argument
# or its ``hidden_states`` keyword), what it returns (the first element of a tuple), or the second
# element of the tuple it returns (eager attention's probabilities), or the ``attention_mask`` keyword
# it is called with
KINDS = ("input", "output", "output[1]", "attention_mask")

_LAYER_NAME = re.compile(r"blocks\.(\d+)\.(.+)")

# fn(value) -> None (read) or the tensor that takes the value's place (replace)
HookFn = Callable[[Any], Any]
# fn(args, kwargs): the whole call of a module (read only)
CallFn = Callable[[tuple, dict[str, Any]], None]


def hook_names(n_layers: int) -> list[str]:
    """Every hook point of a model of ``n_layers`` blocks, in the order a forward pass meets them."""
    return ["embed", *(f"blocks.{layer}.{part}" for layer in range(n_layers) for part in LAYER_POINTS), "unembed"]


def parse_hook_name(name: str) -> tuple[int | None, str]:
    """``(layer, point)`` of a hook point's name (layer None for ``embed`` and ``unembed``); a
    ValueError naming the points there are for any other name."""
    if name in MODEL_POINTS:
        return None, name
    match = _LAYER_NAME.fullmatch(name)
    if match is None or match.group(2) not in LAYER_POINTS:
        raise ValueError(
            f"unknown hook point {name!r}: the points are {', '.join(MODEL_POINTS)} and "
            f"blocks.L.{{{','.join(LAYER_POINTS)}}}"
        )
    return int(match.group(1)), match.group(2)


def input_value(args: tuple, kwargs: dict[str, Any]) -> Any:
    """The hidden states of a module's call (what an ``input`` point reads)."""
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


@dataclass(frozen=True)
class HookPoint:
    """Where the named activation ``name`` is: a value (``kind``, one of ``KINDS``) of ``module``."""

    name: str
    module: torch.nn.Module
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"hook point {self.name}: unknown kind {self.kind!r}; expected one of {KINDS}")

    def attach(self, fn: HookFn) -> RemovableHandle:
        """Call ``fn(value)`` every time the module runs; a tensor it returns replaces the value
        for the rest of the forward pass (None: the value goes on as it was)."""
        if self.kind == "input":

            def pre(_module, args, kwargs):
                if "hidden_states" in kwargs:
                    new = fn(kwargs["hidden_states"])
                    return None if new is None else (args, {**kwargs, "hidden_states": new})
                new = fn(args[0])
                return None if new is None else ((new, *args[1:]), kwargs)

            return self.module.register_forward_pre_hook(pre, with_kwargs=True)
        if self.kind == "attention_mask":

            def masked(_module, args, kwargs):
                if "attention_mask" not in kwargs and len(args) > 1:
                    raise RuntimeError(
                        f"hook point {self.name}: the attention module is not handed its mask as the attention_mask "
                        "keyword; its family's adapter names where it is (hook_point)"
                    )
                new = fn(kwargs.get("attention_mask"))
                return None if new is None else (args, {**kwargs, "attention_mask": new})

            return self.module.register_forward_pre_hook(masked, with_kwargs=True)
        if self.kind == "output":

            def post(_module, _args, output):
                if isinstance(output, tuple):
                    new = fn(output[0])
                    return None if new is None else (new, *output[1:])
                return fn(output)

            return self.module.register_forward_hook(post)

        def second(_module, _args, output):
            probs = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if probs is None:
                raise RuntimeError("attention probabilities were not returned; load the model with eager attention")
            new = fn(probs)
            return None if new is None else (output[0], new, *output[2:])

        return self.module.register_forward_hook(second)

    def attach_call(self, fn: CallFn) -> RemovableHandle:
        """Call ``fn(args, kwargs)`` with the whole call of an ``input`` point's module (the
        effects record each block's call to replay it)."""
        if self.kind != "input":
            raise ValueError(f"hook point {self.name} is a module's {self.kind}, not its call")

        def pre(_module, args, kwargs):
            fn(args, dict(kwargs))

        return self.module.register_forward_pre_hook(pre, with_kwargs=True)


@contextmanager
def attached(hooks: Iterable[tuple[HookPoint, HookFn]]) -> Iterator[None]:
    """Inside: each ``(point, fn)`` attached, in order; every one removed on the way out."""
    handles = []
    try:
        for point, fn in hooks:
            handles.append(point.attach(fn))
        yield
    finally:
        for handle in handles:
            handle.remove()
