"""The objective of a window, from the model's final hidden states (SPEC §9): the model's own,
or the one a request names.

- **next-token loss** (decoders whose LM head is tied to the input embeddings: SmolLM2, GPT-2):
  the mean cross-entropy, in nats, over the window's positions that have a next token in the
  window; the logits are the final (normed) hidden states times the embedding matrix.
- **masked-LM loss** (encoders whose config names a masked-LM model of a family that loads its
  head, ``ModelAdapter.masked_lm``; the head loaded on first use, ``LoadedModel.mlm_head``): 15 % of the window's non-special valid positions (at least one) are
  replaced by ``[MASK]``, the positions chosen by a hash of the window id and the position (the
  same for the intact model and every ablation); the mean cross-entropy, in nats, of the original
  tokens at those positions.
- **embedding drift** (encoders without a task head, such as the default sentence-embedding
  MiniLM, and decoders whose LM head is not tied, so not loaded with the base model):
  ``1 − cos(e', e)``, e the mean of the final hidden states over the window's valid tokens (the
  model's pooled embedding), e' the same under an intervention; 0 for the intact model.

``output_drift`` is computed beside every objective.

The objectives are a registry (``OBJECTIVES``; a plugin adds one through the
``headatlas.objectives`` entry point): each ``ObjectiveDefinition`` says from a model's adapter and
config alone whether it applies (``applies``: no weights read) and builds its per-window function
from the loaded model (``build``). ``choose`` picks a run's objective from the adapter, the config
and the objective the request names (``AUTO``: the first built-in that applies, in the order
above) — the one decision that ``submit``'s check (``definition_for_spec``), the workers and the
embedded runner (``objective_for``) all make, so that they cannot disagree. The loaded model only
builds what was chosen: a masked-LM checkpoint whose weights lack the head is refused, not measured
by another objective.

Pure tensor code: imports neither Celery, Typer nor SQLAlchemy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from headatlas.service.engine.adapters import ModelAdapter
from headatlas.service.engine.model import LoadedModel
from headatlas.service.errors import ModelError, Param, ParameterError

LOGIT_ELEMENTS = 1 << 25  # logits materialised at once (128 MB in float32), windows chunked to fit
MASK_SHARE = 0.15  # masked-LM: share of a window's non-special positions masked (SPEC §9)


def wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 when it is in a half precision, as it is otherwise (float64 stays)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


PerWindow = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


Prepare = Callable[[torch.Tensor, torch.Tensor, "list[str] | None"], tuple[torch.Tensor, torch.Tensor]]


def _unmasked(input_ids: torch.Tensor, _mask: torch.Tensor, _keys) -> tuple[torch.Tensor, torch.Tensor]:
    return input_ids, input_ids


@dataclass(frozen=True)
class Objective:
    """``per_window(final, targets, attention_mask, intact_final) → [batch]``; ``is_loss``:
    a loss the model was trained to lower (gradient importance is defined for it).

    ``prepare(input_ids, attention_mask, window_ids) → (model_ids, targets)``: what the model is
    run on and what ``per_window`` is given as ``targets`` — the window itself twice, except for
    the masked-LM loss (``[MASK]`` in the model's input; the original ids where masked, -100
    elsewhere as targets). ``window_ids``: the windows' ids (None: a hash of their tokens)."""

    name: str
    unit: str
    is_loss: bool
    per_window: PerWindow
    prepare: Prepare = _unmasked


AUTO = "auto"  # the objective a request names when it names none: the first built-in that applies

Built = PerWindow | tuple[PerWindow, Prepare]


@dataclass(frozen=True)
class ObjectiveDefinition:
    """One objective of the registry. ``applies(adapter, config)``: whether it can measure a model
    of that family and config (no weights read: what ``submit`` checks); ``build(model)``: its
    ``per_window`` function for the loaded model, or ``(per_window, prepare)`` where the model is
    run on other ids than the window's (the masked-LM loss). ``is_loss``: a loss the model was
    trained to lower (gradient importance needs one). ``automatic``: chosen without being named
    (the built-ins; a plugin's objective is measured only when a request names it)."""

    name: str
    unit: str
    is_loss: bool
    summary: str
    applies: Callable[[ModelAdapter, Any], bool]
    build: Callable[[LoadedModel], Built]
    automatic: bool = False
    origin: str = "headatlas"


