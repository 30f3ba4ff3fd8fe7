"""Intervals that hold on real corpora (SPEC §5d): replicate groups by document, the t quantile,
coverage on clustered corpora, and every interval naming its scheme."""

from __future__ import annotations

import csv
import io
import json
import math

import numpy as np
import pytest

from headatlas.service.analysis_options import build_params
from headatlas.service.engine.results import (
    FALLBACK_BELOW,
    REPLICATES,
    block_group,
    document_group,
    replicate_group,
    window_group,
)
from headatlas.service.errors import ParameterError
from headatlas.service.params import AnalysisParams
from headatlas.service.reports.intervals import (
    incomplete_beta,
    interval_note,
    jackknife_halfwidth,
    scheme_of,
    t95,
    t_quantile,
)

# Known answers (SPEC §5b: the first 4 bytes of sha256, big-endian, mod 16), worked out with
# coreutils, not Python: printf '%s' KEY | sha256sum, the first 8 hex digits, mod 16.
GROUP_OF = {
    "w0": 1,  # 762036e1
    "abc": 15,  # ba7816bf
    "0123456789abcdef01234567": 8,  # 8865fea8
    "doc-A": 5,  # 51b35475
    "doc-A#0": 5,  # 0e424315
    "doc-A#1": 9,  # 170efc09
    "doc-A#2": 0,  # 9ec56330
    "d#5": 2,  # 55dc5c52
}


def _by_hand(key: str) -> int:
    return GROUP_OF[key]


# --- (a) the groups ---------------------------------------------------------------------------------


def test_document_scheme_puts_every_window_of_a_document_in_one_group():
    groups = {window_group("document", window_id=f"w{k}", doc_id="doc-A", index=k) for k in range(40)}
    assert groups == {_by_hand("doc-A")} == {document_group("doc-A")}
    # different documents spread over the groups
    spread = {document_group(f"doc-{k}") for k in range(200)}
    assert spread == set(range(REPLICATES))


def test_block_scheme_groups_consecutive_windows_of_one_document():
    groups = [window_group("block:4", window_id=f"w{k}", doc_id="doc-A", index=k) for k in range(12)]
    # windows 0-3 are block 0, 4-7 block 1, 8-11 block 2: each block hashed as "<doc>#<block>"
    assert groups == [_by_hand("doc-A#0")] * 4 + [_by_hand("doc-A#1")] * 4 + [_by_hand("doc-A#2")] * 4
    assert block_group("doc-A", 9, 4) == _by_hand("doc-A#2")
    assert window_group("block:1", window_id="x", doc_id="d", index=5) == _by_hand("d#5")


def test_window_scheme_is_the_old_rule():
    for wid in ("w0", "abc", "0123456789abcdef01234567"):
        assert window_group("window", window_id=wid, doc_id="same-doc", index=0) == replicate_group(wid)
        assert replicate_group(wid) == _by_hand(wid)


def test_replicates_option_is_parsed_checked_and_resolved():
    assert AnalysisParams().replicates == "document"  # the declared default
    assert build_params(replicates="Block:08").replicates == "block:8"  # one spelling, one run key
    for bad in ("block:0", "block:x", "block", "doc", "document:2", "window:1"):
        with pytest.raises(ParameterError, match="--replicates"):
            build_params(replicates=bad)
    params = build_params()
    assert FALLBACK_BELOW == 10
    assert params.resolved(9).replicates == "block:8"  # too few documents: blocks of 8 windows
    assert params.resolved(10).replicates == "document"
    assert params.resolved(5000).replicates == "document"
    assert build_params(replicates="block:3").resolved(1000).replicates == "block:3"  # asked for: kept
    assert build_params(replicates="window").resolved(3).replicates == "window"


def test_the_run_records_its_scheme_and_runs_stored_before_read_by_window():
    doc = build_params().to_dict()
    assert doc["replicates"] == "document"
    assert AnalysisParams.from_dict(doc).replicates == "document"
    # --replicates window records nothing: the parameters, and the run key, of the runs stored before
    window = build_params(replicates="window")
    assert "replicates" not in window.to_dict()
    old = {k: v for k, v in window.to_dict().items()}
    assert AnalysisParams.from_dict(old).replicates == "window"
    assert AnalysisParams.from_dict(old).key() == window.key()
    assert build_params().key() != window.key() != build_params(replicates="block:8").key()
    assert scheme_of(old) == "window" and scheme_of(None) == "window"
    assert scheme_of(doc) == "document" and scheme_of({"replicates": "block:8"}) == "block:8"


