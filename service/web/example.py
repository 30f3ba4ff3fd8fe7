"""An example window of a run's corpus, through the run's model: a head's context similarity
matrix and attention map (``service.reports.inspection``, what ``headatlas inspect`` draws).

The window is the run's ``window``-th (0-based, in document order: source, line, window within the
document). Its text is read again from the corpus file the run recorded, and cut into windows as
the run cut it (its parameters), so the window shown is the one the run analysed: its id, a hash of
the document, the window's index, the tokenizer and the window parameters, is compared with the
stored one (``same_window``). Where the file is gone or changed, the document's stored preview (its
first 80 characters) stands in, and ``note`` says so.

Computed on demand, one window at a time, with the run's model (loaded once, on ``device``; the
last ``MODELS_KEPT`` models are held, so that pages of many runs hold no more memory than that), and
kept: the last few windows' matrices, for every head, so that the heads of one window come at once.
One window (or a text of one's own, ``own_text``) is computed at a time and one more may wait for
its turn (``EXAMPLES_WAITING``); a request past them is answered 503 at once, so that windows and
texts asked for together hold no more than two of the server's workers.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from sqlalchemy import text

from headatlas.service.errors import ModelError, Param, ParameterError
from headatlas.service.reports.tokens import window_tokens
from headatlas.service.storage.store import Run
from headatlas.service.web.context import WEB, Busy, ModelUnavailable
from headatlas.service.web.reads import Memo, Reads

EXAMPLES_WAITING = 1  # windows that may wait while one is computed; past them, 503
MODELS_KEPT = 2  # run models held at once: a third loaded lets the least recently used one go

# the run's window number k, in document order (documents and windows are content-addressed: a
# lake may hold a row twice, hence one row per id)
WINDOW_SQL = """
    SELECT w.window_id, w.doc_id, w.window_index, d.source, d.line, d.preview
    FROM run_windows r
    JOIN (SELECT window_id, any_value(doc_id) AS doc_id, any_value(window_index) AS window_index
          FROM windows GROUP BY window_id) w USING (window_id)
    JOIN (SELECT doc_id, any_value(source) AS source, any_value(line) AS line, any_value(preview) AS preview
          FROM documents GROUP BY doc_id) d USING (doc_id)
    WHERE r.run_id = :run
    ORDER BY d.source, d.line, w.window_index, w.window_id
    LIMIT 1 OFFSET :k
"""


@dataclass(frozen=True)
class StoredWindow:
    window_id: str
    doc_id: str
    window_index: int
    source: str
    line: int
    preview: str


def stored_window(conn, run: Run, k: int) -> StoredWindow:
    row = conn.execute(text(WINDOW_SQL), {"run": run.run_id, "k": k}).first()
    if row is None:
        count = conn.execute(text("SELECT count(*) FROM run_windows WHERE run_id = :r"), {"r": run.run_id}).scalar()
        raise ParameterError(Param("window", k), f": run {run.run_id} has windows 0..{count - 1} (0-based)")
    return StoredWindow(*row)


def document_text(window: StoredWindow) -> str | None:
    """The document's text from its corpus file, or None where the file cannot give it."""
    from headatlas.service.engine.corpus import iter_documents
    from headatlas.service.errors import CorpusError

    if not Path(window.source).is_file():
        return None
    try:
        for doc in iter_documents(window.source):
            if doc.doc_id == window.doc_id:
                return doc.text
            if doc.line > window.line:
                return None
    except (CorpusError, OSError):
        return None
    return None


