"""Reading a run's roles (the rows of ``roles.roles``): the primary role of each head, the
``--role`` a command names checked against the run's, filters, and counts per role.
"""

from __future__ import annotations

from collections.abc import Sequence

from headatlas.service.reports.role_rules import NONE, ROLE_ORDER, offered_roles


def primary_grid(columns: list[str], rows: list[tuple], n_layers: int, n_heads: int) -> list[list[str | None]]:
    """``[layer][head]`` → the head's primary role (None where the run stored no head)."""
    grid: list[list[str | None]] = [[None] * n_heads for _ in range(n_layers)]
    li, hi, ri, pi = (columns.index(c) for c in ("layer", "head", "role", "primary"))
    for r in rows:
        if r[pi]:
            grid[r[li]][r[hi]] = r[ri]
    return grid


def check_role(role: str, offered: Sequence[str], run_label: str) -> str:
    """``role`` as ``--role`` names it: one of ``offered`` (the run's roles) or ``none established``
    (``none`` is short for it), case aside; else one line with the closest names."""
    import difflib

    from headatlas.service.errors import Param, ParameterError

    choices = [*offered, NONE]
    by_lower = {c.lower(): c for c in choices} | {"none": NONE}
    found = by_lower.get(role.strip().lower())
    if found is not None:
        return found
    other = [r for r in ROLE_ORDER if r not in offered]
    if role.strip().lower() in {r.lower() for r in other}:
        raise ParameterError(
            Param("role", role, quoted=True), f": not a role {run_label} is tested for", hint=_role_list(choices)
        )
    typed = role.strip().lower()
    close = [c for c in by_lower if typed and typed in c and c != "none"] or difflib.get_close_matches(
        typed, list(by_lower), n=3, cutoff=0.5
    )
    hint = f"did you mean {' or '.join(repr(by_lower[c]) for c in close)}? " if close else ""
    raise ParameterError(Param("role", role, quoted=True), ": not a role", hint=hint + _role_list(choices))


def _role_list(choices: Sequence[str]) -> str:
    return "its roles: " + ", ".join(choices)


def filter_roles(
    columns: list[str],
    rows: list[tuple],
    *,
    layer: int | None = None,
    head: int | None = None,
    role: str | None = None,
) -> list[tuple]:
    """The rows of ``roles`` of one layer, head and/or role (already checked: ``check_role``).
    The tests, their family and Holm-adjusted p stay the run's: a filter chooses rows to show."""
    li, hi, ri = (columns.index(c) for c in ("layer", "head", "role"))
    return [
        r
        for r in rows
        if (layer is None or r[li] == layer) and (head is None or r[hi] == head) and (role is None or r[ri] == role)
    ]


def role_counts(columns: list[str], rows: list[tuple], offered: Sequence[str] | None = None) -> dict[str, int]:
    """Heads holding each role (a head with several counts once per role), ``none established`` last.
    ``offered``: the run's roles (``offered_roles``; default: a bidirectional run's); a role held
    outside it is counted too."""
    ri = columns.index("role")
    held = {r[ri] for r in rows}
    listed = offered_roles(False) if offered is None else offered
    counts = {role: 0 for role in ROLE_ORDER if role in listed or role in held}
    counts[NONE] = 0
    for r in rows:
        counts[r[ri]] += 1
    return counts


def stable_counts(columns: list[str], rows: list[tuple]) -> dict[str, int] | None:
    """Heads holding each role on both halves, for every role of ``ROLE_ORDER`` (None: rows
    without stability columns, or halves too small to test)."""
    if "stable" not in columns:
        return None
    ri, si = columns.index("role"), columns.index("stable")
    if any(r[si] is None for r in rows if r[ri] != NONE):
        return None
    counts = {role: 0 for role in ROLE_ORDER}
    for r in rows:
        if r[ri] != NONE and r[si]:
            counts[r[ri]] += 1
    return counts


def family_size(columns: list[str], rows: list[tuple]) -> int:
    """The number of (head, role) tests Holm–Bonferroni corrected for (0: values tested)."""
    fi = columns.index("family")
    return next((r[fi] for r in rows if r[fi]), 0)
