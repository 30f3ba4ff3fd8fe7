"""One batch through the model with hooks → additive per-head summaries (BatchResult).

Pure computation: no database, no queue. The embedded runner and the Celery workers both call
``analyze_batch``; the result travels as compact bytes (``BatchResult.to_bytes``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping

import numpy as np
import torch

from headatlas.service.engine.features import Workspace, window_features
from headatlas.service.engine.hooks import capture_attention
from headatlas.service.engine.measure_contract import Take
from headatlas.service.engine.model import LoadedModel
from headatlas.service.engine.reference_means import ReferenceMeans
from headatlas.service.engine.results import BatchResult, window_group
from headatlas.service.engine.row_attention import row_attention, uses_row_attention
from headatlas.service.engine.stats import RowSums
from headatlas.service.engine.windows import Batch, TokenClasses, collate
from headatlas.service.errors import ParameterError
from headatlas.service.params import AnalysisParams

# One set of scratch buffers per device and process, reused by every batch.
_WORKSPACES: dict[str, Workspace] = {}

ANCHOR_SUMS = ("anchor_frequent", "anchored_windows")  # from the anchors, after the forward pass


def forward(model: LoadedModel, batch: Batch) -> dict[str, torch.Tensor]:
    """Run the model on a batch and return the captured activations by canonical name."""
    return _forward(model, *_on_device(model, batch))


def _on_device(model: LoadedModel, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's ids and mask on the model's device, moved once (pinned for an async copy)."""
    if model.device.type == "cpu":
        return batch.input_ids, batch.attention_mask
    return (
        batch.input_ids.pin_memory().to(model.device, non_blocking=True),
        batch.attention_mask.pin_memory().to(model.device, non_blocking=True),
    )


def batch_sentences(model: LoadedModel, batch: Batch, params: AnalysisParams) -> torch.Tensor | None:
    """The batch's sentence ids on the model's device, ``[batch, pos]`` int64, when the run uses
    the segmenter; None under ``punct`` (the statistics derive them from the token ids)."""
    if params.sentences == "punct":
        return None
    if batch.sentence is None:
        raise ParameterError(
            f"--sentences {params.sentences}: the batch's windows carry no sentence ids; make them with "
            "document_windows under the run's parameters (a batch made for --sentences punct cannot be reused)"
        )
    return batch.sentence.to(model.device)


