"""The mixing measures of a run (SPEC §6): where each output's mixture comes from, per method,
and how far each method's rows are from the attention's. Returns (columns, rows).
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.engine.results import MIXING_METHODS
from headatlas.service.errors import Param, ParameterError
from headatlas.service.reports.query_support import Rows, fetch_rows

MIXING_MEASURES = {
    # name shown: SQL over mixing_metrics
    "self": "to_self",
    "neighbours": "to_prev + to_next",
    "specials": "to_cls + to_sep",
    "punctuation": "to_punct",
    "mean_distance": "mean_distance",
}
METHOD_ORDER = MIXING_METHODS


def _mixing_methods(
    conn: Connection, run_id: int, methods: list[str] | None, *, parameter: str = "methods"
) -> list[str]:
    """The stored methods asked for (all stored when none); ``parameter``: the option that asked."""
    stored = [
        r[0]
        for r in conn.execute(text("SELECT DISTINCT method FROM mixing_metrics WHERE run_id = :run"), {"run": run_id})
    ]
    if not stored:
        raise ParameterError(
            f"run {run_id} has no mixing measures: analyse with ",
            Param("attribution", True),
            " and/or ",
            Param("mixing", "rollout,norm,alti"),
        )
    if not methods:
        return [m for m in METHOD_ORDER if m in stored]
    for m in methods:
        if m not in METHOD_ORDER:
            raise ParameterError(Param(parameter, m, quoted=True), f": choose one of {', '.join(METHOD_ORDER)}")
        if m not in stored:
            adds = Param("attribution", True) if m == "attribution" else Param("mixing", m)
            raise ParameterError(
                Param(parameter, m),
                f": run {run_id} has only {', '.join(x for x in METHOD_ORDER if x in stored)}",
                hint=("analyse with ", adds, " to add it"),
            )
    return list(dict.fromkeys(methods))


def mixing(conn: Connection, run_id: int, *, layer: int | None = None, methods: list[str] | None = None) -> Rows:
    """Where each output's mixture comes from: mass to self / neighbours / specials / punctuation
    and the mean distance, one column per method. Per layer (the layer-level rows), or per head
    of ``layer`` (head -1 = the layer-level row)."""
    chosen = _mixing_methods(conn, run_id, methods)
    measures = ", ".join(f"{sql} AS {name}" for name, sql in MIXING_MEASURES.items())
    where = "head = -1" if layer is None else "layer = :layer"
    result = conn.execute(
        text(
            f"SELECT layer, head, method, {measures} FROM mixing_metrics "
            f"WHERE run_id = :run AND {where} ORDER BY layer, head"
        ),
        {"run": run_id, "layer": layer},
    )
    values: dict[tuple, dict] = {}
    for row in result.mappings():
        if row["method"] in chosen:
            values.setdefault((row["layer"], row["head"]), {})[row["method"]] = row
    keys = sorted(values, key=lambda k: (k[0], k[1] if k[1] >= 0 else 10_000))  # layer row after its heads
    columns = (["layer"] if layer is None else ["layer", "head"]) + ["measure"] + chosen
    rows = []
    for key in keys:
        for measure in MIXING_MEASURES:
            by_method = values[key]
            cells = [by_method[m][measure] if m in by_method else None for m in chosen]
            lead = (key[0],) if layer is None else (key[0], "layer" if key[1] < 0 else key[1])
            rows.append((*lead, measure, *cells))
    return columns, rows


def discrepancy(conn: Connection, run_id: int, *, method: str = "attribution", top: int | None = None) -> Rows:
    """Per head: how far ``method``'s rows are from the head's attention rows (mean JSD, bits),
    ranked, with the layer's mean and what each says about self and distance."""
    _mixing_methods(conn, run_id, [method], parameter="method")
    sql = """
        WITH m AS (SELECT * FROM mixing_metrics WHERE run_id = :run AND head >= 0)
        SELECT row_number() OVER (ORDER BY x.jsd_attention DESC, x.layer, x.head) AS rank,
               x.layer, x.head, x.jsd_attention AS jsd,
               avg(x.jsd_attention) OVER (PARTITION BY x.layer) AS layer_mean_jsd,
               a.to_self AS attention_self, x.to_self AS method_self,
               a.mean_distance AS attention_distance, x.mean_distance AS method_distance,
               a.entropy AS attention_entropy, x.entropy AS method_entropy
        FROM m x JOIN m a ON a.method = 'attention' AND a.layer = x.layer AND a.head = x.head
        WHERE x.method = :method
        ORDER BY rank LIMIT :limit
    """
    return fetch_rows(conn, sql, {"run": run_id, "method": method, "limit": top or 1_000_000})


def discrepancy_layers(conn: Connection, run_id: int, *, method: str = "attribution") -> Rows:
    """Per layer: mean and spread of the per-head JSD, and the layer-level rows' JSD and self share."""
    _mixing_methods(conn, run_id, [method], parameter="method")
    sql = """
        SELECT layer,
               avg(jsd_attention) FILTER (WHERE head >= 0) AS mean_head_jsd,
               min(jsd_attention) FILTER (WHERE head >= 0) AS min_head_jsd,
               max(jsd_attention) FILTER (WHERE head >= 0) AS max_head_jsd,
               any_value(jsd_attention) FILTER (WHERE head = -1) AS layer_jsd,
               any_value(to_self) FILTER (WHERE head = -1) AS layer_self,
               any_value(mean_distance) FILTER (WHERE head = -1) AS layer_mean_distance
        FROM mixing_metrics WHERE run_id = :run AND method = :method
        GROUP BY layer ORDER BY layer
    """
    return fetch_rows(conn, sql, {"run": run_id, "method": method})
