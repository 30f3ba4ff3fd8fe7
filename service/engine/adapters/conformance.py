"""The conformance checks of a model family: what its adapter says against what its model computes.

``check(adapter, model, input_ids, attention_mask)`` runs one forward pass with every hook point
of the checks attached and compares, in order (the first that fails is named):

- ``blocks``: the adapter's blocks are as many as the config's layers;
- ``attn.pattern``: the captured probabilities are the model's own ``output_attentions``;
- ``attn.z``: each head's z is ``A @ v`` of its key-value group (``values`` of ``attn_in``), on
  the unpadded positions;
- ``attn_out``: ``z @ W_O.T`` (``output_weight``) plus the bias is the output projection's output;
- ``embed``: the embedding output is exactly what block 0 receives (``blocks.0.resid_pre``);
- ``attention_norm``: the norm the block applies to the attention's input (pre-norm) or to the
  residual sum after it (post-norm);
- ``final_norm``: the last block's output through ``final_norm`` is the model's output;
- ``unembed``: the ``unembed`` point holds the model's output (the final hidden states).

``conform(adapter)`` runs them on a tiny random model of the family (a few layers, heads and
positions, on the CPU, well under a second): a plugin family that fails is refused when it is
registered, with the check named. tests/test_adapters.py runs the same checks on every family's
random models and on real windows.
"""

from __future__ import annotations

from typing import Any

import torch

from headatlas.service.engine.adapters.points import HookPoint, attached
from headatlas.service.errors import AdapterIncomplete

CHECKS = ("blocks", "attn.pattern", "attn.z", "attn_out", "embed", "attention_norm", "final_norm", "unembed")
RTOL, ATOL = 1e-4, 1e-5


class Failed(Exception):
    """One conformance check failed: ``check`` (one of ``CHECKS``) and what was seen."""

    def __init__(self, check: str, seen: str) -> None:
        super().__init__(f"{check}: {seen}")
        self.check, self.seen = check, seen


def _same(a: Any, b: Any, exact: bool = False) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
        return False
    return bool(torch.equal(a, b)) if exact else bool(torch.allclose(a.float(), b.float(), rtol=RTOL, atol=ATOL))


