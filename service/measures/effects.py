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
- **attribution patching** (``atp``; Kramár et al. 2024, "AtP*"): the first-order estimate of the
  mean-ablation effect, ``Σ_i (m^{l,h} − z^{l,h}_i) · ∂O/∂z^{l,h}_i`` over the window's positions,
  every head's from the same one forward and one backward pass: a coefficient α = 0 per window and
  head moves z toward its mean, ``z + α (m − z)`` (α = 1 is mean ablation), and ``∂O/∂α`` at α = 0
  is that sum. Only for losses, like gradient importance (a drift's first order is 0).

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
from headatlas.service.interrupts import stop_if_pressed
from headatlas.service.measures.objectives import Objective, objective_of, output_drift, wide
from headatlas.service.measures.objectives import objective_for as objective_for  # for the engine's effect runs

KINDS = ("zero", "mean", "gradient", "atp")
ABLATIONS = ("zero", "mean")
GRADIENTS = ("gradient", "atp")  # from one backward pass: objectives that are losses only
WITH_MEANS = ("mean", "atp")  # measured against the reference means


def needs_means(kinds: Iterable[str]) -> bool:
    """Whether ``kinds`` need the reference means (mean ablation, attribution patching)."""
    return any(k in WITH_MEANS for k in kinds)


def loss_only(kinds: Iterable[str]) -> tuple[str, ...]:
    """The kinds of ``kinds`` that only an objective that is a loss gives (a gradient at the intact
    model: a drift is minimal there, its gradient 0)."""
    return tuple(k for k in kinds if k in GRADIENTS)


def parse_kinds(text: str) -> tuple[str, ...]:
    """``zero,mean,gradient,atp`` → the kinds in SPEC order; a ParameterError naming a wrong one."""
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
    (Δ for the ablations, ``|∂O/∂ξ|`` for ``gradient``, Δ's first-order estimate for ``atp``);
    drift[kind]: the output drift of each ablation ``[batch, layer, head]``.
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
    stop_if_pressed()  # a Ctrl-C whose interrupt a destructor swallowed stops the effects here
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


def _gradients(
    model: LoadedModel,
    objective: Objective,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    targets: torch.Tensor,
    kinds: Sequence[str],
    means: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One forward and one backward pass (``input_ids``: what the model is run on, ``targets``:
    what the objective reads) for each of ``kinds`` (``GRADIENTS``) ``[batch, layer, head]``:
    ``gradient``: ``|∂O(w)/∂ξ_{l,h}|``, a gate ξ = 1 per window and head multiplying z;
    ``atp``: ``∂O(w)/∂α_{l,h}`` at α = 0, z replaced by ``z + α (m − z)`` (``means``: m
    ``[layer, head, d_head]``), which is ``Σ_i (m − z_i) · ∂O/∂z_i``. And ``O(w)`` ``[batch]`` of the
    same pass, which is the intact model's (``(z + 0 · (m − z)) · 1 = z``)."""
    batch = input_ids.shape[0]
    n_layers, n_heads, d_head = model.n_layers, model.n_heads, model.d_head
    dtype = wide(torch.empty(0, dtype=next(model.model.parameters()).dtype)).dtype
    gate = torch.ones(batch, n_layers, n_heads, device=model.device, dtype=dtype, requires_grad=True)
    alpha = torch.zeros(batch, n_layers, n_heads, device=model.device, dtype=dtype, requires_grad=True)
    if "atp" in kinds and means is None:
        raise ParameterError("attribution patching needs the reference means (reference_means)")
    m = means.to(model.device, dtype) if means is not None and "atp" in kinds else None

    def gated(layer: int):
        def fn(z: torch.Tensor) -> torch.Tensor:
            z4 = z.reshape(*z.shape[:2], n_heads, d_head)
            if m is not None:
                a = alpha[:, layer].to(z.dtype).reshape(batch, 1, n_heads, 1)
                z4 = z4 + a * (m[layer].to(z.dtype) - z4)
            if "gradient" in kinds:
                z4 = z4 * gate[:, layer].to(z.dtype).reshape(batch, 1, n_heads, 1)
            return z4.reshape(z.shape)

        return fn

    wrt = {"gradient": gate, "atp": alpha}
    asked = [k for k in GRADIENTS if k in kinds]
    gates = {f"blocks.{layer}.attn.z": gated(layer) for layer in range(n_layers)}
    with hooks(model.model, gates, model.adapter), torch.enable_grad():
        final = wide(_run_model(model, input_ids, attention_mask))
        values = objective.per_window(final, targets, attention_mask, None)
        grads = torch.autograd.grad(
            torch.nan_to_num(values).sum(), [wrt[k] for k in asked]
        )  # a window without a prediction adds nothing
    out = dict(zip(asked, grads, strict=True))
    if "gradient" in out:
        out["gradient"] = out["gradient"].abs()
    return out, values.detach()


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
    ``mean`` and ``atp``; ``heads_per_pass``: heads ablated together in one stacked pass (None: every head of
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
    if "atp" in kinds and means is None:
        raise ParameterError("attribution patching needs the reference means (reference_means)")
    objective = objective or objective_of(model)
    attention_mask = attention_mask.to(model.device)
    input_ids, targets = objective.prepare(input_ids.to(model.device), attention_mask, window_ids)
    batch, n_layers, n_heads = input_ids.shape[0], model.n_layers, model.n_heads
    chosen = list(range(n_layers)) if layers is None else sorted(set(layers))
    step = max(1, min(heads_per_pass or n_heads, n_heads))

    refused = loss_only(kinds)
    if refused and not objective.is_loss:
        what = {"gradient": "gradient importance", "atp": "attribution patching"}
        raise ParameterError(
            f"{' and '.join(what[k] for k in refused)} needs an objective that is a loss; this model's is "
            f"{objective.name} (a drift is minimal at the intact model: its gradient is 0 there)",
            hint=("use ", Param("kinds", "zero,mean")),
        )
    if not any(k in ABLATIONS for k in kinds):
        # gradients alone: their forward pass is the intact model's, so it gives the intact
        # objective too; no pass recording every layer's input is needed
        grads, intact = _gradients(model, objective, input_ids, attention_mask, targets, kinds, means)
        out = WindowEffects(objective=objective, intact=intact.double().cpu())
        for kind, value in grads.items():
            out.effect[kind] = value.double().cpu()
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
    if loss_only(kinds):
        grads, _ = _gradients(model, objective, input_ids, attention_mask, targets, kinds, means)
        for kind, value in grads.items():
            out.effect[kind] = value.double().cpu()
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
