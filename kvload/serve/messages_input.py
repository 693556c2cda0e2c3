"""Anthropic's Messages API request (``POST /v1/messages``, ``/v1/messages/count_tokens``) read as the chat body.

As vLLM serves it (so Claude Code and Anthropic SDK clients can use a local model): a Messages body is checked field by
field, in its own names, then turned into the chat completions body that says the same (``system`` → a system message
first, content blocks → chat messages: ``tool_use`` blocks → the assistant's ``tool_calls``, ``tool_result`` blocks →
``tool`` messages; ``tools[i].input_schema`` → a function's ``parameters``; ``tool_choice`` auto/any/tool/none →
"auto"/"required"/a named function/"none"; ``stop_sequences`` → ``stop``; ``output_config.format`` →
``response_format``), so one path (``kvload.serve.protocol.parse``,
templating, sampling, tool calls, the reasoning split, limits) serves it. What that path then refuses is named back in
the Messages body's words (:func:`renamed_error`), and every refusal on these paths is Anthropic's error document
(:class:`AnthropicError`). Settings accepted that change nothing are reported ``setting_ignored``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

from kvload.serve.command import TOOL_CALL_PARSERS
from kvload.serve.protocol import (
    EFFORT_IGNORED,
    AsSent,
    BadRequest,
    _check_unicode,
    items_aside,
    need_schema,
    not_an_object,
    renamed_as,
)

#: The Messages fields kvload acts on or reports (count_tokens takes those that shape the prompt).
ACCEPTED = frozenset({"model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences",
                      "stream", "tools", "tool_choice", "metadata", "thinking", "output_config", "service_tier",
                      "cache_control", "chat_template_kwargs"})  # the last vLLM's extra, as on the chat endpoint
COUNT_ACCEPTED = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
                            "cache_control", "chat_template_kwargs"})
_PASSED = ("model", "temperature", "top_p", "top_k", "stream", "chat_template_kwargs")
#: Anthropic's ``output_config.effort`` values.
_EFFORTS = ("low", "medium", "high", "xhigh", "max")

#: Anthropic's error type for each HTTP status kvload answers with.
_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "timeout_error", 409: "invalid_request_error",
          413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error", 500: "api_error",
          503: "overloaded_error"}
#: Anthropic's longest ``metadata.user_id`` (an opaque id: a uuid or a hash, never personal data)
MAX_USER_ID = 256
_CACHED = "kvload caches every prompt's prefix whatever is marked (cache_salt scopes sharing on the chat endpoint)"


class AnthropicError(BadRequest):
    """A refusal on the Messages paths: Anthropic's error document, its type from the HTTP status."""

    @classmethod
    def of(cls, exc: BadRequest) -> AnthropicError:
        """``exc`` (any refusal) in Anthropic's shape."""
        return cls(exc.message, param=exc.param, status=exc.status, kind=exc.kind, code=exc.code, headers=exc.headers)

    def body(self) -> dict[str, Any]:
        """Anthropic's error document."""
        kind = _KINDS.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


@attrs.frozen
class MessagesRequest:
    """What a Messages answer needs of its request, and where each chat message came from (for error names)."""

    #: each chat message's origin in the body ("system", "messages[2]", "messages[3].content[0]")
    sources: tuple[str, ...] = ()
    #: settings accepted that change nothing, each (name, value, why)
    ignored: tuple[tuple[str, Any, str], ...] = ()


def _need(ok: bool, field: str, expected: str, value: Any) -> None:
    if not ok:
        raise BadRequest(f"{field}: expected {expected}, got {value!r}"[:300], param=field)


def _fields(item: dict[str, Any], where: str, allowed: set[str]) -> None:
    extra = sorted(str(key) for key in item if key not in allowed)
    if extra:
        raise BadRequest(f"{where}.{extra[0][:60]}: not supported here; accepted: {', '.join(sorted(allowed))}",
                         param=f"{where}.{extra[0][:60]}")


