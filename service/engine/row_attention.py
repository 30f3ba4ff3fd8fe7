"""Attention in blocks of query rows for long windows: no layer holds every head's pos × pos map.

Eager attention materialises the scores, the masked scores and the probabilities of every head of
a layer at once (for SmolLM2's 9 heads at 8,192 tokens, 2.4 GB each), and the statistics read
those probabilities whole. For long windows the analysis runs the model's attention through
``rows_attention_forward`` instead (registered in transformers' attention interface as
``ROW_ATTENTION``; ``row_attention`` switches a model to it for one forward pass):

- the output is computed a block of query rows at a time, as eager attention computes it (scores
  scaled, masked with the dtype's minimum, softmax in float32, times the values);
- each block's probabilities are handed to an observer while they exist (``stats.RowSums``: the
  attention statistics that read whole rows — attention to token classes, to self, previous and
  next, entropy, the copy sets);
- the layer's hook receives an ``AttentionRows`` in place of the probabilities: the queries, keys
  and each row's log-sum-exp, from which any entry A_ij is recomputed exactly where the
  statistics need one (the gate on the selected pairs, SPEC §8).

A mask may also be handed over as a ``RowMask`` (a hook point's edit, ``blocks.L.attn.mask``): an
object that makes the mask of a block of rows when asked, so that a mask that differs by head (the
streaming restriction, ``measures.streaming``) never exists whole either.

Only families whose attention module goes through transformers' attention interface can take
it (``ModelAdapter.row_attention``); the others keep eager attention. Short windows keep eager
attention whatever the family (``uses_row_attention``): their results do not change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

ROW_ATTENTION = "headatlas_rows"

# A window whose attention maps (heads · pos² entries) exceed this takes attention in row blocks,
# and each block holds at most this many entries for the batch (64 MiB in float32).
ATTENTION_ROW_ELEMENTS = 1 << 24


@runtime_checkable
class RowMask(Protocol):
    """An attention mask made a block of query rows at a time: ``rows(first, last)`` gives the keys
    rows ``first .. last − 1`` see, bool ``[batch, 1 or head, rows, key]`` (True: seen)."""

    def rows(self, first: int, last: int) -> torch.Tensor: ...


Observer = Callable[[int, torch.Tensor], None]  # (first row, probabilities [batch, head, rows, key])
_OBSERVER: ContextVar[Callable[[], Observer | None] | None] = ContextVar("row_observer", default=None)


def uses_row_attention(model: Any, heads: int, n_pos: int) -> bool:
    """Whether a window of ``n_pos`` tokens runs its attention in row blocks on ``model`` (a
    LoadedModel): its family can (``row_attention``) and one window's maps exceed the budget."""
    return bool(getattr(model.adapter, "row_attention", False)) and heads * n_pos * n_pos > ATTENTION_ROW_ELEMENTS


