"""The responses ``kvload serve`` keeps (OpenAI's ``store``): the newest ``--responses-store-max``, in memory.

A stored response is the response object as it was answered (a stream's as its last event carried it), the input
items its request sent (each with an ``id``, in the shape ``GET /v1/responses/{id}/input_items`` lists them) and the
kept response its ``previous_response_id`` named. A later request's ``previous_response_id`` puts the whole chain's
items (each turn's input, then its output) before its own ``input`` (OpenAI's rule; the ``instructions`` are not
carried). A turn holds only its own items and a link to the turn before, so a long conversation costs its text once,
not once per turn; a turn dropped from the store stays reachable from the later turns that hold it.
Past the bound the least recently used response (stored, retrieved or chained from) is dropped, and counted.
A response still being generated is not kept yet, but is no stranger either: ``GET`` answers it as it stands
(``status: "in_progress"``, its output so far), and ``DELETE`` and ``previous_response_id`` are refused with a 400
saying it is still in progress (OpenAI's ``GET`` answer; vLLM, which keeps one only for ``background: true``, answers
it the same way and has no ``DELETE``), never a 404 that says it does not exist.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kvload.serve.command import RESPONSES_STORE_MAX_DEFAULT as STORE_MAX_DEFAULT
from kvload.serve.protocol import BadRequest

#: The largest request whose response is kept when the model is unknown (``build_state`` derives it from the context
#: length: :func:`kept_request_bytes`).
KEPT_BYTES_DEFAULT = 16 * 8192 + (1 << 20)

#: ``GET /v1/responses/{id}/input_items``' page size: OpenAI's default and most.
PAGE_DEFAULT = 20
PAGE_MAX = 100


@attrs.frozen(eq=False)
class Stored:
    """One kept response: its object as answered, the input items its request sent, and the kept response its
    ``previous_response_id`` named (held here even once dropped from the store, so the chain stays whole)."""

    response: dict[str, Any]
    items: tuple[dict[str, Any], ...]
    parent: Stored | None = None

    def inputs(self) -> list[dict[str, Any]]:
        """The input items that made it: its chain's first (each earlier turn's input, then its output), then its
        own."""
        chain = []
        node: Stored | None = self
        while node is not None:  # a loop, not recursion: a chain may be thousands of turns long
            chain.append(node)
            node = node.parent
        out: list[dict[str, Any]] = []
        for i, node in enumerate(reversed(chain)):
            out += node.items
            if i < len(chain) - 1:
                out += node.response["output"]
        return out

    def context(self) -> list[dict[str, Any]]:
        """What a request naming it as ``previous_response_id`` is given before its own input."""
        return [*self.inputs(), *self.response["output"]]


class ResponseStore:
    """At most ``max_responses`` responses by id, least recently used dropped first (0: none kept). Used from the
    event loop and from the worker thread that prepares a request, so every method holds a lock."""

    def __init__(self, max_responses: int = STORE_MAX_DEFAULT,
                 on_evicted: Callable[[int], None] | None = None, max_request_bytes: int = KEPT_BYTES_DEFAULT) -> None:
        self.max_responses = max_responses
        self.on_evicted = on_evicted  # told how many were dropped (the metrics count them)
        #: the largest request body whose response is kept: the count alone bounded no memory, as a kept response
        #: holds what its request sent besides the prompt (reasoning items, ids, a schema), of any size
        self.max_request_bytes = max_request_bytes
        self._kept: OrderedDict[str, Stored] = OrderedDict()
        self._claimed: set[str] = set()  # ids of requests in flight whose response will be kept
        #: those being generated: how each stands now (the route's answer while it is in progress)
        self._running: dict[str, Callable[[], Stored]] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether responses are kept at all."""
        return self.max_responses > 0

    def __len__(self) -> int:
        return len(self._kept)

    def check_size(self, size: int, context: int | None = None) -> None:
        """A 400 naming ``store`` when a request of ``size`` bytes asks for its response to be kept past
        :attr:`max_request_bytes` (``context``: the model's context length, said in the message)."""
        if size <= self.max_request_bytes:
            return
        derived = context is not None and self.max_request_bytes == kept_request_bytes(context)
        why = f" (one {context:,}-token prompt as text, 16 bytes a token, plus 1 MiB)" if derived else ""
        raise BadRequest(f"store: a response is kept only for a request of at most {self.max_request_bytes:,} bytes"
                         f"{why}, got {size:,}: send store: false (nothing is kept), or chain the turns with "
                         "previous_response_id (the kept turns are not sent again)", param="store")

    def claim(self, response_id: str, field: str) -> None:
        """Reserve ``response_id`` for a request in flight whose response will be kept; a 400 naming ``field`` (the
        ``X-Request-Id`` header or ``request_id``, which chose it) when a kept response or another request in flight
        has it already: a later response replacing a kept one would silently change every chain through it."""
        with self._lock:
            kept = response_id in self._kept
            if not kept and response_id not in self._claimed:
                self._claimed.add(response_id)
                return
        shown = response_id[:200]
        whose = "names a kept response" if kept else "names a request still in flight whose response will be kept"
        fix = f"; send another id, store: false, or DELETE /v1/responses/{shown} first" if kept else \
            "; send another id, or store: false"
        raise BadRequest(f"{field}: {shown!r} already {whose} (each kept response has its own id){fix}",
                         param=field, code="response_id_in_use")

    def release(self, response_id: str) -> None:
        """Let go of :meth:`claim`'s reservation and :meth:`begin`'s entry (the request ended, kept or not)."""
        with self._lock:
            self._claimed.discard(response_id)
            self._running.pop(response_id, None)

    def begin(self, response_id: str, now: Callable[[], Stored]) -> None:
        """``response_id``'s response, to be kept, is being generated; ``now()`` is how it stands (status
        ``in_progress``). Until :meth:`put` keeps it or :meth:`release` drops it, the routes answer it so."""
        with self._lock:
            self._running[response_id] = now

    def in_progress(self, response_id: str) -> Stored | None:
        """The response of that id as it stands while it is generated, or None when none of that id is."""
        with self._lock:
            now = self._running.get(response_id)
        return now() if now is not None else None  # outside the lock: it copies the output so far

    def _is_running(self, response_id: str) -> bool:
        with self._lock:
            return response_id in self._running

    def put(self, response: dict[str, Any], items: tuple[dict[str, Any], ...], parent: Stored | None = None) -> None:
        """Keep ``response``, made from its request's input ``items`` after the kept response ``parent``, dropping
        the least recently used past the bound."""
        if not self.enabled:
            return
        with self._lock:
            self._running.pop(response["id"], None)  # kept from now on (a DELETE of it must not find it running)
            self._kept[response["id"]] = Stored(response, items, parent)
            self._kept.move_to_end(response["id"])
            dropped = 0
            while len(self._kept) > self.max_responses:
                self._kept.popitem(last=False)
                dropped += 1
        if dropped and self.on_evicted is not None:
            self.on_evicted(dropped)

    def get(self, response_id: str) -> Stored | None:
        """The kept response of that id (now the most recently used), or None."""
        with self._lock:
            stored = self._kept.get(response_id)
            if stored is not None:
                self._kept.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        """Drop a kept response; whether there was one."""
        with self._lock:
            return self._kept.pop(response_id, None) is not None

    # --- what the routes answer ---------------------------------------------------------------------------------

    def previous(self, response_id: str) -> Stored:
        """``previous_response_id``'s kept response; 400 when it is still being generated (it has no output to
        follow yet), 404 (OpenAI's error) when none is kept."""
        # running first: put() moves a response from running to kept at once, so one found in neither is in neither
        if self._is_running(response_id):
            raise BadRequest(f"previous_response_id: response {response_id[:200]!r} is still in progress (being "
                             "generated): wait until it ends (its answer, or its stream's response.completed), then "
                             "send this request", param="previous_response_id", code="previous_response_in_progress")
        stored = self.get(response_id)
        if stored is None:
            hint = (f"kvload serve keeps the {self.max_responses:,} most recently used responses "
                    "(--responses-store-max), none sent with store: false" if self.enabled else
                    "this server keeps no responses (--responses-store-max 0)")
            raise BadRequest(f"Previous response with id {response_id[:200]!r} not found. {hint}; send the whole "
                             "conversation in input instead.", param="previous_response_id", status=404,
                             code="previous_response_not_found")
        return stored

    def retrieve(self, response_id: str, query: Mapping[str, str] | None = None) -> Stored:
        """The kept response for ``GET``, or one still being generated as it stands (``status: "in_progress"``);
        404 when there is neither. ``query``: the request's query parameters, none taken (OpenAI's ``stream``
        re-streams a background response, which kvload does not run)."""
        _query(query or {}, ())
        stored = self.in_progress(response_id) or self.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored

    def remove(self, response_id: str, query: Mapping[str, str] | None = None) -> dict[str, Any]:
        """``DELETE /v1/responses/{id}``'s answer; 400 for one still being generated (it is kept once it ends),
        404 when none is kept."""
        _query(query or {}, ())
        if self._is_running(response_id):
            raise BadRequest(f"response {response_id[:200]!r} is still in progress (being generated) and is kept "
                             "once it ends: delete it then (or send store: false to keep none)",
                             param="response_id", code="response_in_progress")
        if not self.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def input_items(self, response_id: str, query: Mapping[str, str]) -> dict[str, Any]:
        """``GET /v1/responses/{id}/input_items``: a page of its input items (OpenAI's list object: newest first
        unless ``order=asc``, ``limit`` 1 to 100 (20), after the item ``after``); 404 when none is kept."""
        _query(query, ("after", "limit", "order"))
        limit = query.get("limit", str(PAGE_DEFAULT))
        # ASCII digits, and few: "²" is a digit int() refuses, and 5,000 digits pass int()'s own limit (each a 500)
        if not (limit.isascii() and limit.isdigit() and len(limit) <= 3 and 1 <= int(limit) <= PAGE_MAX):
            raise BadRequest(f"limit: expected an integer from 1 to {PAGE_MAX}, got {limit[:40]!r}", param="limit")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadRequest(f"order: expected 'asc' or 'desc', got {order[:40]!r}", param="order")
        items = self.retrieve(response_id).inputs()
        if order == "desc":
            items.reverse()
        after = query.get("after")
        if after is not None:
            place = next((i for i, item in enumerate(items) if item.get("id") == after), None)
            if place is None:
                raise BadRequest(f"after: no input item of response {response_id[:200]!r} has id {after[:200]!r}",
                                 param="after")
            items = items[place + 1:]
        page = items[:int(limit)]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}


