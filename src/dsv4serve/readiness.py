"""Readiness proves inference: /health, the served name in /v1/models, then a real completion.

/health alone is not readiness: a tiny model can answer it and die on its first request
(vllm-cpu-reference §2, head_dim 16), and /v1/models answers while generation is dead
(vllm#53157). The canary is one greedy chat completion, thinking off where the template has it
(the deepseek_v4 template reasons by default and can spend the whole budget on it, trap 6); it
passes when the server reports at least one completion token and, where the profile names one
(`gates.canary.expect`), the answer contains the expected text: tokens alone do not tell a seat
that computes from one that emits garbage.
"""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import psutil

from dsv4serve.errors import JobFailed, first_line

# httpx.InvalidURL is no HTTPError: a URL httpx cannot build (an unbracketed IPv6 host once) must
# read as a failed probe, not escape as a crash of `status` or of the readiness thread.
HTTP_ERRORS = (httpx.HTTPError, httpx.InvalidURL)
# trust_env=False on every probe: the seat is on this machine, and an http_proxy / ALL_PROXY of the
# user's shell without NO_PROXY for 127.0.0.1 carried them away (a healthy seat failed readiness).


def health(base_url: str, timeout: float = 3.0) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=timeout, trust_env=False).status_code == 200
    except HTTP_ERRORS:
        return False


