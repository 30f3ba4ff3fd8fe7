"""What one analysed batch produces: the names of the additive sums and ``BatchResult``, the
numpy container that travels from a worker to the writer as compact bytes.

numpy only (no torch): the writer, the CLI's queries and the store import it without loading
the model stack.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field

import numpy as np

HEAD_SUMS = (
    "high_pairs",
    "sim_sum_all",
    "sim_sum_high",
    "same_sentence_high",
    "same_token_high",
    "attended_high",
    "attn_to_cls",
    "attn_to_sep",
    "attn_to_punct",
    "attn_to_self",
    "attn_to_prev",
    "attn_to_next",
    "attn_entropy",
)
# per mixing method (service.mixing), layer and head
MIX_SUMS = ("to_cls", "to_sep", "to_punct", "to_self", "to_prev", "to_next", "entropy", "jsd_attention",
            "distance_sum")
CHANCE_SUMS = ("windows", "pairs", "same_sentence_pairs", "same_token_pairs", "attn_rows")



@dataclass
class BatchResult:
    """Summaries of one batch. Shapes: heads ``[layer, head]``; dist_hist
    ``[layer, head, seq_len]`` (index = distance); pair_hist ``[seq_len]``; anchors
    ``[window, layer, head]``."""

    window_ids: list[str]
    heads: dict[str, np.ndarray]
    dist_hist: np.ndarray
    chance: dict[str, int]
    pair_hist: np.ndarray
    anchor_token: np.ndarray  # token id, -1 where the window has no high pair
    anchor_count: np.ndarray  # endpoint count of the anchor
    high_count: np.ndarray  # |H| of the window
    windows: list[dict] = field(default_factory=list)  # window_id, doc_id, window_index, n_tokens
    documents: list[dict] = field(default_factory=list)  # doc_id, source, line, n_chars, preview
    vocab: dict[int, str] = field(default_factory=dict)  # anchor token id -> token text
    compute_s: float = 0.0
    # mixing measures (service.mixing), on the first ``mixing_windows`` windows of the batch:
    # method -> {"head": [slot], sum name: [layer, slot], "dist": [layer, slot, seq_len]}
    mixing: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    mixing_windows: int = 0
    mixing_rows: int = 0  # valid query rows in those windows

    def to_bytes(self) -> bytes:
        arrays = {f"heads.{k}": v for k, v in self.heads.items()}
        arrays.update(
            dist_hist=self.dist_hist,
            pair_hist=self.pair_hist,
            anchor_token=self.anchor_token,
            anchor_count=self.anchor_count,
            high_count=self.high_count,
            window_ids=np.array(self.window_ids),
            chance=np.array([self.chance[k] for k in CHANCE_SUMS], dtype=np.int64),
            compute_s=np.array(self.compute_s),
            mixing_counts=np.array([self.mixing_windows, self.mixing_rows], dtype=np.int64),
            **{f"mix.{m}.{k}": v for m, sums in self.mixing.items() for k, v in sums.items()},
            meta=np.frombuffer(
                json.dumps(
                    {"windows": self.windows, "documents": self.documents, "vocab": self.vocab}
                ).encode(),
                dtype=np.uint8,
            ),
        )
        buf = io.BytesIO()
        np.savez_compressed(buf, **arrays)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, blob: bytes) -> "BatchResult":
        with np.load(io.BytesIO(blob), allow_pickle=False) as data:
            heads = {k.split(".", 1)[1]: data[k] for k in data.files if k.startswith("heads.")}
            chance = dict(zip(CHANCE_SUMS, (int(x) for x in data["chance"])))
            meta = json.loads(data["meta"].tobytes().decode())
            mixing: dict[str, dict[str, np.ndarray]] = {}
            for key in data.files:
                if key.startswith("mix."):
                    _, method, name = key.split(".", 2)
                    mixing.setdefault(method, {})[name] = data[key]
            counts = data["mixing_counts"] if "mixing_counts" in data.files else np.zeros(2, dtype=np.int64)
            return cls(
                window_ids=[str(x) for x in data["window_ids"]],
                heads=heads,
                dist_hist=data["dist_hist"],
                chance=chance,
                pair_hist=data["pair_hist"],
                anchor_token=data["anchor_token"],
                anchor_count=data["anchor_count"],
                high_count=data["high_count"],
                windows=meta["windows"],
                documents=meta["documents"],
                vocab={int(k): v for k, v in meta["vocab"].items()},
                compute_s=float(data["compute_s"]),
                mixing=mixing,
                mixing_windows=int(counts[0]),
                mixing_rows=int(counts[1]),
            )
