"""The model's own objective of a window, from its final hidden states (SPEC §9).

- **next-token loss** (decoders whose LM head is tied to the input embeddings: SmolLM2, GPT-2):
  the mean cross-entropy, in nats, over the window's positions that have a next token in the
  window; the logits are the final (normed) hidden states times the embedding matrix.
- **embedding drift** (encoders without a task head, such as the default sentence-embedding
  MiniLM, and decoders whose LM head is not tied, so not loaded with the base model):
  ``1 − cos(e', e)``, e the mean of the final hidden states over the window's valid tokens (the
  model's pooled embedding), e' the same under an intervention; 0 for the intact model.

A masked-LM loss for encoders that ship an MLM head is not computed: the base model is loaded
without its head. ``output_drift`` is computed beside every objective.

Pure tensor code: imports neither Celery, Typer nor SQLAlchemy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from headatlas.service.engine.model import LoadedModel

LOGIT_ELEMENTS = 1 << 25  # logits materialised at once (128 MB in float32), windows chunked to fit


def wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 when it is in a half precision, as it is otherwise (float64 stays)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


PerWindow = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class Objective:
    """``per_window(final, input_ids, attention_mask, intact_final) → [batch]``; ``is_loss``:
    a loss the model was trained to lower (gradient importance is defined for it)."""

    name: str
    unit: str
    is_loss: bool
    per_window: PerWindow


def objective_of(model: LoadedModel) -> Objective:
    """The objective of ``model`` (the module docstring says which)."""
    base: Any = model.model  # a transformers model (nn.Module's __getattr__ is typed Tensor | Module)
    config = getattr(base, "config", None)
    if model.causal and getattr(config, "tie_word_embeddings", False):
        weight = base.get_input_embeddings().weight

        def loss(final, input_ids, attention_mask, _intact):
            return next_token_loss(final, input_ids, attention_mask, weight)

        return Objective("next_token_loss", "nats", True, loss)

    def drift(final, _input_ids, attention_mask, intact):
        if intact is None:
            raise ValueError("embedding drift compares with the intact model's final states")
        return embedding_drift(final, intact, attention_mask)

    return Objective("embedding_drift", "1 - cos", False, drift)


def next_token_loss(
    final: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """Mean next-token cross-entropy per window ``[batch]`` (nats); NaN for a window of one token."""
    batch, n_pos, _ = final.shape
    valid = (attention_mask[:, :-1] > 0) & (attention_mask[:, 1:] > 0)
    targets = input_ids[:, 1:]
    w = weight.to(final.dtype)
    rows = max(1, LOGIT_ELEMENTS // max(1, (n_pos - 1) * w.shape[0]))
    losses = []
    for start in range(0, batch, rows):
        logits = final[start : start + rows, :-1] @ w.T
        nll = torch.nn.functional.cross_entropy(
            wide(logits.reshape(-1, logits.shape[-1])), targets[start : start + rows].reshape(-1), reduction="none"
        ).reshape(logits.shape[:2])
        keep = valid[start : start + rows].to(nll.dtype)
        losses.append((nll * keep).sum(dim=1) / keep.sum(dim=1))
    return torch.cat(losses)


def pooled(final: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The mean of the final hidden states over each window's valid tokens ``[batch, d_model]``."""
    weight = attention_mask.to(final.dtype).unsqueeze(-1)
    return (final * weight).sum(dim=1) / weight.sum(dim=1).clamp_min(1.0)


def embedding_drift(final: torch.Tensor, intact: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``1 − cos(e', e)`` per window ``[batch]``, e the pooled embedding of the intact model."""
    cos = torch.nn.functional.cosine_similarity(pooled(final, attention_mask), pooled(intact, attention_mask), dim=-1)
    return 1.0 - cos


def output_drift(final: torch.Tensor, intact: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``Σ_i ‖h'_i − h_i‖² / Σ_i ‖h_i‖²`` over each window's valid positions ``[batch]``."""
    weight = attention_mask.to(final.dtype)
    moved = ((final - intact) ** 2).sum(dim=-1)
    size = (intact**2).sum(dim=-1)
    return (moved * weight).sum(dim=1) / (size * weight).sum(dim=1)
