"""A value as JSON holds it, for every front end that writes JSON or CSV (the command line's
``--format json|csv``, the web's ``.json`` and ``.csv``): one function, so that the web's documents
stay the command's to the byte. NaN and infinities become null, dates ISO text, numpy scalars
Python numbers."""

from __future__ import annotations

import math
from datetime import date, datetime
from typing import Any


def jsonable(value: Any) -> Any:
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:  # most values: first, and cheaply
        return value
    if kind is float:
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if hasattr(value, "item"):
        return value.item()
    return value