def _next_token_applies(adapter: ModelAdapter, config: Any) -> bool:
    return adapter.causal and bool(getattr(config, "tie_word_embeddings", False))


def _next_token(model: LoadedModel) -> Built:
    base: Any = model.model  # a transformers model (nn.Module's __getattr__ is typed Tensor | Module)
    weight = base.get_input_embeddings().weight

    def loss(final, input_ids, attention_mask, _intact):
        return next_token_loss(final, input_ids, attention_mask, weight)

    return loss


def _masked_lm_applies(adapter: ModelAdapter, config: Any) -> bool:
    return not adapter.causal and adapter.masked_lm(config)


def _masked_lm(model: LoadedModel) -> Built:
    head = model.mlm_head()
    if head is None:
        architectures = ", ".join(getattr(getattr(model.model, "config", None), "architectures", None) or [])
        raise ModelError(
            Param("model", model.spec),
            f": its config names a masked-LM model ({architectures}) but its weights hold no masked-LM head; "
            "measure it by embedding drift",
            hint=("pass ", Param("objective", "embedding_drift")),
        )
    tokenizer = model.tokenizer
    mask_id = tokenizer.mask_token_id
    if mask_id is None:
        raise ValueError(f"{model.name}: the tokenizer has no [MASK] token for its masked-LM head")
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)

    def prepare(input_ids, attention_mask, keys):
        return masked_inputs(input_ids, attention_mask, keys, mask_id=mask_id, special=special)

    def mlm(final, targets, _attention_mask, _intact):
        return masked_lm_loss(final, targets, head)

    return mlm, prepare


def _drift(_model: LoadedModel) -> Built:
    def drift(final, _input_ids, attention_mask, intact):
        if intact is None:
            raise ValueError("embedding drift compares with the intact model's final states")
        return embedding_drift(final, intact, attention_mask)

    return drift


# the built-ins, in the order the automatic choice tries them (embedding drift applies to every model)
OBJECTIVES: dict[str, ObjectiveDefinition] = {
    d.name: d
    for d in (
        ObjectiveDefinition(
            "next_token_loss",
            "nats",
            True,
            "mean next-token cross-entropy (decoders whose LM head is tied to the input embeddings)",
            _next_token_applies,
            _next_token,
            automatic=True,
        ),
        ObjectiveDefinition(
            "masked_lm_loss",
            "nats",
            True,
            "cross-entropy of 15% of the tokens masked (encoders whose config names a masked-LM model)",
            _masked_lm_applies,
            _masked_lm,
            automatic=True,
        ),
        ObjectiveDefinition(
            "embedding_drift",
            "1 - cos",
            False,
            "1 − cos of the pooled embedding against the intact model's (any model)",
            lambda _adapter, _config: True,
            _drift,
            automatic=True,
        ),
    )
}


def register(definition: ObjectiveDefinition) -> ObjectiveDefinition:
    """Add ``definition`` to the registry (a PluginError where its name is taken)."""
    from headatlas.service.errors import PluginError

    if not isinstance(definition, ObjectiveDefinition):
        raise PluginError(f"{definition!r} is not an ObjectiveDefinition")
    taken = OBJECTIVES.get(definition.name)
    if taken is not None and taken != definition:
        owner = "headatlas's" if taken.origin == "headatlas" else f"{taken.origin}'s"
        raise PluginError(f"objective {definition.name!r} is {owner} already: give the plugin's objective another name")
    if definition.name == AUTO or not definition.name.isidentifier():
        raise PluginError(f"objective {definition.name!r}: a name is a Python identifier, and not {AUTO!r}")
    OBJECTIVES[definition.name] = definition
    return definition


