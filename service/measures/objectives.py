"""The model's own objective of a window, from its final hidden states (SPEC §9).

- **next-token loss** (decoders whose LM head is tied to the input embeddings: SmolLM2, GPT-2):
  the mean cross-entropy, in nats, over the window's positions that have a next token in the
  window; the logits are the final (normed) hidden states times the embedding matrix.
- **masked-LM loss** (encoders whose checkpoint ships a masked-LM head, loaded on first use:
  ``LoadedModel.mlm_head``): 15 % of the window's non-special valid positions (at least one) are
  replaced by ``[MASK]``, the positions chosen by a hash of the window id and the position (the
  same for the intact model and every ablation); the mean cross-entropy, in nats, of the original
  tokens at those positions.
- **embedding drift** (encoders without a task head, such as the default sentence-embedding
  MiniLM, and decoders whose LM head is not tied, so not loaded with the base model):
  ``1 − cos(e', e)``, e the mean of the final hidden states over the window's valid tokens (the
  model's pooled embedding), e' the same under an intervention; 0 for the intact model.

``output_drift`` is computed beside every objective.

Pure tensor code: imports neither Celery, Typer nor SQLAlchemy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from headatlas.service.engine.model import LoadedModel

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


def objective_of(model: LoadedModel) -> Objective:
    """The objective of ``model`` (the module docstring says which)."""
    base: Any = model.model  # a transformers model (nn.Module's __getattr__ is typed Tensor | Module)
    config = getattr(base, "config", None)
    if model.causal and getattr(config, "tie_word_embeddings", False):
        weight = base.get_input_embeddings().weight

        def loss(final, input_ids, attention_mask, _intact):
            return next_token_loss(final, input_ids, attention_mask, weight)

        return Objective("next_token_loss", "nats", True, loss)
    head = None if model.causal else model.mlm_head()
    if head is not None:
        tokenizer = model.tokenizer
        mask_id = tokenizer.mask_token_id
        if mask_id is None:
            raise ValueError(f"{model.name}: the tokenizer has no [MASK] token for its masked-LM head")
        special = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)

        def prepare(input_ids, attention_mask, keys):
            return masked_inputs(input_ids, attention_mask, keys, mask_id=mask_id, special=special)

        def mlm(final, targets, _attention_mask, _intact):
            return masked_lm_loss(final, targets, head)

        return Objective("masked_lm_loss", "nats", True, mlm, prepare)

    def drift(final, _input_ids, attention_mask, intact):
        if intact is None:
            raise ValueError("embedding drift compares with the intact model's final states")
        return embedding_drift(final, intact, attention_mask)

    return Objective("embedding_drift", "1 - cos", False, drift)


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
