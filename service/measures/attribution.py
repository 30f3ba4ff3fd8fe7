"""Hidden-token attribution by gradients (SPEC §6), batched.

For output token i of head (l, h): ``g_ij = ‖∂(Σ_k z_ik)/∂e_j‖₂`` with ``e`` the output of the
embedding layer (the input of block 0: BERT's embeddings module, GPT-2's token plus position
embeddings, Llama's token embeddings; rotary positions act inside attention) and ``z`` the head output (the context layer before W_O); rows are normalised,
``ĝ_ij = g_ij / Σ_j' g_ij'``. The layer-level row (head slot -1) uses the block output
``h^l_i`` instead of one head's ``z``: how much of token i's layer-l representation comes from
each input token.

Cost is one backward pass per (layer, unit, output token). Three things keep it tractable:
  * windows in a batch do not interact, so the same output index of every window shares one
    backward pass (the outputs are summed over the batch before differentiating);
  * the passes run vmapped (``torch.autograd.grad(..., is_grads_batched=True)``), ``chunk_size``
    gradient rows at a time — that parameter bounds the memory;
  * layer l's outputs are differentiated on their own, so the backward stops at layer 0 having
    crossed only l + 1 blocks.

Pure tensor code: imports neither Celery, Typer nor SQLAlchemy.
Dimension names: batch, layer, unit (head, then the layer-level slot), pos (query), key, d_model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from headatlas.service.engine.adapters import ModelAdapter, adapter_for
from headatlas.service.engine.hooks import act_name, capture_attention
from headatlas.service.engine.model import LoadedModel, model_blocks
from headatlas.service.measures.blocks import parts

DEFAULT_CHUNK = 2048  # gradient rows (windows × outputs) per batched backward call


@dataclass
class Trace:
    """One forward pass with every tensor the mixing measures need, per layer.

    embeddings: ``[batch, pos, d_model]`` (a leaf when traced with gradients);
    z: ``[batch, pos, head·d_head]``; probs: ``[batch, head, pos, key]``;
    resid_pre / resid_post: block input / output ``[batch, pos, d_model]``; attn_in: the attention's
    input ``[batch, pos, d_model]`` (resid_pre for post-norm blocks, its pre-norm otherwise).
    """

    embeddings: torch.Tensor
    z: list[torch.Tensor]
    probs: list[torch.Tensor]
    resid_pre: list[torch.Tensor]
    resid_post: list[torch.Tensor]
    attn_in: list[torch.Tensor]


@contextmanager
def _replace_embeddings(
    model: torch.nn.Module, adapter: ModelAdapter, store: dict, embeddings: torch.Tensor | None, grad: bool
) -> Iterator[None]:
    """Make the embedding output a tensor we own: a fresh leaf (to differentiate against), or
    ``embeddings`` given by the caller (to evaluate the model at a perturbed point)."""

    def hook(_module, _inputs, output):
        e = embeddings if embeddings is not None else output.detach()
        if grad and not e.requires_grad:
            e = e.requires_grad_(True)
        store["e"] = e
        return e

    handle = parts(adapter).embedding_output(model).register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def _capture_residual(blocks, adapter: ModelAdapter, store: dict) -> Iterator[None]:
    handles = []

    def pre(layer):
        def hook(_module, args, kwargs):
            store.setdefault("pre", {})[layer] = args[0] if args else kwargs["hidden_states"]

        return hook

    def post(layer):
        def hook(_module, _inputs, output):
            store.setdefault("post", {})[layer] = output[0] if isinstance(output, tuple) else output

        return hook

    def attn_in(layer):
        def hook(_module, args, kwargs):
            store.setdefault("attn_in", {})[layer] = adapter.attention_input(args, kwargs)

        return hook

    try:
        for layer, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(pre(layer), with_kwargs=True))
            handles.append(block.register_forward_hook(post(layer)))
            handles.append(adapter.attention(block).register_forward_pre_hook(attn_in(layer), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def trace(
    model: LoadedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    grad: bool = False,
    embeddings: torch.Tensor | None = None,
) -> Trace:
    """Forward ``[batch, pos]`` inputs, keeping the graph from the embeddings when ``grad``."""
    blocks = model_blocks(model.model)
    adapter = adapter_for(model.model)
    store: dict = {}
    ctx = torch.enable_grad() if grad else torch.no_grad()
    with (
        ctx,
        _replace_embeddings(model.model, adapter, store, embeddings, grad),
        _capture_residual(blocks, adapter, store),
        capture_attention(model.model) as acts,
    ):
        model.model(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device))
    n = len(blocks)
    return Trace(
        embeddings=store["e"],
        z=[acts[act_name("z", layer)] for layer in range(n)],
        probs=[acts[act_name("pattern", layer)] for layer in range(n)],
        resid_pre=[store["pre"][layer] for layer in range(n)],
        resid_post=[store["post"][layer] for layer in range(n)],
        attn_in=[store["attn_in"][layer] for layer in range(n)],
    )


def unit_outputs(tr: Trace, layer: int, n_heads: int, *, heads: bool = True, hidden: bool = True) -> torch.Tensor:
    """The scalars to differentiate at one layer, ``[batch, unit, pos]``: ``Σ_k z_ik`` per head,
    then ``Σ_k h^l_ik`` (layer output) when ``hidden``."""
    parts = []
    if heads:
        z = tr.z[layer]
        batch, n_pos, width = z.shape
        parts.append(z.view(batch, n_pos, n_heads, width // n_heads).sum(-1).transpose(1, 2))
    if hidden:
        parts.append(tr.resid_post[layer].sum(-1)[:, None, :])
    return torch.cat(parts, 1)


def gradient_norms(
    model: LoadedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    heads: bool = True,
    hidden: bool = True,
    chunk_size: int = DEFAULT_CHUNK,
    batched: bool = True,
) -> torch.Tensor:
    """Unnormalised ``g`` ``[batch, layer, unit, pos, key]`` float32 (units: the heads when
    ``heads``, then the layer output when ``hidden``). Pad keys and pad query rows are 0.

    ``batched=False`` runs one backward pass per output (the reference the batched path is
    checked against, and the benchmark's baseline).
    """
    if not (heads or hidden):
        raise ValueError("nothing to attribute: pass heads=True and/or hidden=True")
    tr = trace(model, input_ids, attention_mask, grad=True)
    e = tr.embeddings  # [batch, pos, d_model]
    batch, n_pos, _ = e.shape
    valid = attention_mask.to(e.device).bool()
    n_units = (model.n_heads if heads else 0) + (1 if hidden else 0)
    out = torch.zeros(batch, model.n_layers, n_units, n_pos, n_pos, dtype=torch.float32, device=e.device)
    per_call = max(1, chunk_size // batch)
    for layer in range(model.n_layers):
        # Σ over the batch: window b's outputs depend on e[b] only, so one backward pass per
        # output index serves every window.
        s = unit_outputs(tr, layer, model.n_heads, heads=heads, hidden=hidden).sum(0).flatten()  # [unit·pos]
        n_rows = s.shape[0]
        last = layer == model.n_layers - 1
        if batched:
            for start in range(0, n_rows, per_call):
                rows = torch.arange(start, min(start + per_call, n_rows), device=e.device)
                cotangent = torch.zeros(len(rows), n_rows, dtype=s.dtype, device=e.device)
                cotangent[torch.arange(len(rows)), rows] = 1
                (g,) = torch.autograd.grad(
                    s, e, cotangent, is_grads_batched=True, retain_graph=not (last and start + per_call >= n_rows)
                )  # [row, batch, key, d_model]
                norms = g.float().norm(dim=-1).permute(1, 0, 2)  # [batch, row, key]
                unit, pos = rows // n_pos, rows % n_pos
                out[:, layer, unit, pos] = norms
        else:
            for row in range(n_rows):
                (g,) = torch.autograd.grad(s[row], e, retain_graph=not (last and row == n_rows - 1))
                out[:, layer, row // n_pos, row % n_pos] = g.float().norm(dim=-1)
    mask = (valid[:, :, None] & valid[:, None, :]).float()  # [batch, pos, key]
    return out * mask[:, None, None]


def normalise_rows(g: torch.Tensor) -> torch.Tensor:
    """``ĝ = g / Σ_key g`` over the last dimension; all-zero rows (pads) stay zero."""
    total = g.sum(-1, keepdim=True)
    return torch.where(total > 0, g / total.clamp_min(torch.finfo(g.dtype).tiny), torch.zeros_like(g))


def attribution(
    model: LoadedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, chunk_size: int = DEFAULT_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised attribution rows: per head ``[batch, layer, head, pos, key]`` and of the
    layer output ``[batch, layer, pos, key]``."""
    g = normalise_rows(gradient_norms(model, input_ids, attention_mask, chunk_size=chunk_size))
    return g[:, :, : model.n_heads], g[:, :, model.n_heads]
