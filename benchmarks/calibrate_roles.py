"""Where the role thresholds of SPEC §7 come from: the development data through the default model
and through random-weights controls of several seeds.

    python benchmarks/calibrate_roles.py [--seeds 3] [--doc-chars 1500] [--db calibrate.duckdb]
    python benchmarks/calibrate_roles.py --model smollm2 --probe --windowing first   # decoder roles

Development data (SPEC §7): the shipped excerpt (service/data/wiki_excerpt.txt, whole) and
../shared/corpora/wikipedia_dev.txt cut to its documents' leading paragraphs (whole paragraphs
while a document's kept text is under ``--doc-chars`` characters, at least one), so that every
one of its 151 documents is in. The cap: ``--doc-chars 1500`` keeps 533 windows (with the
excerpt's 52, 585 windows through 4 models); measured 985 s on 2 cores shared with other jobs
(load average 10–14), so about ten minutes on a machine less loaded; ``--doc-chars 800`` keeps
177,129 of those 277,982 characters. Each corpus is analysed with the default model and with ``--seeds`` controls (seeds
0..N-1). The thresholds of service/reports/role_rules.py and SPEC §7 were read off this output
(2026-11-30, window-hash replicate groups).

Decoders (SPEC §8): ``--model smollm2 --probe`` reads the roles a causal run is offered
(``role_rules.rules_for``): first-token sink, induction and duplicate-token among them, the last two
with their probe scores (induction_score, duplicate_score: for every seed the largest control
head, for the real model the heads the probe ranks highest). ``--windowing first`` caps the
development corpus at one window per document (151 windows of wikipedia_dev), which a 30-layer
decoder on 2 CPU cores needs; the excerpt is analysed whole (chunks) either way. The decoder
thresholds of service/reports/role_rules.py and SPEC §7 were read off that output on 2026-11-30
(SmolLM2-135M, seeds 0..2: 1,647 s on 2 cores shared with other jobs).

Prints, per corpus and per role's metric (as the rule reads it: ``short_range_share`` over
``short_range_chance``, ``attn_entropy`` over ln n̄): the largest control head of every seed
(value and the upper end of its 95% interval; for ``broad`` the *smallest* entropy, since there
the control sits at uniform attention and the ceiling must stay under it), then the real
model's heads: quantiles of the values, the 12 largest values with their lower bounds, and how
many heads' lower bounds clear the threshold in service/reports/role_rules.py. A threshold must clear
every seed's largest control head (SPEC §7). ``--json PATH`` also writes every head's figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import SHARED_CORPUS, machine  # noqa: E402

# ../shared beside a checkout, or beside the folder of worktrees that holds it
DEV_CORPUS = next(
    (p for p in (SHARED_CORPUS, SHARED_CORPUS.parents[3] / "shared" / "corpora" / SHARED_CORPUS.name) if p.exists()),
    SHARED_CORPUS,
)

# role → (metric, how the rule scales it): the figures are printed on the rule's own scale
ROLE_METRICS = {
    "previous-token": ("attn_to_prev", None),
    "next-token": ("attn_to_next", None),
    "induction": ("induction_lift", None),
    "duplicate-token": ("dup_lift", None),
    "repetition": ("repetition_words_lift_dm", None),
    "sentence-bound": ("within_sentence_lift_dm", None),
    "punctuation": ("attn_to_punct_lift", None),
    "local": ("short_range_share", "short_range_chance"),
    "[CLS] sink": ("attn_to_cls_lift", None),
    "first-token sink": ("attn_to_first_lift", None),
    "[SEP] sink": ("attn_to_sep_lift", None),
    "broad": ("attn_entropy", "uniform_entropy"),
}
# a role's probe score (SPEC §8): printed as "<role> probe"
PROBE_OF = {"induction": "induction_score", "duplicate-token": "duplicate_score"}


def leading_paragraphs(source: Path, doc_chars: int, out: Path) -> Path:
    """Each document's leading paragraphs while its kept text is under ``doc_chars`` characters
    (at least one paragraph), documents in order, as a .txt corpus."""
    docs = []
    for doc in source.read_text(encoding="utf-8").split("\n\n"):
        kept: list[str] = []
        for paragraph in doc.strip().split("\n"):
            if kept and sum(len(p) for p in kept) >= doc_chars:
                break
            kept.append(paragraph)
        if kept:
            docs.append("\n".join(kept))
    out.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return out


def head_figures(conn, run_id: int) -> list[dict]:
    """Per head: each role metric on the rule's scale, with its interval (None where it has none)."""
    from headatlas.service.reports import queries, roles

    context = roles.run_context(conn, run_id)
    columns, rows = queries.heads(conn, run_id, anchors=0, ci=True)
    out = []
    for row in rows:
        d = dict(zip(columns, row))
        heads = {"layer": d["layer"], "head": d["head"]}
        for role, (metric, scale) in ROLE_METRICS.items():
            by = context.get(scale) if scale else 1.0
            cells = [d.get(metric), d.get(f"{metric}_lo"), d.get(f"{metric}_hi")]
            heads[role] = [None if v is None or not by else v / by for v in cells]
        for role, score in PROBE_OF.items():
            heads[f"{role} probe"] = [d.get(score), None, None]
        out.append(heads)
    return out


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.3g}"


def thresholds_of(causal: bool) -> dict[str, float]:
    """Each offered role's threshold on the scale printed here (and its probe's, as "<role> probe")."""
    from headatlas.service.reports import role_rules

    scaled = {"local": role_rules.LOCAL_FACTOR, "broad": role_rules.BROAD_MIN}
    out = {}
    for rule in role_rules.rules_for(causal):
        out[rule.role] = scaled.get(rule.role) or rule.threshold({})
        if rule.probe:
            out[f"{rule.role} probe"] = rule.probe_min
    return out


