"""The command line and the Python API run one analysis: the same request, the same stored runs.

Each test analyses the same corpus twice, once through ``headatlas analyze`` (in-process, typer's
CliRunner) and once through ``headatlas.analyze``, each into its own database, and compares what
the two databases hold: runs (names, keys, parameters), their per-head metrics, probes and mixing
measures. Models are ``random:tiny`` (seeded: two front ends get the same weights).
"""

from __future__ import annotations

import json
import math

import duckdb
import pytest
import typer.main
from typer.testing import CliRunner

from headatlas.cli.main import app

# every option of `headatlas analyze`, by its name (the API's keyword), with a value that is not its
# default: the command-line arguments and the Python value
EVERY_OPTION = {
    "name": (["--name", "every"], "every"),
    "model": (["--model", "random:tiny"], "random:tiny"),
    "device": (["--device", "cpu"], "cpu"),
    "dtype": (["--dtype", "bfloat16"], "bfloat16"),
    "batch_size": (["--batch-size", "3"], "3"),
    "seq_len": (["--seq-len", "24"], 24),
    "windowing": (["--windowing", "first"], "first"),
    "sentences": (["--sentences", "punct"], "punct"),
    "select": (["--select", "topk:5"], "topk:5"),
    "gate": (["--gate", "2.5"], 2.5),
    "include_special": (["--include-special"], True),
    "vectors": (["--vectors", "post_wo"], "post_wo"),
    "short_range": (["--short-range", "2"], 2),
    "attribution": (["--attribution"], True),
    "attribution_windows": (["--attribution-windows", "1"], 1),
    "mixing": (["--mixing", "rollout", "--mixing", "norm"], ["rollout", "norm"]),
    "effects": (["--effects", "zero", "--effects", "mean"], ["zero", "mean"]),
    "effect_windows": (["--effect-windows", "1"], 1),
    "effect_spread": (["--effect-spread", "first"], "first"),
    "effect_reference": (["--effect-reference", "2"], 2),
    "objective": (["--objective", "embedding_drift"], "embedding_drift"),
    "measures": (["--measures", "punct_pairs"], ["punct_pairs"]),  # the test plugins' measure
    "csm_bin": (["--csm-bin", "4"], 4),
    "examples": (["--examples", "2"], 2),
    "max_windows": (["--max-windows", "3"], 3),
    "probe": (["--probe"], True),
    "probe_length": (["--probe-length", "6"], 6),
    "probe_sequences": (["--probe-sequences", "2"], 2),
    "replicates": (["--replicates", "block:2"], "block:2"),
    "text_field": (["--text-field", "body"], "body"),
    "encoding": (["--encoding", "latin-1"], "latin-1"),
    "attribution_chunk": (["--attribution-chunk", "64"], 64),
    "control": (["--control", "1"], 1),
}
DOCS = [
    "The cat sat on the mat. It was warm, and the cat slept.",
    "A second document follows. It is short and plain, and it ends here.",
    "Mr. Smith paid 3.50 for the tea. The tea was cold.",
]
# the command line's own rendering options and what the API has in their place
RENDERING = {"quiet": (["--quiet"], ("progress", False))}


def stored(db) -> dict:
    """What a database holds, without ids or times: per run (by name) its key, parameters, model
    and status, and its head metrics, probe scores and mixing measures."""
    with duckdb.connect(str(db), read_only=True) as conn:
        runs = conn.execute("SELECT run_id, name, run_key, params, model, status FROM runs ORDER BY run_id").fetchall()
        out = {}
        for run_id, name, key, params, model, status in runs:
            rows = {}
            for table, order in (
                ("head_metrics", "layer, head"),
                ("probe_scores", "layer, head"),
                ("mixing_metrics", "method, layer, head"),
            ):
                query = conn.execute(
                    f"SELECT * EXCLUDE (run_id) FROM {table} WHERE run_id = ? ORDER BY {order}", [run_id]
                )
                columns = [c[0] for c in query.description]
                rows[table] = [dict(zip(columns, r, strict=True)) for r in query.fetchall()]
            out[name] = {"key": key, "params": json.loads(params), "model": model, "status": status, **rows}
    return out


