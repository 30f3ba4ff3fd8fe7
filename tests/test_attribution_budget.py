"""`analyze --attribution` within a budget: it says its estimated time and memory before it starts,
takes a small default number of windows (``--attribution-windows``),
attributes them one per batch on a CPU, and stops on Ctrl-C keeping every finished window."""

from __future__ import annotations

import re
import signal
import time

import pytest
from typer.testing import CliRunner

from headatlas.cli.main import app
from headatlas.service.analysis_options import ATTRIBUTION_WINDOWS, MIXING_WINDOWS, build_params
from headatlas.service.storage.store import Store

WIDE = {"COLUMNS": "300", "TERMINAL_WIDTH": "300", "NO_COLOR": "1"}


def _batch_sizes(db: str, run_id: int) -> list[int]:
    with Store(db).read() as conn:
        from sqlalchemy import text

        return [
            r[0]
            for r in conn.execute(
                text("SELECT n_windows FROM batches WHERE run_id = :r ORDER BY batch_id"), {"r": run_id}
            )
        ]


def _window_lengths(db: str, run_id: int) -> list[int]:
    with Store(db).read() as conn:
        from sqlalchemy import text

        return [
            r[0]
            for r in conn.execute(
                text(
                    "SELECT n_tokens FROM windows JOIN run_windows USING (window_id) WHERE run_id = :r ORDER BY batch_id"
                ),
                {"r": run_id},
            )
        ]


def test_the_default_window_count_depends_on_what_is_computed():
    assert build_params(attribution=True).attribution_windows == ATTRIBUTION_WINDOWS
    assert build_params(mixing=["norm"]).attribution_windows == MIXING_WINDOWS
    assert build_params(attribution=True, attribution_windows=7).attribution_windows == 7
    # keyed as resolved: the default and the same number given are one run
    assert build_params(attribution=True).key() == build_params(attribution=True, attribution_windows=2).key()


def test_analyze_attribution_says_its_estimate_first_and_attributes_few_windows_one_by_one(tmp_path, demo_corpus):
    db = str(tmp_path / "a.duckdb")
    corpus = tmp_path / "short.txt"  # a few windows
    corpus.write_text(demo_corpus.read_text(encoding="utf-8")[:700], encoding="utf-8")
    args = ["analyze", str(corpus), "--db", db, "--model", "random:tiny", "--seq-len", "32", "--attribution"]
    result = CliRunner().invoke(app, args, env=WIDE)
    assert result.exit_code == 0, result.output
    err = " ".join(result.stderr.split())
    found = re.search(
        r"attribution: (\d+) windows? of up to (\d+) tokens, ([\d,]+) backward passes: about (under 1 s|\d+ s|\d+ min \d+ s) "
        r"and (\d+ MB|[\d.]+ GB) above the model",
        err,
    )
    assert found, err
    assert err.index("attribution:") < err.index("analysing")  # said before it starts
    assert "Ctrl-C stops it" in err and "--attribution-windows N" in err
    run = Store(db).get_run(None)
    assert Store(db).mixing_windows(run.run_id) == ATTRIBUTION_WINDOWS == int(found.group(1))
    # the passes counted are the ones the run needs: layers × (heads + layer row) × tokens
    lengths = _window_lengths(db, run.run_id)[:ATTRIBUTION_WINDOWS]
    assert int(found.group(3).replace(",", "")) == 2 * (4 + 1) * sum(lengths)
    assert int(found.group(2)) == max(lengths)
    # on a CPU the attributed windows go one per batch (each stored once finished), the rest together
    sizes = _batch_sizes(db, run.run_id)
    assert sizes[:ATTRIBUTION_WINDOWS] == [1] * ATTRIBUTION_WINDOWS and sum(sizes) > ATTRIBUTION_WINDOWS + 1
    assert max(sizes[ATTRIBUTION_WINDOWS:]) > 1

    more = CliRunner().invoke(app, [*args, "--attribution-windows", "3", "-q"], env=WIDE)
    assert more.exit_code == 0, more.output
    again = Store(db).get_run(int(more.stdout.split()[-1]))
    assert again.run_id != run.run_id and Store(db).mixing_windows(again.run_id) == 3


