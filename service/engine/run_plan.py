"""What a run analyses: the corpus surveyed once, the run's key, and its windows in batches.

The building blocks the embedded run (operations/embedded_run.py) and the queue (workers/submit.py)
share: the same corpus gives the same key and the same batches in both.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass

from headatlas.service.config import Settings
from headatlas.service.engine.corpus import Document, corpus_fingerprint, iter_documents, legacy_corpus_fingerprint
from headatlas.service.engine.model import LoadedModel, ModelInfo
from headatlas.service.engine.preparation import WindowPool, preparation_processes
from headatlas.service.engine.windows import Batch, TokenClasses, Window, collate, iter_document_windows, word_rule
from headatlas.service.errors import CorpusError, Param
from headatlas.service.params import AnalysisParams


@dataclass
class CorpusSummary:
    fingerprint: str
    documents: int
    chars: int
    duplicates: int = 0  # documents whose exact text appeared earlier (analysed once)
    # a one-file corpus's fingerprint under the earlier, name-hashing rule (runs stored then)
    legacy_fingerprint: str | None = None

    @property
    def distinct(self) -> int:
        """Documents analysed: the replicate scheme falls back on this count (SPEC §5d)."""
        return self.documents - self.duplicates


def survey_corpus(
    spec: str, *, text_field: str = "text", encoding: str = "utf-8", label: str | None = None
) -> CorpusSummary:
    """Read and validate the whole corpus once, before anything is stored.

    A bad line anywhere fails here, so a run is never left half-written by bad input.
    ``label``: how errors name a one-file spec (``<stdin>`` for a spooled copy).
    """
    fingerprint = corpus_fingerprint(spec)
    documents = chars = 0
    seen: set[str] = set()
    for doc in iter_documents(spec, text_field=text_field, encoding=encoding, label=label):
        documents += 1
        chars += len(doc.text)
        seen.add(doc.doc_id)
    if documents == 0:
        raise CorpusError(f"{label or spec}: no document with text", hint=("check the file and ", Param("text_field")))
    return CorpusSummary(
        fingerprint=fingerprint,
        documents=documents,
        chars=chars,
        duplicates=documents - len(seen),
        legacy_fingerprint=legacy_corpus_fingerprint(spec),
    )


def run_key(corpus_fp: str, model: ModelInfo, params: AnalysisParams) -> str:
    """The identity of a run: corpus, model (spec, name, vocabulary, weights) and parameters.
    ``model`` is loaded (analyze) or not (submit): the key is the same. A byte-level vocabulary's
    word tokens are judged on their decoded text (SPEC §5b), a rule its earlier runs did not
    follow: its key names the rule, so that those runs are not resumed or reported as this one;
    every other vocabulary keeps the key it had."""
    parts = [corpus_fp, model.spec, model.name, model.tokenizer_key, model.weights_key, params.key()]
    rule = word_rule(model.tokenizer)
    if rule:
        parts.append(f"words={rule}")
    blob = "|".join(parts)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def stored_run_key(conn, corpus: CorpusSummary, model: ModelInfo, params: AnalysisParams) -> tuple[str, str]:
    """(run key, corpus fingerprint) of this run as the database ``conn`` holds it: the key of
    ``run_key``, unless a run of the same one-file corpus was stored under the earlier rule (the
    file's name in its fingerprint) and none under the current one; that run keeps its key and is
    resumed or reported as before. ``params`` resolved (``AnalysisParams.resolved``)."""
    from sqlalchemy import text

    def stored(k: str) -> bool:
        return conn.execute(text("SELECT count(*) FROM runs WHERE run_key = :k"), {"k": k}).scalar() > 0

    key = run_key(corpus.fingerprint, model, params)
    if corpus.legacy_fingerprint is None or corpus.legacy_fingerprint == corpus.fingerprint:
        return key, corpus.fingerprint
    legacy = run_key(corpus.legacy_fingerprint, model, params)
    if not stored(key) and stored(legacy):
        return legacy, corpus.legacy_fingerprint
    return key, corpus.fingerprint


def document_row(doc: Document) -> dict:
    return {
        "doc_id": doc.doc_id,
        "source": doc.source,
        "line": doc.line,
        "n_chars": len(doc.text),
        "preview": doc.text[:80],
    }


def iter_batches(
    spec: str,
    model: LoadedModel,
    params: AnalysisParams,
    tokens: TokenClasses,
    *,
    batch_size: int,
    skip: set[str] | frozenset[str] = frozenset(),
    text_field: str = "text",
    encoding: str = "utf-8",
    label: str | None = None,
    single_first: int = 0,
    alone: Collection[str] = frozenset(),
    workers: int | WindowPool = 1,
) -> Iterator[tuple[Batch, list[dict], int]]:
    """Batches of windows not in ``skip``, with the rows of their documents and the number of
    corpus characters consumed so far. ``single_first``: the first that many windows come one
    per batch, and so does each window whose id is in ``alone`` (slow windows, each stored as
    soon as it is done). ``workers``: the documents are
    tokenised and windowed by that many processes (1: this one), or by this pool; the batches are
    the same either way. ``params.max_windows``: the corpus's first that many windows only, counted
    with those in ``skip`` (a resumed run keeps the cap it started with)."""
    pending: list[Window] = []
    docs: dict[str, dict] = {}
    emitted = 0
    cap = params.max_windows
    position = 0
    read = _Read()
    owned = None
    if isinstance(workers, int) and workers > 1:
        workers = owned = WindowPool(workers, model.tokenizer, tokens, model.tokenizer_key, params)
    distinct = _distinct_documents(spec, read, text_field=text_field, encoding=encoding, label=label)
    prepared: Iterator[tuple[Document, int, Iterable[Window]]]
    if isinstance(workers, WindowPool):
        prepared = workers.windows(distinct)
    else:
        prepared = (
            (doc, n, iter_document_windows(doc, model.tokenizer, tokens, model.tokenizer_key, params))
            for doc, n in distinct
        )
    try:
        for doc, consumed, windows in prepared:
            if cap is not None and position >= cap:
                break
            for window in windows:
                if cap is not None and position >= cap:
                    break
                position += 1
                if window.window_id in skip:
                    continue
                single = window.window_id in alone
                if single and pending:  # the windows before it go on in a batch of their own
                    yield collate(pending, tokens.pad_id), _docs_of(pending, docs), consumed
                    emitted += len(pending)
                    pending = []
                pending.append(window)
                docs[doc.doc_id] = document_row(doc)
                if single or len(pending) == (1 if emitted < single_first else batch_size):
                    yield collate(pending, tokens.pad_id), _docs_of(pending, docs), consumed
                    emitted += len(pending)
                    pending = []
                    docs = {doc.doc_id: docs[doc.doc_id]}
        if pending:
            yield collate(pending, tokens.pad_id), _docs_of(pending, docs), read.chars
    finally:
        if owned is not None:
            owned.close()


class _Read:
    """Corpus characters read so far (duplicates included)."""

    chars = 0


def _distinct_documents(
    spec: str, read: _Read, *, text_field: str, encoding: str, label: str | None
) -> Iterator[tuple[Document, int]]:
    """The corpus's documents, a repeated one once (it is analysed once), each with the corpus
    characters read up to it (``read`` counts on to the end)."""
    seen: set[str] = set()
    for doc in iter_documents(spec, text_field=text_field, encoding=encoding, label=label):
        read.chars += len(doc.text)
        if doc.doc_id in seen:
            continue
        seen.add(doc.doc_id)
        yield doc, read.chars


def _docs_of(windows, docs: dict[str, dict]) -> list[dict]:
    return [docs[d] for d in dict.fromkeys(w.doc_id for w in windows)]


def first_windows(
    spec: str,
    model: LoadedModel,
    params: AnalysisParams,
    tokens: TokenClasses,
    count: int,
    *,
    skip: set[str] | frozenset[str] = frozenset(),
    text_field: str = "text",
    encoding: str = "utf-8",
    label: str | None = None,
) -> list:
    """The first ``count`` windows ``iter_batches`` will yield (tokenising only what they need)."""
    out: list = []
    for batch, _docs, _consumed in iter_batches(
        spec,
        model,
        params,
        tokens,
        batch_size=max(1, count),
        skip=skip,
        text_field=text_field,
        encoding=encoding,
        label=label,
    ):
        out += batch.windows[: count - len(out)]
        if len(out) >= count:
            break
    return out


def chosen_windows(
    spec: str,
    model: LoadedModel,
    params: AnalysisParams,
    tokens: TokenClasses,
    count: int,
    *,
    spread: bool,
    text_field: str = "text",
    encoding: str = "utf-8",
    label: str | None = None,
) -> list[tuple[int, Window]]:
    """The ``count`` windows of the run a measure takes, each with its position in the run (what
    ``iter_batches`` yields, from 0): its first by position, or (``spread``) spread over the
    replicate groups of the run's scheme (engine/effect_spread.py), in corpus order. The one rule
    of the embedded runner, the submitter, effects added to a run and prune."""
    if not spread:
        first = first_windows(spec, model, params, tokens, count, text_field=text_field, encoding=encoding, label=label)
        return list(enumerate(first))
    from headatlas.service.engine.effect_spread import spread as spread_over_groups
    from headatlas.service.engine.results import window_group

    def walk() -> Iterator[tuple[int, Window]]:
        batches = iter_batches(
            spec, model, params, tokens, batch_size=64, text_field=text_field, encoding=encoding, label=label
        )
        return enumerate(w for batch, _docs, _consumed in batches for w in batch.windows)

    def group(item: tuple[int, Window]) -> int:
        w = item[1]
        return window_group(params.replicates, window_id=w.window_id, doc_id=w.doc_id, index=w.index)

    return spread_over_groups(walk, group, count)


def spread_windows(
    measures: Iterable,
    spec: str,
    model: LoadedModel,
    params: AnalysisParams,
    tokens: TokenClasses,
    *,
    text_field: str = "text",
    encoding: str = "utf-8",
    label: str | None = None,
) -> dict[str, list[Window]]:
    """The windows each of ``measures`` (``measure_contract.Measure``) that spreads its ``quota``
    windows over the replicate groups takes (``chosen_windows``), by its name: found before a run
    by the embedded runner and the submitter alike."""
    return {
        m.name: [
            w
            for _position, w in chosen_windows(
                spec,
                model,
                params,
                tokens,
                m.quota(params) or 0,
                spread=True,
                text_field=text_field,
                encoding=encoding,
                label=label,
            )
        ]
        for m in measures
        if m.quota(params) is not None and m.spreads(params)
    }


def effect_targets(
    spec: str,
    model: LoadedModel,
    params: AnalysisParams,
    tokens: TokenClasses,
    count: int | None = None,
    *,
    text_field: str = "text",
    encoding: str = "utf-8",
    label: str | None = None,
) -> list[tuple[int, Window]]:
    """The run's effect windows (SPEC §9) with their positions: ``count`` (default
    ``params.effect_windows``) by the run's ``effect_spread``."""
    return chosen_windows(
        spec,
        model,
        params,
        tokens,
        params.effect_windows if count is None else count,
        spread=params.effect_spread == "groups",
        text_field=text_field,
        encoding=encoding,
        label=label,
    )


# below this many corpus characters (about 300 windows) a pool's start costs more than it saves
POOL_MIN_CHARS = 200_000


def window_pool(
    model: LoadedModel, tokens: TokenClasses, params: AnalysisParams, corpus: CorpusSummary
) -> WindowPool | None:
    """The processes that prepare the run's windows beside the model (HEADATLAS_PREPARE_PROCESSES),
    or None: the prefetch thread prepares them. Made before the run's threads start (they are
    forked from this one)."""
    import torch

    threads = 2 if model.device.type != "cpu" else torch.get_num_threads()
    requested = Settings.from_env().prepare_processes
    processes = preparation_processes(requested, model_threads=threads)
    if processes < 2 or (requested == 0 and corpus.chars < POOL_MIN_CHARS):
        return None
    return WindowPool(processes, model.tokenizer, tokens, model.tokenizer_key, params)


def short_name(spec: str) -> str:
    from pathlib import Path

    if spec in ("-", "<stdin>"):
        return "stdin"
    return Path(spec.rstrip("/*")).stem or "corpus"
