"""A results database and its runs in Python: ``connect``, ``Atlas`` (the runs, SQL over them) and
``RunView`` (one run's questions, each a ``Table``)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headatlas.service.analysis_options import DEFAULTS
from headatlas.service.api.tables import Table
from headatlas.service.api.terms import in_python_terms
from headatlas.service.errors import DatabaseNotFound
from headatlas.service.operations.events import Event, ResultWarning, Sink
from headatlas.service.operations.runs import find_run
from headatlas.service.storage.readonly import DEFAULT_MAX_BYTES
from headatlas.service.storage.store import Run, Store
from headatlas.service.wording import counted


class IntervalWarning(UserWarning):
    """A run's intervals rest on too few replicate groups to be read (SPEC §5d)."""


@in_python_terms
def connect(db: str | Path | None = None, *, data_path: str | Path | None = None, at: int | None = None) -> Atlas:
    """A results database (default: HEADATLAS_DB, else ``headatlas.duckdb``): a file, or a lake
    (``ducklake:postgres:dbname=… host=…``; ``data_path``: this machine's mount of its files,
    default HEADATLAS_DATA_PATH or what the lake recorded). ``at``: read it as of that snapshot
    (a lake; ``runs()`` shows each run's last one), so that numbers taken later are the same. A
    missing database raises FileNotFoundError."""
    from headatlas.service.config import Settings

    store = Store(db if db is not None else Settings.from_env().db, data_path=data_path, at=at)
    if not store.backend.exists():
        raise DatabaseNotFound(
            f"no database at {store.backend.label}: analyse a corpus into it first (headatlas.analyze(corpus, db=...))"
        )
    return Atlas(store)


@dataclass(frozen=True, repr=False)
class Atlas:
    """A results database: its runs, and read-only SQL over everything it holds."""

    store: Store

    def __repr__(self) -> str:
        return f"<Atlas {str(self.store.backend.label)!r}>"

    @in_python_terms
    def runs(self) -> Table:
        """Every stored run: id, name, status, model, corpus, windows, times."""
        rows = self.store.list_runs()
        columns = list(rows[0]) if rows else ["run_id", "name", "status", "model", "corpus", "windows"]
        return Table.of(columns, [tuple(r[c] for c in columns) for r in rows], what="runs")

    @in_python_terms
    def run(self, ref: str | int | None = None) -> RunView:
        """A run by id or name; the latest when ``ref`` is None. An unknown one raises
        LookupError."""
        with self.store.checked_read() as conn:
            return RunView.read(self.store, conn, ref)

    @in_python_terms
    def trend(
        self, series: str, metric: str, *, layer: int | None = None, head: int | None = None, ci: bool = False
    ) -> Table:
        """A training series' ``metric`` (a head column or probe score) of every head (of ``layer``;
        one ``head``) against the training step, as ``headatlas query trend --series``: with ``ci``
        its 95% interval (none for a probe score)."""
        from headatlas.service.reports.series_queries import trend

        with self.store.checked_read() as conn:
            columns, rows = trend(conn, series, metric=metric, layer=layer, head=head, ci=ci)
        return Table.of(columns, rows, what=f"trend, series {series}")

    @in_python_terms
    def phases(
        self,
        series: str,
        *,
        metrics: list[str] | None = None,
        layer: int | None = None,
        head: int | None = None,
        min_change: float | None = None,
    ) -> Table:
        """A training series' phase changes, as ``headatlas query phases``: per head and metric the
        consecutive checkpoints between which it changes most beyond both intervals, and the heads
        that change with it (``together``)."""
        from headatlas.service.reports.series_queries import PHASE_METRICS, phase_rows, phases

        with self.store.checked_read() as conn:
            found = phases(
                conn,
                series,
                metrics=tuple(metrics or PHASE_METRICS),
                layer=layer,
                head=head,
                min_change=min_change,
            )
        columns, rows = phase_rows(found)
        return Table.of(columns, rows, what=f"phases, series {series}")

    @in_python_terms
    def sql(
        self,
        statement: str,
        *,
        max_rows: int = 100_000,
        timeout_s: float = 30.0,
        memory_limit: str | None = None,
        max_bytes: int | str | None = DEFAULT_MAX_BYTES,
    ) -> Table:
        """Read-only SQL over every run, the same sandbox as ``headatlas sql`` (one SELECT; at most
        ``max_rows`` rows of at most ``max_bytes``, 64 MiB by default; stopped after ``timeout_s``
        seconds; ``memory_limit`` such as ``2GB``, default a quarter of this machine's, at most 2
        GiB). ``Atlas.run(…).sql`` reads one run."""
        return _sql(
            self.store,
            statement,
            max_rows=max_rows,
            timeout_s=timeout_s,
            memory_limit=memory_limit,
            max_bytes=max_bytes,
        )