def report(
    label: str, real: list[dict], controls: dict[int, list[dict]], windows: int, causal: bool = False
) -> list[str]:
    thresholds = thresholds_of(causal)
    kind = "causal" if causal else "bidirectional"
    lines = [
        f"== {label}: {windows} windows, {len(real)} heads ({kind}); controls: seeds {', '.join(map(str, controls))}"
    ]
    rows = {**{r: ROLE_METRICS[r] for r in thresholds if r in ROLE_METRICS}}
    for role in list(rows):
        if role in PROBE_OF:
            rows[f"{role} probe"] = (PROBE_OF[role], None)
    for role, (metric, scale) in rows.items():
        scale_text = f" / {scale}" if scale else ""
        lines.append(f"-- {role}: {metric}{scale_text}")
        for seed, heads in controls.items():
            cells = [h[role] for h in heads if h[role][0] is not None]
            if role == "broad":
                low = min(cells, key=lambda c: c[0]) if cells else [None] * 3
                lines.append(f"   control seed {seed}: smallest head {_fmt(low[0])} (lower bound {_fmt(low[1])})")
            else:
                top = max(cells, key=lambda c: c[0]) if cells else [None] * 3
                lines.append(f"   control seed {seed}: largest head {_fmt(top[0])} (upper bound {_fmt(top[2])})")
        cells = sorted((h[role] for h in real if h[role][0] is not None), key=lambda c: -c[0])
        if not cells:
            lines.append("   real: no values")
            continue
        values = [c[0] for c in cells]
        q = [values[min(len(values) - 1, int(round(p * (len(values) - 1))))] for p in (0.0, 0.25, 0.5, 0.75, 1.0)]
        lines.append("   real quantiles (max, 75%, median, 25%, min of the values): " + ", ".join(_fmt(v) for v in q))
        lines.append(
            "   real top 12 (value [lower bound]): " + ", ".join(f"{_fmt(c[0])} [{_fmt(c[1])}]" for c in cells[:12])
        )
        if role.endswith(" probe") or role == "first-token sink":
            ranked = sorted((h for h in real if h[role][0] is not None), key=lambda h: -h[role][0])
            lines.append(
                "   real top heads (layer.head value): "
                + ", ".join(f"{h['layer']}.{h['head']} {_fmt(h[role][0])}" for h in ranked[:12])
            )
        threshold = thresholds[role]
        cleared = sum(1 for c in cells if (c[1] if c[1] is not None else c[0]) >= threshold)
        lines.append(f"   heads whose lower bound is ≥ the current threshold {threshold:g}: {cleared}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="controls per corpus (seeds 0..N-1)")
    parser.add_argument("--doc-chars", type=int, default=1500, help="characters kept per development document")
    parser.add_argument("--dev", default=str(DEV_CORPUS), help="the development corpus")
    parser.add_argument("--db", default=None, help="results database (default: a temporary one)")
    parser.add_argument("--json", default=None, help="also write every head's figures here")
    parser.add_argument("--model", default="default", help="the real model (default: the default encoder)")
    parser.add_argument("--probe", action="store_true", help="also run the synthetic probe (SPEC §8) on every run")
    parser.add_argument(
        "--windowing", default="chunks", help="of the development corpus: chunks, or first (one window per document)"
    )
    args = parser.parse_args()

    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.corpus import demo_corpus_path
    from headatlas.service.engine.model import control_model, load_model
    from headatlas.service.engine.probe import ProbeSpec
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.storage.store import Store

    folder = Path(tempfile.mkdtemp(prefix="calibrate-"))
    db = Path(args.db) if args.db else folder / "calibrate.duckdb"
    corpora = {"excerpt": demo_corpus_path()}
    dev = Path(args.dev)
    if dev.exists():
        corpora["wikipedia_dev (leading paragraphs)"] = leading_paragraphs(
            dev, args.doc_chars, folder / "wikipedia_dev_leading.txt"
        )
    else:
        print(f"note: {dev} is missing (pass --dev PATH); the excerpt only", flush=True)
    print(f"machine: {machine()}; database {db}; --doc-chars {args.doc_chars}; seeds 0..{args.seeds - 1}", flush=True)
    loading = time.perf_counter()
    model = load_model(args.model, device="cpu")
    print(f"model {args.model}: loaded in {time.perf_counter() - loading:.0f} s", flush=True)
    probe = ProbeSpec() if args.probe else None
    store = Store(db)
    figures: dict = {}
    lines: list[str] = []
    started = time.perf_counter()
    for label, path in corpora.items():
        summary = survey_corpus(str(path))
        params = build_params(windowing="chunks" if label == "excerpt" else args.windowing)
        run_on = dict(store=store, params=params, corpus=summary, batch_size=32, probe=probe)
        run = analyze_corpus(str(path), model=model, name=label.split()[0], **run_on)
        controls = [
            analyze_corpus(str(path), model=control_model(model, seed=s), control_of=run, control_seed=s, **run_on)
            for s in range(args.seeds)
        ]
        print(f"{label}: analysed ({time.perf_counter() - started:.0f} s so far)", flush=True)
        with store.checked_read() as conn:
            from headatlas.service.reports import attention_kind, queries

            windows = queries.run_summary(conn, run.run_id)["windows"]
            real = head_figures(conn, run.run_id)
            by_seed = {s: head_figures(conn, c.run_id) for s, c in enumerate(controls)}
            causal = attention_kind.causal_run(conn, run.run_id)
        figures[label] = {"windows": windows, "real": real, "controls": by_seed, "run_id": run.run_id}
        lines += report(label, real, by_seed, windows, causal)
    print("\n".join(lines))
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, default=str))


if __name__ == "__main__":
    main()