def to_chat(body: Any, tool_parser: str | None = None, reasoning_parser: str | None = None, *,
            count: bool = False) -> tuple[dict[str, Any], MessagesRequest]:
    """A Messages body as the chat endpoint's body saying the same, and what the answer needs; ``BadRequest`` naming
    the Messages field. ``count``: a count_tokens body (no ``max_tokens``, nothing generated)."""
    if not isinstance(body, dict):
        raise not_an_object(body)
    accepted = COUNT_ACCEPTED if count else ACCEPTED
    unknown = sorted(str(k) for k in set(body) - accepted)
    if unknown:
        path = "/v1/messages/count_tokens" if count else "/v1/messages"
        raise AsSent(f"{unknown[0][:80]}: not supported by kvload serve's {path}; accepted fields: "
                     f"{', '.join(sorted(accepted))}", param=unknown[0][:80])
    model = body.get("model")
    _need(isinstance(model, str) and bool(model), "model", "the served model's name (a non-empty string)", model)
    ignored: list[tuple[str, Any, str]] = []
    chat: dict[str, Any] = {k: body[k] for k in _PASSED if body.get(k) is not None}
    if not count:
        limit = body.get("max_tokens")
        _need(limit is not None, "max_tokens", "an integer of at least 1 (Anthropic requires it)", limit)
        chat["max_tokens"] = limit  # the chat path checks it (an integer, within the context length)
        stops = body.get("stop_sequences")
        if stops is not None:
            _need(isinstance(stops, list) and all(isinstance(s, str) for s in stops), "stop_sequences",
                  "a list of strings", stops)
            if stops:
                chat["stop"] = stops
        if body.get("metadata") is not None:
            _need(isinstance(body["metadata"], dict), "metadata", 'an object {"user_id"?}', body["metadata"])
            _fields(body["metadata"], "metadata", {"user_id"})  # Anthropic's one key; any other is its 400 too
            user = body["metadata"].get("user_id")
            _need(user is None or (isinstance(user, str) and len(user) <= MAX_USER_ID), "metadata.user_id",
                  f"a string of at most {MAX_USER_ID} characters", user)
            ignored.append(("metadata", body["metadata"], "kvload keeps no per-user records of requests"))
        tier = body.get("service_tier")  # Anthropic's: standard capacity is the one kvload has ("auto" falls to it)
        _need(tier in (None, "auto", "standard_only"), "service_tier", '"auto" or "standard_only" (kvload serves one '
              "tier)", tier)
    _output_config(body.get("output_config"), chat, ignored, count)
    # Anthropic's automatic caching, for the whole request: any value taken and reported, as a block's is (vLLM's
    # request model has no such field, so pydantic drops whatever is sent: a client's malformed one is no 400 there)
    _cache_control(body, "", ignored)
    given = body.get("messages")  # a long list of messages checked and converted off the parse gate
    messages, sources = items_aside(given, lambda: _messages(given, ignored))
    system = _system(body.get("system"), ignored)
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
        sources.insert(0, "system")
    if messages[-1]["role"] == "assistant":  # Anthropic's prefill: the reply goes on from the assistant's text
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True
    chat["messages"] = messages
    tools = _tools(body.get("tools"), ignored)
    if tools:
        chat["tools"] = tools
    choice, parallel = _tool_choice(body.get("tool_choice"), tools, tool_parser, count)
    if count and tools:  # checked, but nothing is generated: the prompt (the tools given to the template) is the same
        choice, parallel = "none", None  # whatever the choice, and "auto" needs no parser to be counted
    if choice is not None:
        chat["tool_choice"] = choice
    if parallel is not None:
        chat["parallel_tool_calls"] = parallel
    _thinking(body.get("thinking"), reasoning_parser, ignored)
    return chat, MessagesRequest(sources=tuple(sources), ignored=tuple(ignored))


