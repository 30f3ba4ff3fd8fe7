"""The causal-effect findings of docs/findings.md (SPEC §9): Michel et al. 2019's questions ("Are
Sixteen Heads Really Better than One?") answered with intervals, and the seed paper's claim.

    python benchmarks/effect_findings.py [--corpus PATH] [--doc-chars 800] [--models default,smollm2]
                                         [--effect-windows default=64,smollm2=8]
                                         [--kinds default=mean,smollm2=mean+gradient]
                                         [--documents smollm2=40] [--seq-len smollm2=64]
                                         [--prune default=16:10%,smollm2=16:25%] [--orders MODEL=ORDER+ORDER]
                                         [--until 10%] [--reuse]
                                         [--out docs/findings-output-effects.md] [--db build/effect-findings.duckdb]

``make findings`` runs it twice (MiniLM, then SmolLM2 into files of its own). Per model, into a
fresh database: the corpus (the development corpus where it exists, each document cut to its
leading paragraphs under ``--doc-chars`` characters) analysed with ``--windowing first`` (one window
per document, so that the effect windows come from as many documents as there are windows) and
``--effects`` on ``--effect-windows`` windows spread over the replicate groups (``--kinds``); then
``headatlas prune`` on ``--prune`` WINDOWS:STEP other windows in ``--orders`` (default: every order
the run's objective allows: effect, importance, one_per_layer, noise, random and the trivial
layer, sinks, output_norm, output_variance), its figure in docs/img. ``--documents`` cuts a
model's corpus to its first documents and ``--seq-len`` its windows.

Each model's section answers, from what the tool prints (`headatlas effects RUN`'s table and notes,
as ``run.effects()`` returns them; `query roles`; `prune --format json` and its notes; `prune --show
--until X` for each order): how many heads matter individually (intervals above or below 0), which
ones (raw and normalised within their layer, Michel et al.'s importance), per layer, joined with
their roles and ``noise_share``; how many heads can go before the objective rises by ``--until``;
what keeping one head per layer costs; which order wins against random and against the best trivial
order (the tool's own verdict); and, for an embedding model, neighbour retrieval along the curves.
The defaults are what about 12 minutes per model allow on a 2-core machine, one model per core:
SmolLM2's every ablated head needs its own 49,152-way softmax, so it gets 8 effect windows in
64-token windows and a coarser prune. The markdown goes to ``--out`` and into docs/findings.md
between the markers naming it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
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
    "the order of their noise_share (largest first) should cost less than removing them at random, and than "
    "removing them in an order that knows nothing of what a head does (the best trivial order), and "
    "noise_share should correlate negatively with the effect of removing the head."
)
MICHEL = (
    'Michel et al. 2019 ("Are Sixteen Heads Really Better than One?") asked how many heads can go before '
    "the model's objective suffers, how many matter one at a time, whether a layer can keep a single head, "
    "and how heads rank within their layer (importance normalised by the layer's ‖·‖₂)."
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


def ci(row: dict, name: str, digits: int = 3) -> str:
    lo, hi = row.get(f"{name}_lo"), row.get(f"{name}_hi")
    bounds = "" if lo is None or hi is None else f" [{fmt(lo, digits)}, {fmt(hi, digits)}]"
    return f"{fmt(row.get(name), digits)}{bounds}"


def notes(stderr: str) -> list[str]:
    """The ``note:`` lines a command printed, without the prefix."""
    return [line.removeprefix("note: ") for line in stderr.splitlines() if line.startswith("note: ")]


def head_effects(db: str, run: str) -> tuple[list[dict], list[str]]:
    """The run's effects as `headatlas effects RUN` shows them (``run.effects()``: the same query,
    without loading the model, so that an analysis stopped early can be read too): one row per
    head with its intervals, ``<effect>_layer``, role and noise_share; and the table's notes (what
    the effects are measured against, how many heads' intervals lie above 0)."""
    # in a process of its own, as every command here: a DuckDB file takes one process at a time
    read = (
        "import json, sys, headatlas; t = headatlas.connect(sys.argv[1]).run(sys.argv[2]).effects(ci=True); "
        "print(json.dumps({'rows': t.arrow.to_pylist(), 'notes': list(t.notes)}))"
    )
    done = subprocess.run([sys.executable, "-c", read, db, run], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"run.effects() of {run} failed:\n{done.stderr[-3000:]}")
    found = json.loads(done.stdout)
    return found["rows"], found["notes"]


def role_effects(db: str, run: str) -> list[str]:
    """The line `query roles` prints about each role's mean effect (what the effects are is in
    ``head_effects``' notes)."""
    out = cli("query", "roles", "--run", run, "--db", db).stdout
    return [line for line in out.splitlines() if line.startswith("mean effect")]


