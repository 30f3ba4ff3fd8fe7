"""Where a command's CPU goes, by what headatlas was doing: every Python process the command
starts counts the process CPU (``time.process_time``) of a few operations and of every SQL
statement it executes, and the counts are summed over the processes.

    python benchmarks/suite_operations.py [--top 25] [--callers 40] -- .venv/bin/python -m pytest -q -n 3 --dist loadgroup

How: a ``sitecustomize`` module put first on ``PYTHONPATH`` (so every Python process of the
command imports it, the pytest workers, the console scripts and snippets the tests start, and the
processes the queue tests' launcher forks alike) wraps, as each module is imported, a finished run's
derivation (``reports.stored.derive``), a file's attach and detach (``file_instances.attach``,
``release``), a model's load (``engine.model.load_model``) and one batch's forward pass and measures
(``engine.analysis.analyze_batch``), and times every statement SQLAlchemy executes (its
``before/after_cursor_execute`` events). Statements are classed: those that read the metric views
(a ``*_reps`` or ``*_metrics`` view, ``head_totals``, ``chance_totals``: the view chain DuckDB plans
at each such read), writes (``INSERT``, ``UPDATE``, ``DELETE``), the rest; and, separately, within a
derivation or not. Operations nest (a derivation's statements are counted as statements too).

Each process writes its counts when it exits (``atexit``, and ``os._exit``, by which the console
script, the queue tests' launcher's forks and the sandbox's children end; a forked child starts
counting from nothing): a process killed (``kill -9`` in the fault tests) or whose ``os._exit`` was
bound before this module ran is missed, so the forked processes' figures are a lower bound. The counting itself
costs CPU (a few µs a statement); compare shares, not the command's total, with a run without it.
Prints the calls, CPU seconds and milliseconds a call of each operation and class, then the
``--top`` statements by CPU (their first 100 characters, whitespace folded).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import command_after_dashes  # noqa: E402

SITECUSTOMIZE = r"""
import atexit, functools, importlib.abc, importlib.util, os, re, sys, time

_OUT = os.environ.get("HEADATLAS_OPERATIONS_DIR")
_COUNTS = {}
_IN_DERIVE = [0]
_PROCESS_START = [0.0]  # the process's CPU clock where its counting began
_VIEWS = re.compile(r"\b\w+_reps\b|\b\w+_metrics\b|\bhead_totals\b|\bchance_totals\b")


def _add(key, seconds):
    entry = _COUNTS.setdefault(key, [0, 0.0])
    entry[0] += 1
    entry[1] += seconds


def _dump():
    if not _COUNTS:
        return
    _add("op\t(the whole of each process counted)", time.process_time() - _PROCESS_START[0])
    with open(os.path.join(_OUT, f"{os.getpid()}-{time.monotonic_ns()}.tsv"), "w") as out:
        for key, (n, s) in _COUNTS.items():
            out.write(f"{key}\t{n}\t{s!r}\n")


