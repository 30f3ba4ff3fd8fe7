"""A text of one's own through a run's model: a head's context similarity matrix (C = z zᵀ, C_ii = 0,
SPEC §2) and attention map with the tokens on both axes, and the attention as lines between two
columns of the tokens for the head or its whole layer (bertviz's head view). On a head's page
(``?text=``) and on the run's try-it page (``/runs/RUN/try?text=…&layer=L&head=H&lines=head|layer``,
its JSON at ``try.json``).

Computed on demand with the run's model and parameters (``Examples.text``: the model loaded once per
server, one computation at a time), by ``inspect_text``, what ``headatlas inspect`` computes, on the
text's one window. The text is bounded: ``TEXT_CHARS`` characters, refused before the model is
touched, and ``TEXT_TOKENS`` tokens with the run's tokenizer (specials included; fewer where the
run's windows are shorter), so that a page draws at most 64 × 64 cells a matrix. A run whose model
cannot be loaded in this server is refused in one line (503, ``ModelUnavailable``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from headatlas.service.errors import Param, ParameterError
from headatlas.service.reports.inspection import Inspection
from headatlas.service.reports.tokens import window_tokens
from headatlas.service.storage.store import Run
from headatlas.service.web.context import Ctx, run_path
from headatlas.service.web.html import e, hidden
from headatlas.service.web.token_figures import head_colour, head_view_svg, matrix_svg
from headatlas.service.web.views import View

TEXT_CHARS = 1000  # characters of a text, checked before anything is computed
TEXT_TOKENS = 64  # tokens of a text with the run's tokenizer, specials included
LINE_FLOOR = 0.02  # attention weights under this draw no line in the head view
LINES = ("head", "layer")


@dataclass(frozen=True)
class OwnText:
    """A text through a run's model, and what is shown of it: ``layer`` and ``head``'s matrices,
    and the lines of that head or (``lines == "layer"``) of every head of the layer."""

    text: str
    layer: int
    head: int
    lines: str
    seen: Inspection
    computed_s: float
    model_load_s: float

    def document(self) -> dict:
        """The JSON document: the tokens, the head's matrices at full precision (float32 values,
        as ``inspect`` computes them), its high-similarity pairs, and the layer's attention where
        its lines are shown."""
        seen, layer, head = self.seen, self.layer, self.head
        document = {
            "model": seen.model_name,
            "text": self.text,
            "layer": layer,
            "head": head,
            "lines": self.lines,
            # as they read (Ġactors → " actors"), the vocabulary's own strings beside them
            "tokens": window_tokens(seen.tokens),
            "vocabulary_tokens": seen.tokens,
            "sentence_starts": seen.sentence_starts(),
            "csm": seen.csm[layer, head].tolist(),
            "attention": seen.attention[layer, head].tolist(),
            "high_pairs": _high_pairs(seen, layer, head),
            "computed_s": round(self.computed_s, 3),
            "model_load_s": round(self.model_load_s, 3),
        }
        if self.lines == "layer":
            document["layer_attention"] = seen.attention[layer].tolist()
        return document


def _high_pairs(seen: Inspection, layer: int, head: int) -> list[list[int]]:
    return [[int(i), int(j)] for i, j in zip(*np.nonzero(np.triu(seen.high[layer, head], 1)))]


def asked_text(ctx: Ctx) -> str | None:
    """The request's ``?text=`` (None where absent or blank), refused over ``TEXT_CHARS`` characters."""
    values = [v for v in ctx.request.query.get("text", []) if v.strip()]
    if not values:
        return None
    text = values[0]
    if len(text) > TEXT_CHARS:
        raise ParameterError(
            f"?text=: the text is {len(text):,} characters; the limit is {TEXT_CHARS:,} characters (and "
            f"{TEXT_TOKENS} tokens): paste a shorter text"
        )
    return text


