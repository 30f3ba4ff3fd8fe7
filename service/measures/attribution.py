"""Hidden-token attribution by gradients (SPEC §6), batched.

For output token i of head (l, h): ``g_ij = ‖∂(Σ_k z_ik)/∂e_j‖₂`` with ``e`` the output of the
embedding layer (the input of block 0: BERT's embeddings module, GPT-2's token plus position
embeddings, Llama's token embeddings; rotary positions act inside attention) and ``z`` the head output (the context layer before W_O); rows are normalised,
``ĝ_ij = g_ij / Σ_j' g_ij'``. The layer-level row (head slot -1) uses the block output
``h^l_i`` instead of one head's ``z``: how much of token i's layer-l representation comes from
each input token.

Cost is one backward pass per (layer, unit, output token); layer l's outputs are differentiated
on their own, so the backward stops at layer 0 having crossed only l + 1 blocks. How the passes
run depends on the device (``gradient_norms``):
  * on a GPU, vmapped (``torch.autograd.grad(..., is_grads_batched=True)``), ``chunk_size``
    gradient rows at a time — that parameter bounds the memory — and shared by every window of
    the batch (windows do not interact: the outputs are summed over the batch first);
  * on a CPU, one plain pass per output, window by window, cut to the window's own tokens:
    vmapping was 0.4–0.6× the speed of the plain loop there and took gigabytes (a 2-window
    MiniLM batch at 2,048 rows a call reached 4.2 GB), while a window's graph is tens of
    megabytes; and each pass lasts tens of milliseconds, so Ctrl-C lands at once.
``estimate`` says what a run's attribution will cost before it starts.

Pure tensor code: imports neither Celery, Typer nor SQLAlchemy.
Dimension names: batch, layer, unit (head, then the layer-level slot), pos (query), key, d_model.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from headatlas.service.engine.adapters import adapter_for
from headatlas.service.engine.hooks import act_name, capture_attention, hooks
from headatlas.service.engine.model import LoadedModel, model_blocks
from headatlas.service.wording import counted

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


def _trace_hooks(n_layers: int, store: dict, embeddings: torch.Tensor | None, grad: bool) -> dict:
    """The hook points a trace reads: the embedding output made a tensor we own (a fresh leaf, to
    differentiate against, or ``embeddings`` given by the caller, to evaluate the model at a
    perturbed point), and each block's input, output and attention input."""

    def embed(output: torch.Tensor) -> torch.Tensor:
        e = embeddings if embeddings is not None else output.detach()
        if grad and not e.requires_grad:
            e = e.requires_grad_(True)
        store["e"] = e
        return e

    def keep(part: str, layer: int):
        def fn(value: torch.Tensor) -> None:
            store.setdefault(part, {})[layer] = value

        return fn

    fns = {"embed": embed}
    for layer in range(n_layers):
        fns[f"blocks.{layer}.resid_pre"] = keep("pre", layer)
        fns[f"blocks.{layer}.resid_post"] = keep("post", layer)
        fns[f"blocks.{layer}.attn_in"] = keep("attn_in", layer)
    return fns


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
        hooks(model.model, _trace_hooks(len(blocks), store, embeddings, grad), adapter),
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


def vmapped_on(model: LoadedModel) -> bool:
    """Whether ``gradient_norms`` vmaps its passes on this model's device (a GPU) or runs them
    one by one, window by window (a CPU)."""
    return torch.device(model.device).type != "cpu"


def gradient_norms(
    model: LoadedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    heads: bool = True,
    hidden: bool = True,
    chunk_size: int = DEFAULT_CHUNK,
    batched: bool | None = None,
) -> torch.Tensor:
    """Unnormalised ``g`` ``[batch, layer, unit, pos, key]`` float32 (units: the heads when
    ``heads``, then the layer output when ``hidden``). Pad keys and pad query rows are 0.

    ``batched``: vmapped passes, ``chunk_size`` rows a call, each serving every window of the
    batch; False: one backward pass per output, window by window; None (default): vmapped on a
    GPU, one by one on a CPU (``vmapped_on``). Both give the same numbers, up to float rounding.
    """
    if not (heads or hidden):
        raise ValueError("nothing to attribute: pass heads=True and/or hidden=True")
    if not (vmapped_on(model) if batched is None else batched):
        return _window_by_window(model, input_ids, attention_mask, heads=heads, hidden=hidden)
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
        for start in range(0, n_rows, per_call):
            rows = torch.arange(start, min(start + per_call, n_rows), device=e.device)
            out[:, layer, rows // n_pos, rows % n_pos] = _vmapped(
                s, e, rows, retain=not (last and start + per_call >= n_rows)
            )
    mask = (valid[:, :, None] & valid[:, None, :]).float()  # [batch, pos, key]
    return out * mask[:, None, None]


