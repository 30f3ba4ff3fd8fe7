"""A migration's DDL as a lake takes it (``migrations/env.py`` passes a lake's statements through
``lake_ddl``): DuckLake has no sequences, PRIMARY KEY or UNIQUE, and only literal defaults."""

from __future__ import annotations

import re

_SKIP_DDL = re.compile(r"^\s*(CREATE|DROP)\s+SEQUENCE\b", re.IGNORECASE)
_LAKE_DDL = [
    (re.compile(r"\s+DEFAULT\s+nextval\s*\(\s*'[^']*'\s*\)", re.IGNORECASE), ""),
    (re.compile(r"\s+DEFAULT\s+current_timestamp\b", re.IGNORECASE), ""),
    (re.compile(r",\s*PRIMARY\s+KEY\s*\([^)]*\)", re.IGNORECASE), ""),
    (re.compile(r"\s+PRIMARY\s+KEY\b", re.IGNORECASE), ""),
    (re.compile(r"\s+UNIQUE\b(?!\s*\()", re.IGNORECASE), ""),
]


def lake_ddl(statement: str) -> str | None:
    """A migration's statement as a lake takes it, or None to skip it: DuckLake has no
    sequences, PRIMARY KEY or UNIQUE, and only literal defaults. The store keeps those
    invariants itself there (ids under a serialising update, ledger checks with conflict
    retry); an embedded file keeps its constraints, and its DDL is never rewritten."""
    if _SKIP_DDL.match(statement):
        return None
    for pattern, replacement in _LAKE_DDL:
        statement = pattern.sub(replacement, statement)
    return statement
