"""The runs: names, aliases, tags, model, windows, status, and the progress of running runs.

``/runs`` (``?tag=T``, repeated: runs with all of them) holds the rows of ``headatlas runs
--format json``; ``/progress.json`` the progress of every unfinished run, which the page polls
(app.js) while one is running.
"""

from __future__ import annotations

from headatlas.service.storage.run_labels import UNFINISHED
from headatlas.service.web.context import Ctx, run_path
from headatlas.service.web.documents import run_record
from headatlas.service.web.html import Html, e, num, record, when
from headatlas.service.web.views import View

SHOWN = ("run_id", "name", "status", "windows", "model", "aliases", "tags", "snapshot", "created_at", "compute_s")


def runs_view(ctx: Ctx) -> View:
    tags = tuple(ctx.request.args("tag"))
    rows = ctx.runs(tags)
    progress = {p["run_id"]: p for p in progress_rows(ctx)} if any(r["status"] in UNFINISHED for r in rows) else {}

    def body() -> str:
        if not rows:
            said = f" tagged {', '.join(tags)}" if tags else ""
            return f"<p>No runs{e(said)} in this database yet: <code>headatlas analyze CORPUS</code> stores one.</p>"
        shown = [c for c in SHOWN if c in rows[0]]
        head = "".join(
            f"<th{' class=text' if c in ('name', 'model', 'aliases', 'tags', 'status') else ''}>{e(c)}</th>"
            for c in shown
        )
        lines = [_row(ctx, r, shown, progress.get(r["run_id"])) for r in rows]
        polling = ' data-progress="/progress.json"' if progress else ""
        table = (
            f'<div class="table-wrap"><table class="data" id="runs"{polling}><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(lines)}</tbody></table></div>"
        )
        return _tag_filter(ctx, tags) + table + _compare_form(ctx, rows)

    return View(f"Runs ({len(rows)})", [run_record(r) for r in rows], body)


def _row(ctx: Ctx, run: dict, shown: list[str], progress: dict | None) -> str:
    cells = []
    link = e(ctx.url(run_path(run["run_id"])))
    for c in shown:
        v = run[c]
        if c in ("run_id", "name"):
            cells.append(f'<td class="{"text" if c == "name" else ""}"><a href="{link}">{e(v)}</a></td>')
        elif c in ("aliases", "tags"):
            chips = "".join(
                f'<a class="chip" href="{e(ctx.url("/runs", tag=t))}">{e(t)}</a>'
                if c == "tags"
                else f'<span class="chip">{e(t)}</span>'
                for t in v
            )
            cells.append(f'<td class="text">{chips}</td>')
        elif c == "status":
            cells.append(f'<td class="text status" data-run="{e(run["run_id"])}">{_status(v, progress)}</td>')
        elif c == "windows":
            cells.append(f'<td class="windows" data-run="{e(run["run_id"])}">{num(v)}</td>')
        elif c == "created_at":
            cells.append(f'<td class="text">{e(when(v))}</td>')
        else:
            cells.append(
                f'<td class="{"text" if isinstance(v, str) else ""}">{num(v) if not isinstance(v, str) else e(v)}</td>'
            )
    return f"<tr>{''.join(cells)}</tr>"


def _status(status: str, progress: dict | None) -> str:
    if progress is None or progress.get("share") is None:
        return e(status)
    share = progress["share"]
    return f'{e(status)} <progress max="1" value="{share:.3f}"></progress> {100 * share:.0f}%'


def _tag_filter(ctx: Ctx, tags: tuple[str, ...]) -> str:
    if not tags:
        return ""
    clear = e(ctx.url("/runs"))
    return f'<p>Runs tagged {", ".join(f"<span class=chip>{e(t)}</span>" for t in tags)} · <a href="{clear}">all runs</a></p>'


def _compare_form(ctx: Ctx, rows: list[dict]) -> str:
    if len(rows) < 2:
        return ""
    options = "".join(f'<option value="{e(r["run_id"])}">{e(r["run_id"])} · {e(r["name"])}</option>' for r in rows)
    at = f'<input type="hidden" name="at" value="{e(ctx.at)}">' if ctx.request.arg("at") else ""
    return f"""<h2>Compare two runs</h2>
<form class="inline" action="/compare" method="get" id="compare-form">
<label>A <select name="a">{options}</select></label> <label>B <select name="b">{options}</select></label>
<label>by <select name="by"><option value="layer">layer</option><option value="head">head</option>
<option value="depth">relative depth</option></select></label>{at} <button type="submit">compare</button></form>
<p class="muted">Per layer (or head, for runs of one shape): both values, A − B with its 95% interval, and whether
the difference is beyond it; depths that differ are aligned by relative depth (SPEC §7).</p>"""


def progress_rows(ctx: Ctx) -> list[dict]:
    """Every unfinished run: its windows so far and, for a queued run, its batches stored, failed and
    planned, and the share of its planned windows stored (``share``; None while unknown)."""
    from headatlas.service.storage.queue_store import progress

    def compute() -> list[dict]:
        out = []
        for run in ctx.runs():
            if run["status"] not in UNFINISHED:
                continue
            seen = progress(ctx.reads.conn, run["run_id"])
            planned = seen.plan.windows if seen.plan is not None else None
            out.append(
                {
                    "run_id": run["run_id"],
                    "status": run["status"],
                    "windows": run["windows"],
                    "batches_done": seen.done,
                    "batches_failed": seen.failed,
                    "batches_planned": seen.plan.batches if seen.plan is not None else None,
                    "windows_planned": planned,
                    "share": min(1.0, seen.windows_done / planned) if planned else None,
                }
            )
        return out

    return ctx.reads.get(("progress",), compute)


def progress_view(ctx: Ctx) -> View:
    rows = progress_rows(ctx)
    return View("Progress", rows, lambda: record([(str(r["run_id"]), Html(_status(r["status"], r))) for r in rows]))
