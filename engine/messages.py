"""Chat messages as OpenAI clients send them → what a chat template takes: one set of checks for ``kvload serve``'s
``/v1/chat/completions`` (and ``/tokenize``) and ``LLM.chat``.

An agent's next turn sends back the assistant's message with its ``tool_calls`` (and its ``reasoning``, for
interleaved thinking) and each tool's answer as ``{"role": "tool", "tool_call_id", "content"}``; a message the
openai client built and ``model_dump()``ed has ``refusal``, ``audio``, ``annotations``, ``function_call`` as null,
which count as absent. Each call's
``function.arguments`` JSON text reaches the template parsed to its value, as vLLM passes it (tool-use templates
write ``arguments | tojson``). Every problem is a :class:`MessageError` naming the field as the server names it
(``messages[1].tool_calls[0].function.arguments``); each caller words it as its errors are worded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from engine.content_format import PartedMessage
from engine.prompts import ROLES, check_text, is_conversation, lone_surrogate
from pipeline.errors import GenerationError
from pipeline.json_ints import LongInts, too_long_int, too_long_message
from pipeline.limits import MAX_DEPTH, json_depth, short_py, unique_keys

#: The fields a message of each role may carry besides role, content and name (an agent's turn sends them back).
CARRIED = {"assistant": ("tool_calls", "reasoning", "reasoning_content"), "tool": ("tool_call_id",)}
#: Whose field one carried elsewhere is, for the refusal.
_WHOSE = {"tool_calls": " (an assistant message's)", "reasoning": " (an assistant message's)",
          "reasoning_content": " (an assistant message's)", "tool_call_id": " (a tool message's)"}


class MessageError(GenerationError):
    """A chat message refused: ``field`` names where (``messages[1].role``), the message begins with it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}"[:300])
        self.field = field


def _need(ok: bool, field: str, expected: str, value: Any) -> None:
    if not ok:
        raise MessageError(field, f"expected {expected}, got {short_py(value)}")


