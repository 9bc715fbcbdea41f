"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions,
/v1/embeddings, /health.

Requests are validated before any work (size cap, JSON, field types and ranges, prompt
against the context) and answered with OpenAI-style error JSON and 4xx codes. Every
generation goes to the model's BatchScheduler, so concurrent clients share each decode
step's weight reads; a client that disconnects mid-stream cancels its request, which frees
its batch slot at the next step.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from edgerun.errors import ContextOverflowError, EdgerunError
from edgerun.serving.session import system_prefix_len

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request as HTTPRequest

    from edgerun.api import Model

MAX_BODY_BYTES = 4 << 20  # a request body larger than this gets 413
# An oversized body is read and dropped up to this many bytes in all before the 413 goes
# out: a client still sending when the server answers and closes sees "connection reset"
# instead of the answer. A larger declared body is answered at once.
MAX_DRAIN_BYTES = 64 << 20
# JSON nesting a request body may have: a deep schema or tool needs a few dozen levels; the
# code that walks a body (and the grammar compiler) recurses once per level
MAX_JSON_DEPTH = 128
MAX_STOP = 4  # as OpenAI
MAX_EMBED_INPUTS = 2048  # inputs in one embeddings request, as OpenAI
MAX_STOP_CHARS = 256
# OpenAI's reasoning_effort -> a reasoning mode (generate/reasoning.py): "none"/"minimal"
# turn thinking off; "low" and "medium" cap it at a token budget; "high" leaves it uncapped.
REASONING_EFFORT: dict[str, str | int] = {
    "none": "off",
    "minimal": "off",
    "low": 512,
    "medium": 2048,
    "high": "on",
}


