"""The roles of a stored run under the lifts' three interval rules (SPEC §5d, §7): what the role
calibration sees when a lift's test moves from the symmetric linear interval with t_{R−1} (the
rule before), through the log-scale one with t_{R−1}, to the log-scale one with ``lift_df``.

    python benchmarks/lift_roles.py RUNS.duckdb [--run ID]

Prints per rule the roles earned (by role), how many hold on both halves of the replicate groups
(``query roles --stability``), and the (head, role) pairs gained or lost against the linear rule.
The earlier rules are reproduced by replacing ``intervals.on_log_scale`` and ``intervals.lift_df``
for the duration of the call; nothing is written.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def earned(db: str, run_id: int | None, rule: str) -> tuple[set, set]:
    from headatlas.service.reports import intervals, role_rules, roles
    from headatlas.service.storage.store import Store

    on_log, lift_df = intervals.on_log_scale, intervals.lift_df
    if rule == "linear":
        intervals.on_log_scale = lambda column: False  # type: ignore[assignment]
    if rule == "log":
        intervals.lift_df = lambda logs: float(len(logs) - 1)  # type: ignore[assignment]
    try:
        with Store(Path(db)).checked_read() as conn:
            run = run_id or conn.exec_driver_sql("SELECT max(run_id) FROM runs").scalar()
            columns, rows = roles.roles(conn, run, stability=True)
    finally:
        intervals.on_log_scale, intervals.lift_df = on_log, lift_df
    found = [dict(zip(columns, r)) for r in rows]
    held = {(d["layer"], d["head"], d["role"]) for d in found if d["role"] != role_rules.NONE}
    return held, {(d["layer"], d["head"], d["role"]) for d in found if d["role"] != role_rules.NONE and d["stable"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("db")
    parser.add_argument("--run", type=int, default=None, help="run id (default: the last)")
    args = parser.parse_args(argv)
    results = {rule: earned(args.db, args.run, rule) for rule in ("linear", "log", "log+df")}
    for rule, (held, stable) in results.items():
        counts = dict(sorted(Counter(role for _, _, role in held).items()))
        print(f"{rule:<7} {len(held):>4} roles, {len(stable):>4} stable: {counts}")
    linear = results["linear"][0]
    for rule in ("log", "log+df"):
        held = results[rule][0]
        print(f"{rule}: gained {sorted(held - linear)}, lost {sorted(linear - held)} (against linear)")


if __name__ == "__main__":
    main()