# --- (b) the t quantile --------------------------------------------------------------------------------


def test_incomplete_beta_known_values():
    assert incomplete_beta(1.0, 1.0, 0.3) == pytest.approx(0.3)  # uniform
    assert incomplete_beta(2.5, 2.5, 0.5) == pytest.approx(0.5)  # symmetric
    assert incomplete_beta(2.0, 1.0, 0.4) == pytest.approx(0.4**2)  # x^a for b = 1
    assert incomplete_beta(1.0, 3.0, 0.2) == pytest.approx(1 - 0.8**3)
    assert incomplete_beta(3.0, 4.0, 0.0) == 0.0 and incomplete_beta(3.0, 4.0, 1.0) == 1.0


@pytest.mark.parametrize(
    ("df", "expected"),
    [(1, 12.706), (2, 4.303), (3, 3.182), (5, 2.571), (10, 2.228), (15, 2.131), (30, 2.042), (60, 2.000)],
)
def test_t_quantile_against_textbook_tables(df, expected):
    assert t95(df) == pytest.approx(expected, abs=5e-4)
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=5e-4)


def test_t_quantile_other_levels_and_limits():
    assert t_quantile(0.95, 10) == pytest.approx(1.812, abs=5e-4)
    assert t_quantile(0.995, 15) == pytest.approx(2.947, abs=5e-4)
    assert t_quantile(0.5, 7) == pytest.approx(0.0, abs=1e-9)
    assert t_quantile(0.975, 1e6) == pytest.approx(1.95996, abs=1e-4)  # the normal beyond
    with pytest.raises(ValueError):
        t_quantile(1.0, 5)


def test_halfwidth_uses_t_of_the_groups_that_hold_windows():
    loo = [0.1, 0.3, 0.2, 0.4, 0.25]  # R = 5: t_4 = 2.776
    spread = math.sqrt(4 / 5 * sum((v - 0.25) ** 2 for v in loo))
    assert jackknife_halfwidth(loo) == pytest.approx(2.7764 * spread, rel=1e-4)


# --- (b) coverage on clustered corpora -----------------------------------------------------------------

A, B = 2.0, 8.0  # per-document rate ~ Beta(2, 8): the truth, the mean rate, is 0.2
TRUTH = A / (A + B)


def clustered_corpus(rng: np.random.Generator) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """One corpus like real text: 10-500 documents (log-uniform), 1-60 windows each, each
    document with its own rate; per window 20-200 high-similarity pairs, each "within sentence"
    with the document's rate. Returns (documents, windows per document, hits, pairs per window)."""
    documents = int(np.exp(rng.uniform(np.log(10), np.log(501))))
    windows = rng.integers(1, 61, size=documents)
    rate = rng.beta(A, B, size=documents)
    pairs = rng.integers(20, 201, size=int(windows.sum()))
    hits = rng.binomial(pairs, np.repeat(rate, windows))
    return documents, windows, hits, pairs


def interval_covers(hits: np.ndarray, pairs: np.ndarray, groups: np.ndarray) -> bool:
    """Whether the 95% jackknife interval of the ratio Σ hits / Σ pairs, over ``groups``, holds TRUTH."""
    group_hits = np.bincount(groups, hits, REPLICATES)
    group_pairs = np.bincount(groups, pairs, REPLICATES)
    held = group_pairs > 0
    theta = hits.sum() / pairs.sum()
    loo = (hits.sum() - group_hits[held]) / (pairs.sum() - group_pairs[held])
    half = jackknife_halfwidth(loo.tolist())
    return half is not None and abs(theta - TRUTH) <= half


