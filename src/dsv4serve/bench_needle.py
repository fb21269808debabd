"""`dsv4serve bench needle`: one long prompt with a code hidden at a depth; is it found, how fast.

The haystack is sized with the seat's own tokenizer through vLLM's POST /tokenize, counting the
whole chat-templated prompt, so "166k tokens" means what the seat prefills. The reported prompt
length is always the server's own usage figure, whatever the sizing method.
"""

from __future__ import annotations

import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from dsv4serve.bench import Target, check_text_file, check_timeout, read_text_file
from dsv4serve.bench_client import Tokenizer, chat_body, stream_chat
from dsv4serve.errors import BadInput, DsvError, JobFailed

# Used only when the server has no /tokenize: English prose runs near 4 characters a token on
# large BPE vocabularies. The usage figure after the request tells the truth either way.
EST_CHARS_PER_TOKEN = 4.0
MAX_SIZING_ROUNDS = 8
# Far beyond any served window; above it the haystack string alone could exhaust memory when
# the server does not report its max-model-len.
MAX_TOKENS = 10_000_000

_WORDS_A = ("amber", "cobalt", "willow", "harbor", "saffron", "granite", "lantern", "meadow", "ember", "juniper",
            "quartz", "thistle", "marble", "falcon", "cedar", "orchid")
_WORDS_B = ("river", "comet", "anchor", "valley", "beacon", "glacier", "sparrow", "canyon", "harvest", "island",
            "summit", "tundra", "prairie", "lagoon", "forest", "meteor")


def make_code(rng: random.Random) -> str:
    """A code no model would produce by chance: two unrelated words and four digits."""
    return f"{rng.choice(_WORDS_A)}-{rng.choice(_WORDS_B)}-{rng.randrange(1000, 10000)}"


@dataclass(frozen=True)
class NeedlePrompt:
    text: str
    code: str
    needle_at_char: int      # where the needle sentence starts inside the haystack
    haystack_chars: int

    @property
    def depth_actual(self) -> float:
        return self.needle_at_char / self.haystack_chars if self.haystack_chars else 0.0


def _needle_sentence(code: str) -> str:
    return f" The secret passcode is {code}. Remember this passcode. "


_SENTENCE_END = re.compile(r"[.!?。！？]\s*")


