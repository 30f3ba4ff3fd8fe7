"""What one analysed batch produces: the names of the additive sums and ``BatchResult``, the
numpy container that travels from a worker to the writer as compact bytes.

numpy only (no torch): the writer, the CLI's queries and the store import it without loading
the model stack.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import zipfile
from dataclasses import dataclass, field

import numpy as np

# numpy-free, so that the parameters (and with them the CLI) load without numpy; re-exported here
from headatlas.service.engine.schemes import (  # noqa: F401
    FALLBACK_BELOW,
    FALLBACK_BLOCK,
    FORWARD_MIXING,
    MIXING_METHODS,
    REPLICATE_UNITS,
    REPLICATES,
    parse_replicates,
)

# The additive sums, declared with the metrics that read them (service.metrics): per head
# (HEAD_SUMS, table head_stats) and per run (CHANCE_SUMS, table run_chance) that the statistics
# compute for every window; the causal effects' sums (SPEC §9), on a run's effect windows only,
# travel beside them when the run has effects (EFFECT_SUM_NAMES).
from headatlas.service.metrics import EFFECT_SUM_NAMES, INT_SUMS, STAT_CHANCE_SUMS, STAT_HEAD_SUMS, SUM_KINDS  # noqa: F401

HEAD_SUMS = STAT_HEAD_SUMS
CHANCE_SUMS = STAT_CHANCE_SUMS

# per mixing method (service.measures.mixing), layer and head
MIX_SUMS = ("to_cls", "to_sep", "to_punct", "to_self", "to_prev", "to_next", "entropy", "jsd_attention", "distance_sum")
# the run sums of payloads made before each sum had its own array (one int64 stack, this order)
PACKED_CHANCE = (
    "windows",
    "pairs",
    "same_sentence_pairs",
    "same_token_pairs",
    "attn_rows",
    "same_word_pairs",
    "punct_tokens",
)
# per run and distance: pairs in P, and those sharing a sentence / a token id / a word token id
PAIR_HISTS = ("pairs", "same_sentence", "same_token", "same_word")

# the corpus-averaged similarity matrices (SPEC §5c): all pairs of P, and H split by the attention gate
CSM_KINDS = ("all", "attended", "noise")


def _hash_group(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % REPLICATES


def sum_dtype(name: str) -> type[np.integer] | type[np.floating]:
    """The numpy type a sum travels in: int64 for counts, float64 for weights."""
    return np.int64 if name in INT_SUMS else np.float64


def replicate_group(window_id: str) -> int:
    """The §5b group of a window (``replicates = window``): a stable hash of its id, in [0, REPLICATES)."""
    return _hash_group(window_id)


def document_group(doc_id: str) -> int:
    """The group of every window of a document under ``replicates = document``."""
    return _hash_group(doc_id)


def block_group(doc_id: str, index: int, block: int) -> int:
    """The group of window ``index`` (0-based, within its document) under ``replicates = block:B``:
    windows ``kB … kB+B-1`` of one document share a group."""
    return _hash_group(f"{doc_id}#{index // block}")


def window_group(scheme: str, *, window_id: str, doc_id: str, index: int) -> int:
    """A window's replicate group under ``scheme`` (``document``, ``block:B`` or ``window``). What a
    window carries (its id, document id and index) is enough: a worker computes the group the
    embedded engine does from the batch message alone."""
    unit, block = parse_replicates(scheme)
    if unit == "document":
        return document_group(doc_id)
    if unit == "block":
        return block_group(doc_id, index, block)
    return replicate_group(window_id)


# The payload's deflate level: 1 encodes a MiniLM batch about 4.7x as fast as numpy's default (6)
# for 8 % more bytes (benchmarks/pipeline.py); ``np.load`` reads any level, so older payloads too.
PAYLOAD_LEVEL = 1


def _npz(arrays: dict[str, np.ndarray]) -> bytes:
    """``arrays`` as the bytes of an ``.npz`` file (what ``np.savez_compressed`` writes), deflated
    at ``PAYLOAD_LEVEL``."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=PAYLOAD_LEVEL) as archive:
        for name, value in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as out:
                np.lib.format.write_array(out, np.asanyarray(value), allow_pickle=False)
    return buf.getvalue()


_NPY_HEADER = re.compile(
    r"\{'descr': '([<>|=][a-zA-Z]\d*)', 'fortran_order': False, 'shape': \(((?:\d+, ?)*\d*)\), *\} *\n?"
)


