"""OpenAI's Responses API request (``POST /v1/responses``) read as the chat endpoint's body.

A Responses body is checked field by field here, in its own names, then turned into the chat completions body that
says the same (``input`` items → ``messages``, ``instructions`` → a system message first, flat function ``tools`` →
chat's, ``text.format`` → ``response_format``, ``max_output_tokens`` → ``max_completion_tokens``), so that one path
(``kvload.serve.protocol.parse``, templating, sampling, tool calls, the reasoning split, structured outputs, limits)
serves both. What that path then refuses is named back in the Responses body's words (:func:`renamed`). Fields kvload
cannot honour are refused in one line naming them; fields accepted that can change nothing are reported
``setting_ignored``. A ``previous_response_id`` puts the kept response's input items and output first
(``kvload.serve.responses_store``).
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from engine.messages import MessageError, json_text
from kvload.serve.command import TOOL_CALL_PARSERS
from kvload.serve.protocol import (
    EFFORTS,
    MAX_REQUEST_ID_CHARS,
    AsSent,
    BadRequest,
    _check_unicode,
    items_aside,
    need_schema,
    not_an_object,
    openai_hints,
    renamed_as,
)
from kvload.serve.protocol import metadata as _metadata
from kvload.serve.responses_store import ResponseStore, Stored, input_items

#: vLLM's sampling extras on /v1/responses (its ResponsesRequest takes them), passed to the chat path as they are.
_VLLM_SAMPLING = ("seed", "stop", "ignore_eos", "repetition_penalty", "logit_bias", "skip_special_tokens",
                  "include_stop_str_in_output", "structured_outputs")
#: OpenAI's Responses fields kvload acts on or reports, and vLLM's extras it passes to the chat path as they are.
ACCEPTED = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "metadata", "user", "tools",
    "tool_choice", "parallel_tool_calls", "text", "reasoning", "store", "stream", "background", "include",
    "truncation", "service_tier", "previous_response_id", "prompt_cache_key", "prompt_cache_retention",
    "safety_identifier", "stream_options", "max_tool_calls",
    # vLLM's, as on the chat endpoint (the openai client sends them in extra_body)
    "top_k", "cache_salt", "request_id", "priority", "chat_template_kwargs", *_VLLM_SAMPLING,
})
_PASSED = ("model", "temperature", "top_p", "user", "stream", "parallel_tool_calls",
           "top_k", "cache_salt", "request_id", "priority", "chat_template_kwargs", *_VLLM_SAMPLING)


#: Chat completions' names of Responses fields, which a client moving from chat sends: the refusal says the name.
_CHAT_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
               "response_format": "text.format", "reasoning_effort": "reasoning.effort"}

_ROLES = ("user", "system", "developer", "assistant")
_ITEMS = "message, function_call, function_call_output or reasoning"
_SUMMARIES = ("auto", "concise", "detailed")  # OpenAI's reasoning.summary values
_INCLUDABLE = ("reasoning.encrypted_content",)  # agents send it with store=false; a reasoning item carries its text


@attrs.frozen
class ResponsesRequest:
    """What a Responses answer echoes of its request, and where each chat message came from (for error names)."""

    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    text: dict[str, Any]
    reasoning: dict[str, Any] | None
    user: str | None
    #: each chat message's ``input`` index (None: ``instructions``; a name: where else it came from)
    sources: tuple[int | str | None, ...] = ()
    #: settings accepted that change nothing, each (name, value, why)
    ignored: tuple[tuple[str, Any, str], ...] = ()
    previous_response_id: str | None = None
    #: whether the answer is kept (``store``), the input items it is kept with, and the kept response they follow
    store: bool = False
    items: tuple[dict[str, Any], ...] = ()
    previous: Stored | None = None


def _need(ok: bool, field: str, expected: str, value: Any) -> None:
    if not ok:
        raise BadRequest(f"{field}: expected {expected}, got {value!r}"[:300], param=field)


def to_chat(body: Any, tool_parser: str | None = None,
            kept: ResponseStore | None = None) -> tuple[dict[str, Any], ResponsesRequest]:
    """A Responses body as the chat endpoint's body saying the same, and what the answer echoes;
    ``BadRequest`` naming the Responses field. ``kept``: the server's responses (None: none kept), which
    ``previous_response_id`` names and ``store`` adds to."""
    if not isinstance(body, dict):
        raise not_an_object(body)
    unknown = sorted(set(body) - ACCEPTED)
    if unknown:
        name = unknown[0][:80]
        hint = _CHAT_NAMES.get(name)
        raise AsSent(f"{name}: not supported by kvload serve's /v1/responses"
                     + (f" (the Responses API calls it {hint})" if hint else "")
                     + f"; accepted fields: {', '.join(sorted(ACCEPTED))}", param=name)
    ignored: list[tuple[str, Any, str]] = []
    _unserved(body, ignored)
    chat: dict[str, Any] = {k: body[k] for k in _PASSED if body.get(k) is not None}
    instructions = body.get("instructions")
    _need(instructions is None or isinstance(instructions, str), "instructions", "a string", instructions)
    previous, keep = _kept(body, kept, ignored)
    earlier = kept.previous(previous) if kept is not None and previous is not None else None
    carried = earlier.context() if earlier is not None else []
    given = body.get("input")  # a long list of items checked, made messages and (kept) stored in one turn aside

    def read() -> tuple[list[dict[str, Any]], list[int | str | None], tuple[Any, ...]]:
        messages, sources = _input(given, ignored, carried)
        return messages, sources, tuple(input_items(given)) if keep else ()

    messages, sources, items = items_aside(given, read)
    if instructions is not None:  # OpenAI's: a system (developer) message put first
        messages.insert(0, {"role": "system", "content": instructions})
        sources.insert(0, None)
    chat["messages"] = messages
    limit = body.get("max_output_tokens")
    if limit is not None:
        chat["max_completion_tokens"] = limit
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
    choice = _tool_choice(body.get("tool_choice"), tools, tool_parser)
    if choice is not None:
        chat["tool_choice"] = choice
    if tools and choice in (None, "auto"):  # the model chooses, and its arguments are read, not held to a schema
        ignored += [(f"tools[{i}].strict", True, 'tool_choice "auto": the model\'s arguments are read as written, '
                     'not held to the schema (tool_choice "required" or a named function holds them)')
                    for i, t in enumerate(tools) if t.get("strict")]
    text = _text(body.get("text"), ignored)
    if text["format"]["type"] != "text":
        fmt = text["format"]
        chat["response_format"] = {"type": "json_object"} if fmt["type"] == "json_object" else {
            "type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    effort = (body.get("reasoning") or {}).get("effort")  # checked by _unserved
    if effort is not None:  # vLLM's: the chat template's reasoning_effort, as on the chat endpoint
        chat["reasoning_effort"] = effort
    metadata = _metadata(body.get("metadata"))
    parallel = body.get("parallel_tool_calls")
    echo = ResponsesRequest(instructions=instructions, max_output_tokens=limit, metadata=metadata, tools=tools,
                            tool_choice=body.get("tool_choice") or "auto",
                            parallel_tool_calls=True if parallel is None else parallel, text=text,
                            reasoning=body.get("reasoning"), user=body.get("user"), sources=tuple(sources),
                            ignored=tuple(ignored), previous_response_id=previous, store=keep,
                            items=items,
                            previous=earlier)
    return chat, echo


def _kept(body: dict[str, Any], kept: ResponseStore | None,
          ignored: list[tuple[str, Any, str]]) -> tuple[str | None, bool]:
    """``previous_response_id`` (checked a string) and whether the answer is kept: ``store`` (absent: true, OpenAI's
    default) on a server that keeps responses; ``store: true`` on one that keeps none is reported."""
    previous = body.get("previous_response_id")
    _need(previous is None or (isinstance(previous, str) and bool(previous)), "previous_response_id",
          "a response id (a non-empty string)", previous)
    store = body.get("store")
    _need(store is None or isinstance(store, bool), "store", "true or false", store)
    on = kept is not None and kept.enabled
    if store and not on:
        ignored.append(("store", True, "this server keeps no responses (--responses-store-max 0)"))
    return previous, on and store is not False


def _unserved(body: dict[str, Any], ignored: list[tuple[str, Any, str]]) -> None:
    """OpenAI's fields about where and how a response is kept and run: refused past what kvload does, or reported."""
    background = body.get("background")
    _need(background is None or isinstance(background, bool), "background", "true or false", background)
    if background:
        raise BadRequest("background: true is not supported: kvload serve answers in the request (stream: true sends "
                         "the answer as it is generated); send false or leave it out", param="background")
    most = body.get("max_tool_calls")  # OpenAI's bound on its built-in tools' calls (web search, file search, ...)
    _need(most is None or (isinstance(most, int) and not isinstance(most, bool) and most >= 1), "max_tool_calls",
          "an integer >= 1", most)
    if most is not None:
        ignored.append(("max_tool_calls", most, "it bounds calls of OpenAI's built-in tools, which kvload has none of "
                        "(function calls are the client's to run)"))
    include = body.get("include")
    _need(include is None or (isinstance(include, list) and all(isinstance(i, str) for i in include)), "include",
          "a list of strings", include)
    for value in include or []:
        if value not in _INCLUDABLE:
            raise BadRequest(f"include: {value[:80]!r} is not supported; accepted: {', '.join(_INCLUDABLE)} (a "
                             "reasoning item carries its text in content, never encrypted)", param="include")
        ignored.append(("include", value, "a reasoning item carries its text in content; kvload encrypts nothing"))
    truncation = body.get("truncation")
    _need(truncation in (None, "disabled"), "truncation", '"disabled" (kvload drops no input items: an input past the '
          "context length is a 400)", truncation)
    openai_hints(body, ignored)  # service_tier, prompt_cache_key and _retention, safety_identifier: as chat
    options = body.get("stream_options")
    _need(options is None or isinstance(options, dict), "stream_options", "an object", options)
    if options:
        unknown = sorted(set(options) - {"include_obfuscation"})
        if unknown:
            raise BadRequest(f"stream_options.{unknown[0]!s:.80}: not supported; accepted: include_obfuscation",
                             param="stream_options")
        obfuscation = options["include_obfuscation"]
        _need(isinstance(obfuscation, bool), "stream_options.include_obfuscation", "true or false", obfuscation)
        ignored.append(("stream_options.include_obfuscation", obfuscation,
                        "kvload's stream events carry no obfuscation padding"))
    reasoning = body.get("reasoning")
    if reasoning is None:
        return
    _need(isinstance(reasoning, dict) and set(reasoning) <= {"effort", "summary", "generate_summary"}, "reasoning",
          'an object {"effort"?, "summary"?}', reasoning)
    for key in ("effort", "summary", "generate_summary"):
        value = reasoning.get(key)
        accepted = EFFORTS if key == "effort" else _SUMMARIES  # as OpenAI (and chat's reasoning_effort) take them
        _need(value is None or value in accepted, f"reasoning.{key}",
              ", ".join(f'"{a}"' for a in accepted[:-1]) + f' or "{accepted[-1]}"', value)
        if value is not None and key != "effort":  # the effort is chat's reasoning_effort (to_chat)
            ignored.append((f"reasoning.{key}", value,
                            "a reasoning item carries the thinking itself (its content), never a summary"))


