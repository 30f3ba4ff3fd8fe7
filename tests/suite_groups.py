"""Which tests run together in one pytest-xdist worker under `make test`'s ``--dist loadgroup``.

pytest-xdist's ``loadgroup`` makes every test that no group holds a unit of its own, and a worker
takes the next unit when it is free: a setup that tests share (a session's cluster, a module's
fixture) is made again in each worker that runs one of them. Grouped, it is made once:

- the tests of the shared queue cluster, in two groups of about equal time (the schedule tests, and
  the fault and run tests): each group runs in one worker, so their waiting on the cluster's
  processes is two chains on two workers, not one. Each worker that runs a group makes the
  session's cluster of its own (``_shared_cluster`` is per process: its own Redis, its own file); a
  worker that runs both groups makes one;
- the tests of SmolLM2 (its GGUF weights converted once, not once per worker);
- the tests of a module that use a module- or class-scoped fixture of the module's own (a MiniLM run
  and its control, a run with every effect, a wheel built): each module's in a group of its own.
  The suite is CPU-bound with three workers on two cores, so a worker left without work at the end
  costs no time while the two others have some (docs/testing.md).

Kept free of the suite's heavy imports: tests/test_suite_grouping.py loads it into a tiny suite.
"""

from __future__ import annotations

import pytest

QUEUE_CLUSTER_GROUPS = {
    "test_schedules.py": "queue_cluster_schedules",
    "test_effect_runs.py": "queue_cluster_schedules",
    "test_queued_effects.py": "queue_cluster_schedules",
    "test_queue_probe.py": "queue_cluster_schedules",
}
QUEUE_CLUSTER_GROUP = "queue_cluster"  # every other module's (the queue's fault, run and reliability tests)


def shares_module_setup(item) -> bool:
    """Whether ``item`` uses a module- or class-scoped fixture defined in its own module."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    module = item.nodeid.split("::")[0]
    return any(
        fixturedef.scope in ("module", "class") and fixturedef.baseid.split("::")[0] == module
        for fixturedefs in info.name2fixturedefs.values()
        for fixturedef in fixturedefs
    )


def group_of(item) -> str | None:
    """The group ``item`` runs in, or None: a unit of its own."""
    fixtures = getattr(item, "fixturenames", ())
    if "queue_cluster" in fixtures:
        return QUEUE_CLUSTER_GROUPS.get(item.path.name, QUEUE_CLUSTER_GROUP)
    if "smollm2" in fixtures:
        return "smollm2"
    if shares_module_setup(item):
        return item.path.stem
    return None


def assign(items) -> None:
    """Mark each item of a group with it (``xdist_group``), unless it names one itself."""
    for item in items:
        group = group_of(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
