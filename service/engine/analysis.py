"""One batch through the model with hooks → additive per-head summaries (BatchResult).

Pure computation: no database, no queue. The embedded runner and the Celery workers both call
``analyze_batch``; the result travels as compact bytes (``BatchResult.to_bytes``).
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from headatlas.service.engine.effect_batch import ReferenceMeans
from headatlas.service.engine.hooks import capture_attention
from headatlas.service.engine.model import LoadedModel
from headatlas.service.engine.results import (
    CHANCE_SUMS,
    HEAD_SUMS,
    PAIR_HISTS,
    BatchResult,
    sum_dtype,
    window_group,
)
from headatlas.service.engine.row_attention import row_attention, uses_row_attention
from headatlas.service.engine.stats import (
    RowSums,
    Workspace,
    chance_statistics,
    head_statistics,
    head_vectors,
    window_features,
)
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
    mixing_windows: int | None = None,
    attribution_chunk: int = 2048,
    effect_windows: int = 0,
    effect_means: ReferenceMeans | None = None,
) -> BatchResult:
    """Forward ``batch`` with hooks and summarise every head of every layer.

    ``documents``: rows for the documents whose windows are in the batch (stored with it).
    ``mixing_windows``: how many of the batch's first windows get the mixing measures when
    ``params.mixes`` (default: all); ``attribution_chunk``: gradient rows per backward call.
    ``effect_windows``: how many of the batch's first windows get the causal effects when
    ``params.effects`` (SPEC §9; ``effect_batch``), ``effect_means`` the run's reference means
    (for mean ablation).
    """
    started = time.perf_counter()
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
        chance = chance_statistics(feats, seq_len=params.seq_len)
    blocks = model.blocks
    per_layer: list[dict[str, torch.Tensor]] = []

    def summarise(layer: int, context: torch.Tensor, attn: torch.Tensor) -> None:
        # runs inside the forward pass, as each layer finishes; statistics in full precision
        with torch.autocast(model.device.type, enabled=False):
            w_o = model.adapter.output_weight(blocks[layer]) if params.vectors == "post_wo" else None
            z = head_vectors(context, model.n_heads, w_o)
            per_layer.append(
                head_statistics(
                    z,
                    attn,
                    feats,
                    select=params.select,
                    gate=params.gate,
                    seq_len=params.seq_len,
                    csm_bin=params.csm_bin,
                )
            )

    # a long window's attention in row blocks: no layer holds every head's pos × pos map
    in_rows = uses_row_attention(model, model.n_heads, input_ids.shape[1])
    with (
        torch.inference_mode(),
        model.autocast(),
        capture_attention(model.model, on_layer=summarise),
        row_attention(model.model, lambda: RowSums(feats)) if in_rows else contextlib.nullcontext(),
    ):
        model.model(input_ids=input_ids, attention_mask=attention_mask)
    with torch.inference_mode():
        # per layer [group, ...] -> [group, layer, ...]
        stacked = {key: torch.stack([s[key] for s in per_layer], dim=1) for key in per_layer[0]}
        anchor_pos = stacked["anchor_pos"]  # [window, layer, head]
        high_count = stacked["high_count"]
        anchor_token = input_ids.gather(1, anchor_pos.flatten(1)).view_as(anchor_pos)
        anchored = high_count > 0
        anchor_token = torch.where(anchored, anchor_token, torch.full_like(anchor_token, -1))
        frequent = anchored & (anchor_token == feats.frequent_token[:, None, None])
        stacked["anchor_frequent"] = feats.reduce(frequent.long())
        stacked["anchored_windows"] = feats.reduce(anchored.long())
    anchor_np = anchor_token.cpu().numpy().astype(np.int64)
    anchor_ids = [int(t) for t in np.unique(anchor_np) if t >= 0]
    vocab = dict(zip(anchor_ids, model.tokenizer.convert_ids_to_tokens(anchor_ids)))
    heads = {}
    for key in HEAD_SUMS:
        heads[key] = stacked[key].cpu().numpy().astype(sum_dtype(key))
    mixing, mixed, mixed_rows = {}, 0, 0
    if params.mixes:
        mixed = len(batch.windows) if mixing_windows is None else max(0, min(mixing_windows, len(batch.windows)))
    if mixed:
        from headatlas.service.measures.mixing import mixing_sums

        sub_ids, sub_mask = batch.input_ids[:mixed], batch.attention_mask[:mixed]
        with torch.inference_mode():
            sub_feats = window_features(
                sub_ids.to(model.device),
                sub_mask.to(model.device),
                tokens,
                include_special=params.include_special,
                sentence=None if sentence is None else sentence[:mixed],
                causal=model.causal,
            )
        mixing = mixing_sums(
            model,
            sub_ids,
            sub_mask,
            sub_feats,
            methods=params.mixing,
            attribution=params.attribution,
            seq_len=params.seq_len,
            chunk_size=attribution_chunk,
        )
        mixed_rows = int(sub_mask.sum())
    effects: dict = {}
    if params.effects:
        from headatlas.service.engine.effect_batch import effect_sums

        effect_heads, effect_run, effects = effect_sums(
            model,
            batch,
            params,
            count=max(0, min(effect_windows, len(batch.windows))),
            group=dense.reshape(-1),
            n_groups=len(reps),
            means=effect_means,
            pad_id=tokens.pad_id,
        )
        heads.update(effect_heads)
    rep_chance = {k: chance[k].cpu().numpy().astype(sum_dtype(k)) for k in CHANCE_SUMS}
    if effects:
        rep_chance.update(effect_run)
    return BatchResult(
        window_ids=batch.window_ids,
        reps=reps.astype(np.int16),
        rep_heads=heads,
        rep_dist_hist=stacked["dist_hist"].cpu().numpy().astype(np.int64),
        rep_attended_hist=stacked["attended_hist"].cpu().numpy().astype(np.int64),
        rep_chance=rep_chance,
        rep_pair_hist={k: chance[f"hist.{k}"].cpu().numpy().astype(np.int64) for k in PAIR_HISTS},
        anchor_token=anchor_np,
        anchor_count=stacked["anchor_count"].cpu().numpy().astype(np.int32),
        high_count=high_count.cpu().numpy().astype(np.int32),
        anchor_frequent=frequent.cpu().numpy(),
        windows=[
            {"window_id": w.window_id, "doc_id": w.doc_id, "window_index": w.index, "n_tokens": len(w.input_ids)}
            for w in batch.windows
        ],
        documents=documents or [],
        vocab=vocab,
        compute_s=time.perf_counter() - started,
        mixing=mixing,
        mixing_windows=mixed,
        mixing_rows=mixed_rows,
        rep_same_sentence_hist=stacked["same_sentence_hist"].cpu().numpy().astype(np.int64),
        csm_bin=params.csm_bin,
        # float32 sums: a batch's share of a picture needs no more, and they are most of its payload
        csm_sum=stacked["csm_sum"].cpu().numpy().astype(np.float32) if params.csm_bin else None,
        csm_count=stacked["csm_count"].cpu().numpy().astype(np.int32) if params.csm_bin else None,
        effects=effects,
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
        mixing_windows: int | None = None,
        attribution_chunk: int = 2048,
        effect_windows: int = 0,
        effect_means: ReferenceMeans | None = None,
    ) -> list[BatchResult]:
        """``mixing_windows``: how many of the batch's first windows get the mixing measures
        (None: all); ``effect_windows``: the causal effects; split batches hand them on in order."""
        windows = batch.windows
        size = len(windows) if self.max_windows is None else min(len(windows), self.max_windows)
        if size < len(windows):
            results = []
            left = len(windows) if mixing_windows is None else mixing_windows
            effects_left = effect_windows
            for i in range(0, len(windows), size):
                part = collate(windows[i : i + size], pad_id)
                results += self.analyze(
                    model,
                    part,
                    params,
                    tokens,
                    documents,
                    pad_id=pad_id,
                    mixing_windows=max(0, min(left, len(part.windows))),
                    attribution_chunk=attribution_chunk,
                    effect_windows=max(0, min(effects_left, len(part.windows))),
                    effect_means=effect_means,
                )
                left -= len(part.windows)
                effects_left -= len(part.windows)
            return results
        try:
            return [
                analyze_batch(
                    model,
                    batch,
                    params,
                    tokens,
                    documents=documents,
                    mixing_windows=mixing_windows,
                    attribution_chunk=attribution_chunk,
                    effect_windows=effect_windows,
                    effect_means=effect_means,
                )
            ]
        except RuntimeError as exc:
            if not _is_out_of_memory(exc) or len(windows) == 1:
                raise
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
        self.max_windows = max(1, len(windows) // 2)
        return self.analyze(
            model,
            batch,
            params,
            tokens,
            documents,
            pad_id=pad_id,
            mixing_windows=mixing_windows,
            attribution_chunk=attribution_chunk,
            effect_windows=effect_windows,
            effect_means=effect_means,
        )
