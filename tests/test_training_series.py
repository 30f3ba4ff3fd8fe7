"""A training series, end to end, on the toy induction model (service/training/toy.py).

The known answer — its previous-token head (layer 0) forms no later than its induction head
(layer 1), which forms in a phase change that `query phases` finds between two checkpoints — needs
the toy trained past its phase change: 1,100 steps of a shortened toy, about 30 s of CPU (minutes
on a loaded machine), so that test is `heavy` (`make test-heavy`). The rest reads a series of the
toy trained for 4 steps (seconds), made once for the module: checkpoints and their steps, the
reading side (trend with intervals, phases, the SQL views, the figure, the API), the refusals
(another tokenizer in the series, a folder without a step, --model with --checkpoints), and
resuming a series interrupted after its first checkpoint, and two of its checkpoints queued
(`submit --checkpoints`) through the shared queue cluster."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from suite_groups import QUEUE_CLUSTER_GROUP

from headatlas.service.errors import ParameterError, RunNotFound
from headatlas.service.training.toy import ToySpec, checkpoint_steps, train_toy

# the queued series is compared with the module's toy series: the module's tests run where the
# shared queue cluster's do (tests/suite_groups.py), so that the toy is trained and analysed once
pytestmark = pytest.mark.xdist_group(QUEUE_CLUSTER_GROUP)

# shortened: a smaller model than the default's (hidden 32, 2 heads, r of 8 to 20 tokens), six
# checkpoints; with this seed the induction score of layer 1 rises from 0.05 to 0.88 between
# steps 800 and 1,000, after the previous-token score of layer 0 has risen from 0.03 to 0.13
SHORT = ToySpec(steps=1100, seed=0, hidden=32, heads=2, batch=16, max_copy=20, checkpoints=6, documents=16)
# the series the other tests read: the same toy, 4 steps, checkpoints at steps 0, 1, 2 and 4
TINY = ToySpec(steps=4, seed=0, hidden=32, heads=2, batch=4, max_copy=20, checkpoints=4, documents=16)
OPTIONS = dict(
    model="default",
    probe=True,
    probe_length=20,
    probe_sequences=8,
    sentences="punct",
    replicates="window",
    batch_size=16,
)


def _series(root, spec: ToySpec):
    """(checkpoint folder, corpus, database) of ``spec``'s toy, trained and analysed as series "toy"."""
    from headatlas.service.operations.checkpoint_series import analyze_series
    from headatlas.service.operations.requests import AnalysisRequest

    train_toy(root / "ckpt", spec)
    db = root / "toy.duckdb"
    request = AnalysisRequest.build(root / "ckpt" / "corpus.txt", db=db, name="toy", **OPTIONS)
    analyze_series(request, str(root / "ckpt"))
    return root / "ckpt", root / "ckpt" / "corpus.txt", db


# OPTIONS as the command line spells them
ARGS = ["--probe", "--probe-length", "20", "--probe-sequences", "8", "--sentences", "punct", "--replicates", "window"]
ARGS += ["--batch-size", "16"]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return _series(tmp_path_factory.mktemp("toy"), TINY)


def _without_model() -> dict:
    return {k: v for k, v in OPTIONS.items() if k != "model"}


def _read(db):
    from headatlas.service.storage.store import Store

    return Store(db).checked_read()