def _boundary(hay: str, at: int) -> int:
    """The sentence end nearest to `at`, else the nearest space, within a small window.

    The window scales with the haystack, so a short haystack keeps its depth instead of
    jumping to the next sentence a hundred characters on.
    """
    if not 0 < at < len(hay):
        return max(0, min(at, len(hay)))
    win = max(24, len(hay) // 50)
    lo, hi = max(0, at - win), min(len(hay), at + win)
    ends = [m.end() for m in _SENTENCE_END.finditer(hay, lo, hi)]
    if not ends:
        ends = [i + 1 for i in range(lo, hi) if hay[i] == " "]
    return min(ends, key=lambda e: abs(e - at)) if ends else at


def compose(filler: str, n_chars: int, depth: float, code: str, nonce: str) -> NeedlePrompt:
    """The full user message: instructions, n_chars of haystack with the needle at `depth`, question."""
    hay = _cycle(filler, n_chars)
    at = _boundary(hay, int(len(hay) * depth))
    body = hay[:at] + _needle_sentence(code) + hay[at:]
    # The nonce at the very start defeats prefix caching: a second run over the same haystack
    # would otherwise reuse every cached block before the needle and report a fake TTFT.
    text = (f"Document {nonce}. Read the whole document below. Somewhere inside it, one sentence states "
            f"a secret passcode.\n\n<document>\n{body}\n</document>\n\n"
            "Question: what is the secret passcode stated in the document? Reply with the passcode only.")
    return NeedlePrompt(text=text, code=code, needle_at_char=at, haystack_chars=len(hay))


MIN_HAYSTACK_CHARS = 200


def _cycle(filler: str, n_chars: int) -> str:
    """The filler repeated to n_chars, cut back to a space when one is near (spaceless scripts
    such as Japanese are cut anywhere)."""
    if n_chars <= 0:
        return ""
    unit = " ".join(filler.split())  # one line: layout does not matter to a haystack
    full = " ".join([unit] * (n_chars // (len(unit) + 1) + 2))
    s = full[:n_chars]
    if full[n_chars:n_chars + 1] != " ":
        cut = s.rfind(" ", max(0, n_chars - 40))
        if cut > 0:
            s = s[:cut]
    return s


@dataclass
class NeedleSettings:
    tokens: int
    depth: float
    max_tokens: int = 32
    thinking: bool = False
    read_timeout_s: float = 1800.0
    haystack: Path | None = None
    seed: int | None = None

    def check_inputs(self) -> None:
        """What can be refused before the endpoint is contacted."""
        if not 0.0 <= self.depth <= 1.0:
            raise BadInput(f"--depth {self.depth} must be between 0 and 1", hint="e.g. --depth 0.37")
        if not 1 <= self.tokens <= MAX_TOKENS:
            raise BadInput(f"--tokens {self.tokens} must be between 1 and {MAX_TOKENS}", hint="e.g. --tokens 166000")
        if self.max_tokens < 1:
            raise BadInput(f"--max-tokens {self.max_tokens} must be at least 1", hint="e.g. --max-tokens 32")
        check_timeout(self.read_timeout_s)
        if self.haystack is not None:
            check_text_file(self.haystack, "--haystack")

    def validate(self, max_model_len: int | None) -> None:
        self.check_inputs()
        if max_model_len is not None and self.tokens + self.max_tokens > max_model_len:
            room = max_model_len - self.max_tokens
            raise BadInput(f"needle of {self.tokens} tokens (+{self.max_tokens} answer tokens) exceeds the seat's "
                           f"max-model-len {max_model_len}",
                           hint=f"use --tokens {room} or less" if room >= 1 else
                           f"--max-tokens {self.max_tokens} alone fills it: lower --max-tokens (e.g. 32)")


def _filler(path: Path | None) -> str:
    if path is None:
        from dsv4serve.bench_ppl import sample_text

        return sample_text()
    text = read_text_file(path, "--haystack")
    # words for spaced scripts, characters for spaceless ones (the reference's haystack is Japanese)
    if len(text.split()) < 20 and len("".join(text.split())) < MIN_HAYSTACK_CHARS:
        raise BadInput(f"--haystack {path} is too short to build a haystack from",
                       hint=f"give a text of at least 20 words or {MIN_HAYSTACK_CHARS} characters")
    return text


def build_prompt(tok: Tokenizer, settings: NeedleSettings, code: str, nonce: str,
                 filler: str) -> tuple[NeedlePrompt, int | None, list[str]]:
    """Size the haystack so the templated prompt is `settings.tokens` long (or as near as words allow).

    Returns the prompt, its token count by the seat's tokenizer (None when only estimated), and notes.
    """
    notes: list[str] = []
    target = settings.tokens
    empty = compose(filler, 0, settings.depth, code, nonce)
    overhead = tok.chat_count(empty.text, settings.thinking)
    if overhead is None:
        notes.append(f"the server has no /tokenize: haystack sized by an estimate of {EST_CHARS_PER_TOKEN:g} "
                     "characters a token; the prompt length reported is the server's usage figure")
        chars = int((target - len(empty.text) / EST_CHARS_PER_TOKEN) * EST_CHARS_PER_TOKEN)
        if chars <= 0:
            raise BadInput(f"--tokens {target} is too short for the needle prompt itself")
        return compose(filler, chars, settings.depth, code, nonce), None, notes
    if target <= overhead + 8:
        raise BadInput(f"--tokens {target} is too short: the question and needle alone take {overhead} tokens",
                       hint=f"use --tokens {overhead + 64} or more")
    sample = tok.encode(" ".join(filler.split())[:20000]) or []
    chars_per_tok = max(0.5, min(len(" ".join(filler.split())[:20000]) / max(1, len(sample)), 10.0))
    chars = int((target - overhead) * chars_per_tok)
    best: tuple[int, NeedlePrompt, int] | None = None
    tol = max(4, int(target * 0.002))
    for _ in range(MAX_SIZING_ROUNDS):
        prompt = compose(filler, chars, settings.depth, code, nonce)
        count = tok.chat_count(prompt.text, settings.thinking)
        if count is None:
            raise JobFailed("/tokenize stopped answering while the haystack was being sized")
        diff = target - count
        # Never keep a prompt longer than asked: it could cross max-model-len.
        if diff >= 0 and (best is None or diff < best[0]):
            best = (diff, prompt, count)
        if 0 <= diff <= tol:
            break
        chars = max(1, chars + int(diff * chars_per_tok) - (1 if diff < 0 else 0))
    if best is None:
        raise JobFailed(f"could not size a haystack at or under {target} tokens")
    if best[0] > tol:
        notes.append(f"haystack sized to {best[2]} tokens, {best[0]} under the {target} asked")
    return best[1], best[2], notes


def _says(text: str, code: str) -> bool:
    """`code` as a whole word of `text`: 'saffron-anchor-51797' is a wrong recollection of
    'saffron-anchor-5179', not the code with something after it. ASCII boundaries: beside kana or
    hanzi (a Japanese answer, Chinese reasoning) or Markdown's underscores it is still the code."""
    return re.search(rf"(?<![A-Za-z0-9-]){re.escape(code)}(?![A-Za-z0-9]|-[A-Za-z0-9])", text) is not None


def run_needle(client: httpx.Client, target: Target, settings: NeedleSettings,
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    ep = target.endpoint
    settings.validate(ep.max_model_len)
    rng = random.Random(settings.seed if settings.seed is not None else time.time_ns())
    code = make_code(rng)
    # never from the seed: a repeated --seed must still miss the prefix cache (compose)
    nonce = os.urandom(4).hex()
    filler = _filler(settings.haystack)
    tok = Tokenizer(client, ep)
    if progress:
        progress("sizing the haystack")
    prompt, counted, notes = build_prompt(tok, settings, code, nonce, filler)
    if progress:
        progress(f"asking ({counted or settings.tokens} tokens)")
    body = chat_body(ep, prompt.text, settings.max_tokens, settings.thinking)
    try:
        res = stream_chat(client, ep, body, settings.read_timeout_s)
    except DsvError as e:
        e.message = f"needle request: {e.message}"
        raise
    ttft = res.ttft_s
    prompt_tokens = res.prompt_tokens or counted
    found = _says(res.content, code)
    in_reasoning = _says(res.reasoning, code)
    if not found and in_reasoning:
        notes.append("the code appeared only in the reasoning, not in the answer: counted as not found")
    elif not found and not res.content.strip() and res.finish_reason == "length":
        # the budget, not the retrieval: reasoning (or a long preamble) used every answer token
        notes.append(f"the answer budget (--max-tokens {settings.max_tokens}) ran out before any answer"
                     + (" (the reasoning used it): raise --max-tokens, or leave --thinking off" if settings.thinking
                        else ": raise --max-tokens"))
    ref = target.profile.reference.needle if target.profile else None
    comparable = bool(ref and prompt_tokens and abs(prompt_tokens - ref.tokens) <= 0.02 * ref.tokens
                      and abs(settings.depth - ref.depth) < 1e-6)
    ref_dict = None if ref is None else {
        "profile": target.profile.name if target.profile else None,
        "tokens": ref.tokens, "depth": ref.depth, "found": ref.found, "ttft_s": ref.ttft_s,
        "prefill_tok_s": (ref.tokens / ref.ttft_s) if ref.ttft_s else None, "decode_tok_s": ref.decode_tok_s,
        "comparable": comparable,
    }
    if ref is not None and not comparable:
        notes.append(f"reference is {ref.tokens} tokens at depth {ref.depth:g}: timings are not comparable "
                     "at this length or depth")
    prefill = (prompt_tokens / ttft) if ttft and prompt_tokens else None
    decode = res.decode_tok_s_after_first
    return {
        "kind": "dsv4serve.bench.needle",
        "version": 1,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "endpoint": {"base_url": ep.base_url, "model": ep.model, "max_model_len": ep.max_model_len,
                     "seat": target.seat},
        "tokens_requested": settings.tokens,
        "tokens_sized_by": "tokenize" if counted is not None else "estimate",
        "tokens_counted": counted,
        "prompt_tokens": res.prompt_tokens,
        "depth": settings.depth,
        "depth_actual": prompt.depth_actual,
        "code": code,
        "found": found,
        "found_in_reasoning": in_reasoning,
        "answer": res.content[:500],
        "finish_reason": res.finish_reason,
        "completion_tokens": res.completion_tokens,
        "ttft_s": ttft,
        "prefill_tok_s": prefill,
        "decode_tok_s": decode,
        "reference": ref_dict,
        "ratio": None if not comparable or ref is None else {
            "ttft_s": (ttft / ref.ttft_s) if ttft and ref.ttft_s else None,
            "decode_tok_s": (decode / ref.decode_tok_s) if decode and ref.decode_tok_s else None,
        },
        "notes": notes + list(target.notes),
    }
