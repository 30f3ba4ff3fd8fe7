"""Helpers shared by the figure, report and export tests: a small real run, file checks."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def corpus_of(demo_corpus: Path, folder: Path, docs: slice, name: str) -> Path:
    """Some documents of the shipped excerpt as a corpus file."""
    parts = demo_corpus.read_text(encoding="utf-8").split("\n\n")[docs]
    path = folder / f"{name}.txt"
    path.write_text("\n\n".join(p.strip() for p in parts) + "\n", encoding="utf-8")
    return path


def analyse(corpus: Path, db: Path, model, *, name: str | None = None, **options):
    """Analyse ``corpus`` into ``db`` in this process (the embedded engine) with the analysis
    ``options`` (declared defaults for the rest); returns the Run."""
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.storage.store import Store

    return analyze_corpus(
        str(corpus),
        store=Store(db),
        model=model,
        params=build_params(**options),
        corpus=survey_corpus(str(corpus)),
        name=name,
        batch_size=8,
    )


def check_png(path: Path, size: tuple[int, int] | None = None) -> np.ndarray:
    """A valid PNG of ``size`` (width, height) pixels with a real picture in it; returns RGB."""
    from PIL import Image

    data = Path(path).read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    with Image.open(path) as image:
        image.load()
        if size is not None:
            assert image.size == size, f"{path}: {image.size} px, expected {size}"
        rgb = np.asarray(image.convert("RGB"), dtype=np.float64)
    check_not_blank(rgb, str(path))
    return rgb


def check_not_blank(rgb: np.ndarray, what: str) -> None:
    """Not one flat colour, not a near-empty canvas: some variance and many distinct colours."""
    grey = rgb.mean(axis=2)
    assert grey.std() > 10, f"{what}: pixel standard deviation {grey.std():.2f}, looks blank"
    non_white = (grey < 245).mean()
    assert non_white > 0.02, f"{what}: only {non_white:.1%} of pixels are not white"
    packed = rgb.astype(np.uint32) @ np.array([1 << 16, 1 << 8, 1], dtype=np.uint32)
    colours = np.unique(packed)
    assert len(colours) > 50, f"{what}: only {len(colours)} distinct colours"


def check_svg(path: Path, size_in: tuple[float, float]) -> ET.Element:
    """A well-formed SVG document of ``size_in`` inches (72 pt each) with drawn paths."""
    text = Path(path).read_text(encoding="utf-8")
    assert text.lstrip().startswith("<?xml") and "<svg" in text[:2000], f"{path} is not an SVG"
    root = ET.fromstring(text)
    assert root.tag.endswith("svg")
    width, height = (float(root.get(k).removesuffix("pt")) for k in ("width", "height"))
    assert (width, height) == (size_in[0] * 72, size_in[1] * 72), f"{path}: {width}×{height} pt"
    paths = [e for e in root.iter() if e.tag.endswith("path") or e.tag.endswith("use")]
    assert len(paths) > 50, f"{path}: only {len(paths)} drawn elements"
    return root


# --- readability: what a reader of the figure sees -------------------------------------------------
def drawn_texts(fig) -> list:
    """Every text a reader sees: the figure's (suptitle, supxlabel), and per axes its titles, axis
    labels, the tick labels within its view, its own texts and its legend's."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    texts = list(fig.texts)
    for legend in fig.legends:
        texts += legend.get_texts()
    for ax in fig.axes:
        texts += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label]
        texts += shown_ticklabels(ax.xaxis) + shown_ticklabels(ax.yaxis) + ax.texts
        if ax.get_legend() is not None:
            texts += ax.get_legend().get_texts()
    return [t for t in texts if t.get_visible() and t.get_text().strip()]


def shown_ticklabels(axis) -> list:
    """The tick labels of the ticks within the axis's view (the locator may place more)."""
    lo, hi = sorted(axis.get_view_interval())
    span = (hi - lo) * 1e-9
    return [
        label
        for loc, label in zip(axis.get_majorticklocs(), axis.get_majorticklabels())
        if lo - span <= loc <= hi + span
    ]


def check_text_inside(fig, *, tolerance_px: float = 1.0) -> None:
    """Nothing cut at an edge: every drawn text lies inside the figure's canvas."""
    texts = drawn_texts(fig)
    renderer, box = fig.canvas.get_renderer(), fig.bbox
    for text in texts:
        ext = text.get_window_extent(renderer)
        inside = (
            ext.x0 >= box.x0 - tolerance_px
            and ext.x1 <= box.x1 + tolerance_px
            and ext.y0 >= box.y0 - tolerance_px
            and ext.y1 <= box.y1 + tolerance_px
        )
        assert inside, (
            f"{text.get_text()!r} drawn at x {ext.x0:.0f}–{ext.x1:.0f}, y {ext.y0:.0f}–{ext.y1:.0f}, "
            f"outside the {box.width:.0f} × {box.height:.0f} px figure"
        )


def check_axis_labels(ax) -> None:
    """Both axes say what they are."""
    assert ax.get_xlabel().strip() and ax.get_ylabel().strip(), (
        f"{ax.get_title()!r}: x {ax.get_xlabel()!r}, y {ax.get_ylabel()!r}"
    )


