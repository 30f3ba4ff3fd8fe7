"""Every per-head metric, declared once (SPEC §4, §5, §5b, §8).

A metric is its additive sums (name, integer or float, per head or per run), its view columns
(each an SQL expression over the summed totals, with its one-line definition), what it is
measured against, and the SPEC section that defines it. Everything downstream reads this list:
the batch payload (``service.engine.results``), ingest (``service.storage.store``), compaction
(generic over columns), the views (``service.storage.views``, rebuilt at the end of every
``db upgrade``), the query columns and ``--sort``/``--metric`` choices
(``service.reports.queries``, ``compare``, ``plots``) and ``headatlas metrics``.

Adding a metric: one ``Metric`` below, its sums computed in ``service.engine.stats`` (a head sum
in ``head_statistics``, a run sum in ``chance_statistics``), and one small migration that adds
its sums' columns (docs/architecture.md, "Adding a metric"). A package installed beside
headatlas adds a metric through the ``headatlas.metrics`` entry point: a ``Metric`` whose per-head
sums (``"<measure>.<sum>"``) are stored by name in one table headatlas's migration 0016 made
(``service.storage.named_sums``; no plugin ships a migration) and whose columns are SQL over the
stored sums, its own and its earlier columns (docs/architecture.md, "Plugin sums and columns");
``all_metrics()``, ``all_sums()`` and ``all_columns()`` include it, the views and
``reports.columns``' functions are built from them, ``METRICS``, ``SUMS`` and ``COLUMNS`` are
headatlas's own.

Expressions are SQL over one row of totals: a head's sums beside its run's (a layer's heads
summed, with the run sums once per head, for ``layer_metrics``), plus the distance inputs of
``DISTANCE_INPUTS`` and the streaming effects' inputs of ``STREAMING_INPUTS``. A bare name means the sum (DuckDB binds a relation's columns before the
aliases of the select list), so ``attn_to_cls / … AS attn_to_cls`` followed by
``attn_to_cls / … AS attn_to_cls_lift`` reads the sum both times; a column may name an earlier
column that is not also a sum. No numpy, no torch: the CLI's queries import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any


class Shown(str, Enum):
    """Where a head column is shown by default. Every head column is in ``query heads``' JSON and
    CSV, ``--wide`` and ``--columns``; these are the default tables (``reports.columns.head_table``)."""

    NOT = "not"  # in none of the default tables
    PAGE = "page"  # the head tables of the web page and the report
    TERMINAL = "terminal"  # those, and `query heads`' table (which fits 100 characters)


class Scope(str, Enum):
    HEAD = "head"  # per (run, layer, head, replicate group): table head_stats
    RUN = "run"  # per (run, replicate group), the same for every head: table run_chance

    @property
    def table(self) -> str:
        return "head_stats" if self is Scope.HEAD else "run_chance"


@dataclass(frozen=True)
class Sum:
    """An additive sum over windows, kept per replicate group (SPEC §5b)."""

    name: str
    kind: type  # int or float
    scope: Scope

    @property
    def sql_type(self) -> str:
        return "BIGINT" if self.kind is int else "DOUBLE"


@dataclass(frozen=True)
class Column:
    """One column of ``head_metrics`` / ``layer_metrics``."""

    name: str
    sql: str  # over the totals (see the module docstring)
    definition: str  # one line
    interval: bool = True  # a ratio that gets a jackknife interval (--ci)
    heads: bool = True  # shown by `query heads`, accepted by --sort and `plot heads --metric`
    layers: bool = True  # shown by `query layers`
    # the values it can take (low, high; None: unbounded): its interval is clipped to them
    bounds: tuple[float | None, float | None] = (None, None)
    # the value chance takes (1 for a lift: a ratio to its chance or to uniform attention; None for
    # a share, a mean, an effect): figures and the report draw the column on a diverging colour map
    # centred on it and say "1 = chance" (``chance_centre``)
    centre: float | None = None
    # in which default head tables it is shown (a plugin's column too); its place there: its
    # place among the declarations
    shown: Shown = Shown.NOT


@dataclass(frozen=True)
class Metric:
    name: str
    spec: str  # the SPEC section that defines it
    definition: str  # one line
    against: str  # what its lift or chance is, in a few words ("" where none)
    columns: tuple[Column, ...]
    sums: tuple[Sum, ...] = ()  # the sums it introduces (a sum is declared once, by its first metric)
    origin: str = "headatlas"  # headatlas, or the plugin that declared it


SHARE = (0.0, 1.0)  # a share, a probability, a mean attention weight
POSITIVE = (0.0, None)  # a lift, a mean of non-negative values


def head_int(name: str) -> Sum:
    return Sum(name, int, Scope.HEAD)


def head_float(name: str) -> Sum:
    return Sum(name, float, Scope.HEAD)


def run_int(name: str) -> Sum:
    return Sum(name, int, Scope.RUN)


def run_float(name: str) -> Sum:
    return Sum(name, float, Scope.RUN)


# Inputs of the views that are not scalar sums: read from the per-distance tables (dist_hist,
# pair_hist) by the distance views of migration 0006 and joined beside the sums.
DISTANCE_INPUTS = (
    "distance_sum",
    "short_range_pairs",
    "same_sentence_dm",
    "same_token_dm",
    "same_word_dm",
    "mean_distance_chance",
    "short_range_chance",
)


def _share(name: str, sum_high: str, sum_pairs: str, dm: str, what: str, layers: tuple[str, ...]) -> Metric:
    """A share of the high-similarity pairs against the share of all pairs (plain and matched to
    the head's distances, SPEC §5b)."""
    cols = (
        Column(name, f"{sum_high} / nullif(high_pairs, 0)", f"share of H {what}", bounds=SHARE),
        Column(f"{name}_chance", f"{sum_pairs} / nullif(pairs, 0)", f"share of all pairs P {what}", bounds=SHARE),
        Column(
            f"{name}_lift", f"{name} / nullif({name}_chance, 0)", f"{name} / {name}_chance", bounds=POSITIVE, centre=1.0
        ),
        Column(
            f"{name}_chance_dm",
            f"{dm} / nullif(high_pairs, 0)",
            f"chance of {name} matched to the head's own distances",
            bounds=SHARE,
        ),
        Column(
            f"{name}_lift_dm",
            f"{name} / nullif({name}_chance_dm, 0)",
            f"{name} / {name}_chance_dm",
            bounds=POSITIVE,
            centre=1.0,
        ),
    )
    return Metric(
        name,
        "§5, §5b",
        f"share of the high-similarity pairs H {what}",
        "all pairs of the window; and all pairs at the head's own distances (_dm)",
        tuple(replace(c, layers=c.name in layers) for c in cols),
        sums=(head_int(sum_high), run_int(sum_pairs)),
    )


def _attention_to(name: str, key: str, uniform: str, fallback: str, spec: str, sums: tuple[Sum, ...]) -> Metric:
    """Mean attention weight on a class of keys, and its lift against uniform attention over each
    row's visible keys (SPEC §5b, §8). ``fallback``: the uniform sum of runs stored before it
    existed (exact for bidirectional attention, the only kind those runs have)."""
    expected = f"coalesce({uniform}, {fallback})" if fallback else uniform
    return Metric(
        name,
        spec,
        f"mean attention weight on {key}",
        "uniform attention over each row's visible keys",
        (
            Column(name, f"{name} / nullif(attn_rows, 0)", f"mean weight on {key} per query row", bounds=SHARE),
            Column(
                f"{name}_lift",
                f"{name} / nullif({expected}, 0)",
                f"{name} / its mean under uniform attention",
                bounds=POSITIVE,
                centre=1.0,
            ),
        ),
        sums=sums,
    )


def _copies(name: str, rows: str, spec: str, definition: str, keys: str) -> Metric:
    """Attention to a set of earlier keys per query row (rows that have such keys), against uniform."""
    attn, chance = f"attn_{name}", f"attn_{name}_chance"
    return Metric(
        name,
        spec,
        definition,
        "uniform attention over each row's visible keys",
        (
            Column(attn, f"{attn} / nullif({rows}, 0)", f"mean weight on {keys}, per row that has one", bounds=SHARE),
            Column(
                chance, f"{chance} / nullif({rows}, 0)", f"{attn} under uniform attention", layers=False, bounds=SHARE
            ),
            Column(f"{name}_lift", f"{attn} / nullif({chance}, 0)", f"{attn} / {chance}", bounds=POSITIVE, centre=1.0),
        ),
        sums=(head_float(attn), run_int(rows), run_float(chance)),
    )


def _mean(
    name: str,
    definition: str,
    spec: str = "§4, §5",
    *,
    layers: bool = True,
    sql: str = "",
    bounds: tuple[float | None, float | None] = SHARE,
) -> Metric:
    return Metric(
        name,
        spec,
        definition,
        "",
        (
            Column(
                name,
                sql or f"{name} / nullif(attn_rows, 0)",
                f"{definition}, per query row",
                layers=layers,
                bounds=bounds,
            ),
        ),
        sums=(head_float(name),),
    )


# SPEC §9: what a head's removal costs. O is the run's own objective (``run_effects.objective`` and
# ``unit``): next-token loss (nats) for decoders, masked-LM loss (nats) for encoders with an MLM head,
# embedding drift (1 − cos of the pooled embedding) for sentence-embedding encoders.
EFFECT_AGAINST = (
    "the intact model on the same windows: O(ablated) − O(intact), O the run's own objective "
    "(next-token or masked-LM loss in nats, or embedding drift 1 − cos; named under every table)"
)
DRIFT_AGAINST = "the intact model's final hidden states: Σ‖h' − h‖² / Σ‖h‖² (0 = unchanged)"


def _effect(kind: str, what: str) -> Column:
    return Column(
        f"effect_{kind}",
        f"effect_{kind} / nullif(effect_windows, 0)",
        f"O with the head's output {what} − O intact, mean over the effect windows",
    )


EFFECT_METRICS: tuple[Metric, ...] = (
    Metric(
        "effect",
        "§9",
        "what the model's objective loses when the head is ablated (zero or mean ablation)",
        EFFECT_AGAINST,
        (
            _effect("zero", "set to 0"),
            _effect("mean", "set to its mean over the reference windows"),
            Column(
                "objective",
                "objective / nullif(effect_windows, 0)",
                "O of the intact model, mean over the effect windows (the same for every head)",
                heads=False,
                layers=False,
            ),
        ),
        sums=(head_float("effect_zero"), head_float("effect_mean"), run_int("effect_windows"), run_float("objective")),
    ),
    Metric(
        "importance",
        "§9",
        "gradient importance (Michel et al. 2019): mean over windows of |∂O/∂ξ|, ξ a gate on the head's output",
        "the intact model (ξ = 1); O the run's own objective, a loss (nats)",
        (
            Column(
                "importance",
                "importance / nullif(effect_windows, 0)",
                "mean |∂O/∂ξ| over the effect windows (nats per unit of gate)",
                bounds=POSITIVE,
            ),
        ),
        sums=(head_float("importance"),),
    ),
    Metric(
        "effect_atp",
        "§9",
        "attribution patching (AtP; Kramár et al. 2024): the first-order estimate of effect_mean from one "
        "forward and one backward pass, Σ over positions of (m − z)·∂O/∂z",
        "the intact model's gradient; estimates effect_mean (O with the head's output set to its reference "
        "mean − O intact), O the run's own objective, a loss (nats)",
        (
            Column(
                "effect_atp",
                "effect_atp / nullif(effect_windows, 0)",
                "first-order estimate of effect_mean, mean over the effect windows (a screen, not an ablation)",
            ),
        ),
        sums=(head_float("effect_atp"),),
    ),
    Metric(
        "drift",
        "§9",
        "output drift of the final hidden states when the head is ablated",
        DRIFT_AGAINST,
        (
            Column(
                "drift_zero",
                "drift_zero / nullif(effect_windows, 0)",
                "output drift with the head's output set to 0, mean over the effect windows",
                layers=False,
                bounds=POSITIVE,
            ),
            Column(
                "drift_mean",
                "drift_mean / nullif(effect_windows, 0)",
                "output drift with the head's output set to its reference mean, mean over the effect windows",
                layers=False,
                bounds=POSITIVE,
            ),
        ),
        sums=(head_float("drift_zero"), head_float("drift_mean")),
    ),
)
EFFECT_COLUMNS = tuple(c.name for m in EFFECT_METRICS for c in m.columns)

# SPEC §10: what the objective loses when a head's KV head streams (keeps its S first tokens and
# W most recent keys), stored per KV head and restriction by `effects RUN --streaming` (table
# streaming_effects). Not sums of head_stats: the views join them per query head (its KV head's,
# ``h // (H / H_kv)``) from the restriction the head tables show, ``STREAMING_RULE``
# (``service.storage.views``); the view ``streaming_metrics`` holds every restriction.
STREAMING_INPUTS = (
    "streaming_windows",
    "streaming_effect_sum",
    "streaming_beyond_sum",
    "streaming_sink",
    "streaming_recent",
)
STREAMING_RULE = (
    "where a run holds several restrictions, the head tables show the tightest: the fewest recent keys W, then "
    "the fewest sinks S; the view streaming_metrics holds them all"
)
STREAMING_METRIC = Metric(
    "effect_streaming",
    "§10",
    "what the model's objective loses when the head's KV head streams: keeps only the S first tokens (sinks) and "
    "the W most recent keys, for every query head that reads it (grouped-query attention)",
    f"the intact model on the same windows: O(streaming) − O(intact), O the run's own objective; {STREAMING_RULE}",
    (
        Column(
            "effect_streaming",
            "streaming_effect_sum / nullif(streaming_windows, 0)",
            "O with the head's KV head streaming (S sinks, W recent keys) − O intact, mean over the streaming "
            "windows; a query head shows its KV head's (grouped-query attention: shared by the KV head's query heads)",
            layers=False,
        ),
        Column(
            "streaming_beyond",
            "streaming_beyond_sum / nullif(streaming_windows, 0)",
            "attention mass beyond sinks + W in the intact model, mean over the streaming windows' query rows and "
            "the KV head's query heads (what the restriction hides)",
            layers=False,
            bounds=SHARE,
        ),
        Column(
            "streaming_sink",
            "streaming_sink",
            "S: the first tokens the restriction keeps",
            interval=False,
            layers=False,
        ),
        Column(
            "streaming_recent",
            "streaming_recent",
            "W: the most recent keys the restriction keeps (the query's own included)",
            interval=False,
            layers=False,
        ),
    ),
)
STREAMING_COLUMNS = tuple(c.name for c in STREAMING_METRIC.columns)
# the per-head sums of each effect kind (SPEC §9), in the payload and head_stats
EFFECT_SUMS = {
    "zero": ("effect_zero", "drift_zero"),
    "mean": ("effect_mean", "drift_mean"),
    "gradient": ("importance",),
    "atp": ("effect_atp",),
}


def _placed(metrics: tuple[Metric, ...], **placed: tuple[str, ...]) -> tuple[Metric, ...]:
    """``metrics`` with the columns named under each ``Shown`` (by its value) shown there."""
    where = {name: Shown(kind) for kind, names in placed.items() for name in names}
    out = tuple(
        replace(m, columns=tuple(replace(c, shown=where.get(c.name, c.shown)) for c in m.columns)) for m in metrics
    )
    missing = set(where) - {c.name for m in out for c in m.columns}
    if missing:
        raise RuntimeError(f"placed columns that are not declared: {sorted(missing)}")
    return out


# the default head tables (``Shown``): the measures a reader ranks heads by, in declaration order;
# `query heads`' table takes those that fit 100 characters on the shipped excerpt
METRICS: tuple[Metric, ...] = _placed(
    (
        _share(
            "within_sentence",
            "same_sentence_high",
            "same_sentence_pairs",
            "same_sentence_dm",
            "in one sentence",
            layers=("within_sentence", "within_sentence_lift", "within_sentence_lift_dm"),
        ),
        _share(
            "repetition",
            "same_token_high",
            "same_token_pairs",
            "same_token_dm",
            "with equal token ids",
            layers=("repetition", "repetition_lift", "repetition_lift_dm"),
        ),
        _share(
            "repetition_words",
            "same_word_high",
            "same_word_pairs",
            "same_word_dm",
            "with equal word token ids (punctuation repeats excluded)",
            layers=("repetition_words", "repetition_words_lift_dm"),
        ),
        Metric(
            "mean_distance",
            "§5",
            "mean token distance j − i of the high-similarity pairs",
            "all pairs of the window",
            (
                Column(
                    "mean_distance",
                    "coalesce(distance_sum, 0) / nullif(high_pairs, 0)",
                    "mean j − i over H",
                    bounds=(1.0, None),
                ),
                Column("mean_distance_chance", "mean_distance_chance", "mean j − i over P", interval=False),
            ),
        ),
        Metric(
            "short_range_share",
            "§5",
            "share of the high-similarity pairs at distance ≤ short_range",
            "all pairs of the window",
            (
                Column(
                    "short_range_share",
                    "coalesce(short_range_pairs, 0) / nullif(high_pairs, 0)",
                    "share of H with j − i ≤ short_range",
                    bounds=SHARE,
                ),
                Column("short_range_chance", "short_range_chance", "the same share of P", interval=False),
            ),
        ),
        Metric(
            "noise_share",
            "§3, §5",
            "share of the high-similarity pairs that fail the attention gate (similar without attention)",
            "",
            (
                Column(
                    "noise_share",
                    "1 - attended_high / nullif(high_pairs, 0)",
                    "1 − attended_high / high_pairs",
                    bounds=SHARE,
                ),
            ),
            sums=(head_int("attended_high"),),
        ),
        Metric(
            "similarity",
            "§4",
            "mean context similarity C_ij of the high pairs and of all pairs",
            "",
            (
                Column(
                    "sim_mean_high",
                    "sim_sum_high / nullif(high_pairs, 0)",
                    "mean C_ij over H",
                    heads=False,
                    layers=False,
                ),
                Column("sim_mean_all", "sim_sum_all / nullif(pairs, 0)", "mean C_ij over P", heads=False, layers=False),
            ),
            sums=(head_float("sim_sum_all"), head_float("sim_sum_high")),
        ),
        _attention_to(
            "attn_to_cls",
            "[CLS]",
            "uniform_cls",
            "windows",
            "§4, §5b, §8",
            (head_float("attn_to_cls"), run_float("uniform_cls")),
        ),
        _attention_to(
            "attn_to_sep",
            "[SEP]",
            "uniform_sep",
            "windows",
            "§4, §5b, §8",
            (head_float("attn_to_sep"), run_float("uniform_sep")),
        ),
        _attention_to(
            "attn_to_punct",
            "'.' and ',' tokens",
            "uniform_punct",
            "punct_tokens",
            "§4, §5b, §8",
            (head_float("attn_to_punct"), run_int("punct_tokens"), run_float("uniform_punct")),
        ),
        _attention_to(
            "attn_to_first",
            "position 0 ([CLS] in BERT, BOS in a decoder: the sink)",
            "uniform_first",
            "",
            "§8",
            (head_float("attn_to_first"), run_float("uniform_first")),
        ),
        _mean("attn_to_self", "attention weight on the query token itself (A_ii)"),
        _mean("attn_to_prev", "attention weight on the previous token (A_i,i−1)", layers=False),
        Metric(
            "attn_to_next",
            "§4, §8",
            "attention weight on the next token (A_i,i+1); NULL for causal attention, which cannot see it",
            "",
            (
                Column(
                    "attn_to_next",
                    # next_rows: rows whose next token is visible (0 under causal attention; NULL for
                    # runs stored before it existed, all bidirectional)
                    "CASE WHEN coalesce(next_rows, 1) > 0 THEN attn_to_next / nullif(attn_rows, 0) END",
                    "attention weight on the next token (A_i,i+1), per query row",
                    layers=False,
                    bounds=SHARE,
                ),
            ),
            sums=(head_float("attn_to_next"), run_int("next_rows")),
        ),
        _mean("attn_entropy", "attention entropy −Σ_j A_ij ln A_ij (nats)", bounds=POSITIVE),
        Metric(
            "anchor_frequency_share",
            "§5b",
            "share of windows whose anchor token is the window's most frequent token",
            "",
            (
                Column(
                    "anchor_frequency_share",
                    "anchor_frequent / nullif(anchored_windows, 0)",
                    "anchor_frequent / anchored_windows",
                    bounds=SHARE,
                ),
            ),
            sums=(head_int("anchor_frequent"), head_int("anchored_windows")),
        ),
        _copies(
            "dup",
            "dup_rows",
            "§8",
            "attention from a token to the earlier copies of itself (duplicate-token heads)",
            "earlier copies of the query token",
        ),
        _copies(
            "induction",
            "induction_rows",
            "§8",
            "attention from a token to the tokens that followed its earlier copies (induction heads)",
            "the tokens after earlier copies of the query token",
        ),
        Metric(
            "high_pairs",
            "§3, §4",
            "size of the high-similarity set H, summed over windows (and the run's counts it is read against)",
            "",
            (Column("high_pairs", "high_pairs", "|H| summed over windows", interval=False, layers=False),),
            sums=(head_int("high_pairs"), run_int("windows"), run_int("pairs"), run_int("attn_rows")),
        ),
        *EFFECT_METRICS,
        STREAMING_METRIC,
    ),
    page=(
        "within_sentence",
        "short_range_share",
        "attn_to_punct_lift",
        "attn_entropy",
        "anchor_frequency_share",
    ),
    terminal=("within_sentence_lift_dm", "repetition_words_lift_dm", "mean_distance", "noise_share"),
)

COLUMNS: tuple[Column, ...] = tuple(c for m in METRICS for c in m.columns)
SUMS: tuple[Sum, ...] = tuple(s for m in METRICS for s in m.sums)
HEAD_SUMS: tuple[str, ...] = tuple(s.name for s in SUMS if s.scope is Scope.HEAD)
CHANCE_SUMS: tuple[str, ...] = tuple(s.name for s in SUMS if s.scope is Scope.RUN)
INT_SUMS: frozenset[str] = frozenset(s.name for s in SUMS if s.kind is int)
SUM_KINDS: dict[str, type] = {s.name: s.kind for s in SUMS}
# the sums of the causal effects (SPEC §9), computed on the run's effect windows only; the others
# are computed on every window by the statistics (service.engine.stats)
EFFECT_SUM_NAMES: frozenset[str] = frozenset(s.name for m in EFFECT_METRICS for s in m.sums)
STAT_HEAD_SUMS: tuple[str, ...] = tuple(n for n in HEAD_SUMS if n not in EFFECT_SUM_NAMES)
STAT_CHANCE_SUMS: tuple[str, ...] = tuple(n for n in CHANCE_SUMS if n not in EFFECT_SUM_NAMES)


# --- metrics of installed plugins (the headatlas.metrics entry point) ------------------------------
_PLUGIN_METRICS: dict[str, tuple[Metric, ...]] = {}  # origin -> its metrics


# a plugin's sum: ``<measure>.<sum>`` (or one plain name), lower case, as a measure's payload names it
_SUM_NAME = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)?")


