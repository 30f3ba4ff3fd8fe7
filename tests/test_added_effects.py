"""Causal effects added to a finished run (SPEC §9): `headatlas effects RUN`, `run.add_effects()`,
and `analyze --effects` on a corpus whose run without effects is stored. The effects stored equal
those `analyze --effects` stores in one pass (values and intervals), no other statistic of the run
changes, an interrupted measurement resumes exactly, and what cannot be added is refused saying why."""

from __future__ import annotations

import math

import pytest
from sqlalchemy import text

from headatlas.service.metrics import EFFECT_COLUMNS, EFFECT_SUMS
from headatlas.service.storage.store import Store

# a small encoder (embedding drift): a decoder's next-token loss costs a vocabulary's softmax per
# ablated copy, and the added effects are the same code whatever the objective
MODEL = ["--model", "random:tiny", "--seq-len", "32", "--sentences", "punct", "--replicates", "window"]
KINDS = ["--effects", "zero,mean"]
NOT_ASKED = frozenset(
    (*EFFECT_SUMS["atp"], *EFFECT_SUMS["gradient"])
)  # kinds these runs do not measure: unavailable in both


def _metrics(db: str, run_id: int) -> list[dict]:
    with Store(db).read() as conn:
        rows = conn.execute(
            text("SELECT * FROM head_metrics WHERE run_id = :r ORDER BY layer, head"), {"r": run_id}
        ).mappings()
        return [dict(r) for r in rows]


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, demo_corpus):
    folder = tmp_path_factory.mktemp("added")
    path = folder / "corpus.txt"
    docs = [d.strip() for d in demo_corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()][:3]
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def in_one_pass(corpus, tmp_path_factory):
    """The same corpus analysed with its effects in one pass (`analyze --effects`): (db, run id)."""
    from conftest import invoke_cli

    db = str(tmp_path_factory.mktemp("one_pass") / "one.duckdb")
    done = invoke_cli("analyze", str(corpus), *MODEL, *KINDS, "--effect-windows", "6", "--db", db, "-q")
    assert done.returncode == 0, done.stderr
    return db, int(done.stdout.split()[-1])


def test_effects_added_to_a_run_equal_those_analyze_stores_and_change_nothing_else(corpus, in_one_pass, tmp_path, cli):
    db = str(tmp_path / "added.duckdb")
    done = cli("analyze", str(corpus), *MODEL, "--db", db, "-q", "--name", "plain")
    assert done.returncode == 0, done.stderr
    before = _metrics(db, 1)
    assert all(r["effect_zero"] is None for r in before)

    # in two steps: 4 windows, then 6 (the first 4 not measured again)
    first = cli("effects", "plain", *KINDS, "--windows", "4", "--db", db)
    assert first.returncode == 0, first.stderr
    assert "4 windows measured now, 4 stored in all" in " ".join(first.stderr.split())
    more = cli("effects", "plain", *KINDS, "--windows", "6", "--db", db, "--format", "json")
    assert more.returncode == 0, more.stderr
    assert "2 windows measured now, 6 stored in all" in " ".join(more.stderr.split())
    again = cli("effects", "1", *KINDS, "--windows", "6", "--db", db, "--format", "csv")
    assert again.returncode == 0 and "0 windows measured now, 6 stored in all" in " ".join(again.stderr.split())

    after, one_db_rows = _metrics(db, 1), _metrics(*in_one_pass)
    assert len(after) == len(before) == len(one_db_rows) > 0
    for was, now, want in zip(before, after, one_db_rows):
        for column, value in now.items():
            if column in NOT_ASKED:
                assert value is None and want[column] is None, column
            elif column in EFFECT_COLUMNS:
                assert value is not None and _close(value, want[column]), (column, now["layer"], now["head"])
            elif column != "run_id":
                assert _close(value, was[column]), (column, value, was[column])  # nothing else changed

    # the intervals too: the effects rest on the same replicate groups as in one pass
    import headatlas

    added = headatlas.connect(db).run(1).effects(ci=True)
    single = headatlas.connect(in_one_pass[0]).run(in_one_pass[1]).effects(ci=True)
    rows, want = added.to_pylist(), single.to_pylist()
    assert len(rows) == len(want) > 0 and rows[0].keys() == want[0].keys()
    assert "effect_mean_lo" in rows[0] and all(r["effect_mean_lo"] is not None for r in rows)
    for a, b in zip(rows, want):
        assert all(_close(a[k], b[k]) for k in a), (a, b)
    with Store(db).read() as conn:  # the run records its effects as analyze does, under its own key
        run = Store(db).get_run(1)
        assert run.params["effects"] == ["zero", "mean"] and run.params["effect_windows"] == 6
        assert conn.execute(text("SELECT count(*) FROM run_effects WHERE run_id = 1")).scalar() == 1
    assert Store(db).get_run(1).run_key == Store(db).get_run("plain").run_key


