"""Render bench results: rich tables for the terminal, Markdown and JSON files, a PNG chart.

Every renderer reads the plain result dicts built by bench / bench_needle / bench_ppl, so what the
terminal shows, what --json prints and what --out writes are the same figures.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from dsv4serve.errors import BadInput, JobFailed, first_line
from dsv4serve.jsonout import strict_json

NA = "n/a"


def _num(v: float | None, digits: int = 1) -> str:
    return NA if v is None else f"{v:.{digits}f}"


def _stat(s: dict[str, Any] | None, digits: int = 1) -> str:
    if not s:
        return NA
    if s["n"] > 1:
        return f"{s['mean']:.{digits}f} ±{s['half_range']:.{digits}f}"
    return f"{s['mean']:.{digits}f}"


def _ratio(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def _range(r: dict[str, float] | None) -> str:
    return NA if not r else f"{r['min']:.1f}–{r['max']:.1f}"


def _ref_name(result: dict[str, Any]) -> str:
    ref = result.get("reference")
    return ref["profile"] if ref else "none"


# ---------------------------------------------------------------------------------------------
# terminal


def bench_tables(result: dict[str, Any]) -> list[Table]:
    """One table per suite: a row per stream count, measured beside the reference and the ratio."""
    ref = _ref_name(result)
    tables = []
    for suite in result["settings"]["suites"]:
        # Sized for an 80-column terminal; the per-run token counts are in the Markdown and JSON.
        # Text, not markup: a served name or path may hold "[/...]" (rich raised after the whole run)
        t = Table(title=Text(f"{suite}: {result['endpoint']['model']} vs reference {ref}"), title_justify="left",
                  caption="n = concurrent streams; tok/s = aggregate; TTFT = the slowest stream's; "
                          "± = half-range over runs",
                  caption_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True,
                  show_edge=False)
        for col in ("n", "tok/s", "ref", "ratio", "per-stream", "TTFT max s", "accept", "ref", "ratio"):
            t.add_column(col, justify="right", no_wrap=True)
        for c in result["cells"]:
            if c["suite"] != suite:
                continue
            t.add_row(str(c["streams"]), _stat(c["aggregate_tok_s"]), _num(c["reference"]["tok_s"]),
                      _ratio(c["ratio"]["tok_s"]), _range(c["per_stream_tok_s"]), _stat(c["ttft_max_s"], 2),
                      _stat(c["acceptance_length"], 2), _num(c["reference"]["acceptance_length"], 2),
                      _ratio(c["ratio"]["acceptance_length"]))
        tables.append(t)
    return tables


def _prompt_tokens(r: dict[str, Any]) -> str:
    """The server's count, else the tokenizer's (the figure the prefill rate used), else '?'."""
    if r.get("prompt_tokens") is not None:
        return str(r["prompt_tokens"])
    return f"~{r['tokens_counted']}" if r.get("tokens_counted") is not None else "?"


def needle_table(r: dict[str, Any]) -> Table:
    ref = r.get("reference") or {}
    t = Table(title=Text(f"needle: {_prompt_tokens(r)} prompt tokens at depth {r['depth']:g} "
                         f"({r['tokens_sized_by']}), vs reference {ref.get('profile') or 'none'}"), title_justify="left")
    for col in ("metric", "measured", "reference", "ratio"):
        t.add_column(col, justify="left" if col == "metric" else "right", no_wrap=True)
    ratio = r.get("ratio") or {}
    t.add_row("found", "yes" if r["found"] else "no", _yn(ref.get("found")), "")
    t.add_row("TTFT s", _num(r["ttft_s"], 2), _num(ref.get("ttft_s"), 1), _ratio(ratio.get("ttft_s")))
    t.add_row("prefill tok/s", _num(r["prefill_tok_s"]), _num(ref.get("prefill_tok_s")), "")
    t.add_row("decode tok/s", _num(r["decode_tok_s"]), _num(ref.get("decode_tok_s")), _ratio(ratio.get("decode_tok_s")))
    return t


def _yn(v: bool | None) -> str:
    return NA if v is None else ("yes" if v else "no")


def ppl_table(r: dict[str, Any]) -> Table:
    ref = r.get("reference") or {}
    t = Table(title=Text(f"ppl: {r['text']}, {r['ctx']}×{r['chunks']} ({r['tokens_scored']} tokens scored)"),
              title_justify="left")
    for col in ("metric", "measured", "reference", "ratio", "comparable"):
        t.add_column(col, justify="left" if col == "metric" else "right", no_wrap=True)
    ref_txt = f"{ref['value']:.4f} ({ref['ctx']}×{ref['chunks']})" if ref else NA
    t.add_row("perplexity", _num(r["ppl"], 4), ref_txt, _ratio(r.get("ratio")), _yn(ref.get("comparable")) if ref else NA)
    return t


# ---------------------------------------------------------------------------------------------
# Markdown


def bench_markdown(result: dict[str, Any]) -> str:
    ep, st = result["endpoint"], result["settings"]
    ref = result.get("reference")
    lines = [
        "# dsv4serve bench",
        "",
        f"- endpoint: `{ep['base_url']}`, model `{ep['model']}`" + (f", seat `{ep['seat']}`" if ep.get("seat") else ""),
        f"- measured: {result['measured_at']}; {st['runs']} run(s), max_tokens {st['max_tokens']}, "
        f"temperature 0, thinking {'on' if st['thinking'] else 'off'}",
        f"- reference: profile `{ref['profile']}`" + (f" ({ref['source']})" if ref.get("source") else "")
        if ref else "- reference: none",
        "- tok/s is the aggregate Σ usage completion tokens / wall (TTFT included); mean ± half-range over runs; "
        "ratio = measured / reference",
        "",
        "| suite | streams | measured tok/s | reference tok/s | ratio | per-stream tok/s | TTFT max s "
        "| accept len | reference accept | ratio | tokens per run |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for c in result["cells"]:
        lines.append(
            f"| {c['suite']} | {c['streams']} | {_stat(c['aggregate_tok_s'])} | {_num(c['reference']['tok_s'])} "
            f"| {_ratio(c['ratio']['tok_s'])} | {_range(c['per_stream_tok_s'])} | {_stat(c['ttft_max_s'], 2)} "
            f"| {_stat(c['acceptance_length'], 2)} | {_num(c['reference']['acceptance_length'], 2)} "
            f"| {_ratio(c['ratio']['acceptance_length'])} | {'/'.join(str(n) for n in c['completion_tokens'])} |")
    lines += _notes_md(result)
    return "\n".join(lines) + "\n"


def needle_markdown(r: dict[str, Any]) -> str:
    ref = r.get("reference") or {}
    ratio = r.get("ratio") or {}
    lines = [
        "# dsv4serve bench needle",
        "",
        f"- endpoint: `{r['endpoint']['base_url']}`, model `{r['endpoint']['model']}`",
        f"- prompt: {_prompt_tokens(r)} tokens (asked {r['tokens_requested']}, sized by {r['tokens_sized_by']}), "
        f"depth {r['depth']:g}, code `{r['code']}`",
        f"- reference: profile `{ref['profile']}` ({ref['tokens']} tokens, depth {ref['depth']:g})" if ref
        else "- reference: none",
        "",
        "| metric | measured | reference | ratio |",
        "|---|--:|--:|--:|",
        f"| found | {'yes' if r['found'] else 'no'} | {_yn(ref.get('found'))} | |",
        f"| TTFT s | {_num(r['ttft_s'], 2)} | {_num(ref.get('ttft_s'), 1)} | {_ratio(ratio.get('ttft_s'))} |",
        f"| prefill tok/s | {_num(r['prefill_tok_s'])} | {_num(ref.get('prefill_tok_s'))} | |",
        f"| decode tok/s | {_num(r['decode_tok_s'])} | {_num(ref.get('decode_tok_s'))} "
        f"| {_ratio(ratio.get('decode_tok_s'))} |",
    ]
    lines += _notes_md(r)
    return "\n".join(lines) + "\n"


def ppl_markdown(r: dict[str, Any]) -> str:
    ref = r.get("reference")
    lines = [
        "# dsv4serve bench ppl",
        "",
        f"- endpoint: `{r['endpoint']['base_url']}`, model `{r['endpoint']['model']}`",
        f"- text: {r['text']}; {r['chunks']} windows of {r['ctx']} tokens, {r['tokens_scored']} tokens scored",
        "",
        "| metric | measured | reference | ratio | comparable |",
        "|---|--:|--:|--:|--:|",
        f"| perplexity | {_num(r['ppl'], 4)} | "
        + (f"{ref['value']:.4f} ({ref['text']}, {ref['ctx']}×{ref['chunks']}, profile `{ref['profile']}`)"
           if ref else NA)
        + f" | {_ratio(r.get('ratio'))} | {_yn(ref['comparable']) if ref else NA} |",
    ]
    lines += _notes_md(r)
    return "\n".join(lines) + "\n"


def _notes_md(r: dict[str, Any]) -> list[str]:
    notes = r.get("notes") or []
    return (["", "Notes:", ""] + [f"- {n}" for n in notes]) if notes else []


# ---------------------------------------------------------------------------------------------
# chart


def write_png(result: dict[str, Any], path: Path) -> str | None:
    """tok/s by suite and streams, reference beside measured. Returns a note when skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a seat host
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: bench.png skipped (install the `plot` extra)"
    cells = result["cells"]
    labels = [f"{c['suite']}×{c['streams']}" for c in cells]
    measured = [c["aggregate_tok_s"]["mean"] if c["aggregate_tok_s"] else 0.0 for c in cells]
    errs = [c["aggregate_tok_s"]["half_range"] if c["aggregate_tok_s"] else 0.0 for c in cells]
    refs = [c["reference"]["tok_s"] or 0.0 for c in cells]
    xs = list(range(len(cells)))
    w = 0.4
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(cells)), 3.5))
    ax.bar([x - w / 2 for x in xs], measured, w, yerr=errs, label="measured")
    if any(refs):
        ax.bar([x + w / 2 for x in xs], refs, w, label=f"reference ({_ref_name(result)})")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels)
    ax.set_ylabel("tok/s (aggregate)")
    # a `$` pair in a model name would be read as mathtext (and a bad one raises after the run)
    ax.set_title(f"dsv4serve bench: {result['endpoint']['model']}".replace("$", r"\$"))
    ax.legend()
    try:
        fig.tight_layout()
        fig.savefig(path, dpi=110, format="png")
    except (ValueError, RuntimeError) as e:  # matplotlib's own failures: the chart is optional
        return f"bench.png skipped: matplotlib could not draw it ({first_line(e)})"
    finally:
        plt.close(fig)
    return None


