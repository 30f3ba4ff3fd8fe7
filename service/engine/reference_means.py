"""The reference means of mean ablation (SPEC §9): each head's z averaged over the valid positions
of a run's first ``effect_reference`` windows, as data — identified by the fingerprint of their
float64 bytes, with the fingerprint of the reference windows' ids, and carried between processes
as bytes (queued workers share one copy). Computed by ``measures.effect_batch.reference_means``.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ReferenceMeans:
    """``m^{l,h}`` (SPEC §9): ``means`` ``[layer, head, d_head]`` float64 over ``positions`` valid
    positions of ``windows`` reference windows, whose ids in order hash to ``windows_fingerprint``."""

    means: np.ndarray
    windows: int
    positions: int
    windows_fingerprint: str

    @property
    def fingerprint(self) -> str:
        """The means' identity: a hash of their float64 bytes."""
        return hashlib.sha256(np.ascontiguousarray(self.means, dtype=np.float64).tobytes()).hexdigest()[:16]

    def tensor(self) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.means, dtype=np.float64))

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        np.savez(
            buf,
            means=np.asarray(self.means, dtype=np.float64),
            counts=np.array([self.windows, self.positions], dtype=np.int64),
            windows_fingerprint=np.array(self.windows_fingerprint),
        )
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, blob: bytes) -> ReferenceMeans:
        with np.load(io.BytesIO(blob), allow_pickle=False) as data:
            counts = data["counts"]
            return cls(data["means"], int(counts[0]), int(counts[1]), str(data["windows_fingerprint"]))


def windows_fingerprint(window_ids: list[str]) -> str:
    """The identity of a reference set: a hash of its window ids, in order."""
    return hashlib.sha256("\n".join(window_ids).encode()).hexdigest()[:16]