def test_checkpoints_are_log_spaced_and_carry_their_step(toy):
    folder, _corpus, _db = toy
    assert checkpoint_steps(SHORT.steps, SHORT.checkpoints) == [0, 1, 6, 33, 191, 1100]
    assert checkpoint_steps(1500, 12) == [0, 1, 2, 4, 9, 19, 39, 80, 167, 347, 722, 1500]
    steps = checkpoint_steps(TINY.steps, TINY.checkpoints)
    assert steps == [0, 1, 2, 4]
    saved = sorted(p.name for p in folder.glob("step-*"))
    assert saved == [f"step-{s:06d}" for s in steps]
    state = json.loads((folder / "step-000004" / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    # attention-only: every MLP weight is zero in the saved checkpoint, after training
    from safetensors.torch import load_file

    weights = load_file(folder / "step-000004" / "model.safetensors")
    mlp = [v for k, v in weights.items() if ".mlp." in k]
    assert mlp and all(float(v.abs().max()) == 0.0 for v in mlp)


@pytest.mark.heavy
def test_previous_token_head_forms_then_induction_head_in_a_phase_change(tmp_path):
    """The known answer: the largest rise of the previous-token score is a layer-0 head's, of the
    induction score a layer-1 head's; the induction head ends far above uniform attention, and the
    previous-token head has risen by the step where the induction head's change ends."""
    from headatlas.service.reports.series_queries import largest_phases, phases, trend

    _folder, _corpus, db = _series(tmp_path, SHORT)
    with _read(db) as conn:
        rises = largest_phases(phases(conn, "toy", metrics=("prev_token_score", "induction_score")))
        prev, induction = rises["prev_token_score"], rises["induction_score"]
        assert prev.layer == 0 and induction.layer == 1
        assert induction.after > 0.4 and induction.before < 0.2, induction
        columns, rows = trend(conn, "toy", metric="prev_token_score", layer=prev.layer, head=prev.head)
        by_step = {r[0]: r[4] for r in rows}
    assert prev.step_after <= induction.step_after
    assert by_step[induction.step_after] > 2 * by_step[0]


def test_trend_gives_every_head_at_every_step_with_intervals(toy):
    from headatlas.service.reports.series_queries import trend

    with _read(toy[2]) as conn:
        columns, rows = trend(conn, "toy", metric="attn_induction", ci=True)
        probe_columns, probe_rows = trend(conn, "toy", metric="induction_score", layer=1, ci=True)
    steps = checkpoint_steps(TINY.steps, TINY.checkpoints)
    assert len(rows) == len(steps) * TINY.layers * TINY.heads
    at = {c: i for i, c in enumerate(columns)}
    assert all(r[at["attn_induction_lo"]] <= r[at["attn_induction"]] <= r[at["attn_induction_hi"]] for r in rows)
    assert {r[at["interval_by"]] for r in rows} == {"window"}
    assert [r[0] for r in probe_rows[: len(steps)]] == steps
    assert all(r[probe_columns.index("induction_score_lo")] is None for r in probe_rows)


def test_sql_views_hold_the_series(toy):
    import duckdb

    with duckdb.connect(str(toy[2]), read_only=True) as conn:
        got = conn.execute(
            "SELECT step, count(*), count(prev_token_score) FROM series_head_metrics WHERE series = 'toy' "
            "GROUP BY step ORDER BY step"
        ).fetchall()
    heads = TINY.layers * TINY.heads
    assert got == [(s, heads, heads) for s in checkpoint_steps(TINY.steps, TINY.checkpoints)]


def test_the_commands_and_the_api_read_the_series(toy, tmp_path, cli):
    import headatlas

    _folder, _corpus, db = toy
    done = cli("query", "trend", "--series", "toy", "--metric", "induction_score", "--layer", "1", "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert "series toy: induction_score by step" in done.stdout
    done = cli("query", "phases", "--series", "toy", "--db", str(db), "--min-change", "0", "--format", "json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    # with no least change, every head's probe scores have a largest change; a corpus metric's
    # counts only beyond both intervals
    assert {r["metric"] for r in found} >= {"prev_token_score", "induction_score"}
    assert all(r["beyond"] is True for r in found if r["metric"] in ("attn_to_prev", "attn_induction"))
    out = tmp_path / "trend.png"
    done = cli("plot", "trend", "--series", "toy", "--out", str(out), "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert out.stat().st_size > 10_000
    svg = out.with_suffix(".svg")
    done = cli("plot", "trend", "--series", "toy", "--linear", "--layer", "1", "--out", str(svg), "--db", str(db))
    assert done.returncode == 0 and "L1H0" in svg.read_text() and "L0H0" not in svg.read_text(), done.stderr
    # the same from Python: found finished, every step
    steps = headatlas.analyze_series(_corpus, _folder, db=db, name="toy", progress=False, **_without_model())
    assert steps.arrow.column("step").to_pylist() == checkpoint_steps(TINY.steps, TINY.checkpoints)
    with pytest.raises(ValueError, match="model"):
        headatlas.analyze_series(_corpus, _folder, db=db, model="random:tiny")
    atlas = headatlas.connect(db)
    assert len(atlas.trend("toy", "attn_to_prev", layer=0, head=0).arrow) == TINY.checkpoints
    assert atlas.phases("toy", metrics=["induction_score"], min_change=0).arrow.num_rows == TINY.layers * TINY.heads
    # the series analysed again from the command line: every checkpoint is found finished
    done = cli("analyze", str(_corpus), "--checkpoints", str(_folder), "--name", "toy", "--db", str(db), *ARGS)
    assert done.returncode == 0, done.stderr
    assert f"series toy: {TINY.checkpoints} checkpoints" in done.stdout
    assert "nothing to analyse" not in done.stdout and "query phases --series toy" in done.stdout
    done = cli("query", "trend", "--series", "nope", "--metric", "induction_score", "--db", str(db))
    assert done.returncode == 2 and "no such training series" in done.stderr and "'toy'" in done.stderr


def test_refusals_name_the_checkpoints_and_the_fix(toy, tmp_path, cli):
    from headatlas.service.operations.checkpoint_series import check_tokenizers, checkpoints_of
    from headatlas.service.training.toy import toy_tokenizer

    folder, corpus, _db = toy
    mixed = tmp_path / "mixed"
    for name in ("step-000000", "step-000002"):
        shutil.copytree(folder / name, mixed / name)
    toy_tokenizer(TINY.vocab + 5).save_pretrained(mixed / "step-000002")  # another vocabulary
    with pytest.raises(ParameterError, match=r"step-000002.*differs from that of .*step-000000"):
        check_tokenizers(checkpoints_of(str(mixed)))
    done = cli("analyze", str(corpus), "--checkpoints", str(mixed), "--db", str(tmp_path / "m.duckdb"))
    assert done.returncode == 2 and "tokenizer differs" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "m.duckdb").exists()
    # queued, the same refusal before anything reaches the broker (none listens at this port)
    done = cli("submit", str(corpus), "--checkpoints", str(mixed), "--broker", "redis://127.0.0.1:1/0")
    assert done.returncode == 2 and "tokenizer differs" in done.stderr and "Traceback" not in done.stderr

    nameless = tmp_path / "nameless"
    shutil.copytree(folder / "step-000000", nameless / "final")
    (nameless / "final" / "trainer_state.json").unlink()
    with pytest.raises(ParameterError, match="says no training step; name it step-N"):
        checkpoints_of(str(nameless))
    with pytest.raises(ParameterError, match="holds checkpoints already; pass a new folder"):
        train_toy(folder, TINY)  # nothing trained over a series
    with pytest.raises(ParameterError, match="names no checkpoint folders"):
        checkpoints_of(str(tmp_path / "nothing-*"))
    done = cli("analyze", str(corpus), "--checkpoints", str(folder), "--model", "random:tiny")
    assert done.returncode == 2 and "--checkpoints" in done.stderr
    done = cli("submit", str(corpus), "--checkpoints", str(folder), "--model", "random:tiny")
    assert done.returncode == 2 and "--checkpoints" in done.stderr and "Traceback" not in done.stderr
    # a glob of folders, and hub revisions (parsed here; fetched only where there is internet)
    assert [c.step for c in checkpoints_of(str(folder / "step-00000[12]"))] == [1, 2]
    hub = checkpoints_of("EleutherAI/pythia-70m@step3000,step1000")
    assert [(c.step, c.label) for c in hub] == [
        (1000, "EleutherAI/pythia-70m@step1000"),
        (3000, "EleutherAI/pythia-70m@step3000"),
    ]


def test_an_interrupted_series_resumes_where_it_stopped(toy, tmp_path, monkeypatch):
    """Stopped during its second checkpoint, the series analysed again finds the first finished
    (without analysing it again) and completes the rest."""
    from headatlas.service.operations import checkpoint_series
    from headatlas.service.operations.requests import AnalysisRequest
    from headatlas.service.storage.series_rows import steps

    folder, corpus, _db = toy
    two = tmp_path / "two"
    for name in ("step-000000", "step-000004"):
        shutil.copytree(folder / name, two / name)
    db = tmp_path / "r.duckdb"
    request = AnalysisRequest.build(corpus, db=db, name="r", **OPTIONS)
    real, calls = checkpoint_series.analyze, []

    def stopped(req, events):
        calls.append(req.model)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(req, events)

    monkeypatch.setattr(checkpoint_series, "analyze", stopped)
    with pytest.raises(KeyboardInterrupt):
        checkpoint_series.analyze_series(request, str(two))
    with _read(db) as conn:
        assert [s.step for s in steps(conn, "r")] == [0]
    monkeypatch.setattr(checkpoint_series, "analyze", real)
    done = checkpoint_series.analyze_series(request, str(two))
    assert [a.found_finished for _c, a in done.steps] == [True, False]
    with _read(db) as conn:
        assert [(s.step, s.status) for s in steps(conn, "r")] == [(0, "done"), (4, "done")]
        with pytest.raises(RunNotFound):
            steps(conn, "nope")


def test_a_series_on_a_lake_keeps_one_checkpoint_per_step(lake):
    """A lake has no sequences or keys: the series gets its id by hand, and a step stored again
    replaces its checkpoint rather than adding one."""
    from headatlas.service.storage.series_rows import add_step, ensure_series, list_series, series_id
    from headatlas.service.storage.store import Store

    store = Store(lake.url, data_path=lake.data_path)

    def record(conn):
        first = ensure_series(conn, "a", "ckpt/")
        assert ensure_series(conn, "a", "ckpt/") == first
        second = ensure_series(conn, "b", "other/")
        assert second == first + 1
        add_step(conn, first, 10, "ckpt/step-10", 1)
        add_step(conn, first, 10, "ckpt/step-10", 2)  # analysed again: the step names the new run
        return first

    first = store.atomically(record)
    with store.read() as conn:
        assert series_id(conn, "a") == first
        assert list_series(conn) == [("a", "ckpt/", 1), ("b", "other/", 0)]
        rows = conn.exec_driver_sql("SELECT step, run_id FROM series_runs").fetchall()
    assert rows == [(10, 2)]


@pytest.mark.integration
def test_a_queued_series_trends_as_the_embedded_one(toy, queue_cluster, tmp_path):
    """`submit --checkpoints` through the real queue: the writer records each checkpoint's run in
    the series as it opens it, `query trend --series` reads the values the embedded series holds
    for the same checkpoints, and submitting again queues nothing."""
    from conftest import invoke_cli

    from headatlas.service.reports.series_queries import trend
    from headatlas.service.storage.series_rows import steps

    folder, corpus, db = toy
    two = tmp_path / "two"
    for name in ("step-000000", "step-000004"):
        shutil.copytree(folder / name, two / name)
    args = ["submit", str(corpus), "--checkpoints", str(two), "--name", "queued-toy", *ARGS]
    done = invoke_cli(*args, "--wait", env=queue_cluster.env)
    assert done.returncode == 0, done.stderr
    run_ids = done.stdout.split()
    assert len(run_ids) == 2 and "checkpoint 2/2: step 4" in done.stderr
    for run_id in run_ids:
        assert queue_cluster.wait_status(run_id) == "done"
    with _read(queue_cluster.db) as conn:
        got = steps(conn, "queued-toy")
        assert [(s.step, s.run, s.status, s.run_id) for s in got] == [
            (0, "queued-toy-step0", "done", int(run_ids[0])),
            (4, "queued-toy-step4", "done", int(run_ids[1])),
        ]
        assert got[1].checkpoint == str((two / "step-000004").resolve())
        queued = {m: trend(conn, "queued-toy", metric=m, ci=True) for m in ("attn_induction", "attn_to_prev")}
    with _read(db) as conn:
        embedded = {m: trend(conn, "toy", metric=m, ci=True) for m in queued}
    for metric, (columns, rows) in queued.items():
        assert columns == embedded[metric][0]
        want = [r for r in embedded[metric][1] if r[0] in (0, 4)]
        assert len(rows) == len(want) == 2 * TINY.layers * TINY.heads
        for a, b in zip(rows, want, strict=True):
            assert (a[0], *a[2:4], a[-1]) == (b[0], *b[2:4], b[-1])
            assert a[4:-1] == pytest.approx(b[4:-1], rel=1e-5, abs=1e-7), (metric, a, b)

    # each checkpoint's probe is a task of its own, stored after its run is done (CI once asked
    # again before the first one's was in, and its probe was queued again): both stored first
    from queue_support import wait_for

    def probes_stored() -> int:
        with _read(queue_cluster.db) as conn:
            ids = ", ".join(run_ids)
            return conn.exec_driver_sql(
                f"SELECT count(DISTINCT run_id) FROM probe_scores WHERE run_id IN ({ids})"
            ).scalar_one()

    wait_for(lambda: probes_stored() == 2, queue_cluster, "both checkpoints' probes stored", timeout=120)
    again = invoke_cli(*args, env=queue_cluster.env)
    assert again.returncode == 0, again.stderr
    assert again.stdout.split() == run_ids and again.stderr.count("is already complete: nothing queued") == 2
    # the finished runs submitted as another series: nothing queued, the writer records them in it
    args[args.index("queued-toy")] = "queued-toy-again"
    again = invoke_cli(*args, env=queue_cluster.env)
    assert again.returncode == 0 and again.stdout.split() == run_ids, again.stderr
    deadline = time.monotonic() + 60
    while True:
        try:
            with _read(queue_cluster.db) as conn:
                recorded = [(s.step, s.run_id) for s in steps(conn, "queued-toy-again")]
        except RunNotFound:  # not yet
            recorded = []
        if len(recorded) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert recorded == [(0, int(run_ids[0])), (4, int(run_ids[1]))]