def _shape(value: Any) -> str:
    return "x".join(map(str, value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def check(adapter: Any, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """Raise ``Failed`` naming the first check of ``CHECKS`` that ``adapter`` fails on ``model``
    (its base model, eager attention, eval mode) for a batch with ``attention_mask``."""
    blocks = adapter.blocks(model)
    shape = adapter.shape(model.config)
    if len(blocks) != shape.n_layers:
        raise Failed("blocks", f"the adapter gives {len(blocks)} blocks, the config says {shape.n_layers} layers")
    seen: dict[str, Any] = {}

    def keep(name: str):
        def fn(value: Any) -> None:
            seen[name] = value

        return fn

    last = len(blocks) - 1
    names = ["embed", "unembed", f"blocks.{last}.resid_post"]
    for layer in range(len(blocks)):
        names += [f"blocks.{layer}.{part}" for part in ("resid_pre", "attn_in", "attn.z", "attn.pattern", "attn_out")]
    points: list[tuple[HookPoint, Any]] = [(adapter.hook_point(model, name), keep(name)) for name in names]
    norm = adapter.attention_norm(blocks[0])
    points += [
        (HookPoint("attention_norm input", norm, "input"), keep("norm_in")),
        (HookPoint("attention_norm output", norm, "output"), keep("norm_out")),
    ]
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, "output_attentions": True}
    if adapter.causal:
        kwargs["use_cache"] = False
    with attached(points), torch.inference_mode():
        out = model(**kwargs)
    final_states = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    attentions = getattr(out, "attentions", None) or ()

    valid = attention_mask.bool()
    groups = torch.arange(shape.n_heads) // shape.group_size
    for layer, block in enumerate(blocks):
        pattern = seen.get(f"blocks.{layer}.attn.pattern")
        if layer >= len(attentions) or not _same(pattern, attentions[layer], exact=True):
            raise Failed("attn.pattern", f"layer {layer}'s captured pattern is not the model's output_attentions")
        assert isinstance(pattern, torch.Tensor)  # _same holds only for tensors
        z = seen.get(f"blocks.{layer}.attn.z")
        width = shape.n_heads * shape.d_head
        if not isinstance(z, torch.Tensor) or z.shape[-1] != width:
            raise Failed("attn.z", f"layer {layer}'s z is {_shape(z)}, not [batch, pos, {width}]")
        with torch.inference_mode():
            v = adapter.values(block, seen[f"blocks.{layer}.attn_in"])  # [batch, kv_head, pos, d_head]
            expected = torch.matmul(pattern.to(v.dtype), v[:, groups])  # [batch, head, pos, d_head]
        heads = z.view(*z.shape[:2], shape.n_heads, shape.d_head).transpose(1, 2)
        rows = valid[:, None].expand_as(heads[..., 0])
        if not _same(heads[rows], expected[rows]):
            raise Failed("attn.z", f"layer {layer}'s z is not the pattern times the values of each head's group")
        proj = adapter.output_projection(block)
        bias = getattr(proj, "bias", None)
        with torch.inference_mode():
            w_o = adapter.output_weight(block)
            projected = z @ w_o.T + (0 if bias is None else bias)
        if not _same(projected, seen.get(f"blocks.{layer}.attn_out")):
            raise Failed("attn_out", f"layer {layer}'s z @ W_O.T + b_O is not the output projection's output")
    x0 = seen.get("blocks.0.resid_pre")
    if not _same(seen.get("embed"), x0, exact=True):
        raise Failed(
            "embed",
            f"the embedding output ({_shape(seen.get('embed'))}) is not what block 0 receives ({_shape(x0)})",
        )
    if adapter.pre_norm:
        ok = _same(seen.get("norm_out"), seen.get("blocks.0.attn_in"), exact=True) and _same(
            seen.get("norm_in"), x0, exact=True
        )
    else:
        ok = _same(seen.get("blocks.0.attn_in"), x0, exact=True) and _same(
            seen.get("norm_in"), x0 + seen["blocks.0.attn_out"]
        )
    if not ok:
        where = "the attention's input" if adapter.pre_norm else "the residual sum after the attention"
        raise Failed("attention_norm", f"block 0's attention_norm is not the norm of {where}")
    final = adapter.final_norm(model)
    with torch.inference_mode():
        last_out = seen.get(f"blocks.{last}.resid_post")
        replayed = last_out if final is None else final(last_out)
    if not _same(replayed, final_states):
        raise Failed("final_norm", "the last block's output through final_norm is not the model's output")
    if not _same(seen.get("unembed"), final_states, exact=True):
        raise Failed("unembed", f"the unembed point ({_shape(seen.get('unembed'))}) is not the model's output")


def tiny_shape(adapter: Any) -> Any:
    """The smallest named random shape of the family, cut to 2 layers and at most 2 key-value
    heads of 2 query heads each, 8 wide."""
    from dataclasses import replace

    shape = min(adapter.random_shapes.values(), key=lambda s: s.layers * s.hidden)
    kv = min(shape.kv_heads or shape.heads, 2)
    group = min(shape.heads // (shape.kv_heads or shape.heads), 2)
    heads = kv * group
    return replace(
        shape,
        layers=min(shape.layers, 2),
        heads=heads,
        kv_heads=kv if shape.kv_heads not in (None, shape.heads) else None,
        hidden=heads * 8,
        intermediate=None,
        mlm=False,
        positions=None,
    )


def conform(adapter: Any) -> None:
    """Run the checks on a tiny random model of ``adapter``'s family (seeded, the caller's random
    state left as it was); AdapterIncomplete, one line naming the failing check, if one fails."""
    name = getattr(adapter, "family", type(adapter).__name__)
    try:
        shape = tiny_shape(adapter)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = adapter.random_model(adapter.random_config(shape, 128))
            model.eval()
            input_ids = torch.randint(3, 128, (2, 7))
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, 5:] = 0  # a padded window
        check(adapter, model, input_ids, attention_mask)
    except Failed as failed:
        raise AdapterIncomplete(
            f"model family {name!r} fails the conformance check {failed.check!r}: {failed.seen} "
            "(docs/architecture.md, Hook points)"
        ) from None
    except Exception as exc:  # noqa: BLE001 - a family whose tiny model cannot even run is refused alike
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise AdapterIncomplete(
            f"model family {name!r} fails the conformance checks: its tiny random model does not run "
            f"({type(exc).__name__}: {first})"
        ) from None
