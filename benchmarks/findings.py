"""Every figure of README.md ("What the numbers say", the example table) and docs/findings.md, from
one run of this script.

    python benchmarks/findings.py [--corpus PATH] [--max-docs N] [--max-chars N] [--decoder]
                                  [--out docs/findings-output.md] [--db build/findings.duckdb]

``make findings`` runs it with the defaults. Corpus: the shipped excerpt (service/data/wiki_excerpt.txt)
unless ``--corpus`` names another .txt corpus of documents separated by blank lines (for instance
../shared/corpora/wikipedia_dev.txt), cut to its first ``--max-docs`` documents and ``--max-chars``
characters. Analyses, all with default options unless named, into a fresh database:

- the default model with ``--control 3`` (random-weights controls, seeds 0, 1, 2);
- the default model with ``--sentences punct`` (the earlier sentence rule);
- the default model on each half of the documents (even / odd), for the baselines of ``compare``;
- with ``--decoder``: ``--model smollm2`` on the same corpus with ``--probe`` and ``--control 1``.

Then the figures, as markdown, to stdout and to ``--out``, and into docs/findings.md where it holds
a block ``<!-- begin PATH -->`` … ``<!-- end PATH -->`` for that file (the prose around it is written
by hand from it). Each head count names its rule: "value
above X" counts heads whose estimate is above X, "lower bound above X" those whose 95% interval
lies wholly above X. Roles are ``query roles --stability`` (SPEC §7). tests/test_findings_docs.py
checks that the figures in README.md and docs/findings.md are the ones in ``--out``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine  # noqa: E402

MODEL_NAME = "all-MiniLM-L6-v2"
FINDINGS_PAGE = ROOT / "docs" / "findings.md"  # holds the output verbatim (tests/test_findings_docs.py)
MAIN, PUNCT, HALF_A, HALF_B, DECODER = "findings", "findings-punct", "half-a", "half-b", "smollm2"
# one analysis option changed at a time (name, options): how far the lifts and roles move
VARIANTS = (
    ("findings-select5", ("--select", "top:0.05")),
    ("findings-gate8", ("--gate", "8")),
    ("findings-seq64", ("--seq-len", "64")),
)
ROLE_METRICS = {  # role → (metric, scale in the run's context), as service/reports/role_rules.py reads them
    "previous-token": ("attn_to_prev", None),
    "next-token": ("attn_to_next", None),
    "repetition": ("repetition_words_lift_dm", None),
    "sentence-bound": ("within_sentence_lift_dm", None),
    "punctuation": ("attn_to_punct_lift", None),
    "local": ("short_range_share", "short_range_chance"),
    "[CLS] sink": ("attn_to_cls_lift", None),
}


def prepare_corpus(source: Path, max_docs: int, max_chars: int, out: Path, doc_chars: int = 0) -> tuple[Path, int]:
    """``source`` cut to its first ``max_docs`` documents and about ``max_chars`` characters, each
    document to its leading paragraphs while under ``doc_chars`` characters (0: no cap), as a .txt
    corpus; with no cap, ``source`` itself. Returns the path and its documents."""
    docs = [d.strip() for d in source.read_text(encoding="utf-8").split("\n\n") if d.strip()]
    if not max_docs and not max_chars and not doc_chars:
        return source, len(docs)
    if doc_chars:
        cut = []
        for doc in docs:
            kept: list[str] = []
            for paragraph in doc.split("\n"):
                if kept and sum(len(p) for p in kept) >= doc_chars:
                    break
                kept.append(paragraph)
            cut.append("\n".join(kept))
        docs = cut
    kept, size = [], 0
    for doc in docs[: max_docs or None]:
        if max_chars and kept and size + len(doc) > max_chars:
            break
        kept.append(doc)
        size += len(doc)
    out.write_text("\n\n".join(kept) + "\n", encoding="utf-8")
    return out, len(kept)


def cli(*args: str) -> str:
    """One headatlas command in a child process (this checkout's code); its stdout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-m", "headatlas.cli.main", *args], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode:
        sys.exit(f"error: headatlas {' '.join(args)} failed:\n{done.stderr.strip()}")
    return done.stdout


def f2(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def g3(x: float | None) -> str:
    """Three significant figures, as the CLI's tables print lifts."""
    return "–" if x is None else f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def ci(d: dict, metric: str, fmt=g3) -> str:
    lo, hi = d.get(f"{metric}_lo"), d.get(f"{metric}_hi")
    value = fmt(d.get(metric))
    return value if lo is None or hi is None else f"{value} [{fmt(lo)}, {fmt(hi)}]"


class Reader:
    """The stored runs of one database, read through the library (the queries behind the CLI)."""

    def __init__(self, db: Path) -> None:
        from headatlas.service.storage.store import Store

        self.store = Store(db)

    def run(self, name: str):
        return self.store.get_run(name)

    def _rows(self, fn, *args, **kwargs) -> list[dict]:
        with self.store.checked_read() as conn:
            columns, rows = fn(conn, *args, **kwargs)
        return [dict(zip(columns, r)) for r in rows]

    def layers(self, run) -> list[dict]:
        from headatlas.service.reports import layer_queries

        return self._rows(layer_queries.layers, run.run_id, ci=True)

    def heads(self, run) -> list[dict]:
        from headatlas.service.reports import queries

        return self._rows(queries.heads, run.run_id, ci=True)

    def context(self, run) -> dict:
        from headatlas.service.reports import roles

        with self.store.checked_read() as conn:
            return roles.run_context(conn, run.run_id)

    def roles(self, run, stability: bool = True) -> tuple[list[str], list[tuple], int]:
        from headatlas.service.reports import role_views, roles

        with self.store.checked_read() as conn:
            columns, rows = roles.roles(conn, run.run_id, stability=stability)
        return columns, rows, role_views.family_size(columns, rows)

    def controls(self, run) -> list:
        from headatlas.service.reports import compare

        with self.store.checked_read() as conn:
            return compare.controls_of(conn, run)

    def compare(self, run_a, run_b, *, heads: bool = False) -> list[dict]:
        from headatlas.service.reports import compare

        return self._rows(compare.compare, run_a, run_b, heads=heads)

    def groups(self, run) -> tuple[int, int, int]:
        """The run's replicate groups, and how many each half of ``--stability`` holds."""
        from headatlas.service.reports import halves

        with self.store.checked_read() as conn:
            groups = halves.run_groups(conn, run.run_id)
        a, b = halves.split(groups)
        return len(groups), len(a), len(b)

    def windows(self, run) -> int:
        from sqlalchemy import text

        with self.store.checked_read() as conn:
            return int(
                conn.execute(text("SELECT count(*) FROM run_windows WHERE run_id = :r"), {"r": run.run_id}).scalar()
            )


def scheme(run) -> str:
    from headatlas.service.reports.intervals import scheme_of

    return scheme_of(run.params)


def count_rule(heads: list[dict], metric: str, above: float) -> tuple[int, int]:
    """(heads whose value is above ``above``, heads whose lower bound is)."""
    values = sum(1 for h in heads if h[metric] is not None and h[metric] > above)
    bounds = sum(1 for h in heads if h.get(f"{metric}_lo") is not None and h[f"{metric}_lo"] > above)
    return values, bounds


def span(values: list[float | None], digits: int = 2) -> str:
    kept = [v for v in values if v is not None]
    return f"{f2(min(kept), digits)}–{f2(max(kept), digits)}" if kept else "–"


def sentence_chance(layer: dict) -> float | None:
    """The share of all pairs of the windows that share a sentence (the run's, in every layer)."""
    lift = layer.get("within_sentence_lift")
    return layer["within_sentence"] / lift if lift else None


def section_layers(r: Reader, run) -> list[str]:
    layers = r.layers(run)
    ctx = layers[0]  # the chances over all pairs are the run's, the same in every layer
    out = [
        "### Layers",
        "",
        f"`headatlas query layers --ci`; intervals 95 %, replicate groups by {scheme(run)} (SPEC §5d). "
        f"Within-sentence chance over all pairs {f2(sentence_chance(ctx), 3)}, "
        f"mean-distance chance {f2(ctx.get('mean_distance_chance'), 1)}.",
        "",
        "| layer | mean distance | within-sentence | lift vs all pairs | lift vs same distances "
        "| repetition: tokens / words | word repetition vs same distances | [CLS] vs uniform "
        "| `.` `,` vs uniform | anchor = most frequent token | noise share |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in layers:
        out.append(
            f"| {d['layer']} | {f2(d['mean_distance'], 1)} | {f2(d['within_sentence'], 3)} "
            f"| {f2(d['within_sentence_lift'])} | {ci(d, 'within_sentence_lift_dm')} "
            f"| {f2(d['repetition'], 3)} / {f2(d['repetition_words'], 3)} | {ci(d, 'repetition_words_lift_dm')} "
            f"| {ci(d, 'attn_to_cls_lift')} | {ci(d, 'attn_to_punct_lift')} "
            f"| {f2(d['anchor_frequency_share'])} | {f2(d['noise_share'])} |"
        )
    best = max(layers, key=lambda d: d["within_sentence_lift_dm"] or 0)
    final = layers[-1]
    out += [
        "",
        f"- Most within-sentence layer against same distances: layer {best['layer']}, "
        f"{ci(best, 'within_sentence_lift_dm')}; final layer {final['layer']}: {ci(final, 'within_sentence_lift_dm')}.",
        f"- Layers whose within-sentence interval (same distances) lies above 1: "
        f"{', '.join(str(d['layer']) for d in layers if (d['within_sentence_lift_dm_lo'] or 0) > 1) or 'none'}; "
        f"below 1: {', '.join(str(d['layer']) for d in layers if (d['within_sentence_lift_dm_hi'] or 9) < 1) or 'none'}.",
        f"- [CLS] vs uniform, layers 1–{len(layers) - 1}: {span([d['attn_to_cls_lift'] for d in layers[1:]], 1)}; "
        f"`.` `,` vs uniform, every layer: {span([d['attn_to_punct_lift'] for d in layers])}; "
        f"noise share: {span([d['noise_share'] for d in layers])}.",
    ]
    return out


def section_heads(r: Reader, run) -> list[str]:
    heads = r.heads(run)
    n = len(heads)
    out = ["### Heads", ""]
    top = sorted(heads, key=lambda h: -(h["within_sentence_lift_dm"] or 0))[:3]
    out += [
        f"`headatlas query heads --sort within_sentence_lift_dm --top 3 --ci` (groups by {scheme(run)}):",
        "",
        "```text",
        " layer  head  within_sentence  within_sentence_lift  within_sentence_lift_dm  mean_distance",
    ]
    for h in top:
        out.append(
            f" {h['layer']:<6} {h['head']:<5} {h['within_sentence']:<16.3f} {h['within_sentence_lift']:<21.2f} "
            f"{ci(h, 'within_sentence_lift_dm', f2):<24} {h['mean_distance']:.1f}"
        )
    out += ["```", ""]
    for above in (1.0, 1.1):
        values, bounds = count_rule(heads, "within_sentence_lift_dm", above)
        out.append(
            f"- within_sentence_lift_dm above {above:g}: value above {above:g}: {values} of {n} heads; "
            f"lower bound above {above:g}: {bounds} of {n} heads."
        )
    rep = sorted(heads, key=lambda h: -(h["repetition_words_lift_dm"] or 0))[:4]
    out.append(
        "- Repetition heads (word repetition vs same distances, top 4): "
        + "; ".join(
            f"layer {h['layer']} head {h['head']}: repeated tokens {f2(h['repetition'], 3)}, "
            f"words {f2(h['repetition_words'], 3)}, {ci(h, 'repetition_words_lift_dm')}"
            for h in rep
        )
        + "."
    )
    for above in (1.5,):
        values, bounds = count_rule(heads, "attn_to_punct_lift", above)
        biggest = max(heads, key=lambda h: h["attn_to_punct_lift"] or 0)
        out.append(
            f"- `.` `,` vs uniform above {above:g}: value above: {values} of {n} heads; lower bound above: "
            f"{bounds} of {n}; largest layer {biggest['layer']} head {biggest['head']}, {ci(biggest, 'attn_to_punct_lift')}."
        )
    values, bounds = count_rule(heads, "attn_to_cls_lift", 10.0)
    out.append(f"- [CLS] vs uniform above 10: value above: {values} of {n} heads; lower bound above: {bounds} of {n}.")
    anchors = [h["anchor_frequency_share"] for h in heads if h["anchor_frequency_share"] is not None]
    by_layer: dict[int, list[float]] = {}
    for h in heads:
        if h["anchor_frequency_share"] is not None:
            by_layer.setdefault(h["layer"], []).append(h["anchor_frequency_share"])
    out.append(
        "- Anchor = the window's most frequent token (share of windows, per head): median head "
        f"{f2(statistics.median(anchors))}, largest {f2(max(anchors))}, smallest {f2(min(anchors))}; "
        f"heads above 0.5: {sum(a > 0.5 for a in anchors)} of {len(anchors)}; "
        "per layer (mean of its heads): "
        + ", ".join(f"{layer}: {f2(statistics.mean(v))}" for layer, v in sorted(by_layer.items()))
        + "."
    )
    return out


def role_table(
    columns: list[str], rows: list[tuple], control_counts: list[dict[str, int]], *, causal: bool = False
) -> list[str]:
    """Heads per role the run was offered (a causal run is not offered next-token, [SEP] sink, …)."""
    from headatlas.service.reports import role_rules, role_views

    offered = role_rules.offered_roles(causal)
    counts, stable = role_views.role_counts(columns, rows, offered), role_views.stable_counts(columns, rows)
    seeds = " | ".join(f"control seed {s}" for s in range(len(control_counts)))
    out = [f"| role | heads | stable (both halves) | {seeds} |", "|---|---|---|" + "---|" * len(control_counts)]
    for role, n in counts.items():
        held = "–" if role == role_rules.NONE or stable is None else str(stable.get(role, 0))
        cells = " | ".join(str(c.get(role, 0)) for c in control_counts)
        out.append(f"| {role} | {n} | {held} | {cells} |")
    return out


def section_roles(r: Reader, run) -> list[str]:
    from headatlas.service.reports import role_rules, role_views

    columns, rows, family = r.roles(run)
    controls = r.controls(run)
    control_counts = []
    for c in controls:
        c_columns, c_rows, _ = r.roles(c, stability=False)
        control_counts.append(role_views.role_counts(c_columns, c_rows))
    stable = role_views.stable_counts(columns, rows)
    earned = sum(1 for row in rows if row[columns.index("role")] != role_rules.NONE)
    stable_n = sum(stable.values()) if stable else None
    out = [
        "### Roles",
        "",
        f"`headatlas query roles --stability` (SPEC §7): Holm–Bonferroni over {family} (head, role) tests, "
        f"groups by {scheme(run)}; stable = earned on each half of the replicate groups "
        "({} groups; halves of {} and {}). ".format(*r.groups(run))
        + f"{earned} (head, role) earned, {stable_n if stable_n is not None else '–'} of them stable. "
        "A head may hold several roles.",
        "",
        *role_table(columns, rows, control_counts),
        "",
        "Each control's largest head per role metric (value, upper bound of its 95 % interval; "
        "on the rule's scale; LxHy = layer x, head y, 0-based) against the real model's largest:",
        "",
        "| role | metric | real: largest head | " + " | ".join(f"seed {s}" for s in range(len(controls))) + " |",
        "|---|---|---|" + "---|" * len(controls),
    ]
    real = r.heads(run)
    ctx = r.context(run)
    for role, (metric, scale) in ROLE_METRICS.items():
        by = ctx.get(scale) if scale else 1.0

        def largest(heads: list[dict], by: float | None = by, metric: str = metric) -> str:
            kept = [h for h in heads if h.get(metric) is not None and by]
            if not kept:
                return "–"
            h = max(kept, key=lambda h: h[metric])
            hi = h.get(f"{metric}_hi")
            return f"{g3(h[metric] / by)} ({'–' if hi is None else g3(hi / by)}), L{h['layer']}H{h['head']}"

        cells = []
        for c in controls:
            c_ctx = r.context(c)
            c_by = c_ctx.get(scale) if scale else 1.0
            cells.append(largest(r.heads(c), c_by))
        scale_text = f" / {scale}" if scale else ""
        out.append(f"| {role} | `{metric}{scale_text}` | {largest(real)} | " + " | ".join(cells) + " |")
    return out


def section_punct(r: Reader, run, punct) -> list[str]:
    base, other = r.layers(run), r.layers(punct)
    ctx = other[0]
    shift = max(abs(a["within_sentence_lift_dm"] - b["within_sentence_lift_dm"]) for a, b in zip(base, other))
    l2 = other[2] if len(other) > 2 else other[-1]
    return [
        "### The earlier sentence rule (`--sentences punct`)",
        "",
        f"Within-sentence chance over all pairs {f2(sentence_chance(ctx), 3)}; layer {l2['layer']}: "
        f"lift vs all pairs {f2(l2['within_sentence_lift'])}, vs same distances {ci(l2, 'within_sentence_lift_dm')}. "
        f"Largest change of a layer's within_sentence_lift_dm against the segmenter: {f2(shift, 3)}.",
    ]


def section_sensitivity(r: Reader, run, variants: list[tuple[str, object]]) -> list[str]:
    """Per run (the default, then one option changed at a time): two lifts by layer, and the
    (head, role) counts earned (Holm over each run's own family)."""
    from headatlas.service.reports import role_rules, role_views

    out = [
        "### Sensitivity: one option changed at a time",
        "",
        "Layer values of `within_sentence_lift_dm` and `repetition_words_lift_dm` (layers 0, 1, …), and the "
        "(head, role) earned (`query roles`, each run its own Holm family).",
        "",
        "| run | option | within_sentence_lift_dm | repetition_words_lift_dm | roles earned | by role |",
        "|---|---|---|---|---|---|",
    ]
    for option, other in [("defaults", run), *variants]:
        layers = r.layers(other)
        columns, rows, _ = r.roles(other, stability=False)
        counts = role_views.role_counts(columns, rows)
        earned = sum(n for role, n in counts.items() if role != role_rules.NONE)
        held = ", ".join(f"{role} {n}" for role, n in counts.items() if n and role != role_rules.NONE)
        ws = " ".join(f2(d["within_sentence_lift_dm"], 3) for d in layers)
        rw = " ".join(f2(d["repetition_words_lift_dm"]) for d in layers)
        out.append(f"| {other.name} | {option} | {ws} | {rw} | {earned} | {held or '–'} |")
    return out


def section_baselines(r: Reader, run, half_a, half_b) -> list[str]:
    out = ["### Baselines of `compare`", ""]
    for label, a, b in (
        ("the run with itself (`compare findings findings`)", run, run),
        ("half A against half B (documents alternate)", half_a, half_b),
    ):
        parts = []
        for heads in (False, True):
            rows = [d for d in r.compare(a, b, heads=heads) if d["verdict"] in ("beyond", "within")]
            beyond = sum(d["verdict"] == "beyond" for d in rows)
            share = 100 * beyond / len(rows) if rows else 0.0
            kind = "(head, metric)" if heads else "(layer, metric)"
            parts.append(f"{beyond} of {len(rows)} {kind} cells beyond ({share:.1f} %)")
            interval = rows[0]["interval"] if rows else "–"
        out.append(f"- {label}: {'; '.join(parts)}; interval {interval}.")
    out.append(
        f"- Half A: {r.windows(half_a)} windows, groups by {scheme(half_a)}; half B: {r.windows(half_b)} windows, "
        f"groups by {scheme(half_b)}."
    )
    return out


def section_decoder(r: Reader, run, dec) -> list[str]:
    from headatlas.service.reports import role_rules, role_views

    columns, rows, family = r.roles(dec)
    control_counts = []
    for c in r.controls(dec):
        c_columns, c_rows, _ = r.roles(c, stability=False)
        control_counts.append(role_views.role_counts(c_columns, c_rows, role_rules.offered_roles(True)))
    heads, layers = r.heads(dec), r.layers(dec)
    groups = "{} groups; halves of {} and {}".format(*r.groups(dec))
    out = [
        f"### Decoder: {dec.model} (`--model smollm2 --probe --control 1`)",
        "",
        f"{dec.n_layers} layers × {dec.n_heads} heads, {r.windows(dec)} windows, groups by {scheme(dec)}. "
        "Weights: the Q4_1 GGUF (4-bit quantised), dequantised to float32.",
        "",
        f"Roles (`query roles --stability`, Holm–Bonferroni over {family} tests; {groups}):",
        "",
        *role_table(columns, rows, control_counts, causal=True),
        "",
    ]
    if heads and heads[0].get("induction_score") is not None:
        top = sorted(heads, key=lambda h: -h["induction_score"])[:5]
        out.append(
            "Probe (repeated random tokens, SPEC §8), top induction heads: "
            + ", ".join(
                f"L{h['layer']}H{h['head']} {f2(h['induction_score'], 3)} (duplicate {f2(h['duplicate_score'], 3)})"
                for h in top
            )
            + "."
        )
        out.append("")
    out += ["Sink on the first token by layer (`attn_to_first`, share of each row's attention; vs uniform):", ""]
    out.append("| layer | depth | attn_to_first | vs uniform |")
    out.append("|---|---|---|---|")
    for d in layers:
        depth = (d["layer"] + 0.5) / dec.n_layers
        out.append(f"| {d['layer']} | {depth:.2f} | {f2(d.get('attn_to_first'), 3)} | {ci(d, 'attn_to_first_lift')} |")
    rows_c = r.compare(run, dec)
    out += [
        "",
        f"`headatlas compare {MAIN} {DECODER}` (layers aligned by relative depth (l + 0.5)/L; "
        f"interval {rows_c[0]['interval'] if rows_c else '–'}):",
        "",
        "| MiniLM layer | SmolLM2 layer | metric | MiniLM | SmolLM2 | A − B | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for d in rows_c:
        if d["metric"] in ("within_sentence_lift_dm", "repetition_words_lift_dm", "short_range_share", "noise_share"):
            out.append(
                f"| {d['layer_a']} | {d['layer_b']} | {d['metric']} | {g3(d['value_a'])} | {g3(d['value_b'])} "
                f"| {g3(d['difference'])} | {d['verdict']} |"
            )
    return out


def main(argv: list[str] | None = None) -> None:
    from headatlas.service.engine.corpus import demo_corpus_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=str(demo_corpus_path()), help="a .txt corpus (default: the excerpt)")
    parser.add_argument("--max-docs", type=int, default=0, help="keep the first N documents (0: all)")
    parser.add_argument("--max-chars", type=int, default=0, help="keep about N characters of documents (0: all)")
    parser.add_argument(
        "--doc-chars", type=int, default=0, help="keep each document's leading paragraphs while under N characters"
    )
    parser.add_argument("--db", default=str(ROOT / "build" / "findings.duckdb"), help="database (made afresh)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "findings-output.md"), help="markdown written here")
    parser.add_argument("--decoder", action="store_true", help="also SmolLM2 (--probe, one control)")
    parser.add_argument("--decoder-max-docs", type=int, default=0, help="SmolLM2's corpus: first N documents")
    parser.add_argument("--reuse", action="store_true", help="keep the database and the runs already in it")
    args = parser.parse_args(argv)
    source = Path(args.corpus)
    if not source.is_file():
        sys.exit(
            f"error: no corpus at {source}: pass --corpus PATH, a .txt corpus of documents separated by blank lines"
        )
    started = time.perf_counter()
    db = Path(args.db)
    db.parent.mkdir(parents=True, exist_ok=True)
    work = db.parent / f"{db.stem}-corpora"  # one per database: two runs of the script may share build/
    if not args.reuse:
        db.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(exist_ok=True)
    corpus, n_docs = prepare_corpus(source, args.max_docs, args.max_chars, work / "corpus.txt", args.doc_chars)

    from benchmarks.halves import split_halves

    half_a, half_b, _, _ = split_halves(corpus, work, 0)
    reader = Reader(db)
    existing = {row["name"] for row in reader.store.list_runs()} if db.exists() else set()

    analysed: list[str] = []

    def analyze(name: str, path: Path, *extra: str) -> None:
        if name not in existing:
            analysed.append(name)
            print(f"analyse {name} …", file=sys.stderr, flush=True)
            cli("analyze", str(path), "--name", name, "--db", str(db), "--quiet", *extra)

    analyze(MAIN, corpus, "--control", "3")
    analyze(PUNCT, corpus, "--sentences", "punct")
    analyze(HALF_A, half_a)
    analyze(HALF_B, half_b)
    for name, options in VARIANTS:
        analyze(name, corpus, *options)
    if args.decoder:
        dec_corpus, _ = prepare_corpus(corpus, args.decoder_max_docs, 0, work / "decoder.txt")
        analyze(DECODER, dec_corpus, "--model", "smollm2", "--probe", "--control", "1")

    run = reader.run(MAIN)
    caps = [
        f"{flag} {value}"
        for flag, value in (
            ("--max-docs", args.max_docs),
            ("--max-chars", args.max_chars),
            ("--doc-chars", args.doc_chars),
        )
        if value
    ]
    shown = source.name if corpus == source else f"{source.name}, capped ({' '.join(caps)})"
    named = [] if source == demo_corpus_path() else [f"--corpus {os.path.relpath(source, ROOT)}"]
    command = " ".join(["python benchmarks/findings.py", *named, *caps, *(["--decoder"] if args.decoder else [])])
    lines = [
        f"## Findings: the default model ({MODEL_NAME}), `{source.name}`",
        "",
        f"Made by `{command}` on {datetime.now(UTC):%Y-%m-%d} ({machine()}).",
        f"Corpus: {shown}: {n_docs} documents, {reader.windows(run)} windows of {run.params.get('seq_len')} tokens. "
        "Default analysis options (top 2 % of pairs, gate 4/n, vectors before W_O, sentences from the segmenter), "
        f"controls of seeds 0, 1, 2; 95 % intervals, replicate groups by {scheme(run)}.",
        "",
        *section_layers(reader, run),
        "",
        *section_heads(reader, run),
        "",
        *section_roles(reader, run),
        "",
        *section_punct(reader, run, reader.run(PUNCT)),
        "",
        *section_sensitivity(
            reader,
            run,
            [("--sentences punct", reader.run(PUNCT))]
            + [(" ".join(options), reader.run(name)) for name, options in VARIANTS],
        ),
        "",
        *section_baselines(reader, run, reader.run(HALF_A), reader.run(HALF_B)),
    ]
    if args.decoder:
        lines += ["", *section_decoder(reader, run, reader.run(DECODER))]
    reused = f" (runs reused from the database: {len(existing)})" if existing else ""
    lines += ["", f"Took {time.perf_counter() - started:.0f} s{reused}."]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.write_text(text, encoding="utf-8")
    print(f"written to {out}", file=sys.stderr)
    if copy_into(FINDINGS_PAGE, out, text):
        print(f"and copied into {FINDINGS_PAGE}: now check its prose against it", file=sys.stderr)


def copy_into(page: Path, out: Path, text: str) -> bool:
    """Replace the block of ``page`` between ``<!-- begin PATH -->`` and ``<!-- end PATH -->`` (PATH:
    ``out`` relative to the repository) with ``text``; False where ``page`` has no such block."""
    try:
        name = out.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return False
    begin, end = f"<!-- begin {name} -->\n", f"<!-- end {name} -->"
    held = page.read_text(encoding="utf-8") if page.exists() else ""
    if begin not in held or end not in held:
        return False
    head, rest = held.split(begin, 1)
    page.write_text(head + begin + text + end + rest.split(end, 1)[1], encoding="utf-8")
    return True


if __name__ == "__main__":
    main()
