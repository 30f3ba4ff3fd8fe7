"""`headatlas serve` in a real browser: Debian's headless Chromium, driven by selenium, on the real HTTP
server (a loopback port). One server and one browser for the module; the tests skip, saying why, where
chromium, chromium-driver or selenium is missing (.ci/run installs the first two)."""

from __future__ import annotations

import json
import time

import pytest
from web_support import chromium, chromium_missing, serving

from tests.conftest import invoke_cli
from tests.figure_checks import analyse, corpus_of

pytestmark = [pytest.mark.slow, pytest.mark.skipif(chromium_missing() is not None, reason=str(chromium_missing()))]


@pytest.fixture(scope="module")
def site(tmp_path_factory, tiny_model, demo_corpus):
    """The app on a database holding a tiny run and its control, behind the real server, and a browser."""
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.model import control_model
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.storage.store import Store
    from headatlas.service.web.app import WebApp

    folder = tmp_path_factory.mktemp("browser")
    db = folder / "web.duckdb"
    corpus = corpus_of(demo_corpus, folder, slice(0, 1), "one")
    run = analyse(corpus, db, tiny_model, name="tiny", seq_len=64)
    analyze_corpus(
        str(corpus),
        store=Store(db),
        model=control_model(tiny_model),
        params=build_params(seq_len=64),
        corpus=survey_corpus(str(corpus)),
        batch_size=8,
        control_of=run,
    )
    # twelve heads a layer, as the report's anchor grid has for MiniLM and BERT: the report's test
    from headatlas.service.engine.model import load_model

    analyse(corpus, db, load_model("random:2,12,48", device="cpu"), name="wide", seq_len=64)
    downloads = folder / "downloads"
    downloads.mkdir()
    with serving(WebApp(str(db))) as url, chromium(downloads) as browser:
        browser.implicitly_wait(0)
        yield url, browser, db, downloads


def wait_for(browser, css: str, timeout: float = 120):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout).until(lambda b: b.find_elements(By.CSS_SELECTOR, css))[0]


def cli_json(db, *args):
    done = invoke_cli(*args, "--format", "json", "--db", str(db))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_click_a_head_in_the_atlas_and_see_its_metrics(site):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    url, browser, db, _ = site
    browser.get(url + "/runs")
    browser.find_element(By.LINK_TEXT, "tiny").click()
    wait_for(browser, "#atlas-grid")
    # hovering a point of the layer progression shows its value and interval
    ActionChains(browser).move_to_element(browser.find_element(By.CSS_SELECTOR, "svg.chart circle.pt")).perform()
    tip = wait_for(browser, "#tip:not([hidden])", 10)
    assert tip.text.startswith("layer 0: within_sentence_lift_dm ")
    browser.find_element(By.CSS_SELECTOR, '#atlas-grid a.cell[data-layer="1"][data-head="2"]').click()
    wait_for(browser, "#metrics-table")
    assert browser.current_url.endswith("/runs/1/heads/1/2")
    row = browser.find_element(By.CSS_SELECTOR, '#metrics-table tr[data-metric="mean_distance"]')
    want = next(r for r in cli_json(db, "query", "heads", "--run", "tiny", "--layer", "1", "--ci") if r["head"] == 2)
    value, interval = row.find_elements(By.TAG_NAME, "td")[1].text.split("\n")
    assert float(value) == pytest.approx(want["mean_distance"], rel=5e-3)
    assert interval == f"[{want['mean_distance_lo']:.3g}, {want['mean_distance_hi']:.3g}]"
    # the example window: computed with the run's model while the page says so, then drawn
    done = wait_for(browser, '#example[data-state="done"]')
    assert len(done.find_elements(By.TAG_NAME, "canvas")) == 2
    assert "same window id" in done.text


def test_sort_the_heads_table(site):
    """A header clicked sorts the rows in the page by the cells' full values (largest first, again the
    other way), without a new request."""
    from selenium.webdriver.common.by import By

    url, browser, _, _ = site
    browser.get(url + "/runs/tiny")
    wait_for(browser, "#heads-table")
    address = browser.current_url

    def column(name: str) -> list[float]:
        index = [
            th.get_attribute("data-col") for th in browser.find_elements(By.CSS_SELECTOR, "#heads-table th")
        ].index(name)
        cells = browser.find_elements(By.CSS_SELECTOR, f"#heads-table tbody tr td:nth-child({index + 1})")
        return [float(td.get_attribute("data-sort")) for td in cells]

    header = browser.find_element(By.CSS_SELECTOR, '#heads-table th[data-col="mean_distance"]')
    header.find_element(By.TAG_NAME, "a").click()
    values = column("mean_distance")
    assert values == sorted(values, reverse=True) and len(values) == 8
    assert header.get_attribute("aria-sort") == "descending" and browser.current_url == address
    header.click()  # again: the other way
    assert column("mean_distance") == sorted(values) and header.get_attribute("aria-sort") == "ascending"


