"""Streaming heads (SPEC §10): what the model loses when a key-value head keeps only its attention
sinks and its most recent keys, as a serving engine's constant-size cache would give it.

**Restriction.** KV head g of layer l streams with S sinks and W recent keys: query i attends to
the keys j ≤ i with j < S or i − j < W, the softmax renormalised over them. Every query head that
reads KV head g (grouped-query attention: ``h // group_size``) is restricted, since the cache is
per KV head. It goes in through the hook point ``blocks.L.attn.mask``: the mask the attention
module is handed ``[batch, 1, pos, key]`` becomes one per head ``[batch, head, pos, key]``, the
dtype's minimum where the restriction hides a key, so that the attention's own softmax
renormalises over the keys left. Positions are the window's (decoder windows are padded on the
right).

**Effect.** ``σ_{l,g}(w) = O_streaming(w) − O(w)``, O the objective of the ablation effects
(``objectives.objective_for``: for a decoder the next-token loss). Where the restriction hides no
key of any of the window's valid query rows (W ≥ its length, or a length ≤ S + W), the model is
the intact one and σ is 0 exactly: no pass is run.

**Predictor.** Each KV head's attention mass beyond sinks + W in the intact pass, ``mean_i Σ_{j ≥
S, i − j ≥ W} A_ij`` over the window's valid query rows, averaged over the group's query heads:
what the restriction takes away before the softmax renormalises.

**Cost.** The intact pass is recorded once (every block's input: ``effects._record``); the
restricted passes of layer l restart from layer l's input, and every KV head of the layer streams
in one stacked pass (copy c restricts KV head c). A window costs Σ_l (L − l) / L of L × n_kv full
forward passes, plus the intact one. At short lengths the per-head mask holds batch × KV heads ×
heads × pos² entries, as many as the scores eager attention holds beside it. **Long windows**
(``row_attention.uses_row_attention``: one window's maps past 2^24 entries, on a family that can)
take the intact pass and every restarted one with attention in blocks of query rows, the
restriction made a block at a time and the predictor summed from the blocks
(``streaming_blocks``): no tensor of pos² entries per head, the same effects up to float32
rounding.

Pure tensor code: imports neither Celery, Typer nor SQLAlchemy. Dimension names: batch (windows),
layer, kv_head, head, pos, key.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from headatlas.service.engine.hooks import hooks
from headatlas.service.engine.model import LoadedModel
from headatlas.service.engine.row_attention import ROW_ATTENTION, AttentionRows, row_attention, uses_row_attention
from headatlas.service.errors import Param, ParameterError
from headatlas.service.measures.effects import _hidden, _record, _repeat, _replay, _run_model
from headatlas.service.measures.objectives import Objective, objective_of, wide
from headatlas.service.measures.streaming_blocks import BeyondRows, StreamingRows, hidden_rows, streaming_rows


@dataclass
class StreamingEffects:
    """Per-window streaming effects of one batch, on the CPU in float64.

    intact: ``O(w)`` ``[batch]``; effect: σ ``[batch, layer, kv_head]`` (NaN for layers not
    asked); beyond: the attention mass beyond sinks + W ``[batch, layer, kv_head]``; lengths: each
    window's tokens ``[batch]``."""

    objective: Objective
    sink: int
    recent: int
    intact: torch.Tensor
    effect: torch.Tensor
    beyond: torch.Tensor
    lengths: torch.Tensor


def check_window(sink: int, recent: int) -> None:
    """Refuse a restriction that is not one: fewer than 0 sinks, or fewer than 1 recent key (a
    query always sees itself)."""
    if sink < 0:
        raise ParameterError(Param("sink", sink), ": the sink tokens kept are 0 or more")
    if recent < 1:
        raise ParameterError(Param("recent", recent), ": the recent keys kept are 1 or more (a token sees itself)")