def _sql(
    store: Store,
    statement: str,
    *,
    max_rows: int,
    timeout_s: float,
    memory_limit: str | None = None,
    run_id: int | None = None,
    max_bytes: int | str | None = DEFAULT_MAX_BYTES,
) -> Table:
    from headatlas.service.storage.readonly import run_readonly_sql

    result = run_readonly_sql(
        store.backend,
        statement,
        max_rows=max_rows,
        timeout_s=timeout_s,
        memory_limit=memory_limit,
        run_id=run_id,
        at=store.at,
        max_bytes=max_bytes,
    )
    notes = [f"{max_rows:,} rows shown: the result had more (pass max_rows=…)"] if result.truncated else []
    return Table.of(result.columns, result.rows, what="sql" if run_id is None else f"sql, run {run_id}", notes=notes)


@dataclass(frozen=True, repr=False)
class RunView:
    """One stored run: its facts (``run``, as stored when this view was made) and its questions,
    each a ``Table``."""

    store: Store
    run: Run
    windows: int = 0  # windows stored when the view was made

    @classmethod
    def read(cls, store: Store, conn, ref: str | int | None) -> RunView:
        """The view of a run (by id or name; the latest when ``ref`` is None) through an open
        read connection."""
        from sqlalchemy import text

        run = find_run(conn, ref)
        windows = conn.execute(
            text("SELECT coalesce(sum(windows), 0) FROM run_chance WHERE run_id = :r"), {"r": run.run_id}
        ).scalar()
        return cls(store, run, int(windows or 0))

    def __repr__(self) -> str:
        return f"<Run {self.run.run_id} {self.run.name!r} {self.run.status}, {counted(self.windows, 'window')}>"

    @property
    def run_id(self) -> int:
        """The run's id (what ``headatlas … --run`` takes, as its name)."""
        return self.run.run_id

    @property
    def name(self) -> str:
        """The run's name."""
        return self.run.name

    @property
    def status(self) -> str:
        """created, running, done, interrupted or failed (when this view was made)."""
        return self.run.status

    @in_python_terms
    def refresh(self) -> RunView:
        """The same run read again: its status and windows now."""
        with self.store.checked_read() as conn:
            return RunView.read(self.store, conn, self.run.run_id)

    def _query(
        self,
        query: Callable[..., Any],
        what: str,
        *,
        note: str = "",
        ci: bool = False,
        more: Sequence[str] = (),
        **kwargs: Any,
    ) -> Table:
        """Ask this run (service/operations/runs.py ``ask``, as the CLI's `query` commands do);
        ``more``: notes after the answer's own."""
        from headatlas.service.operations.runs import ask
        from headatlas.service.reports.intervals import interval_note, scheme_of

        said: list[str] = []
        answer = ask(self.store, self.run.run_id, query, ci=ci, events=_warnings_into(said), **kwargs)
        notes = [note]
        if ci:
            notes.append(
                interval_note([scheme_of(answer.run.params)], None if answer.groups is None else [answer.groups])
            )
        if answer.effects_note and answer.effects_note not in notes:  # what the effects are measured against
            notes.append(answer.effects_note)
        notes += more
        for warning in said:
            notes.append(f"warning: {warning}")
            warnings.warn(warning, IntervalWarning, stacklevel=4)  # the caller's line: past the method and its wrapper
        return Table.of(answer.columns, answer.rows, what=f"{what}, run {self.run.run_id}", notes=notes)

    @in_python_terms
    def heads(
        self, *, layer: int | None = None, sort: str | None = None, top: int | None = None, ci: bool = False
    ) -> Table:
        """Per head: every metric of ``headatlas query heads`` (with ``_lo``/``_hi`` when ``ci``),
        sorted by ``sort`` (descending) and cut to ``top`` rows when given."""
        from headatlas.service.reports import queries, query_support

        return self._query(queries.heads, "heads", note=query_support.LIFT_NOTE, layer=layer, sort=sort, top=top, ci=ci)

    @in_python_terms
    def layers(self, *, ci: bool = False) -> Table:
        """Per layer: the metrics of ``headatlas query layers`` (the progression from early to final
        layers) and anchor distinctness."""
        from headatlas.service.reports import layer_queries, query_support

        return self._query(layer_queries.layers, "layers", note=query_support.LIFT_NOTE, ci=ci)

    @in_python_terms
    def boundaries(self, *, ci: bool = False) -> Table:
        """Per layer: within-sentence shares against their chances (plain and matched to distance)
        and attention to the sentence separators against uniform."""
        from headatlas.service.reports import layer_queries, query_support

        return self._query(layer_queries.boundaries, "boundaries", note=query_support.LIFT_NOTE, ci=ci)

    @in_python_terms
    def distances(self, layer: int, head: int | None = None, *, split: bool = False, ci: bool = False) -> Table:
        """Distance profile of a head (or a layer's heads pooled) against chance; ``split``: also
        the attended (signal) and not-attended (noise) pairs."""
        from headatlas.service.reports import distance_queries

        note = "lift = share of the high-similarity pairs at d / share of all pairs at d (chance)"
        return self._query(
            distance_queries.distances, "distances", note=note, layer=layer, head=head, split=split, ci=ci
        )

    @in_python_terms
    def roles(
        self,
        *,
        stability: bool = False,
        layer: int | None = None,
        head: int | None = None,
        role: str | None = None,
    ) -> Table:
        """The head atlas of ``headatlas query roles`` (SPEC §7): one row per (head, role) with the
        evidence that earned it (metric, value and 95% interval, threshold, p, Holm-adjusted p) and
        the head's effect where the run has effects; heads without a role: "none established".
        ``stability``: each role also tested on each half of the replicate groups (``half_a``,
        ``half_b``, ``stable``). ``layer``, ``head``, ``role``: the rows returned (the tests and
        their Holm family stay the run's). ``.notes``: the test, how a role is earned, the heads
        per role and what the run's random-weights controls earn."""
        from headatlas.service.reports.intervals import interval_note, scheme_of
        from headatlas.service.reports.role_table import role_table

        with self.store.checked_read() as conn:
            atlas = role_table(
                conn,
                self.run,
                stability=stability,
                layer=layer,
                head=head,
                role=role,
                flags=("layer=", "head=", "role="),
            )
        notes = [
            f"head roles (SPEC §7); {atlas.tested}{atlas.chosen}",
            atlas.note,
            interval_note([scheme_of(self.run.params)], [atlas.groups]),
            atlas.counts_line(),
            *atlas.control_lines(),
        ]
        names, rows = atlas.names, atlas.rows
        if any(c.endswith("_lo") for c in names) and "interval_by" not in names:  # as the CLI's JSON has it
            names, rows = [*names, "interval_by"], [(*r, scheme_of(self.run.params)) for r in rows]
        return Table.of(names, rows, what=f"roles, run {self.run.run_id}", notes=notes)

    @in_python_terms
    def mixing(self, *, layer: int | None = None, methods: list[str] | None = None) -> Table:
        """Attribution and mixing measures per layer (or ``layer``'s heads), one column set per
        method (``methods``: attention, attribution, rollout, norm, alti; default: all stored)."""
        from headatlas.service.reports import mixing_queries

        return self._query(mixing_queries.mixing, "mixing", layer=layer, methods=methods)

    @in_python_terms
    def discrepancy(self, *, method: str = "attribution", top: int | None = None) -> Table:
        """Per head: the Jensen–Shannon divergence between attention and ``method``'s rows,
        ranked, and the layer progression."""
        from headatlas.service.reports import mixing_queries

        return self._query(mixing_queries.discrepancy, "discrepancy", method=method, top=top)

    @in_python_terms
    def examples(
        self,
        *,
        layer: int | None = None,
        head: int | None = None,
        kind: str | None = None,
        limit: int | None = None,
        context: int = 8,
    ) -> Table:
        """Each head's top examples, as ``headatlas query examples``: per kind (``anchor``, ``pair``,
        ``attention``) the windows where the head is strongest, ranked, with the tokens (``token_i``,
        ``token_j`` at ``pos_i``, ``pos_j``) and ``context`` tokens of text either side of them (in
        [brackets]); ``limit``: the first N of each head and kind. A run that kept none raises
        ValueError saying how to keep them."""
        from headatlas.service.reports import examples

        return self._query(
            examples.examples,
            "top examples",
            note=examples.NOTE,
            layer=layer,
            head=head,
            kind=kind,
            limit=limit,
            context=context,
        )

    @in_python_terms
    def effects(self, *, ci: bool = True, sort: str | None = None) -> Table:
        """Per head, the causal effects the run stores (``analyze --effects``, SPEC §9):
        ``effect_zero``/``effect_mean`` (O(ablated) − O(intact), the run's objective), ``importance``
        (mean |∂O/∂ξ|) and the output drift of each ablation, with 95% intervals (``ci``); beside
        each effect its per-layer normalisation ``<effect>_layer`` (v / ‖v of the layer‖₂, Michel
        et al. 2019), then the head's primary ``role``, ``noise_share`` and the probe's scores
        (where the run has a probe). ``.notes`` says what they are measured against and how many
        heads' intervals lie above 0."""
        from headatlas.service.reports.effect_queries import effects, significance_note
        from headatlas.service.storage.effect_rows import effect_note

        with self.store.checked_read() as conn:
            said = effect_note(conn, self.run.run_id) or ""
            counted_above = significance_note(conn, self.run.run_id) or ""
        return self._query(effects, "head effects", note=said, ci=ci, sort=sort, more=[counted_above])

    @in_python_terms
    def add_effects(
        self,
        *,
        kinds: str | Sequence[str] = "zero,mean",
        windows: int = 16,
        reference: int | None = None,
        objective: str = "auto",
        device: str = DEFAULTS["device"],
    ) -> Table:
        """Measure causal effects (SPEC §9) on the run's own first ``windows`` windows and store
        them in the run, as ``analyze --effects`` would have (``headatlas effects RUN``): ``kinds``
        of zero and mean ablation and gradient importance, mean ablation against the run's first
        ``reference`` windows (None: the run's own when it holds effects, else 256). Windows already
        stored are not measured again; more windows are added to those the run holds. Returns
        ``effects()`` of the run as it is then."""
        from headatlas.service.operations.added_effects import add
        from headatlas.service.operations.requests import AddEffectsRequest

        request = AddEffectsRequest.build(
            self.run.run_id, kinds=kinds, windows=windows, reference=reference, objective=objective, device=device
        )
        add(self.store, request)
        return self.refresh().effects()

    @in_python_terms
    def streaming(
        self,
        *,
        sink: int = 4,
        recent: int = 64,
        windows: int = 16,
        device: str = DEFAULTS["device"],
        show: bool = False,
    ) -> Table:
        """The streaming effects of ``headatlas effects RUN --streaming`` (SPEC §10): each KV head of
        a decoder in turn attends only to the first ``sink`` tokens and its ``recent`` most recent
        keys; per (layer, KV head) ``effect`` (O(streaming) − O(intact), the run's objective) on the
        run's ``windows`` windows, and the atlas predictors ``beyond`` (attention mass beyond sinks +
        W) and ``long_range`` (share of high-similarity pairs at a distance ≥ W), with 95% intervals.
        Measured in this process and stored with the run by (``sink``, ``recent``), replacing the
        rows of that restriction (``show``: read the stored ones, nothing measured; a ParameterError
        where there are none). ``.notes`` gives each predictor's Spearman ρ with the effect."""
        from headatlas.service.operations.streaming_runs import (
            StreamingRequest,
            measure_streaming,
            stored_streaming,
        )

        if show:
            found = stored_streaming(self.store, self.run.run_id, sink, recent)
            if found is None:
                from headatlas.service.errors import Param, ParameterError

                raise ParameterError(
                    Param("show", True),
                    f": run {self.run.run_id} holds no streaming effects of sink {sink} and recent {recent}; "
                    "measure them first",
                )
        else:
            request = StreamingRequest(self.run.run_id, sink=sink, recent=recent, windows=windows, device=device)
            found = measure_streaming(self.store, request)
        what = f"streaming KV heads (S = {sink}, W = {recent}), run {self.run.run_id}"
        return Table.of(found.columns, found.rows, what=what, notes=[found.note()])

    @in_python_terms
    def memory_curve(
        self,
        *,
        sink: int = 4,
        recent: int = 64,
        orders: Sequence[str] | None = None,
        step: float = 0.1,
        seeds: int = 3,
        windows: int = 16,
        max_loss: float = 0.05,
        device: str = DEFAULTS["device"],
        show: bool = False,
    ) -> Table:
        """The memory curve of ``headatlas prune RUN --streaming`` (SPEC §10): KV heads turned to
        streaming (``sink`` S, ``recent`` W) cumulatively in each order (``orders``: effect, beyond,
        long_range, noise, random, layer, sinks; default all; effect and beyond need the run's stored
        streaming effects of (S, W), ``streaming()``), a share ``step`` at a time; per order and step
        the memory saved per sequence (bytes and share of the KV cache) and the objective's increase
        on ``windows`` evaluation windows with 95% intervals. Measured in this process and stored
        with the run (``show``: the newest stored, nothing measured). ``.notes``: how it was made,
        and the headline, the memory saved at a loss increase of ``max_loss``."""
        from headatlas.service.operations.memory_curves import (
            MemoryCurveRequest,
            check_max_loss,
            headline,
            memory_curve,
            note,
        )

        request = MemoryCurveRequest.build(
            self.run.run_id,
            sink=sink,
            recent=recent,
            orders=orders,
            step=step,
            seeds=seeds,
            windows=windows,
            device=device,
            show=show,
        )
        x = check_max_loss(max_loss)
        saved = memory_curve(self.store, request).saved
        said = [note(saved), headline(saved, x).text()]
        return Table.of(saved.columns, saved.rows, what=f"memory curve, run {self.run.run_id}", notes=said)

    @in_python_terms
    def policy(
        self,
        max_loss: float,
        *,
        order: str | None = None,
        format: str | None = None,
        out: str | None = None,
        verify: bool = False,
        windows: int = 8,
        device: str = DEFAULTS["device"],
    ) -> dict:
        """The streaming policy of ``headatlas policy RUN --max-loss X`` (SPEC §10), read from the
        run's newest memory curve: the longest prefix of ``order`` (default effect) whose measured
        increase stays ≤ ``max_loss`` streams. Returns it as the JSON export's dict (run, model,
        window length, objective, S, W, order, ``full_attention_heads`` ``[layer][kv_head]`` with 1
        = full attention, and each KV head's evidence); ``out`` with ``format`` (duo or json) also
        writes the files there; ``verify``: the objective's change with the policy applied on
        ``windows`` held-out windows, in ``["verification"]``."""
        from pathlib import Path

        from headatlas.service.operations import streaming_policy as sp

        chosen = sp.choose(self.store, self.run.run_id, max_loss, order)
        if verify:
            sp.verify(self.store, chosen, windows=windows, device=device)
        if out is not None:
            sp.write(chosen, format or "json", Path(out))
        return chosen.as_dict()

    @in_python_terms
    def prune(
        self,
        *,
        orders: Sequence[str] | None = None,
        step: float = 0.1,
        seeds: int = 3,
        windows: int = 16,
        reference: int | None = None,
        device: str = DEFAULTS["device"],
        show: bool = False,
        until: str | float | None = None,
    ) -> Table:
        """The pruning curves of ``headatlas prune`` (SPEC §9): heads removed cumulatively in each
        order (``orders``: effect, importance, one_per_layer, noise, random and the trivial ones;
        default all the run's objective allows), the objective and its increase over the intact
        model with 95% intervals, measured in this process and stored with the run (``show``: the
        newest stored ones, nothing measured). ``.notes`` holds the seed paper's claim tested: the
        area between the noise order and random ones, and Spearman's ρ(noise_share, effect), each
        with its interval, and every layer reduced to its most important head (``one_per_layer``).
        Beside an encoder's embedding drift the rows add neighbour retrieval (``top1``, ``mrr`` and
        their intervals) and a note says what it is and its chance.
        ``until``: a rise of the objective, in its units (0.05) or a share of the rise with every
        head removed ("10%"): a second note says which heads can go before it (``prune --until``)."""
        from headatlas.service.operations.prune_michel import parse_until, until_of
        from headatlas.service.operations.pruning import prune
        from headatlas.service.operations.requests import PruneRequest
        from headatlas.service.storage.effect_rows import retrieval_note

        request = PruneRequest.build(
            self.run.run_id,
            orders=orders,
            step=step,
            seeds=seeds,
            windows=windows,
            reference=reference,
            device=device,
            show=show,
        )
        if until is not None:  # refused before anything is measured
            parse_until(until)
        saved = prune(self.store, request).saved
        notes = [saved.meta["claim"]]
        said_retrieval = retrieval_note(saved.meta)
        if said_retrieval is not None:
            notes.append(said_retrieval)
        if until is not None:
            notes.append(until_of(saved, until, request.orders).text())
        return Table.of(saved.columns, saved.rows, what=f"pruning curves, run {self.run.run_id}", notes=notes)

    @in_python_terms
    def sql(
        self,
        statement: str,
        *,
        max_rows: int = 100_000,
        timeout_s: float = 30.0,
        memory_limit: str | None = None,
        max_bytes: int | str | None = DEFAULT_MAX_BYTES,
    ) -> Table:
        """Read-only SQL over this run alone: every table and view (``head_metrics``,
        ``layer_metrics``, ``anchors``, ``windows``, …) holds its rows only. The sandbox of
        ``headatlas sql``: one SELECT, at most ``max_rows`` rows of at most ``max_bytes``, stopped
        after ``timeout_s`` s, within ``memory_limit``."""
        return _sql(
            self.store,
            statement,
            max_rows=max_rows,
            timeout_s=timeout_s,
            memory_limit=memory_limit,
            run_id=self.run.run_id,
            max_bytes=max_bytes,
        )


def _warnings_into(said: list[str]) -> Sink:
    """The sink of a run view's question: its warnings kept, to go under its table and to the
    caller as IntervalWarning; a note about the run (a view is of one run, as it was read) dropped."""

    def sink(event: Event) -> None:
        if isinstance(event, ResultWarning):
            said.append(event.text)

    return sink
