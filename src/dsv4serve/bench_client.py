"""HTTP primitives the bench measurements share: the endpoint, SSE parsing, /metrics, /tokenize.

Everything here talks to an OpenAI-compatible server (vLLM in practice) with explicit timeouts,
and turns every failure into a one-line `DsvError`: a bench that swallows an error chunk reports
a number for a request that never finished (seat-reference §7 trap 18).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import httpx

from dsv4serve.errors import BadInput, JobFailed, first_line

# Short calls (models, metrics, tokenize of a short text) must never hang a bench.
SHORT_TIMEOUT_S = 15.0
CONNECT_TIMEOUT_S = 5.0
# Faster than 5,000 tok/s for one stream is no decode any seat does; it is a delivery burst.
BURST_S_PER_TOKEN = 0.0002

# What a request to a bad endpoint can raise besides httpx.HTTPError: httpx.InvalidURL is a bare
# Exception, and a host name the IDNA codec rejects ("a..b", a 64-character label) surfaces as a
# UnicodeError from the socket layer.
REQUEST_ERRORS: tuple[type[Exception], ...] = (httpx.HTTPError, httpx.InvalidURL, UnicodeError)


def timeout(read_s: float) -> httpx.Timeout:
    """Connect fast or fail; `read_s` bounds the silence between two bytes of a response."""
    return httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=read_s, write=60.0, pool=CONNECT_TIMEOUT_S)


# httpx's raw host: a DNS name (IDNA-encoded) or IPv4 address, or an IPv6 one without its brackets
# (a link-local zone as typed, fe80::1%eth0, which httpx connects to); 'http://a b' gives 'a%20b',
# which is neither
_HOST = re.compile(r"[A-Za-z0-9._-]+|[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*(%[A-Za-z0-9._-]+)?", re.ASCII)


def check_base_url(url: str) -> str:
    """`url` as the bench will use it (no trailing slash), or BadInput naming what is wrong.

    Checked before any request: httpx reports a malformed URL only once a request is built, and
    in its own words; a query or fragment would swallow every path appended to the base.
    """
    hint = "give the server's root, e.g. --base-url http://127.0.0.1:8000"
    text = url.strip()
    url = masked_url(text)  # what the messages below quote: never a password
    try:
        parsed = httpx.URL(text)
        port = parsed.port
    except httpx.InvalidURL as e:
        raise BadInput(f"--base-url '{url}' is not a valid URL ({masked_url(str(e))})", hint=hint) from None
    if parsed.scheme not in ("http", "https"):
        raise BadInput(f"--base-url '{url}' must start with http:// or https://", hint=hint)
    if not parsed.host:
        raise BadInput(f"--base-url '{url}' has no host", hint=hint)
    if port is not None and not 0 < port < 65536:
        raise BadInput(f"--base-url '{url}' has port {port}, outside 1-65535", hint=hint)
    try:
        parsed.host.encode("idna")
    except UnicodeError:
        raise BadInput(f"--base-url '{url}' has an invalid host name '{parsed.host}'", hint=hint) from None
    if not _HOST.fullmatch(parsed.raw_host.decode("ascii", errors="replace")):
        raise BadInput(f"--base-url '{url}' has an invalid host name '{parsed.host}'", hint=hint)
    if "//" in parsed.path.rstrip("/"):  # 'https://http://host:1' parses as host 'http' and path '//host:1'
        raise BadInput(f"--base-url '{url}' has '//' in its path: two URLs run together?", hint=hint)
    if parsed.query or parsed.fragment:
        raise BadInput(f"--base-url '{url}' must not carry a query or fragment", hint=hint)
    return text.rstrip("/")


def masked_url(url: str) -> str:
    """`url` with any user:password replaced by ***, for a message (parsed or not)."""
    # to the last @, after the scheme if there is one (`admin:pw@host`, a scheme forgotten, too): a
    # password may hold '/' or '?', and masking a path's @ too is the safe side
    return re.sub(r"^((?:[A-Za-z][\w+.-]*:)?/{0,2}).*@", r"\1***@", url, count=1)


def split_userinfo(url: str) -> tuple[str, httpx.BasicAuth | None]:
    """`url` without a user:password, and those credentials for the client: every result file and
    message names the base URL, and a password must not ride along into them."""
    u = httpx.URL(url)
    if not u.userinfo:
        return url, None
    return str(u.copy_with(userinfo=b"")).rstrip("/"), httpx.BasicAuth(u.username, u.password)


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    model: str
    max_model_len: int | None = None
    served: tuple[str, ...] = ()

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path


# ---------------------------------------------------------------------------------------------
# errors


SERVER_MESSAGE_CHARS = 300


def _server_message(resp: httpx.Response) -> str:
    """The server's own words for a non-200, on one line: vLLM sends {"error": {"message": ...}}.
    A Python traceback in it keeps what precedes it and its last line (the exception), not the
    frames; anything still too long keeps its start and its end, where the cause is."""
    lines = [ln.strip() for ln in _server_words(resp).splitlines() if ln.strip()]
    tb = next((i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")), None)
    if tb is not None and tb < len(lines) - 1:
        lines = lines[:tb] + [lines[-1]]
    text = " ".join(" ".join(lines).split())
    if len(text) > SERVER_MESSAGE_CHARS:
        half = SERVER_MESSAGE_CHARS // 2 - 2
        text = f"{text[:half]} … {text[-half:]}"
    return text or resp.reason_phrase


def _server_words(resp: httpx.Response) -> str:
    text = resp.text
    if "html" in resp.headers.get("content-type", "") or text.lstrip()[:15].lower().startswith(("<!doctype", "<html")):
        # a web page, not an API error: its markup on the error line says nothing; its title may
        title = re.search(r"<title[^>]*>(.*?)</title>", text, re.I | re.S)
        return "an HTML page" + (f" titled '{' '.join(title.group(1).split())}'" if title else "")
    try:
        body = resp.json()
    except ValueError:
        return resp.text
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or json.dumps(err))
        if isinstance(err, str):
            return err
        if "detail" in body:
            return str(body["detail"])
    return json.dumps(body)


def shell_proxy(client: httpx.Client, url: str) -> str | None:
    """The proxy of the shell's HTTP_PROXY / HTTPS_PROXY / ALL_PROXY (less NO_PROXY) that `client`
    sends `url` through, as scheme://host:port (no credentials), or None for a direct request: a
    failure of the proxy must not be blamed on the seat. httpx keeps its routing private, so an
    httpx that moved it only loses the proxy's name from an error's wording."""
    try:
        transport = client._transport_for_url(httpx.URL(url))
        if transport is client._transport:
            return None
        proxy = transport._pool._proxy_url  # type: ignore[attr-defined]
        host = proxy.host.decode("ascii")
        return f"{proxy.scheme.decode('ascii')}://{f'[{host}]' if ':' in host else host}" + \
            (f":{proxy.port}" if proxy.port else "")
    except (AttributeError, UnicodeError, httpx.InvalidURL, TypeError):
        return None


def _via(proxy: str | None) -> str:
    return f" through the shell's proxy {proxy}" if proxy else ""


PROXY_HINT = ("is the proxy up, and can it reach the server? A server this machine reaches directly goes in "
              "NO_PROXY (e.g. NO_PROXY=127.0.0.1,localhost)")


def http_failure(base_url: str, e: Exception, what: str | None = None, proxy: str | None = None) -> JobFailed:
    """One line for a request that got no HTTP answer. `what` names a request with its own fixed
    timeout (not --timeout), so the hint does not send the user to a flag that would not help;
    `proxy` (shell_proxy) is what carried the request, whose own failures are not the seat's."""
    if proxy is not None and isinstance(e, (httpx.ConnectError, httpx.ProxyError)):
        return JobFailed(f"cannot reach {base_url}{_via(proxy)} ({first_line(e, e.__class__.__name__)})",
                         hint=PROXY_HINT)
    if isinstance(e, httpx.ConnectError):
        text = str(e).lower()
        if any(w in text for w in ("name or service not known", "nodename nor servname", "name resolution",
                                   "no address associated")):
            return JobFailed(f"cannot reach {base_url} (its host name does not resolve)", hint="check the --base-url")
        if any(w in text for w in ("ssl", "tls", "certificate", "wrong version number")):
            return JobFailed(f"cannot reach {base_url} (TLS handshake failed: {first_line(e, '')})",
                             hint="a vLLM seat speaks plain HTTP: use http://, or check the server's certificate")
        return JobFailed(f"cannot reach {base_url} ({first_line(e, '') or 'connection refused or no route'})",
                         hint="is the seat up? check `dsv4serve status`, or the --base-url")
    if isinstance(e, httpx.TimeoutException):
        if what is not None:
            return JobFailed(f"{base_url} did not answer {what}{_via(proxy)} in time ({e.__class__.__name__})",
                             hint="the server is overloaded or stuck: check its log"
                             + (f"; or the proxy is: {PROXY_HINT}" if proxy else ""))
        return JobFailed(f"{base_url} did not answer{_via(proxy)} in time ({e.__class__.__name__})",
                         hint="raise --timeout if the seat is just slow (long prefill), else check its log"
                         + (f"; or the proxy is: {PROXY_HINT}" if proxy else ""))
    return JobFailed(f"request to {base_url}{_via(proxy)} failed: {e.__class__.__name__}: {first_line(e, '')}",
                     hint=PROXY_HINT if proxy else None)