def _text_of(parts: Any, field: str, kinds: tuple[str, ...]) -> str:
    """A content list's text: its parts of ``kinds`` joined; anything else (an image, a file) refused."""
    _need(isinstance(parts, list), field, f"a string or a list of {', '.join(kinds)} parts", parts)
    out = []
    for j, part in enumerate(parts):
        where = f"{field}[{j}]"
        _need(isinstance(part, dict) and isinstance(part.get("type"), str), where, "a content part with a type", part)
        if part["type"] not in kinds:
            raise BadRequest(f"{where}.type: {part['type'][:40]!r} is not supported: kvload serves text; accepted: "
                             f"{', '.join(kinds)}", param=where)
        _need(isinstance(part.get("text"), str), f"{where}.text", "a string", part.get("text"))
        out.append(part["text"])
    return "".join(out)


def _input(value: Any, ignored: list[tuple[str, Any, str]],
           carried: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int | str | None]]:
    """``input`` as chat messages (a string: one user message), after the ``carried`` items of
    ``previous_response_id``, and the item each came from. An assistant's
    ``function_call`` items join its message (or make one) as its ``tool_calls``; a ``function_call_output`` is a
    ``tool`` message answering its ``call_id`` (a ``function_call`` item before it must have it, as OpenAI
    requires); a ``reasoning`` item (a past answer's thinking) is the ``reasoning`` of the assistant turn the items
    after it make (vLLM's rule), reported when no such turn follows or it holds no text."""
    if value is None:
        raise BadRequest("input: required: a string, or a list of items (messages, function_call, "
                         "function_call_output)", param="input")
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    _need(isinstance(value, list) and bool(value), "input", "a string or a non-empty list of items", value)
    messages: list[dict[str, Any]] = []
    sources: list[int | str | None] = []
    calls: set[str] = set()  # the call_ids of the function_call items so far: what an output may answer
    turn = False  # the last message is an assistant turn that items of the same reply still join
    thinking: tuple[str, str] | None = None  # (where, text): a reasoning item's, for the assistant turn after it
    for k, item in enumerate([*carried, *value], -len(carried)):
        where = f"input[{k}]" if k >= 0 else "previous_response_id"  # a kept item was checked when it was sent
        _need(isinstance(item, dict), where, f"an item ({_ITEMS})", item)
        kind = item.get("type", "message" if "role" in item else None)
        if k >= 0 and kind in ("message", "function_call", "function_call_output", "reasoning"):
            _item_meta(item, where, kind)
        if thinking is not None and kind != "reasoning" and not (
                kind == "function_call" or (kind == "message" and item.get("role") == "assistant")):
            _unattached(thinking, ignored)
            thinking = None
        if kind == "message":
            _fields(item, where, {"type", "role", "content", "id", "status", "phase"})
            role = item.get("role")
            _need(role in _ROLES, f"{where}.role", ", ".join(_ROLES), role)
            content = item.get("content")
            if not isinstance(content, str):
                content = _text_of(content, f"{where}.content", ("output_text",) if role == "assistant"
                                   else ("input_text", "output_text"))
            joins = turn and role == "assistant" and messages[-1]["content"] is None
            turn = role == "assistant"
            if joins:  # a reply's text after its calls: one assistant turn
                messages[-1]["content"] = content
                thinking = _think(messages[-1], thinking)
                continue
            messages.append({"role": role, "content": content})
            if role == "assistant":
                thinking = _think(messages[-1], thinking)
        elif kind == "function_call":
            _fields(item, where, {"type", "call_id", "name", "arguments", "id", "status"})
            for key in ("call_id", "name", "arguments"):
                _need(isinstance(item.get(key), str) and (key == "arguments" or bool(item[key])), f"{where}.{key}",
                      "a string" if key == "arguments" else "a non-empty string", item.get(key))
            if item["arguments"].strip():  # checked here: the chat path would name its own message's tool_calls[j]
                try:
                    json_text(f"{where}.arguments", item["arguments"])
                except MessageError as exc:
                    raise BadRequest(str(exc), param=exc.field) from None
            calls.add(item["call_id"])
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if turn:  # the calls of one reply (after its text, if any): one assistant turn
                messages[-1].setdefault("tool_calls", []).append(call)
                thinking = _think(messages[-1], thinking)
                continue
            turn = True
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            thinking = _think(messages[-1], thinking)
        elif kind == "function_call_output":
            _fields(item, where, {"type", "call_id", "output", "id", "status"})
            _need(isinstance(item.get("call_id"), str) and bool(item["call_id"]), f"{where}.call_id",
                  "a non-empty string (the call this answers)", item.get("call_id"))
            if item["call_id"] not in calls:  # OpenAI's rule: the template would get an answer to no question
                raise BadRequest(f"{where}.call_id: no function_call item before it has call_id "
                                 f"{item['call_id'][:80]!r}; send the call (the previous response's function_call "
                                 "item) before its output", param=f"{where}.call_id")
            output = item.get("output")
            if not isinstance(output, str):
                output = _text_of(output, f"{where}.output", ("input_text",))
            # named here: the chat path would name the tool message it becomes ("input[k].content", param "input")
            _check_unicode(output, f"{where}.output")
            turn = False
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":  # the thinking of the reply whose items follow: that assistant turn's reasoning
            _fields(item, where, {"type", "id", "summary", "content", "encrypted_content", "status"})
            text = _reasoning_text(item)
            if text is None:
                if k >= 0:  # a kept response's item always has its text
                    why = ("only encrypted_content, which another provider encrypted" if item.get("encrypted_content")
                           else "its summary and content are empty")
                    ignored.append((where, "reasoning", f"it holds no text ({why}): the chat template is given none"))
                continue
            # vLLM's rule: the reply's thinking is its assistant message's reasoning (an agent's tool loop needs it)
            thinking = (where, text if thinking is None else f"{thinking[1]}\n{text}")
            continue
        else:
            raise BadRequest(f"{where}.type: {kind!r} is not supported; accepted items: {_ITEMS}"[:300],
                             param=f"{where}.type")
        sources.append(k if k >= 0 else "previous_response_id")
    if thinking is not None:
        _unattached(thinking, ignored)
    if not messages:
        raise BadRequest("input: holds no message (only reasoning items); give the conversation", param="input")
    return messages, sources


