"""What the API server logs about a request: one line per prompt in vLLM's words when request logging is on,
and a warning for the fields it ignored.

vLLM 0.33 (vllm/entrypoints/serve/utils/request_logger.py, RequestLogger.log_inputs) logs at INFO
"Received request ID: params: SamplingParams(...), lora_request: None." and, at DEBUG only, the prompt and
its token ids ("Request ID details: ..."), both cut to --max-log-len (unlimited there; MAX_LOG_LEN here).
Logging is off unless --enable-log-requests, vLLM's default since it dropped --disable-log-requests
(vllm/engine/arg_utils.py, AsyncEngineArgs.enable_log_requests = False). The id is vLLM's: cmpl-ID (with
-i for the i-th prompt of a completion) or chatcmpl-ID, ID being the X-Request-Id header, else the body's
request_id, else a fresh one.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid

from afd.engine.sampling import SamplingParams

log = logging.getLogger("afd.api")

MAX_LOG_LEN = 2048
"""The DEBUG line shows this many characters of the prompt and this many of its token ids. vLLM's
--max-log-len (unlimited by default) has no flag here: a whole long prompt per line costs more than it tells."""
MAX_ID_LEN = 256
"""A client's request id is cut to this in log lines (the body may hold megabytes of it)."""
MAX_NAMES = 8
"""Ignored fields named in one warning; the rest are counted."""
MAX_ITEMS = 16
"""A list or dict parameter (stop strings, logit_bias, allowed_token_ids) shows this many items in the INFO line,
then how many it has: a 3M-entry stop_token_ids would otherwise be one 20 MB line."""
MAX_FIELD_LEN = 512
"""Characters of one parameter's text in the INFO line, then how many were cut."""


def base_id(headers, body) -> str:
    """vLLM's _base_request_id: the X-Request-Id header, else the body's request_id, else a new one; cut to
    MAX_ID_LEN, and its control characters escaped: it is written into log lines, where a newline or an ANSI
    escape from a client would forge a line of the server's own."""
    rid = headers.get("x-request-id") or getattr(body, "request_id", None) or uuid.uuid4().hex
    return printable(rid[:MAX_ID_LEN])


def printable(text: str) -> str:
    """`text` with each non-printable character (newline, escape, NUL...) as its Python escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def shown(value) -> str:
    """repr(value) for a log line: at most MAX_ITEMS items of a list or dict, at most MAX_FIELD_LEN characters,
    each cut said (repr escapes a string's control characters)."""
    if isinstance(value, (list, tuple)) and len(value) > MAX_ITEMS:
        text = f"{repr(list(value[:MAX_ITEMS]))[:-1]}, ... {len(value)} items]"
    elif isinstance(value, dict) and len(value) > MAX_ITEMS:
        head = dict(list(value.items())[:MAX_ITEMS])
        text = f"{repr(head)[:-1]}, ... {len(value)} items}}"
    else:
        text = repr(value)
    if len(text) > MAX_FIELD_LEN:
        text = f"{text[:MAX_FIELD_LEN]}... ({len(text) - MAX_FIELD_LEN} more characters)"
    return text


def params_text(sp: SamplingParams, n: int, max_tokens: int, stop: list[str], ignore_eos: bool) -> str:
    """The params as vLLM prints its SamplingParams: the request's n, stop, ignore_eos and max_tokens with
    afd's sampling fields (afd keeps those four outside SamplingParams), each cut as `shown` cuts it."""
    fields = {f.name: getattr(sp, f.name) for f in dataclasses.fields(sp)}
    values = {"n": n, **fields, "stop": stop, "ignore_eos": ignore_eos, "max_tokens": max_tokens}
    return "SamplingParams(" + ", ".join(f"{k}={shown(v)}" for k, v in values.items()) + ")"


def log_request(rid: str, prompt: str | None, ids: list[int], params: str) -> None:
    log.info("Received request %s: params: %s, lora_request: None.", rid, params)
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "Request %s details: prompt: %r, prompt_token_ids: %s, prompt_embeds shape: None.",
            rid,
            None if prompt is None else prompt[:MAX_LOG_LEN],
            ids[:MAX_LOG_LEN],
        )


def warn_ignored(rid: str, names: list[str], metrics) -> None:
    """One warning per request naming the fields it ignored, and each counted (the metric bounds its labels)."""
    if not names:
        return
    listed = ", ".join(repr(n[:64]) for n in names[:MAX_NAMES]) + (" ..." if len(names) > MAX_NAMES else "")
    log.warning(
        "Request %s: ignored %d field(s) that no vLLM request model has and afd does not know: %s",
        rid,
        len(names),
        listed,
    )
    if metrics is not None:
        for name in names:
            metrics.ignored_field(name)