def kept_request_bytes(max_seq_len: int) -> int:
    """The largest request body whose response is kept: one prompt of ``max_seq_len`` tokens as text (16 bytes a
    token, as the default ``--max-request-bytes`` counts them), plus 1 MiB for the rest."""
    return 16 * max_seq_len + (1 << 20)


def _query(query: Mapping[str, str], accepted: tuple[str, ...]) -> None:
    """A query parameter a route does not take is refused, naming it (never silently left unread)."""
    unknown = sorted(set(query) - set(accepted))
    if unknown:
        takes = f"accepted: {', '.join(accepted)}" if accepted else "this route takes none"
        raise BadRequest(f"{unknown[0][:60]}: query parameter not supported; {takes}", param=unknown[0][:60])
    getlist = getattr(query, "getlist", None)  # a request's query (a multi-dict): ?limit=1&limit=50 read one of them
    for name in sorted(query) if getlist is not None else ():
        if len(getlist(name)) > 1:
            raise BadRequest(f"{name}: given {len(getlist(name))} times; give it once", param=name)


def _not_found(response_id: str) -> BadRequest:
    return BadRequest(f"Response with id {response_id[:200]!r} not found.", param="response_id", status=404,
                      code="response_not_found")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _parts(content: Any, kind: str) -> list[dict[str, Any]]:
    """A message's content as a list of parts (a string: one ``kind`` part); ``output_text`` with its annotations."""
    parts = [{"type": kind, "text": content}] if isinstance(content, str) else [dict(p) for p in content]
    for part in parts:
        if part["type"] == "output_text":
            part.setdefault("annotations", [])
    return parts