def status_hint(resp: httpx.Response, proxy: str | None = None) -> str:
    """What to do about a non-200 from the endpoint, by its class. A 401 is a missing key or a
    wrong one, and the request says which; a 502 / 503 / 504 that came through a proxy is as
    likely the proxy's own (it could not reach the seat) as the seat's."""
    code = resp.status_code
    if code == 404:
        return ("the endpoint is not an OpenAI-compatible server here: --base-url must be the server's root "
                "(e.g. http://127.0.0.1:8000, a vLLM seat's endpoint from `dsv4serve status`)")
    if code == 407:
        return (f"the shell's proxy {proxy or '(HTTP_PROXY / ALL_PROXY)'} wants credentials: put them in its URL, "
                "or exempt the server's host in NO_PROXY")
    if code in (401, 403):
        sent = resp.request.headers.get("authorization", "") if _has_request(resp) else ""
        if sent.lower().startswith("basic "):  # the --base-url's user:password, not an API key
            return "the server (or a proxy before it) refused the user:password of --base-url: check them"
        if sent:
            return ("the server refused the API key bench sent (--api-key, else the seat's own key with --seat, "
                    "else VLLM_API_KEY): pass the one it was started with")
        return "the server wants an API key: pass it with --api-key KEY (or VLLM_API_KEY in the shell)"
    if code in (502, 503, 504) and proxy:
        return (f"the request went through the shell's proxy {proxy}: {PROXY_HINT}; else see the server's log "
                "(`dsv4serve logs`)")
    if code >= 500:
        return "the server failed the request: see its log (`dsv4serve logs`)"
    return "the server refused the request as sent: check --model and the token options against what it serves"


