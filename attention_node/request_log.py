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


def base_id(headers, body) -> str:
    """vLLM's _base_request_id: the X-Request-Id header, else the body's request_id, else a new one."""
    rid = headers.get("x-request-id") or getattr(body, "request_id", None) or uuid.uuid4().hex
    return rid[:MAX_ID_LEN]


def params_text(sp: SamplingParams, n: int, max_tokens: int, stop: list[str], ignore_eos: bool) -> str:
    """The params as vLLM prints its SamplingParams: the request's n, stop, ignore_eos and max_tokens with
    afd's sampling fields (afd keeps those four outside SamplingParams)."""
    fields = {f.name: getattr(sp, f.name) for f in dataclasses.fields(sp)}
    shown = {"n": n, **fields, "stop": stop, "ignore_eos": ignore_eos, "max_tokens": max_tokens}
    return "SamplingParams(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"


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
    shown = ", ".join(repr(n[:64]) for n in names[:MAX_NAMES]) + (" ..." if len(names) > MAX_NAMES else "")
    log.warning(
        "Request %s: ignored %d field(s) that no vLLM request model has and afd does not know: %s",
        rid,
        len(names),
        shown,
    )
    if metrics is not None:
        for name in names:
            metrics.ignored_field(name)
