"""How much each input token contributes to each output position: forward-only measures
(SPEC §6) and the additive per-(layer, head) sums shared by every method.

Methods and what a row ``M_i·`` (over keys j, summing to 1) means:
  attention    the head's attention row ``A_i·``; layer slot: mean over heads.
  attribution  normalised gradient norms (service.measures.attribution); layer slot: the block output.
  rollout      ``(0.5·A^h + 0.5·I) R_{l-1}`` per head, ``R_l = (0.5·mean_h A + 0.5·I) R_{l-1}``
               for the layer (Abnar & Zuidema 2020), ``R_{-1} = I``. Heads average to the layer.
  norm         ``‖A_ij f_h(x_j)‖`` with ``f_h(x) = (x W_V + b_V) W_O^h`` per head, x the attention's
               input (after the pre-norm of GPT-2 and Llama blocks), head h reading value head
               ``h // (H/H_kv)``; layer slot ``‖Σ_h A^h_ij f_h(x_j)‖`` (Kobayashi et al. 2020).
               Not composed across layers.
  alti         layer slot only: Ferrando et al. 2022 — the attention block's output (residual and
               norm included) decomposed into per-token vectors T_i(x_j); post-norm blocks
               (BERT) linearise the LayerNorm with the token's own scale, pre-norm blocks (GPT-2,
               Llama) need no linearisation (the norm acts on each token alone);
               ``c_ij = max(0, ‖y_i‖₁ − ‖y_i − T_i(x_j)‖₁)``, normalised, then composed across
               layers like rollout.

Causal models use the same formulas: their attention is lower-triangular, and so is every row.

Every method's rows are reduced to the same additive sums per (layer, slot): mass to
[CLS]/[SEP]/`.`,`,`/self/previous/next, row entropy, Jensen–Shannon divergence (base 2) to
the attention row, distance sum and a mass-by-|i−j| histogram. Slot ``n_heads`` is the
layer-level row, stored as head -1.

Pure tensor code: imports neither Celery, Typer nor SQLAlchemy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from headatlas.service.engine.adapters import ModelAdapter, adapter_of_block
from headatlas.service.engine.features import WindowFeatures
from headatlas.service.engine.model import LoadedModel, model_blocks
from headatlas.service.engine.results import FORWARD_MIXING, MIX_SUMS, MIXING_METHODS  # noqa: F401 - MIX_SUMS re-exported
from headatlas.service.engine.stats import attention_sums


# --- the measures ------------------------------------------------------------------------------
def rollout(probs: list[torch.Tensor], valid: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """probs: per layer ``[batch, head, pos, key]``. Returns per layer the head rows
    ``[batch, head, pos, key]`` and the layer rows ``[batch, pos, key]``."""
    eye = torch.diag_embed(valid.to(probs[0].dtype))  # [batch, pos, key]; pads have no self-loop
    prev = eye
    heads, layers = [], []
    for attn in probs:
        mixed = 0.5 * attn + 0.5 * eye[:, None]
        heads.append(torch.matmul(mixed, prev[:, None]))
        prev = torch.matmul(mixed.mean(1), prev)
        layers.append(prev)
    return heads, layers


def value_vectors(
    block: torch.nn.Module, x: torch.Tensor, n_heads: int, *, adapter: ModelAdapter | None = None
) -> torch.Tensor:
    """``f_h(x_j) = (x_j W_V + b_V) W_O^h`` → ``[batch, head, pos, d_model]`` (no output bias).

    x: the attention's input ``[batch, pos, d_model]`` (after the pre-norm where the block has
    one). Query head h reads the values of key-value head ``h // (H / H_kv)`` (grouped-query
    attention, SPEC §8); the values and W_O come from the family's adapter."""
    adapter = adapter or adapter_of_block(block)
    v = adapter.values(block, x)  # [batch, kv_head, pos, d_head]
    n_kv, d_head = v.shape[1], v.shape[-1]
    if n_kv != n_heads:
        v = v[:, torch.arange(n_heads, device=v.device) // (n_heads // n_kv)]  # [batch, head, pos, d_head]
    w_o = adapter.output_weight(block).to(x.dtype)  # [d_model, head·d_head]
    w = w_o.reshape(w_o.shape[0], n_heads, d_head).permute(1, 2, 0)  # [head, d_head, d_model]
    return torch.matmul(v, w)


def norm_based(
    block: torch.nn.Module, x: torch.Tensor, attn: torch.Tensor, *, adapter: ModelAdapter | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kobayashi et al. 2020 for one layer. x: the attention's input ``[batch, pos, d_model]``;
    attn ``[batch, head, pos, key]``. Returns unnormalised head rows ``[batch, head, pos, key]``
    and layer rows ``[batch, pos, key]``."""
    f = value_vectors(block, x, attn.shape[1], adapter=adapter)  # [batch, head, key, d_model]
    heads = attn * f.norm(dim=-1)[:, :, None, :]
    layer = torch.stack(
        [torch.einsum("hij,hjd->ijd", attn[b], f[b]).norm(dim=-1) for b in range(x.shape[0])]
    )  # one window at a time: the [pos, key, d_model] tensor is the memory peak
    return heads, layer


def alti_layer(
    block: torch.nn.Module,
    x: torch.Tensor,
    attn: torch.Tensor,
    valid: torch.Tensor,
    *,
    adapter: ModelAdapter | None = None,
    attn_in: torch.Tensor | None = None,
) -> torch.Tensor:
    """ALTI contributions of one layer, ``[batch, pos, key]``, rows normalised. x: the block
    input ``[batch, pos, d_model]``; ``attn_in``: the attention's input (default: x, or the
    block's pre-norm of x).

    Post-norm blocks (Ferrando et al. 2022, eq. 6–9): y_i = LayerNorm(Σ_j Σ_h A^h_ij f_h(x_j) +
    b_O + x_i) is split into ``T_i(x_j) = γ ⊙ (t_ij − mean(t_ij)) / σ_i`` with
    ``t_ij = Σ_h A^h_ij f_h(x_j) + δ_ij x_j`` (the LayerNorm linearised with token i's own scale).
    Pre-norm blocks: y_i = x_i + Σ_j Σ_h A^h_ij f_h(LN(x_j)) + b_O is already a sum over tokens,
    since the norm acts on each token alone: ``T_i(x_j) = t_ij`` with ``f_h`` applied to LN(x_j),
    exactly (as Ferrando et al. 2023 decompose pre-norm decoders).
    Then ``c_ij = max(0, ‖y_i‖₁ − ‖y_i − T_i(x_j)‖₁)``, normalised over j."""
    adapter = adapter or adapter_of_block(block)
    norm: Any = adapter.attention_norm(block)  # a LayerNorm or RMSNorm: its weight, bias, eps
    if attn_in is None:
        attn_in = norm(x) if adapter.pre_norm else x
    f = value_vectors(block, attn_in, attn.shape[1], adapter=adapter)
    bias: torch.Tensor | None = adapter.output_projection(block).bias  # Linear/Conv1D
    b_o = bias.to(x.dtype) if bias is not None else torch.zeros((), dtype=x.dtype, device=x.device)
    rows = []
    for b in range(x.shape[0]):  # per window: [pos, key, d_model] is the memory peak
        t = torch.einsum("hij,hjd->ijd", attn[b], f[b])
        t = t + torch.diag_embed(x[b].T).permute(1, 2, 0)  # δ_ij x_j on the diagonal
        u = t.sum(1) + b_o  # post-norm: the LayerNorm input; pre-norm: the block's output y
        if adapter.pre_norm:
            y, transformed = u, t
        else:
            gamma, beta = norm.weight.to(x.dtype), norm.bias.to(x.dtype)
            sigma = torch.sqrt(u.var(-1, unbiased=False, keepdim=True) + norm.eps)  # [pos, 1]
            transformed = gamma * (t - t.mean(-1, keepdim=True)) / sigma[:, None]
            y = torch.nn.functional.layer_norm(u, u.shape[-1:], gamma, beta, norm.eps)  # [pos, d_model]
        c = (y.abs().sum(-1, keepdim=True) - (y[:, None] - transformed).abs().sum(-1)).clamp_min(0)
        c = c * valid[b][None, :]
        rows.append(_normalise(c))
    return torch.stack(rows)


def alti(
    blocks,
    resid_pre: list[torch.Tensor],
    probs: list[torch.Tensor],
    valid: torch.Tensor,
    *,
    adapter: ModelAdapter | None = None,
    attn_in: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """ALTI rolled out over layers: ``R_l = C_l R_{l-1}``, ``R_0 = C_0``. Per layer ``[batch, pos, key]``."""
    out, prev = [], None
    for layer, (block, x, attn) in enumerate(zip(blocks, resid_pre, probs)):
        given = None if attn_in is None else attn_in[layer]
        c = alti_layer(block, x, attn, valid, adapter=adapter, attn_in=given)
        prev = c if prev is None else torch.matmul(c, prev)
        out.append(prev)
    return out


# --- additive sums -------------------------------------------------------------------------------
def _normalise(m: torch.Tensor) -> torch.Tensor:
    total = m.sum(-1, keepdim=True)
    return torch.where(total > 0, m / total.clamp_min(torch.finfo(m.dtype).tiny), torch.zeros_like(m))


def jsd(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen–Shannon divergence in bits between rows (last dimension), in [0, 1]."""
    m = 0.5 * (p + q)
    kl = lambda a: (torch.xlogy(a, a) - torch.xlogy(a, m)).sum(-1)  # noqa: E731  0·log 0 = 0
    return (0.5 * kl(p) + 0.5 * kl(q)) / np.log(2.0)


def row_sums(rows: torch.Tensor, attn: torch.Tensor, feats: WindowFeatures, *, seq_len: int) -> dict[str, torch.Tensor]:
    """Sums over valid query rows for one layer. rows, attn: ``[batch, unit, pos, key]``.
    Returns ``[unit]`` float64 per MIX_SUMS and ``dist`` ``[unit, seq_len]`` (mass by |i−j|)."""
    rows, attn = rows.float(), attn.float()
    base = attention_sums(rows, feats)
    valid = feats.valid.float()[:, None, :]  # [batch, 1, pos]
    out = {name: base["attn_" + name] for name in ("to_cls", "to_sep", "to_punct", "to_self", "to_prev", "to_next")}
    out["entropy"] = base["attn_entropy"]
    out["jsd_attention"] = (jsd(rows, attn) * valid).sum(dim=(0, 2), dtype=torch.float64)
    n_pos = rows.shape[-1]
    pos = torch.arange(n_pos, device=rows.device)
    distance = (pos[:, None] - pos[None, :]).abs()  # [pos, key]
    mass = (rows * valid[..., None]).sum(0).flatten(1)  # [unit, pos·key]
    dist = torch.zeros(rows.shape[1], seq_len, dtype=torch.float64, device=rows.device)
    dist.index_add_(1, distance.flatten(), mass.double())
    out["distance_sum"] = (dist * torch.arange(seq_len, device=rows.device, dtype=torch.float64)).sum(1)
    out["dist"] = dist
    return out


def _stack(per_layer: list[dict[str, torch.Tensor]], head_ids: list[int]) -> dict[str, np.ndarray]:
    out = {key: torch.stack([d[key] for d in per_layer]).cpu().numpy().astype(np.float64) for key in per_layer[0]}
    out["head"] = np.array(head_ids, dtype=np.int64)
    return out


class TraceContext:
    """What every method reads: the model, the batch, its traced forward pass (attention maps
    ``probs`` per layer ``[batch, head, pos, key]`` in float32, block and attention inputs) and the
    valid mask."""

    def __init__(
        self, model: LoadedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, chunk_size: int
    ) -> None:
        from headatlas.service.measures.attribution import trace

        self.model, self.input_ids, self.attention_mask, self.chunk_size = model, input_ids, attention_mask, chunk_size
        self.valid = attention_mask.to(model.device).bool()
        self.trace = trace(model, input_ids, attention_mask)
        self.blocks = model_blocks(model.model)
        self.adapter = model.adapter
        self.probs = [p.float() for p in self.trace.probs]


Rows = tuple["list[torch.Tensor] | None", "list[torch.Tensor]"]


class MixingMethod:
    """One measure of how output positions mix input tokens. ``rows`` returns, per layer, the
    head rows ``[batch, head, pos, key]`` (None for a layer-only method) and the layer rows
    ``[batch, pos, key]``; each row sums to 1 over keys. Adding a method is adding a subclass
    (and its name to ``service.engine.results.MIXING_METHODS``)."""

    name: str
    needs_grad = False  # runs outside torch.no_grad (gradient attribution)

    def rows(self, ctx: TraceContext) -> Rows:
        raise NotImplementedError


class Attention(MixingMethod):
    name = "attention"

    def rows(self, ctx):
        return ctx.probs, [p.mean(1) for p in ctx.probs]


class Attribution(MixingMethod):
    name = "attribution"
    needs_grad = True

    def rows(self, ctx):
        from headatlas.service.measures.attribution import attribution as attribute

        per_head, per_layer = attribute(ctx.model, ctx.input_ids, ctx.attention_mask, chunk_size=ctx.chunk_size)
        return list(per_head.unbind(1)), list(per_layer.unbind(1))


class Rollout(MixingMethod):
    name = "rollout"

    def rows(self, ctx):
        return rollout(ctx.probs, ctx.valid)


class NormBased(MixingMethod):
    name = "norm"

    def rows(self, ctx):
        pairs = [
            norm_based(ctx.blocks[l], ctx.trace.attn_in[l].float(), ctx.probs[l], adapter=ctx.adapter)
            for l in range(ctx.model.n_layers)
        ]
        return [_normalise(h) for h, _ in pairs], [_normalise(lay) for _, lay in pairs]


class Alti(MixingMethod):
    name = "alti"

    def rows(self, ctx):
        resid_pre, attn_in = [x.float() for x in ctx.trace.resid_pre], [x.float() for x in ctx.trace.attn_in]
        return None, alti(ctx.blocks, resid_pre, ctx.probs, ctx.valid, adapter=ctx.adapter, attn_in=attn_in)


REGISTRY: dict[str, MixingMethod] = {m.name: m for m in (Attention(), Attribution(), Rollout(), NormBased(), Alti())}


def mixing_sums(
    model: LoadedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    feats: WindowFeatures,
    *,
    methods: tuple[str, ...],
    attribution: bool,
    seq_len: int,
    chunk_size: int,
) -> dict[str, dict[str, np.ndarray]]:
    """Per method: ``head`` ``[slot]`` (0..H-1, then -1 for the layer row), MIX_SUMS arrays
    ``[layer, slot]`` and ``dist`` ``[layer, slot, seq_len]``, summed over the batch's valid rows.
    ``attention`` is always included: it is what the other methods are compared with."""
    ctx = TraceContext(model, input_ids, attention_mask, chunk_size=chunk_size)
    heads_and_layer = list(range(model.n_heads)) + [-1]
    mean_attn = [p.mean(1, keepdim=True) for p in ctx.probs]  # the reference for layer rows
    chosen = ["attention", *(m for m in methods if m in FORWARD_MIXING)] + (["attribution"] if attribution else [])
    results: dict[str, dict[str, np.ndarray]] = {}
    for name in chosen:
        method = REGISTRY[name]
        with torch.enable_grad() if method.needs_grad else torch.no_grad():
            head_rows, layer_rows = method.rows(ctx)
        with torch.no_grad():
            per_layer = []
            for layer in range(model.n_layers):
                rows, ref = [layer_rows[layer][:, None]], [mean_attn[layer]]
                if head_rows is not None:
                    rows.insert(0, head_rows[layer])
                    ref.insert(0, ctx.probs[layer])
                per_layer.append(row_sums(torch.cat(rows, 1), torch.cat(ref, 1), feats, seq_len=seq_len))
        results[name] = _stack(per_layer, heads_and_layer if head_rows is not None else [-1])
    return results
