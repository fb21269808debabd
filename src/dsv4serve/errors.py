"""Error types that carry the exit code and the one-line fix a user needs.

Exit codes are part of the CLI contract: 0 ok, 1 the job failed (the seat did not come up,
a check failed), 2 bad input (usage, profile, missing file, refused launch plan).
"""

from __future__ import annotations

from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


def first_line(e: BaseException, empty: str | None = None) -> str:
    """The first line of an exception's text (tracebacks and tool output run over many), or
    `empty` when it has none (its class name unless given)."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else (type(e).__name__ if empty is None else empty)


class DsvError(Exception):
    """Base error: `str(e)` is the single line shown to the user."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def line(self) -> str:
        return f"{self.message}; {self.hint}" if self.hint else self.message


class BadInput(DsvError):
    """The user's input cannot work as given (profile, flag, path, port, plan)."""

    exit_code = EXIT_BAD_INPUT


class ProfileError(BadInput):
    """A seat profile is malformed or asks for something the seat cannot do."""


class JobFailed(DsvError):
    """The job ran and failed: the seat did not come up, a gate or a check failed."""

    exit_code = EXIT_FAILED


class Signalled(BaseException):
    """A signal (SIGTERM, SIGHUP) ended a command before it had anything running to tear down: the
    shell's convention for the exit code, 128 + the signal. A BaseException, like KeyboardInterrupt:
    it is raised wherever the signal lands, and code that catches Exception (vLLM's own imports do)
    must not swallow it and carry on."""

    def __init__(self, signum: int, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message, self.hint = message, hint
        self.exit_code = 128 + signum

    def line(self) -> str:
        return f"{self.message}; {self.hint}" if self.hint else self.message


def stop_signals_raise(make: Any) -> dict[int, Any]:
    """Until restore_signals(old): SIGTERM and SIGHUP raise make(signum), a Signalled, wherever they
    land, so a command's own cleanup runs as it does for Ctrl-C (by default Python dies on the spot).
    A signal already ignored (`nohup`) stays ignored; one handled outside Python is left alone."""
    import signal

    def raise_it(signum: int, frame: Any) -> None:
        raise make(signum)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_IGN, None):
            continue
        old[sig] = signal.signal(sig, raise_it)
    return old


def restore_signals(old: dict[int, Any]) -> None:
    """Put back the handlers stop_signals_raise replaced."""
    import signal

    for sig, handler in old.items():
        signal.signal(sig, handler)
