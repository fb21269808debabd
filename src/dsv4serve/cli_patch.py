"""`dsv4serve patch status|apply|revert`: the patch sets, by content hash.

Exit codes: 0 every file is in the wanted state (patched after status/apply, pristine after
revert; not-applicable counts as fine), 1 a file is not, 2 bad input (unknown set or profile).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer
from rich.table import Table

from dsv4serve.cli_common import console, emit_json, handled
from dsv4serve.errors import EXIT_FAILED, EXIT_OK, BadInput

app = typer.Typer(help="Apply, verify and revert the exllamav3 / vLLM patch sets by content hash.",
                  no_args_is_help=True)

ProfileOpt = typer.Option(None, "--profile", "-p",
                          help="the sets this profile names, in its runtime.patch_root if it has one")
SetNameOpt = typer.Option(None, "--set-name", "-s", help="a patch set by name, e.g. vllm-0.32.0 (repeatable)")
RootOpt = typer.Option(None, "--root", help="site-packages tree to check instead of the installed packages")
JsonOpt = typer.Option(False, "--json", help="machine-readable output")

_STYLE = {"patched": "green", "pristine": "yellow", "not-applicable": "dim", "modified-unknown": "bold red",
          "missing": "red", "version-mismatch": "red", "package-missing": "red"}


def _targets(profile: Optional[str], set_names: Optional[List[str]],
             root: Optional[Path]) -> tuple[list[Any], Optional[Path], Optional[str]]:
    """(patch sets, root, profile name) from the options; exactly one of --profile / --set-name."""
    from dsv4serve import patches
    from dsv4serve.profile import load_profile

    if bool(profile) == bool(set_names):
        raise BadInput("name the patch sets with --profile P or --set-name NAME (one of them)",
                       hint=f"sets: {', '.join(patches.available_sets()) or 'none'}")
    if profile:
        p = load_profile(profile)
        if not p.patches:
            raise BadInput(f"profile {p.name} names no patch sets")
        return [patches.load_set(n) for n in p.patches], root if root is not None else patches.profile_root(p), p.name
    return [patches.load_set(n) for n in set_names or []], root, None


def _short(h: Optional[str]) -> str:
    return h[:10] if h else "-"


def _common_dir(paths: list[str]) -> str:
    import os.path

    if len(paths) < 2:
        return ""
    common = os.path.commonpath(paths)
    return common + "/" if common else ""


def _render(rows: list[Any], title: str) -> None:
    """One table per set; file paths are shown below the set's common folder (in the title)."""
    for set_name in dict.fromkeys(r.set for r in rows):
        mine = [r for r in rows if r.set == set_name]
        prefix = _common_dir([r.file for r in mine])
        where = f"in {mine[0].root}/{prefix}" if mine[0].root else f"({mine[0].package} not found)"
        t = Table(title=f"{title}: {set_name} {where}", title_justify="left")
        t.add_column("file", overflow="fold")
        t.add_column("state", no_wrap=True)
        t.add_column("found", no_wrap=True)
        t.add_column("expected", no_wrap=True)
        t.add_column("fix", overflow="fold", ratio=1)
        for r in mine:
            t.add_row(r.file[len(prefix):], f"[{_STYLE.get(r.state, '')}]{r.state}[/]", _short(r.found_sha256),
                      _short(r.expected_sha256), "" if r.state == "patched" else r.fix)
        console.print(t)


def _exit(rows: list[Any], wanted: frozenset[str]) -> None:
    raise typer.Exit(EXIT_OK if all(r.state in wanted for r in rows) else EXIT_FAILED)


@app.command()
def status(profile: Optional[str] = ProfileOpt, set_name: Optional[List[str]] = SetNameOpt,
           root: Optional[Path] = RootOpt, json_out: bool = JsonOpt) -> None:
    """Per-file state of the patch sets: pristine, patched, modified-unknown, missing, version-mismatch."""
    from dsv4serve import patches

    with handled():
        sets, r, pname = _targets(profile, set_name, root)
        rows = [row for s in sets for row in patches.set_status(s, r, profile=pname)]
        ok = all(row.state in patches.OK_PATCHED for row in rows)
        if json_out:
            emit_json({"action": "status", "ok": ok, "root": str(r) if r else None,
                       "rows": [row.model_dump() for row in rows]})
        else:
            _render(rows, "patch status")
    _exit(rows, patches.OK_PATCHED)


def _change(action: str, profile: Optional[str], set_name: Optional[List[str]], root: Optional[Path],
            json_out: bool) -> None:
    from dsv4serve import patches

    results: list[Any] = []
    with handled():
        sets, r, pname = _targets(profile, set_name, root)
        fn = patches.apply_set if action == "apply" else patches.revert_set
        for s in sets:  # check every set before changing any: one refusal changes nothing
            patches.refuse_unless(patches.set_status(s, r, profile=pname),
                                  frozenset({"pristine", "patched"}), action, s)
        for s in sets:
            results.append(fn(s, r, profile=pname))
        rows = [row for res in results for row in res.rows]
        wanted = patches.OK_PATCHED if action == "apply" else patches.OK_PRISTINE
        if json_out:
            emit_json({"action": action, "ok": all(row.state in wanted for row in rows),
                       "results": [res.as_json() for res in results]})
        else:
            for res in results:
                verb = "patched" if action == "apply" else "restored"
                msg = f"{res.set}: {verb} {len(res.changed)} file(s)" if res.changed else f"{res.set}: nothing to do"
                console.print(f"{msg} in {res.root}; backups in {res.backup_dir}", highlight=False)
                if res.rebuild:
                    console.print(f"[bold yellow]rebuild needed[/] ({', '.join(res.rebuild)}): {res.rebuild_hint}",
                                  highlight=False)
            _render(rows, f"patch {action}")
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
