"""The causal-effect findings of docs/findings.md (SPEC §9): which heads matter, whether the roles'
heads matter more than the role-less ones, the pruning curves, and the seed paper's claim.

    python benchmarks/effect_findings.py [--corpus PATH] [--doc-chars 800] [--models default,smollm2]
                                         [--effect-windows default=24,smollm2=8]
                                         [--kinds default=mean,smollm2=gradient]
                                         [--documents smollm2=32] [--seq-len smollm2=64]
                                         [--prune default=16:10%,smollm2=4:25%]
                                         [--orders smollm2=importance+noise+random]
                                         [--out docs/findings-output-effects.md] [--db build/effect-findings.duckdb]

``make findings`` runs it after benchmarks/findings.py. Per model, into a fresh database: the
corpus (the development corpus where it exists, each document cut to its leading paragraphs under
``--doc-chars`` characters) analysed with ``--windowing first`` (one window per document, so that
the effect windows come from as many documents as there are windows) and ``--effects`` on the
run's first ``--effect-windows`` windows (``--kinds``), then ``headatlas prune`` on ``--prune``
WINDOWS:STEP other windows (``--orders``), its figure in docs/img. ``--documents`` cuts a model's
corpus to its first documents and ``--seq-len`` its windows. The defaults are what about 12 minutes
per model allow on a shared 2-core machine: for SmolLM2 each ablated copy of a window needs its own
49,152-way softmax, 270 of them per window and kind (minutes per window there), so it gets gradient
importance (one backward pass) and the orders that need no ablation. The markdown goes to ``--out``
and into docs/findings.md between the markers naming it.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import default_corpus, machine  # noqa: E402
from benchmarks.findings import FINDINGS_PAGE, copy_into, prepare_corpus  # noqa: E402

SEED_CLAIM = (
    "Halevi et al. claim that the noise of a head's similarity matrix (pairs whose outputs are similar but "
    "which attention does not connect) points to heads that can be pruned. Tested here (SPEC §9) by "
    "`noise_share` (the share of a head's most similar pairs that fail the attention gate): removing heads in "
    "the order of their noise_share (largest first) should cost less than removing them at random, and "
    "noise_share should correlate negatively with the effect of removing the head."
)


def cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "headatlas.cli.main", *args]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done


def query(db: str, *args: str) -> list[dict]:
    return json.loads(cli(*args, "--db", db, "--format", "json").stdout)


def fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:+.{digits}g}" if isinstance(value, float) else str(value)


def ci(row: dict, name: str) -> str:
    lo, hi = row.get(f"{name}_lo"), row.get(f"{name}_hi")
    bounds = "" if lo is None or hi is None else f" [{fmt(lo)}, {fmt(hi)}]"
    return f"{fmt(row.get(name))}{bounds}"


def role_effects(db: str, run: str) -> list[str]:
    """The lines `query roles` prints about each role's mean effect."""
    out = cli("query", "roles", "--run", run, "--db", db).stdout
    return [line for line in out.splitlines() if line.startswith(("mean effect", "effect_* ="))]


