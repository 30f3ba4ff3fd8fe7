"""The synthetic probe (SPEC §8): every head scored on repeated random tokens, as Olsson et al.
2022 and TransformerLens's head detector score it.

A probe sequence is ``[first] + r + r (+ [last])``: ``first`` is the tokenizer's ``[CLS]`` (an
encoder) or BOS (a decoder; none where it has none), r is L token ids drawn uniformly from the
tokenizer's ordinary tokens, and ``[last]`` is ``[SEP]`` for an encoder only. The first copy of r
starts at position ``start`` (1 with a first token), the second at ``start + L``. Over the
positions i of the second copy:

- induction score       = mean ``A[i, i − L + 1]`` (the token that followed the earlier copy),
- duplicate-token score = mean ``A[i, i − L]`` (the earlier copy itself),
- previous-token score  = mean ``A[i, i − 1]``.

Pure computation: torch only. ``attention_maps`` is the one place that runs the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from headatlas.service.analysis_options import DEFAULTS
from headatlas.service.errors import Param, ParameterError

if TYPE_CHECKING:
    from headatlas.service.engine.model import LoadedModel

PROBE_LENGTH, PROBE_SEQUENCES = DEFAULTS["probe_length"], DEFAULTS["probe_sequences"]
PROBE_SEED = 0
SCORES = ("induction_score", "duplicate_score", "prev_token_score")
CHUNK = 8  # sequences per forward pass: a batch holds every layer's maps at once
# vocabulary slots that are not text: [unused12], [PAD]-like names, <0x0A>-like bytes, <|endoftext|>
_SLOT = re.compile(r"^(\[[^\]]*\]|<[^>]*>)$")


@dataclass(frozen=True)
class ProbeSpec:
    """The probe's parameters, stored with its scores."""

    length: int = PROBE_LENGTH  # L, the length of r
    sequences: int = PROBE_SEQUENCES
    seed: int = PROBE_SEED

    def __post_init__(self) -> None:
        if self.length < 2:
            raise ParameterError(Param("probe_length", self.length), f": must be at least 2 (default {PROBE_LENGTH})")
        if self.sequences < 1:
            raise ParameterError(
                Param("probe_sequences", self.sequences), f": must be at least 1 (default {PROBE_SEQUENCES})"
            )


@dataclass(frozen=True)
class ProbeLayout:
    """Where the tokens of a probe sequence sit: ``first`` (or None), r twice from ``start``,
    then ``last`` (or None)."""

    first: int | None
    last: int | None

    @property
    def start(self) -> int:
        return 0 if self.first is None else 1

    def width(self, length: int) -> int:
        return self.start + 2 * length + (self.last is not None)

    @classmethod
    def from_tokenizer(cls, tokenizer, *, causal: bool = False) -> ProbeLayout:
        """``[CLS] … [SEP]`` where the tokenizer has a CLS token and the model is not causal;
        otherwise BOS first (when there is one) and nothing at the end."""
        cls_id, sep_id, bos_id = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.bos_token_id
        if cls_id is not None and not causal:
            return cls(first=cls_id, last=sep_id)
        return cls(first=bos_id, last=None)


def ordinary_token_ids(tokenizer, vocab_size: int | None = None) -> torch.Tensor:
    """``[n]`` int64, ascending: the ids r is drawn from. Word tokens (SPEC §5b: the text holds a
    letter or digit), never special, never a bracketed slot (``[unused3]``, ``<0x0A>``), and inside
    the model's embedding (``vocab_size``)."""
    from headatlas.service.engine.windows import word_token_mask

    mask = word_token_mask(tokenizer)
    for text, idx in tokenizer.get_vocab().items():
        if _SLOT.match(text):
            mask[idx] = False
    for idx in getattr(tokenizer, "added_tokens_decoder", {}):
        if 0 <= idx < mask.numel():
            mask[idx] = False
    if vocab_size is not None:
        mask[vocab_size:] = False
    ids = mask.nonzero().flatten()
    if ids.numel() == 0:
        raise ParameterError(
            "the probe found no ordinary tokens in this tokenizer's vocabulary; run without ", Param("probe", True)
        )
    return ids


