"""The heads' top examples of a run (service/measures/examples.py, migration 0021), as rows: what
``headatlas query examples``, ``run.examples()`` and the head page read.

Each row is one example: its head, kind and rank, its score and value, the tokens it links
(``token_i``, ``token_j``: the anchor, the pair's i and j, attention's query and key) at their
positions in the window, the text around them (``context``: ``CONTEXT`` tokens either side, the
example's tokens in [brackets]), the window and its document.
"""

from __future__ import annotations

import json

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.errors import Param, ParameterError
from headatlas.service.reports.tokens import is_byte_level_text, window_tokens

KINDS = ("anchor", "pair", "attention")
CONTEXT = 8  # tokens of context either side of an example's tokens
COLUMNS = [
    "layer",
    "head",
    "kind",
    "rank",
    "score",
    "value",
    "token_i",
    "token_j",
    "context",
    "pos_i",
    "pos_j",
    "window_id",
    "source",
    "line",
    "window_index",
]
# what each kind's score and value are (docs, --help, the head page)
MEANING = {
    "anchor": ("high-similarity pairs the anchor token takes part in (endpoint count in H)", "anchor_share"),
    "pair": ("C_ij, the largest similarity of the window's pairs", "C_ij"),
    "attention": ("A_ij · k_i, the strongest attention between two tokens against uniform", "A_ij"),
}
NOTE = (
    "score: anchor = the anchor's endpoint count in H (value: anchor_share); pair = C_ij (the window's most "
    "similar pair); attention = A_ij · k_i, times the uniform weight (value: A_ij; i the query, j the key); "
    "positions 0-based within the window, [CLS]/BOS at 0"
)


def none_kept(run_id: int) -> ParameterError:
    """The refusal of a run that kept no examples, with how to get them."""
    return ParameterError(
        f"run {run_id} kept no top examples (analysed before they were kept, or with ",
        Param("examples", 0),
        ")",
        hint=(
            "analyse the corpus again into a new database (",
            Param("db"),
            "), keeping ",
            Param("examples", 5),
            " (the default) per head and kind",
        ),
    )


def has_examples(conn: Connection, run_id: int) -> bool:
    """Whether the run kept any example."""
    return (
        conn.execute(text("SELECT 1 FROM head_examples WHERE run_id = :r LIMIT 1"), {"r": run_id}).first() is not None
    )


def examples(
    conn: Connection,
    run_id: int,
    *,
    layer: int | None = None,
    head: int | None = None,
    kind: str | None = None,
    limit: int | None = None,
    context: int = CONTEXT,
) -> tuple[list[str], list[tuple]]:
    """The run's examples (``COLUMNS``), by layer, head, kind (``KINDS`` order) and rank:
    ``layer``/``head``/``kind`` keep to those, ``limit`` to the first N of each head and kind;
    ``context`` tokens either side in ``context``. Raises ParameterError where the run kept none."""
    if kind is not None and kind not in KINDS:
        raise ParameterError(Param("kind", kind, quoted=True), f": choose one of {', '.join(KINDS)}")
    if limit is not None and limit < 1:
        raise ParameterError(Param("limit", limit), ": must be at least 1")
    if context < 0:
        raise ParameterError(Param("context", context), ": must be 0 or more")
    if not has_examples(conn, run_id):
        raise none_kept(run_id)
    rows = []
    for found in fetch(conn, run_id, layer=layer, head=head, kind=kind, limit=limit):
        marked = [p for p in (found["pos_i"], found["pos_j"]) if p is not None]
        context_text = snippet(found["tokens"], marked, context)
        rows.append(tuple(context_text if c == "context" else found[c] for c in COLUMNS))
    return list(COLUMNS), rows


def fetch(
    conn: Connection,
    run_id: int,
    *,
    layer: int | None = None,
    head: int | None = None,
    kind: str | None = None,
    limit: int | None = None,
) -> list[dict]:
    """The run's examples as records (the ``examples`` view's columns and ``tokens``: the window's
    tokens as the tokenizer wrote them), by layer, head, kind and rank; none where it kept none."""
    found = conn.execute(
        text(
            """
            SELECT e.layer, e.head, e.kind, e.rank, e.score, e.value, e.token_i, e.token_j, e.pos_i, e.pos_j,
                   e.window_id, e.source, e.line, e.window_index, w.tokens
            FROM examples e
            LEFT JOIN (SELECT window_id, any_value(tokens) AS tokens FROM example_windows
                       WHERE run_id = :r GROUP BY window_id) w USING (window_id)
            WHERE e.run_id = :r
              AND (CAST(:layer AS INTEGER) IS NULL OR e.layer = :layer)
              AND (CAST(:head AS INTEGER) IS NULL OR e.head = :head)
              AND (CAST(:kind AS VARCHAR) IS NULL OR e.kind = :kind)
              AND (CAST(:limit AS INTEGER) IS NULL OR e.rank <= :limit)
            ORDER BY e.layer, e.head, list_position(['anchor', 'pair', 'attention'], e.kind), e.rank
            """
        ),
        {"r": run_id, "layer": layer, "head": head, "kind": kind, "limit": limit},
    )
    out = []
    for row in found:
        record = dict(zip(_FETCHED, row, strict=True))
        record["tokens"] = json.loads(record["tokens"]) if record["tokens"] else []
        out.append(record)
    return out


_FETCHED = (
    "layer",
    "head",
    "kind",
    "rank",
    "score",
    "value",
    "token_i",
    "token_j",
    "pos_i",
    "pos_j",
    "window_id",
    "source",
    "line",
    "window_index",
    "tokens",
)


def pieces(tokens: list[str]) -> list[tuple[str, str]]:
    """A window's tokens as running text: per token (the space before it, its text). WordPiece
    pieces (``##ing``) join the token before; byte-level and SentencePiece tokens carry their own
    leading space; special tokens stand apart."""
    if is_byte_level_text(tokens):
        out = []
        for t in window_tokens(tokens):
            stripped = t.lstrip(" ")
            out.append((t[: len(t) - len(stripped)], stripped or t))
        return out
    if any(t.startswith("▁") for t in tokens):
        return [(" " if t.startswith("▁") else "", t.lstrip("▁") or t) for t in tokens]
    out = []
    for k, t in enumerate(tokens):
        piece = t.startswith("##") and len(t) > 2
        # a piece joins the token before, unless that is a special token ([CLS] before a window cut mid-word)
        joins = piece and k > 0 and not _special(tokens[k - 1])
        out.append(("" if joins else " ", t[2:] if piece else t))
    return out


def _special(token: str) -> bool:
    """A special token's text: ``[CLS]``, ``<s>``, ``<|endoftext|>``."""
    return len(token) > 2 and ((token[0], token[-1]) in (("[", "]"), ("<", ">")))


def snippet(tokens: list[str], marked: list[int], context: int = CONTEXT) -> str:
    """The text around positions ``marked`` (``context`` tokens either side of each, ``…`` where
    text is left out), each marked token in [brackets]."""
    if not tokens:
        return ""
    shown = sorted({p for m in marked for p in range(max(0, m - context), min(len(tokens), m + context + 1))})
    parts = pieces(tokens)
    out, last = [], None
    for p in shown:
        space, word = parts[p]
        if last is not None and p != last + 1:
            out.append(" …")
        elif last is None and p > 0:
            out.append("…")
        out.append(f"{space}[{word}]" if p in marked else f"{space}{word}")
        last = p
    if last is not None and last < len(tokens) - 1:
        out.append(" …")
    return "".join(out).strip()