def _has_request(resp: httpx.Response) -> bool:
    try:
        resp.request
    except RuntimeError:  # a Response built by hand (tests, a mock transport) has none
        return False
    return True


def check_status(resp: httpx.Response, what: str, proxy: str | None = None) -> None:
    if resp.status_code != 200:
        raise JobFailed(f"{what}: HTTP {resp.status_code}: {_server_message(resp)}", hint=status_hint(resp, proxy))


# ---------------------------------------------------------------------------------------------
# the endpoint: served models and their max-model-len


def list_models(client: httpx.Client, base_url: str) -> list[dict[str, Any]]:
    try:
        resp = client.get(base_url.rstrip("/") + "/v1/models", timeout=timeout(SHORT_TIMEOUT_S))
    except REQUEST_ERRORS as e:
        raise http_failure(base_url, e, what=f"GET /v1/models within {SHORT_TIMEOUT_S:g} s",
                           proxy=shell_proxy(client, base_url)) from None
    if resp.status_code == 404 and httpx.URL(base_url).path.rstrip("/").endswith("/v1"):
        raise JobFailed(f"GET {base_url}/v1/models: HTTP 404",
                        hint="drop the trailing /v1 from --base-url: bench appends /v1/... itself")
    check_status(resp, f"GET {base_url}/v1/models", shell_proxy(client, base_url))
    try:
        data = resp.json().get("data", [])
    except (ValueError, AttributeError):
        data = None
    if not isinstance(data, list):
        raise JobFailed(f"{base_url}/v1/models did not return an OpenAI model list")
    # an entry whose id is not a non-empty string (a proxy's extra entry) names no model we could
    # send; a list of nothing else is no model list at all
    models = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]]
    if data and not models:
        raise JobFailed(f"{base_url}/v1/models did not return an OpenAI model list")
    return models


