"""Causal effects of heads (SPEC §9): what the model loses when a head is removed.

Per window w and head (l, h), with ``O`` the run's objective (``objectives.objective_for``: the
model's own unless the request names another):

- **zero / mean ablation**: the head's output ``z^{l,h}`` (before W_O, every position) replaced by
  0 or by ``m^{l,h}``, its mean over the valid positions of reference windows
  (``reference_means``); the effect is ``Δ = O_ablated(w) − O(w)``, and the *output drift*
  ``Σ_i ‖h'_i − h_i‖² / Σ_i ‖h_i‖²`` over the final hidden states comes with it;
- **gradient importance** (Michel et al. 2019): a gate ξ = 1 on every head's z, one per window, so
  that one backward pass gives every ``|∂O(w)/∂ξ_{l,h}|`` (the windows do not interact). Only for
  objectives that are losses: a drift is minimal at ξ = 1 and its gradient 0.

Cost. The intact pass records every block's input (and the arguments the model hands it); an
ablation of a head of layer l restarts from layer l's input, so the layers below are never run
again, and every head of layer l is ablated in one stacked pass (the window repeated once per
head, each copy missing another head) — ``heads_per_pass`` bounds that stack's memory. Exhaustive
ablation of a window costs Σ_l (L − l) / L of (layers × heads) full forward passes: 0.58× for 6
layers, 0.54× for 12 (``benchmarks/effects.py`` measures it).

Pure tensor code: imports neither Celery, Typer nor SQLAlchemy. Dimension names: batch (windows),
layer, head, pos, d_model, d_head.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from headatlas.service.engine.hooks import block_calls, hooks
from headatlas.service.engine.model import LoadedModel
from headatlas.service.errors import Param, ParameterError
from headatlas.service.measures.objectives import Objective, objective_of, output_drift, wide
from headatlas.service.measures.objectives import objective_for as objective_for  # for the engine's effect runs

KINDS = ("zero", "mean", "gradient")
ABLATIONS = ("zero", "mean")


def parse_kinds(text: str) -> tuple[str, ...]:
    """``zero,mean,gradient`` → the kinds in SPEC order; a ParameterError naming a wrong one."""
    kinds = [part.strip().lower() for part in text.split(",") if part.strip()]
    if not kinds:
        raise ParameterError(Param("kinds", text, quoted=True), f": name at least one of {', '.join(KINDS)}")
    for kind in kinds:
        if kind not in KINDS:
            raise ParameterError(
                Param("kinds", text, quoted=True), f": {kind!r} is not an effect; use {', '.join(KINDS)}"
            )
    return tuple(k for k in KINDS if k in kinds)


@dataclass
class WindowEffects:
    """Per-window effects of one batch, on the CPU in float64.

    intact: ``O(w)`` of the intact model ``[batch]``; effect[kind]: ``[batch, layer, head]``
    (Δ for the ablations, ``|∂O/∂ξ|`` for ``gradient``); drift[kind]: the output drift of each
    ablation ``[batch, layer, head]``.
    """

    objective: Objective
    intact: torch.Tensor
    effect: dict[str, torch.Tensor] = field(default_factory=dict)
    drift: dict[str, torch.Tensor] = field(default_factory=dict)


# --- the intact pass, recorded ---------------------------------------------------------------------


@dataclass
class _Recording:
    """Every block's call (positional and keyword arguments, hidden states first) and the final
    hidden states of the intact model."""

    calls: list[tuple[tuple, dict[str, Any]]]
    final: torch.Tensor


def _record(model: LoadedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> _Recording:
    with block_calls(model.model, model.adapter) as calls:  # each block's call, at blocks.L.resid_pre
        final = _run_model(model, input_ids, attention_mask)
    if any(call is None for call in calls):
        raise RuntimeError("a block was not called in the forward pass")
    return _Recording(calls=[c for c in calls if c is not None], final=final)


def _run_model(model: LoadedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
    if model.adapter.causal:
        kwargs["use_cache"] = False  # a cache would grow with every replayed block
    with model.autocast():
        out = model.model(**kwargs)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _hidden(call: tuple[tuple, dict[str, Any]]) -> torch.Tensor:
    args, kwargs = call
    return args[0] if args else kwargs["hidden_states"]


def _repeat(value: Any, copies: int, batch: int) -> Any:
    """``value`` with every tensor whose first dimension is the batch repeated ``copies`` times
    (copy-major: row ``k·batch + b``); tensors broadcast over the batch (first dimension 1 of a
    batch of several) and everything else as it is."""
    if copies == 1:
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() >= 1 and value.shape[0] == batch:
            return value.repeat(copies, *([1] * (value.dim() - 1)))
        return value
    if isinstance(value, tuple):
        return tuple(_repeat(v, copies, batch) for v in value)
    if isinstance(value, list):
        return [_repeat(v, copies, batch) for v in value]
    return value


def _replay(model: LoadedModel, recording: _Recording, start: int, hidden: torch.Tensor, copies: int) -> torch.Tensor:
    """The final hidden states from layer ``start`` on, its input replaced by ``hidden`` (the
    batch repeated ``copies`` times), through the model's final norm."""
    batch = _hidden(recording.calls[0]).shape[0]
    blocks = model.blocks
    x = hidden
    with model.autocast():
        for layer in range(start, len(blocks)):
            args, kwargs = recording.calls[layer]
            rest = _repeat(args[1:], copies, batch)
            extra = {k: _repeat(v, copies, batch) for k, v in kwargs.items() if k != "hidden_states"}
            out = blocks[layer](x, *rest, **extra) if args else blocks[layer](hidden_states=x, **extra)
            x = out[0] if isinstance(out, tuple) else out
        norm = model.adapter.final_norm(model.model)
        if norm is not None:
            x = norm(x)
    return x


