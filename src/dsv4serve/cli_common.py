"""What every CLI command shares: consoles, the error-to-exit-code mapping, JSON output."""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import typer
from filelock import Timeout
from rich.console import Console
from rich.markup import escape

from dsv4serve.errors import EXIT_BAD_INPUT, EXIT_FAILED, DsvError, Signalled
from dsv4serve.jsonout import strict_json

console = Console()
err_console = Console(stderr=True)


def dir_path(value: str) -> Path:
    """A directory option (--out, --root). Typer turns '' into Path('.'), so an empty value (an
    unset shell variable) would silently act on the working directory; refuse it instead."""
    if not value.strip():
        raise typer.BadParameter("is empty; give a directory, or leave the option out")
    return Path(value)


def silence(*streams: Any) -> None:
    """Point a dead stream's descriptor at /dev/null, as rich does on EPIPE: what is still buffered,
    and Python's flush at exit, then go nowhere instead of failing again (exit 120 with a traceback)."""
    seen: set[int] = set()
    for stream in streams:
        try:
            fd = stream.fileno()
            if fd in seen:
                continue
            seen.add(fd)
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, fd)
            finally:
                os.close(null)
        except (OSError, ValueError, AttributeError):
            continue  # no descriptor of its own (a test's StringIO): nothing to point elsewhere


def error_doc(kind: str, message: str, hint: str | None, exit_code: int) -> dict[str, Any]:
    """What a `--json` caller gets on stdout when a command refuses or fails."""
    return {"error": {"type": kind, "message": message, "hint": hint, "exit_code": exit_code}}


def report_error(kind: str, message: str, hint: str | None, exit_code: int, *, json_out: bool = False,
                 event_lines: bool = False) -> None:
    """The one-line error on stderr, always (a person may be watching); with --json also on stdout, as
    one JSON document, or as one more event line where the command streams events (`up`), so a
    machine reading stdout never has to parse the human line."""
    line = f"{message}; {hint}" if hint else message
    # escaped: a path like /srv/[prod]/site is text, not markup (rich dropped it, or raised on "[/x]")
    err_console.print(f"[bold red]error:[/] {escape(line)}", markup=True, highlight=False, soft_wrap=True)
    if event_lines:
        emit_json_line({"t": round(time.time(), 3), "event": "error", **error_doc(kind, message, hint, exit_code)["error"]})
    elif json_out:
        emit_json(error_doc(kind, message, hint, exit_code))


@contextmanager
def handled(json_out: bool = False, *, event_lines: bool = False) -> Iterator[None]:
    """Turn a DsvError into its one-line message and its exit code (see report_error for --json)."""
    try:
        yield
    except DsvError as e:
        report_error(type(e).__name__, e.message, e.hint, e.exit_code, json_out=json_out, event_lines=event_lines)
        raise typer.Exit(e.exit_code) from None
    except FileNotFoundError as e:
        report_error("FileNotFoundError", str(e), None, EXIT_BAD_INPUT, json_out=json_out, event_lines=event_lines)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    except Signalled as e:
        report_error("Signalled", e.message, e.hint, e.exit_code, json_out=json_out, event_lines=event_lines)
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        # typer turns an escaping Ctrl-C into a silent exit 130: say it, and give a --json caller
        # its one document (a bench interrupted mid-run has no result to print)
        report_error("Interrupted", "interrupted", None, 130, json_out=json_out, event_lines=event_lines)
        raise typer.Exit(130) from None
    except (PermissionError, NotADirectoryError, IsADirectoryError) as e:
        # a path of the user's (the state dir, a patch tree) that the code met before any check
        # could: one line naming it, never a traceback
        where = f": {e.filename}" if e.filename else ""
        report_error(type(e).__name__, f"{e.strerror or e}{where}", "fix that path's permissions or type, then retry",
                     EXIT_BAD_INPUT, json_out=json_out, event_lines=event_lines)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    except Timeout as e:
        # filelock's Timeout is an OSError, but the path is fine: another dsv4serve holds it
        report_error("LockTimeout", f"{e.lock_file} is held by another dsv4serve", "wait for that command to "
                     "finish (see `dsv4serve status`), then retry", EXIT_FAILED, json_out=json_out,
                     event_lines=event_lines)
        raise typer.Exit(EXIT_FAILED) from None
    except BrokenPipeError:
        # our reader went away (`dsv4serve logs | head`): nothing to tell it, and nobody to tell
        silence(sys.stdout)
        raise typer.Exit(EXIT_FAILED) from None
    except OSError as e:
        # the machine failed the job (a full disk, a read-only mount, a stray file where a dir goes):
        # one line naming the path, and a --json caller still gets its document
        where = f": {e.filename}" if e.filename else ""
        report_error(type(e).__name__, f"{e.strerror or e}{where}", "free space or fix that path, then retry",
                     EXIT_FAILED, json_out=json_out, event_lines=event_lines)
        raise typer.Exit(EXIT_FAILED) from None


def emit_json(obj: Any) -> None:
    """One JSON document on stdout, nothing else, for machines."""
    sys.stdout.write(strict_json(obj, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def emit_json_line(obj: Any) -> None:
    sys.stdout.write(strict_json(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()