def resolve_endpoint(client: httpx.Client, base_url: str, model: str | None,
                     fallback_max_len: int | None = None) -> Endpoint:
    """Check the server answers and serves `model`; learn its max-model-len."""
    models = list_models(client, base_url)
    served = tuple(m["id"] for m in models)
    if not served:
        raise JobFailed(f"{base_url} serves no model")
    if model is None:
        if len(served) > 1:
            raise BadInput(f"{base_url} serves {len(served)} models ({', '.join(served)})", hint="pick one with --model")
        model = served[0]
    if model not in served:
        raise BadInput(f"model '{model}' is not served at {base_url} (served: {', '.join(served)})",
                       hint="pass one of those to --model")
    entry = next(m for m in models if m["id"] == model)
    mml = _int_or_none(entry.get("max_model_len"))
    max_len = mml if mml is not None and mml > 0 else fallback_max_len
    return Endpoint(base_url=base_url.rstrip("/"), model=model, max_model_len=max_len, served=served)


# ---------------------------------------------------------------------------------------------
# SSE


def iter_sse_data(lines: Iterable[str]) -> Iterator[str]:
    """Yield the data payload of each server-sent event.

    Comment lines (`: keep-alive`) and fields other than `data` are skipped; a payload split
    over several `data:` lines is joined with newlines; a blank line ends an event. A payload
    still pending when the stream ends is yielded too (a server that dies mid-event).
    """
    buf: list[str] = []
    for raw in lines:
        line = raw.rstrip("\r\n")
        if line == "":
            if buf:
                yield "\n".join(buf)
                buf = []
            continue
        if line.startswith(":"):
            continue
        name, sep, value = line.partition(":")
        if not sep:
            continue  # a field with no value carries nothing we need
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            buf.append(value)
    if buf:
        yield "\n".join(buf)


class StreamError(JobFailed):
    """The server reported an error inside a stream, or sent something that is not a chunk."""


def parse_chunk(payload: str) -> dict[str, Any]:
    """Decode one SSE payload into a chunk, raising on an error chunk or garbage."""
    try:
        obj = json.loads(payload)
    except ValueError:
        raise StreamError(f"stream sent a non-JSON event: {payload[:200]!r}") from None
    if not isinstance(obj, dict):
        raise StreamError(f"stream sent a non-object event: {payload[:200]!r}")
    if "error" in obj:
        err = obj["error"]
        msg = err.get("message", json.dumps(err)) if isinstance(err, dict) else str(err)
        raise StreamError(f"server sent an error chunk: {msg}")
    # A chunk without `choices` is what a bench once indexed blindly (KeyError 'choices') and
    # swallowed; only the final usage chunk may legitimately have an empty list.
    if "choices" not in obj:
        raise StreamError(f"stream chunk has no 'choices': {payload[:200]}")
    return obj