def _reasoning_text(item: dict[str, Any]) -> str | None:
    """A reasoning item's thinking: its ``content`` parts' text (the whole thinking, as kvload's replies give it),
    else its ``summary`` parts' (what OpenAI's replies give); None when it has neither (only encrypted content)."""
    for key in ("content", "summary"):
        parts = [p["text"] for p in item.get(key) or () if p["text"]]
        if parts:
            return "\n".join(parts)
    return None


def _unattached(thinking: tuple[str, str], ignored: list[tuple[str, Any, str]]) -> None:
    """Report a reasoning item that no assistant turn follows (one a kept response carried is not the client's)."""
    if thinking[0] != "previous_response_id":
        ignored.append((thinking[0], "reasoning", "no assistant message or function_call follows it: the thinking "
                        "belongs to no turn, so the chat template is given none"))


def _think(turn: dict[str, Any], thinking: tuple[str, str] | None) -> None:
    """Give the assistant ``turn`` the pending reasoning item's text (chat's ``reasoning`` field); nothing pending
    after it."""
    if thinking is not None:
        turn["reasoning"] = thinking[1] if "reasoning" not in turn else f"{turn['reasoning']}\n{thinking[1]}"


_STATUSES = ("in_progress", "completed", "incomplete")  # an item's status, as OpenAI's types have it
_PHASES = ("commentary", "final_answer")  # an assistant message's phase
_REASONING_PARTS = {"summary": "summary_text", "content": "reasoning_text"}


