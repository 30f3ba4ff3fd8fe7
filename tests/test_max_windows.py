"""``--max-windows N`` caps an analysis: the corpus's first N windows, in corpus order, and no
others; the cap is one of the run's parameters, so another N is another run and the same N
finds the run already made."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from headatlas.cli.main import app

ENV = {"COLUMNS": "300", "NO_COLOR": "1"}


def analyze(corpus, db, model, name: str | None = None, **options) -> int:
    from headatlas.service import api

    run = api.analyze(corpus, db=db, model=model, name=name, seq_len=32, batch_size=4, progress=False, **options)
    return run.run_id


def stored(db, run_id: int) -> tuple[list[str], dict]:
    from headatlas.service import api

    atlas = api.connect(db)
    windows = atlas.sql(f"SELECT window_id FROM run_windows WHERE run_id = {run_id}").to_pylist()
    params = atlas.sql(f"SELECT params FROM runs WHERE run_id = {run_id}").to_pylist()[0]["params"]
    return sorted(w["window_id"] for w in windows), json.loads(params)


def corpus_windows_of_first(corpus, tiny_model) -> list[str]:
    """The windows of the corpus's first document."""
    first = corpus.parent / "first.txt"
    first.write_text(corpus.read_text(encoding="utf-8").split("\n\n")[0] + "\n", encoding="utf-8")
    return corpus_windows(first, tiny_model)


def corpus_windows(corpus, tiny_model) -> list[str]:
    """Every window of the corpus, in order, cut by the windowing functions themselves (no cap)."""
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.corpus import iter_documents
    from headatlas.service.engine.windows import TokenClasses, document_windows

    params = build_params(seq_len=32)
    tokens = TokenClasses.for_model(tiny_model)
    return [
        w.window_id
        for doc in iter_documents(str(corpus))
        for w in document_windows(doc, tiny_model.tokenizer, tokens, tiny_model.tokenizer_key, params)
    ]


def test_max_windows_analyses_exactly_the_first_n_and_keys_the_run(tmp_path, demo_corpus, tiny_model):
    corpus = tmp_path / "two.txt"  # two documents of 4 and 3 windows
    docs = [d.strip() for d in demo_corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()][:2]
    corpus.write_text(docs[0][:500] + "\n\n" + docs[1][:400] + "\n", encoding="utf-8")
    every = corpus_windows(corpus, tiny_model)
    first = len(corpus_windows_of_first(corpus, tiny_model))
    assert 3 < first < 5 < len(every)  # one cap ends inside the first document, one past it
    db = tmp_path / "cap.duckdb"

    three = analyze(corpus, db, tiny_model, max_windows=3)
    windows, params = stored(db, three)
    assert windows == sorted(every[:3])
    assert params["max_windows"] == 3

    # another cap is another run, of its own first N windows; the same cap is the same run
    five = analyze(corpus, db, tiny_model, max_windows=5)
    assert five != three
    assert stored(db, five)[0] == sorted(every[:5])
    assert analyze(corpus, db, "random:tiny", name="again", max_windows=3) == three  # found, not made again


def test_no_cap_keeps_the_parameters_of_runs_made_before_it():
    from headatlas.service.analysis_options import build_params

    assert "max_windows" not in build_params().to_dict()
    assert build_params(max_windows=3).key() not in (build_params().key(), build_params(max_windows=4).key())


def test_a_cap_below_one_is_refused_in_one_line(tmp_path, small_corpus):
    done = CliRunner().invoke(
        app, ["analyze", str(small_corpus), "--db", str(tmp_path / "x.duckdb"), "--max-windows", "0"], env=ENV
    )
    assert done.exit_code == 2 and "--max-windows" in done.output
    assert not (tmp_path / "x.duckdb").exists()


def test_the_attribution_windows_keep_their_own_name():
    from headatlas.service.analysis_options import BY_NAME

    assert BY_NAME["attribution_windows"].aliases == ()
    assert BY_NAME["max_windows"].flag == "--max-windows"


def test_a_capped_pass_counts_its_progress_in_windows():
    """Under --max-windows the pass ends after N windows, long before a large corpus's last
    character: its bar runs from 0 to N windows, not over the corpus's characters."""
    from headatlas.cli.analysis_commands import _Shown
    from headatlas.service.operations.events import PassEnded, PassStarted, Progress

    for started, after_two in ((PassStarted(1_000_000, max_windows=4), (2, 4)), (PassStarted(1_000), (250, 1_000))):
        shown = _Shown()
        shown(started)
        shown(Progress(2, 250))  # two windows, a quarter of the characters
        task = shown.bar.tasks[0]
        assert (task.completed, task.total) == after_two
        shown(PassEnded(completed=True))


def test_the_queue_submits_the_same_capped_windows(tmp_path, small_corpus, tiny_model):
    """`submit --max-windows N` cuts the batches it queues from the same first N windows, and its
    payloads carry the cap to the workers and the writer with the run's parameters."""
    from headatlas.service.analysis_options import build_params
    from headatlas.workers.submit import batch_payloads

    params = build_params(seq_len=32, max_windows=5)
    batches = list(
        batch_payloads(
            str(small_corpus), tiny_model, params, model="random:tiny", dtype="float32", batch_size=2, database_id="x"
        )
    )
    sent = [w[0] for _, _, payload in batches for w in payload["windows"]]
    assert sent == corpus_windows(small_corpus, tiny_model)[:5]
    assert [n for _, n, _ in batches] == [2, 2, 1]
    assert all(payload["params"]["max_windows"] == 5 for _, _, payload in batches)