def _unnpz(blob: bytes) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file's bytes (``_npz``'s), by name, as ``np.load`` reads them.
    A member of a plain dtype in C order is read from its header by a pattern, not by ``np.load``'s
    parse of the header as Python (a payload has about 50 members, and that parse was a third of
    decoding one); any other member is read by numpy itself."""
    out: dict[str, np.ndarray] = {}
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        for info in archive.infolist():
            name = info.filename.removesuffix(".npy")
            raw = archive.read(info)
            major = raw[6] if raw[:6] == b"\x93NUMPY" else 0
            if major == 1:
                start = 10 + int.from_bytes(raw[8:10], "little")
                found = _NPY_HEADER.fullmatch(raw[10:start].decode("latin1"))
            elif major in (2, 3):
                start = 12 + int.from_bytes(raw[8:12], "little")
                found = _NPY_HEADER.fullmatch(raw[12:start].decode("utf8" if major == 3 else "latin1"))
            else:
                found = None
            if found is None or (dtype := np.dtype(found.group(1))).hasobject:
                out[name] = np.lib.format.read_array(io.BytesIO(raw), allow_pickle=False)
                continue
            shape = tuple(int(n) for n in found.group(2).replace(" ", "").split(",") if n)
            # a writable copy, as np.load gives
            out[name] = np.frombuffer(bytearray(raw[start:]), dtype=dtype, count=int(np.prod(shape))).reshape(shape)
    return out


def mixing_key(method: str, name: str) -> str:
    """The name of mixing method ``method``'s sum ``name`` among the mixing measure's sums
    (``BatchResult.measures["mixing"]``): ``"<method>.<sum>"``."""
    return f"{method}.{name}"


def mixing_by_method(sums: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """The mixing measure's per-method sums (``mixing_key``) by method: ``{"head": [slot], sum
    name: [layer, slot], "dist": [layer, slot, seq_len]}``; its counts (no dot) left out."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, value in sums.items():
        method, dot, name = key.rpartition(".")
        if dot:
            out.setdefault(method, {})[name] = value
    return out