def sql_name(name: str) -> str:
    """``name`` as an SQL identifier: a plugin's ``<measure>.<sum>`` quoted (``"punct.both"``),
    a plain name as it is."""
    return name if name.isidentifier() else '"' + name.replace('"', '""') + '"'


def _install_plugin(plugin: Any, value: Any) -> None:
    """A ``headatlas.metrics`` entry point names a Metric (or a tuple of them): its per-head sums
    (stored by name, table ``named_head_sums``) and its columns, SQL over the stored sums, its own
    and its earlier columns (``check_columns``); anything else is refused, naming the plugin."""
    from headatlas.service.errors import PluginError

    metrics = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not metrics or not all(isinstance(m, Metric) for m in metrics):
        raise PluginError(f"{plugin.value} is not a Metric (or a tuple of them)")
    taken = {c.name for c in all_columns()} | {s.name for s in all_sums()} | {*DISTANCE_INPUTS, *STREAMING_INPUTS}
    named = {m.name: m.origin for m in all_metrics()}
    for metric in metrics:
        if metric.name in named:  # listings and metric_of() would show two metrics of one name
            owner = "headatlas's" if named[metric.name] == "headatlas" else f"{named[metric.name]}'s"
            raise PluginError(f"metric {metric.name!r} is {owner} already: give the plugin's metric another name")
        named[metric.name] = plugin.origin
        for s in metric.sums:
            if s.scope is not Scope.HEAD:
                raise PluginError(
                    f"metric {metric.name!r}: sum {s.name!r} is per run; a plugin's sums are per head "
                    "(stored by name in named_head_sums), per-run sums only headatlas's own"
                )
            if not _SUM_NAME.fullmatch(s.name):
                raise PluginError(
                    f"metric {metric.name!r}: sum {s.name!r} is not a sum name: '<measure>.<sum>', lower-case "
                    "letters, digits and _"
                )
            if s.name in taken or s.name.lower() in taken:
                raise PluginError(f"metric {metric.name!r}: sum {s.name!r} is a column or sum already")
            taken.add(s.name)
        for column in metric.columns:
            if column.name in taken:
                raise PluginError(f"metric {metric.name!r}: column {column.name!r} is a column or sum already")
            taken.add(column.name)
    check_columns([c for m in metrics for c in m.columns], sums=tuple(s for m in metrics for s in m.sums))
    _PLUGIN_METRICS[plugin.origin] = tuple(replace(m, origin=plugin.origin) for m in metrics)


