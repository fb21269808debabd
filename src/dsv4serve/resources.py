"""Locate data shipped with dsv4serve: in the installed wheel, or in the source checkout."""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent
# src/dsv4serve -> repository root (an editable install or a plain checkout on sys.path)
_REPO = _PKG.parent.parent


def _find(packaged: str, in_repo: str) -> Path:
    cand = _PKG / packaged
    if cand.is_dir():
        return cand
    cand = _REPO / in_repo
    if cand.is_dir():
        return cand
    raise FileNotFoundError(f"dsv4serve data folder '{in_repo}' is missing from this install")


def configs_dir() -> Path:
    return _find("configs", "configs")


def kernels_dir() -> Path:
    return _find("kernels/lna2", "kernels/lna2")


def patches_dir() -> Path:
    return _find("patches_data", "patches")
