"""Share of a token's layer-l representation attributed to its own input token, per layer.

Layer-level gradient attribution (service.measures.attribution, the block output's row) on the first
windows of a corpus (default: the shipped demo text), the quantity Brunner et al. 2020 report
for BERT-base (median near 7.5% in the last layer). Prints per layer the median, quartiles and
mean of ĝ_ii over all non-special tokens, and the same for the runner-up neighbours.

    python benchmarks/self_share.py --windows 6 --model default
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from headatlas.service.engine.corpus import demo_corpus_path, iter_documents  # noqa: E402
from headatlas.service.engine.model import load_model  # noqa: E402
from headatlas.service.engine.windows import TokenClasses, collate, document_windows  # noqa: E402
from headatlas.service.measures.attribution import gradient_norms, normalise_rows  # noqa: E402
from headatlas.service.params import AnalysisParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=str(demo_corpus_path()))
    parser.add_argument("--model", default="default")
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--per-call", type=int, default=2, help="windows per attribution call")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, device="cpu")
    tokens = TokenClasses.from_tokenizer(model.tokenizer)
    params = AnalysisParams(seq_len=args.seq_len)
    windows = []
    for doc in iter_documents(args.corpus):
        windows += document_windows(doc, model.tokenizer, tokens, model.tokenizer_key, params)
        if len(windows) >= args.windows:
            break
    windows = windows[: args.windows]
    selfs = [[] for _ in range(model.n_layers)]
    neighbours = [[] for _ in range(model.n_layers)]
    started = time.perf_counter()
    for start in range(0, len(windows), args.per_call):
        batch = collate(windows[start : start + args.per_call], tokens.pad_id)
        g = normalise_rows(gradient_norms(model, batch.input_ids, batch.attention_mask, heads=False, hidden=True))
        rows = g[:, :, 0]  # [batch, layer, pos, key]
        for b, w in enumerate(batch.windows):
            n = len(w.input_ids)
            inner = torch.arange(1, n - 1)  # skip [CLS] and [SEP] as output tokens
            for layer in range(model.n_layers):
                r = rows[b, layer]
                selfs[layer].append(r[inner, inner])
                neighbours[layer].append(0.5 * (r[inner, inner - 1] + r[inner, inner + 1]))
        print(
            f"  {start + len(batch.windows)}/{len(windows)} windows, {time.perf_counter() - started:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    elapsed = time.perf_counter() - started
    print(
        f"model {model.name}; {len(windows)} windows of <= {args.seq_len} tokens, "
        f"{sum(len(w.input_ids) - 2 for w in windows)} output tokens; {elapsed:.0f} s"
    )
    print("layer  self_median  self_q25  self_q75  self_mean  neighbour_mean")
    for layer in range(model.n_layers):
        s = torch.cat(selfs[layer])
        nb = torch.cat(neighbours[layer])
        q = torch.quantile(s, torch.tensor([0.25, 0.5, 0.75]))
        print(f"{layer:5d}  {q[1]:11.4f}  {q[0]:8.4f}  {q[2]:8.4f}  {s.mean():9.4f}  {nb.mean():14.4f}")


if __name__ == "__main__":
    main()
