"""Where dsv4serve keeps its state, so tests and users can isolate runs with $DSV4SERVE_HOME."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    env = os.environ.get("DSV4SERVE_HOME")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "state"
    return base / "dsv4serve"


def seats_dir() -> Path:
    return home() / "seats"


def runs_dir() -> Path:
    return home() / "runs"


def models_dir() -> Path:
    return home() / "models"


def cache_dir() -> Path:
    return home() / "cache"


def ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