def check_right_axes_labelled(fig) -> None:
    """Every axis drawn on the right (a twin, a colour bar) has a label."""
    drawn_texts(fig)
    right = [ax for ax in fig.axes if ax.yaxis.get_label_position() == "right" and shown_ticklabels(ax.yaxis)]
    for ax in right:
        ticks = [t.get_text() for t in shown_ticklabels(ax.yaxis)]
        assert ax.get_ylabel().strip(), f"a right-hand axis without a label (ticks {ticks})"


def check_plain_ticks(axis, *, at_least: int = 3) -> list[float]:
    """Tick labels a reader reads as numbers at a glance: plain decimals (no 10^k, no ×10⁻¹)."""
    drawn_texts(axis.figure)
    labels = [t.get_text() for t in shown_ticklabels(axis) if t.get_text().strip()]
    assert len(labels) >= at_least, f"only {len(labels)} tick labels: {labels}"
    values = []
    for label in labels:
        plain = label.replace("−", "-")
        assert "$" not in plain and "^" not in plain and "×" not in plain, f"tick label {label!r} is not a plain number"
        values.append(float(plain))
    return values


def check_round_ticks(values, *, digits: int = 2) -> None:
    """Round tick values: each has at most ``digits`` significant digits (0.95, 1, 2.5, 3)."""
    for v in values:
        assert math.isclose(float(f"{v:.{digits}g}"), v, rel_tol=1e-9, abs_tol=1e-12), f"tick {v!r} is not round"


CHAR_EM = 0.6  # a digit or letter of a sans-serif font, in em (a little wide: the check errs safe)


def html_table_widths(page: str, *, root_px: float = 16.0, skip_folded: bool = True) -> list[float]:
    """The narrowest each <table> of ``page`` can be drawn, in CSS pixels: per column the longest
    piece that cannot wrap (a header wraps at spaces and <wbr>, a cell at <br>; an interval span is
    one piece), at the table's font (0.82rem) and the interval's (0.75rem), plus the cell padding
    (0.45rem a side) and border. Tables inside a <details> are skipped with ``skip_folded``."""
    from html.parser import HTMLParser

    cell_px, ci_px, pad_px = 0.82 * root_px * CHAR_EM, 0.75 * root_px * CHAR_EM, 2 * 0.45 * root_px + 1

    class Tables(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tables, self.folded, self.row, self.cell, self.ci = [], 0, None, None, False

        def handle_starttag(self, tag, attrs):
            if tag == "details":
                self.folded += 1
            elif tag == "table":
                self.tables.append(None if (self.folded and skip_folded) else [])
            elif tag == "tr":
                self.row = []
            elif tag in ("td", "th"):
                self.cell = [[""]]  # pieces: a list of [text, is_interval]
            elif tag in ("br", "wbr") and self.cell is not None:
                self.cell.append([""])
            elif tag == "span" and dict(attrs).get("class") == "ci":
                self.ci = True
                if self.cell is not None:
                    self.cell.append(["", True])

        def handle_endtag(self, tag):
            if tag == "details":
                self.folded -= 1
            elif tag in ("td", "th") and self.cell is not None and self.row is not None:
                widths = []
                for piece in self.cell:
                    text, interval = piece[0], len(piece) > 1
                    words = [text] if interval else text.split()
                    widths += [len(w) * (ci_px if interval else cell_px) for w in words]
                self.row.append(max(widths, default=0) + pad_px)
                self.cell = None
            elif tag == "tr" and self.row is not None and self.tables and self.tables[-1] is not None:
                self.tables[-1].append(self.row)
                self.row = None
            elif tag == "span":
                self.ci = False

        def handle_data(self, data):
            if self.cell is not None:
                self.cell[-1][0] += data

    parser = Tables()
    parser.feed(page)
    widths = []
    for rows in parser.tables:
        if rows:
            columns = max(len(r) for r in rows)
            widths.append(sum(max((r[c] for r in rows if c < len(r)), default=0) for c in range(columns)))
    return widths


def check_ticks_apart(axis, *, gap_px: float = 2.0) -> list[str]:
    """The tick labels of an x axis do not run together: each ends ``gap_px`` before the next
    begins (30 layers labelled one by one read ``0123456789101112…``). Returns the labels."""
    drawn_texts(axis.figure)
    renderer = axis.figure.canvas.get_renderer()
    labels = [t for t in shown_ticklabels(axis) if t.get_text().strip()]
    extents = [(t.get_window_extent(renderer), t.get_text()) for t in labels]
    boxes = sorted(((b.x0, b.x1, text) for b, text in extents), key=lambda x: x[0])
    for (_x0, x1, a), (y0, _y1, b) in zip(boxes, boxes[1:]):
        assert y0 - x1 >= gap_px, f"tick labels {a!r} and {b!r} touch ({y0 - x1:.1f} px apart)"
    return [text for _x0, _x1, text in boxes]


def decoder_layer_rows(n_layers: int, *, seed: int = 0):
    """Hand-built rows of ``query layers --ci`` for a decoder of ``n_layers`` layers: the columns a
    causal run's rows hold (query_support.for_attention), plausible values."""
    from headatlas.service.reports import layer_queries, query_support

    rng = np.random.default_rng(seed)
    columns = [c for c in layer_queries.LAYER_COLUMNS if c not in query_support.ENCODER_ONLY_COLUMNS]
    columns.append("anchor_distinct_share")
    rows = []
    for layer in range(n_layers):
        values = [layer] + [float(rng.uniform(0.5, 2.0)) for _ in columns[1:]]
        rows.append(tuple(values))
    return columns, rows
