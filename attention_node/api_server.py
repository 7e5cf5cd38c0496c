"""The OpenAI-compatible HTTP API of an attention node (FastAPI)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from afd import __version__
from afd.engine.engine import Engine, EngineDead
from afd.engine.grammar import GrammarCompiler
from afd.engine.tokenizer import Tokenizer
from afd.observability.attention_metrics import AttentionMetrics
from afd.observability.metrics import CONTENT_TYPE
from attention_node import prompts, request_fields, request_log, structured
from attention_node.body_check import messages_error
from attention_node.generation import Generation, outputs
from attention_node.http_guard import Guard
from attention_node.large_bodies import CheckLargeBodies
from attention_node.memory import TrimAfterLargeBodies
from attention_node.openai_protocol import (
    COMPLETION_MAX_TOKENS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Limits,
    TokenizeRequest,
    check_ids,
    check_prompt,
    resolve_max_tokens,
    sampling_params,
    stop_strings,
    validation_error,
)
from attention_node.openapi_doc import openapi_schema

log = logging.getLogger("afd.api")


@dataclass
class ServerState:
    engine: Engine
    tokenizer: Tokenizer | None
    model_name: str
    model_path: str
    limits: Limits
    metrics: AttentionMetrics | None
    ready: Callable[[], bool]
    """Cluster ready and the data plane alive."""
    api_key: str | None = None
    draining: bool = False
    max_body_bytes: int = 32 << 20
    """Larger request bodies get 413 before they are read."""
    log_requests: bool = False
    """One log line per request, vLLM's (http.enable_log_requests, --enable-log-requests)."""
    grammars: GrammarCompiler | None = None
    """Structured outputs' compiler, made on the first constrained request (attention_node/structured.py)."""
    max_grammar_bytes: int = 256 << 10
    """Larger structured-output specs get 400 before they are compiled (http.max_grammar_bytes)."""