def _item_meta(item: dict[str, Any], where: str, kind: str) -> None:
    """An item's ``id``, ``status`` (and a message's ``phase``, a reasoning item's parts) in OpenAI's shapes: they are
    kept and listed back (``input_items``) as sent, and a status of any JSON made the list one the openai client
    could not read."""
    item_id = item.get("id")
    # printable, as request_id: a lone surrogate was kept, and every input_items listing of it failed to encode (500)
    _need(item_id is None or (isinstance(item_id, str) and 1 <= len(item_id) <= MAX_REQUEST_ID_CHARS
                              and item_id.isprintable()),
          f"{where}.id", f"a string of 1 to {MAX_REQUEST_ID_CHARS} printable characters", item_id)
    _need(item.get("status") in (None, *_STATUSES), f"{where}.status", " or ".join(map(repr, _STATUSES)),
          item.get("status"))
    if kind == "message":
        _need(item.get("phase") in (None, *_PHASES), f"{where}.phase", " or ".join(map(repr, _PHASES)),
              item.get("phase"))
    if kind != "reasoning":
        return
    for key, part in _REASONING_PARTS.items():
        parts = item.get(key)
        ok = parts is None or (isinstance(parts, list) and all(
            isinstance(p, dict) and p.get("type") == part and isinstance(p.get("text"), str) and set(p) <= {"type",
                                                                                                        "text"}
            for p in parts))
        _need(ok, f"{where}.{key}", f'a list of {{"type": "{part}", "text": ...}} parts', parts)
        # kept and listed back as sent: a lone surrogate (in thinking no template renders, or one no assistant turn
        # follows) was served, and every input_items listing of the response failed to encode it (500)
        _check_unicode(parts, f"{where}.{key}")
    encrypted = item.get("encrypted_content")
    _need(encrypted is None or isinstance(encrypted, str), f"{where}.encrypted_content", "a string", encrypted)
    _check_unicode(encrypted, f"{where}.encrypted_content")


