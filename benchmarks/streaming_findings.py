"""The seed paper's long-range claim in the terms of SPEC §10 (streaming heads), measured on SmolLM2.

    nice -n 10 python benchmarks/streaming_findings.py [--model smollm2] [--corpus PATH] [--docs 3]
        [--stream-at 128|2048] [--windows 8] [--sink 4] [--recent 32] [--x 0.01]
        [--db build/streaming-findings.duckdb] [--out docs/findings-output-streaming.md]

The text: the corpus's first ``--docs`` documents (development corpus) that hold at least 2,047
tokens, each cut to its first 2,047 (a decoder window is BOS + 2,047 tokens), written to
``build/streaming-findings.txt``. Three commands, each reusing what an earlier sitting stored:

1. ``headatlas analyze TEXT --model M --seq-len 2048 --windowing first --replicates window``: one
   2,048-token window per document (run ``streaming-2048``), each window its own replicate group.
2. ``headatlas analyze TEXT --model M --seq-len 128 --replicates window``: the same text in
   128-token windows (run ``streaming-128``).
3. ``headatlas effects streaming-N --streaming --sink S --recent W --windows K`` (N: ``--stream-at``,
   K: ``--windows``): every KV head's streaming effect on K of that run's windows, with its
   jackknife interval over them. By default on the 128-token windows: the restarts of one
   2,048-token window cost about 46 forward passes of 2,048 tokens (roughly 27 CPU minutes on two
   cores, 2026-12-06: ``--stream-at 2048 --windows 2``, one batch, two fifths done in 21), of a
   128-token window about 46 passes of 128. At 2,048 each window is its own replicate group: K = 2
   gives intervals on one degree of freedom, K = 3 is the fewest worth running.

Per relative depth (the layers in thirds: early, middle, late), from what the runs stored:
- KV heads that can stream: the interval of their streaming effect lies below ``--x`` (in nats of
  next-token loss); KV heads that need the context: the interval lies above it; the rest unclear.
- the long-range share of high-similarity pairs (distance ≥ W, ``distance_totals``; heads summed)
  at n = 128 and n = 2,048, each against distance-matched chance (all pairs' share at distance ≥ W,
  ``pair_hist``): lift = share / chance, its interval the delete-one-window jackknife (t).

Verdict rule, fixed before the run. The claim "transformers struggle with long-range relations
across larger texts" predicts (a) that most KV heads can stream, and (b) that similar pairs are
less far-reaching, relative to chance, in long windows than in short ones. Each part: *supports*
in at least two of the three depths — (a) more than half the KV heads can stream; (b) the
2,048-token lift's interval lies below the 128-token lift's — *contradicts* in at least two —
(a) more than half need the context; (b) the 2,048-token lift's interval lies above the
128-token lift's — and is undecided otherwise. The claim is *supported* when both parts support
it, *contradicted* when both contradict it, *undecided* otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.long_range import LONG, SHORT, _corpus_default, _jackknife  # noqa: E402

DEPTHS = ("early", "middle", "late")


def cut_corpus(source: Path, model: str, docs: int, out: Path) -> tuple[Path, int]:
    """The first ``docs`` documents of ``source`` holding at least LONG − 1 tokens, each cut to its
    first LONG − 1, as a corpus at ``out``; and how many documents were skipped as shorter."""
    from headatlas.service.engine.model import load_model_info

    tokenizer = load_model_info(model).tokenizer
    kept, skipped = [], 0
    for doc in source.read_text(encoding="utf-8").split("\n\n"):
        doc = doc.strip()
        if not doc:
            continue
        enc = tokenizer(doc, add_special_tokens=False, return_offsets_mapping=True)
        if len(enc["input_ids"]) < LONG - 1:
            skipped += 1
            continue
        kept.append(doc[: enc["offset_mapping"][LONG - 2][1]])
        if len(kept) == docs:
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n".join(kept) + "\n", encoding="utf-8")
    return out, skipped


def headatlas(*args: str) -> float:
    """Run ``headatlas ARGS`` (this checkout's); its CPU seconds (children's rusage)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = [str(Path(sys.executable).with_name("headatlas")), *args]
    print("$ headatlas " + " ".join(args), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def depth_of(layer: int, n_layers: int) -> int:
    return min(2, 3 * layer // n_layers)


def far_sums(db: str, run_id: int, recent: int, n_layers: int) -> np.ndarray:
    """Per replicate group and depth: [H at distance ≥ W, H, P at distance ≥ W, P] ``[group, depth, 4]``
    (H: the run's high-similarity pairs, heads summed; P: all its pairs, counted once per layer)."""
    import duckdb

    con = duckdb.connect(db, read_only=True)
    try:
        high = con.execute(
            "SELECT rep, layer, sum(count) FILTER (WHERE distance >= ?), sum(count) FROM dist_hist "
            "WHERE run_id = ? GROUP BY rep, layer",
            [recent, run_id],
        ).fetchall()
        pairs = con.execute(
            "SELECT rep, sum(count) FILTER (WHERE distance >= ?), sum(count) FROM pair_hist WHERE run_id = ? GROUP BY rep",
            [recent, run_id],
        ).fetchall()
    finally:
        con.close()
    reps = sorted({int(r[0]) for r in high} | {int(r[0]) for r in pairs})
    slot = {r: g for g, r in enumerate(reps)}
    out = np.zeros((len(reps), 3, 4))
    for rep, layer, far, total in high:
        out[slot[int(rep)], depth_of(int(layer), n_layers), :2] += (float(far or 0), float(total or 0))
    layers_per_depth = np.bincount([depth_of(layer, n_layers) for layer in range(n_layers)], minlength=3)
    for rep, far, total in pairs:
        out[slot[int(rep)], :, 2] += float(far or 0) * layers_per_depth
        out[slot[int(rep)], :, 3] += float(total or 0) * layers_per_depth
    return out


def windows_of(db: str, run_id: int) -> int:
    import duckdb

    con = duckdb.connect(db, read_only=True)
    try:
        return int(con.execute("SELECT count(*) FROM run_windows WHERE run_id = ?", [run_id]).fetchone()[0])
    finally:
        con.close()


def lift(s: np.ndarray) -> np.ndarray:
    return (s[..., 0] / s[..., 1]) / (s[..., 2] / s[..., 3])


def part_verdict(supports: int, contradicts: int) -> str:
    return "supports" if supports >= 2 else "contradicts" if contradicts >= 2 else "undecided"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--corpus", type=Path, default=None)
    parser.add_argument("--docs", type=int, default=3)
    parser.add_argument("--stream-at", type=int, choices=(SHORT, LONG), default=SHORT, help="the run streamed")
    parser.add_argument("--windows", type=int, default=8, help="how many of its windows the streaming effects take")
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--recent", type=int, default=32)
    parser.add_argument("--x", type=float, default=0.01, help="the small loss increase X, nats")
    parser.add_argument("--db", default=str(ROOT / "build" / "streaming-findings.duckdb"))
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "findings-output-streaming.md")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: the report of what --db holds (a run cut short included)",
    )
    args = parser.parse_args()
    np.seterr(invalid="ignore", divide="ignore")  # a run not stored (--report-only): its shares are NaN
    began = time.perf_counter()
    source = args.corpus or _corpus_default()
    text, skipped = cut_corpus(source, args.model, args.docs, ROOT / "build" / "streaming-findings.txt")
    rel = text.relative_to(ROOT).as_posix()
    common = ["--model", args.model, "--replicates", "window", "--db", args.db, "--quiet"]
    cpu = (
        {}
        if args.report_only
        else {
            "analysis at 2,048": headatlas(
                "analyze",
                rel,
                "--seq-len",
                str(LONG),
                "--windowing",
                "first",
                "--batch-size",
                "1",
                "--name",
                f"streaming-{LONG}",
                *common,
            ),
            "analysis at 128": headatlas(
                "analyze", rel, "--seq-len", str(SHORT), "--name", f"streaming-{SHORT}", *common
            ),
            "streaming effects": headatlas(
                "effects",
                f"streaming-{args.stream_at}",
                "--streaming",
                "--sink",
                str(args.sink),
                "--recent",
                str(args.recent),
                "--windows",
                str(args.windows),
                "--db",
                args.db,
            ),
        }
    )
    from headatlas.service.errors import RunNotFound
    from headatlas.service.operations.runs import find_run
    from headatlas.service.operations.streaming_runs import stored_streaming
    from headatlas.service.storage.store import Store

    store = Store(args.db)
    table = stored_streaming(store, f"streaming-{args.stream_at}", args.sink, args.recent)
    assert table is not None, "the streaming effects were not stored"
    with store.checked_read() as conn:
        runs = {}
        for n in (LONG, SHORT):
            try:
                runs[n] = find_run(conn, f"streaming-{n}", any_status=True)
            except RunNotFound:  # --report-only before that analysis stored anything
                pass
    del store  # the file is read below by a connection of its own
    col = {name: i for i, name in enumerate(table.columns)}
    n_layers = 1 + max(int(row[col["layer"]]) for row in table.rows)
    counts = np.zeros((3, 3), dtype=int)  # [depth, (can stream, unclear, need)]
    for row in table.rows:
        lo, hi = row[col["effect_lo"]], row[col["effect_hi"]]
        kind = 0 if hi < args.x else 2 if lo > args.x else 1
        counts[depth_of(int(row[col["layer"]]), n_layers), kind] += 1
    none = np.zeros((0, 3, 4))
    long_sums = far_sums(args.db, runs[LONG].run_id, args.recent, n_layers) if LONG in runs else none
    short_sums = far_sums(args.db, runs[SHORT].run_id, args.recent, n_layers) if SHORT in runs else none
    long_lift, long_half = _jackknife(long_sums, lift)
    short_lift, short_half = _jackknife(short_sums, lift)
    kv = counts.sum(1)
    streams = counts[:, 0] > kv / 2
    needs = counts[:, 2] > kv / 2
    below = long_lift + long_half < short_lift - short_half
    above = long_lift - long_half > short_lift + short_half
    part_a = part_verdict(int(streams.sum()), int(needs.sum()))
    part_b = part_verdict(int(below.sum()), int(above.sum()))
    verdict = (
        "supported"
        if part_a == part_b == "supports"
        else "contradicted"
        if part_a == part_b == "contradicts"
        else "undecided"
    )

    from benchmarks.common import machine
    from benchmarks.findings import FINDINGS_PAGE, copy_into

    windows = {n: windows_of(args.db, runs[n].run_id) if n in runs else 0 for n in (LONG, SHORT)}
    lines = [
        f"### Streaming heads and the long-range claim: {args.model}, 2048-token windows against 128",
        "",
        f"Command: `nice -n 10 python benchmarks/streaming_findings.py --docs {args.docs} --stream-at "
        f"{args.stream_at} --windows {args.windows} --sink {args.sink} "
        f"--recent {args.recent} --x {args.x:g}{' --report-only' if args.report_only else ''}` on `{source.name}`, "
        f"{datetime.date.today().isoformat()}, {machine()}; "
        + (
            f"wall {(time.perf_counter() - began) / 60:.1f} min, CPU "
            + ", ".join(f"{what} {s / 60:.1f} min" for what, s in cpu.items())
            + " (a step stored by an earlier sitting is reused and costs about nothing)."
            if cpu
            else "the report of what the three commands stored, nothing run."
        )
        + " Runs: "
        + ", ".join(
            f"streaming-{n} " + (str(getattr(runs[n].status, "value", runs[n].status)) if n in runs else "not stored")
            for n in (LONG, SHORT)
        )
        + ".",
        "",
        f"**{windows[LONG]} windows of 2,048 tokens** (the first {args.docs} documents with 2,047 tokens or "
        f"more, cut there; {skipped} shorter skipped) **and {windows[SHORT]} windows of 128 tokens over the same "
        f"text; streaming effects on {table.windows} windows of {args.stream_at:,} tokens** (up to {table.longest} "
        "tokens each). "
        f"Streaming: S = {args.sink} sinks, W = {args.recent} recent keys, every query head of a KV head; effect in "
        f"nats of next-token loss (intact mean {table.intact_mean:.4g}); 95 % intervals, jackknife over "
        f"replicate groups of windows (`--replicates window`: {short_sums.shape[0]} groups at 128 tokens, "
        f"{long_sums.shape[0]} at 2,048; the streamed windows in {table.groups}). X = {args.x:g} nats. Depths: layers in thirds "
        f"(early 0–{n_layers // 3 - 1}, middle {n_layers // 3}–{2 * n_layers // 3 - 1}, late "
        f"{2 * n_layers // 3}–{n_layers - 1}).",
        "",
        "| depth | KV heads | can stream (interval < X) | unclear | need the context (interval > X) | "
        f"long-range lift at 2,048 (d ≥ {args.recent}) | at 128 | H beyond W, 2,048 / 128 | chance, 2,048 / 128 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    long_total, short_total = long_sums.sum(0), short_sums.sum(0)
    for d, name in enumerate(DEPTHS):
        share = counts[d] / max(1, kv[d])
        lines.append(
            f"| {name} | {kv[d]} | {counts[d, 0]} of {kv[d]} ({share[0]:.2f}) | {counts[d, 1]} | "
            f"{counts[d, 2]} of {kv[d]} ({share[2]:.2f}) | "
            f"{long_lift[d]:.3f} ± {long_half[d]:.3f} | {short_lift[d]:.3f} ± {short_half[d]:.3f} | "
            f"{long_total[d, 0] / long_total[d, 1]:.3f} / {short_total[d, 0] / short_total[d, 1]:.3f} | "
            f"{long_total[d, 2] / long_total[d, 3]:.3f} / {short_total[d, 2] / short_total[d, 3]:.3f} |"
        )
    lines += [
        "",
        f"- (a) most KV heads can stream: {part_a} (more than half can stream in {int(streams.sum())} of 3 depths, "
        f"more than half need the context in {int(needs.sum())} of 3)",
        f"- (b) similar pairs less far-reaching in long windows: {part_b} (the 2,048-token lift's interval below the "
        f"128-token lift's in {int(below.sum())} of 3 depths, above it in {int(above.sum())} of 3)",
        f"- **Verdict on the seed's long-range claim: {verdict}.**",
        "",
        "Every KV head (layer, KV head: effect [interval], mass beyond S + W):",
        "",
        "```text",
    ]
    for row in table.rows:
        lines.append(
            f"{int(row[col['layer']]):>3} {int(row[col['kv_head']])}  {row[col['effect']]:+.5f} "
            f"[{row[col['effect_lo']]:+.5f}, {row[col['effect_hi']]:+.5f}]  {row[col['beyond']]:.3f}"
        )
    lines += ["```", ""]
    out_text = "\n".join(lines)
    args.out.write_text(out_text, encoding="utf-8")
    print(out_text)
    if copy_into(FINDINGS_PAGE, args.out, out_text):
        print(f"and copied into {FINDINGS_PAGE}: now check its prose against it", file=sys.stderr)


if __name__ == "__main__":
    main()
