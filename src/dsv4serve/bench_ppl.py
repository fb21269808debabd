"""`dsv4serve bench ppl`: perplexity through /v1/completions with prompt_logprobs.

The text is cut with the seat's own tokenizer (POST /tokenize) into disjoint windows of exactly
`ctx` tokens, each sent as a token-id prompt with `max_tokens: 1`. vLLM returns, per prompt
position, a dict keyed by token id holding the actual prompt token's logprob and, when
`prompt_logprobs` > 0, the top candidates too. We read the entry of the actual token by its id,
never the max over the dict: the max would pick a better-scoring candidate and bias ppl down.
The first position of each window has no context and no logprob, so it is not scored.

Caution on a full seat: prompt_logprobs gathers the whole vocabulary's logits, which ran the
380K seat out of memory; measure ppl on a seat sized for it (the 8x16gb-ppl profile).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import httpx

from dsv4serve.bench import Target, check_text_file, check_timeout, read_text_file
from dsv4serve.bench_client import (REQUEST_ERRORS, Endpoint, Tokenizer, check_status, http_failure, shell_proxy,
                                     timeout)
from dsv4serve.errors import BadInput, JobFailed

SAMPLE_NAME = "ppl_sample.txt"


def sample_text() -> str:
    """The project's own English sample (written for dsv4serve, free to use)."""
    return resources.files("dsv4serve").joinpath("data", SAMPLE_NAME).read_text(encoding="utf-8")


@dataclass
class PplSettings:
    ctx: int = 512
    chunks: int = 16
    text: Path | None = None
    read_timeout_s: float = 600.0
    # "tokens": exact ctx-token windows; "chars": the reference instrument's ctx*4-character windows,
    # each tokenized on its own (with BOS) and capped at ctx tokens, which the references were cut as
    windows: str = "tokens"

    def check_inputs(self) -> None:
        """What can be refused before the endpoint is contacted."""
        if self.ctx < 2:
            raise BadInput(f"--ctx {self.ctx} must be at least 2 tokens", hint="e.g. --ctx 512")
        if self.chunks < 1:
            raise BadInput(f"--chunks {self.chunks} must be at least 1", hint="e.g. --chunks 16")
        if self.windows not in ("tokens", "chars"):
            raise BadInput(f"--windows {self.windows!r} is not tokens or chars",
                           hint="chars cuts windows as the profiles' ppl references were cut")
        check_timeout(self.read_timeout_s)
        if self.text is not None:
            check_text_file(self.text, "--text")

    def validate(self, max_model_len: int | None) -> None:
        self.check_inputs()
        # The prompt plus the one generated token must fit the window.
        if max_model_len is not None and self.ctx + 1 > max_model_len:
            raise BadInput(f"--ctx {self.ctx} plus the one generated token exceeds the seat's max-model-len "
                           f"{max_model_len}", hint=f"use --ctx {max_model_len - 1} or less")


def _read_text(settings: PplSettings) -> tuple[str, str]:
    if settings.text is None:
        return sample_text(), f"dsv4serve sample ({SAMPLE_NAME})"
    return read_text_file(settings.text, "--text"), str(settings.text)


def detect_bos(tok: Tokenizer) -> int | None:
    """The token the tokenizer prepends to a plain prompt, if any (the seat's BOS)."""
    with_special = tok.encode("a", add_special_tokens=True) or []
    plain = tok.encode("a", add_special_tokens=False) or []
    if len(with_special) == len(plain) + 1 and with_special[1:] == plain:
        return with_special[0]
    return None


def windows(ids: list[int], ctx: int, chunks: int, bos: int | None) -> list[list[int]]:
    """Disjoint prompts of exactly `ctx` tokens; with a BOS, it leads each and text fills ctx-1."""
    step = ctx - (1 if bos is not None else 0)
    out = []
    for i in range(chunks):
        piece = ids[i * step:(i + 1) * step]
        if len(piece) < step:
            break
        out.append(([bos] if bos is not None else []) + piece)
    return out


def char_windows(text: str, ctx: int, chunks: int, tok: Tokenizer) -> list[list[int]] | None:
    """The reference instrument's windows: disjoint ctx*4-character pieces of the text, each
    tokenized as a prompt (the tokenizer's BOS included) and capped at ctx tokens. None when the
    endpoint has no /tokenize."""
    out = []
    width = ctx * 4
    for i in range(chunks):
        piece = text[i * width:(i + 1) * width]
        if len(piece) < width:
            break
        ids = tok.encode(piece, add_special_tokens=True)
        if ids is None:
            return None
        if len(ids) >= 2:
            out.append(ids[:ctx])
    return out


LOGPROB_SLACK = 1e-4  # float rounding of a log-softmax at a near-certain token, never more
ZERO_PROB_LOGPROB = -9999.0  # what vLLM returns for a -inf prompt logprob


