"""`dsv4serve patch status|apply|revert`: the patch sets, by content hash.

Exit codes: 0 every file is in the wanted state (patched after status/apply, pristine after
revert; not-applicable counts as fine), 1 a file is not, 2 bad input (unknown set or profile).

`status` with no set named checks every shipped set whose package is installed at the set's
version (in --root, or in this environment) and lists the others as not checked, with why: a
set pinned to another version is not a fault of this tree. `apply` and `revert` change files,
so they only act on sets named by --set-name or a profile.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, List, Optional

import typer
from rich.markup import escape
from rich.table import Table

from dsv4serve.cli_common import console, dir_path, emit_json, handled
from dsv4serve.errors import EXIT_FAILED, EXIT_OK, BadInput, Signalled, restore_signals, stop_signals_raise

app = typer.Typer(help="Apply, verify and revert the exllamav3 / vLLM patch sets by content hash.",
                  no_args_is_help=True)

ProfileOpt = typer.Option(None, "--profile", "-p",
                          help="the sets this profile names, in its runtime.patch_root if it has one")
SetNameOpt = typer.Option(None, "--set-name", "-s", help="a patch set by name, e.g. vllm-0.32.0 (repeatable)")
RootOpt = typer.Option(None, "--root", parser=dir_path, metavar="DIR", help="site-packages tree to act on (check, patch or restore) instead of the installed packages")
JsonOpt = typer.Option(False, "--json", help="machine-readable output")

_STYLE = {"patched": "green", "pristine": "yellow", "not-applicable": "dim", "modified-unknown": "bold red",
          "missing": "red", "version-mismatch": "red", "package-missing": "red", "unreadable": "red"}


@dataclass
class _Targets:
    """What a command acts on: the sets, the tree, the profile, and (status only) what was left out."""

    sets: list[Any]
    root: Optional[Path]
    profile: Optional[str]
    skipped: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""
    docker: bool = False  # the profile's seat runs in a container (its tree is a host copy)


def _targets(profile: Optional[str], set_names: Optional[List[str]], root: Optional[Path],
             action: str) -> _Targets:
    """The sets from the options: --profile P or --set-name NAME; `status` may name neither."""
    from dsv4serve import patches
    from dsv4serve.profile import load_profile

    if profile and set_names:
        raise BadInput("name the patch sets with --profile P or --set-name NAME, not both")
    if root is not None and not root.is_dir():  # else a typo reads as "package not installed"
        raise BadInput(f"--root {root} is not a directory", hint="point it at a site-packages tree")
    if not profile and not set_names:
        if action == "status":
            return _installed_sets(root)
        raise BadInput(f"patch {action} needs the sets named: --profile P or --set-name NAME",
                       hint=f"sets: {', '.join(patches.available_sets()) or 'none'}")
    if profile:
        p = load_profile(profile)
        refusal = patches.image_refusal(p) if root is None else None
        if refusal is not None:  # the host's packages are not the seat's: acting on them would say nothing
            raise refusal
        r = root if root is not None else patches.profile_root(p)
        refusal = patches.root_refusal(p) if root is None else None
        if refusal is not None:  # as --root's check: not "package missing"
            raise refusal
        if not p.patches:
            if action == "status":  # a seat that needs no patches is in the state it wants
                return _Targets([], r, p.cli_ref(), note=f"profile {p.name} names no patch sets: nothing to verify")
            raise BadInput(f"profile {p.name} names no patch sets: nothing to {action}",
                           hint="name a set with --set-name NAME")
        return _Targets([patches.load_set(n) for n in p.patches], r, p.cli_ref(), docker=p.runtime.kind == "docker")
    return _Targets([patches.load_set(n) for n in set_names or []], root, None)


def _installed_sets(root: Optional[Path]) -> _Targets:
    """Every shipped set whose package is installed at its version; the others skipped, with why."""
    from dsv4serve import patches

    where = f" in {root}" if root else ""
    chosen: list[Any] = []
    skipped: list[dict[str, Any]] = []
    for name in patches.available_sets():
        pset = patches.load_set(name)
        tree = patches.find_root(pset.package, root)
        found = patches.installed_version(tree, pset.package, pset.distributions) if tree else None
        if tree is not None and found == pset.version:
            chosen.append(pset)
            continue
        reason = (f"{pset.package} not installed{where}" if tree is None else
                  f"pinned to {pset.package} {pset.version}, found {found or 'no dist-info'}{where}")
        skipped.append({"set": pset.set, "package": pset.package, "version": pset.version,
                        "installed_version": found, "reason": reason})
    note = "" if chosen else f"no patch set matches the packages installed{where or ' here'}: nothing to verify"
    return _Targets(chosen, root, None, skipped, note)


def _short(h: Optional[str]) -> str:
    return h[:10] if h else "-"


def _common_dir(paths: list[str]) -> str:
    import os.path

    if len(paths) < 2:
        return ""
    common = os.path.commonpath(paths)
    return common + "/" if common else ""


def _render(rows: list[Any], title: str, wanted: str = "patched") -> None:
    """One table per set; file paths are shown below the set's common folder (in the title). A row in
    the `wanted` state needs no fix, and is compared with that state's hash: after a revert every
    restored file said 'patch apply' beside a found/expected mismatch (helper audit)."""
    for set_name in dict.fromkeys(r.set for r in rows):
        mine = [r for r in rows if r.set == set_name]
        prefix = _common_dir([r.file for r in mine])
        where = f"in {mine[0].root}/{prefix}" if mine[0].root else f"({mine[0].package} not found)"
        t = Table(title=escape(f"{title}: {set_name} {where}"), title_justify="left")
        t.add_column("file", overflow="fold")
        t.add_column("state", no_wrap=True)
        t.add_column("found", no_wrap=True)
        t.add_column("expected", no_wrap=True)
        t.add_column("fix", overflow="fold", ratio=1)
        for r in mine:
            expected = r.pristine_sha256 if wanted == "pristine" else r.expected_sha256
            t.add_row(escape(r.file[len(prefix):]), f"[{_STYLE.get(r.state, '')}]{r.state}[/]", _short(r.found_sha256),
                      _short(expected), "" if r.state == wanted else escape(r.fix))
        console.print(t)


def _exit(rows: list[Any], wanted: frozenset[str]) -> None:
    raise typer.Exit(EXIT_OK if all(r.state in wanted for r in rows) else EXIT_FAILED)


def _render_left_out(t: _Targets) -> None:
    for sk in t.skipped:  # soft_wrap: one line per set, whole, for grep
        line = escape(f"not checked: {sk['set']}: {sk['reason']}")
        console.print(f"[dim]{line}[/]", highlight=False, soft_wrap=True)
    if t.note:
        console.print(t.note, highlight=False, soft_wrap=True, markup=False)


@app.command()
def status(profile: Optional[str] = ProfileOpt, set_name: Optional[List[str]] = SetNameOpt,
           root: Optional[Path] = RootOpt, json_out: bool = JsonOpt) -> None:
    """Per-file state of the patch sets: pristine, patched, modified-unknown, missing, version-mismatch.

    With no set named: every shipped set whose package is installed at the set's version.
    """
    from dsv4serve import patches

    with handled(json_out):
        t = _targets(profile, set_name, root, "status")
        rows = [row for s in t.sets for row in patches.set_status(s, t.root, profile=t.profile)]
        ok = all(row.state in patches.OK_PATCHED for row in rows)
        if json_out:
            emit_json({"action": "status", "ok": ok, "root": str(t.root) if t.root else None,
                       "sets": [s.set for s in t.sets], "rows": [row.model_dump() for row in rows],
                       "skipped": t.skipped, "note": t.note or None})
        else:
            _render(rows, "patch status")
            _render_left_out(t)
    _exit(rows, patches.OK_PATCHED)


@contextmanager
def _stoppable(action: str) -> Iterator[None]:
    """SIGTERM / SIGHUP stop a change the way Ctrl-C does: raised where they land, so the rollback
    that undoes a half-written set runs (by default Python would die on the spot, files half
    changed). Restored as soon as the change returns; a nohup'ed command keeps ignoring SIGHUP."""
    def stopped(signum: int) -> Signalled:
        # raised where it lands; by the time it reaches the user the rollback has run (or a failed
        # rollback has replaced it with its own error), so the sets are as before the command
        return Signalled(signum, f"patch {action} stopped by {signal.Signals(signum).name}; the sets it had "
                         "changed were taken back", hint="`dsv4serve patch status` shows each file's state")

    old = stop_signals_raise(stopped)
    try:
        yield
    finally:
        restore_signals(old)