def _forward(model: LoadedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.inference_mode(), model.autocast(), capture_attention(model.model) as acts:
        model.model(input_ids=input_ids, attention_mask=attention_mask)
    return dict(acts)


def analyze_batch(
    model: LoadedModel,
    batch: Batch,
    params: AnalysisParams,
    tokens: TokenClasses,
    *,
    documents: list[dict] | None = None,
    windows: Mapping[str, Take] | None = None,
    mixing_windows: int | None = None,
    attribution_chunk: int = 2048,
    effect_windows: int = 0,
    effect_means: ReferenceMeans | None = None,
) -> BatchResult:
    """Forward ``batch`` with hooks and run on it the measures the request asks for
    (service/engine/measure_contract.py): those ``params`` ask for, the plugin measures it names
    (``params.measures``) among them. The head statistics summarise every head of every layer as it finishes.

    ``documents``: rows for the documents whose windows are in the batch (stored with it).
    ``windows``: which of the batch's windows each measure takes, by name: its first that many,
    or those indices (``measure_contract.Take``; a measure not named: its rule, as if the batch
    came first in its run); ``mixing_windows`` and
    ``effect_windows`` are its entries ``mixing`` (default: all) and ``effects`` (default: none)
    (SPEC §6, §9). ``attribution_chunk``: gradient rows per backward call; ``effect_means`` the
    run's reference means (for mean ablation).
    """
    from headatlas.service.engine.measure_contract import (
        BatchContext,
        batch_counts,
        put_sums,
        requested,
        taken_indices,
    )
    from headatlas.service.interrupts import stop_if_pressed

    stop_if_pressed()  # a Ctrl-C whose interrupt a destructor swallowed stops the run here
    started = time.perf_counter()
    chosen = requested(params)
    given = {"mixing": len(batch.windows) if mixing_windows is None else mixing_windows, "effects": effect_windows}
    takes = batch_counts(chosen, params, len(batch.windows), {**given, **(windows or {})})
    taken = {name: taken_indices(take) for name, take in takes.items()}
    counts = {name: len(indices) for name, indices in taken.items()}
    input_ids, attention_mask = _on_device(model, batch)
    # replicate groups present in the batch (ascending) and each window's index among them; the
    # scheme is the one the run resolved and recorded (SPEC §5d)
    groups = [
        window_group(params.replicates, window_id=w.window_id, doc_id=w.doc_id, index=w.index) for w in batch.windows
    ]
    reps, dense = np.unique(groups, return_inverse=True)
    sentence = batch_sentences(model, batch, params)
    with torch.inference_mode():
        workspace = _WORKSPACES.setdefault(str(model.device), Workspace(model.device))
        feats = window_features(
            input_ids,
            attention_mask,
            tokens,
            include_special=params.include_special,
            workspace=workspace,
            group=torch.as_tensor(dense.reshape(-1), dtype=torch.long, device=input_ids.device),
            n_groups=len(reps),
            sentence=sentence,
            causal=model.causal,
        )
    ctx = BatchContext(
        model=model,
        batch=batch,
        params=params,
        tokens=tokens,
        input_ids=input_ids,
        attention_mask=attention_mask,
        feats=feats,
        sentence=sentence,
        reps=reps,
        group=dense.reshape(-1),
        attribution_chunk=attribution_chunk,
        effect_means=effect_means,
        counts=counts,
        taken=taken,
    )
    in_pass = [m for m in chosen if m.reads_attention]

    def on_layer(layer: int, context: torch.Tensor, attn: torch.Tensor) -> None:
        # runs inside the forward pass, as each layer finishes
        for measure in in_pass:
            measure.on_layer(ctx, layer, context, attn)

    # a long window's attention in row blocks: no layer holds every head's pos × pos map
    in_rows = uses_row_attention(model, model.n_heads, input_ids.shape[1])
    with (
        torch.inference_mode(),
        model.autocast(),
        capture_attention(model.model, on_layer=on_layer),
        row_attention(model.model, lambda: RowSums(feats)) if in_rows else contextlib.nullcontext(),
    ):
        model.model(input_ids=input_ids, attention_mask=attention_mask)
    for measure in chosen:
        sums = measure.collect(ctx, counts[measure.name])
        if sums is not None:
            put_sums(ctx, measure, sums)
    return BatchResult(
        window_ids=batch.window_ids,
        reps=reps.astype(np.int16),
        rep_heads=ctx.heads,
        rep_chance=ctx.run,
        windows=[
            {"window_id": w.window_id, "doc_id": w.doc_id, "window_index": w.index, "n_tokens": len(w.input_ids)}
            for w in batch.windows
        ],
        documents=documents or [],
        compute_s=time.perf_counter() - started,
        measures=ctx.measures,
        **ctx.fields,
    )


def _is_out_of_memory(exc: BaseException) -> bool:
    """The device ran out of memory: torch raises its own type when the device's allocator runs
    out (torch.OutOfMemoryError; torch.cuda.OutOfMemoryError is the same class). No message is read:
    a RuntimeError that merely says "out of memory" is not this."""
    return isinstance(exc, torch.OutOfMemoryError)


class OomSplitter:
    """Analyse batches, halving any that runs out of device memory, and remember the largest
    size that fitted so later batches are split up front instead of failing again."""

    def __init__(self) -> None:
        self.max_windows: int | None = None

    def analyze(
        self,
        model: LoadedModel,
        batch: Batch,
        params: AnalysisParams,
        tokens: TokenClasses,
        documents: list[dict],
        *,
        pad_id: int,
        windows: Mapping[str, Take] | None = None,
        mixing_windows: int | None = None,
        attribution_chunk: int = 2048,
        effect_windows: int = 0,
        effect_means: ReferenceMeans | None = None,
    ) -> list[BatchResult]:
        """``windows``, ``mixing_windows``, ``effect_windows``: which of the batch's windows each
        measure takes (``analyze_batch``); split batches hand each part its own share of them."""
        from headatlas.service.engine.measure_contract import batch_counts, clip, requested

        given = {"mixing": len(batch.windows) if mixing_windows is None else mixing_windows, "effects": effect_windows}
        counts = batch_counts(requested(params), params, len(batch.windows), {**given, **(windows or {})})
        size = len(batch.windows) if self.max_windows is None else min(len(batch.windows), self.max_windows)
        if size < len(batch.windows):
            results = []
            for i in range(0, len(batch.windows), size):
                part = collate(batch.windows[i : i + size], pad_id)
                results += self.analyze(
                    model,
                    part,
                    params,
                    tokens,
                    documents,
                    pad_id=pad_id,
                    windows={name: clip(take, len(part.windows), i) for name, take in counts.items()},
                    attribution_chunk=attribution_chunk,
                    effect_means=effect_means,
                )
            return results
        try:
            return [
                analyze_batch(
                    model,
                    batch,
                    params,
                    tokens,
                    documents=documents,
                    windows=counts,
                    attribution_chunk=attribution_chunk,
                    effect_means=effect_means,
                )
            ]
        except RuntimeError as exc:
            if not _is_out_of_memory(exc) or len(batch.windows) == 1:
                raise
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
        self.max_windows = max(1, len(batch.windows) // 2)
        return self.analyze(
            model,
            batch,
            params,
            tokens,
            documents,
            pad_id=pad_id,
            windows=counts,
            attribution_chunk=attribution_chunk,
            effect_means=effect_means,
        )