def _timed(name, fn, derive=False):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.process_time()
        if derive:
            _IN_DERIVE[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            if derive:
                _IN_DERIVE[0] -= 1
            _add("op\t" + name, time.process_time() - start)

    return wrapper


def _before(conn, cursor, statement, params, context, executemany):
    context._headatlas_started = time.process_time()


def _after(conn, cursor, statement, params, context, executemany):
    started = getattr(context, "_headatlas_started", None)
    if started is None:
        return
    seconds = time.process_time() - started
    folded = " ".join(statement.split())
    lowered = folded.lower()
    if lowered.startswith(("insert", "update", "delete")):
        kind = "writes"
    elif _VIEWS.search(lowered):
        kind = "reads of the metric views"
    else:
        kind = "other statements"
    where = "within a derivation" if _IN_DERIVE[0] else "outside a derivation"
    _add(f"sql\t{kind}, {where}", seconds)
    if kind == "reads of the metric views" and not _IN_DERIVE[0]:
        _add("caller\t" + _caller(), seconds)
    _add("stmt\t" + folded[:100], seconds)


def _caller():
    # who read the views: the innermost headatlas function outside storage and the reports' shared
    # helpers (the reader that asked), and the test function, as `module.function <- file.py::test`
    frame, product, test = sys._getframe(2), None, None
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if "/tests/" in path and frame.f_code.co_name.startswith("test_"):
            test = path.rsplit("/tests/", 1)[1] + "::" + frame.f_code.co_name
            break
        for root in ("/service/", "/cli/", "/workers/"):
            if product is None and root in path and "/site-packages/" not in path:
                module = root.strip("/") + "." + path.rsplit(root, 1)[1].removesuffix(".py").replace("/", ".")
                if not module.startswith(("service.storage.", "service.reports.query_support")):
                    product = module + "." + frame.f_code.co_name
        frame = frame.f_back
    return f"{product or '?'} <- {test or '(no test: a command or a fixture)'}"


_WRAPS = {
    "headatlas.service.reports.stored": [("derive", "a finished run's derivation", True)],
    "headatlas.service.storage.backends.file_instances": [
        ("attach", "a file attached", False),
        ("release", "a connection released (its file detached when the last)", False),
    ],
    "headatlas.service.engine.model": [("load_model", "a model loaded", False)],
    "headatlas.service.engine.analysis": [("analyze_batch", "a batch's forward pass and measures", False)],
}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _WRAPS and name != "sqlalchemy.engine":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def patched(module, _exec=exec_module, _name=name):
            _exec(module)
            if _name == "sqlalchemy.engine":
                from sqlalchemy import event

                event.listen(module.Engine, "before_cursor_execute", _before)
                event.listen(module.Engine, "after_cursor_execute", _after)
                return
            for attr, label, derive in _WRAPS[_name]:
                setattr(module, attr, _timed(label, getattr(module, attr), derive))

        loader.exec_module = patched
        return spec


def _exit(code, _real=os._exit):
    try:
        _dump()
    except BaseException:  # a sandboxed child may write no file: it ends as it would have
        pass
    _real(code)


if _OUT:
    sys.meta_path.insert(0, _Finder())
    atexit.register(_dump)
    # the console script ends by os._exit (cli/main.py), and so do the launcher's forks and the
    # sandbox's children: each writes its counts first; a fork starts from none (its parent's are
    # the parent's to write)
    os._exit = _exit
    os.register_at_fork(after_in_child=lambda: (_COUNTS.clear(), _PROCESS_START.__setitem__(0, time.process_time())))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=25, help="how many statements to list")
    parser.add_argument(
        "--callers",
        type=int,
        default=0,
        help="how many callers of the metric views outside a derivation to list (the outermost "
        "headatlas function and the test below it), by CPU",
    )
    args, command = command_after_dashes(parser, ".venv/bin/python -m pytest -q")
    with tempfile.TemporaryDirectory() as folder:
        hooks, out = Path(folder, "hooks"), Path(folder, "counts")
        hooks.mkdir()
        out.mkdir()
        (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hooks), env.get("PYTHONPATH", "")) if p)
        env["HEADATLAS_OPERATIONS_DIR"] = str(out)
        started = time.monotonic()
        code = subprocess.call(command, env=env)
        wall = time.monotonic() - started
        calls: collections.Counter[str] = collections.Counter()
        cpu: collections.Counter[str] = collections.Counter()
        processes = 0
        for counts in out.iterdir():
            processes += 1
            for line in counts.read_text(encoding="utf-8").splitlines():
                kind, key, n, seconds = line.split("\t")
                calls[f"{kind}\t{key}"] += int(n)
                cpu[f"{kind}\t{key}"] += float(seconds)
    print(f"\n`{' '.join(command)}`: exit {code}, {wall:.0f} s of wall-clock time, {processes} processes counted")
    for kind, title in (("op", "operation"), ("sql", "statements")):
        print(f"\n| CPU s | calls | ms a call | {title} |\n|---|---|---|---|")
        for key, seconds in cpu.most_common():
            if key.startswith(kind + "\t"):
                n = calls[key]
                print(f"| {seconds:.1f} | {n} | {1000 * seconds / n:.2f} | {key.split(chr(9), 1)[1]} |")
    if args.callers:
        print(
            f"\n| CPU s | reads | caller of the metric views outside a derivation (the {args.callers} with "
            "the most CPU) |\n|---|---|---|"
        )
        shown = [(k, s) for k, s in cpu.most_common() if k.startswith("caller\t")][: args.callers]
        for key, seconds in shown:
            print(f"| {seconds:.1f} | {calls[key]} | `{key.split(chr(9), 1)[1]}` |")
    print(f"\n| CPU s | calls | ms a call | statement (the {args.top} with the most CPU) |\n|---|---|---|---|")
    shown = [(k, s) for k, s in cpu.most_common() if k.startswith("stmt\t")][: args.top]
    for key, seconds in shown:
        n = calls[key]
        text = key.split("\t", 1)[1].replace("|", "\\|")
        print(f"| {seconds:.1f} | {n} | {1000 * seconds / n:.2f} | `{text}` |")
    sys.exit(code)


if __name__ == "__main__":
    main()
