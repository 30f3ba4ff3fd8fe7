"""HTML of the pages: escaping, numbers with their intervals, tables, colour scales, the layout.

Every value that comes from the database or the request (run names, tokens, SQL values, corpus
paths) goes through ``e`` before it reaches a page: a name is data, never markup.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from html import escape

from headatlas.service.web.context import Request


def e(value: object) -> str:
    """Text as HTML (quotes too: safe inside an attribute)."""
    kind = type(value)
    if kind is int or kind is float or kind is bool:  # digits, signs, dots, letters: nothing to escape
        return str(value)
    return escape("" if value is None else str(value), quote=True)


def num(value: object, *, digits: int = 3) -> str:
    """A number as a table shows it: ``digits`` significant digits, thousands grouped; – for none."""
    if isinstance(value, float):  # most cells: first
        if not math.isfinite(value):
            return "–"
        return f"{value:.{digits}g}" if abs(value) < 10**digits * 100 else f"{value:,.0f}"
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    return e(value)


def when(value: object) -> str:
    """A time to the second (the CLI's tables show it so)."""
    if value is None:
        return ""
    if hasattr(value, "isoformat"):
        return value.isoformat(sep=" ", timespec="seconds")
    return str(value)


def interval(lo: object, hi: object) -> str:
    return f"[{num(lo)}, {num(hi)}]"


def breakable(name: str) -> str:
    """A column name that may wrap after its underscores."""
    return "_<wbr>".join(e(part) for part in str(name).split("_"))


def table(
    columns: Sequence[str],
    rows: Sequence[tuple],
    *,
    shown: Sequence[str] | None = None,
    text_columns: Sequence[str] = (),
    links: dict[str, Callable[[dict], str]] | None = None,
    header: Callable[[str], str] | None = None,
    row_class: Callable[[dict], str] | None = None,
    table_id: str | None = None,
    classes: str = "",
    digits: int = 3,
) -> str:
    """An HTML table of query rows: ``shown`` columns (default all), a column ``x`` with ``x_lo``/
    ``x_hi`` shows its 95% interval under its value; ``links``: column → the address a cell links
    to (from the row as a dict; None: no link); ``header``: a column's header HTML (default its
    name). Numbers are shown to ``digits`` significant digits; each cell keeps its full value in
    ``data-sort``, which app.js sorts by (a header clicked: numbers as numbers, text as text) and
    the facets (``facets``) match."""
    index = {c: i for i, c in enumerate(columns)}
    picked = [c for c in (shown or columns) if c in index and not (c.endswith(("_lo", "_hi")) and c[:-3] in index)]
    text = set(text_columns) | {c for c in picked if _all_text(rows, index[c])}
    heads = "".join(
        f'<th{" class=text" if c in text else ""} data-col="{e(c)}" data-type="{_kind(rows, index[c], c in text)}" '
        f'tabindex="0" aria-sort="none">{header(c) if header else breakable(c)}</th>'
        for c in picked
    )
    # per column, once: where its value and interval are, whether it is text, what it links to
    cells_of = [
        (
            index[c],
            c in text,
            index.get(f"{c}_lo"),
            index.get(f"{c}_hi"),
            links.get(c) if links else None,
        )
        for c in picked
    ]
    named_rows = bool(links) or row_class is not None
    body = []
    for row in rows:
        named = dict(zip(columns, row)) if named_rows else {}
        cells = []
        for i, is_text, lo, hi, link in cells_of:
            value = row[i]
            shown_value = e(value) if is_text else num(value, digits=digits)
            if lo is not None and hi is not None and row[lo] is not None:
                shown_value += f'<span class="ci">{interval(row[lo], row[hi])}</span>'
            if link is not None and value is not None:
                href = link(named)
                if href is not None:
                    shown_value = f'<a href="{e(href)}">{shown_value}</a>'
            if is_text:  # sorted and matched by its text (app.js): no second copy of it
                cells.append(f"<td class=text>{shown_value}</td>")
            elif value is None:
                cells.append(f"<td>{shown_value}</td>")
            else:
                cells.append(f'<td data-sort="{e(value)}">{shown_value}</td>')
        cls = f' class="{e(row_class(named))}"' if row_class else ""
        body.append(f"<tr{cls}>{''.join(cells)}</tr>")
    ident = f' id="{e(table_id)}"' if table_id else ""
    return (
        f'<div class="table-wrap"><table{ident} class="data {e(classes)}" data-sortable><thead><tr>{heads}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


def _kind(rows: Sequence[tuple], i: int, text: bool) -> str:
    """How app.js compares a column's values: ``num`` (as numbers) or ``text`` (yes/no included)."""
    if text or any(isinstance(r[i], bool) for r in rows if r[i] is not None):
        return "text"
    return "num"


FACETS = ("layer", "role", "stable")  # the columns a table's rows can be narrowed by, where it has them


def facets(table_id: str, columns: Sequence[str], rows: Sequence[tuple], *, among: Sequence[str] = FACETS) -> str:
    """A select box per column of ``among`` that ``columns`` has (with 2 to ``FACET_MOST`` values):
    choosing a value shows only the rows of table ``table_id`` holding it (app.js, in the browser:
    the rows are on the page already), with each value's count of rows."""
    from collections import Counter

    index = {c: i for i, c in enumerate(columns)}
    boxes = []
    for c in among:
        if c not in index:
            continue
        counts = Counter(r[index[c]] for r in rows if r[index[c]] is not None)
        if not 2 <= len(counts) <= FACET_MOST:
            continue
        try:
            values = sorted(counts)
        except TypeError:  # values of several types (SQL may mix them): by their text
            values = sorted(counts, key=str)
        options = "".join(
            f'<option value="{e(v)}">{e(v) if isinstance(v, str) else num(v)} ({counts[v]:,})</option>' for v in values
        )
        boxes.append(
            f'<label>{e(c)} <select data-facet-for="#{e(table_id)}" data-col="{e(c)}">'
            f'<option value="">all</option>{options}</select></label>'
        )
    if not boxes:
        return ""
    return f'<div class="facets" id="{e(table_id)}-facets">show only {" ".join(boxes)}</div>'


FACET_MOST = 100  # a column with more values is no facet (a select box of hundreds)


def _all_text(rows: Sequence[tuple], i: int) -> bool:
    values = [r[i] for r in rows if r[i] is not None]
    return bool(values) and all(isinstance(v, str) for v in values)


def record(pairs: Sequence[tuple[str, object]]) -> str:
    """Facts as a two-column table (name, value)."""
    body = "".join(f"<tr><th>{e(k)}</th><td>{v if isinstance(v, Html) else e(v)}</td></tr>" for k, v in pairs)
    return f'<table class="facts"><tbody>{body}</tbody></table>'


class Html(str):
    """Text that is HTML already (``record`` does not escape it)."""


def select(name: str, options: Sequence[tuple[str, str]], chosen: str | None, *, label: str) -> str:
    """A <select> that submits its form on change (app.js), and a label."""
    opts = "".join(
        f'<option value="{e(v)}"{" selected" if v == chosen else ""}>{e(text)}</option>' for v, text in options
    )
    return f'<label>{e(label)} <select name="{e(name)}" data-autosubmit>{opts}</select></label>'


def hidden(request: Request, *keep: str) -> str:
    """The request's parameters ``keep`` (and ``at``) as hidden fields of a form."""
    return "".join(
        f'<input type="hidden" name="{e(n)}" value="{e(v)}">' for n in (*keep, "at") for v in request.args(n)
    )


# --- colour ---------------------------------------------------------------------------------------
# viridis, 9 stops: perceptually even, readable in grey and by the colour-blind
SEQUENTIAL = ("#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c", "#28ae80", "#5ec962", "#addc30", "#fde725")
# blue – white – red, for differences around 0
DIVERGING = ("#2166ac", "#4393c3", "#92c5de", "#d1e5f0", "#f7f7f7", "#fddbc7", "#f4a582", "#d6604d", "#b2182b")
MISSING = "#eeeeee"


@lru_cache(maxsize=1024)
def _rgb(colour: str) -> tuple[int, int, int]:
    """``#rrggbb`` as its three channels (a grid colours hundreds of cells from a few stops)."""
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


def _mix(stops: Sequence[str], t: float) -> str:
    t = min(1.0, max(0.0, t)) * (len(stops) - 1)
    i = min(int(t), len(stops) - 2)
    a, b = _rgb(stops[i]), _rgb(stops[i + 1])
    f = t - i
    rgb = [round(a[k] * (1 - f) + b[k] * f) for k in (0, 1, 2)]
    return "#" + "".join(f"{c:02x}" for c in rgb)


def colour(value: float | None, low: float, high: float, *, diverging: bool = False) -> str:
    """The colour of ``value`` on a scale from ``low`` to ``high`` (diverging: symmetric about 0)."""
    if value is None or not math.isfinite(value):
        return MISSING
    if diverging:
        top = max(abs(low), abs(high)) or 1.0
        return _mix(DIVERGING, 0.5 + value / (2 * top))
    return _mix(SEQUENTIAL, 0.5 if high <= low else (value - low) / (high - low))


def ink(background: str) -> str:
    """Black or white text, whichever reads on ``background``."""
    r, g, b = _rgb(background)
    return "#000" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#fff"


def legend_bar(low: float, high: float, label: str, *, diverging: bool = False) -> str:
    stops = DIVERGING if diverging else SEQUENTIAL
    if diverging:
        top = max(abs(low), abs(high)) or 1.0
        low, high = -top, top
    gradient = ", ".join(stops)
    return (
        f'<div class="legend-bar"><span>{num(low)}</span><span class="bar" style="background: linear-gradient(to right, '
        f'{gradient})"></span><span>{num(high)}</span> <span class="muted">{e(label)}</span></div>'
    )


# --- the page -------------------------------------------------------------------------------------
def layout(
    title: str,
    body: str,
    *,
    home: str,
    database: str,
    at: int | None = None,
    crumbs: Sequence[tuple[str, str]] = (),
) -> str:
    """A whole page: the navigation line (``home``: the runs' address; ``database`` and the snapshot
    ``at`` read; the way back), ``body``, a footer."""
    where = e(database)
    snapshot = f" · snapshot <strong>{e(at)}</strong>" if at is not None else ""
    trail = "".join(f' › <a href="{e(url)}">{e(label)}</a>' for label, url in crumbs)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)} · headatlas</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="stylesheet" href="/static/style.css"><script src="/static/app.js" defer></script></head>
<body><nav><a class="home" href="{e(home)}">headatlas</a>{trail}
<span class="db">{where}{snapshot} · read-only</span></nav>
<main><h1>{e(title)}</h1>
{body}
</main><footer>Layers and heads are counted from 0 (the papers count from 1: their “layer 11, head 8” is layer 10,
head 7 here). Every page has its data as JSON at the same address plus <code>.json</code>.</footer>
<div id="tip" role="tooltip" hidden></div></body></html>
"""


def message_page(title: str, message: str, *, back: str = "/runs") -> str:
    """A 404 or 400 page (no database needed to draw it)."""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)} · headatlas</title>
<link rel="stylesheet" href="/static/style.css"></head>
<body><nav><a class="home" href="/runs">headatlas</a></nav>
<main><h1>{e(title)}</h1><p class="error">{e(message)}</p><p><a href="{e(back)}">back to the runs</a></p></main>
</body></html>
"""
