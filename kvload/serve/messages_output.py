"""Anthropic's Messages API answer: the message object, and its stream of server-sent events.

A ``/v1/messages`` request runs as a chat request (``kvload.serve.messages_input``); its chat reply becomes the
message's ``content`` blocks: a ``thinking`` block with the thinking (under ``--reasoning-parser``), a ``text`` block,
and a ``tool_use`` block per tool call (its ``input`` the call's arguments, parsed). The chat finish reason becomes
``stop_reason``: ``max_tokens`` (cut by length), ``tool_use`` (a call made), ``stop_sequence`` (one of the request's
``stop_sequences``, named in ``stop_sequence``) or ``end_turn``. A stream sends Anthropic's event sequence:
``message_start``, per block ``content_block_start``, its deltas (``text_delta``, ``thinking_delta``,
``input_json_delta``) and ``content_block_stop``, then ``message_delta`` (stop reason, usage) and ``message_stop``; an
engine failure is an ``error`` event. Anthropic has no stop reason for an answer cut short by the server stopping
(chat's ``abort``), so that is an error too (503 ``overloaded_error``; a stream's ``error`` event), never ``end_turn``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from kvload.serve.messages_input import AnthropicError
from kvload.serve.responses_output import ChatDeltas
from pipeline.json_ints import LongInts, digit_limit, too_long_int

if TYPE_CHECKING:
    from kvload.serve.choices import _Choice
    from kvload.serve.request_run import _Run


def _stop(c: _Choice, called: bool) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished choice (``called``: it made a tool call)."""
    if c.reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(c.stop_reason, str):  # a stop string (a stop token's id is an int: the turn ended)
        return "stop_sequence", c.stop_reason
    return "end_turn", None


#: what an answer the server's stop cut short says: Anthropic's clients take ``end_turn`` for a finished answer
CUT_SHORT = "the server stopped before the answer was finished (it is shutting down); retry on another server"