def _vmapped(s: torch.Tensor, e: torch.Tensor, rows: torch.Tensor, *, retain: bool) -> torch.Tensor:
    """‖∂s_r/∂e_j‖ for the outputs ``rows`` of ``s`` ``[unit·pos]`` in one vmapped call:
    ``[batch, row, key]``."""
    cotangent = torch.zeros(len(rows), s.shape[0], dtype=s.dtype, device=e.device)
    cotangent[torch.arange(len(rows)), rows] = 1
    (g,) = torch.autograd.grad(
        s, e, cotangent, is_grads_batched=True, retain_graph=retain
    )  # [row, batch, key, d_model]
    return g.float().norm(dim=-1).permute(1, 0, 2)


def _one_pass(s: torch.Tensor, e: torch.Tensor, row: int, *, retain: bool) -> torch.Tensor:
    """‖∂s_row/∂e_j‖ for one window's output ``row`` of ``s`` ``[unit·pos]``: ``[key]``."""
    (g,) = torch.autograd.grad(s[row], e, retain_graph=retain)  # [1, key, d_model]
    return g[0].float().norm(dim=-1)


def _window_by_window(
    model: LoadedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, heads: bool, hidden: bool
) -> torch.Tensor:
    """``gradient_norms`` one plain backward pass per output, each window on its own and cut to
    its tokens (a right-padded window: pads then cost nothing)."""
    batch, n_pos = input_ids.shape
    n_units = (model.n_heads if heads else 0) + (1 if hidden else 0)
    out = torch.zeros(batch, model.n_layers, n_units, n_pos, n_pos, dtype=torch.float32, device=model.device)
    for b in range(batch):
        n = int(attention_mask[b].sum())
        if not bool(attention_mask[b, :n].all()):
            n = n_pos  # not right-padded: keep the pads (masked below)
        tr = trace(model, input_ids[b : b + 1, :n], attention_mask[b : b + 1, :n], grad=True)
        for layer in range(model.n_layers):
            s = unit_outputs(tr, layer, model.n_heads, heads=heads, hidden=hidden)[0].flatten()  # [unit·pos]
            last = layer == model.n_layers - 1
            for row in range(s.shape[0]):
                out[b, layer, row // n, row % n, :n] = _one_pass(
                    s, tr.embeddings, row, retain=not (last and row == s.shape[0] - 1)
                )
    valid = attention_mask.to(out.device).bool()
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


@dataclass(frozen=True)
class Estimate:
    """What a run's attribution will cost, said before it starts.

    ``seconds``: backward passes timed on the run's longest window at the first and the last
    layer (a pass at layer l crosses l + 1 blocks: the layers between are interpolated), times the
    passes every window needs, a window's passes taken to cost in proportion to its length (an
    upper bound where they grow faster); plus three forward passes per window (the one with
    gradients, timed likewise, the analysis's and the mixing measures' own). On a GPU, whose vmapped passes serve every window of a batch at once, it is an upper
    bound. ``memory_bytes``: the working set above the loaded model, from the model's shape
    (``working_set``), or what the process grew by while the timed passes held the longest
    window's graph (Linux) when that is more."""

    windows: int
    longest: int  # tokens in the longest window
    passes: int  # backward passes, one per (window, layer, head or layer row, token)
    seconds: float
    memory_bytes: int
    timed: int  # backward passes timed
    timing_s: float  # how long measuring took

    def describe(self) -> str:
        return (
            f"attribution: {counted(self.windows, 'window')} of up to {self.longest} tokens, {self.passes:,} backward "
            f"passes: about {duration(self.seconds)} and {size(self.memory_bytes)} above the model "
            f"(timed {self.timed} passes in {self.timing_s:.1f} s; memory from the model's shape)"
        )


def size(n_bytes: int) -> str:
    """``40 MB``, ``1.3 GB``."""
    return f"{n_bytes / 2**30:.1f} GB" if n_bytes >= 2**30 else f"{max(1, round(n_bytes / 2**20))} MB"


def duration(seconds: float) -> str:
    """``under 1 s``, ``42 s``, ``7 min 05 s``, ``2 h 14 min``."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return "under 1 s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def about(seconds: float) -> str:
    """An estimate's duration as said: ``about 42 s``, or ``under 1 s`` (not "about under 1 s")."""
    said = duration(seconds)
    return said if said.startswith("under") else f"about {said}"