# ---------------------------------------------------------------------------------------------
# files


def prepare_out(out_dir: Path) -> None:
    """Check --out can be written, so a bad path fails before a long measurement. Nothing is
    created yet: a run that then fails leaves no empty directory behind."""
    from dsv4serve.home import nearest_existing

    probe, broken = nearest_existing(out_dir)
    if broken is not None:  # a dangling link: mkdir would fail on it only after the measurement
        raise BadInput(f"--out {out_dir}: {broken} is a broken symlink (to {os.readlink(broken)})",
                       hint="pass a directory (created if absent), or fix the link")
    if probe == out_dir and not probe.is_dir():
        raise BadInput(f"--out {out_dir} is a file, not a directory", hint="pass a directory (created if absent)")
    if not probe.is_dir():
        raise BadInput(f"cannot create --out {out_dir}: {probe} is a file", hint="pass a directory (created if absent)")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise BadInput(f"cannot write to --out {out_dir}" + ("" if probe == out_dir else f" ({probe} is not writable)"),
                       hint="pass a writable directory")


def write_outputs(result: dict[str, Any], out_dir: Path, stem: str) -> tuple[list[Path], list[str]]:
    """`stem`.json and `stem`.md (and bench.png for the main table) under out_dir. Each is written
    under a temporary name and renamed once every one is written, so a full disk leaves no half
    file. When writing fails, the result is kept in the state dir and the error names it: a
    measurement that took an hour is never lost to a bad --out. A skipped chart is noted in the
    returned notes and the files."""
    temps: list[tuple[Path, Path]] = []
    try:
        prepare_out(out_dir)  # checked before the run too; the directory may have changed since
        out_dir.mkdir(parents=True, exist_ok=True)
        names, notes = _write_outputs(result, out_dir, stem, temps)
        for _, final in temps:  # the one rename that fails on a healthy disk: check before any is done
            if final.is_dir():
                raise IsADirectoryError(errno.EISDIR, "Is a directory", str(final))
        for tmp, _ in temps:  # on disk before any rename, so a crash never leaves a renamed empty file
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for tmp, final in temps:
            os.replace(tmp, final)
        temps.clear()
        stale = out_dir / "bench.png"
        if stem == "bench" and stale not in names and stale.is_file():
            # beside this run's bench.json it would read as this run's chart; the files are written
            # already, so a failure here is a note, never the write's error
            try:
                stale.unlink()
                notes.append("removed bench.png of an earlier run: this run has no chart")
            except OSError as e:
                notes.append(f"bench.png of an earlier run is still in {out_dir} ({e.strerror or e}): it is not "
                             "this run's chart")
        return names, notes
    except BadInput as e:
        kept = keep_result(result, stem)
        raise BadInput(e.message, hint=(f"the result is kept in {kept}; " if kept else "") + (e.hint or "")) from None
    except OSError as e:
        kept = keep_result(result, stem)
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        kept_hint = f"the result is kept in {kept}; " if kept else ""
        if e.errno in _PATH_ERRNOS:  # the directory the user named: bad input
            raise BadInput(f"cannot write to --out {out_dir}: {e.strerror or e}{where}",
                           hint=kept_hint + "pass a writable directory") from None
        # the machine failed the job (a full disk, an I/O error): exit 1, as every command says it
        raise JobFailed(f"cannot write to --out {out_dir}: {e.strerror or e}{where}",
                        hint=kept_hint + "free space or fix the disk, then write it again from that copy") from None
    finally:
        for tmp, _ in temps:
            with contextlib.suppress(OSError):
                tmp.unlink()