def until_lines(db: str, run: str, orders: list[str], until: str) -> list[str]:
    """`prune RUN --show --order O --until X` for each order with a cumulative curve: how many heads
    that order removes before the objective rises by X (the removed heads named for the first only)."""
    out = []
    for k, order in enumerate(orders):
        said = cli("prune", run, "--db", db, "--show", "--order", order, "--until", until).stderr
        line = next(x for x in said.splitlines() if x.startswith("until "))
        out.append(line if k == 0 else re.sub(r"; removed: .*$", "", line))
    return out


def curve_table(prune: list[dict], orders: list[str], column: str, digits: int = 3) -> list[str]:
    steps = sorted({r["step"] for r in prune if r["order"] in orders})
    lines = ["| step (heads removed) | " + " | ".join(orders) + " |", "|---|" + "---|" * len(orders)]
    for step in steps:
        here = {r["order"]: r for r in prune if r["step"] == step and r["order"] in orders}
        removed = next(r["heads_removed"] for r in here.values())
        cells = [ci(here[o], column, digits) if o in here else "" for o in orders]
        lines.append(f"| {step} ({removed}, {next(iter(here.values()))['fraction']:.0%}) | " + " | ".join(cells) + " |")
    return lines


def area(prune: list[dict], order: str) -> float:
    """Trapezoids of an order's mean increase over the share removed (the claim's measure, no interval)."""
    rows = sorted((r for r in prune if r["order"] == order), key=lambda r: r["fraction"])
    return sum((b["fraction"] - a["fraction"]) * (a["increase"] + b["increase"]) / 2 for a, b in zip(rows, rows[1:]))