def working_set(model: LoadedModel, n_pos: int, *, windows: int = 1, rows_per_call: int = 1) -> int:
    """Bytes the attribution of ``windows`` windows of ``n_pos`` tokens holds at its peak, above
    the loaded model, from its shape (float32): a window's graph kept from the embeddings
    (per layer, three attention-sized tensors — scores, weights and a gradient — and about 24
    model-wide activations per token, the feed-forward's included), a backward pass's transient
    gradients (one layer's worth) per row in flight (``rows_per_call``: vmapped rows), and three
    copies of the window's rows (gradient norms, normalised, split per head and layer).
    Window by window (a CPU), one graph is alive at a time."""
    graph = graph_bytes(model, n_pos)
    rows = 4 * 3 * model.n_layers * (model.n_heads + 1) * n_pos * n_pos
    in_flight = graph // model.n_layers * rows_per_call
    if rows_per_call > 1:  # vmapped: the whole batch's graph at once
        return windows * (graph + rows) + in_flight
    return graph + in_flight + windows * rows


def graph_bytes(model: LoadedModel, n_pos: int) -> int:
    """The graph one window of ``n_pos`` tokens keeps for its backward passes, from the model's
    shape (``working_set``)."""
    per_layer = 3 * model.n_heads * n_pos * n_pos + 24 * n_pos * model.d_model
    return 4 * model.n_layers * per_layer


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux: /proc/self/statm), or None where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def estimate(
    model: LoadedModel,
    input_ids: torch.Tensor,
    lengths: Sequence[int],
    *,
    batch_windows: int = 1,
    chunk_size: int = DEFAULT_CHUNK,
    sample: int = 3,
) -> Estimate:
    """The cost of attributing windows of ``lengths`` tokens, measured on ``input_ids``
    ``[1, pos]`` (the longest of them, no padding) with ``sample`` to 20 passes per timed layer
    (a quarter second's worth; one vmapped call of ``chunk_size`` rows on a GPU). ``batch_windows``: windows attributed together
    (the memory of a vmapped batch)."""
    started = time.perf_counter()
    n_pos = int(input_ids.shape[1])
    vmapped = vmapped_on(model)
    cuda = torch.device(model.device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    mask = torch.ones_like(input_ids)
    before = resident_bytes()
    sync()
    t = time.perf_counter()
    tr = trace(model, input_ids, mask, grad=True)
    sync()
    forward_s = time.perf_counter() - t
    per_pass: dict[int, float] = {}
    timed = 0
    for layer in sorted({0, model.n_layers - 1}):
        s = unit_outputs(tr, layer, model.n_heads)[0].flatten()  # [unit·pos]
        if vmapped:
            rows = torch.arange(min(chunk_size, s.shape[0]), device=s.device)
            t = time.perf_counter()
            _vmapped(s, tr.embeddings, rows, retain=True)
            sync()
            per_pass[layer] = (time.perf_counter() - t) / len(rows)
            timed += len(rows)
            continue
        times: list[float] = []
        # at least ``sample`` passes, more while they take under a quarter second (a busy machine's
        # timings vary: more of them, averaged, is what the run's total will see), spread over the
        # layer's heads and tokens
        order = [(k * 7919) % s.shape[0] for k in range(min(20, s.shape[0]))]
        while len(times) < min(len(order), max(sample, 20 if sum(times) < 0.25 else 0)):
            t = time.perf_counter()
            _one_pass(s, tr.embeddings, order[len(times)], retain=True)
            times.append(time.perf_counter() - t)
        per_pass[layer] = statistics.fmean(times)
        timed += len(times)
    after = resident_bytes()  # the longest window's graph is still held
    del tr
    first, last = per_pass[0], per_pass[model.n_layers - 1]
    layers = model.n_layers
    per_token = (model.n_heads + 1) * sum(
        first + (last - first) * layer / max(1, layers - 1) for layer in range(layers)
    )
    lengths = [int(m) for m in lengths]
    scale = sum(m * m for m in lengths) / n_pos  # Σ passes (∝ m) × their cost (∝ m / n_pos)
    # each window also runs its analysis forward and the mixing measures' own (two more forwards)
    seconds = per_token * scale + 3 * forward_s * sum(lengths) / n_pos
    rows_per_call = max(1, chunk_size // max(1, batch_windows)) if vmapped else 1
    shaped = working_set(model, n_pos, windows=batch_windows if vmapped else 1, rows_per_call=rows_per_call)
    # what the process grew by while it held the window's graph (the autograd engine's own first
    # allocations included), with the rows and the passes in flight the measurement did not hold
    measured = 0
    if before is not None and after is not None and not cuda:
        measured = max(0, after - before) + shaped - graph_bytes(model, n_pos)
    return Estimate(
        windows=len(lengths),
        longest=max(lengths, default=0),
        passes=layers * (model.n_heads + 1) * sum(lengths),
        seconds=seconds,
        memory_bytes=max(shaped, measured),
        timed=timed,
        timing_s=time.perf_counter() - started,
    )