def _fields(item: dict[str, Any], where: str, allowed: set[str]) -> None:
    extra = sorted(str(key) for key in item if key not in allowed and item[key] is not None)
    if extra:
        raise BadRequest(f"{where}.{extra[0][:60]}: not supported on a {item.get('type', 'message')} item; accepted: "
                         f"{', '.join(sorted(allowed))}", param=f"{where}.{extra[0][:60]}")


_TOOL = '{"type": "function", "name": ..., "description"?, "parameters"?, "strict"?}'


def _tools(value: Any) -> list[dict[str, Any]]:
    """Responses' flat function tools, checked (chat's path checks the rest: names twice, schemas)."""
    if value is None:
        return []
    _need(isinstance(value, list), "tools", f"a list of {_TOOL} objects", value)
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        _need(isinstance(tool, dict), where, f"a {_TOOL} object", tool)
        if tool.get("type") != "function":
            raise BadRequest(f"{where}.type: {tool.get('type')!r} is not supported: kvload serves function tools "
                             "(the client runs them); OpenAI's built-in tools (web_search, file_search, mcp, ...) "
                             "are not served"[:300], param=f"{where}.type")
        _fields(tool, where, {"type", "name", "description", "parameters", "strict"})
        _need(isinstance(tool.get("name"), str) and bool(tool["name"]), f"{where}.name", "a non-empty string",
              tool.get("name"))
        _need(tool.get("description") is None or isinstance(tool["description"], str), f"{where}.description",
              "a string", tool.get("description"))
        need_schema(tool.get("parameters"), f"{where}.parameters", optional=True)
        _need(tool.get("strict") is None or isinstance(tool["strict"], bool), f"{where}.strict", "true or false",
              tool.get("strict"))
    return [{k: v for k, v in tool.items() if v is not None} for tool in value]