def token_limit(run: Run) -> int:
    return min(TEXT_TOKENS, run.seq_len)


def read_own_text(ctx: Ctx, run: Run, text: str, layer: int, head: int, lines: str) -> OwnText:
    """``text`` through ``run``'s model (``Examples.text``), refused where it has more tokens than
    ``token_limit``; the database's connection is closed first (the model's seconds hold none)."""
    ctx.reads.close()
    limit = token_limit(run)
    computed = ctx.examples.text(run, text, seq_len=limit)
    seen = computed["inspection"]
    if seen.truncated:
        why = "the limit" if limit == TEXT_TOKENS else f"what run {run.run_id}'s windows hold"
        raise ParameterError(
            f"?text=: the text has more than {limit} tokens with {run.model_name}'s tokenizer (its special tokens "
            f"included); {limit} tokens is {why}: paste a shorter text"
        )
    return OwnText(text, layer, head, lines, seen, computed["seconds"], computed["load_s"])


def _lines(ctx: Ctx) -> str:
    lines = ctx.arg("lines") or "head"
    if lines not in LINES:
        raise ParameterError(Param("lines", lines), ": pass head (the head's lines) or layer (every head of its layer)")
    return lines


# --- the try-it page --------------------------------------------------------------------------------
def try_view(ctx: Ctx, ref: str) -> View:
    """``/runs/RUN/try``: a form, and for a text the chosen head's figures."""
    from headatlas.service.operations.runs import check_layer_head

    run = ctx.run(ref)
    layer = ctx.number("layer", minimum=0) or 0
    head = ctx.number("head", minimum=0) or 0
    check_layer_head(run, layer, head)
    lines = _lines(ctx)
    text = asked_text(ctx)
    row = ctx.run_row(run)  # read before the connection closes for the model
    seen = read_own_text(ctx, run, text, layer, head, lines) if text is not None else None

    def data() -> dict:
        found = seen.document() if seen is not None else {"text": None, "layer": layer, "head": head, "lines": lines}
        return {"run": row, **found}

    def body() -> str:
        head_link = ctx.url(run_path(run, "heads", layer, head))
        return (
            f'<p class="muted">Paste a text: it is read with the run\'s model, <code>{e(run.model_name)}</code>, and '
            f'its parameters; the matrices are those of layer {layer}, head {head} (<a href="{e(head_link)}">its '
            "page</a>).</p>" + _form(ctx, run, text, lines, layer=layer, head=head) + _figures(seen)
        )

    crumbs = [(f"run {run.run_id}", ctx.url(run_path(run))), ("your own text", ctx.request.path)]
    return View(f"Run {run.run_id} ({run.name}): your own text", data, body, crumbs=crumbs)


# --- a head's page --------------------------------------------------------------------------------
def head_section(ctx: Ctx, run: Run, layer: int, head: int) -> str:
    """The head page's "Your own text": the form, and the figures of a text sent with it."""
    lines = _lines(ctx)
    text = asked_text(ctx)
    seen = read_own_text(ctx, run, text, layer, head, lines) if text is not None else None
    every = ctx.url(run_path(run, "try"), layer=layer, head=head)
    return (
        '<h2 id="your-text">Your own text</h2><p class="muted">Paste a text to see this head read it, with the run\'s '
        f"model (<code>{e(run.model_name)}</code>): its similarity matrix and attention, tokens on both axes, and its "
        f'attention as lines, or its whole layer\'s. <a href="{e(every)}">Any head of the run: try it</a>.</p>'
        + _form(ctx, run, text, lines)
        + _figures(seen)
    )