def block_rows(batch: int, heads: int, n_pos: int) -> int:
    """Query rows per block: at most ``ATTENTION_ROW_ELEMENTS`` entries for the batch, one row at least."""
    return max(1, ATTENTION_ROW_ELEMENTS // max(1, batch * heads * n_pos))


@dataclass
class AttentionRows:
    """One layer's attention probabilities, held as what makes them: ``[batch, head, pos, key]``
    in shape, never materialised. ``query`` ``[batch, head, pos, d]``, ``key`` ``[batch, kv_head,
    key, d]`` (as the attention received them: rotary embeddings applied), ``lse`` ``[batch, head,
    pos]`` float32 each row's log-sum-exp of its masked, scaled scores, ``allowed`` ``[batch, 1,
    pos, key]`` bool or None (then causal: key ≤ row; ``row_mask``: the ``RowMask`` the attention
    was handed, if any). ``sums``: what the observer gathered from the row blocks during the
    forward pass (``stats.RowSums.result``), or None."""

    query: torch.Tensor
    key: torch.Tensor
    scaling: float
    lse: torch.Tensor
    allowed: torch.Tensor | None
    causal: bool
    sums: dict[str, torch.Tensor] | None = None
    row_mask: RowMask | None = None

    @property
    def shape(self) -> torch.Size:
        batch, heads, n_pos, _ = self.query.shape
        return torch.Size((batch, heads, n_pos, self.key.shape[2]))

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def entries(self, index: torch.Tensor, piece: int = 1 << 22) -> torch.Tensor:
        """A at ``index`` ``[batch, head, k]`` (i·key + j), float32 ``[batch, head, k]``:
        exp(q_i·k_j·scaling − lse_i) where the mask lets row i see key j, 0 elsewhere (as eager
        attention gives). Computed ``piece`` // d entries at a time."""
        if self.row_mask is not None:
            raise ValueError("the entries of attention under a mask made by rows are not recomputed")
        batch, heads, n_pos, d = self.query.shape
        n_keys = self.key.shape[2]
        group = heads // self.key.shape[1]
        keys = self.key.float()[:, torch.arange(heads, device=index.device) // group]  # [batch, head, key, d]
        queries = self.query.float()
        out = torch.empty(index.shape, dtype=torch.float32, device=index.device)
        step = max(1, piece // max(1, d))
        for start in range(0, index.shape[2], step):
            part = index[..., start : start + step]
            i, j = part // n_keys, part % n_keys
            q_i = queries.gather(2, i[..., None].expand(-1, -1, -1, d))
            k_j = keys.gather(2, j[..., None].expand(-1, -1, -1, d))
            score = (q_i * k_j).sum(3) * self.scaling
            p = torch.exp(score - self.lse.gather(2, i))
            if self.allowed is None:
                ok = j <= i if self.causal else torch.ones_like(p, dtype=torch.bool)
            else:
                mask = self.allowed[:, 0].expand(batch, n_pos, n_keys).reshape(batch, 1, n_pos * n_keys)
                ok = mask.expand(batch, heads, -1).gather(2, part)
            out[..., start : start + step] = torch.where(ok, p, 0.0)
        return out


def rows_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **_kwargs: Any,
) -> tuple[torch.Tensor, AttentionRows]:
    """transformers' attention-interface signature: ``query`` ``[batch, head, pos, d]``, ``key``
    and ``value`` ``[batch, kv_head, key, d]``, ``attention_mask`` ``[batch, 1, pos, key]`` bool
    (True: seen), a ``RowMask``, or None (causal, or every key where the module is not causal).
    Returns the output ``[batch, pos, head, d]`` and an ``AttentionRows``."""
    batch, heads, n_pos, _ = query.shape
    n_keys = key.shape[2]
    group = heads // key.shape[1]
    row_mask = attention_mask if isinstance(attention_mask, RowMask) else None
    if row_mask is not None:
        attention_mask = None
    causal = attention_mask is None and row_mask is None and bool(getattr(module, "is_causal", True))
    allowed = attention_mask
    if allowed is not None and allowed.dtype != torch.bool:  # an additive mask: 0 seen, the minimum not
        allowed = allowed == 0
    keys = key.repeat_interleave(group, dim=1) if group > 1 else key
    values = value.repeat_interleave(group, dim=1) if group > 1 else value
    lse = torch.empty(batch, heads, n_pos, dtype=torch.float32, device=query.device)
    factory = _OBSERVER.get()
    observer = factory() if factory is not None else None
    rows = block_rows(batch, heads, n_keys)
    outputs = []
    cols = torch.arange(n_keys, device=query.device)
    for first in range(0, n_pos, rows):
        last = min(first + rows, n_pos)
        scores = (torch.matmul(query[:, :, first:last], keys.transpose(2, 3)) * scaling).float()
        if row_mask is not None:
            seen = row_mask.rows(first, last)
        elif allowed is not None:
            seen = allowed[:, :, first:last]
        elif causal:
            seen = (cols[None, :] <= torch.arange(first, last, device=query.device)[:, None])[None, None]
        else:
            seen = None
        if seen is not None:
            scores.masked_fill_(~seen, torch.finfo(torch.float32).min)
        top = scores.amax(3, keepdim=True)
        probs = scores.sub_(top).exp_()  # in place: the block's scores become its probabilities
        total = probs.sum(3, keepdim=True)
        probs.div_(total)
        lse[:, :, first:last] = (top + total.log()).squeeze(3)
        if observer is not None:
            observer(first, probs)
        outputs.append(torch.matmul(probs.to(value.dtype), values))
        del scores, probs
    output = torch.cat(outputs, dim=2).transpose(1, 2).contiguous()
    rows_held = AttentionRows(
        query=query, key=key, scaling=float(scaling), lse=lse, allowed=allowed, causal=causal, row_mask=row_mask
    )
    if observer is not None:
        rows_held.sums = getattr(observer, "result", lambda: None)()
    return output, rows_held


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ROW_ATTENTION, rows_attention_forward)
    AttentionMaskInterface.register(ROW_ATTENTION, sdpa_mask)  # a bool mask, or None where causal says it all


@contextmanager
def row_attention(model: torch.nn.Module, observer: Callable[[], Observer | None]) -> Iterator[None]:
    """Run ``model``'s attention in row blocks inside the block (its config's implementation set
    to ``ROW_ATTENTION``, then back); ``observer()`` makes each layer's observer of its blocks."""
    _register()
    config: Any = model.config
    before = config._attn_implementation
    token = _OBSERVER.set(observer)
    config._attn_implementation = ROW_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before
        _OBSERVER.reset(token)
