"""A head's top examples on its page: per kind (anchor, pair, attention) the windows where the head
is strongest, each with the text around it and its tokens highlighted (the anchor and its other
occurrences; the pair's i and j; attention's query and key), read from the database alone
(service/reports/examples.py). A run that kept none says so, and how to keep them."""

from __future__ import annotations

from headatlas.service.reports import examples
from headatlas.service.storage.store import Run
from headatlas.service.web.context import Ctx
from headatlas.service.web.html import e, num

CONTEXT = 12  # tokens either side of an example's tokens
TITLES = {
    "anchor": "Anchor: the token most similar to the others",
    "pair": "Most similar pair",
    "attention": "Strongest attention",
}
# what each highlighted token is, per kind: (the first token's, the second's)
ROLES = {"anchor": ("anchor", ""), "pair": ("i", "j"), "attention": ("query", "key")}


def head_examples(ctx: Ctx, run: Run, layer: int, head: int) -> list[dict]:
    """The head's examples as records (``reports.examples.fetch``), read once per run state."""
    r = run.run_id
    return ctx.run_query(run, ("examples", layer, head), lambda c: examples.fetch(c, r, layer=layer, head=head))


def records(found: list[dict]) -> list[dict]:
    """The page's JSON: each example without its window's tokens, with the text around it."""
    out = []
    for x in found:
        marked = [p for p in (x["pos_i"], x["pos_j"]) if p is not None]
        out.append({k: v for k, v in x.items() if k != "tokens"} | {"context": examples.snippet(x["tokens"], marked)})
    return out


def section(found: list[dict]) -> str:
    """The "Top examples" section of a head's page."""
    if not found:
        return (
            '<h2 id="top-examples">Top examples</h2><p class="muted" id="no-examples">None were kept for this run: it '
            "was analysed before top examples were kept, or with <code>--examples 0</code>. Analyse its corpus again "
            "into a new database (<code>headatlas analyze CORPUS --db NEW.duckdb</code>; <code>--examples 5</code>, "
            "the default, per head and kind) to see the windows where each head is strongest.</p>"
        )
    parts = ['<h2 id="top-examples">Top examples</h2>']
    for kind in examples.KINDS:
        mine = [x for x in found if x["kind"] == kind]
        if not mine:
            continue
        score, value = examples.MEANING[kind]
        items = "".join(_item(x) for x in mine)
        parts.append(
            f'<h3>{e(TITLES[kind])}</h3><ol class="top-examples" data-kind="{e(kind)}">{items}</ol>'
            f'<p class="muted">Ranked by {e(score)}; beside it {e(value)}.</p>'
        )
    parts.append(
        '<p class="muted">The windows of the run where this head is strongest, one example a window, the text '
        f"{CONTEXT} tokens either side; positions are 0-based within the window. Kept during the run "
        "(<code>--examples N</code> per head and kind); all of them: <code>headatlas query examples</code>.</p>"
    )
    return "".join(parts)


def _item(x: dict) -> str:
    tokens = x["tokens"]
    i, j = x["pos_i"], x["pos_j"]
    marked = [p for p in (i, j) if p is not None]
    shown = sorted({p for m in marked for p in range(max(0, m - CONTEXT), min(len(tokens), m + CONTEXT + 1))})
    # an anchor is a token id: its other occurrences within the text shown are marked too, more lightly
    also = {p for p in shown if x["kind"] == "anchor" and tokens[p] == x["token_i"] and p != i}
    pieces = examples.pieces(tokens)
    first, second = ROLES[x["kind"]]
    html, last = [], None
    for p in shown:
        space, word = pieces[p]
        if last is not None and p != last + 1:
            html.append(" …")
        elif last is None and p > 0:
            html.append("…")
        if p == i or p == j:
            role = first if p == i else second
            cls = "ex-i" if p == i else "ex-j"
            html.append(f'{e(space)}<mark class="{cls}" title="{e(role)}, position {p}">{e(word)}</mark>')
        elif p in also:
            html.append(f'{e(space)}<mark class="ex-also" title="the anchor again, position {p}">{e(word)}</mark>')
        else:
            html.append(e(space + word))
        last = p
    if last is not None and last < len(tokens) - 1:
        html.append(" …")
    where = f"{x['source']}:{x['line']}, window {x['window_index']}" if x["source"] is not None else x["window_id"]
    return (
        f'<li class="top-example" data-kind="{e(x["kind"])}" data-rank="{x["rank"]}" data-window="{e(x["window_id"])}">'
        f'<span class="ex-score">{num(x["score"])}</span> <span class="ex-value muted">({num(x["value"])})</span> '
        f'<span class="ex-text">{"".join(html).strip()}</span> <span class="muted ex-where">{e(where)}</span></li>'
    )
