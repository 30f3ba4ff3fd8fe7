"""The seed paper's long-range claim, measured: how much of each layer's high-similarity mass lies
beyond 128 tokens in 2,048-token windows, against distance-matched chance, and the same text read in
128-token windows.

    nice -n 10 python benchmarks/long_range.py [--model smollm2] [--corpus PATH] [--minutes 20]
                                               [--max-docs 200] [--out docs/findings-output-long-range.md]

Documents are taken in corpus order; each one long enough for a full 2,048-token window (BOS + 2,047
tokens) gives that window (``--windowing first``) and, from the same first 2,047 tokens, sixteen
128-token windows (BOS + 127 tokens each: the same text). Documents are analysed one by one until
``--minutes`` of wall time have passed (the count is printed). Selection, gate and vectors are the
defaults (top:0.02 per head, gate 4, pre_wo); ``--sentences punct`` (sentences play no part here).

Per layer (heads summed), with H the high-similarity pairs and P all pairs (SPEC §3):
- ``far`` = share of H at distance d > 128 in the 2,048-token windows; ``chance`` = share of P at
  d > 128 (the distance-matched chance: the share a head whose H were drawn from P would have);
  ``lift`` = far / chance.
- the same text in 128-token windows has no pair beyond 128: the comparison at the same relative
  range is the share of H at d > 8 (8 = 128 · 128 / 2,048, the far 15/16 of the range) against its
  chance; ``lift128``. ``ratio`` = lift / lift128: below 1, the long window's heads reach less far,
  relative to their range, than the short window's.
Intervals: delete-one-document jackknife over the documents (each gives one long window), ± t_{N−1}
(SPEC §5d with the document as the group, N groups).

Only H's distances are needed, so each layer's heads go through the engine's own selection
(``head_vectors`` then ``select_pairs_chunked``: the pairs ``analyze`` stores in ``dist_hist``) and
nothing else of ``head_statistics`` runs. Each document's sums are appended to ``--save`` (JSON
lines) as soon as it is done; ``--resume`` continues from them (documents already there are
skipped), so a loaded machine can gather windows over several sittings, and ``--minutes 0 --resume``
only writes the report.

Verdict rule, fixed before the run: the claim "transformers struggle with long-range relations
across larger texts" is *supported* when in at least two thirds of the layers the far lift's interval
lies below 1 (less high-similarity mass beyond 128 tokens than chance) and below the short window's
relative lift; *contradicted* when in at least two thirds of the layers the far lift's interval
reaches 1 or lies above it; *undecided* otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LONG, SHORT, FAR = 2048, 128, 128
SHORT_FAR = SHORT * FAR // LONG  # 8: the same share of the short window's range


def _corpus_default() -> Path:
    for base in (ROOT.parent, ROOT.parent.parent):
        path = base / "shared" / "corpora" / "wikipedia_dev.txt"
        if path.exists():
            return path
    from headatlas.service.engine.corpus import demo_corpus_path

    return demo_corpus_path()


def _layer_sums(model, windows, pad_id: int, cut: int, select) -> np.ndarray:
    """Per layer: [H beyond cut, H, P beyond cut, P], summed over ``windows`` (one batch)."""
    import torch

    from headatlas.service.engine.hooks import capture_attention
    from headatlas.service.engine.pair_selection import head_vectors, select_pairs_chunked, similarity_chunk_rows
    from headatlas.service.engine.windows import collate

    batch = collate(windows, pad_id)
    ids, mask = batch.input_ids, batch.attention_mask
    special = torch.zeros_like(ids, dtype=torch.bool)
    for tok in model_special_ids(model):
        special |= ids == tok
    in_pairs = mask.bool() & ~special
    m = in_pairs.sum(1)
    pairs_view = SimpleNamespace(in_pairs=in_pairs, n_pairs=m * (m - 1) // 2)
    # pairs of P beyond the cut, from the positions of P's tokens
    far_pairs = all_pairs = 0
    for row in in_pairs:
        pos = row.nonzero().flatten()
        d = pos[None, :] - pos[:, None]
        far_pairs += int((d > cut).sum())
        all_pairs += int((d > 0).sum())
    out: list[list[float]] = []
    rows = similarity_chunk_rows(ids.shape[0], model.n_heads, ids.shape[1])

    def on_layer(layer: int, context, attn) -> None:
        z = head_vectors(context.float(), model.n_heads)
        _values, index, chosen = select_pairs_chunked(z, pairs_view, select, rows=rows)
        n_pos = ids.shape[1]
        distance = index % n_pos - index // n_pos
        out.append([float((chosen & (distance > cut)).sum()), float(chosen.sum()), far_pairs, all_pairs])

    with torch.inference_mode(), capture_attention(model.model, on_layer=on_layer):
        model.model(input_ids=ids, attention_mask=mask)
    return np.asarray(out, dtype=np.float64)


def model_special_ids(model) -> list[int]:
    from headatlas.service.engine.windows import TokenClasses

    return sorted(TokenClasses.for_model(model).special_ids)


def _lift(s: np.ndarray) -> np.ndarray:
    """s: [..., layer, 4] summed over documents → lift per layer."""
    return (s[..., 0] / s[..., 1]) / (s[..., 2] / s[..., 3])


def _jackknife(per_doc: np.ndarray, stat) -> tuple[np.ndarray, np.ndarray]:
    """per_doc: [doc, ...]; stat(sum over docs) → estimate and half-width (95%, t_{N-1})."""
    from headatlas.service.reports.intervals import t_quantile

    n = per_doc.shape[0]
    total = per_doc.sum(0)
    estimate = stat(total)
    if n < 3:  # no interval from fewer than three documents
        return estimate, np.full_like(estimate, np.nan)
    leave = np.stack([stat(total - per_doc[i]) for i in range(n)])
    spread = np.sqrt((n - 1) / n * ((leave - leave.mean(0)) ** 2).sum(0))
    return estimate, t_quantile(0.975, n - 1) * spread


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--corpus", type=Path, default=None)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--max-docs", type=int, default=200)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "findings-output-long-range.md")
    parser.add_argument("--save", type=Path, default=ROOT / "build" / "long-range.jsonl")
    parser.add_argument("--resume", action="store_true", help="continue from the documents in --save")
    args = parser.parse_args()

    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.corpus import iter_documents
    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.windows import TokenClasses, iter_document_windows

    corpus = args.corpus or _corpus_default()
    began = time.perf_counter()
    model = tokens = None  # loaded when a document needs it (not for a report from saved sums)
    loaded_s = 0.0
    long_params = build_params(seq_len=LONG, windowing="first", sentences="punct")
    short_params = build_params(seq_len=SHORT, windowing="chunks", sentences="punct")
    saved: dict[str, dict] = {}
    if args.resume and args.save.exists():
        for line in args.save.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if row["model"] == args.model:
                saved[row["doc_id"]] = row
    elif args.save.exists():
        args.save.unlink()
    args.save.parent.mkdir(parents=True, exist_ok=True)
    per_doc_long, per_doc_short, skipped, new_docs = [], [], 0, 0
    compute_long = compute_short = 0.0
    deadline = began + args.minutes * 60
    for doc in iter_documents(str(corpus)):
        if len(per_doc_long) >= args.max_docs:
            break
        if doc.doc_id in saved:
            if saved[doc.doc_id].get("skipped"):
                skipped += 1
                continue
            per_doc_long.append(np.asarray(saved[doc.doc_id]["long"]))
            per_doc_short.append(np.asarray(saved[doc.doc_id]["short"]))
            continue
        if time.perf_counter() > deadline:
            continue  # past the time: only the documents saved by earlier sittings
        if model is None or tokens is None:
            load_began = time.perf_counter()
            model = load_model(args.model, device="cpu")
            tokens = TokenClasses.for_model(model)
            loaded_s = time.perf_counter() - load_began
        window = next(iter_document_windows(doc, model.tokenizer, tokens, model.tokenizer_key, long_params), None)
        if window is None or len(window.input_ids) < LONG:
            skipped += 1  # shorter than one full long window
            with args.save.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"model": args.model, "doc_id": doc.doc_id, "skipped": True}) + "\n")
            continue
        # the same text in short windows: the long window's tokens after BOS, 127 at a time
        body = list(window.input_ids[1:])
        short = [
            w
            for w in iter_document_windows(doc, model.tokenizer, tokens, model.tokenizer_key, short_params)
            if w.index < len(body) // (SHORT - 1)
        ]
        assert [t for w in short for t in w.input_ids[1:]] == body[: len(short) * (SHORT - 1)]
        t0 = time.perf_counter()
        long_sums = _layer_sums(model, [window], tokens.pad_id, FAR, long_params.select)
        t1 = time.perf_counter()
        short_sums = _layer_sums(model, short, tokens.pad_id, SHORT_FAR, short_params.select)
        t2 = time.perf_counter()
        compute_long += t1 - t0
        compute_short += t2 - t1
        new_docs += 1
        per_doc_long.append(long_sums)
        per_doc_short.append(short_sums)
        row = {"model": args.model, "doc_id": doc.doc_id, "long": long_sums.tolist(), "short": short_sums.tolist()}
        with args.save.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(f"document {len(per_doc_long)}: long {t1 - t0:.1f} s, short {t2 - t1:.1f} s", flush=True)
    docs = len(per_doc_long)
    if docs == 0:
        sys.exit(f"no document analysed in {args.minutes} min")
    long_docs, short_docs = np.stack(per_doc_long), np.stack(per_doc_short)  # [doc, layer, 4]
    both = np.stack([long_docs, short_docs], axis=1)  # [doc, 2, layer, 4]
    far, far_hw = _jackknife(long_docs, lambda s: s[:, 0] / s[:, 1])
    chance = long_docs.sum(0)[:, 2] / long_docs.sum(0)[:, 3]
    lift, lift_hw = _jackknife(long_docs, _lift)
    lift128, lift128_hw = _jackknife(short_docs, _lift)
    ratio, ratio_hw = _jackknife(both, lambda s: _lift(s[0]) / _lift(s[1]))
    layers = len(lift)
    below = [bool(lift[i] + lift_hw[i] < 1 and ratio[i] + ratio_hw[i] < 1) for i in range(layers)]
    reaches = [bool(lift[i] + lift_hw[i] >= 1) for i in range(layers)]
    if np.isnan(lift_hw).any():
        verdict = f"undecided ({docs} documents: too few for an interval)"
    elif sum(below) * 3 >= 2 * layers:
        verdict = "supported"
    elif sum(reaches) * 3 >= 2 * layers:
        verdict = "contradicted"
    else:
        verdict = "undecided"
    wall = time.perf_counter() - began
    lines = [
        f"### Long range: {args.model}, {LONG}-token windows against {SHORT}",
        "",
        f"Command: `nice -n 10 python benchmarks/long_range.py --model {args.model} --minutes {args.minutes:g}"
        f"{' --resume' if args.resume else ''}` ({len(saved)} documents' records read from earlier sittings) "
        f"on `{corpus.name}`, {os.cpu_count()} cores (shared), wall {wall / 60:.1f} min "
        f"(model load {loaded_s:.0f} s; this sitting: {new_docs} documents, {compute_long / max(new_docs, 1):.1f} s "
        f"per {LONG}-token window, {compute_short / max(new_docs * 16, 1):.2f} s per {SHORT}-token window).",
        "",
        f"**{docs} documents: {docs} windows of {LONG} tokens and {docs * 16} windows of {SHORT} tokens "
        f"over the same text** ({skipped} shorter documents skipped). Selection top:0.02 per head, gate 4, "
        "pre_wo; heads of a layer summed. "
        + (
            f"Intervals: 95 %, delete-one-document jackknife, t_{{{docs - 1}}}."
            if docs >= 3
            else "No intervals: fewer than three documents."
        ),
        "",
        f"| layer | H beyond {FAR} | chance (P beyond {FAR}) | lift | lift, {SHORT}-token windows "
        f"(beyond {SHORT_FAR}) | lift ÷ lift{SHORT} |",
        "|---:|---:|---:|---:|---:|---:|",
    ]

    def pm(value: float, half: float) -> str:
        return f"{value:.3f}" if np.isnan(half) else f"{value:.3f} ± {half:.3f}"

    for i in range(layers):
        lines.append(
            f"| {i} | {pm(far[i], far_hw[i])} | {chance[i]:.3f} | {pm(lift[i], lift_hw[i])} "
            f"| {pm(lift128[i], lift128_hw[i])} | {pm(ratio[i], ratio_hw[i])} |"
        )
    lines += [
        "",
        f"Layers whose far lift lies below 1 and below the short windows' relative lift: {sum(below)} of "
        f"{layers}; layers whose far lift's interval reaches 1: {sum(reaches)} of {layers}. "
        f"Verdict (rule in benchmarks/long_range.py): **{verdict}**.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    args.out.write_text(text, encoding="utf-8")
    from benchmarks.findings import FINDINGS_PAGE, copy_into

    if copy_into(FINDINGS_PAGE, args.out, text):  # docs/findings.md holds it between its markers
        print(f"copied into {FINDINGS_PAGE.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