def check_columns(columns: list[Column], *, sums: tuple[Sum, ...] = ()) -> None:
    """Raise PluginError when a column's SQL does not bind over the totals the views read (every
    sum, the installed plugins' and ``sums`` included, the distance inputs, the declared columns
    and those of ``columns`` before it), as the views would bind it."""
    import duckdb

    from headatlas.service.errors import PluginError

    names = (*(sql_name(s.name) for s in (*all_sums(), *sums)), *DISTANCE_INPUTS, *STREAMING_INPUTS)
    inputs = ", ".join(f"NULL::DOUBLE AS {name}" for name in names)
    declared = [f"{c.sql} AS {c.name}" for c in all_columns()]
    with duckdb.connect(":memory:") as conn:
        for column in columns:
            selected = ",\n".join([*declared, f"{column.sql} AS {column.name}"])
            try:
                conn.execute(f"SELECT {selected} FROM (SELECT {inputs}) LIMIT 0")
            except duckdb.Error as exc:
                first = str(exc).strip().splitlines()[0]
                raise PluginError(
                    f"column {column.name!r}: {column.sql!r} does not bind over the sums ({first})"
                ) from None
            declared.append(f"{column.sql} AS {column.name}")


def plugin_metrics() -> tuple[Metric, ...]:
    """The metrics of installed plugins (read once per process)."""
    from headatlas.service import plugins

    installed = plugins.load(plugins.METRICS, _install_plugin)
    return tuple(m for plugin, _value in installed for m in _PLUGIN_METRICS.get(plugin.origin, ()))