_AUTO_FLAGS = f"--enable-auto-tool-choice --tool-call-parser {'|'.join(TOOL_CALL_PARSERS)}"
_CHOICES = '"none", "auto", "required" or {"type": "function", "name": ...}'


def _tool_choice(value: Any, tools: list[dict[str, Any]], parser: str | None) -> Any:
    """Responses' ``tool_choice`` as chat's: ``"auto"`` (OpenAI's default) needs a tool-call parser when there are
    tools to call (with none there is nothing to choose); a named function is chat's ``{"function": {"name"}}``."""
    if value in (None, "auto"):
        if tools and parser is None:
            raise BadRequest('tool_choice: "auto" (the default with tools): the model would choose between text '
                             f"and tool calls, which needs a tool-call parser: start kvload serve with {_AUTO_FLAGS} "
                             '(vLLM\'s flags); else pass tool_choice "required" or {"type": "function", "name": ...} '
                             '(the reply is held to tool calls), or "none" (the tools are only shown to the chat '
                             "template)", param="tool_choice")
        return "auto" if tools else None
    if value in ("none", "required"):
        return value
    _need(isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "name"}
          and isinstance(value["name"], str) and bool(value["name"]), "tool_choice", _CHOICES, value)
    return {"type": "function", "function": {"name": value["name"]}}