def test_analyze_effects_on_a_stored_run_adds_them_there(corpus, in_one_pass, tmp_path, cli):
    db = str(tmp_path / "analyze.duckdb")
    assert cli("analyze", str(corpus), *MODEL, "--db", db, "-q").returncode == 0
    done = cli("analyze", str(corpus), *MODEL, *KINDS, "--effect-windows", "6", "--db", db)
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stderr.split())
    assert "holds this analysis without effects: --effects zero,mean adds them to it" in said
    with Store(db).read() as conn:
        assert conn.execute(text("SELECT count(*) FROM runs")).scalar() == 1  # no second run
    for now, want in zip(_metrics(db, 1), _metrics(*in_one_pass)):
        assert all(_close(now[c], want[c]) for c in EFFECT_COLUMNS)
    roles = cli("query", "roles", "--db", db, "--format", "csv")  # stored results current, no db upgrade
    assert roles.returncode == 0 and "effect" in roles.stdout.splitlines()[0], roles.stdout[:300]


def test_what_cannot_be_added_is_refused_saying_why(corpus, tmp_path, cli):
    db = str(tmp_path / "refused.duckdb")
    assert cli("analyze", str(corpus), *MODEL, "--db", db, "-q", "--control", "1").returncode == 0
    assert cli("effects", "1", "--effects", "zero", "--windows", "2", "--db", db).returncode == 0
    other = cli("effects", "1", "--effects", "zero,mean", "--windows", "2", "--db", db)
    assert other.returncode != 0
    assert "holds effects zero on 2 windows" in " ".join(other.stderr.split())
    control = cli("effects", "2", "--db", db)
    assert control.returncode != 0 and "random-weights control" in control.stderr
    neither = cli("effects", "nothing-here", "--db", db)
    assert neither.returncode != 0 and "no such corpus" in neither.stderr and "no run of that" in neither.stderr
    with Store(db).read() as conn:  # the refusals stored nothing
        assert conn.execute(text("SELECT count(*) FROM run_effects")).scalar() == 1


def test_an_interrupted_measurement_resumes_the_windows_not_stored(corpus, in_one_pass, tmp_path, cli, monkeypatch):
    from headatlas.service.measures import effect_batch
    from headatlas.service.operations.added_effects import add
    from headatlas.service.operations.requests import AddEffectsRequest

    db = str(tmp_path / "resume.duckdb")
    assert cli("analyze", str(corpus), *MODEL, "--db", db, "-q").returncode == 0
    store = Store(db)
    real, calls = effect_batch.window_effects, []

    def stop_at_the_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(effect_batch, "window_effects", stop_at_the_third)
    request = AddEffectsRequest.build(1, kinds="zero,mean", windows=6)
    with pytest.raises(KeyboardInterrupt):
        add(store, request)
    monkeypatch.setattr(effect_batch, "window_effects", real)
    resumed = add(store, request)
    assert resumed.measured == 4 and resumed.windows == 6  # the two stored before the stop are kept
    for now, want in zip(_metrics(db, 1), _metrics(*in_one_pass)):
        assert all(_close(now[c], want[c]) for c in EFFECT_COLUMNS)


def test_more_windows_for_a_run_analysed_with_effects_measure_only_the_new_ones(corpus, in_one_pass, tmp_path, cli):
    """A run whose analysis measured its first 4 windows' effects, asked for 6: the 2 new ones are
    measured (the 4 are not measured again and counted twice), and the run equals the 6-window one."""
    db = str(tmp_path / "grown.duckdb")
    assert cli("analyze", str(corpus), *MODEL, *KINDS, "--effect-windows", "4", "--db", db, "-q").returncode == 0
    grown = cli("effects", "1", *KINDS, "--windows", "6", "--db", db)
    assert grown.returncode == 0, grown.stderr
    assert "2 windows measured now, 6 stored in all" in " ".join(grown.stderr.split())
    for now, want in zip(_metrics(db, 1), _metrics(*in_one_pass)):
        assert all(_close(now[c], want[c]) for c in EFFECT_COLUMNS if c in want), now
    again = cli("effects", "1", *KINDS, "--windows", "6", "--db", db)
    assert "0 windows measured now, 6 stored in all" in " ".join(again.stderr.split())