def _message(run: _Run, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
             output_tokens: int) -> dict[str, Any]:
    return {"id": run.id, "type": "message", "role": "assistant", "model": run.state.model_name, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": {"input_tokens": len(run.prompts[0]), "output_tokens": output_tokens}}


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call as a ``tool_use`` block; arguments cut short by ``max_tokens`` (not JSON yet) as ``{}``, the
    stop reason ``max_tokens`` saying so (Anthropic's ``input`` is an object)."""
    ints = LongInts()
    try:
        arguments = json.loads(call["function"]["arguments"] or "{}", parse_int=ints)
    except json.JSONDecodeError:
        arguments = {}
    found = too_long_int(arguments) if ints.found else None
    if found is not None:  # json's ValueError was a 500 with a traceback; json.dumps could not write it either
        where, digits = found
        raise AnthropicError(f"the model's call of {call['function']['name']!r} holds an integer of {digits:,} digits "
                             f"at {where}, past the {digit_limit():,} a tool_use block's input can hold; ask for a "
                             "stream (its input comes as JSON text) or use /v1/chat/completions (arguments as text)",
                             status=500,
                             kind="server_error", code="output_not_representable")
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": arguments if isinstance(arguments, dict) else {}}


def message_document(run: _Run, chat: dict[str, Any]) -> dict[str, Any]:
    """The message object of a finished run, from its chat completion document ``chat``."""
    (choice,) = chat["choices"]
    message = choice["message"]
    c = run.choices[0]
    if c.reason == "abort":
        raise AnthropicError(CUT_SHORT, status=503, kind="server_error", code="server_shutting_down",
                             headers={"Connection": "close"})
    blocks: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    content, calls = message.get("content"), message.get("tool_calls") or []
    if reasoning is not None and c.thinking is not None:  # qwen3's text before its <think> comes first, as streamed
        read = c.thinking.content or ""
        before = read[:len(read) - len(c.thinking.answer)]
        if before and (content or "").startswith(before):
            blocks.append({"type": "text", "text": before})
            content = content[len(before):]  # type: ignore[index]
    if reasoning is not None:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if content:
        blocks.append({"type": "text", "text": content})
    blocks += [_tool_use(call) for call in calls]
    return _message(run, blocks, _stop(c, bool(calls)), len(c.token_ids))


class _Blocks(ChatDeltas):
    """A stream's content blocks: the one open grows; a new kind (or a new tool call) closes it and opens another."""

    ANSWER, THINKING = "text", "thinking"

    def __init__(self) -> None:
        self.count = 0  # blocks opened
        self.open: str | None = None  # the open block's type
        self.calls: dict[int, int] = {}  # a chat tool call's index → its block's index
        self.thought = False  # a thinking block was opened: text from now on is the answer, after the thinking

    @staticmethod
    def event(kind: str, **fields: Any) -> str:
        """One server-sent event, named as its type."""
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, separators=(',', ':'))}\n\n"

    def close(self) -> list[str]:
        """The open block's ``content_block_stop``."""
        if self.open is None:
            return []
        self.open = None
        return [self.event("content_block_stop", index=self.count - 1)]

    def start(self, block: dict[str, Any]) -> list[str]:
        """Close the open block, open ``block``."""
        out = self.close()
        self.open = block["type"]
        self.count += 1
        out.append(self.event("content_block_start", index=self.count - 1, content_block=block))
        return out

    def text(self, kind: str, piece: str) -> list[str]:
        """``piece`` of thinking (``kind`` "thinking") or answer ("text"): in the open block of that kind, or anew."""
        out: list[str] = []
        if self.open != kind:  # text after a call, or thinking after text: a block of its own
            out += self.start({"type": "text", "text": ""} if kind == "text"
                              else {"type": "thinking", "thinking": "", "signature": ""})
        delta = {"type": "text_delta", "text": piece} if kind == "text" else {"type": "thinking_delta",
                                                                              "thinking": piece}
        out.append(self.event("content_block_delta", index=self.count - 1, delta=delta))
        return out

    def call(self, delta: dict[str, Any]) -> list[str]:
        """One chat tool call delta: a new call opens its ``tool_use`` block; later ones add to its input's JSON."""
        out: list[str] = []
        function = delta.get("function") or {}
        index = self.calls.get(delta["index"])
        if index is None:
            out += self.start({"type": "tool_use", "id": delta["id"], "name": function["name"], "input": {}})
            index = self.calls[delta["index"]] = self.count - 1
        piece = function.get("arguments") or ""
        if piece:
            out.append(self.event("content_block_delta", index=index,
                                  delta={"type": "input_json_delta", "partial_json": piece}))
        return out



async def message_events(run: _Run) -> AsyncIterator[str]:
    """The Messages stream of a run: ``message_start``, the content blocks' events, ``message_delta`` and
    ``message_stop`` (an ``error`` event when the engine failed it). A closed connection cancels it, which aborts
    the run."""
    blocks = _Blocks()
    try:
        yield blocks.event("message_start", message=_message(run, [], (None, None), 0))
        last: _Choice | None = None
        async for c, _update, _finished, delta in run.deltas():
            last = c
            if delta is None:  # the engine failed the request (said once in the operator's log)
                yield blocks.event("error", error={"type": "api_error",
                                                   "message": c.error or "the engine failed this request"})
                return
            for event in blocks.delta(delta):
                yield event
        if last is None or last.finish_reason is None:  # the client went away
            return
        for event in blocks.close():
            yield event
        if last.reason == "abort":  # the server is stopping: no stop reason says so
            yield blocks.event("error", error={"type": "overloaded_error", "message": CUT_SHORT})
            return
        reason, sequence = _stop(last, bool(blocks.calls))
        yield blocks.event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                           usage={"input_tokens": len(run.prompts[0]), "output_tokens": len(last.token_ids)})
        yield blocks.event("message_stop")
    finally:  # a closed connection cancels this generator: free what the run still holds
        run.abort()


__all__ = ["message_document", "message_events"]
