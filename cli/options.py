"""Options shared by several commands, declared once (help text, defaults, env variables)."""

from __future__ import annotations

import typer

from headatlas.cli.output import Format
from headatlas.service.config import Settings

SETTINGS = Settings.from_env()

Db = typer.Option(SETTINGS.db, "--db", help="DuckDB results file [env HEADATLAS_DB].")
Run = typer.Option(None, "--run", "-r", help="Run id or name (default: the latest run).")
Fmt = typer.Option(Format.table, "--format", "-f", help="Output format.")
Name = typer.Option(None, "--name", help="Run name (default: corpus name + key).")
Dtype = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16 (statistics are computed in float32).")
SeqLen = typer.Option(128, "--seq-len", help="Tokens per window, [CLS] and [SEP] included.")
Windowing = typer.Option(
    "chunks", "--windowing", help="chunks (cover each document) or first (one window per document)."
)
Sentences = typer.Option(
    "segmenter",
    "--sentences",
    help='Sentence ids: segmenter (a sentence-boundary library: "Mr." or "3.14" do not end a sentence) or punct (every . ! ? ends one; reproduces runs made before the segmenter).',
)
Select = typer.Option("top:0.02", "--select", help="High-similarity set: top:Q, ratio:R or topk:K.")
Gate = typer.Option(4.0, "--gate", help="Attention gate: a pair is attended when max(A_ij, A_ji) >= gate / n.")
IncludeSpecial = typer.Option(False, "--include-special/--no-include-special", help="Let [CLS]/[SEP] form pairs.")
Vectors = typer.Option("pre_wo", "--vectors", help="pre_wo (head output before W_O) or post_wo (after).")
ShortRange = typer.Option(4, "--short-range", help="Distance counted as short range in short_range_share.")
TextField = typer.Option("text", "--text-field", help="JSONL field / CSV column holding the text.")
Encoding = typer.Option("utf-8", "--encoding", help="Text encoding of the corpus files.")
Attribution = typer.Option(
    False,
    "--attribution/--no-attribution",
    help="Gradient attribution per head to the input tokens (costly: one backward pass per layer, head and token).",
)
AttributionWindows = typer.Option(
    256, "--attribution-windows", min=0, help="Only the run's first N windows get --attribution / --mixing."
)
Mixing = typer.Option(
    [], "--mixing", help="Forward-only mixing measures: rollout, norm, alti (repeat or comma-separate)."
)
CsmBin = typer.Option(
    8,
    "--csm-bin",
    min=0,
    help="Corpus-averaged similarity matrices: positions per bin (1 = full resolution: a larger payload; 0 = none).",
)
