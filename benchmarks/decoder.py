"""A decoder on CPU (SPEC §8): SmolLM2-135M's full analysis against its bare forward pass, its
loads, and the peak memory of the process.

    python benchmarks/decoder.py [--model smollm2] [--windows 32] [--batch-size 16] [--repeats 3]

- First load (the GGUF file converted into a fresh cache folder) and cached load (the same
  folder again), each in a process of its own: seconds and that process's peak resident memory
  (``ru_maxrss``).
- Bare forward vs full analysis on the same windows (seq_len 128, one batch size): (a) the
  model's forward pass alone, inference mode; (b) ``analyze_corpus`` end to end into a fresh
  DuckDB file. Interleaved repeats after a warm-up of each; medians; the ratio is (b) / (a).
  Target ≤ 1.3.
- Where the time goes (``--breakdown``, or whenever the ratio is over 1.3): the forward pass with
  the capture hooks, ``analyze_batch`` (hooks + statistics), and one layer's statistics in parts
  (times the layer count: all layers).
- Peak memory: this process's ``ru_maxrss`` after everything (the model, the windows, the runs).

``--cache DIR`` reuses a converted cache instead of converting into a temporary one (then the
first-load row is the cached load too); ``--no-loads`` skips the load rows.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Timer, corpus_prefix, default_corpus, forward_passes, machine, median  # noqa: E402

TARGET = 1.3
LOAD_SNIPPET = """
import json, resource, sys, time
t = time.perf_counter()
from headatlas.service.engine.model import load_model
model = load_model(sys.argv[1], device="cpu")
print(json.dumps({"seconds": time.perf_counter() - t, "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def load_in_process(spec: str, cache: Path) -> dict:
    """Load ``spec`` in a fresh interpreter with ``HEADATLAS_CACHE=cache``: seconds (imports
    included) and the process's peak memory."""
    env = {**os.environ, "HEADATLAS_CACHE": str(cache), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", LOAD_SNIPPET, spec], env=env, capture_output=True, text=True)
    if done.returncode != 0:  # e.g. the named model's package is not installed: say why, measure nothing
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"--model {spec} does not load here: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def breakdown(model, batches, params, tokens, repeats: int) -> list[str]:
    """The forward pass with hooks, ``analyze_batch``, and one middle layer's statistics in parts."""
    import torch

    from headatlas.service.engine import features, pair_selection, stats
    from headatlas.service.engine.analysis import forward
    from headatlas.service.engine.hooks import act_name

    runs = forward_passes(model, batches, params, tokens, repeats)
    base = median(runs["bare forward"])
    lines = [f"{'pass':<18} {'s':>7} {'× bare':>7}"]
    lines += [f"{name:<18} {median(s):>7.2f} {median(s) / base:>7.2f}" for name, s in runs.items()]

    layer = model.n_layers // 2
    b = batches[0]
    acts = forward(model, b)
    with torch.inference_mode():
        feats = features.window_features(
            b.input_ids, b.attention_mask, tokens, workspace=features.Workspace(), causal=model.causal
        )
        z = pair_selection.head_vectors(acts[act_name("z", layer)], model.n_heads)
        attn = acts[act_name("pattern", layer)]
        sim = pair_selection.masked_similarity(z, feats)
        parts = {
            "similarity matrix": lambda: pair_selection.masked_similarity(z, feats),
            "top-k selection": lambda: pair_selection.select_pairs(sim, feats, params.select),
            "attention sums": lambda: stats.attention_sums(attn, feats, work=feats.workspace),
            "head_statistics": lambda: stats.head_statistics(
                z, attn, feats, select=params.select, gate=params.gate, seq_len=params.seq_len
            ),
        }
        lines.append(f"layer {layer}, one batch of {len(b.windows)} (× {model.n_layers} layers: all of them), s")
        for name, fn in parts.items():
            fn()
            seconds = median([_time(fn) for _ in range(repeats)])
            lines.append(f"  {name:<20} {seconds:>7.3f}  (× {model.n_layers}: {seconds * model.n_layers:.2f})")
    return lines


def _time(fn) -> float:
    with Timer() as t:
        fn()
    return t.seconds


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--windows", type=int, default=32, help="about this many 128-token windows")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", default=None, help="a converted cache to reuse (default: convert into a fresh one)")
    parser.add_argument("--no-loads", action="store_true", help="skip the first-load and cached-load rows")
    parser.add_argument("--breakdown", action="store_true", help="always say where the time goes")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cache = Path(args.cache) if args.cache else tmp / "cache"
        result: dict = {"model": args.model}
        print(f"# {machine()}; model {args.model}; seq_len 128; batch {args.batch_size}; medians of {args.repeats}")
        if not args.no_loads:
            first = load_in_process(args.model, cache)
            cached = load_in_process(args.model, cache)
            result.update(first_load=first, cached_load=cached)
            what = "cached (--cache)" if args.cache else "conversion into a fresh cache"
            print(f"first load, {what}: {first['seconds']:.1f} s, peak {first['maxrss_mb']:.0f} MB")
            print(f"cached load: {cached['seconds']:.1f} s, peak {cached['maxrss_mb']:.0f} MB")
        os.environ["HEADATLAS_CACHE"] = str(cache)

        import torch

        from headatlas.service.engine.model import load_model
        from headatlas.service.engine.run_plan import iter_batches, survey_corpus
        from headatlas.service.engine.windows import TokenClasses
        from headatlas.service.operations.embedded_run import analyze_corpus
        from headatlas.service.params import AnalysisParams
        from headatlas.service.storage.store import Store

        model = load_model(args.model, device="cpu")
        params = AnalysisParams()
        tokens = TokenClasses.for_model(model)
        corpus = corpus_prefix(default_corpus(), args.windows * 560, tmp / "bench.txt")
        batches = [b for b, _, _ in iter_batches(str(corpus), model, params, tokens, batch_size=args.batch_size)]
        windows = sum(len(b.windows) for b in batches)
        summary = survey_corpus(str(corpus))

        def bare():
            with torch.inference_mode():
                for b in batches:
                    model.model(input_ids=b.input_ids, attention_mask=b.attention_mask)

        def full(k: int):
            store = Store(tmp / f"bench-{k}.duckdb")
            store.ensure_schema()  # a new database's set-up, not part of an analysis
            with Timer() as t:
                analyze_corpus(
                    str(corpus), store=store, model=model, params=params, corpus=summary, batch_size=args.batch_size
                )
            return t.seconds

        bare()
        full(-1)  # warm-ups
        bare_s, full_s = [], []
        for k in range(args.repeats):  # interleaved: drifts in machine load hit both
            bare_s.append(_time(bare))
            full_s.append(full(k))
        ratio = median(full_s) / median(bare_s)
        ratios = sorted(f / b for f, b in zip(full_s, bare_s))
        result.update(
            windows=windows,
            bare_s=median(bare_s),
            full_s=median(full_s),
            ratio=ratio,
            ratio_range=[ratios[0], ratios[-1]],
        )
        print(
            f"{model.name} ({model.n_layers} layers × {model.n_heads} heads, {model.n_kv_heads} key-value heads, "
            f"d_head {model.d_head}): {windows} windows; bare forward {median(bare_s):.2f} s "
            f"({median(bare_s) / windows * 1000:.0f} ms/window), full analysis {median(full_s):.2f} s "
            f"({median(full_s) / windows * 1000:.0f} ms/window); ratio {ratio:.2f} "
            f"(repeats {ratios[0]:.2f}–{ratios[-1]:.2f}; target ≤ {TARGET})"
        )
        if args.breakdown or ratio > TARGET:
            print("where the time goes:")
            print("\n".join(breakdown(model, batches, params, tokens, args.repeats)))
        result["peak_mb"] = peak_mb()
        print(f"peak memory of this process (ru_maxrss): {result['peak_mb']:.0f} MB")
    return result


if __name__ == "__main__":
    main()