def all_metrics() -> tuple[Metric, ...]:
    """headatlas's metrics, then the plugins'."""
    return METRICS + plugin_metrics()


def plugin_sums() -> tuple[Sum, ...]:
    """The per-head sums installed plugins' metrics declare (stored in ``named_head_sums``)."""
    return tuple(s for m in plugin_metrics() for s in m.sums)


def all_sums() -> tuple[Sum, ...]:
    """headatlas's sums, then the plugins'."""
    return SUMS + plugin_sums()


def all_columns() -> tuple[Column, ...]:
    """Every view column, the plugins' included: what the views are built from."""
    return COLUMNS + tuple(c for m in plugin_metrics() for c in m.columns)


def reference() -> tuple[list[str], list[tuple]]:
    """One row per view column: its metric, SPEC section, one-line definition, what it is read
    against, where it comes from, and the sums its metric introduces (a plugin's are stored by
    name, ``named_head_sums``) (``headatlas metrics``)."""
    rows = [
        (c.name, m.name, m.spec, c.definition, m.against, m.origin, ", ".join(s.name for s in m.sums))
        for m in all_metrics()
        for c in m.columns
    ]
    return ["column", "metric", "spec", "definition", "against", "origin", "sums"], rows


def chance_centre(column: str) -> float | None:
    """The value ``column`` takes at chance (1 for every lift, ``_lift`` and ``_lift_dm`` alike),
    None where chance has no one value (a share, a mean, an effect) or the column is unknown: the
    one rule for a diverging colour map centred on chance and its "1 = chance" label."""
    for c in all_columns():
        if c.name == column:
            return c.centre
    return None


def chance_note(column: str) -> str:
    """ " (1 = chance)" for a column centred on chance, else "": the label's suffix."""
    centre = chance_centre(column)
    return "" if centre is None else f" ({centre:g} = chance)"


def metric_of(column: str) -> Metric:
    """The metric a view column belongs to."""
    for metric in all_metrics():
        if any(c.name == column for c in metric.columns):
            return metric
    raise KeyError(column)


def _check() -> None:
    names = [s.name for s in SUMS]
    twice = {n for n in names if names.count(n) > 1}
    if twice:
        raise RuntimeError(f"sums declared twice: {sorted(twice)}")
    columns = [c.name for c in COLUMNS]
    twice = {n for n in columns if columns.count(n) > 1}
    if twice:
        raise RuntimeError(f"view columns declared twice: {sorted(twice)}")


_check()
