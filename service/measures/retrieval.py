"""Neighbour retrieval: what a sentence-embedding model's embeddings are for, measured on the corpus
with no labels (SPEC §9, the downstream measure beside ``embedding_drift`` on a pruning curve).

Every evaluation window is split into its sentences (the run's own: ``--sentences segmenter``
carries them with the window, ``punct`` ends one at every . ! ?). Each sentence is embedded **on
its own** (``[CLS] sentence [SEP]``, mean-pooled over its valid tokens as the objective pools a
window), as a sentence-embedding model is used: inside one window a sentence's tokens attend to
its neighbours, so a span of the window's pass would carry its successor's words and the score
would measure the mixing that removing heads takes away rather than the embeddings' use.

A *query* is a sentence followed by another in its window; its *target* that successor. The
*candidates* are every sentence that follows another in its window, over all the evaluation
windows, less the query itself. The query ranks the candidates by cosine similarity; ties count as
a draw among the tied (the expected value over a random order of them), so a model that maps
every sentence to one vector scores chance, not 0. Top-1 is the share of queries whose target
ranks first, MRR the mean of 1 / its rank. Chance: ``1/n`` and ``H_n / n`` for a query among n
candidates, averaged over the queries.

Pure computation: numpy and torch, nothing of a store or a command line.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from headatlas.service.engine.windows import TokenClasses, Window

if TYPE_CHECKING:
    from headatlas.service.engine.model import LoadedModel


@dataclass(frozen=True)
class NeighbourTask:
    """The sentences of a set of windows and the queries among them.

    ``sentences``: each sentence's input ids as the model reads it alone (the window's opening and
    closing specials around its word pieces); ``window`` ``[sentence]``: the window it came from
    (an index into the windows given); ``query``/``target`` ``[query]``: a sentence and its
    successor (indices into ``sentences``); ``candidates`` ``[candidate]``: every sentence that
    follows another in its window."""

    sentences: list[tuple[int, ...]]
    window: np.ndarray
    query: np.ndarray
    target: np.ndarray
    candidates: np.ndarray

    @property
    def query_windows(self) -> np.ndarray:
        """``[query]``: the window of each query (for the replicate groups of an interval)."""
        return self.window[self.query]

    def chance(self) -> tuple[float, float]:
        """Top-1 and MRR of a ranking at random: the mean over queries of ``1/n`` and ``H_n/n``."""
        n = self._counts()
        if not len(n):
            return math.nan, math.nan
        harmonic = np.array([np.sum(1.0 / np.arange(1, k + 1)) for k in n])
        return float(np.mean(1.0 / n)), float(np.mean(harmonic / n))

    def _counts(self) -> np.ndarray:
        """``[query]``: the candidates each query ranks (the pool less the query itself)."""
        pool = set(self.candidates.tolist())
        return np.array([len(pool) - (int(q) in pool) for q in self.query], dtype=np.int64)


def window_sentences(window: Window, tokens: TokenClasses) -> list[tuple[int, ...]]:
    """The word pieces of each sentence of ``window``, in order (specials left out).

    Sentence ids are the window's own where it carries them (``--sentences segmenter``), else the
    ``punct`` rule (SPEC §1): a token of ``tokens.sentence_end_ids`` ends its sentence."""
    ids = window.input_ids
    special = tokens.special_ids
    out: dict[int, list[int]] = {}
    if window.sentence_ids is not None:
        for token, sentence in zip(ids, window.sentence_ids, strict=True):
            if sentence >= 0 and token not in special:
                out.setdefault(sentence, []).append(token)
        return [tuple(out[s]) for s in sorted(out)]
    sentence = 0
    for token in ids:
        if token in special:
            continue
        out.setdefault(sentence, []).append(token)
        if token in tokens.sentence_end_ids:
            sentence += 1
    return [tuple(out[s]) for s in sorted(out)]


def neighbour_task(windows: Sequence[Window], tokens: TokenClasses) -> NeighbourTask:
    """The retrieval task of ``windows`` (the module docstring)."""
    opening = [tokens.first_id] if tokens.first_id is not None else []
    closing = [tokens.last_id] if tokens.last_id is not None else []
    sentences: list[tuple[int, ...]] = []
    window_of: list[int] = []
    query: list[int] = []
    for w, window in enumerate(windows):
        pieces = window_sentences(window, tokens)
        first = len(sentences)
        for piece in pieces:
            sentences.append((*opening, *piece, *closing))
            window_of.append(w)
        query += range(first, first + len(pieces) - 1)
    queries = np.array(query, dtype=np.int64)
    return NeighbourTask(
        sentences=sentences,
        window=np.array(window_of, dtype=np.int64),
        query=queries,
        target=queries + 1,
        candidates=queries + 1,  # every sentence that follows another in its window
    )


def ranks(embeddings: torch.Tensor, task: NeighbourTask) -> tuple[np.ndarray, np.ndarray]:
    """Each query's top-1 hit and reciprocal rank ``([query], [query])``, from the sentences'
    embeddings ``[sentence, d_model]`` (cosine similarity in float64; ties a draw among the tied:
    a target tied with t − 1 others below g better candidates scores ``1/t`` if g = 0 else 0, and
    ``(1/t) Σ_{r=g+1}^{g+t} 1/r``)."""
    if not len(task.query):
        return np.zeros(0), np.zeros(0)
    unit = torch.nn.functional.normalize(embeddings.double(), dim=-1)
    similarity = (unit[task.query] @ unit[task.candidates].T).cpu().numpy()  # [query, candidate]
    hits = np.zeros(len(task.query))
    reciprocal = np.zeros(len(task.query))
    for row, (q, target) in enumerate(zip(task.query, task.target, strict=True)):
        others = task.candidates != q  # a query is never its own candidate
        scores = similarity[row, others]
        true = similarity[row, int(np.flatnonzero(task.candidates == target)[0])]
        better = int(np.sum(scores > true))
        tied = int(np.sum(scores == true))  # the target itself among them
        hits[row] = (better == 0) / tied
        reciprocal[row] = float(np.sum(1.0 / np.arange(better + 1, better + tied + 1))) / tied
    return hits, reciprocal


def with_interval(values: np.ndarray, groups: np.ndarray, *, clip: bool = True) -> tuple[float, float, float]:
    """The mean of per-query ``values`` and its 95% interval: the jackknife over the queries'
    replicate groups (SPEC §5d), each group's queries left out in turn (the candidates stay: the
    pool is the task's), its bounds clipped to [0, 1], where a top-1 rate and an MRR lie, as every
    share's are (``clip=False``: the symmetric interval itself). NaN bounds with fewer than two
    groups."""
    from headatlas.service.reports.intervals import clip_interval, jackknife_halfwidth

    if not len(values):
        return math.nan, math.nan, math.nan
    full = float(values.mean())
    present = np.unique(groups)
    drops = [float(values[groups != g].mean()) for g in present] if len(present) > 1 else []
    half = jackknife_halfwidth(drops)
    if half is None:
        return full, math.nan, math.nan
    lo, hi = full - half, full + half
    return (full, *clip_interval("top1", lo, hi, bounds=(0.0, 1.0))) if clip else (full, lo, hi)  # type: ignore[return-value]


def embed(model: LoadedModel, task: NeighbourTask, pad_id: int, *, batch_size: int = 16) -> torch.Tensor:
    """Each sentence's embedding ``[sentence, d_model]`` (float64): the mean of the model's final
    hidden states over its valid tokens, each sentence a sequence of its own. Sentences are batched
    by length, 16 at a time (sentences vary in length: a batch of 84 padded to its longest cost 3×
    one of 16, while 16 cost about what the windows' own pass does), and the rows put back in the
    task's order; the attention mask keeps padding out of every valid token. Runs under whatever hooks the caller holds (removed heads)."""
    from headatlas.service.measures.effects import _run_model
    from headatlas.service.measures.objectives import pooled

    order = sorted(range(len(task.sentences)), key=lambda i: (len(task.sentences[i]), i))
    out: torch.Tensor | None = None
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            chosen = order[start : start + batch_size]
            longest = max(len(task.sentences[i]) for i in chosen)
            ids = torch.full((len(chosen), longest), pad_id, dtype=torch.long)
            mask = torch.zeros((len(chosen), longest), dtype=torch.long)
            for row, i in enumerate(chosen):
                ids[row, : len(task.sentences[i])] = torch.tensor(task.sentences[i])
                mask[row, : len(task.sentences[i])] = 1
            ids, mask = ids.to(model.device), mask.to(model.device)
            vectors = pooled(_run_model(model, ids, mask).double(), mask).cpu()  # [batch, d_model]
            if out is None:
                out = torch.zeros(len(task.sentences), vectors.shape[-1], dtype=torch.float64)
            out[torch.tensor(chosen)] = vectors
    return out if out is not None else torch.zeros(0, 0, dtype=torch.float64)