class APIError(Exception):
    """An error answered as OpenAI error JSON."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or ("authentication_error" if status == 401 else "invalid_request_error")

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}
        }


# -- request validation ---------------------------------------------------------------


def _nesting_over(value: Any, limit: int) -> bool:
    """Whether a parsed JSON value nests lists and objects more than `limit` deep (walked
    without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        if depth > limit:
            return True
        stack.extend((x, depth + 1) for x in v if isinstance(x, (dict, list)))
    return False


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# field -> (type check, range check, expected); unknown fields are ignored, as OpenAI's
# clients send extras ("user", "logit_bias", ...) that do not change a local answer.
_FIELDS: dict[str, tuple[Any, Any, str]] = {
    "model": (lambda v: isinstance(v, str), None, "a string"),
    "stream": (lambda v: isinstance(v, bool), None, "a boolean"),
    "max_tokens": (lambda v: _is_int(v) or v is None, None, "an integer"),
    "max_completion_tokens": (lambda v: _is_int(v) or v is None, None, "an integer"),
    "temperature": (lambda v: _is_num(v) or v is None, lambda v: 0 <= v <= 2, "in [0, 2]"),
    "top_p": (lambda v: _is_num(v) or v is None, lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (lambda v: _is_int(v) or v is None, lambda v: v >= 0, "an integer >= 0"),
    "min_p": (lambda v: _is_num(v) or v is None, lambda v: 0 <= v <= 1, "in [0, 1]"),
    "repeat_penalty": (lambda v: _is_num(v) or v is None, lambda v: v > 0, "a number > 0"),
    "frequency_penalty": (lambda v: _is_num(v) or v is None, lambda v: -2 <= v <= 2, "[-2, 2]"),
    "presence_penalty": (lambda v: _is_num(v) or v is None, lambda v: -2 <= v <= 2, "[-2, 2]"),
    "seed": (lambda v: _is_int(v) or v is None, None, "an integer"),
    "n": (lambda v: _is_int(v) or v is None, lambda v: v == 1, "1 (one choice per request)"),
    "stop": (
        lambda v: (
            v is None
            or isinstance(v, str)
            or (isinstance(v, list) and all(isinstance(s, str) for s in v))
        ),
        lambda v: (
            v is None
            or isinstance(v, str)
            or (len(v) <= MAX_STOP and all(0 < len(s) <= MAX_STOP_CHARS for s in v))
        ),
        f"a string or a list of at most {MAX_STOP} non-empty strings",
    ),
    "stream_options": (lambda v: v is None or isinstance(v, dict), None, "an object"),
    # structured output (generate/constraint.py): OpenAI's response_format, and the
    # llama.cpp server's json_schema / grammar body fields
    "response_format": (lambda v: v is None or isinstance(v, dict), None, "an object"),
    "json_schema": (lambda v: v is None or isinstance(v, dict), None, "a JSON Schema object"),
    "grammar": (lambda v: v is None or isinstance(v, str), None, "a string (GBNF or Lark)"),
    "tools": (lambda v: v is None or isinstance(v, list), None, "a list of tools"),
    "tool_choice": (
        lambda v: v is None or isinstance(v, str | dict),
        None,
        "'auto', 'none', 'required' or a function",
    ),
    "parallel_tool_calls": (lambda v: v is None or isinstance(v, bool), None, "a boolean"),
    "reasoning_effort": (
        lambda v: v is None or v in REASONING_EFFORT,
        None,
        f"one of {', '.join(REASONING_EFFORT)}",
    ),
    "reasoning_budget": (lambda v: _is_int(v) or v is None, lambda v: v >= -1, "an integer >= -1"),
    "chat_template_kwargs": (lambda v: v is None or isinstance(v, dict), None, "an object"),
}


def _check_fields(body: dict) -> None:
    for key, (type_ok, range_ok, expected) in _FIELDS.items():
        if key not in body:
            continue
        v = body[key]
        if not type_ok(v) or (range_ok is not None and v is not None and not range_ok(v)):
            raise APIError(400, f"'{key}' must be {expected}, got {json.dumps(v)[:80]}", key)


def _max_tokens(body: dict, n_ctx: int, default: int) -> int:
    v = body.get("max_completion_tokens", body.get("max_tokens"))
    if v is None:
        return default
    if v <= 0:
        raise APIError(400, f"'max_tokens' must be > 0, got {v}", "max_tokens")
    if v > n_ctx:
        raise APIError(
            400, f"'max_tokens' is {v} but the context window is {n_ctx} tokens", "max_tokens"
        )
    return v


def _stops(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    return [v] if isinstance(v, str) else list(v)


def _messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a 'role'", "messages")
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise APIError(400, f"messages[{i}].role {m['role']!r} is not a known role", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise APIError(
                        400, f"messages[{i}].content: only text parts are supported", "messages"
                    )
                if not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content text must be a string", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": content}
        msg.update(_tool_fields(m, i))
        out.append(msg)
    return out


def _tool_fields(m: dict, i: int) -> dict:
    """An assistant's tool_calls (and reasoning), a tool result's tool_call_id and name, as
    the chat template reads them."""
    out: dict[str, Any] = {}
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list) or not all(
            isinstance(c, dict)
            and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str)
            for c in calls
        ):
            raise APIError(
                400,
                f"messages[{i}].tool_calls must be a list of {{'id', 'type': 'function', "
                "'function': {'name', 'arguments'}}",
                "messages",
            )
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name", "reasoning_content"):
        v = m.get(key)
        if v is not None:
            if not isinstance(v, str):
                raise APIError(400, f"messages[{i}].{key} must be a string", "messages")
            out[key] = v
    return out


def _reasoning(body: dict) -> str | int | None:
    """The reasoning mode a request asks for: reasoning_budget (llama.cpp's: -1 no limit,
    0 off, N tokens), else reasoning_effort."""
    budget = body.get("reasoning_budget")
    if budget is not None:
        return "on" if budget == -1 else budget
    effort = body.get("reasoning_effort")
    return None if effort is None else REASONING_EFFORT[effort]


def _sampling(body: dict) -> dict[str, Any]:
    return {
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "min_p": body.get("min_p"),
        "repeat_penalty": body.get("repeat_penalty"),
    }


def _embedding_inputs(body: dict, model: Model) -> list[list[int]]:
    """The token ids of an embeddings request's `input`: a string, a list of strings, a
    list of token ids, or a list of such lists (OpenAI's four forms)."""
    from edgerun.generate.embedding import text_tokens

    v = body.get("input")
    expected = "a string, a list of strings, or token ids (a list or a list of lists)"
    if isinstance(v, str):
        v = [v]
    elif isinstance(v, list) and v and all(_is_int(t) for t in v):
        v = [v]
    if not isinstance(v, list) or not v:
        raise APIError(400, f"'input' must be {expected}", "input")
    if len(v) > MAX_EMBED_INPUTS:
        raise APIError(400, f"'input' holds {len(v)} items; at most {MAX_EMBED_INPUTS}", "input")
    seqs = []
    vocab = model.spec.vocab_size
    for i, item in enumerate(v):
        if isinstance(item, str):
            if not item:
                raise APIError(400, f"input[{i}] is empty", "input")
            seqs.append(text_tokens(model.tokenizer, item))
        elif isinstance(item, list) and item and all(_is_int(t) for t in item):
            if any(not 0 <= t < vocab for t in item):
                raise APIError(400, f"input[{i}] holds token ids outside [0, {vocab})", "input")
            seqs.append([int(t) for t in item])
        else:
            raise APIError(400, f"input[{i}] must be a non-empty string or token-id list", "input")
        if len(seqs[-1]) > model.n_ctx:
            raise APIError(
                400, f"input[{i}] has {len(seqs[-1])} tokens but the context window is "
                f"{model.n_ctx}", "input",
            )  # fmt: skip
    return seqs


def chat_turn(model: Model, convo: list[dict], body: dict):
    """The turn a chat request asks for: its tools, tool_choice, reasoning and template
    variables (generate/chat_turn.prepare_turn); a forced call's grammar is its
    `grammar` (constrained by _constraint)."""
    from edgerun.generate.chat_turn import prepare_turn

    model._need_template()
    turn = prepare_turn(
        model.tokenizer,
        convo,
        body.get("tools"),
        body.get("tool_choice"),
        _reasoning(body),
        body.get("chat_template_kwargs"),
        parallel=body.get("parallel_tool_calls") is not False,
    )
    return turn


# -- the app ----------------------------------------------------------------------------
def _constraint(model: Model, body: dict, turn=None):
    """The grammar a request's body asks for (response_format, json_schema or grammar),
    compiled, or the call a chat turn's tool_choice forces (ChatTurn.constraint); None
    for none. Runs off the event loop: compiling takes up to constraint.COMPILE_SECONDS."""
    from edgerun.generate.constraint import constraint_from, response_format_constraint

    if turn is not None:
        return turn.constraint(model.tokenizer, _constraint(model, body))
    rf = body.get("response_format")
    if rf is not None and (body.get("json_schema") is not None or body.get("grammar")):
        raise APIError(
            400, "give response_format or json_schema/grammar, not both", "response_format"
        )
    if rf is not None:
        return response_format_constraint(model.tokenizer, rf)
    return constraint_from(model.tokenizer, body.get("json_schema"), grammar=body.get("grammar"))


def create_app(
    model: Model,
    api_key: str | None = None,
    model_id: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    default_max_tokens: int = 512,
) -> Starlette:
    """A Starlette app serving `model`. api_key set: every /v1 request needs
    `Authorization: Bearer <key>` (compared in constant time)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    mid = model_id or model.name
    created = int(time.time())
    key = api_key.encode() if api_key else None

    def _auth(req: HTTPRequest) -> None:
        if key is None:
            return
        given = req.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), key):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)")

    async def _body(req: HTTPRequest) -> dict:
        length = req.headers.get("content-length")
        too_big = APIError(413, f"request body over {max_body_bytes} bytes")
        too_deep = f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep"
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                raise APIError(400, "bad Content-Length header") from None
            if declared > max(max_body_bytes, MAX_DRAIN_BYTES):
                raise too_big
        raw = bytearray()
        seen = 0
        async for chunk in req.stream():
            seen += len(chunk)
            if seen <= max_body_bytes:
                raw += chunk
            elif seen > MAX_DRAIN_BYTES:
                break
        if seen > max_body_bytes:  # the rest was read and dropped (MAX_DRAIN_BYTES)
            raise too_big
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        except RecursionError:  # deeper than the parser goes
            raise APIError(400, too_deep) from None
        if _nesting_over(body, MAX_JSON_DEPTH):
            raise APIError(400, too_deep)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        _check_fields(body)
        return body

    def _error(e: Exception) -> JSONResponse:
        if isinstance(e, APIError):
            return JSONResponse(e.body(), status_code=e.status)
        if isinstance(e, EdgerunError):
            return JSONResponse(APIError(400, str(e)).body(), status_code=400)
        err = APIError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")
        return JSONResponse(err.body(), status_code=500)

    async def health(req: HTTPRequest) -> JSONResponse:
        return JSONResponse({"status": "ok", "model": mid, "active": model.scheduler.active})

    async def models(req: HTTPRequest) -> JSONResponse:
        try:
            _auth(req)
        except APIError as e:
            return _error(e)
        card = {"id": mid, "object": "model", "created": created, "owned_by": "edgerun"}
        return JSONResponse({"object": "list", "data": [card]})

    def _request_limits(ids: list[int], body: dict):
        """A request's max_tokens, sampling parameters and stops, after checking that its
        prompt leaves room in the context window."""
        n_ctx = model.n_ctx
        if len(ids) >= n_ctx:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens but the context window is {n_ctx}; "
                "shorten the prompt",
                "messages" if "messages" in body else "prompt",
            )
        max_tokens = _max_tokens(body, n_ctx, default_max_tokens)
        params = model.settings.sampling(body.get("seed"), **_sampling(body))
        return max_tokens, params, _stops(body)

    def _submit(ids: list[int], body: dict, prefix_len: int = 0, constraint=None):
        max_tokens, params, stops = _request_limits(ids, body)
        try:
            return model.scheduler.submit(
                ids, params, max_tokens, stops, prefix_len=prefix_len, constraint=constraint
            )
        except ContextOverflowError as e:
            raise APIError(400, str(e)) from None

    def _usage(r) -> dict:
        st = r.stats
        return {
            "prompt_tokens": st.prompt_tokens,
            "completion_tokens": st.generated_tokens,
            "total_tokens": st.total_tokens,
        }

    def _finish_reason(r) -> str:
        return "length" if r.stats.finish_reason == "length" else "stop"

    def _sse_response(r, chunk_of, body: dict, finish=None) -> StreamingResponse:
        opts = body.get("stream_options") or {}
        return StreamingResponse(
            _stream(r, chunk_of, bool(opts.get("include_usage")), finish),
            media_type="text/event-stream",
        )

    def _sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def _stream(r, chunk_of, include_usage: bool, finish=None) -> AsyncIterator[str]:
        # chunk_of(piece) is one chunk or a list (a piece of a chat turn can make several
        # deltas, or none); chunk_of(None) ends the stream and its last chunk gets the
        # finish reason (finish(r), else _finish_reason)
        def chunks(c):
            return c if isinstance(c, list) else [c]

        try:
            async for piece in r:
                for c in chunks(chunk_of(piece)):
                    yield _sse(c)
            final = chunks(chunk_of(None))
            final[-1]["choices"][0]["finish_reason"] = (finish or _finish_reason)(r)
            for c in final:
                yield _sse(c)
            if include_usage:
                yield _sse({**chunk_of(None), "choices": [], "usage": _usage(r)})
            yield "data: [DONE]\n\n"
        finally:
            r.cancel()  # a client gone mid-stream frees its slot at the next step

    async def chat_completions(req: HTTPRequest):
        try:
            _auth(req)
            body = await _body(req)
            msgs = _messages(body)
            convo = model.with_system(msgs)
            turn = chat_turn(model, convo, body)
            ids = turn.ids
            prefix = system_prefix_len(model.engine, convo, ids) or turn.prefix_len
            constraint = await asyncio.to_thread(_constraint, model, body, turn)
            if turn.reasoning.budget is None:
                r = _submit(ids, body, prefix, constraint)
            elif constraint is not None:
                raise APIError(
                    400,
                    "a reasoning budget cannot be combined with response_format, a grammar "
                    "or a forced tool call",
                    "reasoning_budget",
                )
            else:
                r = _submit_turn(turn, body, prefix)
        except Exception as e:  # noqa: BLE001 - every failure becomes error JSON
            return _error(e)
        if turn.tools or turn.thinks:
            return await _chat_turn_answer(r, turn, body)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        now = int(time.time())
        base = {"id": rid, "created": now, "model": mid}
        if body.get("stream"):
            first = [True]

            def chunk_of(piece):
                delta = {}
                if piece is not None:
                    delta = {"content": piece}
                    if first[0]:
                        delta["role"] = "assistant"
                        first[0] = False
                return {
                    **base,
                    "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
                }

            return _sse_response(r, chunk_of, body)
        try:
            text = "".join([p async for p in r])
        except Exception as e:  # noqa: BLE001
            return _error(e)
        return JSONResponse(
            {
                **base,
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": _finish_reason(r),
                    }
                ],
                "usage": _usage(r),
            }
        )

    def _submit_turn(turn, body: dict, prefix_len: int):
        """A turn whose reasoning has a token budget (generate/reasoning.BudgetedGeneration)."""
        from edgerun.generate.reasoning import BudgetedGeneration

        max_tokens, params, stops = _request_limits(turn.ids, body)

        def submit(ids, n, cache):
            return model.scheduler.submit(
                ids, params, n, stops, cache=cache, prefix_len=prefix_len if cache is None else 0
            )

        return BudgetedGeneration(
            submit,
            turn.ids,
            max_tokens,
            turn.reasoning.budget,
            turn.close_ids,
            turn.opens_reasoning,
        )

    async def _chat_turn_answer(r, turn, body: dict):
        """A chat answer read as reasoning, content and tool calls (generate/chat_turn.py)."""
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        base = {"id": rid, "created": int(time.time()), "model": mid}
        reader = turn.reader()
        if body.get("stream"):
            first = [True]

            def chunk(delta: dict) -> dict:
                if first[0]:
                    delta = {"role": "assistant", **delta}
                    first[0] = False
                return {
                    **base,
                    "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
                }

            def chunk_of(piece):
                if piece is None:
                    return [chunk(d) for d in reader.finish()] + [chunk({})]
                return [chunk(d) for d in reader.feed(piece)]

            return _sse_response(
                r, chunk_of, body, lambda r: reader.finish_reason(_finish_reason(r))
            )
        try:
            async for piece in r:
                reader.feed(piece)
            reader.finish()
        except Exception as e:  # noqa: BLE001
            return _error(e)
        choice = {
            "index": 0,
            "message": reader.message(),
            "finish_reason": reader.finish_reason(_finish_reason(r)),
        }
        return JSONResponse(
            {**base, "object": "chat.completion", "choices": [choice], "usage": _usage(r)}
        )

    async def completions(req: HTTPRequest):
        try:
            _auth(req)
            body = await _body(req)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str):
                if not prompt:
                    raise APIError(400, "'prompt' is empty", "prompt")
                ids = model.tokenize(prompt, special=False)
            elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
                ids = [int(t) for t in prompt]
                if any(not 0 <= t < model.spec.vocab_size for t in ids):
                    raise APIError(400, "'prompt' holds token ids outside the vocabulary", "prompt")
            else:
                raise APIError(
                    400, "'prompt' must be a non-empty string or a list of token ids", "prompt"
                )
            constraint = await asyncio.to_thread(_constraint, model, body)
            r = _submit(ids, body, constraint=constraint)
        except Exception as e:  # noqa: BLE001
            return _error(e)
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        base = {"id": rid, "created": int(time.time()), "model": mid, "object": "text_completion"}
        if body.get("stream"):

            def chunk_of(piece):
                return {
                    **base,
                    "choices": [
                        {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": None}
                    ],
                }

            return _sse_response(r, chunk_of, body)
        try:
            text = "".join([p async for p in r])
        except Exception as e:  # noqa: BLE001
            return _error(e)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": _finish_reason(r)}
        return JSONResponse({**base, "choices": [choice], "usage": _usage(r)})

    async def embeddings(req: HTTPRequest):
        from starlette.concurrency import run_in_threadpool

        from edgerun.generate.embedding import embed_ids

        try:
            _auth(req)
            body = await _body(req)
            seqs = _embedding_inputs(body, model)
            fmt = body.get("encoding_format", "float")
            if fmt not in ("float", "base64"):
                raise APIError(
                    400, "'encoding_format' must be 'float' or 'base64'", "encoding_format"
                )
            dims = body.get("dimensions")
            if dims is not None and dims != model.spec.d_model:
                raise APIError(
                    400, f"'dimensions' must be {model.spec.d_model} for this model "
                    f"(its hidden size), got {json.dumps(dims)[:40]}", "dimensions",
                )  # fmt: skip
            pooling = body.get("pooling")  # an extension: "last", "mean" or "cls"
            if pooling is not None and not isinstance(pooling, str):
                raise APIError(400, "'pooling' must be a string", "pooling")
            vectors = await run_in_threadpool(embed_ids, model.engine, seqs, pooling)
        except Exception as e:  # noqa: BLE001
            return _error(e)
        data = []
        for i, v in enumerate(vectors):
            if fmt == "base64":
                emb: Any = base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
            else:
                emb = v.tolist()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        n = sum(len(s) for s in seqs)
        usage = {"prompt_tokens": n, "total_tokens": n}
        return JSONResponse({"object": "list", "data": data, "model": mid, "usage": usage})

    async def not_found(req: HTTPRequest, exc: Exception) -> JSONResponse:
        return JSONResponse(APIError(404, f"no route {req.url.path}").body(), status_code=404)

    async def bad_method(req: HTTPRequest, exc: Exception) -> JSONResponse:
        return JSONResponse(
            APIError(405, f"method {req.method} not allowed on {req.url.path}").body(),
            status_code=405,
        )

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
        ],
        exception_handlers={404: not_found, 405: bad_method},
    )


def serve(
    model: Model,
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    log_level: str = "info",
) -> None:
    """Run the server until interrupted (binds to loopback unless told otherwise)."""
    import uvicorn

    app = create_app(model, api_key=api_key)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