def chat_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Each message of a conversation as the chat template gets it (:func:`chat_message`)."""
    return [chat_message(i, m) for i, m in enumerate(messages)]


def chat_message(i: int, m: Any) -> dict[str, Any]:
    """Message ``i`` checked and as the chat template gets it: role (``developer`` read as ``system``), content (a
    string; text parts joined by newlines, as vLLM joins them; an assistant's null is ``""``; the parts as sent kept
    too, for the "openai" content format), and the name, tool calls, reasoning and tool call id it carries;
    ``MessageError`` naming the field."""
    _need(isinstance(m, Mapping) and isinstance(m.get("role"), str), f"messages[{i}]", "an object with a string role",
          m)
    _need(m["role"] in ROLES, f"messages[{i}].role", f"{', '.join(ROLES[:-1])} or {ROLES[-1]}", m["role"])
    content = m.get("content")
    parts: list[str] | None = None  # as sent, for a template that reads the parts ("openai" content format)
    if content is None and m["role"] == "assistant":  # OpenAI's assistant turn that only called tools
        content, parts = "", []
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]: text parts only
        parts = []
        for j, part in enumerate(content):
            _need(isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str),
                  f"messages[{i}].content[{j}]", 'a {"type": "text", "text": ...} part (text only)', part)
            parts.append(part["text"])
        content = "\n".join(parts)  # vLLM's (and TensorRT-LLM's) join of text parts for a string-content template
    _need(isinstance(content, str), f"messages[{i}].content", "a string or a list of text parts", content)
    carried = CARRIED.get(m["role"], ())
    # null is "not given": a message the openai client built, model_dump()ed, has refusal, audio, ... as null
    extra = sorted(str(k) for k in m if k not in ("role", "content", "name", *carried) and m[k] is not None)
    if extra:
        raise MessageError(f"messages[{i}].{extra[0][:80]}", f"not supported{_WHOSE.get(extra[0], '')}; a message has "
                           f"role, content, name{''.join(', ' + c for c in carried)}")
    message: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
    if m.get("tool_calls") not in (None, []):  # [] or null: a plain assistant turn (vLLM drops an empty list too);
        message["tool_calls"] = tool_calls(f"messages[{i}].tool_calls", m["tool_calls"])  # false or {}: refused
    if m.get("tool_call_id") is not None:
        _need(isinstance(m["tool_call_id"], str) and lone_surrogate(m["tool_call_id"]) is None,
              f"messages[{i}].tool_call_id", "a string (the id of the call this answers)", m["tool_call_id"])
        message["tool_call_id"] = m["tool_call_id"]
    reasoning = _reasoning(i, m)
    if reasoning is not None:  # by vLLM's two names: Qwen3's template reads reasoning_content, newer ones reasoning
        message["reasoning"] = message["reasoning_content"] = reasoning
    if m.get("name") is not None:  # passed to the chat template, as vLLM's llm.chat does (templates that use it act)
        _need(isinstance(m["name"], str) and lone_surrogate(m["name"]) is None, f"messages[{i}].name",
              "a string of valid Unicode text", m["name"])
        message["name"] = m["name"]
    return message if parts is None else PartedMessage(message, [{"type": "text", "text": t} for t in parts])


def _reasoning(i: int, m: Mapping[str, Any]) -> str | None:
    """An assistant message's earlier thinking sent back (interleaved thinking): ``reasoning`` (vLLM's name) or
    ``reasoning_content`` (its older one, DeepSeek's); both only when they agree."""
    given = {k: m[k] for k in ("reasoning", "reasoning_content") if m.get(k) is not None}
    for key, value in given.items():
        _need(isinstance(value, str) and lone_surrogate(value) is None, f"messages[{i}].{key}",
              "a string of valid Unicode text (the assistant's reasoning)", value)
    if len(set(given.values())) > 1:
        raise MessageError(f"messages[{i}].reasoning_content", "differs from reasoning (send one of them)")
    return next(iter(given.values()), None)


def tool_calls(field: str, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as the chat template gets them: OpenAI's ``[{"id", "type": "function",
    "function": {"name", "arguments"}}]`` with each ``arguments`` JSON text parsed to its value (vLLM's: tool-use
    templates write ``arguments | tojson``; empty arguments are ``{}``)."""
    shape = '[{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<JSON text>"}}, ...]'
    _need(isinstance(calls, list), field, shape, calls)
    out = []
    for k, call in enumerate(calls):
        at = f"{field}[{k}]"
        _need(isinstance(call, Mapping) and call.get("type", "function") == "function"
              and isinstance(call.get("function"), Mapping), at, '{"id": ..., "type": "function", "function": '
              '{"name": ..., "arguments": ...}}', call)
        # index: a streamed call's place, kept by clients that join the deltas into the message they send back
        unknown = sorted(set(call) - {"id", "type", "function", "index"}) or sorted(set(call["function"]) - {
            "name", "arguments"})
        if unknown:
            raise MessageError(at, f"{unknown[0]}: not part of a tool call (id, type, function.name, "
                               "function.arguments)")
        if call.get("id") is not None:
            _need(isinstance(call["id"], str) and lone_surrogate(call["id"]) is None, f"{at}.id", "a string",
                  call["id"])
        name = call["function"].get("name")
        _need(isinstance(name, str) and bool(name) and lone_surrogate(name) is None, f"{at}.function.name",
              "the called function's name (a non-empty string)", name)
        arguments = call["function"].get("arguments")
        if isinstance(arguments, str) and arguments.strip():
            arguments = json_text(f"{at}.function.arguments", arguments)
        elif arguments is None or arguments == "":
            arguments = {}
        else:  # vLLM takes an object as it is; anything else is no arguments
            _need(isinstance(arguments, Mapping), f"{at}.function.arguments", "JSON text (a string) or an object",
                  arguments)
        out.append({**call, "type": "function", "function": {"name": name, "arguments": arguments}})
    return out


def json_text(field: str, text: str) -> Any:
    """The value of standard JSON ``text`` (no NaN or Infinity, no key twice, nesting bounded) or a
    ``MessageError`` naming ``field``."""
    if json_depth(text.encode("utf-8", "surrogatepass")) > MAX_DEPTH:
        raise MessageError(field, f"nested deeper than {MAX_DEPTH} levels")

    def no_constant(word: str) -> Any:
        raise ValueError(f"{word} is not standard JSON")

    ints = LongInts()  # a 5,000-digit integer was "expected JSON text (Exceeds the limit (4300 digits) ... t)"
    try:
        value = json.loads(text, parse_constant=no_constant, object_pairs_hook=unique_keys(ValueError), parse_int=ints)
    except ValueError as exc:
        raise MessageError(field, f"expected JSON text ({str(exc).splitlines()[0][:120]})") from None
    found = too_long_int(value) if ints.found else None
    if found is not None:
        where, digits = found
        raise MessageError(field, f"{where + ': ' if where else ''}{too_long_message(digits)}")
    return value


def check_messages(where: str, messages: Any) -> list[dict[str, Any]]:
    """A conversation checked as the server's ``/v1/chat/completions`` takes it (:func:`chat_messages`), its content
    valid Unicode; ``GenerationError`` naming ``where`` (``prompt 0``) and the field."""
    if not is_conversation(messages):
        raise GenerationError(f"generate: {where}: expected a conversation (a non-empty list of "
                              f"{{'role': ..., 'content': ...}} messages), got {short_py(messages)}")
    try:
        out = chat_messages(messages)
    except MessageError as exc:
        raise GenerationError(f"generate: {where}: {exc}") from None
    for j, m in enumerate(out):
        check_text(f"{where}: messages[{j}].content", m["content"])
    return out


__all__ = ["CARRIED", "MessageError", "chat_message", "chat_messages", "check_messages", "json_text", "tool_calls"]