def _text(value: Any, field: str, ignored: list[tuple[str, Any, str]]) -> str:
    """A string, or a list of text blocks joined (their ``cache_control`` reported)."""
    if isinstance(value, str):
        return value
    _need(isinstance(value, list), field, "a string or a list of text blocks", value)
    out = []
    for j, block in enumerate(value):
        where = f"{field}[{j}]"
        _need(isinstance(block, dict) and block.get("type") == "text", where,
              'a text block {"type": "text", "text": ...} (kvload serves text)', block)
        out.append(_block_text(block, where, ignored))
    return "".join(out)


def _cache_control(block: dict[str, Any], where: str, ignored: list[tuple[str, Any, str]]) -> None:
    if block.get("cache_control") is not None:  # where "": the request's own (Anthropic's automatic caching)
        ignored.append((f"{where}.cache_control" if where else "cache_control", block["cache_control"], _CACHED))


#: How Claude Code's per-request attribution block in ``system`` begins: its hash changes every request.
BILLING_HEADER = "x-anthropic-billing-header"


def _system(value: Any, ignored: list[tuple[str, Any, str]]) -> str | None:
    """``system`` as one text; Claude Code's attribution block (:data:`BILLING_HEADER`) is dropped, as vLLM drops it:
    put first in the prompt, its per-request hash left the prefix cache nothing to reuse between turns."""
    if value is None:
        return None
    if not isinstance(value, list):
        return _text(value, "system", ignored)
    out = []
    for j, block in enumerate(value):
        where = f"system[{j}]"
        _need(isinstance(block, dict) and block.get("type") == "text", where,
              'a text block {"type": "text", "text": ...} (kvload serves text)', block)
        text = _block_text(block, where, ignored)
        if text.startswith(BILLING_HEADER):
            ignored.append((where, BILLING_HEADER, "Claude Code's per-request attribution: dropped from the prompt "
                            "(as vLLM drops it), so the prefix cache holds across turns"))
        else:
            out.append(text)
    return "".join(out) if out or not value else None


_BLOCKS = {"user": "text or tool_result", "assistant": "text, tool_use, thinking or redacted_thinking"}