def _change(action: str, profile: Optional[str], set_name: Optional[List[str]], root: Optional[Path],
            json_out: bool) -> None:
    from dsv4serve import patches

    results: list[Any] = []
    with handled(json_out):
        t = _targets(profile, set_name, root, action)
        with _stoppable(action):
            if action == "apply":  # all sets or none: a later set's failure undoes the earlier ones
                results = patches.apply_sets(t.sets, t.root, profile=t.profile)
            else:  # all sets or none, as apply
                results = patches.revert_sets(t.sets, t.root, profile=t.profile)
        rows = [row for res in results for row in res.rows]
        wanted = patches.OK_PATCHED if action == "apply" else patches.OK_PRISTINE
        if json_out:
            emit_json({"action": action, "ok": all(row.state in wanted for row in rows),
                       "results": [res.as_json() for res in results]})
        else:
            for res in results:
                verb = "patched" if action == "apply" else "restored"
                msg = f"{res.set}: {verb} {len(res.changed)} file(s)" if res.changed else f"{res.set}: nothing to do"
                kept = f"; backups in {res.backup_dir}" if action == "apply" else ""  # a revert removes them
                console.print(f"{msg} in {res.root}{kept}", highlight=False, markup=False,
                              soft_wrap=True)
                if res.rebuild:
                    console.print(f"[bold yellow]rebuild needed[/] ({escape(', '.join(res.rebuild))}): "
                                  f"{escape(res.rebuild_hint or '')}", highlight=False, soft_wrap=True)
                    if t.docker and action == "apply":
                        # the tree is a host copy: the container runs the image's build unless given one
                        console.print("  a docker seat runs its image's extension: build one from these sources and "
                                      "pass it as runtime.exl3_extension (check-seat's exl3-extension row reads it)",
                                      highlight=False, markup=False, soft_wrap=True)
            _render(rows, f"patch {action}", "patched" if action == "apply" else "pristine")
    _exit(rows, wanted)


@app.command()
def apply(profile: Optional[str] = ProfileOpt, set_name: Optional[List[str]] = SetNameOpt,
          root: Optional[Path] = RootOpt, json_out: bool = JsonOpt) -> None:
    """Apply the sets (all files of a set or none; a patched file is left as it is)."""
    _change("apply", profile, set_name, root, json_out)


@app.command()
def revert(profile: Optional[str] = ProfileOpt, set_name: Optional[List[str]] = SetNameOpt,
           root: Optional[Path] = RootOpt, json_out: bool = JsonOpt) -> None:
    """Restore the pristine files (from the backup, else by the reverse diff), checked by hash."""
    _change("revert", profile, set_name, root, json_out)
