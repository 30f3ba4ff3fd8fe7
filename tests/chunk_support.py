"""What the tests of the chunked paths share: the token classes of their small hand-made windows,
and a record of the largest tensor any operation made (a path that promises not to hold a pos × pos
map per head is checked by what it allocated, not by timing or by reading the process's memory)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from headatlas.service.engine.windows import TokenClasses

CLS, SEP, PAD, DOT = 1, 2, 0, 3
TOKENS = TokenClasses(
    cls_id=CLS,
    sep_id=SEP,
    pad_id=PAD,
    special_ids=frozenset({CLS, SEP, PAD}),
    sentence_end_ids=frozenset({DOT}),
    punct_ids=frozenset({DOT}),
)


class Largest(TorchDispatchMode):
    """The most elements (``numel``) and the most bytes of memory (``bytes``: a view counts its
    base's) behind any tensor an operation returned while the mode was on."""

    def __init__(self):
        super().__init__()
        self.numel = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
                self.bytes = max(self.bytes, t.untyped_storage().nbytes())
        return out