def model_section(
    db: str, run: str, model: str, seconds: float, figure: Path, options: str, documents: int, until: str
) -> list[str]:
    heads, said = head_effects(db, run)
    kinds = [k for k in ("effect_mean", "effect_zero", "importance") if heads[0].get(k) is not None]
    main = kinds[0]
    ranked = sorted(heads, key=lambda h: -h[main])
    layers = 1 + max(h["layer"] for h in heads)
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
        "**How many heads matter individually** (`headatlas effects RUN`'s notes, as `run.effects()` gives them):",
        "",
        *[f"- {note}" for note in said],
        "",
        f"Top heads by {main} (`headatlas effects RUN --format json`, largest first): raw, and normalised within the "
        f"layer "
        f"({main}_layer = v / ‖v of the layer's heads‖₂, Michel et al.), with the head's primary role and "
        "noise_share:",
        "",
        "| layer | head | role | " + " | ".join(f"{k} | {k}_layer" for k in kinds) + " | noise_share |",
        "|---|---|---|" + "---|---|" * len(kinds) + "---|",
    ]
    for h in ranked[:8]:
        cells = " | ".join(f"{ci(h, k)} | {ci(h, f'{k}_layer')}" for k in kinds)
        lines.append(f"| {h['layer']} | {h['head']} | {h['role'] or '–'} | {cells} | {h['noise_share']:.3f} |")
    lines += [
        "",
        f"Per layer: its head of largest {main}, raw and normalised, and the layer's mean {main} "
        "(over its heads, without an interval):",
        "",
        f"| layer | head | role | {main} | {main}_layer | layer's mean {main} |",
        "|---|---|---|---|---|---|",
    ]
    for layer in range(layers):
        mine = [h for h in heads if h["layer"] == layer]
        top = max(mine, key=lambda h: h[main])
        mean = sum(h[main] for h in mine) / len(mine)
        lines.append(
            f"| {layer} | {top['head']} | {top['role'] or '–'} | {ci(top, main)} | {ci(top, f'{main}_layer')} "
            f"| {fmt(mean)} |"
        )
    lines += ["", "**Effects joined with roles** (`headatlas query roles`):", ""]
    lines += [f"- {line}" for line in role_effects(db, run)]

    done = cli("prune", run, "--db", db, "--show", "--format", "json")
    prune = json.loads(done.stdout)
    said_prune = notes(done.stderr)
    claim = next(n for n in said_prune if n.startswith("prune "))
    rest = [n for n in said_prune if n != claim]
    orders = list(dict.fromkeys(r["order"] for r in prune))
    cumulative = [o for o in orders if o != "one_per_layer"]
    lines += [
        "",
        f"**Pruning curves** (`headatlas prune {run} --format json`): increase of the objective over the intact "
        "model (paired, window by window), each step's heads removed together by mean ablation:",
        "",
        *curve_table(prune, cumulative, "increase"),
    ]
    if any(r.get("top1") is not None for r in prune):
        intact = next(r for r in prune if r["step"] == 0)
        lines += [
            "",
            "Neighbour retrieval along the curves (the embeddings' use, beside their drift, which rises by "
            f"construction): top1, intact {ci(intact, 'top1')}:",
            "",
            *curve_table(prune, cumulative, "top1"),
            "",
            f"mrr, intact {ci(intact, 'mrr')}:",
            "",
            *curve_table(prune, cumulative, "mrr"),
        ]
    lines += ["", f"![pruning curves of {model}](img/{figure.name})", ""]
    single = [r for r in prune if r["order"] == "one_per_layer" and r["step"] > 0]
    if single:
        r = single[-1]
        retrieval = f"; top1 {ci(r, 'top1')}, mrr {ci(r, 'mrr')}" if r.get("top1") is not None else ""
        lines.append(
            f"- **One head per layer** (order one_per_layer): {r['heads_removed']} heads removed at once, the "
            f"objective rises by {ci(r, 'increase')}{retrieval}."
        )
    ranking = sorted(cumulative, key=lambda o: area(prune, o))
    lines.append(
        "- Orders by the area under their increase (trapezoids over the share removed, smallest first; the "
        "points, whose intervals the verdict below gives for noise): "
        + ", ".join(f"{o} {area(prune, o):+.4g}" for o in ranking)
        + "."
    )
    firsts = [o for o in ("effect", "importance") if o in cumulative]
    others = [o for o in cumulative if not o.startswith("random") and o not in firsts]
    asked = [*firsts, *others, *(["random"] if any(o.startswith("random") for o in cumulative) else [])]
    lines.append(f"- **How many heads can go** (`headatlas prune {run} --show --order ORDER --until {until}`):")
    lines += [f"  - {line}" for line in until_lines(db, run, asked, until)]
    lines += [f"- **Which order wins** (the prune's verdict): {claim}"]
    lines += [f"- {note}" for note in rest]
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", type=Path, default=None)
    parser.add_argument("--doc-chars", type=int, default=800)
    parser.add_argument("--models", default="default,smollm2")
    parser.add_argument("--effect-windows", default="default=64,smollm2=8")
    parser.add_argument("--kinds", default="default=mean,smollm2=mean+gradient", help="MODEL=KIND+KIND,… (+ for ,)")
    parser.add_argument("--documents", default="smollm2=40", help="MODEL=N: the corpus's first N documents")
    parser.add_argument("--seq-len", default="smollm2=64", help="MODEL=N: --seq-len of the analysis")
    parser.add_argument("--prune", default="default=16:10%,smollm2=16:25%")
    parser.add_argument("--orders", default="", help="MODEL=ORDER+ORDER,… (default: every order the run allows)")
    parser.add_argument("--until", default="10%", help="prune --until X for each order's curve")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "findings-output-effects.md")
    parser.add_argument("--db", type=Path, default=ROOT / "build" / "effect-findings.duckdb")
    parser.add_argument(
        "--reuse", action="store_true", help="Keep the database: a model analysed and pruned there is not run again."
    )
    args = parser.parse_args()
    source = args.corpus or default_corpus()
    work = args.db.parent / (args.db.stem + "-work")
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
    made = (
        f"`python benchmarks/effect_findings.py --doc-chars {args.doc_chars} --models {args.models} "
        f"--effect-windows {args.effect_windows} --kinds {args.kinds} --documents {args.documents} "
        f"--seq-len {args.seq_len} --prune {args.prune}"
        + (f" --orders {args.orders}" if args.orders else "")
        + f" --until {args.until}`"
    )
    lines = [
        f"## Findings: which heads matter (SPEC §9), {'SmolLM2, ' if args.models == 'smollm2' else ''}`{source.name}`",
        "",
        f"Made by {made} on {datetime.now(UTC).date()} ({machine()}). Corpus: {source.name}, each document cut "
        f"under {args.doc_chars} characters, one window per document (--windowing first): {documents} documents. "
        "Effects are O(ablated) − O(intact) in the model's own objective; 95 % intervals, replicate groups by "
        "document, an effect's over the groups that hold its effect windows (spread over the groups: "
        "--effect-spread groups).",
        "",
        f"What Michel et al. asked: {MICHEL}",
        "",
        f"What the seed paper claims: {SEED_CLAIM}",
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
        seconds = next((r["wall_s"] for r in listed if r["name"] == run), None) or time.perf_counter() - began
        if (
            not done
            or subprocess.run(
                [sys.executable, "-m", "headatlas.cli.main", "prune", run, "--db", db, "--show"], capture_output=True
            ).returncode
        ):
            print(f"{model}: pruning …", file=sys.stderr)
            chosen = ["--order", orders] if orders else []
            cli("prune", run, "--db", db, "--windows", prune_windows, "--step", step, *chosen, "--out", str(figure))
        lines += model_section(db, run, model, seconds, figure, options, model_docs, args.until)
    text = "\n".join(lines) + "\n"
    args.out.write_text(text, encoding="utf-8")
    print(text)
    if copy_into(FINDINGS_PAGE, args.out, text):
        print(f"and copied into {FINDINGS_PAGE}: now check its prose against it", file=sys.stderr)


if __name__ == "__main__":
    main()
