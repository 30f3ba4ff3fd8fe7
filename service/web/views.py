"""What a page handler returns: its title, its JSON document, and its HTML (built only when asked)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class View:
    title: str
    # the page's JSON document (at its address plus .json), or what builds it (only when asked: an
    # HTML page does not need it)
    data: Any | Callable[[], Any]
    body: Callable[[], str]  # the page's HTML, between the title and the footer
    crumbs: Sequence[tuple[str, str]] = field(default_factory=tuple)  # (label, address) of the way back
    status: int = 200
    table: tuple[list[str], list[tuple]] | None = None  # columns and rows a .csv of the page holds

    def document(self) -> Any:
        """The page's JSON document."""
        return self.data() if callable(self.data) else self.data