_FORMATS = ('{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name": ..., "schema": {...}, '
            '"strict"?, "description"?}')


def _text(value: Any, ignored: list[tuple[str, Any, str]]) -> dict[str, Any]:
    """``text``: its ``format`` (default text), checked; ``verbosity`` reported as ``setting_ignored``."""
    if value is None:
        return {"format": {"type": "text"}}
    _need(isinstance(value, dict) and set(value) <= {"format", "verbosity"}, "text",
          'an object {"format"?, "verbosity"?}', value)
    if value.get("verbosity") is not None:
        _need(value["verbosity"] in ("low", "medium", "high"), "text.verbosity", '"low", "medium" or "high"',
              value["verbosity"])
        ignored.append(("text.verbosity", value["verbosity"], "kvload does not steer how long an answer is "
                        "(max_output_tokens bounds it)"))
    fmt = value.get("format")
    fmt = {"type": "text"} if fmt is None else fmt  # 0, "", false and {} are no format: refused, never plain text
    _need(isinstance(fmt, dict), "text.format", _FORMATS, fmt)
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        _need(set(fmt) == {"type"}, "text.format", _FORMATS, fmt)
    elif kind == "json_schema":
        extra = sorted(set(fmt) - {"type", "name", "schema", "strict", "description"})
        if extra:
            raise BadRequest(f"text.format.{extra[0][:60]}: not supported; accepted: type, name, schema, strict, "
                             "description", param="text.format")
        _need(isinstance(fmt.get("name"), str) and bool(fmt["name"]), "text.format.name", "a non-empty string",
              fmt.get("name"))
        need_schema(fmt.get("schema"), "text.format.schema")
        _check_unicode(fmt, "text.format")  # echoed in the answer, whose UTF-8 a lone surrogate in its name failed
        fmt = {k: v for k, v in fmt.items() if v is not None}
    else:
        raise BadRequest(f"text.format: type {kind!r} is not supported; expected {_FORMATS}"[:400], param="text.format")
    return {**value, "format": fmt}


#: The chat path's names for what a Responses body calls otherwise (the first match of each spot wins).
_NAMES = [
    (re.compile(r"'max_tokens' or 'max_completion_tokens'"), "max_output_tokens"),
    (re.compile(r"(?<![-\w])max_(?:completion_)?tokens\b"), "max_output_tokens"),  # not the --max_tokens flag
    (re.compile(r"\bresponse_format\.json_schema\.schema\b"), "text.format.schema"),
    (re.compile(r"\bresponse_format\.json_schema\b"), "text.format"),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"\btools\[(\d+)\]\.function\b"), r"tools[\1]"),
    (re.compile(r"\btool_choice\.function\.name\b"), "tool_choice.name"),
    (re.compile(r"\breasoning_effort\b"), "reasoning.effort"),
]
_MESSAGE = re.compile(r"\bmessages\[(\d+)\]")


def renamed(text: str, request: ResponsesRequest | None) -> str:
    """``text`` (an error or a setting's name from the chat path) in the Responses body's names: ``messages[i]`` as
    the ``input`` item (or ``instructions``) it came from, ``max_tokens`` as ``max_output_tokens``,
    ``response_format`` as ``text.format``, ``tools[i].function`` as ``tools[i]``."""
    for pattern, name in _NAMES:
        text = pattern.sub(name, text)

    def item(m: re.Match[str]) -> str:
        i = int(m.group(1))
        sources = request.sources if request is not None else ()
        source = sources[i] if i < len(sources) else i
        return "instructions" if source is None else source if isinstance(source, str) else f"input[{source}]"

    text = _MESSAGE.sub(item, text)
    return re.sub(r"\bmessages\b", "input", text)


def renamed_error(exc: BadRequest, request: ResponsesRequest | None) -> BadRequest:
    """The chat path's refusal named as the Responses body named it."""
    return renamed_as(exc, lambda text: renamed(text, request))


__all__ = ["ACCEPTED", "ResponsesRequest", "renamed", "renamed_error", "to_chat"]
