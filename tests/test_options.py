"""Each analysis option is declared once (service/analysis_options.py): every command that takes
it exposes it with the declared default, help and environment variable, and AnalysisParams
parses and validates what any of them was given. Settings are read when a command runs, from
Typer's own ``envvar``, and reach the workers as an argument, never through os.environ."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import click
import pytest
import typer.main
from typer.testing import CliRunner

from headatlas.cli.main import app
from headatlas.service.analysis_options import BY_NAME, DEFAULTS, OPTIONS, PARAM_NAMES, build_params
from headatlas.service.errors import ParameterError
from headatlas.service.params import AnalysisParams, Selection

ALL = {o.name for o in OPTIONS}
# the analysis options each command offers (the rest take their declared defaults)
OFFERED = {
    ("analyze",): ALL,
    ("submit",): ALL - {"device"},  # the workers' device is theirs
    # a schedule's fires submit no probe (SPEC §8): a run's probe comes from analyze or submit
    ("schedule", "add"): ALL - {"device", "text_field", "encoding", "probe", "probe_length", "probe_sequences"},
    # one window, no statistics stored: nothing that batches, gates or counts
    ("inspect",): ALL
    - {
        "dtype",
        "batch_size",
        "windowing",
        "max_windows",
        "gate",
        "short_range",
        "attribution",
        "attribution_windows",
        "mixing",
        "csm_bin",
        "probe",
        "probe_length",
        "probe_sequences",
        "replicates",  # one window: no intervals
        "effects",  # nothing stored: `headatlas effects` measures them
        "effect_windows",
        "effect_spread",
        "effect_reference",
        "objective",
        "measures",  # nothing stored
        "examples",  # nothing stored: one window is the example
    },
    ("demo",): {"model", "device", "batch_size"},
}
WIDE = {"COLUMNS": "300", "TERMINAL_WIDTH": "300", "NO_COLOR": "1"}


def command(path: tuple[str, ...]) -> click.Command:
    found = typer.main.get_command(app)
    for name in path:
        found = found.commands[name]
    return found


def invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, list(args), env={**WIDE, **(env or {})})


@pytest.mark.parametrize("path", list(OFFERED), ids=" ".join)
def test_each_command_offers_exactly_its_declared_options(path):
    params = {p.name: p for p in command(path).params}
    assert {name for name in params if name in ALL} == OFFERED[path]
    for name in OFFERED[path]:
        declared, param = BY_NAME[name], params[name]
        assert param.opts[0] == declared.flag
        assert param.opts == [declared.flag, *declared.aliases, *([declared.short] if declared.short else [])], name
        default = param.default if declared.type != list[str] else tuple(param.default)
        assert default == declared.default, name
        assert param.envvar == declared.envvar, name
        assert param.type_descriptor.annotation == declared.type, name  # one type wherever it is offered
    assert "analysis" not in params  # the options object is built, never offered


def test_batch_size_has_one_type_and_accepts_auto_everywhere():
    from headatlas.service.analysis_options import parse_batch_size

    kinds = {
        next(p for p in command(path).params if p.name == "batch_size").type_descriptor.annotation
        for path in OFFERED
        if "batch_size" in OFFERED[path]
    }
    assert kinds == {str}
    assert parse_batch_size("auto") == "auto"
    assert parse_batch_size("auto", queued=True) == 32  # batches are cut before a worker is known
    assert parse_batch_size(" 8 ") == 8
    for bad in ("0", "-1", "many", "1.5"):
        with pytest.raises(ParameterError, match="--batch-size"):
            parse_batch_size(bad)


def test_help_shows_the_environment_variable_and_the_spec_section():
    out = invoke("analyze", "--help").output
    for variable in ("HEADATLAS_DB", "HEADATLAS_MODEL", "HEADATLAS_DEVICE", "HEADATLAS_BATCH_SIZE"):
        assert f"[env var: {variable}]" in out, variable
    assert "(SPEC §3)" in out and "[default: top:0.02]" in out
    assert "[env HEADATLAS" not in out


def test_schedule_edit_model_has_no_default_to_stand_in():
    # an environment variable there would change the model of every schedule edited
    model = next(p for p in command(("schedule", "edit")).params if p.name == "model")
    assert model.default is None and model.envvar is None


def test_analysis_params_take_their_defaults_from_the_declaration():
    assert {f.name for f in fields(AnalysisParams)} == set(PARAM_NAMES)
    assert AnalysisParams() == build_params()
    assert AnalysisParams().select == Selection.parse(DEFAULTS["select"])
    for f in fields(AnalysisParams):
        if f.name not in ("select", "mixing", "attribution_windows"):
            assert getattr(AnalysisParams(), f.name) == DEFAULTS[f.name], f.name
    # no declared number: it depends on --attribution (tests/test_attribution_budget.py)
    assert DEFAULTS["attribution_windows"] is None
    with pytest.raises(ParameterError, match="unknown option 'seqlen'"):
        build_params(seqlen=64)


@pytest.mark.parametrize(
    "flag, value",
    [("--seq-len", "2"), ("--select", "top:7"), ("--vectors", "post"), ("--mixing", "rollout,nope")],
)
def test_every_command_validates_through_analysis_params(tmp_path, flag, value):
    corpus = tmp_path / "c.txt"
    corpus.write_text("One sentence. Another one.\n", encoding="utf-8")
    db = str(tmp_path / "x.duckdb")
    key = flag[2:].replace("-", "_")
    with pytest.raises(ParameterError) as raised:
        build_params(**{key: [value] if key == "mixing" else int(value) if key == "seq_len" else value})
    expected = f"error: {raised.value}"
    lines = {
        "analyze": ["analyze", str(corpus), flag, value, "--db", db],
        "submit": ["submit", str(corpus), flag, value, "--db", db, "--broker", "redis://127.0.0.1:1/0"],
        "schedule add": ["schedule", "add", "s", "--corpus", str(corpus), "--every", "1h", flag, value, "--db", db],
        "inspect": ["inspect", "some text", "--out", str(tmp_path / "f.png"), flag, value],
    }
    for name, args in lines.items():
        if flag[2:].replace("-", "_") not in OFFERED[tuple(name.split())]:
            continue
        done = invoke(*args)
        assert done.exit_code == 2, (name, done.output)
        assert done.output.strip().splitlines()[-1] == expected, name
    assert not os.path.exists(db)  # refused before anything was opened


def test_a_bad_setting_is_a_one_line_error_when_the_command_runs():
    env = {**os.environ, "HEADATLAS_MAX_ATTEMPTS": "many", "HEADATLAS_BATCH_SIZE": "lots"}
    imported = subprocess.run(
        [sys.executable, "-c", "import headatlas.cli.main"], env=env, capture_output=True, text=True, timeout=120
    )
    assert imported.returncode == 0, imported.stderr  # nothing is read at import
    done = invoke("analyze", "x.txt", env={"HEADATLAS_MAX_ATTEMPTS": "many"})
    assert done.exit_code == 2
    assert done.output.strip() == "error: HEADATLAS_MAX_ATTEMPTS='many': expected an integer from 1 to 100"
    done = invoke("analyze", "x.txt", env={"HEADATLAS_BATCH_SIZE": "lots"})
    assert done.exit_code == 2 and done.output.strip() == "error: --batch-size 'lots': use a positive integer or auto"
    done = invoke("sql", "SELECT 1", env={"HEADATLAS_SQL_MAX_ROWS": "all"})
    assert done.exit_code == 2 and len(done.output.strip().splitlines()) == 1 and "--max-rows" in done.output


def test_settings_reach_the_writer_and_workers_as_an_argument(monkeypatch, tmp_path):
    from headatlas.workers import launch

    seen = {}
    monkeypatch.setattr(launch, "run_writer", lambda settings: seen.update(writer=settings))
    monkeypatch.setattr(launch, "run_worker", lambda settings, **kw: seen.update(worker=settings, **kw))
    before = {k: v for k, v in os.environ.items() if k.startswith("HEADATLAS_")}
    db, broker = str(tmp_path / "w.duckdb"), "redis://example.invalid:6390/2"
    assert invoke("writer", "--db", db, "--broker", broker).exit_code == 0
    assert invoke("worker", "--device", "cpu", "--broker", broker, env={"HEADATLAS_MAX_ATTEMPTS": "7"}).exit_code == 0
    assert (seen["writer"].db, seen["writer"].broker_url) == (db, broker)
    assert (seen["worker"].device, seen["worker"].broker_url, seen["worker"].max_attempts) == ("cpu", broker, 7)
    assert {k: v for k, v in os.environ.items() if k.startswith("HEADATLAS_")} == before


def test_the_usage_page_states_the_declared_defaults():
    page = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text(encoding="utf-8")
    stated = dict(re.findall(r"^\| `(--[a-z-]+)` \| ([^|]+) \|", page, flags=re.M))
    checked = 0
    for option in OPTIONS:
        if option.flag not in stated:
            continue
        value = stated[option.flag].strip().strip("`")
        default = option.default
        accepted = {str(default), "off" if default is False else "on" if default is True else ""}
        if isinstance(default, float):
            accepted.add(f"{default:g}")
        assert value in accepted, (option.flag, value, default)
        checked += 1
    assert checked >= 10


# a value each setting refuses; several for the numbers that harmed runs when they were accepted
BAD_SETTINGS = [
    ("db", "  "),
    ("db", "runs\n.duckdb"),
    ("data_path", "lake\tfiles"),
    ("model", ""),
    ("device", "gpu"),
    ("batch_size", "0"),
    ("batch_size", "lots"),
    ("broker_url", "http://127.0.0.1:6379"),
    ("spool_dir", "spool\x1b[31m"),
    ("task_time_limit_s", "-5"),
    ("task_time_limit_s", "0"),
    ("task_time_limit_s", "nan"),
    ("task_time_limit_s", "inf"),
    ("max_attempts", "0"),
    ("max_attempts", "-1"),
    ("max_attempts", "1.5"),
    ("sql_max_rows", "0"),
    ("sql_timeout_s", "nan"),
    ("sql_timeout_s", "-1"),
    ("attribution_chunk", "0"),
    ("store_every_s", "-1"),
    ("store_every_s", "inf"),
    ("prepare_processes", "-1"),
    ("prepare_processes", "two"),
    ("prepare_processes", "4096"),
    ("lease_s", "0"),
    ("lease_s", "nan"),
    ("cache", "models\ncache"),
    ("duckdb_threads", "-1"),
    ("sql_threads", "-1"),
    ("sql_threads", "1025"),
]


@pytest.mark.parametrize("threads", ["1", "3", ""])
def test_duckdb_threads_reach_every_connection_headatlas_opens(tmp_path, monkeypatch, threads):
    """HEADATLAS_DUCKDB_THREADS sets the threads of a file's connections and a lake's (the
    conftest sets it to 1 for the suite; unset, DuckDB picks its own: one per core)."""
    import duckdb

    from headatlas.service.storage.backends import open_backend

    monkeypatch.setenv("HEADATLAS_DUCKDB_THREADS", threads)
    with duckdb.connect() as plain:
        default = plain.execute("SELECT current_setting('threads')").fetchone()[0]
    with open_backend(tmp_path / "threads.duckdb").connect() as connection:
        got = connection.execute("SELECT current_setting('threads')").fetchone()[0]
    assert got == (int(threads) if threads else default)


def test_an_address_space_cap_bounds_duckdb_within_it(tmp_path):
    """Under RLIMIT_AS (prlimit --as) DuckDB's memory limit is a share of the cap, so that it spills
    rather than failing to allocate; without a cap DuckDB keeps its own default."""
    script = (
        "from headatlas.service.storage.backends import open_backend\n"
        f"with open_backend({str(tmp_path / 'cap.duckdb')!r}).connect() as c:\n"
        "    print(c.execute(\"SELECT current_setting('memory_limit')\").fetchone()[0])"
    )
    cap = 4 << 30

    def capped() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, preexec_fn=capped)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1.0", "GiB"]  # a quarter of 4 GiB
    free = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert free.stdout.split() != ["1.0", "GiB"]


def test_every_setting_has_a_bad_value_tested():
    from headatlas.service.config import Settings

    assert {name for name, _ in BAD_SETTINGS} == {f.name for f in fields(Settings)}


@pytest.mark.parametrize("name, raw", BAD_SETTINGS)
def test_a_setting_out_of_its_range_is_refused_where_it_is_read_and_flagged_by_config(name, raw):
    from headatlas.service.config import Settings, allowed

    variable = f"HEADATLAS_{name.upper()}"
    with pytest.raises(ParameterError) as refused:
        Settings.from_env({variable: raw})
    assert str(refused.value) == f"{variable}={raw!r}: expected {allowed(name).text}"
    assert "\n" not in str(refused.value)
    try:
        value = type(Settings.default(name))(raw)
    except ValueError:
        pass  # not even of the setting's type
    else:  # built in code (a command's option over the environment): refused there too
        with pytest.raises(ParameterError, match=re.escape(variable)):
            Settings(**{name: value})
    shown = invoke("config", env={"COLUMNS": "300", variable: raw})
    assert shown.exit_code == 2
    [row] = [line for line in shown.stdout.splitlines() if line.startswith(variable)]
    assert f"BAD: expected {allowed(name).text}" in row
    assert shown.stderr.strip() == f"error: 1 bad setting: {variable}"
    assert [line for line in shown.stdout.splitlines() if "BAD" in line] == [row]


def test_config_passes_good_values():
    shown = invoke("config", env={"HEADATLAS_MAX_ATTEMPTS": "5", "HEADATLAS_TASK_TIME_LIMIT_S": "0.5"})
    assert shown.exit_code == 0 and "BAD" not in shown.stdout


@pytest.mark.parametrize(
    "command, variable, raw",
    [
        (["worker", "--device", "cpu"], "HEADATLAS_MAX_ATTEMPTS", "0"),
        (["worker", "--device", "cpu"], "HEADATLAS_TASK_TIME_LIMIT_S", "nan"),
        (["writer"], "HEADATLAS_TASK_TIME_LIMIT_S", "-5"),
        (["beat"], "HEADATLAS_MAX_ATTEMPTS", "-1"),
    ],
)
def test_processes_refuse_a_bad_setting_before_they_start(monkeypatch, tmp_path, command, variable, raw):
    from headatlas.workers import beat, launch

    started = []
    monkeypatch.setattr(launch, "run_writer", lambda settings: started.append(settings))
    monkeypatch.setattr(launch, "run_worker", lambda settings, **kw: started.append(settings))
    monkeypatch.setattr(beat.Beat, "run", lambda self: started.append(self.settings))
    env = {variable: raw, "HEADATLAS_DB": str(tmp_path / "w.duckdb"), "HEADATLAS_BROKER_URL": "redis://127.0.0.1:1/0"}
    done = CliRunner().invoke(app, command, env={**WIDE, **env})
    assert done.exit_code == 2 and started == []
    assert done.output.strip().splitlines()[-1].startswith(f"error: {variable}={raw!r}: expected ")


def test_a_bad_database_setting_never_prints_its_password():
    from headatlas.service.config import Settings

    url = "ducklake:postgres:dbname=x password=s3cr3t-Pa55 host=h\t"
    with pytest.raises(ParameterError) as refused:
        Settings.from_env({"HEADATLAS_DB": url})
    shown = invoke("config", env={"COLUMNS": "300", "HEADATLAS_DB": url})
    assert shown.exit_code == 2 and "BAD" in shown.stdout
    assert "s3cr3t" not in str(refused.value) + shown.stdout + shown.stderr


@pytest.mark.parametrize("raw", ["0", "1", "1024", "-1", "1025", "two", "1.5", " 2 "])
def test_duckdb_threads_read_by_the_storage_layer_as_the_settings_read_them(monkeypatch, raw):
    """The storage layer reads HEADATLAS_DUCKDB_THREADS itself (not through Settings, which would
    make config and storage import each other): the same values pass, the same refusal words."""
    from headatlas.service.config import Settings
    from headatlas.service.storage.duckdb_settings import configured_threads

    monkeypatch.setenv("HEADATLAS_DUCKDB_THREADS", raw)
    values, bad = Settings.read({"HEADATLAS_DUCKDB_THREADS": raw})
    if bad:
        with pytest.raises(ParameterError) as refused:
            configured_threads()
        assert str(refused.value) == bad["HEADATLAS_DUCKDB_THREADS"]
    else:
        assert configured_threads() == values["duckdb_threads"]