# what is wrong with the path given as --out, not with the machine
_PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.EROFS, errno.ENAMETOOLONG,
                errno.ENOENT, errno.ELOOP}


def keep_result(result: dict[str, Any], stem: str) -> Path | None:
    """The result under the state dir's bench/ (a measurement that must not be lost), or None."""
    from dsv4serve import home
    from dsv4serve.state import atomic_write

    try:
        d = home.home() / "bench"
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
        atomic_write(path, strict_json(result, indent=2) + "\n")  # never a truncated rescue copy
        return path
    except (OSError, BadInput):  # the state dir is unusable too: the error still names --out
        return None


def _write_outputs(result: dict[str, Any], out_dir: Path, stem: str,
                   temps: list[tuple[Path, Path]]) -> tuple[list[Path], list[str]]:
    def temp_for(final: Path) -> Path:
        # not mkstemp: its 0600 would outlive the rename, where the user's umask is expected
        tmp = out_dir / f".{final.name}.{os.getpid()}.tmp"
        temps.append((tmp, final))
        return tmp

    written: list[Path] = []
    notes: list[str] = []
    if stem == "bench":
        png = out_dir / "bench.png"
        skipped = write_png(result, temp_for(png))
        if skipped:
            notes.append(skipped)
            result = {**result, "notes": [*result.get("notes", []), skipped]}
            temps.pop()[0].unlink(missing_ok=True)
        else:
            written.append(png)
    md = {"bench": bench_markdown, "needle": needle_markdown, "ppl": ppl_markdown}[stem](result)
    # UTF-8 whatever the locale: every report holds Σ, × or — (under LC_ALL=C the default codec
    # raised after the whole measurement)
    temp_for(out_dir / f"{stem}.json").write_text(strict_json(result, indent=2) + "\n", encoding="utf-8")
    temp_for(out_dir / f"{stem}.md").write_text(md, encoding="utf-8")
    return [out_dir / f"{stem}.json", out_dir / f"{stem}.md", *written], notes