def _earlier_measures(data: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """The built-in measures' sums of a payload of an earlier version, which kept each in members
    of its own: ``mix.<method>.<sum>`` with ``mixing_counts`` (windows, rows), and ``csm_bin``,
    ``csm_sum``, ``csm_count``. A worker and the writer may be of different versions while an
    installation upgrades."""
    out: dict[str, dict[str, np.ndarray]] = {}
    mixing = {key.removeprefix("mix."): data[key] for key in data if key.startswith("mix.")}
    if mixing:  # a batch whose mixing took no window held no method and stored nothing
        counts = data.get("mixing_counts", np.zeros(2, dtype=np.int64))
        out["mixing"] = {"windows": np.asarray(counts[0]), "rows": np.asarray(counts[1]), **mixing}
    if "csm_sum" in data:
        out["csm"] = {"bin": data["csm_bin"], "sum": data["csm_sum"], "count": data["csm_count"]}
    return out


@dataclass
class BatchResult:
    """Summaries of one batch, kept per replicate group present in the batch (``reps``, ``[group]``,
    ascending). Shapes: ``rep_heads[name]`` ``[group, layer, head]``; ``rep_dist_hist`` and
    ``rep_attended_hist`` ``[group, layer, head, seq_len]`` (index = distance);
    ``rep_chance[name]`` ``[group]``; ``rep_pair_hist[name]`` ``[group, seq_len]``; anchors
    ``[window, layer, head]``. ``heads``, ``dist_hist``, ``chance`` and ``pair_hist`` are the
    batch totals. ``rep_same_sentence_hist`` ``[group, layer, head, seq_len]``: pairs of H at each
    distance sharing a sentence.

    ``measures[name]``: the sums of measure ``name`` that are not per head or per run, of any
    shape, by the measure's own names (absent: the measure did not run on the batch's windows).
    The built-ins' (service/measures/builtin.py): ``"csm"`` (SPEC §5c) ``{"bin": [], "sum", "count":
    [kind, layer, head, bin, bin]}`` (kind: CSM_KINDS), batch totals of the averaged similarity
    matrices in bins of ``bin`` positions; ``"mixing"`` (SPEC §6) ``{"windows": [], "rows": [],
    "<method>.<sum>": ...}`` (``mixing_key``), on the batch's first ``windows`` windows."""

    window_ids: list[str]
    reps: np.ndarray
    rep_heads: dict[str, np.ndarray]
    rep_dist_hist: np.ndarray
    rep_attended_hist: np.ndarray
    rep_chance: dict[str, np.ndarray]
    rep_pair_hist: dict[str, np.ndarray]
    anchor_token: np.ndarray  # token id, -1 where the window has no high pair
    anchor_count: np.ndarray  # endpoint count of the anchor
    high_count: np.ndarray  # |H| of the window
    anchor_frequent: np.ndarray  # bool: the anchor is the window's most frequent non-special token
    windows: list[dict] = field(default_factory=list)  # window_id, doc_id, window_index, n_tokens
    documents: list[dict] = field(default_factory=list)  # doc_id, source, line, n_chars, preview
    vocab: dict[int, str] = field(default_factory=dict)  # anchor token id -> token text
    compute_s: float = 0.0
    rep_same_sentence_hist: np.ndarray | None = None
    measures: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    # the causal effects (SPEC §9) of a run that has them: what they are measured against (objective,
    # unit, kinds, the reference set of mean ablation and the fingerprint of its means); their sums
    # travel in rep_heads / rep_chance (EFFECT_SUM_NAMES), zero in a batch without effect windows
    effects: dict = field(default_factory=dict)

    # --- batch totals -------------------------------------------------------------------------
    @property
    def heads(self) -> dict[str, np.ndarray]:
        """``[layer, head]`` per sum."""
        return {k: v.sum(0) for k, v in self.rep_heads.items()}

    @property
    def dist_hist(self) -> np.ndarray:
        return self.rep_dist_hist.sum(0)

    @property
    def attended_hist(self) -> np.ndarray:
        return self.rep_attended_hist.sum(0)

    @property
    def chance(self) -> dict[str, int | float]:
        return {k: v.sum().item() for k, v in self.rep_chance.items()}

    @property
    def pair_hist(self) -> np.ndarray:
        return self.rep_pair_hist["pairs"].sum(0)

    def to_bytes(self) -> bytes:
        arrays = {f"heads.{k}": v for k, v in self.rep_heads.items()}
        arrays.update({f"pairs.{k}": v for k, v in self.rep_pair_hist.items()})
        arrays.update({f"chance.{k}": v for k, v in self.rep_chance.items()})
        arrays.update(
            reps=self.reps,
            dist_hist=self.rep_dist_hist,
            attended_hist=self.rep_attended_hist,
            anchor_token=self.anchor_token,
            anchor_count=self.anchor_count,
            high_count=self.high_count,
            anchor_frequent=self.anchor_frequent,
            window_ids=np.array(self.window_ids),
            compute_s=np.array(self.compute_s),
            **{f"measure.{m}.{k}": v for m, sums in self.measures.items() for k, v in sums.items()},
            meta=np.frombuffer(
                json.dumps(
                    {"windows": self.windows, "documents": self.documents, "vocab": self.vocab, "effects": self.effects}
                ).encode(),
                dtype=np.uint8,
            ),
        )
        if self.rep_same_sentence_hist is not None:
            arrays["same_sentence_hist"] = self.rep_same_sentence_hist
        return _npz(arrays)

    @classmethod
    def from_bytes(cls, blob: bytes) -> BatchResult:
        data = _unnpz(blob)
        heads = {k.split(".", 1)[1]: data[k] for k in data if k.startswith("heads.")}
        pairs = {k.split(".", 1)[1]: data[k] for k in data if k.startswith("pairs.")}
        chance = {k.split(".", 1)[1]: data[k] for k in data if k.startswith("chance.")}
        if "chance" in data:  # a payload of an earlier version: the run sums in one stack
            chance = dict(zip(PACKED_CHANCE, data["chance"]))
        meta = json.loads(data["meta"].tobytes().decode())
        measures: dict[str, dict[str, np.ndarray]] = _earlier_measures(data)
        for key in data:
            if key.startswith("measure."):
                _, measure, name = key.split(".", 2)
                measures.setdefault(measure, {})[name] = data[key]
        return cls(
            window_ids=[str(x) for x in data["window_ids"]],
            reps=data["reps"],
            rep_heads=heads,
            rep_dist_hist=data["dist_hist"],
            rep_attended_hist=data["attended_hist"],
            rep_chance=chance,
            rep_pair_hist=pairs,
            anchor_token=data["anchor_token"],
            anchor_count=data["anchor_count"],
            high_count=data["high_count"],
            anchor_frequent=data["anchor_frequent"],
            windows=meta["windows"],
            documents=meta["documents"],
            vocab={int(k): v for k, v in meta["vocab"].items()},
            compute_s=float(data["compute_s"]),
            rep_same_sentence_hist=data["same_sentence_hist"] if "same_sentence_hist" in data else None,
            measures=measures,
            effects=meta.get("effects") or {},
        )