def _edit_z(
    layer: int, model: LoadedModel, edit: Callable[[torch.Tensor], torch.Tensor]
) -> AbstractContextManager[None]:
    """Inside: layer ``layer``'s z (``blocks.L.attn.z``) replaced by ``edit(z)``."""
    return hooks(model.model, {f"blocks.{layer}.attn.z": edit}, model.adapter)


# --- ablation ------------------------------------------------------------------------------------


def _ablate_layer(
    model: LoadedModel,
    recording: _Recording,
    objective: Objective,
    targets: torch.Tensor,
    attention_mask: torch.Tensor,
    layer: int,
    heads: Sequence[int],
    replacement: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Objective and output drift ``[batch, len(heads)]`` with each head of ``heads`` (of
    ``layer``) replaced by ``replacement[head]`` ``[d_head]``, one stacked pass."""
    n_heads, d_head = model.n_heads, model.d_head
    batch = targets.shape[0]
    copies = len(heads)
    keep = torch.ones(copies, 1, 1, n_heads, 1, device=replacement.device, dtype=replacement.dtype)
    fill = torch.zeros(copies, 1, 1, n_heads, d_head, device=replacement.device, dtype=replacement.dtype)
    for k, head in enumerate(heads):
        keep[k, 0, 0, head, 0] = 0.0
        fill[k, 0, 0, head] = replacement[head]

    def edit(z: torch.Tensor) -> torch.Tensor:
        n_pos = z.shape[1]
        z5 = z.reshape(copies, batch, n_pos, n_heads, d_head)
        return (z5 * keep.to(z.dtype) + fill.to(z.dtype)).reshape(z.shape)

    start = _hidden(recording.calls[layer])
    with _edit_z(layer, model, edit):
        final = _replay(model, recording, layer, _repeat(start, copies, batch), copies)
    final = wide(final).reshape(copies, batch, *final.shape[1:])
    ids = targets.unsqueeze(0).expand(copies, -1, -1).reshape(copies * batch, -1)
    mask = attention_mask.unsqueeze(0).expand(copies, -1, -1).reshape(copies * batch, -1)
    intact = wide(recording.final).unsqueeze(0).expand(copies, -1, -1, -1).reshape(copies * batch, *final.shape[2:])
    flat = final.reshape(copies * batch, *final.shape[2:])
    values = objective.per_window(flat, ids, mask, intact).reshape(copies, batch)
    drift = output_drift(flat, intact, mask).reshape(copies, batch)
    return values.T, drift.T


def _gradient(
    model: LoadedModel,
    objective: Objective,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    targets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``|∂O(w)/∂ξ_{l,h}|`` ``[batch, layer, head]``: one gate per window and head, one backward
    (``input_ids``: what the model is run on, ``targets``: what the objective reads); and ``O(w)``
    ``[batch]`` of the same pass, which is the intact model's (every gate is 1: ``z · 1 = z``)."""
    batch = input_ids.shape[0]
    n_layers, n_heads, d_head = model.n_layers, model.n_heads, model.d_head
    dtype = next(model.model.parameters()).dtype
    gate = torch.ones(batch, n_layers, n_heads, device=model.device, dtype=wide(torch.empty(0, dtype=dtype)).dtype)
    gate.requires_grad_(True)

    def gated(layer: int):
        def fn(z: torch.Tensor) -> torch.Tensor:
            g = gate[:, layer].to(z.dtype).reshape(batch, 1, n_heads, 1)
            return (z.reshape(*z.shape[:2], n_heads, d_head) * g).reshape(z.shape)

        return fn

    gates = {f"blocks.{layer}.attn.z": gated(layer) for layer in range(n_layers)}
    with hooks(model.model, gates, model.adapter), torch.enable_grad():
        final = wide(_run_model(model, input_ids, attention_mask))
        values = objective.per_window(final, targets, attention_mask, None)
        (grad,) = torch.autograd.grad(
            torch.nan_to_num(values).sum(), gate
        )  # a window without a prediction adds nothing
    return grad.abs(), values.detach()


def head_effects(
    model: LoadedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    kinds: Iterable[str] = ABLATIONS,
    means: torch.Tensor | None = None,
    heads_per_pass: int | None = None,
    layers: Iterable[int] | None = None,
    window_ids: list[str] | None = None,
    objective: Objective | None = None,
) -> WindowEffects:
    """Every head's effect on a batch of windows, for each of ``kinds`` (SPEC §9).

    ``means``: the reference means ``[layer, head, d_head]`` (``reference_means``), needed for
    ``mean``; ``heads_per_pass``: heads ablated together in one stacked pass (None: every head of
    a layer); ``layers``: only these layers' heads (the others' effects are NaN);
    ``window_ids``: the windows' ids, which fix the masked positions of a masked-LM objective;
    ``objective``: the run's (None: the model's own, ``objective_of``).
    """
    kinds = tuple(kinds)
    for kind in kinds:
        if kind not in KINDS:
            raise ParameterError(f"unknown effect {kind!r}; use {', '.join(KINDS)}")
    if "mean" in kinds and means is None:
        raise ParameterError("mean ablation needs the reference means (reference_means)")
    objective = objective or objective_of(model)
    attention_mask = attention_mask.to(model.device)
    input_ids, targets = objective.prepare(input_ids.to(model.device), attention_mask, window_ids)
    batch, n_layers, n_heads = input_ids.shape[0], model.n_layers, model.n_heads
    chosen = list(range(n_layers)) if layers is None else sorted(set(layers))
    step = max(1, min(heads_per_pass or n_heads, n_heads))

    if "gradient" in kinds and not objective.is_loss:
        raise ParameterError(
            f"gradient importance needs an objective that is a loss; this model's is {objective.name} "
            "(a drift is minimal at the intact model: its gradient is 0 there)",
            hint=("use ", Param("kinds", "zero,mean")),
        )
    if not any(k in ABLATIONS for k in kinds):
        # gradient importance alone: its forward pass is the intact model's, so it gives the intact
        # objective too; no pass recording every layer's input is needed
        grad, intact = _gradient(model, objective, input_ids, attention_mask, targets)
        out = WindowEffects(objective=objective, intact=intact.double().cpu())
        out.effect["gradient"] = grad.double().cpu()
        return out

    with torch.no_grad():
        recording = _record(model, input_ids, attention_mask)
        final = wide(recording.final)
        intact = objective.per_window(final, targets, attention_mask, final)
        out = WindowEffects(objective=objective, intact=intact.double().cpu())
        for kind in (k for k in kinds if k in ABLATIONS):
            effect = torch.full((batch, n_layers, n_heads), math.nan, dtype=torch.float64)
            drift = torch.full((batch, n_layers, n_heads), math.nan, dtype=torch.float64)
            for layer in chosen:
                if kind == "zero":
                    replacement = torch.zeros(n_heads, model.d_head, device=model.device)
                else:
                    assert means is not None
                    replacement = means[layer].to(model.device, torch.float32)
                for first in range(0, n_heads, step):
                    heads = list(range(first, min(first + step, n_heads)))
                    values, drifts = _ablate_layer(
                        model, recording, objective, targets, attention_mask, layer, heads, replacement
                    )
                    effect[:, layer, heads] = (values - intact.unsqueeze(1)).double().cpu()
                    drift[:, layer, heads] = drifts.double().cpu()
            out.effect[kind] = effect
            out.drift[kind] = drift
    if "gradient" in kinds:
        out.effect["gradient"] = _gradient(model, objective, input_ids, attention_mask, targets)[0].double().cpu()
    return out


def reference_means(
    model: LoadedModel, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, int]:
    """``m^{l,h}``: every head's z averaged over the valid positions of ``batches`` (``(input_ids,
    attention_mask)`` pairs), ``[layer, head, d_head]`` float64, and the number of positions."""
    from headatlas.service.engine.hooks import capture_attention

    n_layers, n_heads, d_head = model.n_layers, model.n_heads, model.d_head
    sums = torch.zeros(n_layers, n_heads * d_head, dtype=torch.float64)
    positions = 0
    for input_ids, attention_mask in batches:
        ids, mask = input_ids.to(model.device), attention_mask.to(model.device)
        weight = mask.to(torch.float64).unsqueeze(-1)

        def add(layer: int, z: torch.Tensor, _probs: torch.Tensor, weight=weight) -> None:
            sums[layer] += (z.double() * weight.to(z.device)).sum(dim=(0, 1)).cpu()

        with torch.no_grad(), capture_attention(model.model, add):
            _run_model(model, ids, mask)
        positions += int(mask.sum())
    if positions == 0:
        raise ParameterError("the reference windows hold no tokens: mean ablation needs a reference set")
    return (sums / positions).reshape(n_layers, n_heads, d_head), positions