@dataclass
class StreamResult:
    """One streamed chat completion, timed on the client's monotonic clock."""

    t_start: float
    t_first: float | None = None       # first delta carrying content or reasoning
    t_last: float | None = None        # last chunk carrying a choice (token or finish)
    t_end: float | None = None         # the stream closed
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    chunks: int = 0                    # for diagnostics only: never a token count

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_start

    @property
    def decode_s(self) -> float | None:
        if self.t_first is None or self.t_last is None:
            return None
        return self.t_last - self.t_first

    @property
    def burst(self) -> bool:
        """All tokens reached the client at once: a starved client or HTTP layer buffered them.

        Seen on a CPU seat with more streams than cores: 16 tokens "decoded" in 0.2 ms. The
        interval then measures buffering, not decoding, and gives no decode rate.
        """
        d = self.decode_s
        n = self.completion_tokens or 0
        return d is not None and n > 2 and d < n * BURST_S_PER_TOKEN

    @property
    def decode_tok_s(self) -> float | None:
        # Same definition as the seat's reference instrument (tokens over last - first event),
        # so ratios against the profile's figures compare like with like.
        d = self.decode_s
        if d is None or d <= 0 or not self.completion_tokens or self.burst:
            return None
        return self.completion_tokens / d

    @property
    def decode_tok_s_after_first(self) -> float | None:
        """Tokens decoded after the first over the time they took: the prefill made the first token at
        t_first, so n tokens span n - 1 decode steps. The needle's answer is ~10 tokens, where
        n / (n - 1) would overstate the rate by ~12 %; a 256-token stream keeps decode_tok_s, the
        reference instrument's definition."""
        d = self.decode_s
        n = self.completion_tokens or 0
        if d is None or d <= 0 or n < 2 or self.burst:
            return None
        return (n - 1) / d

    @property
    def wall_s(self) -> float | None:
        return None if self.t_end is None else self.t_end - self.t_start


# A generation the server ended itself: no figure may be read off it.
FAILED_FINISH = ("abort", "error")


def consume_stream(payloads: Iterable[str], result: StreamResult, clock=time.perf_counter) -> StreamResult:
    """Fold SSE payloads into `result`; raise on errors, on a generation the server aborted, and on
    a stream with no usage."""
    done = False
    for payload in payloads:
        if payload.strip() == "[DONE]":
            done = True
            break
        chunk = parse_chunk(payload)
        now = clock()
        result.chunks += 1
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            result.prompt_tokens = _count(usage, "prompt_tokens", payload)
            result.completion_tokens = _count(usage, "completion_tokens", payload)
        choices = chunk["choices"] or []
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise StreamError(f"stream chunk's 'choices' is not a list of objects: {payload[:200]}")
        for choice in choices:
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise StreamError(f"stream chunk has a malformed delta: {payload[:200]}")
            text = delta.get("content")
            reason = delta.get("reasoning_content") or delta.get("reasoning")
            if not isinstance(text or "", str) or not isinstance(reason or "", str):
                raise StreamError(f"stream chunk has a non-text delta: {payload[:200]}")
            if text or reason:
                if result.t_first is None:
                    result.t_first = now
                result.content += text or ""
                result.reasoning += reason or ""
            result.t_last = now
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
    result.t_end = clock()
    if not done:
        raise StreamError("stream ended without [DONE] (the server closed it mid-generation)")
    if result.finish_reason in FAILED_FINISH:
        raise StreamError(f"the server ended the generation with finish_reason '{result.finish_reason}' after "
                          f"{result.completion_tokens if result.completion_tokens is not None else '?'} tokens",
                          hint="its log says why (`dsv4serve logs`); no figure is read off an aborted request")
    if result.completion_tokens is None:
        raise StreamError("stream carried no usage chunk, so tokens cannot be counted",
                          hint="the server must honour stream_options.include_usage")
    return result


def within_deadlines(pieces: Iterable[str], result: StreamResult, first_s: float, total_s: float,
                     clock=time.perf_counter) -> Iterator[str]:
    """The stream's pieces (the text as it arrives, not whole lines: a server that sends a byte a
    second and never a newline would hold a line reader forever), until the first token is later
    than `first_s` or the whole stream longer than `total_s` after it began: the read timeout bounds
    only the silence between two bytes, and a proxy's keep-alives in front of a stuck engine never
    leave any."""
    for piece in pieces:
        now = clock()
        if result.t_first is None and now - result.t_start > first_s:
            raise StreamError(f"no token within {first_s:g} s of the request (the stream sent only keep-alives)",
                              hint="is the engine stuck? `dsv4serve logs`; or raise --timeout")
        if now - result.t_start > total_s:
            raise StreamError(f"the stream did not end within {total_s:g} s", hint="is the engine stuck? "
                              "`dsv4serve logs`; or raise --timeout")
        yield piece


_EOL = re.compile(r"\r\n|\r|\n")