def test_run_a_query_and_download_its_csv(site):
    from selenium.webdriver.common.by import By

    url, browser, db, downloads = site
    query = "SELECT layer, head, high_pairs, windows FROM head_metrics ORDER BY high_pairs DESC, layer, head"
    browser.get(url + "/runs/tiny/sql")
    box = wait_for(browser, "#sql-form textarea")
    box.clear()
    box.send_keys(query)
    browser.find_element(By.ID, "run-sql").click()
    table = wait_for(browser, "#sql-result")
    assert len(table.find_elements(By.CSS_SELECTOR, "tbody tr")) == 8
    # a facet keeps layer 1's rows; a header sorts what is left, smallest head first on a second click
    from selenium.webdriver.support.ui import Select

    Select(
        browser.find_element(By.CSS_SELECTOR, 'select[data-facet-for="#sql-result"][data-col="layer"]')
    ).select_by_value("1")
    shown = [r for r in table.find_elements(By.CSS_SELECTOR, "tbody tr") if r.is_displayed()]
    assert len(shown) == 4 and {r.find_element(By.TAG_NAME, "td").text for r in shown} == {"1"}
    head = table.find_element(By.CSS_SELECTOR, 'th[data-col="head"]')
    head.click()
    head.click()
    shown = [r for r in table.find_elements(By.CSS_SELECTOR, "tbody tr") if r.is_displayed()]
    assert [r.find_elements(By.TAG_NAME, "td")[1].text for r in shown] == ["0", "1", "2", "3"]
    browser.find_element(By.ID, "download-csv").click()
    deadline = time.monotonic() + 60
    while not list(downloads.glob("*.csv")) and time.monotonic() < deadline:
        time.sleep(0.2)
    files = list(downloads.glob("*.csv"))
    assert [f.name for f in files] == ["run-1-sql.csv"]  # the page links the run by id
    done = invoke_cli("sql", "--run", "tiny", query, "--format", "csv", "--db", str(db))
    assert files[0].read_text(encoding="utf-8") == done.stdout


def test_compare_two_runs(site):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    url, browser, db, _ = site
    browser.get(url + "/runs")
    form = wait_for(browser, "#compare-form")
    Select(form.find_element(By.NAME, "a")).select_by_visible_text("1 · tiny")
    Select(form.find_element(By.NAME, "b")).select_by_visible_text("2 · tiny-control")
    Select(form.find_element(By.NAME, "by")).select_by_value("layer")
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    table = wait_for(browser, "#compare-table")
    assert browser.current_url.endswith("/compare/1/2?by=layer")
    want = cli_json(db, "compare", "tiny", "tiny-control")
    verdicts = [tr.find_elements(By.TAG_NAME, "td")[-1].text for tr in table.find_elements(By.CSS_SELECTOR, "tbody tr")]
    assert verdicts == [r["verdict"] for r in want]
    beyond = browser.find_element(By.CSS_SELECTOR, "#verdicts + p strong").text
    assert int(beyond) == sum(r["verdict"] == "beyond" for r in want)


def test_the_reports_tables_stay_on_the_page_at_1400_px(site, tmp_path):
    """`headatlas report`: no table scrolls inside a box of its own, none runs off a 1,400 px page
    (the folded table of every column may scroll sideways: it is wider than any page)."""
    url, browser, db, _ = site
    out = tmp_path / "report.html"
    done = invoke_cli("report", "wide", "--out", str(out), "--db", str(db))
    assert done.returncode == 0, done.stderr
    browser.set_window_size(1400, 1000)
    try:
        browser.get(out.as_uri())
        wait_for(browser, "table.anchors")
        page_width = browser.execute_script("return document.documentElement.clientWidth")
        wide = browser.execute_script(
            "return [...document.querySelectorAll('table')].filter(t => !t.closest('details'))"
            ".map(t => t.getBoundingClientRect().right).filter(r => r > document.documentElement.clientWidth).length"
        )
        boxed = browser.execute_script(
            "return [...document.querySelectorAll('.scroll')].filter(d => d.scrollHeight > d.clientHeight + 1).length"
        )
        assert browser.execute_script("return document.documentElement.scrollWidth") <= page_width
        assert wide == 0 and boxed == 0
    finally:
        browser.set_window_size(1400, 1000)


