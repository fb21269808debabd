"""Check an assembled command line with vLLM's own parser, starting nothing.

argparse alone accepts unknown tool/reasoning parser names, so those are checked against vLLM's
registries as well. vLLM's rejection becomes our own one-line ProfileError.
"""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from typing import Any

from dsv4serve.errors import ProfileError


@dataclass
class ParserCheck:
    available: bool
    vllm_version: str | None
    detail: str


def _arg_after(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def validate(vllm_args: list[str], profile_name: str = "") -> ParserCheck:
    who = f"profile {profile_name}: " if profile_name else ""
    try:
        import vllm
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except Exception as e:  # noqa: BLE001 - any import failure means "cannot check here"
        return ParserCheck(False, None, f"vLLM is not importable here ({type(e).__name__}: {e})")
    version = getattr(vllm, "__version__", "?")
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    buf = io.StringIO()
    try:
        with redirect_stderr(buf), redirect_stdout(io.StringIO()):
            args = parser.parse_args(list(vllm_args))
    except SystemExit:
        lines = [ln for ln in buf.getvalue().splitlines() if "error:" in ln]
        tail = buf.getvalue().strip().splitlines()  # no "error:" line: its last words, or say there were none
        msg = lines[-1].split("error:", 1)[1].strip() if lines else (tail[-1] if tail else "(it printed nothing)")
        raise ProfileError(f"{who}vLLM {version} rejects the command line: {msg}",
                           hint="fix the vllm.* key that renders this flag") from None
    _refuse_repeats(parser, vllm_args, who)
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    try:
        validate_parsed_serve_args(args)
    except Exception as e:  # noqa: BLE001 - vLLM raises TypeError/ValueError/... here
        raise ProfileError(f"{who}vLLM {version} rejects the arguments: {e}") from None
    _check_registries(vllm_args, who, version)
    return ParserCheck(True, version, f"accepted by vLLM {version}'s parser")


def _refuse_repeats(parser: Any, vllm_args: list[str], who: str) -> None:
    """vLLM takes the later of two flags that set one setting and only logs it: a profile whose
    extra_args repeat a flag (or give both --X and --no-X) serves a value nobody reviewed."""
    import argparse

    seen: dict[str, str] = {}
    for a in vllm_args:
        if not a.startswith("--") or "." in a.split("=", 1)[0]:  # --x.y=.. merges into a dict flag
            continue
        name = a.split("=", 1)[0]
        act = parser._option_string_actions.get(name) or parser._option_string_actions.get(name.replace("_", "-"))
        if act is None or isinstance(act, (argparse._AppendAction, argparse._ExtendAction, argparse._CountAction)):
            continue  # a flag meant to repeat, or one the parser completes from a prefix (judged by it)
        if act.dest in seen:
            raise ProfileError(f"{who}{seen[act.dest]} and {name} both set vLLM's {act.dest}: vLLM would take the "
                               "later one without a word", hint="give it once (in vllm.extra_args or its vllm.* key)")
        seen[act.dest] = name


def _check_registries(vllm_args: list[str], who: str, version: str) -> None:
    checks = []
    tool = _arg_after(vllm_args, "--tool-call-parser")
    reasoning = _arg_after(vllm_args, "--reasoning-parser")
    if tool:
        from vllm.tool_parsers import ToolParserManager

        checks.append(("vllm.tool_call_parser", tool, ToolParserManager.list_registered()))
    if reasoning:
        from vllm.reasoning import ReasoningParserManager

        checks.append(("vllm.reasoning_parser", reasoning, ReasoningParserManager.list_registered()))
    for key, name, registered in checks:
        names = list(registered)
        if name not in names:
            import difflib

            close = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean '{close[0]}'?" if close else "see `vllm serve --help=all`"
            raise ProfileError(f"{who}{key}: '{name}' is not a parser vLLM {version} knows", hint=hint)


