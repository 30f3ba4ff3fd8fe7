"""Which windows of a run get the causal effects (SPEC §9): spread over its replicate groups.

An effect's interval is the jackknife over the replicate groups (SPEC §5d) that hold effect
windows, and a run's first N windows by position often lie in one or two groups (a corpus of
long documents: the shipped excerpt's first 8 windows are one document's, one group, so no
effect had an interval). The rule ``groups`` (``--effect-spread``, recorded with the run) walks
the run's windows in corpus order and takes a window while its group holds fewer than
``ceil(k / SPREAD_GROUPS)`` of the windows taken, k being the one it would be (the 1st … 8th one
group each, the 9th … 16th two, …); a window passed over waits, and is taken, earliest first, as
soon as the cap has grown to admit it. N windows are the first N so taken: they lie in at least
SPREAD_GROUPS groups wherever the corpus has that many, each window's group is known from the
window alone (``results.window_group``), and the walk stops at the N-th.

The windows are taken in one order whatever N is, so the windows for N are among those for any
larger N (``effects RUN --windows`` grows a run's set without measuring a window twice). A corpus
that ends first (fewer groups than it takes) goes on with the windows that wait, by their rank in
their group, then by position: every group's second window before any group's third.

``first`` is the rule runs stored before this one followed (the run's first N windows); their
parameters have no ``effect_spread`` and decode to it.

Pure: imports neither torch, Celery, Typer nor SQLAlchemy.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from headatlas.service.engine.schemes import MIN_GROUPS

T = TypeVar("T")

SPREAD_GROUPS = MIN_GROUPS  # the groups N effect windows are spread over, where the corpus has them


def group_cap(count: int) -> int:
    """The most effect windows one replicate group takes of ``count`` (at least 1)."""
    return max(1, math.ceil(count / SPREAD_GROUPS))


def spread(walk: Callable[[], Iterable[T]], group: Callable[[T], int], count: int) -> list[T]:
    """The first ``count`` items of ``walk()`` in the order of the rule ``groups`` (the module
    docstring), returned in ``walk()``'s order; ``group(item)`` is an item's replicate group. An
    item that waited is read again by a second walk (those passed over are not kept meanwhile)."""
    taken: dict[int, T | None] = {}  # position -> the item, None where it waited (read again)
    held: Counter[int] = Counter()
    waiting: dict[int, deque[int]] = {}  # per group, the positions passed over, earliest first

    def admit() -> None:
        # those waiting that the cap now admits, earliest first; each one taken may raise the cap
        while len(taken) < count:
            cap = group_cap(len(taken) + 1)
            ready = [(queue[0], g) for g, queue in waiting.items() if queue and held[g] < cap]
            if not ready:
                return
            position, g = min(ready)
            waiting[g].popleft()
            taken[position] = None
            held[g] += 1

    if count < 1:
        return []
    for position, item in enumerate(walk()):
        g = group(item)
        if held[g] < group_cap(len(taken) + 1) and not waiting.get(g):
            taken[position] = item
            held[g] += 1
            admit()
        else:
            waiting.setdefault(g, deque()).append(position)
        if len(taken) >= count:
            break
    else:
        # the corpus ended first: those still waiting by their rank in their group, then position
        rest = sorted((held[g] + rank, position) for g, queue in waiting.items() for rank, position in enumerate(queue))
        taken.update((position, None) for _rank, position in rest[: count - len(taken)])
    if any(item is None for item in taken.values()):
        last = max(taken)
        for position, item in enumerate(walk()):
            if position in taken:
                taken[position] = item
            if position >= last:
                break
    return [item for _position, item in sorted(taken.items())]  # type: ignore[misc]


def groups_held(scheme: str, windows: Iterable[Any]) -> str:
    """Which replicate groups (under ``scheme``) ``windows`` (effect windows, ``engine.windows.Window``:
    their id, document id and index name the group) fall in, in words,
    with what their count means for the effects' intervals (fewer than SPREAD_GROUPS: rough)."""
    from headatlas.service.engine.results import window_group

    n = len({window_group(scheme, window_id=w.window_id, doc_id=w.doc_id, index=w.index) for w in windows})
    groups = f"{n} replicate group" + ("" if n == 1 else "s")
    if n < 2:
        return f"they fall in {groups}: no interval (it needs 2 or more)"
    if n < SPREAD_GROUPS:
        return f"they fall in {groups}, fewer than {SPREAD_GROUPS}: rough intervals"
    return f"they fall in {groups}"