def _install_plugin(plugin: Any, value: Any) -> None:
    """A ``headatlas.objectives`` entry point names an ObjectiveDefinition (or a tuple of them); each
    is registered with the plugin as its origin, never chosen unless named."""
    from headatlas.service.errors import PluginError

    found = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not found or not all(isinstance(d, ObjectiveDefinition) for d in found):
        raise PluginError(f"{plugin.value} is not an ObjectiveDefinition (or a tuple of them)")
    for definition in found:
        register(replace(definition, origin=plugin.origin, automatic=False))


def objectives() -> dict[str, ObjectiveDefinition]:
    """Every objective, the plugins' included (read once per process): name -> definition."""
    from headatlas.service import plugins

    plugins.load(plugins.OBJECTIVES, _install_plugin)
    return OBJECTIVES


def choose(adapter: ModelAdapter, config: Any, requested: str = AUTO, *, model: str = "") -> ObjectiveDefinition:
    """The objective of a model of ``adapter``'s family and ``config``: the one ``requested``
    names, or (``AUTO``) the first built-in that applies. A ParameterError where the name is not
    registered or does not apply (``model``: the spec the message names)."""
    if requested == AUTO:
        return next(d for d in OBJECTIVES.values() if d.automatic and d.applies(adapter, config))
    known = objectives()
    definition = known.get(requested)
    if definition is None:
        raise ParameterError(
            Param("objective", requested, quoted=True),
            f": not an objective; choose {AUTO} or one of {', '.join(known)}",
        )
    if not definition.applies(adapter, config):
        fitting = [d.name for d in known.values() if d.applies(adapter, config)]
        raise ParameterError(
            Param("objective", requested),
            f" does not apply to {model or adapter.title} ({definition.summary}); it takes {', '.join(fitting)}",
        )
    return definition


def definition_for_spec(spec: str, requested: str = AUTO) -> ObjectiveDefinition:
    """``choose`` from a model's config alone, no weights loaded (``submit``, ``schedule add``)."""
    from headatlas.service.engine.model import model_config

    adapter, config = model_config(spec)
    return choose(adapter, config, requested, model=spec)


def definition_for(model: LoadedModel, requested: str = AUTO) -> ObjectiveDefinition:
    """``choose`` for a loaded model: from its adapter and its config, as from the spec."""
    return choose(model.adapter, getattr(model.model, "config", None), requested, model=model.spec)


def objective_for(model: LoadedModel, requested: str = AUTO) -> Objective:
    """The objective ``requested`` (``AUTO``: the model's own, the module docstring says which),
    built for ``model`` once and kept with it."""
    built: dict[str, Objective] = model.__dict__.setdefault("_objectives", {})
    if requested not in built:
        definition = definition_for(model, requested)
        got = definition.build(model)
        per_window, prepare = got if isinstance(got, tuple) else (got, _unmasked)
        built[requested] = Objective(definition.name, definition.unit, definition.is_loss, per_window, prepare)
    return built[requested]


def objective_of(model: LoadedModel) -> Objective:
    """The model's own objective (``objective_for`` with nothing named)."""
    return objective_for(model)