def _messages(value: Any, ignored: list[tuple[str, Any, str]]) -> tuple[list[dict[str, Any]], list[str]]:
    """``messages`` as chat messages, and the body's name for where each came from. A user message's ``tool_result``
    blocks are ``tool`` messages (each answering a ``tool_use`` block before it, as Anthropic requires), then its
    text a user message; an assistant's ``tool_use`` blocks are its ``tool_calls``; its ``thinking`` blocks (a past
    answer's) its ``reasoning``, joined, as vLLM converts them (``redacted_thinking``: dropped, reported)."""
    _need(isinstance(value, list) and bool(value), "messages", "a non-empty list of {role, content} messages", value)
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    calls: set[str] = set()  # the tool_use ids so far: what a tool_result may answer
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        _need(isinstance(message, dict), where, "a {role, content} message", message)
        _fields(message, where, {"role", "content"})
        role = message.get("role")
        _need(role in ("user", "assistant"), f"{where}.role", '"user" or "assistant"', role)
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            sources.append(where)
            continue
        _need(isinstance(content, list), f"{where}.content", f"a string or a list of {_BLOCKS[role]} blocks", content)
        texts: list[str] = []
        uses: list[dict[str, Any]] = []
        thoughts: list[str] = []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            _need(isinstance(block, dict) and isinstance(block.get("type"), str), at, "a content block with a type",
                  block)
            kind = block["type"]
            if kind == "text":
                texts.append(_block_text(block, at, ignored))
            elif kind == "tool_use" and role == "assistant":
                _fields(block, at, {"type", "id", "name", "input", "cache_control"})
                for key in ("id", "name"):
                    _need(isinstance(block.get(key), str) and bool(block[key]), f"{at}.{key}", "a non-empty string",
                          block.get(key))
                _need(isinstance(block.get("input"), dict), f"{at}.input", "an object (the tool's arguments)",
                      block.get("input"))
                _cache_control(block, at, ignored)
                calls.add(block["id"])
                uses.append({"id": block["id"], "type": "function",
                             "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
            elif kind == "thinking" and role == "assistant":  # vLLM's rule: the turn's reasoning, for the template
                _fields(block, at, {"type", "thinking", "signature", "cache_control"})
                _need(isinstance(block.get("thinking"), str), f"{at}.thinking", "a string (the answer's thinking)",
                      block.get("thinking"))
                # named here: the chat path would name the turn it becomes (messages[i].reasoning)
                _check_unicode(block["thinking"], f"{at}.thinking")
                # Anthropic's opaque string, used for nothing here: any JSON was taken
                _need(block.get("signature") is None or isinstance(block["signature"], str), f"{at}.signature",
                      "a string (the thinking's signature)", block.get("signature"))
                _cache_control(block, at, ignored)
                thoughts.append(block["thinking"])
            elif kind == "redacted_thinking" and role == "assistant":
                _fields(block, at, {"type", "data", "cache_control"})
                _need(isinstance(block.get("data"), str), f"{at}.data", "a string (the encrypted thinking)",
                      block.get("data"))
                ignored.append((at, kind, "thinking encrypted by another provider: the chat template is given none"))
            elif kind == "tool_result" and role == "user":
                messages.append(_tool_result(block, at, calls, ignored))
                sources.append(at)
            else:
                raise BadRequest(f"{at}.type: {kind[:40]!r} is not supported in a{'n' if role == 'assistant' else ''} "
                                 f"{role} message: kvload serves text; accepted: {_BLOCKS[role]}", param=f"{at}.type")
        if role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not uses else None}
            if uses:
                turn["tool_calls"] = uses
            if thoughts:  # as chat's reasoning field: the template sees it as reasoning and reasoning_content
                turn["reasoning"] = "".join(thoughts)
            messages.append(turn)
            sources.append(where)
        elif texts or not content:  # the text after a user turn's tool results (Anthropic puts the results first)
            messages.append({"role": "user", "content": "".join(texts)})
            sources.append(where)
    return messages, sources


def _block_text(block: dict[str, Any], at: str, ignored: list[tuple[str, Any, str]]) -> str:
    _fields(block, at, {"type", "text", "cache_control", "citations"})
    _need(isinstance(block.get("text"), str), f"{at}.text", "a string", block.get("text"))
    _cache_control(block, at, ignored)
    return block["text"]


def _tool_result(block: dict[str, Any], at: str, calls: set[str],
                 ignored: list[tuple[str, Any, str]]) -> dict[str, Any]:
    """A ``tool_result`` block as the chat ``tool`` message answering its ``tool_use_id``."""
    _fields(block, at, {"type", "tool_use_id", "content", "is_error", "cache_control"})
    use = block.get("tool_use_id")
    _need(isinstance(use, str) and bool(use), f"{at}.tool_use_id", "a non-empty string (the tool_use this answers)",
          use)
    if use not in calls:  # Anthropic's rule: the template would get an answer to no question
        raise BadRequest(f"{at}.tool_use_id: no tool_use block before it has id {use[:80]!r}; send the assistant's "
                         "tool_use before its result", param=f"{at}.tool_use_id")
    content = block.get("content")
    text = "" if content is None else _text(content, f"{at}.content", ignored)
    error = block.get("is_error")
    _need(error is None or isinstance(error, bool), f"{at}.is_error", "true or false", error)
    if error:
        ignored.append((f"{at}.is_error", True, "the chat template is given the result's content only (chat tool "
                        "messages carry no error flag)"))
    _cache_control(block, at, ignored)
    return {"role": "tool", "tool_call_id": use, "content": text}


_TOOL = '{"name": ..., "description"?, "input_schema": {...}}'


def _tools(value: Any, ignored: list[tuple[str, Any, str]]) -> list[dict[str, Any]]:
    """Anthropic's client tools as chat's function tools (chat's path checks the rest: names twice, schemas)."""
    if value is None:
        return []
    _need(isinstance(value, list), "tools", f"a list of {_TOOL} objects", value)
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        _need(isinstance(tool, dict), where, f"a {_TOOL} object", tool)
        if tool.get("type") not in (None, "custom"):
            raise BadRequest(f"{where}.type: {str(tool['type'])[:60]!r} is not supported: kvload serves client tools "
                             "(name, description, input_schema; the client runs them); Anthropic's server tools "
                             "(web_search, code_execution, ...) are not served", param=f"{where}.type")
        _fields(tool, where, {"type", "name", "description", "input_schema", "cache_control"})
        _need(isinstance(tool.get("name"), str) and bool(tool["name"]), f"{where}.name", "a non-empty string",
              tool.get("name"))
        _need(tool.get("description") is None or isinstance(tool["description"], str), f"{where}.description",
              "a string", tool.get("description"))
        need_schema(tool.get("input_schema"), f"{where}.input_schema")
        _cache_control(tool, where, ignored)
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


_AUTO_FLAGS = f"--enable-auto-tool-choice --tool-call-parser {'|'.join(TOOL_CALL_PARSERS)}"
_CHOICES = '{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} or {"type": "none"}'


def _tool_choice(value: Any, tools: list[dict[str, Any]], parser: str | None,
                 count: bool = False) -> tuple[Any, bool | None]:
    """Anthropic's ``tool_choice`` as chat's, and ``parallel_tool_calls`` (false for ``disable_parallel_tool_use``).
    "auto" (the default with tools) needs a tool-call parser (but to be ``count``-ed): the model chooses between text
    and calls."""
    if value is None:
        value = {"type": "auto"}
    _need(isinstance(value, dict) and value.get("type") in ("auto", "any", "tool", "none"), "tool_choice", _CHOICES,
          value)
    kind = value["type"]
    _fields(value, "tool_choice", {"type", "name", "disable_parallel_tool_use"} if kind == "tool"
            else {"type", "disable_parallel_tool_use"} if kind != "none" else {"type"})
    serial = value.get("disable_parallel_tool_use")
    _need(serial is None or isinstance(serial, bool), "tool_choice.disable_parallel_tool_use", "true or false", serial)
    parallel = None if serial is None else not serial
    if kind == "auto":
        if tools and parser is None and not count:
            raise BadRequest('tool_choice: "auto" (the default with tools): the model would choose between text and '
                             f"tool calls, which needs a tool-call parser: start kvload serve with {_AUTO_FLAGS} "
                             '(vLLM\'s flags); else pass tool_choice {"type": "any"} or {"type": "tool", "name": ...} '
                             '(the reply is held to tool calls), or {"type": "none"}', param="tool_choice")
        return ("auto" if tools else None), parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    _need(isinstance(value.get("name"), str) and bool(value["name"]), "tool_choice.name", "a non-empty string",
          value.get("name"))
    return {"type": "function", "function": {"name": value["name"]}}, parallel


def _output_config(value: Any, chat: dict[str, Any], ignored: list[tuple[str, Any, str]], count: bool = False) -> None:
    """Anthropic's ``output_config`` (vLLM's too): ``format`` ``{"type": "json_schema", "schema": {...}}`` holds the
    reply to the schema (chat's ``response_format``: structured outputs); ``effort`` is chat's ``reasoning_effort``
    (the chat template's)."""
    if value is None:
        return
    _need(isinstance(value, dict), "output_config", 'an object {"format"?, "effort"?}', value)
    _fields(value, "output_config", {"format", "effort"})
    effort = value.get("effort")
    if effort is not None:
        _need(effort in _EFFORTS, "output_config.effort", ", ".join(f'"{e}"' for e in _EFFORTS[:-1]) +
              f' or "{_EFFORTS[-1]}"', effort)
        chat["reasoning_effort"] = effort  # vLLM's: the chat template's reasoning_effort, as on the chat endpoint
    fmt = value.get("format")
    if fmt is None:
        return
    _need(isinstance(fmt, dict) and fmt.get("type") == "json_schema", "output_config.format",
          '{"type": "json_schema", "schema": {...}}', fmt)
    _fields(fmt, "output_config.format", {"type", "schema"})
    need_schema(fmt.get("schema"), "output_config.format.schema")
    if count:  # the format holds what is generated; the prompt counted is the same
        return
    chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _thinking(value: Any, parser: str | None, ignored: list[tuple[str, Any, str]]) -> None:
    """``thinking``: under ``--reasoning-parser`` the model's thinking is a ``thinking`` block whatever is asked
    (kvload does not switch it on or off, nor bound it); what cannot act is reported."""
    if value is None:
        return
    _need(isinstance(value, dict) and value.get("type") in ("enabled", "disabled", "adaptive"), "thinking",
          '{"type": "enabled", "budget_tokens": N}, {"type": "disabled"} or {"type": "adaptive"}', value)
    _fields(value, "thinking", {"type", "budget_tokens"} if value["type"] == "enabled" else {"type"})
    budget = value.get("budget_tokens")
    if value["type"] == "enabled":
        _need(isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1, "thinking.budget_tokens",
              "an integer of at least 1", budget)
    if parser is None:
        if value["type"] != "disabled":
            ignored.append(("thinking", value["type"], "this server has no --reasoning-parser: a thinking model's "
                            "thinking is part of the text"))
        return
    if value["type"] == "disabled":
        ignored.append(("thinking", "disabled", f"under --reasoning-parser the model's thinking is a thinking block "
                        f"when it thinks; {EFFORT_IGNORED}"))
    elif budget is not None:
        ignored.append(("thinking.budget_tokens", budget, EFFORT_IGNORED))


#: The chat path's names for what a Messages body calls otherwise.
_NAMES = [
    (re.compile(r"'max_tokens' or 'max_completion_tokens'"), "max_tokens"),
    (re.compile(r"\bmax_completion_tokens\b"), "max_tokens"),
    (re.compile(r"\btools\[(\d+)\]\.function\.parameters\b"), r"tools[\1].input_schema"),
    (re.compile(r"\btools\[(\d+)\]\.function\b"), r"tools[\1]"),
    (re.compile(r"\btool_choice\.function\.name\b"), "tool_choice.name"),
    (re.compile(r"\bresponse_format\.json_schema\.schema\b"), "output_config.format.schema"),
    (re.compile(r"\bresponse_format\b"), "output_config.format"),
    (re.compile(r"^stop\b"), "stop_sequences"),
    (re.compile(r"\breasoning_effort\b"), "output_config.effort"),
    (re.compile(r"\bstop\[(\d+)\]"), r"stop_sequences[\1]"),
]
_MESSAGE = re.compile(r"\bmessages\[(\d+)\]")


def renamed(text: str, request: MessagesRequest | None) -> str:
    """``text`` (an error or a setting's name from the chat path) in the Messages body's names: ``messages[i]`` as
    the message or block it came from, ``tools[i].function.parameters`` as ``tools[i].input_schema``, ``stop`` as
    ``stop_sequences``."""
    for pattern, name in _NAMES:
        text = pattern.sub(name, text)

    def origin(m: re.Match[str]) -> str:
        i = int(m.group(1))
        sources = request.sources if request is not None else ()
        return sources[i] if i < len(sources) else m.group(0)

    return _MESSAGE.sub(origin, text)


def renamed_error(exc: BadRequest, request: MessagesRequest | None) -> BadRequest:
    """The chat path's refusal named as the Messages body named it."""
    return renamed_as(exc, lambda text: renamed(text, request))


__all__ = ["ACCEPTED", "COUNT_ACCEPTED", "AnthropicError", "MessagesRequest", "renamed", "renamed_error", "to_chat"]