def test_a_pasted_text_renders_with_its_tokens_on_both_axes_and_its_lines(site):
    """A head's page: a text pasted and sent draws the head's two matrices, each token labelling a row
    and a column, and its attention as lines; hovering a token leaves its lines alone in view."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    url, browser, _, _ = site
    browser.get(url + "/runs/tiny/heads/1/2")
    box = wait_for(browser, "form.own-text textarea")
    box.send_keys("The cat sat on the mat.")
    browser.find_element(By.CSS_SELECTOR, "form.own-text button[type=submit]").click()
    figures = wait_for(browser, "#own-text")
    assert "/runs/tiny/heads/1/2?text=The+cat" in browser.current_url
    tokens = ["[CLS]", "the", "cat", "sat", "on", "the", "mat", ".", "[SEP]"]
    matrices = figures.find_elements(By.CSS_SELECTOR, "svg.token-matrix")
    assert len(matrices) == 2
    for svg in matrices:
        for axis in ("row", "col"):
            shown = svg.find_elements(By.CSS_SELECTOR, f"text.{axis}")
            assert [t.text for t in shown] == tokens and all(t.is_displayed() for t in shown)
        assert len(svg.find_elements(By.TAG_NAME, "rect")) >= len(tokens) ** 2
    # the row labels sit left of the cells and the column labels above them, within the figure
    svg = matrices[0]
    first = svg.find_element(By.CSS_SELECTOR, "rect").rect
    assert svg.find_element(By.CSS_SELECTOR, "text.row").rect["x"] < first["x"]
    assert svg.find_element(By.CSS_SELECTOR, "text.col").rect["y"] < first["y"]
    # a cell hovered: its two tokens and its value
    cell = svg.find_elements(By.CSS_SELECTOR, 'g.cells[data-i="2"] rect')[5]
    ActionChains(browser).move_to_element(cell).perform()
    tip = wait_for(browser, "#tip:not([hidden])", 10)
    assert tip.text == f"2 «cat» · 5 «the»: {cell.get_attribute('data-v')}"
    view = figures.find_element(By.CSS_SELECTOR, "svg.head-view")
    assert [t.text for t in view.find_elements(By.CSS_SELECTOR, "text.q")] == tokens
    cat = view.find_element(By.CSS_SELECTOR, 'g.from[data-i="2"]')
    other = view.find_element(By.CSS_SELECTOR, 'g.from[data-i="3"] g.lines')
    ActionChains(browser).move_to_element(cat.find_element(By.CSS_SELECTOR, "text.q")).perform()
    assert float(other.value_of_css_property("opacity")) < 0.5
    assert float(cat.find_element(By.CSS_SELECTOR, "g.lines").value_of_css_property("opacity")) == 1.0


def test_a_heads_top_examples_show_their_tokens_highlighted(site):
    from selenium.webdriver.common.by import By

    url, browser, db, _ = site
    want = cli_json(
        db, "query", "examples", "--run", "tiny", "--layer", "1", "--head", "2", "--kind", "pair", "--limit", "1"
    )[0]
    browser.get(url + "/runs/1/heads/1/2#top-examples")
    first = wait_for(browser, 'ol.top-examples[data-kind="pair"] li:first-child mark.ex-i', 30)
    second = browser.find_element(By.CSS_SELECTOR, 'ol.top-examples[data-kind="pair"] li:first-child mark.ex-j')
    # the pair's two tokens, as the stored example names them, marked in the text around them
    assert (first.text, second.text) == (want["token_i"].removeprefix("##"), want["token_j"].removeprefix("##"))
    assert first.is_displayed() and second.is_displayed()
    colours = {m.value_of_css_property("background-color") for m in (first, second)}
    assert len(colours) == 2 and "rgba(0, 0, 0, 0)" not in colours  # highlighted, each in its own colour
    text = browser.find_element(By.CSS_SELECTOR, 'ol.top-examples[data-kind="pair"] li:first-child .ex-text').text
    assert text.startswith(("…", "[CLS]")) and first.text in text
