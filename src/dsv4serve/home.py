"""Where dsv4serve keeps its state, so tests and users can isolate runs with $DSV4SERVE_HOME."""

from __future__ import annotations

import os
from pathlib import Path

from dsv4serve.errors import BadInput

_FIX = "set DSV4SERVE_HOME to a writable directory"


def _configured() -> Path:
    env = os.environ.get("DSV4SERVE_HOME")
    if env:
        # absolute: a relative home put relative paths into docker's -v and the run dir, and
        # status / down from another directory found no seat
        return Path(env).expanduser().absolute()
    # the XDG spec: a relative XDG_STATE_HOME is invalid and is ignored (unset reads as ".", relative too)
    xdg = Path(os.environ.get("XDG_STATE_HOME", "")).expanduser()
    base = xdg if xdg.is_absolute() else Path.home() / ".local" / "state"
    return base / "dsv4serve"


def nearest_existing(path: Path) -> tuple[Path, Path | None]:
    """The nearest existing ancestor of `path` (itself if it exists): where a directory for it would
    be created, and so what decides whether it can be. Also the first dangling symlink met on the
    way up, where mkdir would fail, or None."""
    probe, broken = path.expanduser(), None
    while not probe.exists() and probe.parent != probe:
        if broken is None and probe.is_symlink():
            broken = probe
        probe = probe.parent
    return probe, broken


def _check_usable(path: Path) -> None:
    """Refuse a state dir that cannot work before any command writes into it.

    Every state path (seats, runs, models, caches, patch backups) is derived from here, so one
    read-only check covers every writer, including those that call mkdir themselves; a dry run
    still writes nothing. The nearest existing ancestor stands in for a dir not created yet.
    """
    probe, broken = nearest_existing(path)
    if broken is not None:  # a dangling link: mkdir would fail on it
        raise BadInput(f"state dir {path} is not usable ({broken} is a broken symlink)", hint=_FIX)
    if not probe.is_dir():
        what = "is a file" if probe == path else f"is under {probe}, which is a file"
        raise BadInput(f"state dir {path} is not a directory (it {what})", hint=_FIX)
    if not os.access(probe, os.W_OK | os.X_OK):
        where = "" if probe == path else f" to {probe}, where it would be created"
        raise BadInput(f"state dir {path} is not writable (no write access{where})", hint=_FIX)


def home() -> Path:
    path = _configured()
    # Processes a seat started (tagged with its run id: vLLM and the plugin in its workers, maybe
    # in a container with its own home) only look here for a prebuilt lna2; `up` checked the
    # state dir before starting them, and a raise there would fail a worker, not a command.
    if not os.environ.get("DSV4SERVE_RUN_ID"):
        _check_usable(path)
    return path


def seats_dir() -> Path:
    return home() / "seats"


def runs_dir() -> Path:
    return home() / "runs"


def models_dir() -> Path:
    return home() / "models"


def cache_dir() -> Path:
    return home() / "cache"


def ensure(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        # What os.access cannot foresee: a read-only mount seen only at mkdir, a full disk, a
        # file where a subdirectory should be.
        raise BadInput(f"state dir {path} is not writable ({e.strerror or e})", hint=_FIX) from None
    return path