def input_items(value: Any) -> list[dict[str, Any]]:
    """A request's ``input`` (checked already: ``responses_input``) as stored input items, each with an ``id`` and
    the shape OpenAI lists them in (a string: one user message of one ``input_text`` part)."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    out = []
    for item in value:
        kind = item.get("type", "message")
        if kind == "message":
            assistant = item["role"] == "assistant"
            out.append({"id": item.get("id") or _id("msg"), "type": "message", "role": item["role"],
                        "content": _parts(item["content"], "output_text" if assistant else "input_text"),
                        "status": item.get("status") or "completed"})
        elif kind == "function_call":
            out.append({"id": item.get("id") or _id("fc"), "type": "function_call", "call_id": item["call_id"],
                        "name": item["name"], "arguments": item["arguments"], "status": item.get("status") or
                        "completed"})
        elif kind == "function_call_output":
            out.append({"id": item.get("id") or _id("fco"), "type": "function_call_output",
                        "call_id": item["call_id"], "output": item["output"],
                        "status": item.get("status") or "completed"})
        else:  # reasoning: as given, with an id
            out.append({**{k: v for k, v in item.items() if v is not None}, "id": item.get("id") or _id("rs"),
                        "summary": item.get("summary") or []})
    return out


__all__ = ["PAGE_MAX", "STORE_MAX_DEFAULT", "ResponseStore", "Stored", "input_items", "kept_request_bytes"]