def streaming_allowed(n_pos: int, sink: int, recent: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[pos, key]`` bool: key j ≤ query i with j < ``sink`` or i − j < ``recent``."""
    i = torch.arange(n_pos, device=device)[:, None]
    j = torch.arange(n_pos, device=device)[None, :]
    return (j <= i) & ((j < sink) | (i - j < recent))


def hidden_keys(n_pos: int, sink: int, recent: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[pos, key]`` bool: the keys a query sees causally that the restriction hides."""
    return hidden_rows(0, n_pos, n_pos, sink, recent, device)


def restricted_mask(
    mask: torch.Tensor | None, blocked: torch.Tensor, copies: int, n_heads: int, n_kv: int
) -> torch.Tensor:
    """The attention mask with copy c's KV head c streaming: ``mask`` ``[copies·batch, 1 or head,
    pos, key]`` (additive or bool; None: causal), ``blocked`` ``[pos, key]`` the keys hidden.
    Returns ``[copies·batch, head, pos, key]`` (copy-major, as ``effects._repeat`` stacks)."""
    heads = torch.arange(n_heads, device=blocked.device) // (n_heads // n_kv)  # [head] its KV head
    streams = heads[None, :] == torch.arange(copies, device=blocked.device)[:, None]  # [copies, head]
    return _hidden_from(mask, blocked, streams)


def heads_streaming_mask(
    mask: torch.Tensor | None, blocked: torch.Tensor, kv_heads: Iterable[int], n_heads: int, n_kv: int
) -> torch.Tensor:
    """The attention mask with every KV head of ``kv_heads`` streaming at once (one layer's share of
    a streaming policy): ``mask`` ``[batch, 1 or head, pos, key]`` (None: causal), ``blocked``
    ``[pos, key]``. Returns ``[batch, head, pos, key]``."""
    heads = torch.arange(n_heads, device=blocked.device) // (n_heads // n_kv)  # [head] its KV head
    chosen = torch.tensor(sorted(set(kv_heads)), dtype=heads.dtype, device=blocked.device)
    return _hidden_from(mask, blocked, torch.isin(heads, chosen)[None, :])


def _hidden_from(mask: torch.Tensor | None, blocked: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``mask`` with the keys of ``blocked`` ``[pos, key]`` hidden from the heads ``streams``
    ``[copies, head]`` marks, copy c of the rows (copy-major) from copy c's heads."""
    n_q, n_k = blocked.shape
    copies, n_heads = streams.shape
    if mask is None:
        i = torch.arange(n_q, device=blocked.device)[:, None]
        j = torch.arange(n_k, device=blocked.device)[None, :]
        mask = (j <= i)[None, None].expand(copies, 1, n_q, n_k)
    rows = mask.shape[0]
    batch = rows // copies
    hide = (streams[:, None, :, None, None] & blocked[None, None, None]).expand(copies, batch, n_heads, n_q, n_k)
    hide = hide.reshape(rows, n_heads, n_q, n_k)
    full = mask[..., :n_q, :n_k].expand(rows, n_heads, n_q, n_k)
    if full.dtype == torch.bool:
        return full & ~hide
    return full.masked_fill(hide, torch.finfo(full.dtype).min)


@contextmanager
def streaming_heads(
    model: LoadedModel, kv_heads: Iterable[tuple[int, int]], *, sink: int, recent: int, n_pos: int
) -> Iterator[None]:
    """Inside: every (layer, KV head) of ``kv_heads`` streams (S = ``sink``, W = ``recent``) on
    windows of ``n_pos`` positions, all at once, through the hook points ``blocks.L.attn.mask``.
    Nothing is hooked where the restriction hides no key (W ≥ ``n_pos``, or ``n_pos`` ≤ S + W) or
    no head streams: the pass is then the intact model's, bit for bit."""
    check_window(sink, recent)
    by_layer: dict[int, list[int]] = {}
    for layer, kv in kv_heads:
        by_layer.setdefault(int(layer), []).append(int(kv))
    blocked = hidden_keys(n_pos, sink, recent, model.device)
    if not by_layer or not bool(blocked.any()):
        yield
        return
    n_heads, n_kv = model.n_heads, model.n_kv_heads

    def restrict(chosen: list[int]):
        def fn(mask: torch.Tensor | None) -> torch.Tensor:
            return heads_streaming_mask(mask, blocked, chosen, n_heads, n_kv)

        return fn

    edits = {f"blocks.{layer}.attn.mask": restrict(chosen) for layer, chosen in by_layer.items()}
    with hooks(model.model, edits, model.adapter):
        yield


def kv_cache_bytes(*, layers: int, kv_heads: int, d_head: int, n: int, kv_bytes: int) -> int:
    """The full KV cache of one sequence of ``n`` tokens (SPEC §10): ``2 · L · n_kv · d_head · n ·
    bytes`` (keys and values of every KV head)."""
    return 2 * layers * kv_heads * d_head * n * kv_bytes


def memory_saved(streaming: int, *, d_head: int, n: int, sink: int, recent: int, kv_bytes: int) -> int:
    """What ``streaming`` KV heads save of one sequence's cache (SPEC §10): each keeps S + W of its
    ``n`` keys and values, ``2 · d_head · (n − S − W) · bytes`` saved (0 where n ≤ S + W)."""
    return streaming * 2 * d_head * max(0, n - sink - recent) * kv_bytes


def _beyond_mass(pattern: torch.Tensor, beyond: torch.Tensor, valid: torch.Tensor, n_kv: int) -> torch.Tensor:
    """``[batch, kv_head]``: the mass of ``pattern`` ``[batch, head, pos, key]`` on the keys of
    ``beyond`` ``[pos, key]``, averaged over the valid query rows (``valid`` ``[batch, pos]``) and
    the group's query heads."""
    batch, n_heads, n_pos, _ = pattern.shape
    weight = valid.float()[:, None, :]
    if isinstance(pattern, AttentionRows):  # long windows: summed from the row blocks (BeyondRows)
        assert pattern.sums is not None, "attention in row blocks without a BeyondRows observer"
        total = pattern.sums["beyond"].to(weight.dtype)  # [batch, head]
    else:
        per_row = (pattern.float() * beyond.to(pattern.device)).sum(-1)  # [batch, head, pos]
        total = (per_row * weight).sum(-1)
    per_head = total / weight.sum(-1).clamp(min=1)  # [batch, head]
    return per_head.reshape(batch, n_kv, n_heads // n_kv).mean(-1)


def streaming_effects(
    model: LoadedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    sink: int,
    recent: int,
    layers: Iterable[int] | None = None,
    window_ids: list[str] | None = None,
    objective: Objective | None = None,
) -> StreamingEffects:
    """Every KV head's streaming effect on a batch of windows (module docstring): ``sink`` S,
    ``recent`` W; ``layers``: only these layers' heads (the others' effects NaN);
    ``window_ids``: the windows' ids; ``objective``: the run's (None: the model's own)."""
    check_window(sink, recent)
    if not model.adapter.causal:
        raise ParameterError(
            f"{model.name} attends both ways (an encoder): the streaming restriction keeps a causal model's "
            "sinks and recent keys; measure it on a decoder"
        )
    objective = objective or objective_of(model)
    attention_mask = attention_mask.to(model.device)
    input_ids, targets = objective.prepare(input_ids.to(model.device), attention_mask, window_ids)
    batch, n_pos = input_ids.shape
    n_layers, n_kv = model.n_layers, model.n_kv_heads
    chosen = list(range(n_layers)) if layers is None else sorted(set(layers))
    lengths = attention_mask.sum(-1)
    blocked = hidden_keys(n_pos, sink, recent, model.device)
    # a window whose valid rows see every key they saw: the intact model, σ = 0 exactly
    changed = torch.tensor(
        [bool(blocked[: int(n), : int(n)].any()) for n in lengths.tolist()], device=model.device, dtype=torch.bool
    )
    beyond = torch.zeros(batch, n_layers, n_kv, dtype=torch.float64)
    patterns = {
        f"blocks.{layer}.attn.pattern": _reader(beyond, layer, blocked, attention_mask, n_kv)
        for layer in range(n_layers)
    }
    in_rows = uses_row_attention(model, model.n_heads, n_pos)  # long windows: attention in row blocks

    def in_blocks(observer):
        return row_attention(model.model, observer) if in_rows else contextlib.nullcontext()

    with torch.no_grad():
        with hooks(model.model, patterns, model.adapter), in_blocks(lambda: BeyondRows(attention_mask, sink, recent)):
            recording = _record(model, input_ids, attention_mask)
        final = wide(recording.final)
        intact = objective.per_window(final, targets, attention_mask, final)
        effect = torch.full((batch, n_layers, n_kv), math.nan, dtype=torch.float64)
        for layer in chosen:
            effect[:, layer] = 0.0
        rows = changed.nonzero().flatten()
        if len(rows):
            sub = _Sub(recording, rows, batch)
            with in_blocks(lambda: None):
                for layer in chosen:
                    values = _streamed_layer(
                        model, sub, objective, targets[rows], attention_mask[rows], layer, blocked, (sink, recent)
                    )
                    effect[rows.cpu(), layer] = (values - intact[rows].unsqueeze(1)).double().cpu()
    return StreamingEffects(
        objective=objective,
        sink=sink,
        recent=recent,
        intact=intact.double().cpu(),
        effect=effect,
        beyond=beyond,
        lengths=lengths.cpu(),
    )


def _reader(out: torch.Tensor, layer: int, beyond: torch.Tensor, valid: torch.Tensor, n_kv: int):
    def read(pattern: torch.Tensor) -> None:
        out[:, layer] = _beyond_mass(pattern, beyond, valid, n_kv).double().cpu()

    return read


class _Sub:
    """The recorded intact pass of the batch's rows ``rows`` alone (the windows the restriction
    changes): each block's call with its batch tensors cut to those rows."""

    def __init__(self, recording, rows: torch.Tensor, batch: int) -> None:
        if len(rows) == batch:
            self.calls, self.final = recording.calls, recording.final
            return
        self.calls = [(_cut(args, rows, batch), _cut(kwargs, rows, batch)) for args, kwargs in recording.calls]
        self.final = recording.final[rows]


def _cut(value, rows: torch.Tensor, batch: int):
    if isinstance(value, torch.Tensor):
        return value[rows] if value.dim() >= 1 and value.shape[0] == batch and batch > 1 else value
    if isinstance(value, tuple):
        return tuple(_cut(v, rows, batch) for v in value)
    if isinstance(value, list):
        return [_cut(v, rows, batch) for v in value]
    if isinstance(value, dict):
        return {k: _cut(v, rows, batch) for k, v in value.items()}
    return value


def _streamed_layer(
    model: LoadedModel,
    recording,
    objective: Objective,
    targets: torch.Tensor,
    attention_mask: torch.Tensor,
    layer: int,
    blocked: torch.Tensor,
    window: tuple[int, int],
) -> torch.Tensor:
    """``O`` ``[batch, kv_head]`` with each KV head of ``layer`` streaming in turn, one stacked pass
    restarted from the layer's recorded input; ``window``: (S, W), whose keys ``blocked`` hides.
    Under ``row_attention`` (long windows) the restriction is made a block of rows at a time."""
    n_heads, copies = model.n_heads, model.n_kv_heads
    batch = targets.shape[0]
    in_rows = getattr(model.model.config, "_attn_implementation", None) == ROW_ATTENTION

    def restrict(mask: torch.Tensor | None) -> torch.Tensor | StreamingRows:
        if in_rows:
            return streaming_rows(
                mask,
                copies=copies,
                batch=batch,
                n_heads=n_heads,
                n_kv=copies,
                n_keys=blocked.shape[1],
                sink=window[0],
                recent=window[1],
                device=blocked.device,
            )
        return restricted_mask(mask, blocked, copies, n_heads, copies)

    start = _hidden(recording.calls[layer])
    with hooks(model.model, {f"blocks.{layer}.attn.mask": restrict}, model.adapter):
        final = _replay(model, recording, layer, _repeat(start, copies, batch), copies)
    flat = wide(final)
    ids = targets.unsqueeze(0).expand(copies, -1, -1).reshape(copies * batch, -1)
    mask = attention_mask.unsqueeze(0).expand(copies, -1, -1).reshape(copies * batch, -1)
    intact = wide(recording.final).unsqueeze(0).expand(copies, -1, -1, -1).reshape(copies * batch, *flat.shape[1:])
    values = objective.per_window(flat, ids, mask, intact).reshape(copies, batch)
    return values.T


def intact_objective(model: LoadedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``O(w)`` of the intact model ``[batch]`` (the model's own objective), for checks."""
    objective = objective_of(model)
    mask = attention_mask.to(model.device)
    ids, targets = objective.prepare(input_ids.to(model.device), mask, None)
    with torch.no_grad():
        final = wide(_run_model(model, ids, mask))
    return objective.per_window(final, targets, mask, final)
