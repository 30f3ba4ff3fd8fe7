"""Extension points that a package installed beside headatlas can use (entry points).

A distribution declares, in its own pyproject.toml::

    [project.entry-points."headatlas.families"]
    neox = "my_package.neox:NeoXAdapter"          # a ModelAdapter subclass
    [project.entry-points."headatlas.backends"]
    memduck = "my_package.memory:MemoryBackend"   # a Backend subclass; the name is its --db scheme
    [project.entry-points."headatlas.metrics"]
    attended = "my_package.metric:ATTENDED"       # a Metric (or a tuple of them)
    [project.entry-points."headatlas.measures"]
    spread = "my_package.spread:Spread"           # a Measure subclass (its sums per head)
    [project.entry-points."headatlas.objectives"]
    surprise = "my_package.objective:SURPRISE"    # an ObjectiveDefinition (or a tuple of them)

Each group is read once per process, and only when it is first needed (a model family that no
built-in adapter serves, a ``--db`` scheme no built-in backend has, the metric views or the
metric list, an objective a request names), as datasette and mlflow load theirs. A plugin that
cannot be imported, or whose contribution breaks its extension point's contract, is left out and
reported on stderr in one line that names it; everything else goes on working. That holds for
whatever a plugin raises as it is imported or registered, SystemExit and KeyboardInterrupt
included: only a Ctrl-C the user pressed (a real SIGINT) stops the command, as it would anywhere
else.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from headatlas.service.interrupts import sigint_seen

FAMILIES = "headatlas.families"
BACKENDS = "headatlas.backends"
METRICS = "headatlas.metrics"
OBJECTIVES = "headatlas.objectives"
MEASURES = "headatlas.measures"  # a Measure subclass (service/engine/measure_contract.py)
GROUPS = (FAMILIES, BACKENDS, METRICS, OBJECTIVES, MEASURES)


@dataclass(frozen=True)
class Plugin:
    """One entry point: where a contribution comes from."""

    group: str
    name: str  # the entry point's name
    value: str  # module:attribute
    distribution: str  # the installed distribution that declares it, with its version

    @property
    def origin(self) -> str:
        """How listings name it: ``plugin NAME (DISTRIBUTION VERSION)``."""
        return f"plugin {self.name} ({self.distribution})"


_lock = threading.RLock()
_loaded: dict[str, list[tuple[Plugin, Any]]] = {}
_failures: list[str] = []


def _plugin(group: str, entry: metadata.EntryPoint) -> Plugin:
    dist = getattr(entry, "dist", None)
    where = f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"
    return Plugin(group, entry.name, entry.value, where)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def load(group: str, install: Callable[[Plugin, Any], None]) -> list[tuple[Plugin, Any]]:
    """The contributions of ``group``'s entry points, each loaded and handed to ``install`` once
    per process (which raises to refuse one). Later calls return what the first one installed."""
    with _lock:
        if group in _loaded:
            return _loaded[group]
        installed: list[tuple[Plugin, Any]] = []
        _loaded[group] = installed  # an install that asks for its own group again sees it loading
        for entry in sorted(metadata.entry_points(group=group), key=lambda e: e.name):
            plugin = _plugin(group, entry)
            with sigint_seen() as pressed:
                try:
                    value = entry.load()
                    install(plugin, value)
                except BaseException as exc:  # noqa: BLE001 - whatever a plugin raises is the plugin's fault
                    if isinstance(exc, KeyboardInterrupt) and pressed():
                        raise  # the user's own Ctrl-C, not the plugin's: stop as asked
                    report(plugin, exc)
                    continue
            installed.append((plugin, value))
        return installed


def report(plugin: Plugin, exc: BaseException) -> None:
    """Say once, on one line on stderr, that ``plugin`` was left out and why."""
    line = f"headatlas: {plugin.origin}, {plugin.group} = {plugin.value}, is not loaded: {_first_line(exc)}"
    _failures.append(line)
    print(line, file=sys.stderr)


def failures() -> list[str]:
    """Every plugin left out in this process, one line each."""
    return list(_failures)


def forget(group: str | None = None) -> None:
    """Read ``group`` (every group: None) again on its next use (tests that install a plugin)."""
    with _lock:
        for name in GROUPS if group is None else (group,):
            _loaded.pop(name, None)
        if group is None:
            _failures.clear()
