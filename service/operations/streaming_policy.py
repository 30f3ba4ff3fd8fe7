"""A streaming policy for a loss budget (SPEC §10): ``headatlas policy RUN --max-loss X`` and
``run.policy(...)``.

The policy is read from the run's newest memory curve (``prune RUN --streaming``): the longest
prefix of the chosen order (``--order``; default effect) whose measured increase of the objective
stays ≤ X from the first step on; its KV heads stream (S sinks, W recent keys), the others keep the
full cache. It is written in DuoAttention's layout — ``full_attention_heads.tsv`` (rows = layers,
columns = KV heads, 1 = full attention, 0 = streaming; tab-separated, as ``np.savetxt`` writes it
and DuoAttention's ``load_attn_pattern`` reads it) and ``config.json`` with ``sink_size`` S and
``recent_size`` W — or as one JSON that names the run, model, window length, objective, S, W, the
order and the evidence (each KV head's stored streaming effect with its interval).

``verify`` runs the model with the policy applied — every streaming KV head at once, through the
hook points ``blocks.L.attn.mask`` — on windows used neither to choose the order nor to measure
the curve, and gives the objective's change (paired, window by window) with its §5d interval; a
policy of no streaming head changes nothing: 0 exactly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from headatlas.service.errors import Param, ParameterError
from headatlas.service.operations.memory_curves import KVHead, check_max_loss, chosen_order, within
from headatlas.service.wording import counted

if TYPE_CHECKING:
    from headatlas.service.storage.store import Run, Store
    from headatlas.service.storage.streaming_curve_rows import StoredMemoryCurve

FORMATS = ("duo", "json")
TSV = "full_attention_heads.tsv"
CONFIG = "config.json"
JSON = "policy.json"


@dataclass
class Verification:
    """The objective's change with the policy applied on ``windows`` held-out windows: mean and its
    95% interval (NaN bounds with fewer than two replicate groups)."""

    windows: int
    groups: int
    intact: float
    change: float
    lo: float
    hi: float
    window_ids: list[str] = field(default_factory=list)

    def text(self, unit: str) -> str:
        bounds = (
            f" [{self.lo:+.4g}, {self.hi:+.4g}]" if math.isfinite(self.lo) else " (no interval: fewer than 2 groups)"
        )
        return (
            f"verified on {counted(self.windows, 'held-out window')} ({self.groups} replicate groups), none used to "
            f"choose the order or measure the curve: the objective changes by {self.change:+.4g} {unit}{bounds} "
            f"(intact {self.intact:.4g})"
        )


@dataclass
class Policy:
    """The KV heads that stream within a loss budget, and what chose them."""

    run: Run
    curve: StoredMemoryCurve
    order: str
    max_loss: float
    row: tuple  # the curve's row of the last step within the budget (streaming_curve_rows.STEP_COLUMNS)
    streaming: list[KVHead]
    evidence: list[dict]
    verification: Verification | None = None

    @property
    def full(self) -> np.ndarray:
        """``[layer, kv_head]``: 1 where the KV head keeps the full cache, 0 where it streams."""
        m = self.curve.meta
        out = np.ones((int(m["layers"]), int(m["kv_heads"])), dtype=np.int64)
        for layer, kv in self.streaming:
            out[layer, kv] = 0
        return out

    def _cell(self, name: str):
        return self.row[self.curve.columns.index(name)]

    def as_dict(self) -> dict:
        m = self.curve.meta
        out = {
            "run": {"id": self.run.run_id, "name": self.run.name},
            "model": self.run.model_name,
            "window_length": int(m["seq_len"]),
            "objective": m["objective"],
            "unit": m["unit"],
            "sink": int(m["sink"]),
            "recent": int(m["recent"]),
            "order": self.order,
            "max_loss": self.max_loss,
            "curve": int(m["curve_id"]),
            "step": int(self._cell("step")),
            "kv_heads": int(m["layers"]) * int(m["kv_heads"]),
            "kv_heads_streaming": len(self.streaming),
            "increase": [_finite(self._cell(c)) for c in ("increase", "increase_lo", "increase_hi")],
            "memory_saved_bytes": _finite(self._cell("memory_saved")),
            "memory_share": _finite(self._cell("memory_share")),
            "full_cache_bytes": _finite(m["full_cache"]),
            "kv_bytes": int(m["kv_bytes"]),
            "selection_windows": m["selection_windows"].split(),
            "evaluation_windows": m["evaluation_windows"].split(),
            "full_attention_heads": self.full.tolist(),
            "streaming_heads": [[layer, kv] for layer, kv in self.streaming],
            "evidence": self.evidence,
        }
        if self.verification is not None:
            v = self.verification
            out["verification"] = {
                "windows": v.window_ids,
                "groups": v.groups,
                "intact": _finite(v.intact),
                "change": [_finite(v.change), _finite(v.lo), _finite(v.hi)],
            }
        return out

    def text(self) -> str:
        m = self.curve.meta
        up = [self._cell(c) for c in ("increase", "increase_lo", "increase_hi")]
        bounds = f" [{up[1]:+.4g}, {up[2]:+.4g}]" if up[1] is not None and math.isfinite(up[1]) else ""
        return (
            f"policy for a loss budget of {self.max_loss:g} {m['unit']}: the {self.order} order's first "
            f"{counted(len(self.streaming), 'KV head')} of {int(m['layers']) * int(m['kv_heads'])} stream (S = "
            f"{m['sink']}, W = {m['recent']}), measured increase {up[0]:+.4g}{bounds} on the curve's "
            f"{counted(m['evaluated'], 'evaluation window')}, {self._cell('memory_share'):.1%} of the KV cache saved at "
            f"n = {m['seq_len']} (memory curve {m['curve_id']})"
        )


def _finite(value) -> float | None:
    return None if value is None or not math.isfinite(float(value)) else float(value)


def choose(store: Store, ref: str | int | None, max_loss: float, order: str | None = None) -> Policy:
    """The policy of the run's newest memory curve for a loss budget ``max_loss`` (module docstring)."""
    from headatlas.service.operations.runs import find_run
    from headatlas.service.operations.streaming_runs import group_jackknife
    from headatlas.service.storage.streaming_curve_rows import load_memory_curve
    from headatlas.service.storage.streaming_rows import streaming_sums

    max_loss = check_max_loss(max_loss)
    with store.checked_read() as conn:
        run = find_run(conn, ref, any_status=True)
        curve = load_memory_curve(conn, run.run_id)
        if curve is None:
            raise ParameterError(
                f"run {run.run_id} ({run.name}) has no memory curve to read a policy from: run `headatlas prune "
                f"{run.name} --streaming --sink S --recent W` first",
                parameter="max_loss",
                value=max_loss,
            )
        sums = streaming_sums(conn, run.run_id, int(curve.meta["sink"]), int(curve.meta["recent"]))
    name = chosen_order(curve, order)
    steps = curve.steps_of(name)
    at = curve.columns.index("increase")
    last = within([row[at] for row, _heads in steps], max_loss)
    streaming = [head for _row, heads in steps[1 : last + 1] for head in heads]
    layers, kv_heads = int(curve.meta["layers"]), int(curve.meta["kv_heads"])
    effect = beyond = None
    if sums is not None:
        effect = group_jackknife(sums.sums["effect_sum"], sums.sums["windows"])
        beyond = group_jackknife(sums.sums["beyond_sum"], sums.sums["windows"])
    chosen = set(streaming)
    evidence = []
    for layer in range(layers):
        for kv in range(kv_heads):
            entry: dict = {"layer": layer, "kv_head": kv, "streaming": (layer, kv) in chosen}
            if effect is not None and beyond is not None:
                entry["effect"] = [_finite(v[layer, kv]) for v in effect]
                entry["beyond"] = _finite(beyond[0][layer, kv])
            else:
                entry["effect"] = None
            evidence.append(entry)
    return Policy(run, curve, name, max_loss, steps[last][0], streaming, evidence)