def probe_sequences(candidates: torch.Tensor, layout: ProbeLayout, spec: ProbeSpec) -> torch.Tensor:
    """``[sequence, pos]`` int64 token ids: ``[first] + r + r (+ [last])``, r drawn uniformly
    (with replacement) from ``candidates`` by a generator seeded with ``spec.seed``."""
    generator = torch.Generator().manual_seed(spec.seed)
    picks = torch.randint(candidates.numel(), (spec.sequences, spec.length), generator=generator)
    r = candidates[picks]  # [sequence, L]
    parts = [r, r]
    if layout.first is not None:
        parts.insert(0, torch.full((spec.sequences, 1), layout.first, dtype=torch.long))
    if layout.last is not None:
        parts.append(torch.full((spec.sequences, 1), layout.last, dtype=torch.long))
    return torch.cat(parts, dim=1)


def probe_scores(attn: torch.Tensor, *, length: int, start: int = 1) -> dict[str, torch.Tensor]:
    """Induction, duplicate-token and previous-token scores per head.

    ``attn``: ``[layer, batch, head, query, key]`` attention probabilities of probe sequences whose
    first copy of r starts at ``start``. Returns ``SCORES`` -> ``[layer, head]`` float64, the mean
    over the batch and over the L positions of the second copy.
    """
    if attn.dim() != 5:
        raise ValueError(f"attention maps must be [layer, batch, head, query, key], got shape {tuple(attn.shape)}")
    width = attn.shape[-1]
    if start + 2 * length > width:
        raise ValueError(f"a probe of length {length} from position {start} needs {start + 2 * length} positions")
    i = torch.arange(start + length, start + 2 * length, device=attn.device)  # the second copy
    rows = attn[..., i, :].double()  # [layer, batch, head, L, key]
    out = {}
    for name, back in zip(SCORES, (length - 1, length, 1), strict=True):
        picked = rows.gather(-1, (i - back).view(1, 1, 1, -1, 1).expand(*rows.shape[:-1], 1))
        out[name] = picked.squeeze(-1).mean(dim=(1, 3))
    return out


def attention_maps(model: LoadedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Forward ``input_ids`` (``[batch, pos]``, no padding) and return every layer's attention
    probabilities, ``[layer, batch, head, query, key]`` float32 on the model's device."""
    from headatlas.service.engine.hooks import capture_attention

    maps: list[torch.Tensor] = []
    ids = input_ids.to(model.device)
    with torch.inference_mode(), model.autocast():
        with capture_attention(model.model, on_layer=lambda _layer, _z, probs: maps.append(probs.float())):
            model.model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return torch.stack(maps)


def run_probe(model: LoadedModel, spec: ProbeSpec = ProbeSpec()) -> dict[str, torch.Tensor]:
    """The probe on a loaded model: ``SCORES`` -> ``[layer, head]`` float64 on the CPU."""
    config = getattr(model.model, "config", None)
    # the first and last specials of the model's own windows, as its adapter lays them out
    first, last = model.adapter.window_specials(model.tokenizer)
    layout = ProbeLayout(first=first, last=last)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and layout.width(spec.length) > limit:
        raise ParameterError(
            Param("probe_length", spec.length),
            f": a probe sequence of {layout.width(spec.length)} tokens exceeds the "
            f"model's {limit} positions; use at most {(limit - layout.width(0)) // 2}",
        )
    candidates = ordinary_token_ids(model.tokenizer, getattr(config, "vocab_size", None))
    sequences = probe_sequences(candidates, layout, spec)
    sums: dict[str, torch.Tensor] = {}
    for chunk in sequences.split(CHUNK):
        scores = probe_scores(attention_maps(model, chunk), length=spec.length, start=layout.start)
        for name in SCORES:
            part = scores[name].cpu() * len(chunk)
            sums[name] = sums[name] + part if name in sums else part
    return {name: total / spec.sequences for name, total in sums.items()}