def next_token_loss(
    final: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """Mean next-token cross-entropy per window ``[batch]`` (nats); NaN for a window of one token.
    Logits are formed only at the positions that predict a valid next token (padding never goes
    through the vocabulary), a chunk of rows at a time."""
    batch = final.shape[0]
    valid = (attention_mask[:, :-1] > 0) & (attention_mask[:, 1:] > 0)
    rows, cols = valid.nonzero(as_tuple=True)
    states = final[:, :-1][rows, cols]  # [n, d_model]
    targets = input_ids[:, 1:][rows, cols]
    w = weight.to(final.dtype)
    step = max(1, LOGIT_ELEMENTS // max(1, w.shape[0]))
    nll = torch.cat(
        [
            torch.nn.functional.cross_entropy(wide(states[i : i + step] @ w.T), targets[i : i + step], reduction="none")
            for i in range(0, len(rows), step)
        ]
        or [torch.zeros(0, device=final.device)]
    ).to(final.dtype)
    total = torch.zeros(batch, dtype=final.dtype, device=final.device).index_add(0, rows, nll)
    count = torch.zeros(batch, dtype=final.dtype, device=final.device).index_add(0, rows, torch.ones_like(nll))
    return total / count  # 0 / 0: NaN for a window without a prediction


def mask_positions(window_id: str, candidates: list[int]) -> list[int]:
    """The positions of a window masked for the masked-LM loss: ``MASK_SHARE`` of ``candidates``
    (its non-special valid positions; at least one), those whose hash of ``window_id#position``
    is smallest — fixed by the window, whatever batch it is in."""
    if not candidates:
        return []
    count = max(1, round(MASK_SHARE * len(candidates)))
    ranked = sorted(candidates, key=lambda i: hashlib.sha256(f"{window_id}#{i}".encode()).digest())
    return sorted(ranked[:count])


def masked_inputs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, keys, *, mask_id: int, special: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(model_ids, targets)`` of the masked-LM loss: ``[MASK]`` at each window's masked
    positions; targets the original ids there, -100 elsewhere."""
    ids = input_ids.cpu()
    valid = (attention_mask.cpu() > 0) & ~torch.isin(ids, special)
    targets = torch.full_like(ids, -100)
    for row in range(ids.shape[0]):
        key = keys[row] if keys is not None else hashlib.sha256(ids[row].numpy().tobytes()).hexdigest()
        chosen = mask_positions(key, valid[row].nonzero().flatten().tolist())
        targets[row, chosen] = ids[row, chosen]
    model_ids = torch.where(targets >= 0, torch.full_like(ids, mask_id), ids)
    return model_ids.to(input_ids.device), targets.to(input_ids.device)


def masked_lm_loss(final: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
    """Mean cross-entropy per window ``[batch]`` (nats) of the original tokens at the masked
    positions (``targets`` ≥ 0), the logits from ``head``; NaN for a window with none masked.
    Only the masked positions go through the head."""
    rows, cols = (targets >= 0).nonzero(as_tuple=True)
    out = torch.full((final.shape[0],), float("nan"), dtype=final.dtype, device=final.device)
    if rows.numel() == 0:
        return out
    logits = wide(head(final[rows, cols]))
    nll = torch.nn.functional.cross_entropy(logits, targets[rows, cols], reduction="none").to(final.dtype)
    total = torch.zeros_like(out).index_add(0, rows, nll)
    count = torch.zeros_like(out).index_add(0, rows, torch.ones_like(nll))
    return torch.where(count > 0, total / count.clamp_min(1), out)


def pooled(final: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The mean of the final hidden states over each window's valid tokens ``[batch, d_model]``."""
    weight = attention_mask.to(final.dtype).unsqueeze(-1)
    return (final * weight).sum(dim=1) / weight.sum(dim=1).clamp_min(1.0)


def embedding_drift(final: torch.Tensor, intact: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``1 − cos(e', e)`` per window ``[batch]``, e the pooled embedding of the intact model; in
    float64, so that the intact model's drift is 0 to 1e-15, not to float32's 1e-7 (an effect is
    this minus that)."""
    a, b = pooled(final.double(), attention_mask), pooled(intact.double(), attention_mask)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    return (1.0 - cos).to(final.dtype if final.dtype == torch.float64 else torch.float64)


def output_drift(final: torch.Tensor, intact: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``Σ_i ‖h'_i − h_i‖² / Σ_i ‖h_i‖²`` over each window's valid positions ``[batch]``."""
    weight = attention_mask.to(final.dtype)
    moved = ((final - intact) ** 2).sum(dim=-1)
    size = (intact**2).sum(dim=-1)
    return (moved * weight).sum(dim=1) / (size * weight).sum(dim=1)