def test_the_estimate_counts_the_passes_and_bounds_memory_by_the_shape(tiny_model):
    import torch

    from headatlas.service.measures.attribution import estimate, working_set

    ids = torch.randint(1000, 2000, (1, 16))
    cost = estimate(tiny_model, ids, [16, 9, 12])
    assert cost.passes == tiny_model.n_layers * (tiny_model.n_heads + 1) * (16 + 9 + 12)
    assert cost.windows == 3 and cost.longest == 16
    assert 6 <= cost.timed <= 40  # 3 to 20 passes at the first and the last layer
    assert cost.seconds > 0 and cost.memory_bytes >= working_set(tiny_model, 16)
    assert f"{cost.passes:,} backward passes" in cost.describe()


@pytest.mark.slow
def test_ctrl_c_stops_attribution_at_once_keeping_finished_windows(tmp_path, demo_corpus, request):
    """A real SIGINT to a real `analyze --attribution` once some windows are stored: it exits 130
    promptly, the run is interrupted, and the windows it had finished are kept whole."""
    from queue_support import assert_whole_batches, fork_cli

    db = tmp_path / "c.duckdb"
    # the command forked from the tests' launcher, its imports done (tests/queue_support.py)
    process = fork_cli(
        "analyze", str(demo_corpus), "--db", str(db), "--model", "random:tiny", "--seq-len", "64",
        "--attribution", "--attribution-windows", "500",
        env={"HEADATLAS_STORE_EVERY_S": "1"},  # stores soon: less to wait for
    )  # fmt: skip
    # a failed wait below must not leave it attributing 500 windows beside the rest of the suite
    request.addfinalizer(lambda: process.poll() is None and (process.kill(), process.wait()))
    stored, deadline = 0, time.monotonic() + 180
    while stored == 0:  # the first windows stored (finished batches are stored every second here)
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.5)
        try:
            stored = Store(str(db)).mixing_windows(1)
        except Exception:  # noqa: BLE001 - not created yet, or the run holds the file right now
            stored = 0
    time.sleep(1.0)
    process.send_signal(signal.SIGINT)
    sent = time.monotonic()
    _out, err = process.communicate(timeout=60)
    stopped_after = time.monotonic() - sent
    assert process.returncode == 130, err
    assert "interrupted; re-run the same command to resume" in err and "Traceback" not in err
    run = Store(str(db)).get_run(1)
    assert run.status == "interrupted"
    kept = Store(str(db)).mixing_windows(1)
    assert stored <= kept < 500
    with Store(str(db)).read() as conn:
        from sqlalchemy import text

        done = conn.execute(text("SELECT count(*) FROM batches WHERE run_id = 1 AND status = 'done'")).scalar()
        assert_whole_batches(conn, 1, done, 2 * 4)
    assert stopped_after < 10, f"{stopped_after:.1f} s"  # while a pass of the old batched code took minutes
    print(f"\nCtrl-C during attribution: exited after {stopped_after:.2f} s, {kept} attributed windows kept")


def test_analyze_effects_estimate_counts_the_reference_windows_the_corpus_has(tmp_path, demo_corpus):
    """The reference means of mean ablation are over the corpus's first ``--effect-reference``
    windows, fewer where it has fewer: the estimate said before the run counts those it will use
    (it once multiplied by 256 on a corpus of 6 windows), and the run records as many."""
    from headatlas.service.storage.effect_rows import run_effects

    db = str(tmp_path / "e.duckdb")
    corpus = tmp_path / "short.txt"
    corpus.write_text(demo_corpus.read_text(encoding="utf-8")[:700], encoding="utf-8")
    args = ["analyze", str(corpus), "--db", db, "--model", "random:tiny", "--seq-len", "32"]
    result = CliRunner().invoke(app, [*args, "--effects", "zero,mean", "--effect-windows", "2"], env=WIDE)
    assert result.exit_code == 0, result.output
    err = " ".join(result.stderr.split())
    found = re.search(
        r"effects \(zero, mean\): 2 windows of up to \d+ tokens: (?:about .*?|under 1 s), the reference means \((\d+) windows?\)",
        err,
    )
    assert found, err
    run = Store(db).get_run(None)
    with Store(db).read() as conn:
        (recorded,) = run_effects(conn, run.run_id)
        windows = conn.exec_driver_sql(f"SELECT count(*) FROM run_windows WHERE run_id = {run.run_id}").scalar()
    assert 2 < windows < 256  # a corpus shorter than the default reference set
    assert int(found.group(1)) == recorded["reference_windows"] == windows