def auth(api_key: str | None) -> dict[str, str]:
    """The header vLLM wants on every /v1 path of a seat started with --api-key / VLLM_API_KEY
    (/health needs none); without it readiness read 401 and stopped a healthy seat."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def unsendable(api_key: str | None) -> str | None:
    """Where `api_key` has a character an HTTP header cannot carry ("'\\xa0' at position 6"), or None.
    httpx raises UnicodeEncodeError on such a header mid-request: a pasted key with a non-breaking
    space or a curly quote."""
    bad = next(((i, c) for i, c in enumerate(api_key or "") if not " " <= c < "\x7f"), None)
    return None if bad is None else f"{bad[1]!r} at position {bad[0]}"


def served_models(base_url: str, timeout: float = 5.0, api_key: str | None = None) -> list[str]:
    try:
        r = httpx.get(f"{base_url}/v1/models", timeout=timeout, trust_env=False, headers=auth(api_key))
        r.raise_for_status()
        data = r.json().get("data", [])
        if not isinstance(data, list):
            raise TypeError(f"data is a JSON {type(data).__name__}, not a list")
        return [m.get("id", "") if isinstance(m, dict) else "" for m in data]
    except (*HTTP_ERRORS, ValueError, AttributeError, TypeError) as e:
        raise JobFailed(f"{base_url}/v1/models did not answer ({type(e).__name__}: {first_line(e)})") from None


# A greedy answer that misses the expected text is a seat that generates but computes something else.
EXPECT_HINT = ("the seat generates, but not the expected answer: a wrong quant or bits stamp, or a MoE kernel "
               "computing nonsense (`dsv4serve check-seat`, `dsv4serve logs`); if the answer is right, fix "
               "gates.canary.expect")


def canary_body(model: str, canary_cfg: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": getattr(canary_cfg, "prompt", "Hello")}],
        "max_tokens": int(getattr(canary_cfg, "max_tokens", 8)),
        "temperature": 0,
    }
    if getattr(canary_cfg, "thinking_off", False):
        body["chat_template_kwargs"] = {"thinking": False}
    return body


def canary_result(base_url: str, model: str, canary_cfg: Any, timeout: float = 120.0,
                  api_key: str | None = None) -> dict[str, Any]:
    """The canary with its evidence: text, completion tokens, seconds. Raises JobFailed."""
    t0 = time.monotonic()
    try:
        r = httpx.post(f"{base_url}/v1/chat/completions", json=canary_body(model, canary_cfg), timeout=timeout,
                       trust_env=False, headers=auth(api_key))
    except HTTP_ERRORS as e:
        raise JobFailed(f"canary completion failed: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise JobFailed(f"canary completion returned HTTP {r.status_code}: {r.text[:200]}")
    try:
        data = r.json()
        tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
        choice = data["choices"][0]
        msg, finish = choice["message"], choice.get("finish_reason")
        parts = [msg.get(k) for k in ("content", "reasoning_content", "reasoning")]
        if any(v is not None and not isinstance(v, str) for v in parts):
            raise TypeError("a message field is not text")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        # an error chunk must surface, not pass as an empty answer (trap 18)
        raise JobFailed(f"canary completion answered without choices: {r.text[:200]}") from None
    if tokens < 1:
        raise JobFailed("canary completion returned no tokens",
                        hint="the model produced nothing: read the seat's log (`dsv4serve logs`)")
    if finish not in ("stop", "length"):  # abort / error: the engine gave up on it, whatever it had made
        raise JobFailed(f"canary completion ended with finish_reason {finish!r} after {tokens} token(s)",
                        hint="the engine did not finish the request: read the seat's log (`dsv4serve logs`)")
    if data.get("model") not in (None, model):
        raise JobFailed(f"canary completion was answered as model {data.get('model')!r}, not {model}",
                        hint="another server may own this port")
    text = next((v for v in parts if v), "").strip()
    reasoned = not parts[0] and bool(text)  # no answer, only reasoning: what the budget cut, not the answer
    expect = getattr(canary_cfg, "expect", None)
    if expect is not None and not re.search(expect, text):
        what = "reasoned (no answer)" if reasoned else "answered"
        raise JobFailed(f"canary {what} {text[:80]!r} ({tokens} token(s), finish_reason {finish!r}), which does "
                        f"not match gates.canary.expect /{expect}/",
                        hint="the answer ran out of max_tokens before it was given: raise gates.canary.max_tokens "
                             "or set gates.canary.thinking_off=true (trap 6)"
                        if finish == "length" and (reasoned or not text) else EXPECT_HINT)
    return {"text": text, "tokens": tokens, "seconds": round(time.monotonic() - t0, 2), "expect": expect}


def canary(base_url: str, model: str, canary_cfg: Any, timeout: float = 120.0, api_key: str | None = None) -> str:
    """One chat completion that must return tokens; the generated text (may be gibberish)."""
    return canary_result(base_url, model, canary_cfg, timeout, api_key=api_key)["text"]


def listeners(port: int) -> set[int]:
    """Pids listening on `port` (empty when psutil may not see them)."""
    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.AccessDenied, OSError):
        return set()
    return {c.pid for c in conns if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid}


def foreign_listeners(port: int, our_pids: set[int]) -> str | None:
    """Who else listens on our port, as 'pid N (its command)' (None when nobody, or psutil cannot
    see): a seat whose port another process holds never answers its own /health."""
    foreign = sorted(listeners(port) - our_pids)
    if not foreign:
        return None
    described = []
    for pid in foreign:
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())[:80]
        except (psutil.Error, OSError):
            cmd = ""
        described.append(f"pid {pid}" + (f" ({cmd})" if cmd else ""))
    return ", ".join(described)


def check(base_url: str, model: str, canary_cfg: Any, timeout: float, port: int | None = None,
          our_pids: set[int] | None = None, api_key: str | None = None) -> dict[str, Any]:
    """/health, the served name, that the listener is one of our processes (when the caller can
    say which are ours), then the canary."""
    if not health(base_url, timeout=5.0):
        raise JobFailed(f"{base_url}/health is not 200")
    names = served_models(base_url, api_key=api_key)
    if model not in names:
        raise JobFailed(f"the server at {base_url} serves {names}, not {model}",
                        hint="another server may own this port")
    owner = None
    if port is not None and our_pids is not None:
        owners = listeners(port)
        foreign = owners - our_pids
        # Any foreign listener fails, not only an all-foreign set: with SO_REUSEPORT two servers
        # share the port and the kernel may hand the canary to the other one.
        if foreign:
            raise JobFailed(f"port {port} is also served by pid {sorted(foreign)}, which is not one of this seat's "
                            f"processes", hint="another server listens on this port: stop it")
        owner = sorted(owners & our_pids) or None
    res = canary_result(base_url, model, canary_cfg, timeout, api_key=api_key)
    return {"health": 200, "models": names, "listener": owner, "canary": res["text"][:80],
            "canary_tokens": res["tokens"], "canary_s": res["seconds"], "canary_expect": res["expect"]}
