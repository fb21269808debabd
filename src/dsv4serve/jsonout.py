"""JSON that every parser takes, for `--json` output and result files."""

from __future__ import annotations

import json
import math
from typing import Any


def strict_json(obj: Any, **kw: Any) -> str:
    """A NaN or an infinity (a figure that could not be measured) becomes null, where Python's
    json would write the bare words NaN / Infinity that strict parsers (jq, JavaScript) refuse."""
    return json.dumps(_finite(obj), allow_nan=False, default=str, **kw)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