def same(a, b) -> bool:
    """Equal, floats up to the summation order of DuckDB's parallel aggregates (last bits)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-9, abs=1e-12)
    return a == b


def test_python_control_equals_the_command_lines(tmp_path):
    """`headatlas.analyze(..., control=2)` stores what `headatlas analyze --control 2` stores: the
    run and its two random-weights controls (the first unnumbered, the next numbered), with the same
    names, keys and numbers."""
    import headatlas

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(DOCS) + "\n", encoding="utf-8")
    cli_db, api_db = tmp_path / "cli.duckdb", tmp_path / "api.duckdb"
    args = ["analyze", str(corpus), "--db", str(cli_db), "--model", "random:tiny", "--seq-len", "32"]
    done = CliRunner().invoke(app, [*args, "--name", "c", "--control", "2", "--quiet"])
    assert done.exit_code == 0, done.output
    run = headatlas.analyze(corpus, db=api_db, model="random:tiny", seq_len=32, name="c", control=2, progress=False)
    assert run.name == "c"
    mine, theirs = stored(api_db), stored(cli_db)
    assert list(mine) == list(theirs) == ["c", "c-control", "c-control-1"]
    assert [r["params"].get("control_seed") for r in mine.values()] == [None, 0, 1]
    assert all(r["status"] == "done" and len(r["head_metrics"]) == 2 * 4 for r in mine.values())
    assert same(mine, theirs)
    # the controls are other weights: their numbers are not the run's
    assert not same(mine["c"]["head_metrics"], mine["c-control"]["head_metrics"])


def test_every_option_of_analyze_is_a_keyword_of_the_python_api(tmp_path):
    """Every option `headatlas analyze` offers (read from the command itself, so a new one fails
    here until the API takes it) is a keyword of `headatlas.analyze` of the same name: given all
    at once, not at their defaults, both store the same runs, which record the values given."""
    import headatlas

    command = typer.main.get_command(app).commands["analyze"]
    # each front end its own database; --checkpoints makes a series of runs instead of one, with
    # the same options (tests/test_training_series.py)
    offered = {p.name for p in command.params if p.name not in ("corpus", "db", "checkpoints")}
    assert offered == set(EVERY_OPTION) | set(RENDERING)
    corpus = tmp_path / "c.jsonl"
    docs = ["Le café était chaud. Il faisait beau dehors.", "Une deuxième phrase suit. Elle est courte et claire."]
    corpus.write_bytes("".join(json.dumps({"body": d}, ensure_ascii=False) + "\n" for d in docs).encode("latin-1"))

    cli_db, api_db = tmp_path / "cli.duckdb", tmp_path / "api.duckdb"
    args = [arg for flags, _ in (*EVERY_OPTION.values(), *RENDERING.values()) for arg in flags]
    done = CliRunner().invoke(app, ["analyze", str(corpus), *args, "--db", str(cli_db)])
    assert done.exit_code == 0, done.output
    keywords = {name: value for name, (_, value) in EVERY_OPTION.items()}
    keywords.update(dict(value for _, value in RENDERING.values()))
    headatlas.analyze(corpus, db=api_db, **keywords)

    mine, theirs = stored(api_db), stored(cli_db)
    assert list(mine) == ["every", "every-control"]
    assert same(mine, theirs)
    params = mine["every"]["params"]
    for name in ("seq_len", "windowing", "sentences", "select", "gate", "include_special", "vectors"):
        assert params[name] == keywords[name], name
    assert (params["short_range"], params["dtype"], params["csm_bin"], params["replicates"]) == (
        2,
        "bfloat16",
        4,
        "block:2",
    )
    assert params["examples"] == 2
    assert (params["attribution"], params["attribution_windows"], params["mixing"]) == (True, 1, ["rollout", "norm"])
    assert {r["method"] for r in mine["every"]["mixing_metrics"]} == {"attention", "attribution", "rollout", "norm"}
    assert len(mine["every"]["probe_scores"]) == 2 * 4
    assert (params["effects"], params["effect_windows"], params["effect_reference"]) == (["zero", "mean"], 1, 2)
    assert params["objective"] == "embedding_drift"
    assert params["measures"] == ["punct_pairs"]
    assert all(r["both_punct_share"] is not None for r in mine["every"]["head_metrics"] if r["high_pairs"])
    assert all(r["effect_mean"] is not None for r in mine["every"]["head_metrics"])
