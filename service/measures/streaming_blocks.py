"""The streaming restriction (SPEC §10) a block of query rows at a time, for long windows.

At short lengths the restriction is a mask per head (``streaming.restricted_mask``: ``[copies·batch,
head, pos, key]``, as many entries as eager attention's scores). At long ones the model's attention
runs in blocks of query rows (``engine.row_attention``), and the restriction is handed to it as a
``StreamingRows``, which makes the mask of the rows asked for and nothing more; the attention mass
beyond sinks + W (the predictor) is summed from the same blocks by ``BeyondRows``. Neither holds a
tensor of pos × pos entries per head: at 4,096 tokens on SmolLM2 (9 heads, 3 stacked copies) the
whole mask was 1.8 GB, and eager attention's scores, masked scores and probabilities as much again
each.

Pure tensor code. Dimension names: batch (windows, or copies · windows), head, rows (a block's
query rows), key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def hidden_rows(first: int, last: int, n_keys: int, sink: int, recent: int, device: torch.device | str) -> torch.Tensor:
    """``[rows, key]`` bool: of query rows ``first .. last − 1``, the keys j ≤ i the restriction
    hides (j ≥ ``sink`` and i − j ≥ ``recent``)."""
    i = torch.arange(first, last, device=device)[:, None]
    j = torch.arange(n_keys, device=device)[None, :]
    return (j <= i) & (j >= sink) & (i - j >= recent)


@dataclass
class StreamingRows:
    """The attention mask with copy c's KV head c streaming (``streaming.restricted_mask``'s), made
    a block of rows at a time (a ``row_attention.RowMask``). ``base``: the mask the attention was
    handed ``[copies·batch, 1, pos, key]`` (bool, True: seen; or additive: 0 seen) or None (causal);
    ``streams`` ``[copies, head]``: the query heads copy c restricts; ``batch``: windows per copy."""

    base: torch.Tensor | None
    streams: torch.Tensor
    batch: int
    n_keys: int
    sink: int
    recent: int

    def rows(self, first: int, last: int) -> torch.Tensor:
        """``[copies·batch, head, rows, key]`` bool, True: seen."""
        device = self.streams.device
        hidden = hidden_rows(first, last, self.n_keys, self.sink, self.recent, device)  # [rows, key]
        copies, heads = self.streams.shape
        if self.base is None:
            i = torch.arange(first, last, device=device)[:, None]
            seen = (torch.arange(self.n_keys, device=device)[None, :] <= i)[None, None]  # [1, 1, rows, key]
        else:
            seen = self.base[:, :, first:last, : self.n_keys]
            seen = seen if seen.dtype == torch.bool else seen == 0
        hide = self.streams[:, None, :, None, None] & hidden  # [copies, 1, head, rows, key]
        shape = (copies * self.batch, heads, *hidden.shape)
        hide = hide.expand(copies, self.batch, heads, *hidden.shape).reshape(shape)
        return seen & ~hide


def streaming_rows(
    mask: torch.Tensor | None,
    *,
    copies: int,
    batch: int,
    n_heads: int,
    n_kv: int,
    n_keys: int,
    sink: int,
    recent: int,
    device: torch.device | str,
) -> StreamingRows:
    """The ``StreamingRows`` of ``mask`` (None: causal) with KV head c streaming in copy c (c <
    ``copies``) of ``batch`` windows each."""
    heads = torch.arange(n_heads, device=device) // (n_heads // n_kv)  # [head] its KV head
    streams = heads[None, :] == torch.arange(copies, device=device)[:, None]  # [copies, head]
    return StreamingRows(base=mask, streams=streams, batch=batch, n_keys=n_keys, sink=sink, recent=recent)


class BeyondRows:
    """A row-attention observer: each head's attention mass on the keys the restriction hides,
    summed over the valid query rows ``valid`` ``[batch, pos]`` block by block; ``result()`` gives
    ``{"beyond": [batch, head]}`` (float64), the sum ``streaming._beyond_mass`` averages."""

    def __init__(self, valid: torch.Tensor, sink: int, recent: int) -> None:
        self.valid, self.sink, self.recent = valid, sink, recent
        self.total: torch.Tensor | None = None

    def __call__(self, first: int, probs: torch.Tensor) -> None:
        _batch, _heads, n_rows, n_keys = probs.shape
        hidden = hidden_rows(first, first + n_rows, n_keys, self.sink, self.recent, probs.device)
        per_row = (probs.float() * hidden).sum(-1)  # [batch, head, rows]
        weight = self.valid[:, None, first : first + n_rows].to(per_row.dtype)
        part = (per_row * weight).sum(-1, dtype=torch.float64)  # [batch, head]
        self.total = part if self.total is None else self.total + part

    def result(self) -> dict[str, torch.Tensor]:
        assert self.total is not None, "no block of rows was observed"
        return {"beyond": self.total}
