"""The head atlas of one run as `query roles` and ``RunView.roles()`` show it: one row per (head,
role) with its evidence and the head's effect, the rows chosen (layer, head, role), what the roles
were tested with, and what the run's random-weights controls earn."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection

from headatlas.service.storage.store import Run


@dataclass(frozen=True)
class RoleTable:
    """``names``/``rows``: the rows chosen; ``every``: all of the run's; ``role_names``: the
    roles' own columns (before the effect's); ``tested``: the test and its family; ``note``:
    what a role is and how it is earned; ``controls``: (seed, control run, role counts) each."""

    run: Run
    names: list[str]
    rows: list[tuple]
    every: list[tuple]
    role_names: list[str]
    offered: tuple[str, ...]
    tested: str
    note: str
    chosen: str
    groups: int
    controls: list[tuple[int, Run, dict[str, int]]]

    def counts(self) -> tuple[dict[str, int], dict[str, int] | None]:
        """Heads per role over the whole run (whatever rows are shown), and how many of them are
        stable (None without the halves' tests)."""
        from headatlas.service.reports import role_views

        role_rows = [row[: len(self.role_names)] for row in self.every]
        return (
            role_views.role_counts(self.role_names, role_rows, self.offered),
            role_views.stable_counts(self.role_names, role_rows),
        )

    def counts_line(self) -> str:
        """``heads per role: previous-token 3 (2 stable), …``"""
        counts, stable = self.counts()
        held = ", ".join(
            f"{role} {n}" + (f" ({stable[role]} stable)" if stable is not None and role in stable else "")
            for role, n in counts.items()
        )
        return f"heads per role: {held}"

    def control_lines(self) -> list[str]:
        """What each random-weights control earns: the floor the roles should beat."""
        from headatlas.service.reports import role_rules

        return [
            f"control seed {seed} (run {control.run_id}, {control.name}): "
            f"{sum(n for role, n in counts.items() if role != role_rules.NONE)} (head, role) earned"
            for seed, control, counts in self.controls
        ]


def role_table(
    conn: Connection,
    run: Run,
    *,
    stability: bool = False,
    layer: int | None = None,
    head: int | None = None,
    role: str | None = None,
    flags: tuple[str, str, str] = ("--layer", "--head", "--role"),
) -> RoleTable:
    """The roles of ``run`` (SPEC §7), with each head's effect where the run has effects;
    ``stability``: each role also tested on each half of the replicate groups; ``layer``,
    ``head``, ``role``: the rows shown (the tests and their Holm family stay the run's).
    ``flags``: how the caller names those three (``--layer``, or ``layer=``), for the line that
    says which rows are shown."""
    from headatlas.service.layer_head import check_layer_head
    from headatlas.service.reports import (
        attention_kind,
        compare,
        role_effects,
        role_rules,
        role_tests,
        role_views,
        roles,
    )
    from headatlas.service.reports.intervals import groups_held

    check_layer_head(layer, head, n_layers=run.n_layers, n_heads=run.n_heads, whose=f"run {run.run_id}")
    offered = tuple(role_rules.offered_roles(attention_kind.causal_run(conn, run.run_id)))
    if role is not None:
        role = role_views.check_role(role, offered, f"run {run.run_id} ({run.name})")
    names, rows = roles.roles(conn, run.run_id, stability=stability)
    role_names = list(names)
    names, rows = role_effects.with_effects(conn, run.run_id, names, rows)  # each head's effect (SPEC §9)
    controls = [
        (compare.control_seed(c), c, role_views.role_counts(*roles.roles(conn, c.run_id)))
        for c in compare.controls_of(conn, run)
    ]
    family = role_views.family_size(names, rows)
    tested = (
        f"Holm–Bonferroni over {family} (head, role) tests, α = {role_tests.ALPHA:g}"
        if family
        else "no replicate groups: each value tested against its threshold, uncorrected"
    )
    note = role_tests.ROLES_NOTE + (f". {roles.STABILITY_NOTE}" if stability else "")
    if "induction" in offered:
        note += f". {role_tests.PROBE_NOTE}"
    shown = role_views.filter_roles(names, rows, layer=layer, head=head, role=role)
    picked = [
        f"{flag}{value!r}" if flag.endswith("=") else f"{flag} {value}"  # layer=0 (Python), --layer 0 (CLI)
        for flag, value in zip(flags, (layer, head, role))
        if value is not None
    ]
    chosen = f"; {len(shown)} of its {len(rows)} rows ({' '.join(picked)})" if picked else ""
    return RoleTable(
        run=run,
        names=names,
        rows=shown,
        every=rows,
        role_names=role_names,
        offered=offered,
        tested=tested,
        note=note,
        chosen=chosen,
        groups=groups_held(conn, run.run_id),
        controls=controls,
    )
