"""`headatlas serve`'s app through an in-process client: every page and its JSON against the CLI's own
output (`headatlas … --format json|csv`, run in this process), escaping of a run named `<script>`, the
404 and 400 pages (the CLI's checks, in the web's words: `?layer=7`), no path outside the app, the example window (the
window the run analysed, its matrices as `inspect` computes them), a text of one's own (every token on both
axes, the values `inspect` computes, its limits, a model that cannot be loaded here), a lake read now and at a snapshot,
and the command itself (a process: it prints its address, warns off loopback, serves)."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import time
import urllib.request

import numpy as np
import pytest
from web_support import Client

from tests.conftest import headatlas_cmd, invoke_cli
from tests.figure_checks import analyse, corpus_of

NAUGHTY = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def stored(tmp_path_factory, tiny_model, demo_corpus):
    """A database with a tiny run, its control, and a deeper run named NAUGHTY (random weights)."""
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.model import control_model, load_model
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.storage.store import Store

    folder = tmp_path_factory.mktemp("web")
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
    deep = analyse(corpus, db, load_model("random:3,4,32", device="cpu"), name=NAUGHTY, seq_len=64)
    return db, run, deep


@pytest.fixture(scope="module")
def client(stored):
    from headatlas.service.web.app import WebApp

    return Client(WebApp(str(stored[0])))


def cli_json(db, *args: str):
    done = invoke_cli(*args, "--format", "json", "--db", str(db))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def same(got, want) -> bool:
    """The same document: keys, order and values; floats to 1e-9 relative (DuckDB sums in parallel, so
    two runs of one query may differ in the last bits, the CLI's with itself too)."""
    if isinstance(got, float) and isinstance(want, float):
        return got == pytest.approx(want, rel=1e-9, abs=1e-12)
    if isinstance(got, dict) and isinstance(want, dict):
        return list(got) == list(want) and all(same(got[k], want[k]) for k in got)
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(same(a, b) for a, b in zip(got, want))
    return got == want


def cli_error(db, *args: str) -> str:
    done = invoke_cli(*args, "--db", str(db))
    assert done.returncode == 2, done.stdout
    return done.stderr.strip().removeprefix("error: ")


def page_text(answer) -> str:
    """The page's text as a reader sees it (tags dropped, entities read)."""
    import html

    return html.unescape(re.sub(r"<[^>]+>", "", answer.text))


def test_every_page_answers_and_its_json_is_the_clis(stored, client):
    db, run, _ = stored
    for path in ("/runs", "/runs/tiny", "/runs/tiny/heads/1/2", "/compare/tiny/tiny-control", "/runs/tiny/sql"):
        answer = client.get(path)
        assert answer.status == 200 and answer.headers["Content-Type"].startswith("text/html"), path
        assert "default-src 'self'" in answer.headers["Content-Security-Policy"]
    assert client.get("/").status == 302 and client.get("/").headers["Location"] == "/runs"
    assert same(client.get("/runs.json").json(), cli_json(db, "runs"))
    page = client.get("/runs/tiny.json").json()
    assert same(page["run"], next(r for r in cli_json(db, "runs") if r["name"] == "tiny"))
    assert same(page["layers"], cli_json(db, "query", "layers", "--run", "tiny", "--ci"))
    assert same(page["heads"], cli_json(db, "query", "heads", "--run", "tiny", "--ci"))
    assert same(page["roles"], cli_json(db, "query", "roles", "--run", "tiny", "--stability"))
    sorted_page = client.get("/runs/tiny.json?sort=mean_distance&asc=1&layer=1&top=3").json()
    assert same(
        sorted_page["heads"],
        cli_json(
            db,
            "query",
            "heads",
            "--run",
            "tiny",
            "--sort",
            "mean_distance",
            "--asc",
            "--layer",
            "1",
            "--top",
            "3",
            "--ci",
        ),
    )
    head = client.get(f"/runs/{run.run_id}/heads/1/2.json").json()
    layer_rows = cli_json(db, "query", "heads", "--run", "tiny", "--layer", "1", "--ci")
    assert same(head["metrics"], [r for r in layer_rows if r["head"] == 2])
    assert same(
        head["distances"], cli_json(db, "query", "distances", "--run", "tiny", "--layer", "1", "--head", "2", "--ci")
    )
    roles = cli_json(db, "query", "roles", "--run", "tiny", "--stability")
    assert same(head["roles"], [r for r in roles if (r["layer"], r["head"]) == (1, 2)])
    assert head["top_anchors"] and all(a.endswith("%") for a in head["top_anchors"])


def test_compare_by_layer_head_and_depth_is_the_clis(stored, client):
    db, _, deep = stored
    by_layer = client.get("/compare/tiny/tiny-control.json").json()
    assert same(by_layer["rows"], cli_json(db, "compare", "tiny", "tiny-control"))
    assert {r["verdict"] for r in by_layer["rows"]} <= {"beyond", "within", "no value", "no interval"}
    by_head = client.get("/compare/tiny/tiny-control.json?by=head&metric=mean_distance").json()
    assert same(
        by_head["rows"], cli_json(db, "compare", "tiny", "tiny-control", "--heads", "--metric", "mean_distance")
    )
    # 2 layers against 3: aligned by relative depth (the run named NAUGHTY has a "/" in its name: by id)
    by_depth = client.get(f"/compare/tiny/{deep.run_id}.json?by=depth").json()
    assert same(by_depth["rows"], cli_json(db, "compare", "tiny", NAUGHTY))
    assert [r["layer"] for r in by_depth["profiles"]["b"]] == [0, 1, 2]
    assert (
        client.get("/compare?a=tiny&b=tiny-control&by=head").headers["Location"] == "/compare/tiny/tiny-control?by=head"
    )
    assert "beyond" in client.get("/compare/tiny/tiny-control?by=head").text
    # heads pair up only between runs of one shape: refused as the CLI refuses --heads
    refused = client.get(f"/compare/tiny/{deep.run_id}?by=head")
    assert refused.status == 400
    assert cli_error(db, "compare", "tiny", NAUGHTY, "--heads") in page_text(refused)


def test_sql_over_a_run_is_the_clis_with_its_limits(stored, client, monkeypatch):
    db, run, _ = stored
    q = "SELECT layer, head, within_sentence_lift_dm, mean_distance FROM head_metrics ORDER BY 3 DESC"
    assert same(client.get("/runs/tiny/sql.json", {"q": q}).json(), cli_json(db, "sql", "--run", "tiny", q))
    # the CSV as the CLI writes it, to the byte (counts: no float summed in another order)
    counts = (
        "SELECT layer, head, high_pairs, windows, 'a,\"b\"' AS quoted, NULL AS nothing FROM head_metrics ORDER BY 1, 2"
    )
    csv_answer = client.get("/runs/tiny/sql.csv", {"q": counts})
    done = invoke_cli("sql", "--run", "tiny", counts, "--format", "csv", "--db", str(db))
    assert csv_answer.text == done.stdout
    assert csv_answer.headers["Content-Disposition"] == 'attachment; filename="run-tiny-sql.csv"'
    # scoped to the run: the views hold its rows alone
    scoped = client.get("/runs/tiny/sql.json", {"q": "SELECT DISTINCT run_id FROM head_metrics"}).json()
    assert scoped == [{"run_id": run.run_id}]
    page = client.get("/runs/tiny/sql", {"q": q})
    assert page.status == 200 and page.text.count("<tr>") == 1 + run.n_layers * run.n_heads
    # the sandbox's refusals and limits hold, in the CLI's words
    refused = client.get("/runs/tiny/sql", {"q": "DROP TABLE runs"})
    assert refused.status == 400 and cli_error(db, "sql", "--run", "tiny", "DROP TABLE runs") in page_text(refused)
    assert client.get("/runs/tiny/sql.json", {"q": "DROP TABLE runs"}).json()["status"] == 400
    monkeypatch.setenv("HEADATLAS_SQL_MAX_ROWS", "100")
    capped = client.get("/runs/tiny/sql", {"q": "SELECT * FROM range(5000)"})
    assert "truncated: the first 100 rows" in capped.text and capped.text.count("<tr>") == 101


def test_tables_sort_facet_round_and_link_their_rows_to_heads(stored, client):
    """The SQL page's result: numbers at 4 significant digits with the full value to sort by, headers
    that sort (numbers as numbers), a facet per layer (and per role, its values as text), and a
    row's head linked to its page; the JSON keeps every digit. The run page's heads table the same."""
    from html import unescape

    db, run, _ = stored
    q = (
        "SELECT layer, head, within_sentence_lift_dm AS lift, '<b>' || (head % 2) || '</b>' AS role "
        "FROM head_metrics ORDER BY 1, 2"
    )
    page = client.get("/runs/tiny/sql", {"q": q})
    rows = client.get("/runs/tiny/sql.json", {"q": q}).json()
    assert page.status == 200 and '<table id="sql-result" class="data " data-sortable>' in page.text
    assert re.search(r'<th data-col="lift" data-type="num" tabindex="0" aria-sort="none">', page.text)
    assert re.search(r'<th class=text data-col="role" data-type="text" tabindex="0" aria-sort="none">', page.text)
    body = page.text.split('<table id="sql-result"')[1].split("<tbody>")[1]
    shown = re.findall(r'<td data-sort="([^"]+)">([^<]+)</td>', body)
    lifts = [r["lift"] for r in rows]
    # the lifts (layer and head are integers): each its full value, shown to 4 digits
    full = [(float(k), v) for k, v in shown if "." in k]
    assert [k for k, _ in full] == lifts and [v for _, v in full] == [f"{x:.4g}" for x in lifts]
    assert any(len(repr(x)) > 8 for x in lifts)  # the page rounds what the JSON keeps
    for r in rows:
        href = f"/runs/{run.run_id}/heads/{r['layer']}/{r['head']}"
        assert f'<td data-sort="{r["head"]}"><a href="{href}">{r["head"]}</a></td>' in page.text
    facets = page.text.split('<div class="facets" id="sql-result-facets">')[1].split("</div>")[0]
    layer_box = facets.split('data-col="layer">')[1].split("</select>")[0]
    assert re.findall(r'<option value="([^"]*)">', layer_box) == ["", "0", "1"]
    assert f"0 ({run.n_heads})" in layer_box
    role_box = facets.split('data-col="role">')[1].split("</select>")[0]
    assert re.findall(r'<option value="([^"]*)">', role_box) == ["", "&lt;b&gt;0&lt;/b&gt;", "&lt;b&gt;1&lt;/b&gt;"]
    assert "<b>" not in page.text.split("</form>", 1)[1] and unescape("&lt;b&gt;") == "<b>"
    # the run page: the heads table sorts by its values, each head linked
    run_page = client.get("/runs/tiny").text
    heads = run_page.split('id="heads-table"')[1].split("</table>")[0]
    assert "data-sortable" in run_page.split('id="heads-table"')[1][:40]
    assert heads.count('data-type="num"') >= 3 and heads.count(f'<a href="/runs/{run.run_id}/heads/') == 8


def test_a_run_named_script_is_text_on_every_page(stored, client):
    db, _, deep = stored
    naughty = deep.run_id
    pages = [
        "/runs",
        f"/runs/{naughty}",
        f"/runs/{naughty}/heads/0/0",
        f"/compare/tiny/{naughty}",
        f"/runs/{naughty}/sql?q=SELECT+'<img src=x onerror=alert(2)>'+AS+v",
    ]
    for path in pages:
        answer = client.get(path)
        assert answer.status == 200, path
        assert "<script>alert" not in answer.text and "<img src=x" not in answer.text, path
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in answer.text, path
    assert "&lt;img src=x onerror=alert(2)&gt;" in client.get(pages[4]).text
    # by its name in the address, its "/" as %2F: the run; unquoted, the "/" splits the path: no page there,
    # and the 404 page names the address as text
    by_name = client.get("/runs/%3Cscript%3Ealert(1)%3C%2Fscript%3E.json")
    assert by_name.status == 200 and by_name.json()["run"]["run_id"] == naughty
    missing = client.get("/runs/%3Cscript%3Ealert(1)%3C/script%3E")
    assert missing.status == 404 and "<script>alert" not in missing.text and "&lt;script&gt;" in missing.text
    # the page's only scripts are the app's own file
    assert re.findall(r"<script[^>]*>", client.get(f"/runs/{naughty}").text) == ['<script src="/static/app.js" defer>']


def test_a_run_named_with_a_slash_is_addressable_by_its_name(stored, tmp_path):
    import shutil

    from headatlas.service.storage.store import Store
    from headatlas.service.web.app import WebApp

    db, run = tmp_path / "copy.duckdb", stored[1]
    shutil.copy(stored[0], db)
    Store(db).rename_run(run.run_id, "a/b")
    client = Client(WebApp(str(db)))
    assert client.get("/runs/a%2Fb.json").json()["run"]["name"] == "a/b"
    for path in (
        "/runs/a%2Fb",
        "/runs/a%2Fb/heads/1/2",
        "/runs/a%2Fb/sql.json?q=SELECT+1",
        "/compare/a%2Fb/tiny-control",
    ):
        assert client.get(path).status == 200, path
    assert client.get("/runs/a/b").status == 404
    form = client.get("/compare?a=a/b&b=tiny-control&by=head")
    assert form.status == 302 and form.headers["Location"] == "/compare/a%2Fb/tiny-control?by=head"


def test_on_loopback_only_requests_addressed_to_loopback_are_answered(stored):
    """A page of another site that points a name at 127.0.0.1 (DNS rebinding) sends that name as Host."""
    from headatlas.service.web.app import WebApp
    from headatlas.service.web.server import LoopbackHosts, bind

    guarded = Client(LoopbackHosts(WebApp(str(stored[0])), 8150))
    for host in ("127.0.0.1:8150", "localhost:8150", "[::1]:8150", "LOCALHOST:8150"):
        assert guarded.get("/runs.json", host=host).status == 200, host
    for host in ("evil.example:8150", "evil.example", "127.0.0.1:8151", "127.0.0.1", "10.0.0.2:8150", ""):
        answer = guarded.get("/runs.json", host=host)
        assert answer.status == 421 and "localhost, 127.0.0.1 or [::1] on port 8150" in answer.text, host
    server = bind(WebApp(str(stored[0])), "127.0.0.1", 0, quiet=True)
    try:
        assert isinstance(server.get_app(), LoopbackHosts)
    finally:
        server.server_close()


def test_the_atlas_is_coloured_by_effect_where_effects_were_measured(stored, tmp_path, tiny_model, demo_corpus):
    """Zero ablation (SPEC §9) on 2 windows of a tiny run: the atlas offers its effects first, shades them
    about 0 (the head whose removal costs most at the red end, one that helps at the blue), and a run
    without effects refuses the colour with how to measure them."""
    from headatlas.service.web.app import WebApp

    corpus = corpus_of(demo_corpus, tmp_path, slice(0, 1), "one")
    db = tmp_path / "fx.duckdb"
    fx = analyse(corpus, db, tiny_model, name="fx", seq_len=32, effects="zero", effect_windows=2, replicates="window")
    client = Client(WebApp(str(db)))
    heads = client.get(f"/runs/{fx.run_id}.json").json()["heads"]
    assert same(heads, cli_json(db, "query", "heads", "--run", "fx", "--ci"))
    page = client.get(f"/runs/{fx.run_id}")  # the default colour: the effect, as `plot atlas` draws it
    assert page.status == 200
    choice = page.text.split('<select name="color"')[1].split("</select>")[0]
    offered = re.findall(r'<option value="([^"]+)"', choice)
    assert offered[0] == "effect_zero" and '<option value="effect_zero" selected>' in choice
    assert "role" in offered and "effect_mean" not in offered and "induction_score" not in offered
    cells = dict(re.findall(r'href="/runs/\d+/heads/(\d+/\d+)"[^>]*style="background:(#[0-9a-f]{6})', page.text))
    strongest = max(heads, key=lambda h: abs(h["effect_zero"]))
    end = "#b2182b" if strongest["effect_zero"] > 0 else "#2166ac"
    assert cells[f"{strongest['layer']}/{strongest['head']}"] == end and len(cells) == fx.n_layers * fx.n_heads
    refused = Client(WebApp(str(stored[0]))).get("/runs/tiny?color=effect_zero")
    # the parameter as the address writes it; how to measure it, an option of `headatlas analyze`, as code
    assert refused.status == 400 and (
        "?color=effect_zero: run 1 has no value of it; its effects (SPEC §9) were not measured: analyse it with "
        "`--effects zero` (or mean, gradient)"
    ) in page_text(refused)


@pytest.fixture(scope="module")
def real_run(tmp_path_factory, real_model, demo_corpus):
    """A run of the real model (MiniLM) on one document: heads that earn roles."""
    from headatlas.service.web.app import WebApp

    folder = tmp_path_factory.mktemp("real")
    db = folder / "real.duckdb"
    run = analyse(corpus_of(demo_corpus, folder, slice(0, 1), "one"), db, real_model, name="real", seq_len=64)
    return Client(WebApp(str(db))), run


def test_the_atlas_names_each_heads_role_in_words_coloured_by_its_evidence(real_run):
    """Without effects the atlas is coloured by each head's primary role's value over its threshold
    (`plot atlas`'s default), names the role in a word (letter codes read as a cipher), and draws an
    unsure role (not on both halves, or its interval reaching its threshold) faded, never hatched."""
    from headatlas.service.reports.atlas_plots import ROLE_WORDS, role_uncertain

    client, run = real_run
    page = client.get(f"/runs/{run.run_id}")
    roles = client.get(f"/runs/{run.run_id}.json").json()["roles"]
    earned = [r for r in roles if r["primary"] and r["role"] != "none established"]
    assert earned
    choice = page.text.split('<select name="color"')[1].split("</select>")[0]
    assert '<option value="evidence" selected>' in choice
    cells = {
        (int(l), int(h)): (cls, text)
        for cls, l, h, text in re.findall(
            r'<a class="cell([^"]*)" href="/runs/\d+/heads/(\d+)/(\d+)"[^>]*>([^<]*)</a>', page.text
        )
    }
    columns = list(roles[0])
    for r in earned:
        cls, text = cells[(r["layer"], r["head"])]
        others = sum(1 for o in roles if (o["layer"], o["head"]) == (r["layer"], r["head"]) and not o["primary"])
        assert text == ROLE_WORDS[r["role"]] + (f" +{others}" if others else "")
        assert ("unsure" in cls) == role_uncertain(columns, tuple(r.values()))
    assert "unstable" not in page.text and "hatched" not in page.text
    assert "faded: unsure (not on both halves" in page_text(page).lower()


def test_bad_addresses_get_a_404_page(stored, client):
    db, _, deep = stored
    for path in ("/nope", "/runs/tiny/heads/9/0", "/runs/tiny/heads/x/0", "/runs/tiny/layers", "/favicon.ico"):
        answer = client.get(path)
        assert answer.status == 404 and "Not found" in answer.text, path
    # a run no name finds: the CLI's lookup and words, its command to run the page's own link
    missing = client.get("/runs/no-such-run")
    assert missing.status == 404
    said = "no run 'no-such-run': see the runs at /runs for ids and names"
    assert cli_error(db, "query", "layers", "--run", "no-such-run") == said.replace(
        "the runs at /runs", "`headatlas runs`"
    )
    assert said in page_text(missing)
    assert client.get("/runs/no-such-run.json").json() == {"error": said, "status": 404}
    # a head the run does not have, by its address
    beyond = client.get("/runs/tiny/heads/1/9")
    assert beyond.status == 404
    assert "run 1 (tiny) has no layer 1, head 9: its layers are 0..1 and its heads 0..3 (0-based)" in page_text(beyond)
    assert client.get("/runs", method="POST").status == 405


@pytest.mark.parametrize(
    ("query", "cli", "flag", "parameter"),
    [
        ("sort=bogus", ("query", "heads", "--run", "tiny", "--sort", "bogus"), "--sort 'bogus'", "?sort=bogus"),
        ("layer=7", ("query", "heads", "--run", "tiny", "--layer", "7"), "--layer 7", "?layer=7"),
        ("at=3", ("query", "heads", "--run", "tiny", "--at", "3"), "--at 3", "?at=3"),
        ("top=x", ("query", "heads", "--run", "tiny", "--top", "x"), None, "?top=x: not a whole number"),
        ("asc=1", ("query", "heads", "--run", "tiny", "--asc"), None, "?asc=1 orders the ?sort= metric"),
    ],
)
def test_a_bad_parameter_gets_a_400_page_in_the_webs_words(stored, client, query, cli, flag, parameter):
    """The check the command line makes, its message naming the address's parameter (``?layer=7``)
    where the command line names its flag (``--layer 7``): no flag of the command line on the page
    but as code (how to make a lake: `--db ducklake:…`)."""
    answer = client.get(f"/runs/tiny?{query}")
    assert answer.status == 400
    assert parameter in page_text(answer)
    if flag is not None:  # the same check: the command line's message, its flag the only difference
        assert cli_error(stored[0], *cli).split("; ")[0].replace(flag, parameter) in page_text(answer)
    assert not re.search(r"(?<![\w`])--[a-z]", page_text(answer)), page_text(answer)


def test_no_path_outside_the_app_is_served(client):
    secret = open("pyproject.toml", encoding="utf-8").read()[:40]
    for path in (
        "/static/../pyproject.toml",
        "/static/../../pyproject.toml",
        "/static/%2e%2e/%2e%2e/pyproject.toml",
        "/static/..%2f..%2fpyproject.toml",
        "/static/app.py",
        "/static/",
        "//etc/passwd",
        "/runs/../../../etc/passwd",
        "/static/app.js/../../app.py",
    ):
        answer = client.get(path)
        assert answer.status == 404, path
        assert secret not in answer.text and "root:" not in answer.text, path
    script = client.get("/static/app.js")
    assert script.status == 200 and script.headers["Content-Type"].startswith("text/javascript")
    assert "http://" not in script.text and "https://" not in script.text  # nothing loaded from elsewhere


def test_the_example_window_is_the_window_the_run_analysed(stored, client, tiny_model):
    import numpy as np

    from headatlas.service.params import AnalysisParams
    from headatlas.service.reports.inspection import inspect_text
    from headatlas.service.reports.tokens import window_tokens
    from headatlas.service.storage.store import Store
    from headatlas.service.web.example import document_text, stored_window

    db, run, _ = stored
    first = client.get(f"/runs/{run.run_id}/heads/1/2/example.json?window=1")
    assert first.status == 200, first.text
    doc = first.json()
    assert doc["same_window"] and doc["note"] is None
    with Store(db).checked_read() as conn:
        window = stored_window(conn, run, 1)
    assert doc["window_id"] == window.window_id
    # the matrices inspect computes for that window, with the run's own parameters
    seen = inspect_text(
        tiny_model, document_text(window), AnalysisParams.from_dict(run.params), window=window.window_index
    )
    # the vocabulary's strings, and as they read (the same for a WordPiece vocabulary; a byte-level
    # one's decoded, tests/test_token_text.py)
    assert doc["vocabulary_tokens"] == seen.tokens and doc["tokens"] == window_tokens(seen.tokens)
    np.testing.assert_allclose(doc["csm"], seen.csm[1, 2], rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(np.asarray(doc["attention"]).sum(axis=1), 1.0, atol=1e-2)
    high = {tuple(p) for p in doc["high_pairs"]}
    assert high == {(i, j) for i, j in zip(*np.nonzero(np.triu(seen.high[1, 2], 1)))}
    # every head of the window is kept: another head comes without computing again
    other = client.get(f"/runs/{run.run_id}/heads/0/3/example.json?window=1").json()
    assert other["computed_s"] == doc["computed_s"] and other["window_id"] == doc["window_id"]
    assert client.get(f"/runs/{run.run_id}/heads/1/2/example.json?window=99999").status == 400
    page = client.get(f"/runs/{run.run_id}/heads/1/2?window=1")
    assert f'data-src="/runs/{run.run_id}/heads/1/2/example.json?window=1"' in page.text and "computing" in page.text


def test_a_write_to_the_database_is_seen_at_the_next_request(stored, client):
    from headatlas.service.storage.store import Store

    db, run, _ = stored
    before = client.get("/runs.json").json()
    Store(db).tag_run(run.run_id, ["seen"], [])
    try:
        after = client.get("/runs.json").json()
        assert next(r for r in after if r["run_id"] == run.run_id)["tags"] == ["seen"]
        assert after != before and client.get("/runs?tag=seen").text.count('href="/runs/') == 2  # the run, twice
    finally:
        Store(db).tag_run(run.run_id, [], ["seen"])


def test_a_finished_runs_reads_outlive_writes_elsewhere_not_its_own(stored, tmp_path):
    import shutil

    import numpy as np

    from headatlas.service.reports.columns import PROBE_COLUMNS
    from headatlas.service.storage.store import Store
    from headatlas.service.web.app import WebApp

    db, run, deep = tmp_path / "copy.duckdb", stored[1], stored[2]
    shutil.copy(stored[0], db)
    app = WebApp(str(db))
    client = Client(app)

    def heads_reads() -> int:  # the run's heads, as read from the database so far
        return sum(1 for key in app.memo._items if key[1:3] == ("run", run.run_id) and key[4] == "heads")

    first = client.get(f"/runs/{run.run_id}.json").json()
    Store(db).tag_run(deep.run_id, ["elsewhere"], [])  # a write, not to this run
    assert client.get(f"/runs/{run.run_id}.json").json() == first and heads_reads() == 1
    Store(db).rename_run(run.run_id, "renamed")  # a write to its row that changes none of its results
    renamed = client.get(f"/runs/{run.run_id}.json").json()
    assert renamed["run"]["name"] == "renamed" and renamed["heads"] == first["heads"] and heads_reads() == 1
    scores = np.full((run.n_layers, run.n_heads), 0.5)
    Store(db).store_probe(run.run_id, (8, 2, 0), dict.fromkeys(PROBE_COLUMNS, scores))
    probed = client.get(f"/runs/{run.run_id}.json").json()
    assert heads_reads() == 2 and {h["induction_score"] for h in probed["heads"]} == {0.5}
    assert same(probed["heads"], cli_json(db, "query", "heads", "--run", str(run.run_id), "--ci"))


def test_a_request_opens_the_database_once_and_checks_its_schema_once_per_state(stored, tmp_path):
    """A page reads in one transaction (the runs' rows too), and the schema check is made once per
    state of the file: not again for a state already checked, again after any write."""
    import shutil

    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from headatlas.service.storage.store import Store
    from headatlas.service.web.app import WebApp

    db, run, deep = tmp_path / "copy.duckdb", stored[1], stored[2]
    shutil.copy(stored[0], db)
    client = Client(WebApp(str(db)))
    opened: list[int] = []
    checked: list[str] = []

    def on_open(conn) -> None:
        opened.append(1)

    def on_statement(conn, cursor, statement, *rest) -> None:
        if "alembic_version" in statement:
            checked.append(statement)

    def get(path: str) -> tuple[int, int, int]:
        opened.clear()
        checked.clear()
        status = client.get(path).status
        return status, len(opened), len(checked)

    event.listen(Engine, "engine_connect", on_open)
    event.listen(Engine, "before_cursor_execute", on_statement)
    try:
        status, opens, checks = get(f"/runs/{run.run_id}")
        assert (status, opens) == (200, 1) and checks > 0
        assert get(f"/runs/{deep.run_id}") == (200, 1, 0)  # the same state: checked already
        Store(db).tag_run(deep.run_id, ["elsewhere"], [])
        status, opens, checks = get(f"/runs/{run.run_id}")
        assert (status, opens) == (200, 1) and checks > 0  # a write: the file is another state
    finally:
        event.remove(Engine, "engine_connect", on_open)
        event.remove(Engine, "before_cursor_execute", on_statement)


def test_a_file_changed_under_the_server_is_checked_again(stored, tmp_path):
    """A schema check remembered for one state of the file is not trusted for another: a database set
    back to an older schema, or replaced by another tool's file, is refused at the next request."""
    import shutil

    import duckdb
    from sqlalchemy import text

    from headatlas.service.storage.store import Store
    from headatlas.service.web.app import WebApp

    db, run = tmp_path / "copy.duckdb", stored[1]
    shutil.copy(stored[0], db)
    client = Client(WebApp(str(db)))
    assert client.get("/runs.json").status == 200 and client.get(f"/runs/{run.run_id}.json").status == 200
    with Store(db).write() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0014_prune_curves'"))
    for path in ("/runs.json", f"/runs/{run.run_id}.json"):
        answer = client.get(path)
        assert answer.status == 400 and "run `headatlas db upgrade`" in answer.json()["error"], path
    foreign = tmp_path / "foreign.duckdb"
    with duckdb.connect(str(foreign)) as other:
        other.execute("CREATE TABLE measurements (x INTEGER)")
    shutil.copy(foreign, db)
    answer = client.get("/runs.json")
    assert answer.status == 400 and "a DuckDB database of something else" in answer.json()["error"]


def test_progress_of_an_unfinished_run(stored, tmp_path):
    from headatlas.service.storage.store import Store
    from headatlas.service.web.app import WebApp

    db = tmp_path / "open.duckdb"
    store = Store(db)
    store.ensure_schema()
    store.find_or_create_run(
        run_key="k",
        name="open",
        corpus="c.txt",
        corpus_fingerprint="-",
        model={"spec": "random:tiny", "name": "tiny", "layers": 2, "heads": 4, "d_head": 8},
        params={"seq_len": 32, "short_range": 4},
        engine="embedded",
        device="cpu",
    )
    client = Client(WebApp(str(db)))
    assert client.get("/progress.json").json() == [
        {
            "run_id": 1,
            "status": "created",
            "windows": 0,
            "batches_done": 0,
            "batches_failed": 0,
            "batches_planned": None,
            "windows_planned": None,
            "share": None,
        }
    ]
    assert 'data-progress="/progress.json"' in client.get("/runs").text


@pytest.mark.slow
def test_a_lake_now_and_at_a_snapshot(lake, tiny_model, small_corpus):
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.storage.store import Store
    from headatlas.service.web.app import WebApp

    store = Store(lake.url, data_path=lake.data_path)
    run = analyze_corpus(
        str(small_corpus),
        store=store,
        model=tiny_model,
        params=build_params(seq_len=32),
        corpus=survey_corpus(str(small_corpus)),
        name="on-lake",
        batch_size=8,
    )
    snapshot = cli_json(lake.url, "runs")[0]["snapshot"]
    client = Client(WebApp(lake.url))
    assert same(client.get("/runs.json").json(), cli_json(lake.url, "runs"))
    layers = cli_json(lake.url, "query", "layers", "--run", "on-lake", "--ci", "--at", str(snapshot))
    assert same(client.get(f"/runs/{run.run_id}.json?at={snapshot}").json()["layers"], layers)
    store.rename_run(run.run_id, "renamed")
    assert client.get("/runs.json").json()[0]["name"] == "renamed"
    assert client.get(f"/runs.json?at={snapshot}").json()[0]["name"] == "on-lake"
    assert f"?at={snapshot}" in client.get(f"/runs?at={snapshot}").text  # links keep the snapshot


@pytest.mark.slow
def test_the_command_prints_its_address_warns_off_loopback_and_serves(stored, tmp_path):
    db, _, deep = stored
    started = time.perf_counter()
    process = subprocess.Popen(
        [*headatlas_cmd(), "serve", "--db", str(db), "--host", "0.0.0.0", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = process.stdout.readline()
        took = time.perf_counter() - started
        address = re.search(r"http://0\.0\.0\.0:(\d+)/", line)
        assert address, line
        assert took < 20, f"{took:.1f} s to print the address"  # 2 s on an idle machine: docs/benchmarks.md
        warning = process.stderr.readline()
        assert warning.startswith("warning: listening on 0.0.0.0: anyone who can reach this machine"), warning
        with urllib.request.urlopen(f"http://127.0.0.1:{address.group(1)}/runs.json", timeout=60) as answer:
            assert same(json.loads(answer.read()), cli_json(db, "runs"))
    finally:
        process.terminate()
        process.wait(30)


def test_the_command_line_loads_no_array_or_database_library_before_serve_prints_its_address():
    import sys

    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, headatlas.cli.main; print(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert not {"numpy", "torch", "transformers", "sqlalchemy", "duckdb"} & set(loaded)


def test_the_server_reads_the_latest_runs_pages_ahead(stored):
    from headatlas.service.web.app import WebApp

    app = WebApp(str(stored[0]))
    app.warm(runs=1).join(300)
    remembered = {part for key in app.memo._items for part in key if isinstance(part, str)}
    assert {"runs", "run", "layers", "roles", "heads"} <= remembered


def test_a_port_in_use_is_one_line_naming_the_fix():
    import socket

    from headatlas.service.errors import ParameterError
    from headatlas.service.web.server import bind

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ParameterError, match=rf"^--port {port}: in use on 127\.0\.0\.1; pass another port"):
            bind(None, "127.0.0.1", port, quiet=True)


def test_pages_read_a_finished_runs_stored_results_and_show_the_same_numbers(stored):
    """A page of a run whose results are stored (as when a run ends) shows what it shows when they
    are computed: the run, a head, a comparison with its control, as JSON."""
    from headatlas.service.reports import stored as results
    from headatlas.service.storage import run_results
    from headatlas.service.storage.store import Store
    from headatlas.service.web.app import WebApp
    from tests.test_stored_results import same_results

    db, run, deep = stored
    pages = (
        "/runs/tiny.json",
        "/runs/tiny.json?sort=mean_distance&asc=1&layer=1&top=3",
        f"/runs/{run.run_id}/heads/1/2.json",
        "/compare/tiny/tiny-control.json?by=head",
        f"/compare/tiny/{deep.run_id}.json?by=depth",
    )

    def shown() -> dict:
        client = Client(WebApp(str(db)))  # a new server: nothing remembered
        return {path: client.get(path).json() for path in pages}

    with run_results.computed():
        computed = shown()
    for r in Store(db).list_runs():
        results.refresh(Store(db), r["run_id"])
    with Store(db).checked_read() as conn:
        assert run_results.is_fresh(conn, run.run_id)
    same_results(shown(), computed)


# --- a text of one's own (service/web/own_text.py) ---------------------------------------------------
TEXT = "The cat sat on the mat. It was warm, so the cat slept."


def axis_labels(svg: str, kind: str) -> list[str]:
    """The labels of an axis (``row`` or ``col``) of a matrix, in order."""
    found = re.findall(rf'<text class="{kind}" data-i="(\d+)"[^>]*>([^<]*)</text>', svg)
    assert [int(i) for i, _ in found] == list(range(len(found)))
    return [html.unescape(t) for _, t in found]


def token_matrices(page: str) -> list[str]:
    return re.findall(r'<svg class="token-matrix".*?</svg>', page, flags=re.S)


def drawn_lines(view: str) -> list[int]:
    """The head of each line of a head view, one entry a line."""
    groups = re.findall(r'<g class="lines" data-head="(\d+)"[^>]*>(.*?)</g>', view)
    return [int(head) for head, paths in groups for _ in re.findall(r"<path ", paths)]


def test_a_short_text_shows_every_token_on_both_axes_and_the_values_inspect_computes(stored, client, tiny_model):
    from headatlas.service.params import AnalysisParams
    from headatlas.service.reports.inspection import inspect_text, read_text
    from headatlas.service.reports.tokens import window_tokens

    _, run, _ = stored
    # the tokens, from the tokenizer itself: [CLS], the word pieces, [SEP]
    pieces = tiny_model.tokenizer.convert_ids_to_tokens(tiny_model.tokenizer(TEXT)["input_ids"])
    assert pieces[0] == "[CLS]" and pieces[-1] == "[SEP]" and "cat" in pieces
    answer = client.get(f"/runs/{run.run_id}/try", {"text": TEXT, "layer": 1, "head": 2})
    assert answer.status == 200, answer.text
    shown = token_matrices(answer.text)
    assert len(shown) == 2  # the similarity matrix and the attention map
    for svg in shown:
        assert axis_labels(svg, "row") == pieces and axis_labels(svg, "col") == pieces
    # the values: what inspect computes for the text with the run's parameters, at full precision
    params = AnalysisParams.from_dict(run.params)
    seen = inspect_text(tiny_model, TEXT, params)
    doc = client.get(f"/runs/{run.run_id}/try.json", {"text": TEXT, "layer": 1, "head": 2}).json()
    assert doc["vocabulary_tokens"] == seen.tokens == pieces and doc["tokens"] == window_tokens(pieces)
    np.testing.assert_allclose(doc["csm"], seen.csm[1, 2], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(doc["attention"], seen.attention[1, 2], rtol=1e-5, atol=1e-7)
    assert {tuple(p) for p in doc["high_pairs"]} == {(i, j) for i, j in zip(*np.nonzero(np.triu(seen.high[1, 2], 1)))}
    # and C_ij = z_i · z_j from the head's own outputs (the API's read_text), C_ii = 0
    z = read_text(tiny_model, TEXT, params).z[1, 2].astype(np.float64)
    by_hand = z @ z.T
    np.fill_diagonal(by_hand, 0.0)
    np.testing.assert_allclose(doc["csm"], by_hand, rtol=1e-4, atol=1e-5)
    # the page's cells: row i's group holds its cells in column order, each with its value to 4 digits
    for svg, want in zip(shown, (seen.csm[1, 2], seen.attention[1, 2])):
        rows = re.findall(r'<g class="cells" data-i="(\d+)"[^>]*>(.*?)</g>', svg)
        assert [int(i) for i, _ in rows] == list(range(len(pieces)))
        drawn = [re.findall(r'data-v="([^"]+)"', cells) for _, cells in rows]
        assert drawn == [[f"{v:.4g}" for v in row] for row in want.astype(np.float64)]


def test_the_lines_of_a_head_or_a_layer_and_the_head_page(stored, client, tiny_model):
    from headatlas.service.params import AnalysisParams
    from headatlas.service.reports.inspection import inspect_text
    from headatlas.service.web.own_text import LINE_FLOOR

    _, run, _ = stored
    attention = inspect_text(tiny_model, TEXT, AnalysisParams.from_dict(run.params)).attention[0]
    r = run.run_id
    one = client.get(f"/runs/{r}/try", {"text": TEXT, "layer": 0, "head": 1}).text
    view = re.search(r'<svg class="head-view".*?</svg>', one, flags=re.S).group(0)
    drawn = drawn_lines(view)
    assert set(drawn) == {1} and len(drawn) == int((attention[1] >= LINE_FLOOR).sum())
    layer = client.get(f"/runs/{r}/try", {"text": TEXT, "layer": 0, "head": 1, "lines": "layer"}).text
    view = re.search(r'<svg class="head-view".*?</svg>', layer, flags=re.S).group(0)
    drawn = drawn_lines(view)
    assert sorted(set(drawn)) == [0, 1, 2, 3] and len(drawn) == int((attention >= LINE_FLOOR).sum())
    doc = client.get(f"/runs/{r}/try.json", {"text": TEXT, "layer": 0, "head": 1, "lines": "layer"}).json()
    np.testing.assert_allclose(doc["layer_attention"], attention, rtol=1e-5, atol=1e-7)
    # the head's page: its form, and with a text the same figures
    page = client.get(f"/runs/{r}/heads/0/1")
    assert page.status == 200 and 'id="your-text"' in page.text and 'name="text"' in page.text
    assert 'class="token-matrix"' not in page.text
    page = client.get(f"/runs/{r}/heads/0/1", {"text": TEXT})
    assert page.status == 200 and token_matrices(page.text) == token_matrices(one)
    # the try-it page without a text: its form alone; the run's page and the head's link to it
    empty = client.get(f"/runs/{r}/try")
    assert empty.status == 200 and "<textarea" in empty.text and "token-matrix" not in empty.text
    assert f'href="/runs/{r}/try"' in client.get(f"/runs/{r}").text
    assert f'href="/runs/{r}/try?layer=0&amp;head=1"' in page.text


def test_too_long_a_text_is_refused_naming_the_limit(stored, client):
    r = stored[1].run_id
    long = "word " * 250  # 1,250 characters
    for path in (f"/runs/{r}/try", f"/runs/{r}/heads/0/0"):
        answer = client.get(path, {"text": long})
        assert answer.status == 400 and "1,250 characters; the limit is 1,000 characters" in html.unescape(answer.text)
        assert "Traceback" not in answer.text
    words = " ".join(f"w{k}" for k in range(80))  # under 1,000 characters, well over 64 tokens
    answer = client.get(f"/runs/{r}/try.json", {"text": words})
    assert answer.status == 400 and "more than 64 tokens" in answer.json()["error"]
    bad = client.get(f"/runs/{r}/try.json", {"text": TEXT, "lines": "all"})
    assert bad.status == 400 and bad.json()["error"].startswith("?lines=all: pass head")
    assert client.get(f"/runs/{r}/try.json", {"text": TEXT, "layer": 9}).status == 400


def test_a_run_whose_model_cannot_be_loaded_here_is_refused_in_one_line(stored, tmp_path):
    import duckdb

    from headatlas.service.web.app import WebApp

    # the run as another machine would have stored it: analysed from a model folder this one lacks
    db = tmp_path / "elsewhere.duckdb"
    shutil.copy(stored[0], db)
    with duckdb.connect(str(db)) as conn:
        conn.execute("UPDATE runs SET model = '/nowhere/models/minilm' WHERE run_id = ?", [stored[1].run_id])
    client = Client(WebApp(str(db)))
    r = stored[1].run_id
    assert client.get(f"/runs/{r}/try").status == 200  # the form needs no model
    for path in (f"/runs/{r}/try", f"/runs/{r}/heads/0/0"):
        answer = client.get(path, {"text": TEXT})
        assert answer.status == 503 and "Traceback" not in answer.text, answer.text
        said = re.findall(r'<p class="error">(.*?)</p>', answer.text, flags=re.S)
        assert len(said) == 1 and "\n" not in said[0]
        assert "/nowhere/models/minilm, which cannot be loaded here" in html.unescape(said[0])
    error = client.get(f"/runs/{r}/try.json", {"text": TEXT})
    assert error.status == 503 and "cannot be loaded here" in error.json()["error"]


def test_a_server_holds_two_run_models_at_most(stored, client):
    """Texts read with three runs' models (the tiny run's, its control's, the deeper run's): the server
    holds the last two, and the one let go loads again when asked."""
    _, run, deep = stored
    runs = client.get("/runs.json").json()
    control = next(r["run_id"] for r in runs if r["name"] == "tiny-control")
    examples = client.app.examples
    for r in (run.run_id, control, deep.run_id):
        assert client.get(f"/runs/{r}/try.json", {"text": "Two models at most."}).status == 200
    held = list(examples._models)
    assert len(held) == 2 and held[0].startswith("control:") and held[1].startswith("random:3,4,32")
    assert client.get(f"/runs/{run.run_id}/try.json", {"text": "Loaded again."}).json()["model_load_s"] > 0
    assert len(examples._models) == 2 and list(examples._models)[-1].startswith("random:tiny")