def _form(
    ctx: Ctx, run: Run, text: str | None, lines: str, *, layer: int | None = None, head: int | None = None
) -> str:
    """The text box and its choices; on the try-it page the layer and head too (a head's page is one head)."""
    choose = ""
    if layer is not None and head is not None:
        layers = "".join(
            f'<option value="{k}"{" selected" if k == layer else ""}>{k}</option>' for k in range(run.n_layers)
        )
        heads = "".join(
            f'<option value="{k}"{" selected" if k == head else ""}>{k}</option>' for k in range(run.n_heads)
        )
        choose = (
            f'<label>layer <select name="layer">{layers}</select></label>'
            f'<label>head <select name="head">{heads}</select></label>'
        )
    picks = "".join(
        f'<label><input type="radio" name="lines" value="{v}"{" checked" if v == lines else ""}> {words}</label>'
        for v, words in (("head", "lines of this head"), ("layer", "lines of every head of its layer"))
    )
    keep = hidden(ctx.request, "window") if layer is None else hidden(ctx.request)
    action = ctx.request.path + ("#your-text" if layer is None else "")
    return (
        f'<form class="own-text" method="get" action="{e(action)}">{keep}'
        f'<textarea name="text" rows="3" maxlength="{TEXT_CHARS}" required placeholder="a sentence or two: at most '
        f'{TEXT_CHARS:,} characters and {token_limit(run)} tokens">{e(text or "")}</textarea>'
        f'<div class="choices">{choose}{picks}<button type="submit">read it</button></div></form>'
    )


def _figures(seen: OwnText | None) -> str:
    if seen is None:
        return ""
    inspection, layer, head = seen.seen, seen.layer, seen.head
    tokens = window_tokens(inspection.tokens)
    starts = inspection.sentence_starts()
    csm = matrix_svg(
        tokens,
        inspection.csm[layer, head],
        label=f"context similarity of layer {layer}, head {head}",
        diverging=True,
        high=[(i, j) for i, j in _high_pairs(inspection, layer, head)],
        sentence_starts=starts,
    )
    attention = matrix_svg(
        tokens,
        inspection.attention[layer, head],
        label=f"attention of layer {layer}, head {head}",
        diverging=False,
        sentence_starts=starts,
    )
    if seen.lines == "layer":
        shown = [(h, inspection.attention[layer, h]) for h in range(inspection.n_heads)]
        legend = "".join(
            f'<span><i style="background:{head_colour(h)}"></i>head {h}</span>' for h in range(inspection.n_heads)
        )
        who = f"every head of layer {layer}, one colour each"
    else:
        shown = [(head, inspection.attention[layer, head])]
        legend = ""
        who = f"layer {layer}, head {head}"
    lines = head_view_svg(tokens, shown, label=f"attention of {who} as lines", floor=LINE_FLOOR)
    said = (
        f"{len(tokens)} tokens, read by {e(inspection.model_name)} in {seen.computed_s:.2f} s"
        + (f" after loading the model ({seen.model_load_s:.1f} s, once)" if seen.model_load_s > 0 else "")
        + f"; {len(_high_pairs(inspection, layer, head))} high-similarity pairs."
    )
    return (
        f'<div id="own-text" class="own-text-figures"><p class="muted">{said}</p><div class="pair">'
        f"<figure>{csm}<figcaption>Context similarity C = z zᵀ of layer {layer}, head {head} (C<sub>ii</sub> = 0; "
        "blue below 0, red above), its high-similarity pairs H outlined, sentence boundaries dashed; rows and "
        "columns are the tokens. Hover a cell for its tokens and value.</figcaption></figure>"
        f"<figure>{attention}<figcaption>Attention A of layer {layer}, head {head}: rows are queries, columns "
        "keys (colour: √A).</figcaption></figure></div>"
        f'<h3 id="lines">Attention as lines</h3>{f"<div class=legend>{legend}</div>" if legend else ""}'
        f"<figure>{lines}<figcaption>Attention of {e(who)}: each token on the left (a query) to the tokens on the "
        f"right (keys) it attends to, a line's strength its weight; weights under {LINE_FLOOR:g} draw no line. "
        "Hover a token on the left for its lines alone.</figcaption></figure></div>"
    )