def model_section(
    db: str, run: str, model: str, windows: int, seconds: float, figure: Path, options: str, documents: int
) -> list[str]:
    heads = query(db, "query", "heads", "--run", run, "--ci")
    kinds = [k for k in ("effect_mean", "effect_zero", "importance") if heads[0].get(k) is not None]
    main = kinds[0]
    ranked = sorted(heads, key=lambda h: -h[main])
    (counted,) = query(
        db, "sql", "--run", run, "SELECT sum(effect_windows) AS measured, sum(windows) AS analysed FROM run_chance"
    )
    status = next(r["status"] for r in query(db, "runs") if r["name"] == run)
    stopped = (
        f" The analysis was stopped (status {status}) after {counted['analysed']} of {documents} documents, "
        "the machine being shared: noise_share rests on those windows."
        if status != "done"
        else ""
    )
    lines = [
        f"### {model}",
        "",
        f"`headatlas analyze --windowing first {options}`: {counted['measured']} windows with effects (of "
        f"{counted['analysed']} analysed), {seconds / 60:.0f} min of analysis on this machine.{stopped}",
        "",
        f"Top heads by {main} (`headatlas query heads --sort {main} --ci`):",
        "",
        "| layer | head | " + " | ".join(kinds) + " | noise_share |",
        "|---|---|" + "---|" * len(kinds) + "---|",
    ]
    for h in ranked[:8]:
        lines.append(
            f"| {h['layer']} | {h['head']} | " + " | ".join(ci(h, k) for k in kinds) + f" | {h['noise_share']:.3f} |"
        )
    if main != "importance":  # an importance is |∂O/∂ξ|, never below 0
        clear = sum(1 for h in heads if (h.get(f"{main}_lo") or 0) > 0)
        lines += ["", f"- Heads whose {main} interval lies above 0: {clear} of {len(heads)}."]
    else:
        lines += [""]
    lines += [f"- {line}" for line in role_effects(db, run)]
    prune = json.loads(cli("prune", run, "--db", db, "--show", "--format", "json").stdout)
    note = cli("prune", run, "--db", db, "--show").stderr.strip().replace("\n", " ")
    lines += ["", f"Pruning curves (`headatlas prune {run}`), increase of the objective over the intact model:", ""]
    orders = list(dict.fromkeys(r["order"] for r in prune))
    steps = sorted({r["fraction"] for r in prune})
    lines.append("| share removed | " + " | ".join(orders) + " |")
    lines.append("|---|" + "---|" * len(orders))
    for step in steps:
        cells = []
        for order in orders:
            row = next(r for r in prune if r["order"] == order and r["fraction"] == step)
            cells.append(ci(row, "increase"))
        lines.append(f"| {step:.0%} | " + " | ".join(cells) + " |")
    lines += ["", f"![pruning curves of {model}](img/{figure.name})", "", f"- {note.removeprefix('note: ')}", ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", type=Path, default=None)
    parser.add_argument("--doc-chars", type=int, default=800)
    parser.add_argument("--models", default="default,smollm2")
    parser.add_argument("--effect-windows", default="default=24,smollm2=8")
    parser.add_argument("--kinds", default="default=mean,smollm2=gradient", help="MODEL=KIND+KIND,… (+ for ,)")
    parser.add_argument("--documents", default="smollm2=32", help="MODEL=N: the corpus's first N documents")
    parser.add_argument("--seq-len", default="smollm2=64", help="MODEL=N: --seq-len of the analysis")
    parser.add_argument("--prune", default="default=16:10%,smollm2=4:25%")
    parser.add_argument("--orders", default="smollm2=importance+noise+random", help="MODEL=ORDER+ORDER,…")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "findings-output-effects.md")
    parser.add_argument("--db", type=Path, default=ROOT / "build" / "effect-findings.duckdb")
    parser.add_argument(
        "--reuse", action="store_true", help="Keep the database: a model analysed and pruned there is not run again."
    )
    args = parser.parse_args()
    source = args.corpus or default_corpus()
    work = args.db.parent / "effect-findings"
    if not args.reuse:
        shutil.rmtree(work, ignore_errors=True)
        args.db.unlink(missing_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    corpus, documents = prepare_corpus(source, 0, 0, work / "corpus.txt", doc_chars=args.doc_chars)

    def per_model(text: str) -> dict[str, str]:
        return dict(part.split("=") for part in text.split(",") if part)

    counts, prunes = per_model(args.effect_windows), per_model(args.prune)
    kinds_of, orders_of = per_model(args.kinds), per_model(args.orders)
    documents_of, seq_len_of = per_model(args.documents), per_model(args.seq_len)
    db = str(args.db)
    lines = [
        f"## Findings: which heads matter (SPEC §9), `{source.name}`",
        "",
        f"Made by `python benchmarks/effect_findings.py --doc-chars {args.doc_chars} --models {args.models} "
        f"--effect-windows {args.effect_windows} --kinds {args.kinds} --documents {args.documents} "
        f"--seq-len {args.seq_len} --prune {args.prune} --orders {args.orders}` on "
        f"{datetime.now(UTC).date()} ({machine()}). Corpus: {source.name}, each document cut under "
        f"{args.doc_chars} characters, one window per document (--windowing first): {documents} documents. "
        "Effects are O(ablated) − O(intact) in the model's own objective; 95 % intervals, replicate groups by "
        "document, an effect's over the groups that hold its effect windows.",
        "",
        f"What the paper claims: {SEED_CLAIM}",
        "",
    ]
    for model in args.models.split(","):
        run = f"effects-{model}"
        windows = int(counts.get(model, 16))
        kinds = kinds_of.get(model, "zero+mean").replace("+", ",")
        prune_windows, step = prunes.get(model, "16:10%").split(":")
        orders = orders_of.get(model, "").replace("+", ",")
        model_corpus, model_docs = corpus, documents
        if model in documents_of:
            model_corpus, model_docs = prepare_corpus(corpus, int(documents_of[model]), 0, work / f"corpus-{model}.txt")
        extra = ["--seq-len", seq_len_of[model]] if model in seq_len_of else []
        options = " ".join([*extra, "--effects", kinds, "--effect-windows", str(windows)])
        figure = ROOT / "docs" / "img" / f"prune-{model}.png"
        done = args.reuse and args.db.exists() and run in cli("runs", "--db", db).stdout
        began = time.perf_counter()
        if not done:
            print(f"{model}: analysing with effects on {windows} windows …", file=sys.stderr)
            cli(
                "analyze", str(model_corpus), "--model", model, "--db", db, "--name", run, "--windowing", "first",
                *extra, "--effects", kinds, "--effect-windows", str(windows), "-q",
            )  # fmt: skip
        # the analysis's own wall time, as the run recorded it (a reused run's too)
        listed = json.loads(cli("runs", "--db", db, "--format", "json").stdout)
        seconds = next((r["wall_s"] for r in listed if r["name"] == run), time.perf_counter() - began)
        if (
            not done
            or subprocess.run(
                [sys.executable, "-m", "headatlas.cli.main", "prune", run, "--db", db, "--show"], capture_output=True
            ).returncode
        ):
            print(f"{model}: pruning …", file=sys.stderr)
            chosen = ["--order", orders] if orders else []
            cli("prune", run, "--db", db, "--windows", prune_windows, "--step", step, *chosen, "--out", str(figure))
        lines += model_section(db, run, model, windows, seconds, figure, options, model_docs)
    text = "\n".join(lines) + "\n"
    args.out.write_text(text, encoding="utf-8")
    print(text)
    if copy_into(FINDINGS_PAGE, args.out, text):
        print(f"and copied into {FINDINGS_PAGE}: now check its prose against it", file=sys.stderr)


if __name__ == "__main__":
    main()
