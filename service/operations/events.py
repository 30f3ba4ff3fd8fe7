"""What an operation tells its front end while it works, typed: progress, notices, estimates and
warnings, delivered to a ``Sink`` the front end supplies (the CLI draws a progress bar and prints
lines on stderr; the Python API a tqdm bar; a quiet front end drops them all).

An event's words that name a parameter or a command are ``Part``s (service/errors.py), rendered
by the front end as it renders an error: ``--attribution-windows N`` or ``attribution_windows=N``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from headatlas.service.errors import Part

if TYPE_CHECKING:
    from headatlas.service.engine.run_plan import CorpusSummary
    from headatlas.service.storage.store import Run


@dataclass(frozen=True)
class CorpusRead:
    """The corpus is read and valid; ``model`` is loaded next (None: it is loaded already)."""

    corpus: CorpusSummary
    model: str | None


@dataclass(frozen=True)
class PassStarted:
    """A pass over the corpus begins: the run itself (``control_seed`` None), or its random-weights
    control with that seed (``controls``: how many; the model ``n_layers`` × ``n_heads``).
    ``max_windows``: the pass ends after that many windows (``--max-windows``), long before the
    corpus's last character where the corpus is large: progress is then counted in windows."""

    total_chars: int
    control_seed: int | None = None
    controls: int = 0
    n_layers: int = 0
    n_heads: int = 0
    max_windows: int | None = None

    def done(self, windows: int, consumed: int) -> tuple[int, int]:
        """(done, total) of the pass after ``windows`` windows and ``consumed`` characters."""
        if self.max_windows is not None:
            return min(windows, self.max_windows), self.max_windows
        return consumed, self.total_chars


@dataclass(frozen=True)
class Progress:
    """``windows`` more windows analysed; ``consumed`` corpus characters read so far."""

    windows: int
    consumed: int


@dataclass(frozen=True)
class PassEnded:
    """The pass ended: ``completed``, or stopped by an error or Ctrl-C where it was."""

    completed: bool


@dataclass(frozen=True)
class Estimate:
    """What a slow part will cost, said before it starts (``--attribution``: time and memory)."""

    text: tuple[Part, ...]


@dataclass(frozen=True)
class Notice:
    """Something the user should know that changes nothing asked (a run reused, a size kept)."""

    text: tuple[Part, ...]


@dataclass(frozen=True)
class RunReused:
    """The corpus, model and parameters are those of ``run``, stored under another name: it was
    reused, and ``name`` (the name asked for) now names it too."""

    run: Run
    name: str


@dataclass(frozen=True)
class NameKept:
    """The corpus, model and parameters are those of the queued run ``run_name``, which keeps its
    name: the queue does not write the database, so ``asked`` is not added as an alias."""

    run_name: str
    asked: str


@dataclass(frozen=True)
class ResultWarning:
    """A result to read with care: ``text`` says why (intervals from too few replicate groups,
    SPEC §5d). A front end shows it after the result it concerns."""

    text: str


@dataclass(frozen=True)
class WindowsMeasured:
    """``done`` of ``total`` windows measured (``effects``: every head removed in turn on each)."""

    done: int
    total: int


@dataclass(frozen=True)
class PruneStarted:
    """The pruning curves of ``run`` are measured next (its model loaded, its corpus read)."""

    run: Run


@dataclass(frozen=True)
class PruneStep:
    """Step ``done`` of ``total`` of the curve of order ``order`` evaluated; ``left_s``: the
    seconds the prune's other evaluations will take at the pace so far (None: not known)."""

    order: str
    done: int
    total: int
    left_s: float | None = None


Event = (
    CorpusRead
    | PassStarted
    | Progress
    | PassEnded
    | Estimate
    | Notice
    | RunReused
    | NameKept
    | ResultWarning
    | WindowsMeasured
    | PruneStarted
    | PruneStep
)
Sink = Callable[[Event], None]


def ignore(_event: Event) -> None:
    """The sink of a front end that shows nothing."""


def text_of(parts: str | Sequence[Part]) -> tuple[Part, ...]:
    return (parts,) if isinstance(parts, str) else tuple(parts)
