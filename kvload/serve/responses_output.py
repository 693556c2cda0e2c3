"""OpenAI's Responses API answer: the response object, and its stream of server-sent events.

A ``/v1/responses`` request runs as a chat request (``kvload.serve.responses_input``); its chat reply becomes the
response's ``output`` items: a ``reasoning`` item with the thinking (under ``--reasoning-parser``), a ``message``
with one ``output_text`` part, and a ``function_call`` item per tool call. A stream sends the Responses event
sequence, each event with its ``sequence_number``: ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, its content part and text deltas (``response.reasoning_text.delta``,
``response.output_text.delta``, ``response.function_call_arguments.delta``) and their ``.done`` events, then
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it, ``response.failed`` when the
engine failed it), as OpenAI sends them. The response an answer ends with is kept when its request said so
(``store``, ``kvload.serve.responses_store``).
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from kvload.serve.responses_store import Stored

if TYPE_CHECKING:
    from kvload.serve.choices import _Choice
    from kvload.serve.request_run import _Run

#: A chat finish reason as the response's status.
_STATUS = {"stop": "completed", "tool_calls": "completed", "length": "incomplete", "abort": "cancelled"}
#: a response's statuses whose last item was cut short: that item is "incomplete" (by max_output_tokens, or the
#: server's stop), never "completed"
_CUT = ("incomplete", "cancelled")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_document(run: _Run, chat: dict[str, Any]) -> dict[str, Any]:
    """The response object of a finished run, from its chat completion document ``chat``."""
    (choice,) = chat["choices"]
    message = choice["message"]
    status = _STATUS.get(choice["finish_reason"], "completed")
    items: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    content, calls = message.get("content"), message.get("tool_calls") or []
    thinking = run.choices[0].thinking
    if reasoning is not None and thinking is not None:  # qwen3's text before its <think> comes first, as streamed
        read = thinking.content or ""
        before = read[:len(read) - len(thinking.answer)]
        if before and (content or "").startswith(before):
            items.append(_message_item(_id("msg"), before, "completed"))
            content = content[len(before):]  # type: ignore[index]
    if reasoning is not None:
        items.append(_reasoning_item(_id("rs"), reasoning, "completed"))
    if content or (not calls and not items):  # a reply with nothing in it is still a message
        items.append(_message_item(_id("msg"), content or "", "completed"))
    items += [_call_item(_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"],
                         "completed") for call in calls]
    if status in _CUT and items:  # the last item is the one cut short
        items[-1]["status"] = "incomplete"
    return _kept(run, _response(run, status, items, run.choices[0]))


def in_progress(run: _Run) -> Stored:
    """The kept response ``run`` will answer, as it stands while it is generated: ``status: "in_progress"``, no
    usage, and its output so far (a stream's items as written, the open one growing; none for an answer sent
    whole)."""
    req = run.responses
    assert req is not None
    return Stored(_response(run, "in_progress", copy.deepcopy(run.streamed), None), req.items, req.previous)


def _kept(run: _Run, doc: dict[str, Any]) -> dict[str, Any]:
    """``doc``, the whole response as answered, kept when its request asked for that (``store``)."""
    req = run.responses
    assert req is not None
    if req.store:
        run.state.responses.put(doc, req.items, req.previous)
    return doc


def _response(run: _Run, status: str, output: list[dict[str, Any]], c: _Choice | None,
              error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The response object: the request's echo, ``output`` and (``c``: the finished choice) its usage."""
    req, params = run.responses, run.job.params
    assert req is not None
    usage = None
    if c is not None:
        usage = {"input_tokens": c.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": c.reused, "cache_write_tokens": 0},
                 "output_tokens": len(c.token_ids),
                 "output_tokens_details": {"reasoning_tokens": c.reasoning_tokens},
                 "total_tokens": c.prompt_tokens + len(c.token_ids)}
    return {"id": run.id, "object": "response", "created_at": run.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "metadata": req.metadata,
            "model": run.state.model_name, "output": output, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "reasoning": req.reasoning, "service_tier": "default",
            "store": req.store,
            "temperature": params.temperature, "text": req.text, "tool_choice": req.tool_choice, "tools": req.tools,
            "top_p": params.top_p, "truncation": "disabled", "usage": usage, "user": req.user, "background": False}


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_output_text(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class ChatDeltas:
    """Reads chat's streamed deltas as a stream's events (the Responses and Messages APIs' streams): answer text,
    thinking text and tool-call pieces, each through the subclass's :meth:`text` and :meth:`call`, the two kinds of
    text named by :attr:`ANSWER` and :attr:`THINKING`."""

    ANSWER: str
    THINKING: str
    thought = False  # thinking was opened: text from now on is the answer, after the thinking

    def text(self, kind: str, piece: str) -> list[str]:
        """The events of ``piece`` of text of ``kind`` (:attr:`ANSWER` or :attr:`THINKING`)."""
        raise NotImplementedError

    def call(self, delta: dict[str, Any]) -> list[str]:
        """The events of one chat tool-call delta."""
        raise NotImplementedError

    def delta(self, delta: Any) -> list[str]:
        """The events of one chat delta (text, or chat's delta object)."""
        if isinstance(delta, str):
            return self.text(self.ANSWER, delta) if delta else []
        out: list[str] = []
        reasoning, content = delta.get("reasoning_content"), delta.get("content")
        if content and reasoning and not self.thought:  # qwen3's text before the <think> that opened the thinking
            out += self.text(self.ANSWER, content)
            content = None
        if reasoning:
            self.thought = True
            out += self.text(self.THINKING, reasoning)
        if content:
            out += self.text(self.ANSWER, content)
        for call in delta.get("tool_calls") or []:
            out += self.call(call)
        return out


class _Events(ChatDeltas):
    """A stream's events: each numbered, and the output items they open, grow and close."""

    ANSWER, THINKING = "message", "reasoning"

    def __init__(self, run: _Run) -> None:
        self.run = run
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # every item opened, in output order (the open one last)
        self.index: dict[str, int] = {}  # an item's id → its place in the output
        self.open: dict[str, Any] | None = None  # the item being written: its text grows here
        self.calls: dict[int, dict[str, Any]] = {}  # a chat tool call's index → its function_call item
        self.thought = False  # a reasoning item was opened: text from now on is the answer, after the thinking

    def event(self, kind: str, **fields: Any) -> str:
        doc = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(doc, separators=(',', ':'))}\n\n"

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.index[item["id"]]}

    def start(self, item: dict[str, Any]) -> list[str]:
        """Close the open item, open ``item``."""
        out = self.close()
        self.index[item["id"]] = len(self.items)
        self.items.append(item)
        self.open = item
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                              item=_shown(item, "in_progress")))
        if item["type"] == "reasoning":
            out.append(self.event("response.content_part.added", **self._where(item), content_index=0,
                                  part={"type": "reasoning_text", "text": ""}))
        elif item["type"] == "message":
            out.append(self.event("response.content_part.added", **self._where(item), content_index=0,
                                  part=_output_text("")))
        return out

    def close(self, status: str = "completed") -> list[str]:
        """The open item's closing events (``status``: its status)."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        where = self._where(item)
        out = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part={"type": "reasoning_text", "text": text}))
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            out.append(self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=_output_text(text)))
        else:
            out.append(self.event("response.function_call_arguments.done", **where, arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        return out

    def text(self, kind: str, piece: str) -> list[str]:
        """``piece`` of reasoning (``kind`` "reasoning") or answer ("message"): in the open item of that kind, or a
        new one."""
        out: list[str] = []
        if self.open is None or self.open["type"] != kind:
            item = _reasoning_item(_id("rs"), "", "in_progress") if kind == "reasoning" else \
                _message_item(_id("msg"), "", "in_progress")
            out += self.start(item)
        item = self.open
        assert item is not None
        item["content"][0]["text"] += piece
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", **self._where(item), content_index=0, delta=piece))
        else:
            out.append(self.event("response.output_text.delta", **self._where(item), content_index=0, delta=piece,
                                  logprobs=[]))
        return out

    def call(self, delta: dict[str, Any]) -> list[str]:
        """One chat tool call delta: a new call opens its ``function_call`` item; later ones add to its arguments."""
        out: list[str] = []
        function = delta.get("function") or {}
        item = self.calls.get(delta["index"])
        if item is None:
            item = _call_item(_id("fc"), delta["id"], function["name"], "", "in_progress")
            self.calls[delta["index"]] = item
            out += self.start(item)
        piece = function.get("arguments") or ""
        if piece:
            item["arguments"] += piece
            out.append(self.event("response.function_call_arguments.delta", **self._where(item), delta=piece))
        return out



def _shown(item: dict[str, Any], status: str) -> dict[str, Any]:
    """``item`` as ``response.output_item.added`` shows it: nothing written yet."""
    shown = copy.deepcopy(item)
    shown["status"] = status
    if "content" in shown:
        shown["content"] = []
    return shown


async def response_events(run: _Run) -> AsyncIterator[str]:
    """The Responses stream of a run: server-sent events, each numbered, ending with ``response.completed`` (or
    ``response.incomplete`` / ``response.failed``). A closed connection cancels it, which aborts the run."""
    events = _Events(run)
    run.streamed = events.items  # what GET /v1/responses/{id} shows meanwhile
    try:
        begun = _response(run, "in_progress", [], None)
        yield events.event("response.created", response=begun)
        yield events.event("response.in_progress", response=begun)
        last: _Choice | None = None
        async for c, _update, _finished, delta in run.deltas():
            last = c
            if delta is None:  # the engine failed the request (said once in the operator's log)
                error = {"code": "server_error", "message": c.error or "the engine failed this request"}
                yield events.event("response.failed", response=_kept(run, _response(run, "failed", events.items, c,
                                                                                     error)))
                return
            for event in events.delta(delta):
                yield event
        if last is None or last.finish_reason is None:  # the client went away
            return
        status = _STATUS.get(last.reason, "completed")
        if not events.items:  # a reply with nothing in it is still a message
            for event in events.start(_message_item(_id("msg"), "", "in_progress")):
                yield event
        for event in events.close("incomplete" if status in _CUT else "completed"):
            yield event
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        yield events.event(kind, response=_kept(run, _response(run, status, events.items, last)))
    finally:  # a closed connection cancels this generator: free what the run still holds
        run.abort()


__all__ = ["ChatDeltas", "in_progress", "response_document", "response_events"]
