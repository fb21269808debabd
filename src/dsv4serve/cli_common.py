"""What every CLI command shares: consoles, the error-to-exit-code mapping, JSON output."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import typer
from rich.console import Console

from dsv4serve.errors import EXIT_BAD_INPUT, DsvError

console = Console()
err_console = Console(stderr=True)


@contextmanager
def handled() -> Iterator[None]:
    """Turn a DsvError into its one-line message on stderr and its exit code."""
    try:
        yield
    except DsvError as e:
        err_console.print(f"[bold red]error:[/] {e.line()}", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(e.exit_code) from None
    except FileNotFoundError as e:
        err_console.print(f"[bold red]error:[/] {e}", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None


def emit_json(obj: Any) -> None:
    """One JSON document on stdout, nothing else, for machines."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def emit_json_line(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":"), default=str) + "\n")
    sys.stdout.flush()
