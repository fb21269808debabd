"""Find and import the lna2 extension, and say why when it cannot be used."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from dsv4serve.errors import first_line
from dsv4serve.lna2.build import MODULE, build_tag, default_out, source_digest

_loaded: Any = None
_error: str | None = None


ENV = "DSV4SERVE_LNA2_EXT"


def candidates() -> list[Path]:
    """The build to load: the one DSV4SERVE_LNA2_EXT names, and only it (a typo or a broken copy
    there must not quietly give the default build, which the user did not ask for), else the
    default build."""
    env = os.environ.get(ENV)
    return [Path(env)] if env else [default_out() / f"{MODULE}.so"]


def load() -> Any:
    """The extension module, or raise RuntimeError with the reason (extension not built, ...)."""
    global _loaded, _error
    if _loaded is not None:
        return _loaded
    import torch  # noqa: F401 - the extension links against libtorch; load it first

    tried, broken = [], []
    unloadable = False  # a file that is a module but fails to load (another Python's or torch's build)
    for path in candidates():
        if not path.is_file():
            tried.append(f"{path} ({'not a file' if path.exists() else 'missing'})")
            if path.exists():
                broken.append(tried[-1])
            continue
        spec = importlib.util.spec_from_file_location(MODULE, path)
        if spec is None or spec.loader is None:
            tried.append(f"{path} (not a loadable module)")
            broken.append(tried[-1])
            continue
        try:
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        except ImportError as e:
            tried.append(f"{path} ({first_line(e)})")
            broken.append(tried[-1])
            unloadable = True
            continue
        sys.modules.setdefault(MODULE, mod)
        _loaded = mod
        return mod
    if os.environ.get(ENV):
        if unloadable:
            # there and not loading: built for another Python or torch (a docker seat's launcher sets
            # the variable to its mount, which the user neither set nor can unset)
            _error = (f"{ENV} names {'; '.join(tried)}, which does not load here: rebuild it with this "
                      f"interpreter and torch (`dsv4serve kernel build`; for a docker seat, with the image's, "
                      f"then moe.extension)")
        else:
            _error = (f"{ENV} names {'; '.join(tried)}: point it at a build (`dsv4serve kernel build --out DIR`), "
                      f"or unset it to use the default build")
        raise RuntimeError(_error)
    try:  # e.g. mounted into a container's site-packages
        mod = importlib.import_module(MODULE)
        _loaded = mod
        return mod
    except ImportError as e:
        if not (isinstance(e, ModuleNotFoundError) and e.name == MODULE):
            # there, but it does not load (another Python's or torch's build): that is the reason
            where = getattr(e, "path", None) or MODULE
            broken.append(f"{where} on sys.path ({first_line(e)})")
    if broken:
        # a file that is there and does not load (truncated copy, another torch's ABI) is not
        # "not built": saying so would send the user to look for a build that exists
        _error = "extension does not load (" + "; ".join(broken) + "): rebuild it with `dsv4serve kernel build`"
    else:
        _error = "extension not built (" + "; ".join(tried) + "): run `dsv4serve kernel build`"
    raise RuntimeError(_error)


def _sources() -> dict[str, Any]:
    """What every description starts from: the module's name and the build id of these sources."""
    digest = _safe(source_digest)
    return {"module": MODULE, "source_build_id": build_tag(digest) if digest else None}


def describe() -> dict[str, Any]:
    info = _sources()
    try:
        mod = load()
    except (RuntimeError, OSError) as e:
        info.update(loadable=False, error=str(e))
        # the metadata of the file it tried (DSV4SERVE_LNA2_EXT's, else the default build's)
        with contextlib.suppress(ValueError):  # DSV4SERVE_LNA2_EXT=/ has no name to put .json on
            _read_meta(info, candidates()[0].with_suffix(".json"), None)
        return info
    path = getattr(mod, "__file__", None)
    try:
        info.update(loadable=True, path=path, build_id=mod.lna2_build_id(),
                    max_rows=mod.lna2_moe_max_rows(), scratch_bytes_seat=mod.lna2_moe_scratch_bytes(4096, 256))
    except AttributeError as e:
        # a build of older sources, without a function these sources call: not this API
        missing = getattr(e, "name", None) or str(e)
        info.update(loadable=False, path=path,
                    error=f"{path or MODULE} lacks {missing}: a build of other sources; "
                          "rebuild it with `dsv4serve kernel build`")
        return info
    # The metadata beside the module that loaded (DSV4SERVE_LNA2_EXT may point elsewhere than the
    # default build), and only if it describes that build: check-seat's arch row reads it.
    _read_meta(info, Path(path).with_suffix(".json") if path else default_out() / f"{MODULE}.json", info["build_id"])
    info["stale"] = _stale(info)
    try:
        import torch

        if torch.cuda.is_available():
            cap = torch.cuda.get_device_capability()
            info["device"] = torch.cuda.get_device_name()
            info["device_arch"] = f"sm_{cap[0]}{cap[1]}"
            info["info"] = dict(mod.lna2_moe_info(2))
    except Exception as e:  # noqa: BLE001 - a kernel built for another arch fails here
        info["device_error"] = str(e)
    return info


def describe_file(path: Path, what: str = "moe.extension") -> dict[str, Any]:
    """What describe() says, for a build this process does not load: a docker seat's moe.extension,
    built for the image's Python and torch and mounted there. Its metadata beside it (written by
    `dsv4serve kernel build`) is all there is to go by; without it the build cannot be named."""
    info = {**_sources(), "path": str(path), "loaded_here": False}
    if not path.is_file():
        info.update(loadable=False, error=f"{what} {path} is {'not a file' if path.exists() else 'missing'}")
        return info
    _read_meta(info, path.with_suffix(".json"), None)
    meta = info.get("built")
    if not isinstance(meta, dict) or not meta.get("build_id"):
        info.update(loadable=False, error=f"no build metadata beside {what} {path} "
                                          f"({path.with_suffix('.json').name}): its build cannot be named")
        return info
    info.update(loadable=True, build_id=build_tag(str(meta["build_id"]), meta.get("max_rows")),
                max_rows=meta.get("max_rows"))
    info["stale"] = _stale(info)
    return info


def _stale(info: dict[str, Any]) -> bool:
    """A build of these sources at its ceiling has exactly this id: one of other sources, or one made
    before the ceiling was part of the id (b<digest> with 16 rows), is stale."""
    digest = (info["source_build_id"] or "b")[1:]
    return info["build_id"] != build_tag(digest, info["max_rows"])


def _read_meta(info: dict[str, Any], meta_path: Path, build_id: str | None) -> None:
    if not meta_path.is_file():
        return
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, OSError, RecursionError):  # another user's private file, not JSON, not UTF-8, too deep
        info["built"] = "unreadable metadata"
        return
    if build_id is not None and (not isinstance(meta, dict) or build_tag(str(meta.get("build_id")), meta.get("max_rows")) != build_id):
        info["built"] = f"{meta_path} describes another build"
        return
    info["built"] = meta


def _safe(fn) -> Any:
    try:
        return fn()
    except OSError:
        return None
