"""`headatlas report`: one self-contained HTML page, opened in headless Chromium."""

from __future__ import annotations

import base64
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from tests.figure_checks import analyse, check_not_blank, check_png, corpus_of

pytestmark = pytest.mark.slow

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
)


@pytest.fixture(scope="module")
def stored(tmp_path_factory, real_model, demo_corpus):
    folder = tmp_path_factory.mktemp("report")
    db = folder / "results.duckdb"
    corpus = corpus_of(demo_corpus, folder, slice(0, 2), "small")
    run = analyse(corpus, db, real_model, name="small")
    # its random-weights control: the report measures the run against it
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.model import control_model
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.storage.store import Store

    analyze_corpus(
        str(corpus),
        store=Store(db),
        model=control_model(real_model),
        params=build_params(),
        corpus=survey_corpus(str(corpus)),
        batch_size=8,
        control_of=run,
    )
    return db, run


@pytest.fixture(scope="module")
def page(stored, tmp_path_factory):
    """The report written by the command, as the user gets it."""
    from tests.conftest import invoke_cli

    db, run = stored
    out = tmp_path_factory.mktemp("page") / "nested" / "report.html"
    done = invoke_cli("report", run.name, "--out", str(out), "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout
    return out


class Elements(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def test_report_is_self_contained_with_every_section(page, stored, tmp_path):
    from headatlas.service.reports import report

    db, run = stored
    parsed = Elements()
    parsed.feed(page.read_text(encoding="utf-8"))
    text = " ".join(parsed.text)
    images = [attrs for tag, attrs in parsed.tags if tag == "img"]
    # the atlas, the comparison with the control, then the run's figures
    assert len(images) == 2 + 3 + len(report.HEAD_METRICS)
    assert [a["alt"] for a in images[:2]] == ["head atlas", "compare with control"]
    for k, attrs in enumerate(images):
        prefix = "data:image/png;base64,"
        assert attrs["src"].startswith(prefix)
        png = tmp_path / f"{k}.png"
        png.write_bytes(base64.b64decode(attrs["src"][len(prefix) :]))
        check_png(png)
    # nothing fetched from elsewhere: no scripts, stylesheets, frames or remote links
    assert not [t for t, a in parsed.tags if t in ("script", "link", "iframe", "object", "embed")]
    assert not [
        a
        for t, a in parsed.tags
        if any(str(v).startswith(("http:", "https:", "file:", "//")) for k, v in a.items() if k in ("src", "href"))
    ]
    for needed in (
        "Parameters",
        "Figures",
        "Heads",
        "Top anchor tokens per head",
        run.model_name,
        "top:0.02",
        run.corpus_fingerprint,
        "Head atlas",
        "Heads per role",
        "Roles and their evidence",
        "Against the random-weights control (the floor)",
        "small-control",
    ):
        assert needed in text, needed
    # the page opens with the atlas; the floor comes before the run's own figures
    assert text.index("Head atlas") < text.index("Parameters") < text.index("Against the random-weights control")
    assert text.index("Against the random-weights control") < text.index("Top anchor tokens per head")
    tables = [t for t, _ in parsed.tags if t == "table"]
    rows = [t for t, _ in parsed.tags if t == "tr"]
    assert (
        len(tables) == 4 + 3 + 1
    )  # + heads per role, role evidence, comparison with the control; every head column, folded
    # head table: header + one row per head; anchor grid: header + one row per layer
    assert len(rows) >= (1 + run.n_layers * run.n_heads) + (1 + run.n_layers)


def test_anchor_lists_split_even_when_the_token_is_a_comma():
    from headatlas.service.reports.report import split_anchors

    assert split_anchors("the 30%, , 12%, . 5%") == ["the 30%", ", 12%", ". 5%"]
    assert split_anchors("and 100%") == ["and 100%"]
    assert split_anchors(None) == ["–"]


def test_report_opens_in_headless_chromium(page, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian `chromium` is not installed here (`apt-get install -y chromium`; .ci/run installs it)")
    shot = tmp_path / "shot.png"
    # tall enough to reach the figures below the atlas and its tables (which take their whole length:
    # no table scrolls in a box of its own)
    width, height = 1280, 12000
    done = subprocess.run(
        [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--window-size={width},{height}",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.exists(), done.stderr[-2000:]
    rgb = check_png(shot, (width, height))
    check_not_blank(rgb, "report screenshot")
    # the figures rendered: text and tables are grey (no saturated pixel at all), the plots'
    # lines, bars and heatmaps are coloured (tens of thousands of pixels)
    saturation = rgb.max(axis=2) - rgb.min(axis=2)
    assert (saturation > 60).sum() > 0.003 * 1280 * 4800, "no coloured figure visible in the screenshot"


def test_report_tables_never_split_a_word(page):
    """In a page as narrow as a laptop's half screen, every word of the tables' text cells (roles,
    metrics, rules) stays on one line: the text wraps between words (prose also after a hyphen,
    never a role's or a metric's name), and the table scrolls."""
    from web_support import chromium, chromium_missing

    if (missing := chromium_missing()) is not None:
        pytest.skip(missing)
    with chromium(width=700, height=900) as browser:
        browser.get(page.as_uri())
        split = browser.execute_script(
            """
            const out = [];
            for (const td of document.querySelectorAll('td.text')) {
              const walker = document.createTreeWalker(td, NodeFilter.SHOW_TEXT);
              for (let node = walker.nextNode(); node; node = walker.nextNode()) {
                for (const m of node.data.matchAll(/\\S+/g)) {
                  const range = document.createRange();
                  range.setStart(node, m.index);
                  range.setEnd(node, m.index + m[0].length);
                  const tops = new Set([...range.getClientRects()].map(r => Math.round(r.top)));
                  // prose may wrap after a hyphen (one-sided), a name (td.name) never
                  const atHyphen = /^[^-]+(-[^-]+)+$/.test(m[0]) && !td.classList.contains('name');
                  if (tops.size > 1 && !atHyphen) out.push(m[0]);
                }
              }
            }
            return out;
            """
        )
    assert split == [], f"words split across lines: {split[:10]}"