def build_app(st: ServerState) -> FastAPI:
    app = FastAPI(title="afd", version=__version__)
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]  # FastAPI's documented way to override

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return JSONResponse(e.body(), status_code=e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):  # e.g. a body that is not UTF-8 JSON
        err = ApiError(e.status_code, str(e.detail), "body" if e.status_code in (400, 413) else None)
        return JSONResponse(err.body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        err = validation_error(list(e.errors()))
        return JSONResponse(err.body(), status_code=err.code)

    app.add_middleware(
        CheckLargeBodies, max_model_len=st.limits.max_model_len, vocab_size=st.limits.vocab_size
    )  # inside the guard: after its checks
    app.add_middleware(Guard, st=st)
    app.add_middleware(TrimAfterLargeBodies)  # outermost: it trims once the guard and the route are done

    @app.get("/health")
    async def health():
        return Response(status_code=200 if _serving(st) else 503)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():  # what SageMaker-style load balancers probe; the same answer as /health
        return Response(status_code=200 if _serving(st) else 503)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        body = st.metrics.render() if st.metrics else b""
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": st.model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "afd",
                    "root": st.model_path,
                    "parent": None,
                    "max_model_len": st.limits.max_model_len,
                    "vocab_size": st.limits.vocab_size,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _admit(st, body.model)
        rid = _fields(st, body, request, chat=False)
        ids = await prompts.completion_prompts(st.tokenizer, body.prompt, st.limits, body.add_special_tokens)
        return await _serve(st, body, ids, request, chat=False, rid=rid)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        _admit(st, body.model)
        rid = _fields(st, body, request, chat=True)
        if st.tokenizer is None:
            raise ApiError(
                400,
                "This model has no tokenizer.json: chat needs one; send token ids to /v1/completions instead.",
                "messages",
            )
        bad = messages_error([m.content for m in body.messages], st.limits.max_model_len)
        if bad is not None:
            raise ApiError(400, *bad)
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        tools = body.tools if body.tool_choice != "none" else None  # as vLLM: the template lists what may be called
        ids = await prompts.chat_ids(
            st.tokenizer,
            body.messages,
            body.add_generation_prompt,
            st.limits,
            add_special_tokens=body.add_special_tokens,
            template_kwargs=body.chat_template_kwargs,
            tools=tools,
        )
        return await _serve(st, body, [ids], request, chat=True, rid=rid)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        tok = _need_tokenizer(st, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "Send either `prompt` or `messages`.", "prompt")
        if body.messages is not None:
            ids = await prompts.chat_ids(tok, body.messages, body.add_generation_prompt, st.limits)
        else:
            assert body.prompt is not None  # the check above: one of prompt and messages
            ids = await prompts.text_ids(tok, body.prompt, st.limits, body.add_special_tokens)
        out = {"count": len(ids), "max_model_len": st.limits.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = tok.token_strs(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        tok = _need_tokenizer(st, body.model)
        if len(body.tokens) > st.limits.max_model_len:  # /tokenize's bound: no sequence is longer than the context
            raise ApiError(
                400,
                f"This model's maximum context length is {st.limits.max_model_len} tokens. However, your "
                f"request has {len(body.tokens)} tokens to detokenize.",
                "tokens",
            )
        check_ids(body.tokens, st.limits, "tokens")
        return {"prompt": await prompts.tokenize(lambda: tok.decode(body.tokens), "tokens")}

    return app


def _serving(st: ServerState) -> bool:
    return st.ready() and not st.draining and not st.engine.dead and not st.engine.paused


def _check_model(st: ServerState, model: str | None) -> None:
    if model is not None and model not in (st.model_name, st.model_path):
        raise ApiError(404, f"The model `{model}` does not exist.", "model", "NotFoundError")


def _need_tokenizer(st: ServerState, model: str | None) -> Tokenizer:
    _check_model(st, model)
    if st.tokenizer is None:
        raise ApiError(400, "This model has no tokenizer.json to tokenize with.", "model")
    return st.tokenizer


def _admit(st: ServerState, model: str | None) -> None:
    _check_model(st, model)
    if st.draining:
        raise ApiError(503, "The server is draining and takes no new requests.")
    if st.engine.dead or not st.ready():
        raise ApiError(503, f"The cluster is not serving: {st.engine.dead or 'not ready'}.")


def _fields(st: ServerState, body, request: Request, chat: bool) -> str:
    """The request's id (vLLM's cmpl-ID or chatcmpl-ID), after the check of every field vLLM's request models
    have (a 400 for one afd refuses) and a warning and count for each field afd ignores."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{request_log.base_id(request.headers, body)}"
    request_log.warn_ignored(rid, request_fields.check(body, chat), st.metrics)
    return rid


async def _serve(st: ServerState, body, prompt_ids: list[list[int]], request: Request, chat: bool, rid: str):
    plan = []
    for k, ids in enumerate(prompt_ids):
        prompt_ids[k] = ids = request_fields.truncate(ids, body, st.limits.max_model_len)
        check_prompt(ids, st.limits)
        default = None if chat else COMPLETION_MAX_TOKENS
        plan.append((ids, resolve_max_tokens(body.max_tokens, len(ids), st.limits, default)))
    sampling_params(body, 0, st.limits)  # surfaces a bad n or sampling parameter as 400 before anything runs
    if stop_strings(body) and st.tokenizer is None:
        raise ApiError(400, "stop strings need a tokenizer; this model has no tokenizer.json.", "stop")
    constraint = structured.constraint_of(body, chat)
    grammar = None if constraint is None else await structured.compile_for(st, constraint)  # on a worker thread
    if st.log_requests:
        _log(st, body, plan, rid, chat)
    try:
        gens = [Generation(st, ids, body, mt, k * body.n, chat, grammar) for k, (ids, mt) in enumerate(plan)]
    except EngineDead as e:
        raise ApiError(503, f"The cluster is not serving: {e}.") from None
    from attention_node import responses

    if body.stream:
        return StreamingResponse(
            responses.stream(st, body, gens, outputs(gens), request, chat, constraint, rid),
            media_type="text/event-stream",
        )
    return await responses.full(st, body, gens, outputs(gens), request, chat, constraint, rid)


def _log(st: ServerState, body, plan: list[tuple[list[int], int]], rid: str, chat: bool) -> None:
    """vLLM's line per prompt: a completion's i-th prompt is cmpl-ID-i, as vLLM names it."""
    sp, stop = sampling_params(body, 0, st.limits), stop_strings(body)
    prompt = None if chat else body.prompt
    texts = [prompt] if isinstance(prompt, str) else prompt if prompt and isinstance(prompt[0], str) else []
    for k, (ids, max_tokens) in enumerate(plan):
        params = request_log.params_text(sp, body.n, max_tokens, stop, body.ignore_eos)
        request_log.log_request(rid if chat else f"{rid}-{k}", texts[k] if k < len(texts) else None, ids, params)