class Examples:
    """The run models and the windows computed so far (one computation at a time)."""

    def __init__(self, *, device: str = "cpu", windows: int = 8) -> None:
        self.device = device
        self._models: OrderedDict[str, object] = OrderedDict()  # the last MODELS_KEPT, oldest first
        self.load_s: dict[str, float] = {}  # seconds each model took to load
        self._windows = Memo(windows, max_bytes=None)  # a window of a large model is large: kept by count
        self._texts = Memo(4, max_bytes=None)  # texts of one's own: the last few
        self._lock = threading.Lock()
        self._asked = 0  # windows being computed or waiting to be
        self._asked_lock = threading.Lock()

    def model(self, run: Run):
        """The run's model: its spec (a control's: its parent's, with the control's seed), on
        ``device``, in the run's precision; loaded once."""
        from headatlas.service.engine.model import control_model, load_model
        from headatlas.service.params import AnalysisParams

        key = self._key(run)
        params = AnalysisParams.from_dict(run.params)
        if key in self._models:
            self._models.move_to_end(key)
            return self._models[key]
        started = time.perf_counter()
        spec = run.model
        try:
            if spec.startswith("control:"):
                parent = load_model(spec.removeprefix("control:"), device=self.device, dtype=params.dtype)
                loaded = control_model(parent, seed=int(run.params.get("control_seed", 0)))
            else:
                loaded = load_model(spec, device=self.device, dtype=params.dtype)
        except (ModelError, OSError, MemoryError) as failed:
            why = failed.render(WEB) if isinstance(failed, ModelError) else f"{type(failed).__name__}: {failed}"
            raise ModelUnavailable(
                f"run {run.run_id} ({run.name}) was analysed with the model {spec}, which cannot be loaded here "
                f"({why.strip()}); its texts and windows are read with that model alone: serve the database "
                "where the model is"
            ) from None
        self.load_s[key] = time.perf_counter() - started
        self._models[key] = loaded
        while len(self._models) > MODELS_KEPT:
            self._models.popitem(last=False)
        return loaded

    @staticmethod
    def _key(run: Run) -> str:
        return f"{run.model}|{run.params.get('dtype', 'float32')}"

    def window(self, run: Run, stored: StoredWindow) -> dict:
        """Every head's matrices on ``stored``, computed once (``seconds``: how long it took)."""
        return self._windows.get((run.run_key, stored.window_id), lambda: self._compute(run, stored))

    def text(self, run: Run, body: str, *, seq_len: int) -> dict:
        """Every head's matrices on ``body``'s first window of at most ``seq_len`` tokens (the
        run's parameters otherwise), computed once (``seconds``: how long it took)."""
        digest = hashlib.sha256(body.encode("utf-8", "surrogatepass")).hexdigest()
        return self._texts.get(
            (run.run_key, seq_len, digest), lambda: self._one_at_a_time(lambda: self._text_now(run, body, seq_len))
        )

    def _compute(self, run: Run, stored: StoredWindow) -> dict:
        return self._one_at_a_time(lambda: self._compute_now(run, stored))

    def _one_at_a_time(self, work: Callable[[], dict]) -> dict:
        with self._asked_lock:
            if self._asked > EXAMPLES_WAITING:
                raise Busy(
                    "busy: a window (an example, or a text of one's own) is being computed and another waits for "
                    "its turn; try again in a few seconds",
                    retry_after_s=3,
                )
            self._asked += 1
        try:
            with self._lock:
                return work()
        finally:
            with self._asked_lock:
                self._asked -= 1

    def _text_now(self, run: Run, body: str, seq_len: int) -> dict:
        from headatlas.service.params import AnalysisParams
        from headatlas.service.reports.inspection import inspect_text

        loaded = self._key(run) in self._models
        model = self.model(run)
        started = time.perf_counter()
        params = replace(AnalysisParams.from_dict(run.params), seq_len=seq_len)
        seen = inspect_text(model, body, params)
        return {
            "inspection": seen,
            "seconds": time.perf_counter() - started,
            "load_s": 0.0 if loaded else self.load_s[self._key(run)],
        }

    def _compute_now(self, run: Run, stored: StoredWindow) -> dict:
        from headatlas.service.params import AnalysisParams
        from headatlas.service.reports.inspection import inspect_text

        loaded = self._key(run) in self._models
        model = self.model(run)  # loaded once, timed apart from the window
        started = time.perf_counter()
        params = AnalysisParams.from_dict(run.params)
        body = document_text(stored)
        note = None
        index = stored.window_index
        if body is None:
            body, index = stored.preview, 0
            note = (
                f"the corpus file {stored.source} no longer holds this document: showing its first "
                f"{len(stored.preview)} characters, as stored"
            )
        seen = inspect_text(model, body, params, window=index)
        return {
            "inspection": seen,
            "note": note,
            "same_window": seen.window_id == stored.window_id,
            "seconds": time.perf_counter() - started,
            "load_s": 0.0 if loaded else self.load_s[self._key(run)],
        }


def _rounded(matrix: np.ndarray) -> list[list[float]]:
    """Four significant digits: what a heatmap and its tooltip need, a quarter of the text."""
    return [[float(f"{v:.4g}") for v in row] for row in matrix.tolist()]


def head_example(examples: Examples, reads: Reads, run: Run, k: int, layer: int, head: int) -> dict:
    """The JSON document of one head on the run's window ``k``."""
    stored = stored_window(reads.conn, run, k)
    # the model's seconds hold no connection: a file's holds this process's lock, which every other
    # request's connection waits for
    reads.close()
    started = time.perf_counter()
    computed = examples.window(run, stored)
    seen = computed["inspection"]
    high = seen.high[layer, head]
    pairs = [[int(i), int(j)] for i, j in zip(*np.nonzero(np.triu(high, 1)))]
    return {
        "window": k,
        "window_id": stored.window_id,
        "same_window": computed["same_window"],
        "source": stored.source,
        "line": stored.line,
        "document_window": stored.window_index,
        "model": seen.model_name,
        "layer": layer,
        "head": head,
        # as they read (Ġactors → " actors", Ċ → \n), the vocabulary's own strings beside them
        "tokens": window_tokens(seen.tokens),
        "vocabulary_tokens": seen.tokens,
        "sentence_starts": seen.sentence_starts(),
        "csm": _rounded(seen.csm[layer, head]),
        "attention": _rounded(seen.attention[layer, head]),
        "high_pairs": pairs,
        "truncated": seen.truncated,
        "note": computed["note"],
        "computed_s": round(computed["seconds"], 3),
        "model_load_s": round(computed["load_s"], 3),
        "served_s": round(time.perf_counter() - started, 3),
    }