def window_nll(prompt: list[int], prompt_logprobs: Any) -> tuple[float, int]:
    """Summed negative log-likelihood of prompt[1:] and the count scored."""
    if not isinstance(prompt_logprobs, list) or len(prompt_logprobs) != len(prompt):
        got = len(prompt_logprobs) if isinstance(prompt_logprobs, list) else type(prompt_logprobs).__name__
        raise JobFailed(f"prompt_logprobs has {got} entries for a {len(prompt)}-token prompt",
                        hint="the server does not return per-token prompt logprobs as vLLM does")
    total = 0.0
    for pos in range(1, len(prompt)):
        entry = prompt_logprobs[pos]
        item = entry.get(str(prompt[pos])) if isinstance(entry, dict) else None
        if not isinstance(item, dict) or "logprob" not in item:
            raise JobFailed(f"prompt_logprobs at position {pos} has no entry for the prompt token {prompt[pos]}")
        logprob = item["logprob"]
        if isinstance(logprob, bool) or not isinstance(logprob, (int, float)):
            raise JobFailed(f"prompt_logprobs at position {pos} has a non-numeric logprob {logprob!r}")
        # -inf is a token the model ruled out (the perplexity is then infinite, and said so); NaN
        # or a positive value is no probability at all, and would give a perplexity below 1 or none
        if math.isnan(logprob) or logprob > LOGPROB_SLACK:
            raise JobFailed(f"prompt_logprobs at position {pos} has logprob {logprob!r}, which no probability has",
                            hint="a log-probability is at most 0: the server's scores are broken")
        if logprob <= ZERO_PROB_LOGPROB:
            logprob = -math.inf  # vLLM clamps -inf to -9999.0: a token the model ruled out, not a score
        total -= float(logprob)
    return total, len(prompt) - 1


def score(client: httpx.Client, ep: Endpoint, prompt: list[int], read_timeout_s: float) -> tuple[float, int]:
    body = {"model": ep.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    try:
        resp = client.post(ep.url("/v1/completions"), json=body, timeout=timeout(read_timeout_s))
    except REQUEST_ERRORS as e:
        raise http_failure(ep.base_url, e, proxy=shell_proxy(client, ep.base_url)) from None
    check_status(resp, "completion with prompt_logprobs", shell_proxy(client, ep.base_url))
    try:
        choice = resp.json()["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        choice = None
    if not isinstance(choice, dict):
        raise JobFailed(f"completion response has no choices: {resp.text[:200]}")
    return window_nll(prompt, choice.get("prompt_logprobs"))


def _exp(x: float) -> float | None:
    """exp(x), or None where it is not a finite number (math.exp raises past ~709)."""
    try:
        y = math.exp(x)
    except OverflowError:
        return None
    return y if math.isfinite(y) else None


def run_ppl(client: httpx.Client, target: Target, settings: PplSettings,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    ep = target.endpoint
    settings.validate(ep.max_model_len)
    text, label = _read_text(settings)
    tok = Tokenizer(client, ep, read_timeout_s=settings.read_timeout_s, timeout_is_flag=True)
    ids = tok.encode(text, add_special_tokens=False)
    if ids is None:
        raise JobFailed(f"{ep.base_url} has no /tokenize: ppl needs the seat's tokenizer to cut token windows")
    bos = detect_bos(tok)
    if settings.windows == "chars":
        wins = char_windows(text, settings.ctx, settings.chunks, tok) or []
    else:
        wins = windows(ids, settings.ctx, settings.chunks, bos)
    unit = (f"{settings.ctx * 4} characters (--windows chars)" if settings.windows == "chars"
            else f"{settings.ctx} tokens")
    if not wins:
        size = f"{len(text):,} characters" if settings.windows == "chars" else f"{len(ids)} tokens"
        raise BadInput(f"the text has {size}, less than one window of {unit}",
                       hint="use a longer --text or a smaller --ctx")
    notes = list(target.notes)
    if len(wins) < settings.chunks:
        notes.append(f"the text holds only {len(wins)} windows of {unit}, not {settings.chunks}")
    per_window: list[float | None] = []
    nll_sum = 0.0
    scored = 0
    for i, w in enumerate(wins, 1):
        if progress:
            progress(f"window {i}/{len(wins)}")
        nll, n = score(client, ep, w, settings.read_timeout_s)
        per_window.append(_exp(nll / n))
        nll_sum += nll
        scored += n
    ppl = _exp(nll_sum / scored)
    if ppl is None:
        # A -inf (or absurdly low) logprob: say so rather than print a bare Infinity that strict
        # JSON readers reject.
        notes.append("perplexity is infinite: a prompt token had zero (or vanishing) probability")
    ref = target.profile.reference.ppl if target.profile else None
    shipped = settings.text is None
    # the references were cut as character windows: token windows score other spans of the text
    # with longer contexts, which moves ppl by more than the project's 0.02 gate
    comparable = bool(ref and not shipped and settings.windows == "chars" and ref.ctx == settings.ctx
                      and ref.chunks == len(wins))
    if shipped:
        notes.append("measured on the dsv4serve sample text: NOT comparable to wikitext-2 figures "
                     "(pass --text wiki.test.raw for those)")
    elif ref is not None:
        notes.append(f"comparable to the reference ({ref.text}, {ref.ctx}x{ref.chunks}, character windows) only "
                     "if --text is that text" + ("" if comparable else
                                                 "; not here: " + ("pass --windows chars" if settings.windows != "chars"
                                                                   else "ctx or chunk count differ")))
    if settings.windows == "tokens":
        notes.append("windows are exact token windows; the references were cut as ctx*4-character windows "
                     "capped at ctx tokens (--windows chars)")
    return {
        "kind": "dsv4serve.bench.ppl",
        "version": 1,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "endpoint": {"base_url": ep.base_url, "model": ep.model, "max_model_len": ep.max_model_len,
                     "seat": target.seat},
        "text": label,
        "text_shipped": shipped,
        "text_tokens": len(ids),
        "ctx": settings.ctx,
        "windows": settings.windows,
        "chunks_requested": settings.chunks,
        "chunks": len(wins),
        "bos": bos,
        "tokens_scored": scored,
        "ppl": ppl,
        "ppl_per_window": per_window,
        "reference": None if ref is None else {
            "profile": target.profile.name if target.profile else None, "value": ref.value, "ctx": ref.ctx,
            "chunks": ref.chunks, "text": ref.text, "comparable": comparable},
        "ratio": (ppl / ref.value) if comparable and ref and ppl is not None else None,
        "notes": notes,
    }