def verify(store: Store, policy: Policy, *, windows: int = 8, device: str = "auto", model=None) -> Verification:
    """Run the model with ``policy`` applied on ``windows`` windows used neither to choose its order
    nor to measure its curve; sets and returns ``policy.verification``."""
    from headatlas.service.engine.model import load_model
    from headatlas.service.measures.objectives import objective_for
    from headatlas.service.operations.effect_runs import jackknife
    from headatlas.service.operations.memory_curves import Evaluation, held_out
    from headatlas.service.params import AnalysisParams

    if windows < 1:
        raise ParameterError(Param("windows", windows), ": verify on at least 1 window")
    run, m = policy.run, policy.curve.meta
    params = AnalysisParams.from_dict(run.params)
    loaded = model or load_model(run.model, device=device, dtype=params.dtype)
    used = set(m["selection_windows"].split()) | set(m["evaluation_windows"].split())
    chosen = held_out(run.corpus, loaded, params, windows, used)
    objective = objective_for(loaded, m["objective"])
    ev = Evaluation.of(loaded, chosen, objective, params, sink=int(m["sink"]), recent=int(m["recent"]))
    intact = ev.values([])
    change = ev.values(policy.streaming) - intact
    mean, lo, hi, groups = jackknife(change[:, None], ev.groups)
    policy.verification = Verification(
        windows=len(chosen),
        groups=groups,
        intact=float(np.mean(intact)),
        change=float(mean[0]),
        lo=float(lo[0]),
        hi=float(hi[0]),
        window_ids=[w.window_id for w in chosen],
    )
    return policy.verification


def duo_tsv(full: np.ndarray) -> str:
    """``full`` ``[layer, kv_head]`` as DuoAttention's ``full_attention_heads.tsv`` (``np.savetxt``,
    tab-separated, one line per layer)."""
    import io

    out = io.StringIO()
    np.savetxt(out, np.asarray(full, dtype=float).reshape(full.shape[0], -1), delimiter="\t")
    return out.getvalue()


def write(policy: Policy, fmt: str, folder: Path) -> list[Path]:
    """Write the policy into ``folder`` (made if missing): ``duo``: the TSV and config.json;
    ``json``: policy.json. Returns the paths written."""
    if fmt not in FORMATS:
        raise ParameterError(Param("format", fmt, quoted=True), f": use {' or '.join(FORMATS)}")
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "json":
        path = folder / JSON
        path.write_text(json.dumps(policy.as_dict(), indent=2) + "\n", encoding="utf-8")
        return [path]
    m = policy.curve.meta
    tsv, config = folder / TSV, folder / CONFIG
    tsv.write_text(duo_tsv(policy.full), encoding="utf-8")
    config.write_text(
        json.dumps({"sink_size": int(m["sink"]), "recent_size": int(m["recent"])}, indent=2) + "\n", encoding="utf-8"
    )
    return [tsv, config]


def read_duo(folder: Path) -> tuple[np.ndarray, int, int]:
    """A DuoAttention pattern folder read as DuoAttention reads it: ``[layer, kv_head]`` (1 = full),
    ``sink_size``, ``recent_size``."""
    full = np.loadtxt(folder / TSV, dtype=float, delimiter="\t", ndmin=2)
    config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    return np.clip(full, 0, 1), int(config["sink_size"]), int(config["recent_size"])