def test_document_groups_cover_95_percent_on_clustered_corpora():
    """3000 corpora (seeded): the §5d interval holds the truth 93-97% of the time (binomial
    standard error of the share 0.4%)."""
    rng = np.random.default_rng(20261130)
    n, covered = 3000, 0
    for sim in range(n):
        documents, windows, hits, pairs = clustered_corpus(rng)
        # the scheme the run would use for this corpus: the default resolved for its documents
        assert build_params().resolved(documents).replicates == "document"
        doc_groups = np.array([document_group(f"c{sim}-d{d}") for d in range(documents)])
        covered += interval_covers(hits, pairs, np.repeat(doc_groups, windows))
    assert 0.93 <= covered / n <= 0.97, covered / n


LIFT = 1.3  # the true lift of the heavy-tailed corpora below


def heavy_tailed_lift_corpus(
    rng: np.random.Generator, *, rate_sigma: float = 1.0, lift_sigma: float = 0.8
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A lift's sums per document on a clustered corpus with few, heavy-tailed contributions per
    document (as attn_to_punct_lift on fiction: '.'/',' per window lognormal with σ = 1, dialogue
    against narration, and the head's lift in each document lognormal with σ = 0.8, mean 1):
    10-500 documents (log-uniform) of 1-60 windows, in their replicate groups (benchmarks/
    lift_intervals.py, kind `spec`; ``rate_sigma``/``lift_sigma`` 0.15/0.3: a well-behaved lift).
    Returns (observed, chance, group)."""
    documents = int(np.exp(rng.uniform(np.log(10), np.log(500))))
    windows = rng.integers(1, 61, size=documents)
    effect = rng.lognormal(-(lift_sigma**2) / 2, lift_sigma, size=documents)
    rate = rng.lognormal(np.log(12.0) - rate_sigma**2 / 2, rate_sigma, size=documents)
    chance = rng.poisson(rate * windows).astype(float)
    observed = chance * LIFT * effect * rng.lognormal(-0.02, 0.2, size=documents)
    return observed, chance, rng.integers(0, REPLICATES, size=documents)


def lift_interval(observed: np.ndarray, chance: np.ndarray, groups: np.ndarray) -> tuple[float, float, float, list]:
    """(value, lo, hi, leave-one-out lifts) of the lift Σ observed / Σ chance as ``add_intervals``
    gives it (query heads --ci)."""
    from headatlas.service.reports.intervals import add_intervals

    obs_g, chance_g = np.bincount(groups, observed, REPLICATES), np.bincount(groups, chance, REPLICATES)
    held = np.flatnonzero(np.bincount(groups, minlength=REPLICATES) > 0)
    value = observed.sum() / chance.sum()
    reps = [(0, int(g), (observed.sum() - obs_g[g]) / (chance.sum() - chance_g[g])) for g in held]
    _, rows = add_intervals(
        ["layer", "attn_to_punct_lift"], [(0, value)], reps, keys=["layer"], metrics=["attn_to_punct_lift"]
    )
    return rows[0][1], rows[0][2], rows[0][3], [r[2] for r in reps]


def lift_coverage(n: int, seed: int, **kind) -> tuple[float, float, float, float, float]:
    """Over ``n`` corpora with 8 or more groups holding windows: coverage of LIFT by the interval
    query heads --ci shows, by the log-scale jackknife with t_{R-1} (the rule before ``lift_df``)
    and by the linear jackknife; the median width over the value of the first and of the second."""
    rng = np.random.default_rng(seed)
    covered, before, linear, widths, widths_before, kept = 0, 0, 0, [], [], 0
    while kept < n:
        observed, chance, groups = heavy_tailed_lift_corpus(rng, **kind)
        if len(set(groups.tolist())) < 8 or chance.sum() == 0:
            continue
        value, lo, hi, loo = lift_interval(observed, chance, groups)
        if min(loo) <= 0:
            continue
        kept += 1
        assert 0 < lo <= value <= hi
        covered += lo <= LIFT <= hi
        half_log = jackknife_halfwidth(np.log(loo).tolist())
        before += abs(math.log(value / LIFT)) <= half_log
        linear += abs(value - LIFT) <= jackknife_halfwidth(loo)
        widths.append((hi - lo) / value)
        widths_before.append(2 * math.sinh(half_log))
    return covered / n, before / n, linear / n, float(np.median(widths)), float(np.median(widths_before))


def test_lift_intervals_hold_on_heavy_tailed_documents():
    """The failure found on fiction, reproduced: a lift whose documents contribute few, heavy-tailed
    sums, on 10-500 documents. The linear jackknife held the truth 90.1% of the time on these 1000
    corpora, the log one with t_{R-1} 91.6% (the misses mostly intervals wholly below the truth:
    corpora that drew none of the few heavy documents), and the log one with the degrees of freedom
    of ``lift_df`` (its t grows with the kurtosis of the leave-one-out log lifts) 93.3%, its median
    width 20% over the one before (seeded; binomial standard error 0.8%); every bound stays
    positive (benchmarks/lift_intervals.py)."""
    covered, before, linear, width, width_before = lift_coverage(1000, 20261203)
    assert before < 0.925 and linear < 0.91, (before, linear)  # the failure
    assert 0.93 <= covered <= 0.97, covered
    assert width < 1.25 * width_before, (width, width_before)


def test_well_behaved_lifts_are_not_made_conservative():
    """A lift whose documents differ little ('.'/',' per window σ = 0.15, as between wikipedia_dev's
    articles; the head's lift σ = 0.3): ``lift_df`` stays near R − 1 and the interval near the
    log-scale one with t_{R-1}: coverage within 93-97.5% (95.5% against 95.2% on these 600 corpora,
    seeded), median width at most 15% wider (4.8%)."""
    covered, before, _, width, width_before = lift_coverage(600, 20261204, rate_sigma=0.15, lift_sigma=0.3)
    assert 0.93 <= covered <= 0.975 and 0.93 <= before, (covered, before)
    assert width <= 1.15 * width_before, (width, width_before)


def test_lift_df_by_hand():
    """Normal-looking leave-one-out logs keep R − 1; one group standing apart lowers it; it is
    never below 1 nor above R − 1, and under 4 groups it is R − 1."""
    from headatlas.service.reports.intervals import lift_df

    assert lift_df([0.0, 1.0, 2.0]) == 2.0
    even = [-1.0, 1.0] * 8  # kurtosis 1: G2 < 0 counts as 0
    assert lift_df(even) == 15.0
    outlier = [0.0] * 15 + [1.0]  # g2 = 16·(15/16⁴ + (15/16)⁴)/(15/16)² − 3 = 11.07; G2 = 16.0
    g2 = 16 * (15 * (1 / 16) ** 4 + (15 / 16) ** 4) / (15 / 16 * (1 / 16) * 16) ** 2 - 3
    excess = (17 * g2 + 6) * 15 / (14 * 13)
    expected = 2 / (2 / 15 + excess / 16)
    assert lift_df(outlier) == pytest.approx(math.floor(expected / 0.05) * 0.05)
    assert 1.0 <= lift_df(outlier) < 2.0
    assert lift_df([0.0] * 16) == 15.0


def test_a_lift_interval_is_the_jackknife_of_its_log():
    """Known answer: leave-one-group-out lifts 1, 2, 4, 8 around a lift of 2 (logs 0, ln 2, 2 ln 2,
    3 ln 2): se of the log = sqrt(3/4 · ln²2 · (2.25 + 0.25 + 0.25 + 2.25)) = 1.3425, half-width
    t_3 · se = 3.1824 · 1.3425 = 4.2725, interval 2 · exp(∓4.2725) = [0.02788, 143.5]; a share
    keeps the linear jackknife."""
    from headatlas.service.reports.intervals import add_intervals

    loo = [1.0, 2.0, 4.0, 8.0]
    cols, rows = add_intervals(
        ["layer", "dup_lift", "noise_share"],
        [(0, 2.0, 0.5)],
        [(0, g, v, 0.45 + v / 100) for g, v in enumerate(loo)],
        keys=["layer"],
        metrics=["dup_lift", "noise_share"],
    )
    row = dict(zip(cols, rows[0]))
    half_log = 3.1824 * math.sqrt(0.75 * math.log(2) ** 2 * 5.0)
    assert row["dup_lift_lo"] == pytest.approx(2.0 * math.exp(-half_log), rel=1e-4)
    assert row["dup_lift_hi"] == pytest.approx(2.0 * math.exp(half_log), rel=1e-4)
    assert row["noise_share_lo"] == pytest.approx(0.5 - jackknife_halfwidth([0.45 + v / 100 for v in loo]))


def test_the_pivots_of_a_whole_column_are_each_cells_pivot_bit_for_bit():
    """``jackknife_pivots`` (what ``add_intervals`` computes a column's intervals with, every row
    at once) returns exactly ``jackknife_pivot`` of each cell: the same floats to the last bit,
    for 2-16 groups, lifts on the log scale and off it, and the cells without a pivot (a None
    value, a None, infinite or NaN leave-one-out value, fewer than 2 groups, a zero lift)."""
    from headatlas.service.reports.intervals import jackknife_pivot, jackknife_pivots

    rng = np.random.default_rng(7)
    cells: list[tuple[float | None, list[float | None]]] = []
    for r in [*range(0, 17), *rng.integers(2, 17, size=400).tolist()]:
        scale = 10.0 ** rng.integers(-6, 7)
        values: list[float | None] = (rng.lognormal(0.0, 1.5, size=r) * scale).tolist()
        cells.append((float(rng.lognormal(0.0, 1.0) * scale), values))
    cells += [
        (None, [1.0, 2.0, 3.0]),
        (1.0, [1.0, None, 3.0]),
        (1.0, [1.0, math.inf, 3.0]),
        (1.0, [1.0, math.nan, 3.0]),
        (0.0, [0.5, 1.0, 2.0, 4.0]),  # a zero lift: no log, the linear jackknife
        (2.0, [0.0, 1.0, 2.0, 4.0, 8.0]),  # a zero leave-one-out lift: linear too
        (-1.0, [-1.0, -2.0, -0.5, -1.5]),
        (3.0, [3.0] * 16),  # no spread: se 0, R − 1 degrees of freedom
        (7, [7, 6, 8, 7]),  # ints, as DuckDB returns counts
    ]
    for column in ("dup_lift", "noise_share", "within_sentence_lift_dm"):
        for log_lifts in (True, False):
            want = [jackknife_pivot(column, v, loo, log_lifts=log_lifts) if v is not None else None for v, loo in cells]
            got = jackknife_pivots(column, cells, log_lifts=log_lifts)
            assert [repr(p) for p in got] == [repr(p) for p in want], (column, log_lifts)
    assert sum(p is not None for p in jackknife_pivots("dup_lift", cells)) > 300  # most cells have one


def test_window_groups_fail_on_the_same_corpora():
    """The §5b rule on the same kind of corpora: windows of one document fall in different groups,
    the interval misses the between-document variation, and coverage is far below 95%."""
    rng = np.random.default_rng(20261130)
    n, covered = 300, 0
    for sim in range(n):
        documents, windows, hits, pairs = clustered_corpus(rng)
        groups = np.array([replicate_group(f"c{sim}-w{k}") for k in range(len(hits))])
        covered += interval_covers(hits, pairs, groups)
    assert covered / n < 0.5, covered / n


def test_blocks_do_not_hold_across_documents():
    """Why `document` falls back to blocks only below 10 documents (FALLBACK_BELOW), not below
    4·R = 64: on corpora of 10-63 documents, blocks of 8 windows split a document over several
    groups and cover far less than 95%, where the document rule (the first test) holds."""
    rng = np.random.default_rng(7)
    n, covered = 300, 0
    for sim in range(n):
        documents = int(rng.integers(10, 64))
        windows = rng.integers(1, 61, size=documents)
        rate = rng.beta(A, B, size=documents)
        pairs = rng.integers(20, 201, size=int(windows.sum()))
        hits = rng.binomial(pairs, np.repeat(rate, windows))
        groups = np.array([block_group(f"c{sim}-d{d}", k, 8) for d in range(documents) for k in range(int(windows[d]))])
        covered += interval_covers(hits, pairs, groups)
    assert covered / n < 0.8, covered / n


# --- (c) end to end on random:tiny --------------------------------------------------------------------


@pytest.fixture(scope="module")
def paragraphs_corpus(tmp_path_factory):
    """The shipped excerpt with every paragraph a document: enough documents for `document`."""
    from headatlas.service.engine.corpus import demo_corpus_path

    lines = [line.strip() for line in demo_corpus_path().read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(lines) >= FALLBACK_BELOW
    path = tmp_path_factory.mktemp("intervals") / "paragraphs.txt"
    path.write_text("\n\n".join(lines) + "\n", encoding="utf-8")
    return path, len(lines)


@pytest.mark.slow
def test_analyze_records_document_and_the_cli_says_it(cli, tmp_path, paragraphs_corpus):
    from sqlalchemy import text

    from headatlas.service.storage.store import Store

    corpus, documents = paragraphs_corpus
    db = tmp_path / "runs.duckdb"
    done = cli("analyze", str(corpus), "--model", "random:tiny", "--db", str(db), "--quiet")
    assert done.returncode == 0, done.stderr
    store = Store(db)
    with store.checked_read() as conn:
        run_id = conn.execute(text("SELECT max(run_id) FROM runs")).scalar()
        params = conn.execute(text("SELECT params FROM runs WHERE run_id = :r"), {"r": run_id}).scalar()
        params = json.loads(params) if isinstance(params, str) else params
        assert params["replicates"] == "document"
        # the stored groups are the documents' hashes, nothing else
        doc_ids = [
            r[0]
            for r in conn.execute(
                text("SELECT DISTINCT doc_id FROM run_windows JOIN windows USING (window_id) WHERE run_id = :r"),
                {"r": run_id},
            )
        ]
        groups = {
            r[0]
            for r in conn.execute(
                text("SELECT DISTINCT rep FROM head_stats WHERE run_id = :r AND rep IS NOT NULL"), {"r": run_id}
            )
        }
    assert len(doc_ids) == documents
    assert groups == {document_group(d) for d in doc_ids}

    as_json = cli("query", "heads", "--ci", "--format", "json", "--db", str(db))
    assert as_json.returncode == 0, as_json.stderr
    rows = json.loads(as_json.stdout)
    assert rows and all(r["interval_by"] == "document" for r in rows)
    assert all(r["within_sentence_lo"] <= r["within_sentence"] <= r["within_sentence_hi"] for r in rows)
    as_csv = cli("query", "layers", "--ci", "--format", "csv", "--db", str(db))
    assert as_csv.returncode == 0, as_csv.stderr
    layer_rows = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert layer_rows and {r["interval_by"] for r in layer_rows} == {"document"}
    table = cli("query", "layers", "--ci", "--db", str(db))
    assert table.returncode == 0, table.stderr
    assert f"{len(groups)} replicate groups by document" in table.stdout and "t quantile" in table.stdout
    assert "interval_by" not in table.stdout  # named in the note, not a column
    roles = cli("query", "roles", "--format", "json", "--db", str(db))
    assert roles.returncode == 0, roles.stderr
    assert {r["interval_by"] for r in json.loads(roles.stdout)} == {"document"}


def test_few_documents_fall_back_to_blocks_and_window_runs_say_so(tmp_path, tiny_model, demo_corpus):
    from headatlas.service.reports import compare, layer_queries, query_support
    from headatlas.service.storage.store import Store
    from tests.figure_checks import analyse, corpus_of

    small = corpus_of(demo_corpus, tmp_path, slice(0, 2), "two")  # 2 documents < 10
    db = tmp_path / "runs.duckdb"
    blocks = analyse(small, db, tiny_model, name="blocks")
    window = analyse(small, db, tiny_model, name="window", replicates="window")
    assert blocks.params["replicates"] == "block:8"
    assert "replicates" not in window.params  # as runs stored before SPEC §5d
    with Store(db).checked_read() as conn:
        assert query_support.replicate_scheme(conn, blocks.run_id) == "block:8"
        assert query_support.replicate_scheme(conn, window.run_id) == "window"
        columns, rows = layer_queries.layers(conn, window.run_id, ci=True)
        assert {r[columns.index("interval_by")] for r in rows} == {"window"}
        # the same windows under two schemes: groups do not pair, so the difference is independent
        assert compare.same_windows(conn, blocks.run_id, window.run_id)
        columns, rows = compare.compare(conn, blocks, window, metrics=["mean_distance"])
        data = [dict(zip(columns, r)) for r in rows]
        assert {d["interval"] for d in data} == {"independent"}
        assert {d["interval_by"] for d in data} == {"block:8 / window"}
        columns, rows = compare.compare(conn, blocks, blocks, metrics=["mean_distance"])
        assert {dict(zip(columns, r))["interval"] for r in rows} == {"paired"}
    note = interval_note(["window"])
    assert "by window" in note and "too narrow" in note
    assert "by block of 8 consecutive windows" in interval_note(["block:8"])


def test_a_worker_computes_the_groups_of_the_embedded_engine(tiny_model, paragraphs_corpus):
    """The batch message carries the resolved scheme in its params and each window's document id
    and index: a worker's result has the groups the embedded engine gives."""
    import base64

    from headatlas.service.engine.analysis import analyze_batch
    from headatlas.service.engine.results import BatchResult
    from headatlas.service.engine.run_plan import iter_batches
    from headatlas.service.engine.windows import TokenClasses
    from headatlas.workers.submit import batch_payloads
    from headatlas.workers.tasks import _analyse

    corpus, documents = paragraphs_corpus
    params = build_params(sentences="punct").resolved(documents)
    tokens = TokenClasses.from_tokenizer(tiny_model.tokenizer)
    embedded = next(iter_batches(str(corpus), tiny_model, params, tokens, batch_size=16))[0]
    expected = analyze_batch(tiny_model, embedded, params, tokens).reps.tolist()
    assert expected == sorted({document_group(w.doc_id) for w in embedded.windows})
    _, _, payload = next(
        batch_payloads(
            str(corpus), tiny_model, params, model="random:tiny", dtype="float32", batch_size=16, database_id="x"
        )
    )
    assert payload["params"]["replicates"] == "document"
    worker = BatchResult.from_bytes(base64.b64decode(_analyse(tiny_model, payload)))
    assert worker.reps.tolist() == expected


# --- (d) bounds and few groups -------------------------------------------------------------------------


def test_each_bound_metric_declares_its_range():
    from headatlas.service.metrics import COLUMNS
    from headatlas.service.reports.intervals import bounds_of

    declared = {c.name: c.bounds for c in COLUMNS if c.interval}
    for name, bounds in declared.items():
        if name.endswith(("_lift", "_lift_dm")):
            assert bounds == (0.0, None), name
        elif name.endswith("_share") or name in ("within_sentence", "repetition", "repetition_words"):
            assert bounds == (0.0, 1.0), name
    assert bounds_of("mean_distance") == (1.0, None)  # j − i ≥ 1
    assert bounds_of("attn_entropy") == (0.0, None)
    assert bounds_of("sim_mean_high") == (None, None)  # a dot product: either sign
    # the distance profiles' columns, declared nowhere, go by their names
    assert bounds_of("attended_share") == (0.0, 1.0) and bounds_of("noise_lift") == (0.0, None)


def test_a_share_interval_below_zero_is_clipped_and_says_so():
    from headatlas.service.reports.intervals import CLIP_NOTE, add_intervals, clip_interval

    # the reported case: anchor_frequency_share 0.1667 [-0.034, 0.367] with 12 windows
    assert clip_interval("anchor_frequency_share", -0.034, 0.367) == (0.0, 0.367)
    assert clip_interval("noise_share", 0.9, 1.2) == (0.9, 1.0)
    assert clip_interval("within_sentence_lift_dm", -0.2, 2.5) == (0.0, 2.5)
    assert clip_interval("mean_distance", 0.5, 9.0) == (1.0, 9.0)
    assert clip_interval("sim_mean_all", -3.0, 2.0) == (-3.0, 2.0)
    # leave-one-group-out values 0, 0, 0, 0.6 around a share of 0.15: half-width
    # t_3 · sqrt(3/4 · (3 · 0.15² + 0.45²)) = 3.1824 · 0.4500 = 1.432 → [-1.28, 1.58] before clipping
    loo = [0.0, 0.0, 0.0, 0.6]
    rows = [(0, 0.15, 0.15)]
    reps = [(0, g, v, v) for g, v in enumerate(loo)]
    cols, clipped = add_intervals(
        ["layer", "noise_share", "dup_lift"], rows, reps, keys=["layer"], metrics=["noise_share", "dup_lift"]
    )
    row = dict(zip(cols, clipped[0]))
    half = 3.1824 * math.sqrt(0.75 * (3 * 0.15**2 + 0.45**2))
    assert (row["noise_share_lo"], row["noise_share_hi"]) == (0.0, 1.0)
    assert row["dup_lift_lo"] == 0.0 and row["dup_lift_hi"] == pytest.approx(0.15 + half, rel=1e-4)
    _, raw = add_intervals(
        ["layer", "noise_share"],
        [(0, 0.15)],
        [(0, g, v) for g, v in enumerate(loo)],
        keys=["layer"],
        metrics=["noise_share"],
        clip=False,
    )
    assert raw[0][2] == pytest.approx(0.15 - half, rel=1e-4) and raw[0][2] < 0  # the tests' symmetric interval
    assert CLIP_NOTE in interval_note(["document"]) and "[0, 1]" in CLIP_NOTE


def test_few_groups_are_flagged():
    from headatlas.service.reports.intervals import MIN_GROUPS, unreliable_note

    note = unreliable_note(3, 12)
    assert note is not None and "only 3 of 16 replicate groups" in note and "12 windows" in note
    assert unreliable_note(MIN_GROUPS - 1, 400) is not None
    assert unreliable_note(MIN_GROUPS, 400) is None
    assert unreliable_note(0, 12) is None  # stored before groups existed: no interval to flag


def test_a_short_run_warns_and_keeps_its_intervals_in_range(tmp_path, tiny_model, demo_corpus):
    from typer.testing import CliRunner

    from headatlas.cli.main import app
    from headatlas.service.reports import queries, query_support
    from headatlas.service.reports.intervals import bounds_of
    from headatlas.service.storage.store import Store
    from tests.figure_checks import analyse, corpus_of

    small = corpus_of(demo_corpus, tmp_path, slice(0, 2), "two")  # 2 documents: block:8, few groups
    db = tmp_path / "short.duckdb"
    run = analyse(small, db, tiny_model, name="short", seq_len=64)
    with Store(db).checked_read() as conn:
        groups, windows = query_support.interval_groups(conn, run.run_id)
        assert 2 <= groups < 8 and windows > groups
        assert "intervals unreliable" in (query_support.interval_warning(conn, run.run_id) or "")
        columns, rows = queries.heads(conn, run.run_id, ci=True)
        _, raw_rows = queries.heads(conn, run.run_id, ci=True, clip=False)
    data, raw = [dict(zip(columns, r)) for r in rows], [dict(zip(columns, r)) for r in raw_rows]
    bounded = [c for c in columns if c.endswith("_lo") and bounds_of(c[:-3]) != (None, None)]
    assert bounded
    # some raw interval leaves its metric's range (this short run's intervals are wide) …
    assert any(r[c] is not None and r[c] < bounds_of(c[:-3])[0] for r in raw for c in bounded)
    # … none once clipped, and every value stays inside its interval
    for row in data:
        for lo in bounded:
            name, (low, high) = lo[:-3], bounds_of(lo[:-3])
            if row[lo] is None:
                continue
            assert low <= row[lo] <= row[name] <= row[f"{name}_hi"], name
            assert high is None or row[f"{name}_hi"] <= high, name
    out = CliRunner().invoke(app, ["query", "layers", "--ci", "--db", str(db)], env={"COLUMNS": "300"})
    assert out.exit_code == 0, out.output
    assert "warning: run" in out.stderr and "intervals unreliable" in out.stderr
    assert "bounds clipped" in out.stdout
    plain = CliRunner().invoke(app, ["query", "layers", "--db", str(db)], env={"COLUMNS": "300"})
    assert plain.exit_code == 0 and "unreliable" not in plain.stderr  # no intervals, no warning


def test_the_footnote_counts_the_groups_that_hold_windows():
    """R of the interval is the number of groups holding windows: the footnote says that number,
    not always 16, and where the count is not at hand it says what R is."""
    from headatlas.service.reports.intervals import interval_note
    from headatlas.service.reports.plots import interval_caption

    assert "over 5 replicate groups by document" in interval_note(["document"], [5])
    assert "over 16 replicate groups by document" in interval_note(["document"], [16])
    assert "over 12 / 16 replicate groups" in interval_note(["document"], [12, 16])
    assert "over the replicate groups holding windows (at most 16)" in interval_note(["document"])
    caption = interval_caption((["layer", "interval_by"], [(0, "document")]), groups=[7])
    assert "over 7 replicate groups by document" in caption