def sse_lines(pieces: Iterable[str]) -> Iterator[str]:
    """Lines (CRLF, CR or LF, as SSE allows) of text that arrives in pieces of any length."""
    buf = ""
    for piece in pieces:
        buf += piece
        while (m := _EOL.search(buf)) and not (m.group() == "\r" and m.end() == len(buf)):  # "\r" may be half "\r\n"
            yield buf[:m.start()]
            buf = buf[m.end():]
    if buf:
        yield buf.rstrip("\r")


def _count(usage: dict[str, Any], key: str, payload: str) -> int | None:
    """A usage count, None when absent; a negative one is the server's bug, never a figure to divide by."""
    n = _int_or_none(usage.get(key))
    if n is not None and n < 0:
        raise StreamError(f"stream usage has {key} {n}: {payload[:200]}")
    return n


def _int_or_none(v: Any) -> int | None:
    # Python's json accepts Infinity and NaN, which int() cannot take.
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return int(v)


def chat_body(endpoint: Endpoint, prompt: str, max_tokens: int, thinking: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": endpoint.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body["chat_template_kwargs"] = template_kwargs(thinking)
    return body


def template_kwargs(thinking: bool) -> dict[str, Any]:
    """The chat template's switch, said both ways: with reasoning on, thinking eats the budget and
    the answer can come back empty (seat-reference §7 trap 6), so it is off unless asked for; and
    asked for, it is sent, not left to a template whose default may be off."""
    return {"thinking": thinking}


def stream_chat(client: httpx.Client, endpoint: Endpoint, body: dict[str, Any], read_timeout_s: float,
                clock=time.perf_counter) -> StreamResult:
    result = StreamResult(t_start=clock())
    try:
        with client.stream("POST", endpoint.url("/v1/chat/completions"), json=body,
                           timeout=timeout(read_timeout_s)) as resp:
            if resp.status_code != 200:
                resp.read()
                raise StreamError(f"chat completion: HTTP {resp.status_code}: {_server_message(resp)}",
                                  hint=status_hint(resp, shell_proxy(client, endpoint.base_url)))
            ctype = resp.headers.get("content-type", "")
            if "text/event-stream" not in ctype:
                resp.read()
                raise StreamError(f"chat completion did not stream (content-type {ctype or 'missing'}): "
                                  f"{resp.text[:200]}")
            # a token a second at the least, after a first token within the read timeout
            total = read_timeout_s + max(60.0, float(body.get("max_tokens") or 0))
            lines = sse_lines(within_deadlines(resp.iter_text(), result, read_timeout_s, total, clock))
            return consume_stream(iter_sse_data(lines), result, clock)
    except REQUEST_ERRORS as e:
        raise http_failure(endpoint.base_url, e, proxy=shell_proxy(client, endpoint.base_url)) from None


# ---------------------------------------------------------------------------------------------
# /metrics (Prometheus text format)


def _split_series(line: str) -> tuple[str, str] | None:
    """`name{labels} value [ts]` -> (name, rest after the labels); None if not a sample."""
    i = 0
    n = len(line)
    while i < n and line[i] not in "{ \t":
        i += 1
    name = line[:i]
    if not name:
        return None
    if i < n and line[i] == "{":
        # Skip the label set, honouring quotes and escapes: label values may contain } or spaces.
        i += 1
        in_q = False
        while i < n:
            c = line[i]
            if in_q:
                if c == "\\":
                    i += 1
                elif c == '"':
                    in_q = False
            elif c == '"':
                in_q = True
            elif c == "}":
                break
            i += 1
        else:
            return None
        i += 1
    return name, line[i:]


def parse_metrics(text: str) -> dict[str, float]:
    """Sum every sample of each metric name over all its label sets."""
    out: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        split = _split_series(line)
        if split is None:
            continue
        name, rest = split
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if not math.isfinite(value):  # a counter at ±Inf would make every difference NaN
            continue
        out[name] = out.get(name, 0.0) + value
    return out


ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_SERIES = (ACCEPTED, DRAFTS, DRAFT_TOKENS)


def scrape_spec(client: httpx.Client, base_url: str) -> dict[str, float] | None:
    """The speculative-decoding counters now, or None when /metrics is absent or unreadable."""
    try:
        resp = client.get(base_url.rstrip("/") + "/metrics", timeout=timeout(SHORT_TIMEOUT_S))
    except REQUEST_ERRORS:
        return None  # acceptance becomes "n/a"; the token figures do not depend on it
    if resp.status_code != 200:
        return None
    values = parse_metrics(resp.text)
    return {k: values[k] for k in SPEC_SERIES if k in values}


@dataclass(frozen=True)
class SpecDelta:
    accepted: float
    drafts: float
    draft_tokens: float | None

    @property
    def acceptance_length(self) -> float | None:
        """Tokens emitted per target forward: the accepted drafts plus the one bonus token."""
        if self.drafts <= 0:
            return None
        return 1.0 + self.accepted / self.drafts

    @property
    def acceptance_rate(self) -> float | None:
        if not self.draft_tokens:
            return None
        return self.accepted / self.draft_tokens


def spec_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> SpecDelta | None:
    """The counters' growth over a run; None when either scrape lacks a needed series."""
    if before is None or after is None:
        return None
    if any(k not in before or k not in after for k in (ACCEPTED, DRAFTS)):
        return None
    tokens = None
    if DRAFT_TOKENS in before and DRAFT_TOKENS in after:
        tokens = after[DRAFT_TOKENS] - before[DRAFT_TOKENS]
    return SpecDelta(accepted=after[ACCEPTED] - before[ACCEPTED], drafts=after[DRAFTS] - before[DRAFTS],
                     draft_tokens=tokens)


# ---------------------------------------------------------------------------------------------
# /tokenize


@dataclass
class Tokenizer:
    """The seat's own tokenizer, through vLLM's POST /tokenize; `available` False on other servers."""

    client: httpx.Client
    endpoint: Endpoint
    read_timeout_s: float = 120.0
    timeout_is_flag: bool = False  # read_timeout_s came from --timeout (ppl), so the hint may name it
    available: bool = True
    notes: list[str] = field(default_factory=list)

    def _post(self, body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            resp = self.client.post(self.endpoint.url("/tokenize"), json=body, timeout=timeout(self.read_timeout_s))
        except REQUEST_ERRORS as e:
            raise http_failure(self.endpoint.base_url, e, what=None if self.timeout_is_flag
                               else f"POST /tokenize within {self.read_timeout_s:g} s",
                               proxy=shell_proxy(self.client, self.endpoint.base_url)) from None
        if resp.status_code in (404, 405, 501):
            self.available = False
            return None
        check_status(resp, "POST /tokenize", shell_proxy(self.client, self.endpoint.base_url))
        try:
            out = resp.json()
        except ValueError:
            out = None
        if not isinstance(out, dict):
            raise self._malformed(f"not a JSON object: {resp.text[:120]!r}")
        return out

    def _malformed(self, what: str) -> JobFailed:
        return JobFailed(f"POST {self.endpoint.base_url}/tokenize answered {what}",
                         hint="the server's /tokenize is not vLLM's; measure against a vLLM endpoint")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int] | None:
        out = self._post({"model": self.endpoint.model, "prompt": text, "add_special_tokens": add_special_tokens})
        if out is None:
            return None
        tokens = out.get("tokens")
        ids = [_int_or_none(t) for t in tokens] if isinstance(tokens, list) else None
        if ids is None or any(i is None or i != t for i, t in zip(ids, tokens)):
            raise self._malformed("without a 'tokens' list of token ids")
        return [i for i in ids if i is not None]

    def chat_count(self, prompt: str, thinking: bool) -> int | None:
        """Tokens of the whole chat-templated prompt, exactly as the server will see it."""
        body: dict[str, Any] = {"model": self.endpoint.model, "messages": [{"role": "user", "content": prompt}],
                                "add_generation_prompt": True, "chat_template_kwargs": template_kwargs(thinking)}
        out = self._post(body)
        if out is None:
            return None
        count = _int_or_none(out.get("count"))
        if count is None or count < 0 or count != out.get("count"):
            raise self._malformed("without a 'count' of tokens")
        return count
