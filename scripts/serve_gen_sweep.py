"""Hostile-input sweep of ``kvload serve``'s generation routes: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/responses`` (and its stored-response routes: GET, DELETE, ``/input_items``), ``/v1/messages`` and
``/v1/messages/count_tokens``, ``/tokenize`` (prompt and chat forms), ``/detokenize``, and the GET routes
(``/v1/models``, ``/v1/models/{name}``, ``/health``, ``/ping``, ``/load``, ``/metrics``, ``/version``), on a tiny
random llama with a word tokenizer and a chat template (``tests/paged_support.py``, ``tests/llm_support.py``).

Each field each route accepts (its parser's own list: ``protocol._COMPLETION``, ``_CHAT``, ``responses_input
.ACCEPTED``, ``messages_input.ACCEPTED``, ...) is given hostile JSON (wrong types, -1, 0, 2**63, 10**400, a lone
surrogate, a 1 MB string, nested junk) and ``NaN`` / ``Infinity`` / ``-Infinity`` as bare JSON numbers; each route
also gets an unknown field, a typo, and odd raw bodies (not JSON, truncated, empty, an array, 100,000 brackets, wrong
Content-Type, UTF-16, invalid UTF-8); the GET routes get hostile paths and query strings. Streaming routes get
clients that hang up after the first chunk (a reset, or a plain close). Every route then takes 32 requests at once
(``*.concurrency``): good ones (each checked against the baseline), bad ones, streams hung up after their first
chunk, and clients that reset once the body is sent.

After each case the same route's good request must answer as the baseline did (greedy: the same text), and the
server must hold nothing once idle: admission slots, engine requests (running, waiting, live), the KV manager's
requests and used blocks back at the baseline; a kept response (``/v1/responses`` answered 200) must read back (GET,
``input_items``); the concurrency case runs three rounds, and threads and open fds must not grow from the second to
the third. A suspect: a status outside 200/400/404/405/413/415, a server log record with a traceback or
``request_failed``, an error body not in OpenAI's shape (Anthropic's on ``/v1/messages``), a 400 whose param and
message do not name the field, a hang (past 30 s, ``--timeout``; a beam search's case 4 times that), a good
request answering differently afterwards, anything left behind, a kept response that does not read back, a hostile
value answered 200 that nothing should take, or a falsy value (false, "", 0, {}) answered 200 where its truthy
sibling of the same type is refused (a parser reading ``body.get(f) or default``); the values judged fine are in
``JUDGED_OK`` and ``NAMED_INSTEAD``, each with why.

    python scripts/serve_gen_sweep.py --out /tmp/gen.jsonl --summary           # the whole sweep
    python scripts/serve_gen_sweep.py --out /tmp/gen.jsonl --only chat.stop --summary
    python scripts/serve_gen_sweep.py --out /tmp/gen.jsonl --nested --summary  # the nested fields alone
    python scripts/serve_gen_sweep.py --out /tmp/tp.jsonl --tp_size 2 --every 2 --summary  # 2 ranks, half the cases

``--tp_size N`` sweeps a real ``kvload serve CKPT --tp_size N`` (``External``: kvload's own N rank processes) with the
same cases and rules, its leftovers read over HTTP and every rank required alive after each case (BENCHMARKS.md,
"tpfault42").

``--group`` runs one other server instead, each with its own cases (judged by the same rules, ``--only`` narrows):
``parsers`` (``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser deepseek_r1``): the fields the
parsers read (chat's ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``reasoning_effort``, ``include_reasoning``,
assistant turns' ``reasoning_content`` and ``tool_calls``; Responses' ``reasoning``, ``include``, reasoning and
function-call items; Messages' ``thinking``, ``tool_choice``, thinking and redacted_thinking blocks) hostile at the
top and below (``PARSER_FIELDS``, ``PARSER_NESTED``), and each streaming route with tools hung up after its first
chunk; ``auth`` (``--api-key``): every route, the open ones too, under 25 Authorization / X-Api-Key header sets sent
as raw bytes (missing, wrong, a prefix, two headers, latin-1, a control byte, 60 KB, ...; ``AUTH_HEADERS``): a right
key must be served, a wrong one a 401 in the route's error shape with ``WWW-Authenticate: Bearer`` and nothing held,
and an open route (``AUTH_OPEN``) must answer as the same request to a second server without ``--api-key`` does (its
status, Content-Type, Allow, WWW-Authenticate, Connection and body; ``/metrics`` by its families, ``/load`` by its
keys); ``beam`` (``--max_beam_width 4``): beam search on completions and chat, every hostile value on each field
of ``BEAM_FIELDS`` over a good search of two beams, ``beam_combos`` (each field's meaningful values, and their
combinations with n, best_of, stream, logprobs, stop, max_tokens and structured outputs, each with the status
expected and every 200's choices checked), clients gone mid-search (streamed or not: the search must end within
fewer steps than a whole one), 16 requests at once (three rounds), 16 searches at once, 8 beside 8 plain requests,
and the running or queued searches among the leftovers; ``admin`` (``--enable-reset-prefix-cache``, KV events on):
``/v1/kvload/audit``, ``/explain``, ``/kv_events`` and ``/reset_prefix_cache`` with hostile queries, bodies and
methods, and a reset while a stream runs (409, the stream unharmed).

    python scripts/serve_gen_sweep.py --out /tmp/p.jsonl --group parsers --summary

Record (2-core VM shared with other helpers, 2026-12-05; main's run before the kept-response read-back was added,
judged by this file's rules):

    | tree | cases | suspects | completion | chat | responses | run |
    |---|--:|--:|--:|--:|--:|--:|
    | main at 5a33980 | 6,343 | 19 | 4 | 9 | 6 | 23.6 min |
    | branch gensweep39 | 6,343 | 0 | 0 | 0 | 0 | 17.0 min |

    main's: stop_token_ids 0, "", false or {} served as none given (both routes); chat's tools[0].function
    .description of any JSON (a number, an object) rendered into the prompt; structured_outputs {"regex": ...,
    "choice": false} (or grammar: false) served the regex; a Responses input item's id holding a lone surrogate kept,
    and every GET .../input_items of it a 500; a lone surrogate in a function_call_output's output named input[1]
    .content (param input); text.format false, "", 0 or {} served as plain text. No 5xx on any POST, no traceback,
    nothing left behind (engine requests, KV blocks, slots), no hang, every good request after a case answered as the
    baseline, streams hung up after their first chunk and 32 concurrent requests clean on every route.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

#: Seconds a client waits for an answer, and past which ``suspect`` calls a case slow (``--timeout`` sets it).
TIMEOUT = 30.0
#: A beam search's case waits this many times longer (``timeout_for``): a chat search of two beams run to the
#: context (``max_tokens`` 59 or unset, ``ignore_eos``) takes a few seconds idle, but took past 30 s on two cores at
#: a load of 10 (beam40's run: 3 such cases flagged as hangs, answered 200 in the run before; nothing held after).
BEAM_TIMEOUT_SCALE = 4.0


def timeout_for(name: str) -> float:
    """The seconds case ``name`` (or a route's tag) waits for: TIMEOUT, scaled for a beam search's (``beam_*``)."""
    return TIMEOUT * (BEAM_TIMEOUT_SCALE if name.startswith("beam_") else 1.0)

HOSTILE: dict[str, Any] = {
    "str": "abc", "float": 1.5, "bool": True, "none": None, "list": [1], "dict": {"a": 1}, "neg": -1, "zero": 0,
    "huge": 2 ** 63, "bignum": 10 ** 400, "surrogate": "\ud800", "empty_str": "", "empty_list": [],
    "nested": [{"a": [None, {"b": [1.5, "\ud800"]}]}], "long_str": "w1 " * 350_000, "neg_float": -1e308,
    "false": False, "one": 1, "empty_dict": {}}
#: A falsy value and its truthy sibling of the same type: the first answered 200 while the second is refused is a
#: suspect (a parser that reads ``body.get(field) or default`` takes 0, "" and false for "not given").
SIBLINGS = {"false": "bool", "empty_str": "str", "zero": "one", "empty_dict": "dict"}  # [] is a well-typed list
#: Bare JSON literals Python's json reads (and strict JSON does not): each given to every field.
LITERALS = {"nan_lit": "NaN", "inf_lit": "Infinity", "neg_inf_lit": "-Infinity"}
#: Case kinds (the name's last part) a 200 to is a suspect unless ``JUDGED_OK`` says why the field takes it.
NEVER_OK = {"nested", "bignum", "surrogate", "nan_lit", "inf_lit", "neg_inf_lit", "huge", "neg_float", "long_str",
            "typo", "unknown"}
#: (route tag, field) -> the kinds judged fine for that field, and why.
_HINT = "reported as setting_ignored (its first 200 characters) and used for nothing, echoed nowhere"
JUDGED_OK: dict[tuple[str, str], tuple[set[str], str]] = {
    **{(tag, "length_penalty"): ({"huge", "neg_float"}, "a finite number: reported as setting_ignored without "
                                  "use_beam_search; with it, any finite exponent is a ranking (vLLM's float)")
       for tag in ("completion", "chat")},
    **{(tag, field): ({"surrogate", "long_str"}, _HINT) for tag in ("completion", "chat", "responses")
       for field in ("session_id", "prompt_cache_key", "safety_identifier")},
    **{(tag, "user"): ({"long_str"}, "OpenAI's end-user id, any string (a lone surrogate is refused: the Responses "
                       "API echoes it); the request's size bounds it") for tag in ("completion", "chat", "responses")},
    ("responses", "max_tool_calls"): ({"huge", "bignum"}, "an integer >= 1 bounding OpenAI's built-in tools, which "
                                      "kvload has none of: reported as setting_ignored"),
    **{(tag, "priority"): ({"zero"}, "0 is what every request gets without --scheduling-policy priority (1 is "
                           "refused there)") for tag in ("completion", "chat", "responses")},
    **{(tag, "logit_bias"): ({"empty_dict"}, "no bias: well typed") for tag in ("completion", "chat", "responses")},
    **{(tag, "use_beam_search"): ({"false"}, "false is no beam search; true is refused only by the server's "
                                  "max_beam_width=1") for tag in ("completion", "chat")},
    ("chat", "continue_final_message"): ({"false"}, "true is refused only because the last message is the user's"),
    **{(tag, "metadata"): ({"empty_dict"}, "no pairs: well typed ({\"a\": 1} is refused for its value)")
       for tag in ("chat", "responses")},
    **{(tag, "chat_template_kwargs.enable_thinking"): ({"huge", "bignum", "neg_float"}, "the template's keywords "
                                                        "are free-form; only false switches qwen3's parser off")
       for tag in ("chat",)},
    ("chat", "chat_template_kwargs.thinking"): ({"huge", "bignum", "neg_float"}, "as enable_thinking"),
    **{("messages", f"messages.1.content.0.{k}"): ({"surrogate"}, "Anthropic's opaque string, used for nothing and "
                                                   "echoed nowhere (the template is given none)")
       for k in ("signature", "data")},
    ("chat", "response_format.json_schema.name"): ({"surrogate"}, "chat echoes it nowhere and no template reads it "
                                                   "(/v1/responses, which echoes its name, refuses one)"),
    ("chat", "messages.1.tool_calls.0.function.arguments"): ({"empty_str"}, "\"\" is no arguments ({}), as vLLM "
                                                             "takes it; \"abc\" is no JSON"),
    ("responses", "input.0.arguments"): ({"empty_str"}, "as chat's"),
    ("responses", "background"): ({"false"}, "false is what kvload does; true is refused for what it asks"),
    **{(tag, field): ({"empty_dict"}, "an object whose keys are all optional")
       for tag, field in (("responses", "reasoning"), ("responses", "stream_options"), ("responses", "text"),
                          ("messages", "output_config"), ("count_tokens", "output_config"))},
    **{("messages", "messages.0.content.0.cache_control"): (
        {"huge", "bignum", "surrogate", "nested", "neg_float"}, "any cache_control is reported as setting_ignored "
        "(kvload caches every prefix), as the request's own and a tool's are; used for nothing")},
    **{(tag, "cache_control"): ({"huge", "bignum", "surrogate", "nested", "neg_float", "long_str", "nan_lit",
                                 "inf_lit", "neg_inf_lit"}, "the request's own, of any value, is reported as "
                                "setting_ignored: vLLM's request model has no such field and drops it unread "
                                "(commit 5e2b8ca); used for nothing, echoed nowhere")
       for tag in ("messages", "count_tokens")},
    ("messages", "thinking.budget_tokens"): ({"huge", "bignum"}, "an integer >= 1, reported as setting_ignored "
                                             "(kvload does not steer how long a model thinks)"),
    ("messages", "metadata.user_id"): ({"surrogate"}, "Anthropic's opaque id, at most 256 characters, used for "
                                       "nothing and echoed nowhere"),
    **{(tag, "continue_final_message"): ({"false"}, "as chat's") for tag in ("tokenize_chat",)},
    **{("chat", f"structured_outputs.{k}"): ({"false"}, "a flag: false is its default (true is refused here only "
                                             "because the body's regex is a second kind)")
       for k in ("json_object", "disable_any_whitespace")},
    ("messages", "metadata"): ({"empty_dict"}, "no user_id: well typed"),
    **{(tag, field): ({"zero"}, "0 is the neutral value beam search takes (greedy; no penalty; no minimum); 1 "
                      "asks for what it cannot honour, refused by name")
       for tag in ("beam_completion", "beam_chat")
       for field in ("temperature", "min_tokens", "presence_penalty", "frequency_penalty")},
    ("tokenize", "prompt"): ({"long_str"}, "/tokenize counts past the context (vLLM's; max_model_len is in the "
                             "answer for the client to compare)"),
    ("count_tokens", "system"): ({"long_str"}, "count_tokens counts past the context, as /tokenize does (Anthropic's "
                                 "counts what it is sent; /v1/messages refuses the same system prompt by name)"),
}
#: (route tag, kind) -> the param a 400 may name instead of the field, and why.
NAMED_INSTEAD: dict[tuple[str, str], tuple[str, str]] = {
    ("responses", "long_str"): ("store", "a 1 MB body is over what a kept response may hold: the refusal names "
                                "store and says to send store: false"),
    ("messages", "long_str"): ("messages", "the system prompt is the templated prompt's start: its length is "
                               "refused as the prompt's (messages)"),
    ("count_tokens", "long_str"): ("messages", "as /v1/messages"),
}
OK_STATUSES = (200, 400, 404, 405, 413, 415)


@attrs.frozen
class Raw:
    """A body sent as these bytes (not JSON-encoded), with this Content-Type (None: no header)."""

    data: bytes
    media: str | None = "application/json"


@attrs.frozen
class Route:
    tag: str
    path: str
    good: dict[str, Any]
    fields: tuple[str, ...]
    stream: bool = False  # takes "stream": true
    anthropic: bool = False  # errors in Anthropic's document


CHAT = [{"role": "user", "content": "w1 w2 w3"}]


def routes() -> list[Route]:
    from kvload.serve import messages_input, protocol, responses_input

    return [
        Route("completion", "/v1/completions", {"prompt": "w1 w2 w3", "max_tokens": 3},
              tuple(sorted(protocol._COMPLETION)), stream=True),
        Route("chat", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3}, tuple(sorted(protocol._CHAT)),
              stream=True),
        Route("responses", "/v1/responses", {"input": "w1 w2 w3", "max_output_tokens": 3},
              tuple(sorted(responses_input.ACCEPTED)), stream=True),
        Route("messages", "/v1/messages", {"model": "tiny", "messages": CHAT, "max_tokens": 3},
              tuple(sorted(messages_input.ACCEPTED)), stream=True, anthropic=True),
        Route("count_tokens", "/v1/messages/count_tokens", {"model": "tiny", "messages": CHAT},
              tuple(sorted(messages_input.COUNT_ACCEPTED)), anthropic=True),
        Route("tokenize", "/tokenize", {"prompt": "w1 w2 w3"}, tuple(sorted(protocol._TOKENIZE_PROMPT))),
        Route("tokenize_chat", "/tokenize", {"messages": CHAT}, tuple(sorted(protocol._TOKENIZE_CHAT))),
        Route("detokenize", "/detokenize", {"tokens": [1, 2, 3]}, ("model", "tokens")),
    ]


def answer_of(route: Route, doc: Any) -> Any:
    """What a good answer says (its text or tokens), the part a later good request must repeat."""
    if route.tag.startswith("beam_"):  # every hypothesis, best first
        return [c["text"] if "text" in c else c["message"]["content"]
                for c in sorted(doc["choices"], key=lambda c: c["index"])]
    if route.tag == "completion":
        return doc["choices"][0]["text"]
    if route.tag == "chat":
        return doc["choices"][0]["message"]["content"]
    if route.tag == "responses":
        return [o.get("content") for o in doc["output"]]
    if route.tag == "messages":
        return doc["content"]
    return {k: v for k, v in doc.items() if k not in ("id", "created")}


def raw_bodies(route: Route) -> dict[str, Raw]:
    text = json.dumps(route.good)
    inner = text[1:-1]
    first = next(iter(route.good))
    out = {
        "body.not_json": Raw(b"hello"), "body.truncated": Raw(text[:-3].encode()), "body.empty": Raw(b""),
        "body.spaces": Raw(b"   "), "body.array": Raw(f"[{text}]".encode()), "body.string": Raw(b'"w1"'),
        "body.null": Raw(b"null"), "body.number": Raw(b"1"), "body.deep": Raw(("[" * 100_000 + "]" * 100_000).encode()),
        "body.deep_obj": Raw(('{"a":' * 50_000 + "1" + "}" * 50_000).encode()),
        "body.deep_field": Raw(f'{{{inner}, "{first}": {"[" * 5000}1{"]" * 5000}}}'.encode()),
        "body.dup_keys": Raw(f"{{{inner}, {inner}}}".encode()),
        "body.trailing": Raw(f"{text} {text}".encode()), "body.utf16": Raw(text.encode("utf-16")),
        "body.bom": Raw(b"\xef\xbb\xbf" + text.encode()), "body.latin1": Raw(text.encode().replace(b"w1", b"w\xe91")),
        "body.surrogate_esc": Raw(text.replace("w1", "w1\\udc00").encode()),
        "body.key_surrogate": Raw(f'{{{inner}, "\\ud800": 1}}'.encode()),
        "body.null_key": Raw(f'{{{inner}, "": 1}}'.encode()),
        "body.nul_key": Raw(f'{{{inner}, "\\u0000": 1}}'.encode()),
        "body.text_plain": Raw(text.encode(), "text/plain"), "body.no_type": Raw(text.encode(), None),
        "body.form": Raw(b"prompt=w1", "application/x-www-form-urlencoded"),
        "body.multipart": Raw(b"--x--", "multipart/form-data; boundary=x"),
        "body.json_charset": Raw(text.encode(), "application/json; charset=utf-8"),
        "body.json_latin1_charset": Raw(text.encode(), "application/json; charset=latin-1"),
        "body.big_number": Raw(f'{{{inner}, "max_tokens": {"9" * 5000}}}'.encode()),
        "body.big_float": Raw(f'{{{inner}, "temperature": 1e999999}}'.encode()),
        "body.many_keys": Raw(("{" + inner + "," + ",".join(f'"k{i}": 1' for i in range(100_000)) + "}").encode()),
    }
    return out


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
#: Nested fields, each (route tag, the good body's extra fields that make the path exist, the path): every hostile
#: value is put at the path (dotted; a number indexes a list).
NESTED: list[tuple[str, dict[str, Any], str]] = [
    *[("chat", {}, f"messages.0.{k}") for k in ("role", "content", "name", "tool_calls", "tool_call_id",
                                                "reasoning_content")],
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "w1"}]}]}, "messages.0.content.0"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "w1"}]}]},
     "messages.0.content.0.text"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "w1"}]}]},
     "messages.0.content.0.type"),
    ("chat", {"messages": [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ("chat", {"messages": [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.1.tool_calls.0.function"),
    *[("chat", {"stream": True, "stream_options": {"include_usage": True}}, f"stream_options.{k}")
      for k in ("include_usage", "continuous_usage_stats")],
    *[("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object"}}}}, f"response_format.{k}") for k in ("type", "json_schema", "json_schema.name",
                                                                  "json_schema.schema", "json_schema.strict")],
    *[("chat", {"tools": [WEATHER], "tool_choice": "required"}, k)
      for k in ("tools.0", "tools.0.type", "tools.0.function", "tools.0.function.name",
                "tools.0.function.parameters", "tools.0.function.description")],
    *[("chat", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, k)
      for k in ("tool_choice.type", "tool_choice.function", "tool_choice.function.name")],
    *[("chat", {"structured_outputs": {"regex": "w[0-9]"}}, f"structured_outputs.{k}")
      for k in ("regex", "json", "choice", "grammar", "json_object", "disable_any_whitespace")],
    ("chat", {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs.enable_thinking"),
    ("chat", {"logit_bias": {"5": 1}}, "logit_bias.5"),
    ("chat", {"metadata": {"k": "v"}}, "metadata.k"),
    ("completion", {"logit_bias": {"5": 1}}, "logit_bias.5"),
    ("completion", {"prompt": [5, 6, 7]}, "prompt.1"),
    ("completion", {"prompt": [[5, 6, 7], [8]]}, "prompt.1"),
    ("completion", {"prompt": ["w1", "w2"]}, "prompt.1"),
    ("completion", {"stop": ["w9", "w8"]}, "stop.1"),
    ("completion", {"allowed_token_ids": [5, 6]}, "allowed_token_ids.1"),
    ("completion", {"bad_words": ["w9"]}, "bad_words.0"),
    ("completion", {"stop_token_ids": [5]}, "stop_token_ids.0"),
    *[("responses", {"input": [{"role": "user", "content": "w1"}]}, f"input.0.{k}") for k in ("role", "content",
                                                                                            "type", "id", "status")],
    *[("responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "w1"}]}]},
       f"input.0.content.0.{k}") for k in ("type", "text")],
    *[("responses", {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                               {"type": "function_call_output", "call_id": "c1", "output": "w2"}]}, f"input.{k}")
      for k in ("0.call_id", "0.name", "0.arguments", "1.call_id", "1.output")],
    *[("responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}},
       f"text.{k}") for k in ("format", "format.type", "format.name", "format.schema", "format.strict", "verbosity")],
    *[("responses", {"reasoning": {"effort": "low"}}, f"reasoning.{k}") for k in ("effort", "summary")],
    ("responses", {"metadata": {"k": "v"}}, "metadata.k"),
    *[("responses", {"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                     "tool_choice": "required"}, f"tools.0.{k}") for k in ("type", "name", "parameters", "strict")],
    ("responses", {"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "f"}},
     "tool_choice.name"),
    ("responses", {"stream": True, "stream_options": {"include_obfuscation": False}},
     "stream_options.include_obfuscation"),
    *[("messages", {}, f"messages.0.{k}") for k in ("role", "content")],
    *[("messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": "w1"}]}]},
       f"messages.0.content.0.{k}") for k in ("type", "text", "cache_control")],
    *[("messages", {"system": [{"type": "text", "text": "w1"}]}, f"system.0.{k}") for k in ("type", "text")],
    *[("messages", {"thinking": {"type": "enabled", "budget_tokens": 1024}}, f"thinking.{k}")
      for k in ("type", "budget_tokens")],
    ("messages", {"output_config": {"effort": "low"}}, "output_config.effort"),
    ("messages", {"metadata": {"user_id": "u"}}, "metadata.user_id"),
    *[("messages", {"tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"}},
       k) for k in ("tools.0.name", "tools.0.input_schema", "tool_choice.type", "tools.0")],
    *[("messages", {"messages": [*CHAT, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "w2"}]}]}, f"messages.{k}")
      for k in ("1.content.0.input", "1.content.0.id", "1.content.0.name", "2.content.0.tool_use_id",
                "2.content.0.content")],
    ("tokenize_chat", {}, "messages.0.content"),
    ("detokenize", {}, "tokens.1"),
    ("tokenize", {"prompt": "w1"}, "prompt"),
]


# --- the other servers (--group) ----------------------------------------------------------------------------------

#: --group parsers (a server started with ``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser
#: deepseek_r1``): each route's fields a parser reads, hostile at the top and below (``NESTED`` and these).
PARSER_FIELDS = {"chat": ("tools", "tool_choice", "parallel_tool_calls", "reasoning_effort", "include_reasoning",
                          "chat_template_kwargs", "messages"),
                 "responses": ("tools", "tool_choice", "parallel_tool_calls", "reasoning", "include", "input"),
                 "messages": ("tools", "tool_choice", "thinking", "messages")}
_R_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
PARSER_NESTED: list[tuple[str, dict[str, Any], str]] = [
    *[("chat", {"messages": [*CHAT, {"role": "assistant", "content": "w1", "reasoning_content": "w2",
                                     "tool_calls": [{"id": "c1", "type": "function", "function": {
                                         "name": "get_weather", "arguments": "{\"city\": \"w1\"}"}}]},
                             {"role": "tool", "tool_call_id": "c1", "content": "w3"}], "tools": [WEATHER]},
       f"messages.{k}") for k in ("1.reasoning_content", "1.reasoning", "1.tool_calls.0.id", "1.tool_calls.0.type",
                                  "1.tool_calls", "2.tool_call_id", "2.content", "2.name")],
    *[("chat", {"tools": [WEATHER], "tool_choice": "auto"}, k) for k in ("tool_choice", "parallel_tool_calls",
                                                                         "tools.0.function.strict")],
    *[("chat", {"tools": [WEATHER], "reasoning_effort": "low", "include_reasoning": True}, k)
      for k in ("reasoning_effort", "include_reasoning")],
    ("chat", {"chat_template_kwargs": {"thinking": True}}, "chat_template_kwargs.thinking"),
    *[("responses", {"tools": [_R_TOOL], "tool_choice": "auto"}, k) for k in ("tool_choice", "parallel_tool_calls",
                                                                            "tools.0.description")],
    *[("responses", {"reasoning": {"effort": "low", "summary": "auto"}}, f"reasoning.{k}")
      for k in ("effort", "summary", "generate_summary")],
    *[("responses", {"input": [{"type": "reasoning", "id": "rs_1", "summary": [
        {"type": "summary_text", "text": "w1"}], "content": [{"type": "reasoning_text", "text": "w2"}]},
        {"role": "user", "content": "w1"}]}, f"input.0.{k}")
      for k in ("id", "summary", "summary.0", "summary.0.text", "summary.0.type", "content", "content.0.text",
                "content.0.type", "encrypted_content", "type")],
    *[("responses", {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}",
                                "id": "fc_1", "status": "completed"},
                               {"type": "function_call_output", "call_id": "c1", "output": "w2"}],
                     "tools": [_R_TOOL]}, f"input.{k}")
      for k in ("0.id", "0.status", "0.type", "1.type", "1.id", "1.status", "1.output")],
    ("responses", {"include": ["reasoning.encrypted_content"]}, "include.0"),
    *[("messages", {"thinking": {"type": "enabled", "budget_tokens": 1024}}, f"thinking.{k}")
      for k in ("type", "budget_tokens", "display")],
    *[("messages", {"thinking": {"type": "disabled"}}, f"thinking.{k}") for k in ("type", "budget_tokens")],
    *[("messages", {"tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "auto"}},
       k) for k in ("tool_choice", "tool_choice.type", "tool_choice.disable_parallel_tool_use", "tools.0.description",
                    "tools.0.type")],
    ("messages", {"tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {
        "type": "tool", "name": "f"}}, "tool_choice.name"),
    *[("messages", {"thinking": {"type": "enabled", "budget_tokens": 1024}, "messages": [*CHAT, {
        "role": "assistant", "content": [{"type": "thinking", "thinking": "w1", "signature": "s"},
                                         {"type": "text", "text": "w2"}]}, {"role": "user", "content": "w3"}]},
       f"messages.1.content.0.{k}") for k in ("thinking", "signature", "type")],
    *[("messages", {"messages": [*CHAT, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "x"}, {"type": "text", "text": "w2"}]}, {"role": "user",
                                                                                     "content": "w3"}]},
       f"messages.1.content.0.{k}") for k in ("data", "type")],
]


def parser_cases(route: Route) -> dict[str, Any]:
    """--group parsers: the route's top-level fields a parser reads (``PARSER_FIELDS``), every hostile value (the
    1 MB string and the literals too), and ``NESTED`` and ``PARSER_NESTED`` below them."""
    fields = PARSER_FIELDS.get(route.tag, ())
    cases = {name: body for name, body in field_cases(route).items() if name.split(".", 1)[0] in fields}
    for tag, extra, path in PARSER_NESTED:
        if tag == route.tag:
            for k, v in HOSTILE.items():
                if k != "long_str":
                    cases[f"{path}.{k}"] = put({**route.good, **extra}, path, v)
    return cases


#: --group auth: the key the server takes, and each Authorization / X-Api-Key header set with whether it passes.
KEY = "sk-sweep-key"
AUTH_HEADERS: dict[str, tuple[list[tuple[bytes, bytes]], bool]] = {
    "right": ([(b"Authorization", b"Bearer " + KEY.encode())], True),
    "lower_scheme": ([(b"Authorization", b"bearer " + KEY.encode())], True),
    "two_spaces": ([(b"Authorization", b"Bearer  " + KEY.encode())], True),
    "x_api_key": ([(b"X-Api-Key", KEY.encode())], True),
    "x_api_key_and_wrong_bearer": ([(b"Authorization", b"Bearer no"), (b"X-Api-Key", KEY.encode())], True),
    "missing": ([], False), "wrong": ([(b"Authorization", b"Bearer sk-wrong")], False),
    "prefix": ([(b"Authorization", b"Bearer " + KEY[:-1].encode())], False),
    "longer": ([(b"Authorization", b"Bearer " + KEY.encode() + b"x")], False),
    "empty": ([(b"Authorization", b"")], False), "scheme_only": ([(b"Authorization", b"Bearer")], False),
    "scheme_space": ([(b"Authorization", b"Bearer ")], False),
    "no_scheme": ([(b"Authorization", KEY.encode())], False),
    "basic": ([(b"Authorization", b"Basic " + KEY.encode())], False),
    "tab": ([(b"Authorization", b"Bearer\t" + KEY.encode())], False),
    "two_headers": ([(b"Authorization", b"Bearer " + KEY.encode()), (b"Authorization", b"Bearer no")], False),
    "two_right": ([(b"Authorization", b"Bearer " + KEY.encode())] * 2, False),
    "two_x_api_keys": ([(b"X-Api-Key", KEY.encode()), (b"X-Api-Key", b"no")], False),
    "latin1": ([(b"Authorization", b"Bearer sk-sweep-k\xe9y")], False),
    "utf8": ([(b"Authorization", "Bearer sk-sweep-k\u00e9y".encode())], False),
    "control": ([(b"Authorization", b"Bearer sk-\x01sweep")], False),
    "long": ([(b"Authorization", b"Bearer " + b"k" * 60_000)], False),
    "x_api_key_empty": ([(b"X-Api-Key", b"")], False),
    "x_api_key_bearer": ([(b"X-Api-Key", b"Bearer " + KEY.encode())], False),
    "key_in_query": ([], False),
}
#: --group auth: every route (method, path, body) behind the gate, and those open to all (OPEN_PATHS).
AUTH_ROUTES: dict[str, tuple[str, str, Any]] = {
    "completion": ("POST", "/v1/completions", {"prompt": "w1 w2 w3", "max_tokens": 3}),
    "completion_stream": ("POST", "/v1/completions", {"prompt": "w1 w2 w3", "max_tokens": 3, "stream": True}),
    "chat": ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3}),
    "responses": ("POST", "/v1/responses", {"input": "w1 w2 w3", "max_output_tokens": 3, "store": False}),
    "messages": ("POST", "/v1/messages", {"model": "tiny", "messages": CHAT, "max_tokens": 3}),
    "count_tokens": ("POST", "/v1/messages/count_tokens", {"model": "tiny", "messages": CHAT}),
    "tokenize": ("POST", "/tokenize", {"prompt": "w1 w2 w3"}),
    "detokenize": ("POST", "/detokenize", {"tokens": [1, 2, 3]}),
    "invocations": ("POST", "/invocations", {"prompt": "w1 w2 w3", "max_tokens": 3}),
    "embeddings": ("POST", "/v1/embeddings", {"input": "w1"}), "pooling": ("POST", "/pooling", {"input": "w1"}),
    "classify": ("POST", "/classify", {"input": "w1"}), "score": ("POST", "/score", {"text_1": "w1", "text_2": "w2"}),
    "rerank": ("POST", "/v1/rerank", {"query": "w1", "documents": ["w2"]}),
    "models": ("GET", "/v1/models", None), "model_card": ("GET", "/v1/models/tiny", None),
    "models_head": ("HEAD", "/v1/models", None), "stored": ("GET", "/v1/responses/resp_zzz", None),
    "stored_delete": ("DELETE", "/v1/responses/resp_zzz", None),
    "input_items": ("GET", "/v1/responses/resp_zzz/input_items", None),
    "audit": ("GET", "/v1/kvload/audit", None), "explain": ("GET", "/v1/kvload/explain?field=max_seq_len", None),
    "kv_events": ("GET", "/v1/kvload/kv_events", None), "reset_prefix_cache": ("POST", "/reset_prefix_cache", None),
    "unknown_path": ("GET", "/v1/zzz", None), "wrong_method": ("GET", "/v1/completions", None),
    "options": ("OPTIONS", "/v1/completions", None),
    "health": ("GET", "/health", None), "ping": ("POST", "/ping", None), "metrics": ("GET", "/metrics", None),
    "version": ("GET", "/version", None), "load": ("GET", "/load", None),
    "health_slash": ("GET", "/health/", None), "metrics_query": ("GET", "/metrics?x=1", None),
    # the open paths under other methods, a query and an escaped path: each as a server without --api-key answers it
    "health_head": ("HEAD", "/health", None), "ping_get": ("GET", "/ping", None),
    "version_post": ("POST", "/version", None), "metrics_head": ("HEAD", "/metrics", None),
    "load_query": ("GET", "/load?x=%ED%A0%80", None), "health_escaped": ("GET", "/%68ealth", None),
}
#: The routes the gate leaves open: each must answer as the same request to a server without --api-key does.
AUTH_OPEN = {"health", "ping", "metrics", "version", "load", "options", "metrics_query", "health_head", "ping_get",
             "version_post", "metrics_head", "load_query", "health_escaped"}


def raw_request(port: int, method: str, path: str, headers: list[tuple[bytes, bytes]], body: Any
                ) -> tuple[int, dict[str, str], bytes]:
    """One request over its own connection, headers sent as these bytes (httpx refuses some of them): the status,
    the answer's headers (lower-case names) and its body (read to the close)."""
    data = b"" if body is None else json.dumps(body).encode()
    head = [f"{method} {path} HTTP/1.1".encode(), b"Host: t", b"Connection: close",
            *[k + b": " + v for k, v in headers]]
    if body is not None:
        head += [b"Content-Type: application/json", f"Content-Length: {len(data)}".encode()]
    elif method in ("POST", "DELETE"):
        head.append(b"Content-Length: 0")
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + data)
        got = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    top, _, rest = got.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines and len(lines[0].split()) > 1 else 0
    hdrs = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        hdrs[k.strip().lower()] = v.strip()
    if hdrs.get("transfer-encoding") == "chunked":  # the stream's chunks joined
        out, buf = b"", rest
        while buf:
            size, _, buf = buf.partition(b"\r\n")
            n = int(size or b"0", 16)
            if not n:
                break
            out, buf = out + buf[:n], buf[n + 2:]
        rest = out
    return status, hdrs, rest


def auth_judge(name: str, status: int, hdrs: dict[str, str], body: bytes, passes: bool, route_name: str) -> list[str]:
    """Why an auth case is a suspect: a refused header set answered other than 401 in the route's error shape (with
    WWW-Authenticate: Bearer), or a right one answered 401; the gate's answers do not read as the route's own."""
    why = []
    if route_name in AUTH_OPEN or passes:
        if status == 401:
            why.append("401 for a key the server takes" if passes else "401 on an open path")
        if status >= 500 or status == 0:
            why.append(f"status {status}")
        return why
    if status == 431 and hdrs.get("content-type") == "application/json":  # a head past the limit: refused unread
        return why
    if status != 401:
        why.append(f"status {status} (a request without the key served)")
        return why
    if "bearer" not in hdrs.get("www-authenticate", "").lower():
        why.append("401 without WWW-Authenticate: Bearer")
    if route_name == "models_head":
        return why
    rec = {"body": body.decode("utf-8", "replace")}
    error, bad = error_of(rec, AUTH_ROUTES[route_name][1].startswith("/v1/messages"))
    if error is None:
        why.append(f"401: {bad}")
    elif KEY in body.decode("utf-8", "replace"):
        why.append("401 echoes the key")
    return why


def open_view(route_name: str, status: int, hdrs: dict[str, str], body: bytes) -> dict[str, Any]:
    """What an open route's answer says, less what moves from one request to the next (a metric's value, a load's
    count): its status, the headers a client reads, and its body (``/metrics``: the metric families it lists;
    ``/load``: its keys)."""
    text = body.decode("utf-8", "replace")
    view: Any = text
    if route_name.startswith("metrics") and status == 200:
        view = sorted({ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE ") and len(ln.split()) > 2})
    elif route_name == "load" and status == 200:
        try:
            doc = json.loads(text)
            view = sorted(doc) if isinstance(doc, dict) else doc
        except ValueError:
            pass
    return {"status": status, **{k: hdrs.get(k) for k in ("content-type", "allow", "www-authenticate", "connection")},
            "body": view}


def open_diff(auth: dict[str, Any], plain: dict[str, Any]) -> str | None:
    """How an open route's answer under --api-key differs from the same request's on a server without it."""
    diffs = []
    for k in auth:
        if auth[k] != plain[k]:
            a, p = (auth[k], plain[k]) if k != "body" or not isinstance(auth[k], list) else (
                sorted(set(auth[k]) - set(plain[k])), sorted(set(plain[k]) - set(auth[k])))
            diffs.append(f"{k} {str(a)[:80]!s} (without auth {str(p)[:80]!s})")
    return "; ".join(diffs) or None


#: --group admin: kvload's own routes and vLLM's /reset_prefix_cache, hostile query strings, bodies and methods.
def admin_cases() -> list[tuple[str, str, str, Any]]:
    """(name, method, path, body or None)."""
    junk = {"long": "x" * 8000, "pct_surrogate": "%ED%A0%80", "pct_nul": "a%00b", "pct_bad": "%zz",
            "unicode": "%E2%98%83", "dots": "..", "dotted": "a..b", "dot_end": "seed.", "dot_start": ".seed",
            "dashes": "--seed", "flag": "--max-model-len", "bracket": "a[0]", "dunder": "__class__",
            "proto": "__proto__", "deep": ".".join(["a"] * 2000), "space": "+seed+", "empty": "", "mapping":
            "override_generation_config", "mapping_key": "override_generation_config.temperature",
            "upper": "SEED", "tab": "se%09ed", "newline": "seed%0A", "glob": "*", "regex": "se.*d", "json":
            "%7B%22a%22%3A1%7D", "int": "1", "known": "max_seq_len", "known2": "kv_cache_config.max_tokens"}
    cases = [(f"get.explain.{k}", "GET", f"/v1/kvload/explain?field={v}", None) for k, v in junk.items()]
    cases += [("get.explain.no_field", "GET", "/v1/kvload/explain", None),
              ("get.explain.bare_field", "GET", "/v1/kvload/explain?field", None),
              ("get.explain.two_fields", "GET", "/v1/kvload/explain?field=max_seq_len&field=max_seq_len", None),
              ("get.explain.field_list", "GET", "/v1/kvload/explain?field[]=seed", None),
              ("get.explain.other", "GET", "/v1/kvload/explain?field=max_seq_len&zzz=1", None),
              ("get.explain.key_surrogate", "GET", "/v1/kvload/explain?%ED%A0%80=1", None),
              ("get.explain.key_long", "GET", "/v1/kvload/explain?" + "z" * 8000 + "=1", None),
              ("get.explain.many", "GET", "/v1/kvload/explain?" + "&".join(f"k{i}=1" for i in range(2000)), None),
              ("get.explain.amp", "GET", "/v1/kvload/explain?&&&field=max_seq_len&&", None),
              ("get.explain.semicolon", "GET", "/v1/kvload/explain?field=max_seq_len;zzz=1", None),
              ("get.explain.post", "POST", "/v1/kvload/explain?field=max_seq_len", {"field": "seed"}),
              ("get.explain.head", "HEAD", "/v1/kvload/explain?field=max_seq_len", None),
              ("get.explain.head_bad", "HEAD", "/v1/kvload/explain?field=zzz", None)]
    for route in ("audit", "kv_events"):
        for k, q in {"plain": "", "unknown": "?zzz=1", "empty": "?", "amp": "?&", "pct": "?%ED%A0%80",
                     "nul": "?a%00=1", "long": "?" + "z" * 8000, "eq": "?=", "many": "?" + "&".join(
                         f"k{i}=1" for i in range(2000)), "pct_bad": "?%zz=1"}.items():
            cases.append((f"get.{route}.{k}", "GET", f"/v1/kvload/{route}{q}", None))
        cases += [(f"get.{route}.post", "POST", f"/v1/kvload/{route}", {"a": 1}),
                  (f"get.{route}.delete", "DELETE", f"/v1/kvload/{route}", None),
                  (f"get.{route}.head", "HEAD", f"/v1/kvload/{route}", None),
                  (f"get.{route}.slash", "GET", f"/v1/kvload/{route}/", None)]
    for k, b in {"plain": Raw(b"", None), "json": {"a": 1}, "not_json": Raw(b"hello"), "deep": Raw(b"[" * 100_000),
                 "form": Raw(b"a=1", "application/x-www-form-urlencoded"), "big": Raw(b"x" * 2_000_000)}.items():
        cases.append((f"get.reset_prefix_cache.{k}", "POST", "/reset_prefix_cache", b))
    cases += [("get.reset_prefix_cache.query", "POST", "/reset_prefix_cache?zzz=%ED%A0%80", Raw(b"", None)),
              ("get.reset_prefix_cache.get", "GET", "/reset_prefix_cache", None),
              ("get.reset_prefix_cache.put", "PUT", "/reset_prefix_cache", None),
              ("get.reset_prefix_cache.head", "HEAD", "/reset_prefix_cache", None),
              ("get.reset_prefix_cache.slash", "POST", "/reset_prefix_cache/", Raw(b"", None))]
    return cases


#: --group beam (a server started with ``max_beam_width`` BEAM_WIDTH): the beam search's own fields and those it
#: meets (``BEAM_FIELDS``), every hostile value on top of a good beam search (``use_beam_search``, ``n`` 2), and
#: ``beam_combos``: meaningful values of each with the status kvload answers them with (a 200's choices checked).
BEAM_WIDTH = 4
_BEAM_COMMON = ("use_beam_search", "length_penalty", "n", "stream", "stream_options", "logprobs", "stop",
                "stop_token_ids", "max_tokens", "structured_outputs", "response_format", "temperature", "top_p",
                "top_k", "min_p", "seed", "ignore_eos", "echo", "include_stop_str_in_output", "prompt_logprobs",
                "min_tokens", "priority", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                "bad_words", "allowed_token_ids", "truncate_prompt_tokens", "return_token_ids", "guided_regex",
                "cache_salt", "skip_special_tokens")
BEAM_FIELDS = {"beam_completion": (*_BEAM_COMMON, "best_of", "prompt"),
               "beam_chat": (*_BEAM_COMMON, "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                             "messages", "continue_final_message", "add_generation_prompt")}
_BEAM = {"use_beam_search": True, "n": 2}


def beam_routes() -> list[Route]:
    """The two routes that serve beam search, their good request a search of two beams."""
    return [Route("beam_completion", "/v1/completions", {"prompt": "w1 w2 w3", "max_tokens": 3, **_BEAM},
                  BEAM_FIELDS["beam_completion"], stream=True),
            Route("beam_chat", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, **_BEAM},
                  BEAM_FIELDS["beam_chat"], stream=True)]


def beam_combos(route: Route) -> dict[str, tuple[dict[str, Any], int]]:
    """name -> (body, the status expected): each beam field's meaningful values and its combinations with n,
    best_of, stream, logprobs, stop, max_tokens and structured outputs (a name's middle part is the field a 400
    names)."""
    g, chat = route.good, route.tag == "beam_chat"
    long = {**g, "max_tokens": 12, "ignore_eos": True}
    c: dict[str, tuple[dict[str, Any], int]] = {
        "n.one": ({**g, "n": 1}, 200), "n.width": ({**g, "n": BEAM_WIDTH}, 200),
        "n.past_width": ({**g, "n": BEAM_WIDTH + 1}, 400),
        "n.absent": ({k: v for k, v in g.items() if k != "n"}, 200), "n.null": ({**g, "n": None}, 200),
        "n.float_int": ({**g, "n": 2.0}, 400), "n.huge_width": ({**g, "n": 10 ** 6}, 400),
        "use_beam_search.true_str": ({**g, "use_beam_search": "true"}, 400),
        "use_beam_search.one_int": ({**g, "use_beam_search": 1}, 400),
        "use_beam_search.null": ({**g, "use_beam_search": None}, 200),
        "use_beam_search.off_n_past_width": ({**g, "use_beam_search": False, "n": BEAM_WIDTH + 1}, 200),
        "use_beam_search.off_with_penalty": ({**g, "use_beam_search": False, "length_penalty": 2.0}, 200),
        "length_penalty.zero": ({**long, "length_penalty": 0}, 200),
        "length_penalty.neg": ({**long, "length_penalty": -1.0}, 200),
        "length_penalty.big": ({**long, "length_penalty": 1e308}, 200),
        "length_penalty.neg_big": ({**long, "length_penalty": -1e308}, 200),
        "length_penalty.tiny": ({**long, "length_penalty": 5e-324}, 200),
        "length_penalty.int": ({**long, "length_penalty": 3}, 200),
        "length_penalty.bool": ({**long, "length_penalty": True}, 400),
        "stream.on": ({**g, "stream": True}, 200), "stream.width": ({**long, "n": BEAM_WIDTH, "stream": True}, 200),
        "stream.usage": ({**g, "stream": True, "stream_options": {"include_usage": True,
                                                                  "continuous_usage_stats": True}}, 200),
        "stream.logprobs": ({**g, "stream": True, **({"logprobs": True, "top_logprobs": 2} if chat
                                                     else {"logprobs": 2})}, 200),
        "stream_options.without_stream": ({**g, "stream_options": {"include_usage": True}}, 400),
        "stop.word": ({**g, "stop": ["w9"]}, 400), "stop.str": ({**g, "stop": "w9"}, 400),
        "stop.empty_list": ({**g, "stop": []}, 200), "stop.null": ({**g, "stop": None}, 200),
        "stop.empty_str": ({**g, "stop": ""}, 400), "stop.list_empty_str": ({**g, "stop": [""]}, 400),
        "stop_token_ids.one": ({**g, "stop_token_ids": [5]}, 400),
        "stop_token_ids.empty": ({**g, "stop_token_ids": []}, 200),
        "include_stop_str_in_output.true": ({**g, "include_stop_str_in_output": True}, 200),
        "max_tokens.one": ({**g, "max_tokens": 1}, 200),
        "max_tokens.to_context": ({**g, "max_tokens": 64 - (5 if chat else 3), "ignore_eos": True}, 200),
        "max_tokens.past_context": ({**g, "max_tokens": 65 - (5 if chat else 3), "ignore_eos": True}, 400),
        "max_tokens.huge": ({**g, "max_tokens": 10 ** 6}, 400),
        "max_tokens.null": ({**g, "max_tokens": None}, 200),
        "max_tokens.zero": ({**g, "max_tokens": 0}, 400),
        "ignore_eos.width_long": ({**long, "n": BEAM_WIDTH, "max_tokens": 40}, 200),
        "structured_outputs.regex": ({**g, "structured_outputs": {"regex": "w[0-9]"}}, 400),
        "structured_outputs.json_object": ({**g, "structured_outputs": {"json_object": True}}, 400),
        "structured_outputs.choice": ({**g, "structured_outputs": {"choice": ["w1", "w2"]}}, 400),
        "structured_outputs.empty": ({**g, "structured_outputs": {}}, 400),
        "response_format.json_object": ({**g, "response_format": {"type": "json_object"}}, 400),
        "response_format.text": ({**g, "response_format": {"type": "text"}}, 200),
        "guided_regex.regex": ({**g, "guided_regex": "w[0-9]"}, 400),
        "temperature.zero": ({**g, "temperature": 0}, 200), "temperature.null": ({**g, "temperature": None}, 200),
        "temperature.one": ({**g, "temperature": 1.0}, 400), "temperature.tiny": ({**g, "temperature": 1e-9}, 400),
        # greedy decoding's: reported as setting_ignored (what greedy ignores), as on a plain greedy request
        "top_p.half": ({**g, "top_p": 0.5}, 200), "top_p.one": ({**g, "top_p": 1.0}, 200),
        "top_k.two": ({**g, "top_k": 2}, 200), "top_k.off": ({**g, "top_k": -1}, 200),
        "min_p.half": ({**g, "min_p": 0.5}, 200), "min_p.zero": ({**g, "min_p": 0}, 200),
        "seed.one": ({**g, "seed": 1}, 200),
        "min_tokens.two": ({**g, "min_tokens": 2}, 400), "min_tokens.zero": ({**g, "min_tokens": 0}, 200),
        "repetition_penalty.neutral": ({**g, "repetition_penalty": 1.0}, 200),
        "repetition_penalty.more": ({**g, "repetition_penalty": 1.2}, 400),
        "presence_penalty.one": ({**g, "presence_penalty": 1.0}, 400),
        "frequency_penalty.zero": ({**g, "frequency_penalty": 0.0}, 200),
        "logit_bias.one": ({**g, "logit_bias": {"5": 1}}, 400), "logit_bias.empty": ({**g, "logit_bias": {}}, 200),
        "bad_words.one": ({**g, "bad_words": ["w9"]}, 400),
        "allowed_token_ids.two": ({**g, "allowed_token_ids": [5, 6]}, 400),
        "prompt_logprobs.one": ({**g, "prompt_logprobs": 1}, 400),
        "prompt_logprobs.zero": ({**g, "prompt_logprobs": 0}, 400),
        "priority.one": ({**g, "priority": 1}, 400), "priority.zero": ({**g, "priority": 0}, 200),
        "truncate_prompt_tokens.two": ({**g, "truncate_prompt_tokens": 2}, 200),
        "return_token_ids.true": ({**g, "return_token_ids": True}, 200),
        "cache_salt.one": ({**g, "cache_salt": "s1"}, 200),
        "skip_special_tokens.false": ({**g, "skip_special_tokens": False}, 200),
    }
    if chat:
        c.update({
            "logprobs.top_zero": ({**g, "logprobs": True, "top_logprobs": 0}, 200),
            "logprobs.top_max": ({**g, "logprobs": True, "top_logprobs": 20}, 200),
            "top_logprobs.past": ({**g, "logprobs": True, "top_logprobs": 21}, 400),
            "top_logprobs.without_logprobs": ({**g, "top_logprobs": 2}, 400),
            "logprobs.false": ({**g, "logprobs": False}, 200),
            "max_completion_tokens.one": ({k: v for k, v in g.items() if k != "max_tokens"} | {
                "max_completion_tokens": 1}, 200),
            "max_completion_tokens.both": ({**g, "max_completion_tokens": 2}, 400),
            "tool_choice.required": ({**g, "tools": [WEATHER], "tool_choice": "required"}, 400),
            "tool_choice.named": ({**g, "tools": [WEATHER], "tool_choice": {
                "type": "function", "function": {"name": "get_weather"}}}, 400),
            "tools.none_choice": ({**g, "tools": [WEATHER], "tool_choice": "none"}, 200),
            "echo.true": ({**g, "echo": True}, 200),
            "echo.assistant_logprobs": ({**g, "messages": [*CHAT, {"role": "assistant", "content": "w4"}],
                                         "echo": True, "logprobs": True, "add_generation_prompt": False,
                                         "continue_final_message": True}, 200),
            "continue_final_message.true": ({**g, "messages": [*CHAT, {"role": "assistant", "content": "w4"}],
                                             "continue_final_message": True, "add_generation_prompt": False}, 200),
            "n.two_turns_width": ({**long, "n": BEAM_WIDTH, "messages": [*CHAT, {"role": "assistant", "content": "w4"},
                                                                         {"role": "user", "content": "w5"}]}, 200),
        })
    else:
        c.update({
            "logprobs.zero": ({**g, "logprobs": 0}, 200), "logprobs.max": ({**g, "logprobs": 20}, 200),
            "logprobs.past": ({**g, "logprobs": 21}, 400), "logprobs.width_long": ({**long, "logprobs": 5,
                                                                                    "n": BEAM_WIDTH}, 200),
            "best_of.eq_n": ({**g, "best_of": 2}, 200), "best_of.gt_n": ({**g, "best_of": BEAM_WIDTH}, 400),
            "n.past_width_best_of": ({**g, "n": BEAM_WIDTH + 1, "best_of": BEAM_WIDTH + 1}, 400),
            "best_of.alone": ({k: v for k, v in g.items() if k != "n"} | {"best_of": 2}, 400),
            "best_of.null": ({**g, "best_of": None}, 200),
            "echo.true": ({**g, "echo": True}, 200),
            "echo.zero_tokens": ({**g, "echo": True, "max_tokens": 0}, 400),
            "echo.logprobs": ({**g, "echo": True, "logprobs": 1}, 400),  # the prompt is not scored
            "echo.logprobs_zero": ({**g, "echo": True, "logprobs": 0}, 400),
            "prompt.two": ({**g, "prompt": ["w1 w2", "w3 w4 w5"]}, 200),
            "prompt.two_width": ({**long, "prompt": ["w1 w2", "w3 w4 w5"], "n": BEAM_WIDTH}, 200),
            "prompt.ids": ({**g, "prompt": [5, 6, 7]}, 200),
            "prompt.two_ids": ({**g, "prompt": [[5, 6, 7], [8]]}, 200),
            "prompt.empty_ids": ({**g, "prompt": []}, 400),
            "prompt.to_context": ({**g, "prompt": " ".join(["w1"] * 63), "max_tokens": 1}, 200),
            "prompt.past_context": ({**g, "prompt": " ".join(["w1"] * 64), "max_tokens": 1}, 400),
            "stream.two_prompts": ({**long, "prompt": ["w1 w2", "w3"], "stream": True}, 200),
            "stream.echo": ({**g, "echo": True, "stream": True}, 200),
        })
    return c


def beam_shape(body: dict[str, Any], text: str, route: Route) -> str | None:
    """What is wrong with a beam search's 200 (None: nothing): ``n`` choices a prompt (each index once), each with
    its finish reason, logprobs where asked; a stream's chunks valid JSON, ending with ``[DONE]``."""
    n = body.get("n") or 1
    prompts = body.get("prompt") if route.tag == "beam_completion" else None
    count = n * (len(prompts) if isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))
                 else 1)
    if body.get("stream"):
        lines = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
        if not lines or lines[-1] != "[DONE]":
            return f"stream does not end with [DONE]: {lines[-1:]}"
        try:
            chunks = [json.loads(x) for x in lines[:-1]]
        except ValueError as e:
            return f"a chunk is not JSON: {e}"
        seen = {ch["index"] for doc in chunks for ch in doc.get("choices", [])}
        ends = [ch for doc in chunks for ch in doc.get("choices", []) if ch.get("finish_reason")]
        if seen != set(range(count)) or len(ends) != count:
            return f"stream: choices {sorted(seen)}, {len(ends)} finished, {count} expected"
        return None
    doc = json.loads(text)
    choices = doc.get("choices", [])
    if sorted(ch["index"] for ch in choices) != list(range(count)):
        return f"choices {[ch['index'] for ch in choices]}, {count} expected"
    if any(not ch.get("finish_reason") for ch in choices):
        return "a choice without finish_reason"
    if body.get("logprobs") not in (None, False) and any(ch.get("logprobs") is None for ch in choices):
        return "logprobs asked, a choice without them"
    return None


def put(body: Any, path: str, value: Any) -> Any:
    """A deep copy of ``body`` with ``value`` at the dotted ``path``."""
    body = json.loads(json.dumps(body))
    keys = path.split(".")
    node = body
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    last = keys[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return body


def field_cases(route: Route, nested_only: bool = False) -> dict[str, Any]:
    cases: dict[str, Any] = {}
    if nested_only:
        return {f"{path}.{k}": put({**route.good, **extra}, path, v) for tag, extra, path in NESTED if tag == route.tag
                for k, v in HOSTILE.items() if k != "long_str"}
    text = json.dumps(route.good)
    inner = text[1:-1]
    for f in route.fields:
        for k, v in HOSTILE.items():
            cases[f"{f}.{k}"] = {**route.good, f: v}
        for k, lit in LITERALS.items():
            body = {kk: vv for kk, vv in route.good.items() if kk != f}
            rest = json.dumps(body)[1:-1]
            cases[f"{f}.{k}"] = Raw(f'{{{rest}{", " if rest else ""}"{f}": {lit}}}'.encode())
    for tag, extra, path in NESTED:
        if tag == route.tag:
            for k, v in HOSTILE.items():
                if k != "long_str":
                    cases[f"{path}.{k}"] = put({**route.good, **extra}, path, v)
    cases["typo"] = {**route.good, "max_token": 3} if "max_tokens" in route.good else {**route.good, "promt": "w1"}
    cases["unknown"] = {**route.good, "zzz": 1}
    cases["unknown_long"] = {**route.good, "z" * 100_000: 1}
    cases["unknown_surrogate"] = Raw(f'{{{inner}, "z\\ud800": 1}}'.encode())
    cases.update(raw_bodies(route))
    return cases


# --- the server ---------------------------------------------------------------------------------------------------


class Captured(logging.Handler):
    """Every log record with a traceback, or that says a request failed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if record.exc_info or "Traceback" in msg or "request_failed" in msg or record.levelno >= logging.ERROR:
            self.records.append(f"{record.name}: {msg[:300]}")


class External:
    """``--tp_size N``: ``kvload serve CKPT --tp_size N ...`` (kvload starts and supervises its N ranks) in a session
    of its own. What the sweep reads of an in-process server is read here over HTTP (``/metrics``, ``/load``) and
    from the command's stderr (rank 0's lines, ``--debug``: every rank's); every rank must still be alive after each
    case. The ranks' state is rank 0's: a rank that diverged fails the next step's schedule check, which ends the
    server (so the case's good request after it fails, and ``ranks_dead`` is set)."""

    START_S = 300.0

    def __init__(self, argv: list[str]) -> None:
        import subprocess

        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
               "PYTHONPATH": str(REPO)}
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        self.argv = [sys.executable, "-m", "kvload", "serve", *argv]
        self.proc = subprocess.Popen(self.argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
        atexit.register(self.close)
        self.lines: list[str] = []
        deadline = time.monotonic() + self.START_S
        line = ""
        while " at http://" not in line:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise SystemExit(f"the server did not start: {''.join(self.lines[-5:])}")
            line = self.proc.stderr.readline()
            self.lines.append(line)
        self.url = line.split(" at ", 1)[1].split(" ", 1)[0]
        self.server = argparse.Namespace(port=int(self.url.rsplit(":", 1)[1]))
        self.ranks = self._children()
        self.rank0 = next((p for p in self.ranks if b"RANK=0" in Path(f"/proc/{p}/environ").read_bytes().split(b"\0")),
                          None)
        self.seen = len(self.lines)
        threading.Thread(target=self._read, daemon=True).start()

    def _children(self) -> list[int]:
        deadline = time.monotonic() + 30
        while True:
            try:
                kids = [int(c) for c in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
                        .split()]
            except OSError:
                kids = []
            if len(kids) >= 2 or time.monotonic() > deadline:
                return kids
            time.sleep(0.1)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def new_log(self) -> list[str]:
        """The stderr lines since the last call that say something failed."""
        lines, self.seen = self.lines[self.seen:], len(self.lines)
        return [x.rstrip()[:300] for x in lines if "Traceback" in x or "request_failed" in x or "error" in x.lower()
                or "lost contact" in x]

    def dead(self) -> int:
        def alive(pid: int) -> bool:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                return False
            return stat.rsplit(")", 1)[1].split()[0] != "Z"

        return sum(not alive(p) for p in [self.proc.pid, *self.ranks])

    def held(self, base_used: int) -> dict[str, int]:
        """held()'s figures from rank 0's /load and /metrics, and how many of the command and its ranks died."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        out = {"ranks_dead": self.dead()}
        if out["ranks_dead"]:
            return out
        try:
            with httpx.Client(base_url=self.url, timeout=TIMEOUT) as c:
                out["in_flight"] = c.get("/load").json()["server_load"]
                text = c.get("/metrics").text
        except Exception as e:
            return {**out, "no_answer": 1, f"({type(e).__name__})": 1}
        used = 0
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "kvload_num_requests_running":
                    out["running"] = int(s.value)
                elif s.name == "kvload_num_requests_waiting":
                    out["waiting"] = int(s.value)
                elif s.name == "kvload_kv_cache_blocks" and s.labels.get("state") == "used":
                    used += int(s.value)
        out["kv_used_over_baseline"] = used - base_used
        return {k: v for k, v in out.items() if v}

    def used_blocks(self) -> int:
        return self.held(0).get("kv_used_over_baseline", 0)

    def close(self) -> None:
        """SIGTERM to the command (it passes it to its ranks and must exit 0 within 60 s), then SIGKILL to the
        group; what was left is said."""
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                print("the server did not stop within 60 s of SIGTERM", file=sys.stderr)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.exit_status = self.proc.returncode


def external_argv(ckpt: Path, a: Any, state: dict[str, Any], kv: dict[str, Any], load: dict[str, Any]) -> list[str]:
    """The ``kvload serve`` command line of the in-process server the group would run, for ``--tp_size``."""
    import shlex

    argv = [str(ckpt), "--tp_size", str(a.tp_size), "--port", "0", "--dtype", "float32", "--max_seq_len", "64",
            "--max_num_tokens", "16", "--max_tokens", str(kv["max_tokens"]), "--tokens_per_block",
            str(kv["tokens_per_block"]), "--served-model-name", state["model_name"]]
    if "event_buffer_max_size" in kv:
        argv += ["--event_buffer_max_size", str(kv["event_buffer_max_size"])]
    if state.get("tool_call_parser"):
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", state["tool_call_parser"]]
    if state.get("reasoning_parser"):
        argv += ["--reasoning-parser", state["reasoning_parser"]]
    if state.get("api_keys"):
        argv += ["--api-key", *state["api_keys"]]
    if state.get("enable_reset_prefix_cache"):
        argv += ["--enable-reset-prefix-cache"]
    if "max_beam_width" in load:
        argv += ["--max_beam_width", str(load["max_beam_width"])]
    return argv + shlex.split(a.server_args)


def audit_failures(served: Any, seen: int) -> tuple[list[str], int]:
    """The audit log's request_failed records (and any with an exception) past the first ``seen``; for an
    ``External`` server, its stderr's failure lines since the last call."""
    if isinstance(served, External):
        return served.new_log(), 0
    head, tail, _ = served.state.result.audit.tail()
    records = [*head, *tail]
    bad = [json.dumps(r, default=str)[:300] for r in records[seen:]
           if r.get("event") in ("request_failed", "engine_failed") or "exception" in r or "Traceback" in str(r)]
    return bad, len(records)


def held(served: Any, base_used: int) -> dict[str, int]:
    if isinstance(served, External):
        return served.held(base_used)
    state = served.state
    engine = state.engine
    snap = engine.snapshot()
    manager = snap["manager"]
    used = sum(g.used for g in manager.groups.values()) if manager is not None else 0
    out = {"in_flight": state.in_flight, "running": snap["running"], "waiting": snap["waiting"],
           "live": len(engine._live), "kv_requests": manager.requests if manager is not None else 0,
           "kv_used_over_baseline": used - base_used,
           # a beam search running or queued, and what waits behind one (engine.serving's own queues)
           "beam": int(getattr(engine, "_beam", None) is not None), "beam_ids": len(getattr(engine, "_beam_ids", ())),
           "held_back": len(getattr(engine, "_held", ()))}
    return {k: v for k, v in out.items() if v}


def leftovers(served: Any, base_used: int, wait: float = 5.0) -> str:
    deadline = time.monotonic() + wait
    while True:
        h = held(served, base_used)
        if not h or time.monotonic() > deadline:
            return ", ".join(f"{k}={v}" for k, v in h.items())
        time.sleep(0.02)


def resources(served: Any = None) -> dict[str, int]:
    """This process's threads and open fds: the server's; an ``External`` server's are its rank 0's."""
    if isinstance(served, External) and served.rank0:
        status = Path(f"/proc/{served.rank0}/status").read_text()
        threads = int(next(x for x in status.splitlines() if x.startswith("Threads:")).split()[1])
        return {"threads": threads, "fds": len(os.listdir(f"/proc/{served.rank0}/fd"))}
    return {"threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd"))}


class Sweep:
    def __init__(self, served: Any, http: Any, capture: Captured) -> None:
        self.served, self.http, self.capture = served, http, capture
        self.baseline: dict[str, Any] = {}
        self.audit_seen = audit_failures(served, 0)[1]
        self.base_used = 0
        self.last_text = ""  # the last probe's whole answer (a record keeps 8,000 characters)
        self.plain_port = 0  # --group auth: a server without --api-key, the open routes' baseline

    def post(self, path: str, body: Any, method: str = "POST", timeout: float | None = None) -> Any:
        wait = TIMEOUT if timeout is None else timeout
        if isinstance(body, Raw):
            return self.http.request(method, path, content=body.data, timeout=wait,
                                     headers={} if body.media is None else {"content-type": body.media})
        return self.http.request(method, path, content=json.dumps(body).encode(), timeout=wait,
                                 headers={"content-type": "application/json"})

    def good_answer(self, route: Route) -> Any:
        r = self.post(route.path, route.good, timeout=timeout_for(route.tag))
        if r.status_code != 200:
            return f"status {r.status_code}: {r.text[:200]}"
        return answer_of(route, r.json())

    def after(self, rec: dict[str, Any], route: Route | None) -> dict[str, Any]:
        """The checks once a case is answered: the same route's good request, leftovers, log records."""
        if route is not None:
            try:
                got = self.good_answer(route)
                rec["still_ok"] = True if got == self.baseline[route.tag] else f"answer now {str(got)[:200]}"
            except Exception as e:
                rec["still_ok"] = f"{type(e).__name__}: {e}"[:200]
        left = leftovers(self.served, self.base_used)
        if left:
            rec["left"] = left
        logs, self.audit_seen = audit_failures(self.served, self.audit_seen)
        logs += self.capture.records
        self.capture.records.clear()
        if logs:
            rec["log"] = logs[:3]
        return rec

    def probe(self, route: Route | None, name: str, body: Any, path: str, method: str = "POST") -> dict[str, Any]:
        start = time.monotonic()
        try:
            r = self.post(path, body, method, timeout_for(name)) if method in ("POST", "DELETE") or body is not None \
                else self.http.request(method, path, timeout=timeout_for(name))
            rec: dict[str, Any] = {"case": name, "status": r.status_code, "s": round(time.monotonic() - start, 3),
                                   "body": r.text[:8000], "ctype": r.headers.get("content-type", "")}
            self.last_text = r.text
        except Exception as e:
            rec = {"case": name, "status": None, "exc": f"{type(e).__name__}: {e}"[:300],
                   "s": round(time.monotonic() - start, 3)}
        if route is not None and route.tag == "responses" and rec["status"] == 200:
            self.read_back(rec)
        return self.after(rec, route)

    def read_back(self, rec: dict[str, Any]) -> None:
        """A kept response read back (GET, and its input items): what was kept must be servable."""
        try:
            rid = json.loads(rec["body"])["id"]
        except (ValueError, KeyError, TypeError):
            return
        for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/input_items"):
            r = self.http.get(path)
            if r.status_code not in (200, 404):  # 404: not kept (store: false)
                rec["read_back"] = f"GET {path.replace(rid, '{id}')}: {r.status_code} {r.text[:200]}"

    def hangup(self, route: Route, name: str, body: dict[str, Any], reset: bool) -> dict[str, Any]:
        """A streaming request whose client goes once the first chunk (``data:``) is in."""
        data = json.dumps(body).encode()
        head = (f"POST {route.path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        start = time.monotonic()
        rec: dict[str, Any] = {"case": name, "status": None}
        try:
            with socket.create_connection(("127.0.0.1", self.served.server.port), timeout=timeout_for(name)) as sock:
                sock.sendall(head + data)
                got = b""
                while b"data:" not in got and b"event:" not in got:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    got += chunk
                rec["status"] = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/") else None
                rec["body"] = got[:300].decode("utf-8", "replace")
                if reset:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        except Exception as e:
            rec["exc"] = f"{type(e).__name__}: {e}"[:300]
        rec["s"] = round(time.monotonic() - start, 3)
        return self.after(rec, route)

    def concurrency(self, route: Route, name: str, n: int = 32) -> dict[str, Any]:
        """``n`` requests at once: good (checked against the baseline), bad, streams hung up after the first chunk,
        clients that reset once the body is sent."""
        results: list[Any] = []
        wait = timeout_for(name)
        long_body = {**route.good}
        for key in ("max_tokens", "max_output_tokens"):
            if key in long_body:
                long_body[key] = 40

        def one(i: int) -> None:
            import httpx

            try:
                kind = i % 4
                if kind == 0:
                    with httpx.Client(base_url=self.served.url, timeout=wait) as c:
                        r = c.post(route.path, json=route.good)
                    results.append("ok" if r.status_code == 200 and answer_of(route, r.json()) ==
                                   self.baseline[route.tag] else f"good: {r.status_code} {r.text[:100]}")
                elif kind == 1:
                    with httpx.Client(base_url=self.served.url, timeout=wait) as c:
                        r = c.post(route.path, json={**route.good, "zzz": i})
                    results.append("refused" if r.status_code == 400 else f"bad: {r.status_code} {r.text[:100]}")
                elif kind == 2 and route.stream:
                    rec = self._stream_and_go({**long_body, "stream": True}, route.path, i % 8 == 2, wait)
                    results.append("gone" if rec is None else rec)
                else:
                    data = json.dumps(long_body).encode()
                    head = (f"POST {route.path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                            f"Content-Length: {len(data)}\r\n\r\n").encode()
                    with socket.create_connection(("127.0.0.1", self.served.server.port), timeout=wait) as sock:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                        sock.sendall(head + (data if i % 8 < 4 else data[: len(data) // 2]))
                        time.sleep(0.02 * (i % 5))
                    results.append("gone")
            except Exception as e:
                results.append(f"{type(e).__name__}: {e}"[:100])

        rec = self.after(at_once(name, one, n, results, ("ok", "refused", "gone"), Counter, wait), route)
        if "left" in rec:  # a longer wait: an abort lands at the next step
            rec["left"] = leftovers(self.served, self.base_used, wait=30.0) or None
            if rec["left"] is None:
                del rec["left"]
        return rec

    def _stream_and_go(self, body: dict[str, Any], path: str, reset: bool, wait: float) -> str | None:
        data = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", self.served.server.port), timeout=wait) as sock:
            sock.sendall(head + data)
            got = b""
            while b"data:" not in got:
                chunk = sock.recv(4096)
                if not chunk:
                    return f"stream ended before a chunk: {got[:100]!r}"
                got += chunk
            if not got.startswith(b"HTTP/1.1 200"):
                return f"stream: {got[:100]!r}"
            if reset:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        return None


# --- judging ------------------------------------------------------------------------------------------------------


def error_of(rec: dict[str, Any], anthropic: bool) -> tuple[dict[str, Any] | None, str]:
    """The error object, or None and why the body is not in the route's error shape."""
    try:
        doc = json.loads(rec["body"])
    except (ValueError, KeyError, TypeError):
        return None, "not JSON"
    if anthropic:
        if not (isinstance(doc, dict) and doc.get("type") == "error" and isinstance(doc.get("error"), dict)
                and isinstance(doc["error"].get("type"), str) and isinstance(doc["error"].get("message"), str)):
            return None, "not Anthropic's error shape"
        return doc["error"], ""
    if not (isinstance(doc, dict) and isinstance(doc.get("error"), dict)
            and isinstance(doc["error"].get("message"), str) and isinstance(doc["error"].get("type"), str)
            and "param" in doc["error"] and "code" in doc["error"]):
        return None, "not OpenAI's error shape"
    return doc["error"], ""


def judged_ok(tag: str, field: str) -> set[str]:
    """The kinds ``JUDGED_OK`` takes for this field of this route (a beam search's: its own, and the route's)."""
    plain = tag[len("beam_"):] if tag.startswith("beam_") else tag
    return JUDGED_OK.get((tag, field), (set(), ""))[0] | JUDGED_OK.get((plain, field), (set(), ""))[0]


def suspect(r: dict[str, Any]) -> list[str]:
    why = []
    name = r["case"]
    tag = name.split(".", 1)[0]
    anthropic = tag in ("messages", "count_tokens")
    parts = name.split(".")
    kind = parts[-1]
    if r.get("tp_refused"):  # beam search under tensor parallel: refused, naming use_beam_search or a bad field
        error, _ = error_of(r, False)
        if r["status"] != 400 or error is None or not error.get("param"):
            why.append(f"status {r['status']}: not refused naming use_beam_search or a field (no beam search is "
                       "served under tensor parallel)")
        for k, label in (("left", "left behind"), ("log", "server log"), ("still_ok", "good request after")):
            if r.get(k) and r[k] is not True:
                why.append(f"{label}: {str(r[k])[:160]}")
        return why
    # the field a case puts its value in: "stop" of "chat.stop.neg", "role" of "chat.messages.0.role.str"
    path = parts[1:-1]
    field = next((p for p in reversed(path) if not p.isdigit()), None) if path and path[0] not in ("body", "stream") \
        and not name.startswith("get.") and "concurrency" not in name else None
    if r.get("exc"):
        why.append(f"no answer: {r['exc'][:120]}")
    answered = isinstance(r["status"], int)
    if (answered and r["status"] not in OK_STATUSES and not name.endswith("hangup")
            and not (name.startswith("get.reset_prefix_cache.") and r["status"] == 409)) or \
            (not answered and not r.get("exc") and not r.get("dropped")):
        why.append(f"status {r['status']}")
    if isinstance(r["status"], int) and r["status"] >= 400 and "hangup" not in name and "concurrency" not in name \
            and not name.endswith((".head", ".head_bad")):  # HEAD: no body
        error, bad_shape = error_of(r, anthropic)
        if error is None:
            why.append(f"{r['status']}: {bad_shape}")
        else:
            msg = str(error.get("message", ""))
            if "\n" in msg:
                why.append("multi-line message")
            if r["status"] == 400 and field is not None:
                named = str(error.get("param") or "") + " " + msg
                instead = NAMED_INSTEAD.get((tag, kind), ("\0", ""))[0]
                if field not in named and instead not in named:
                    why.append(f"400 not naming {field}")
    if name.startswith("get.explain.") and r["status"] == 400:
        error, _ = error_of(r, False)
        if error is not None and not (isinstance(error.get("param"), str) and error["param"]):
            why.append(f"400 naming {error.get('param')!r}, not the query parameter")
    if r["status"] == 200 and kind in NEVER_OK:
        ok = judged_ok(tag, ".".join(path) or kind)
        if kind not in ok:
            why.append("a hostile value accepted")
    if r.get("sibling_refused") and kind not in judged_ok(tag, ".".join(path)):
        why.append(f"accepted while {r['sibling_refused']} is refused")
    if r.get("still_ok", True) is not True:
        why.append(f"good request after: {r['still_ok']}")
    if r.get("left"):
        why.append(f"left behind: {r['left']}")
    if r.get("log"):
        why.append(f"server log: {r['log'][0][:160]}")
    if r.get("read_back"):
        why.append(f"kept response unreadable: {r['read_back'][:160]}")
    if r.get("expect") is not None and r["status"] != r["expect"] and isinstance(r["status"], int):
        why.append(f"status {r['status']}, {r['expect']} expected")
    if r.get("ran_on"):
        why.append(f"the search ran on after its client went: {r['ran_on']}")
    if r.get("shape"):
        why.append(f"answer: {r['shape']}")
    if r.get("grew"):
        why.append(f"grew: {r['grew']}")
    if isinstance(r.get("s"), float) and r["s"] > timeout_for(name):
        why.append(f"took {r['s']} s")
    return why


def mark_siblings(rows: list[dict[str, Any]]) -> None:
    """Marks each falsy value answered 200 whose truthy sibling (``SIBLINGS``) of the same field was refused."""
    status = {r["case"]: r["status"] for r in rows}
    for r in rows:
        stem, _, kind = r["case"].rpartition(".")
        if kind in SIBLINGS and r["status"] == 200 and status.get(f"{stem}.{SIBLINGS[kind]}") == 400:
            r["sibling_refused"] = SIBLINGS[kind]


# --- GET routes ---------------------------------------------------------------------------------------------------


def get_cases(stored: str) -> list[tuple[str, str, str]]:
    """(name, method, path) of the GET/DELETE routes with hostile paths and queries."""
    junk = {"long": "x" * 8000, "pct_surrogate": "%ED%A0%80", "pct_nul": "a%00b", "pct_bad": "%zz", "dots": "..%2F..",
            "unicode": "%E2%98%83", "slash": "a/b/c"}
    cases = [("get.models.plain", "GET", "/v1/models"), ("get.models.query", "GET", "/v1/models?zzz=1"),
             ("get.health.plain", "GET", "/health"), ("get.health.query", "GET", "/health?x=%00"),
             ("get.ping.post", "POST", "/ping"), ("get.load.plain", "GET", "/load"),
             ("get.metrics.plain", "GET", "/metrics"), ("get.metrics.query", "GET", "/metrics?name[]=%ff"),
             ("get.version.plain", "GET", "/version"), ("get.models.head", "HEAD", "/v1/models"),
             ("get.completions.get", "GET", "/v1/completions"), ("get.chat.put", "PUT", "/v1/chat/completions"),
             ("get.unknown.path", "GET", "/v1/zzz"), ("get.slash.path", "POST", "/v1/completions/")]
    for k, v in junk.items():
        cases += [(f"get.model_card.{k}", "GET", f"/v1/models/{v}"),
                  (f"get.stored.{k}", "GET", f"/v1/responses/{v}"),
                  (f"get.stored_delete.{k}", "DELETE", f"/v1/responses/{v}"),
                  (f"get.input_items.{k}", "GET", f"/v1/responses/{v}/input_items")]
    q = {"limit_neg": "limit=-1", "limit_huge": "limit=" + "9" * 5000, "limit_zero": "limit=0",
         "limit_float": "limit=1.5", "limit_sup": "limit=%C2%B2", "order_bad": "order=zzz", "after_bad": "after=zzz",
         "dup_limit": "limit=1&limit=2", "unknown": "zzz=1", "surrogate": "after=%ED%A0%80", "nul": "order=a%00",
         "long_after": "after=" + "x" * 8000, "empty_limit": "limit=", "stream": "stream=true"}
    for k, v in q.items():
        cases += [(f"get.input_items.{k}", "GET", f"/v1/responses/{stored}/input_items?{v}"),
                  (f"get.stored.{k}", "GET", f"/v1/responses/{stored}?{v}")]
    cases += [("get.stored.ok", "GET", f"/v1/responses/{stored}"),
              ("get.input_items.ok", "GET", f"/v1/responses/{stored}/input_items"),
              ("get.stored_delete.ok", "DELETE", f"/v1/responses/{stored}"),
              ("get.stored.after_delete", "GET", f"/v1/responses/{stored}"),
              ("get.stored_delete.again", "DELETE", f"/v1/responses/{stored}")]
    return cases


def main() -> None:
    global TIMEOUT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="results, one JSON line a case")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    ap.add_argument("--nested", action="store_true", help="only the nested fields' cases (NESTED)")
    ap.add_argument("--summary", action="store_true", help="list the suspects (else the counts only)")
    ap.add_argument("--group", choices=("base", "parsers", "auth", "admin", "beam"), default="base",
                    help="base: the server without parsers (the cases above); parsers: one with --tool-call-parser "
                         "hermes --reasoning-parser deepseek_r1 and the fields they read; auth: one with --api-key "
                         "and every route under odd Authorization / X-Api-Key headers; admin: one with "
                         "--enable-reset-prefix-cache and KV events, kvload's admin routes' queries and bodies; beam: "
                         f"one with max_beam_width {BEAM_WIDTH} and beam searches on completions and chat")
    ap.add_argument("--timeout", type=float, default=TIMEOUT,
                    help=f"seconds a client waits and past which a case is slow (default {TIMEOUT:g}); a beam "
                         f"search's case waits {BEAM_TIMEOUT_SCALE:g} times as long")
    ap.add_argument("--tp_size", type=int, default=0, metavar="N",
                    help="sweep a `kvload serve CKPT --tp_size N` command (N rank processes kvload starts) instead of "
                         "an in-process server: leftovers read from its /metrics and /load, failures from its stderr, "
                         "and every rank must be alive after each case")
    ap.add_argument("--server-args", default="", metavar="ARGS",
                    help="more `kvload serve` flags for --tp_size's command (one string, split as a shell does)")
    ap.add_argument("--every", type=int, default=1, metavar="K",
                    help="a sample: run one case in K of each route's hostile field cases (a group's: its per-route "
                         "cases, and auth's header sets), in order; the hang-ups and concurrency cases all run")
    a = ap.parse_args()
    TIMEOUT = a.timeout
    if a.server_args and not a.tp_size:
        ap.error("--server-args: only with --tp_size (the in-process server takes no flags)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import httpx

    from models.weights import random_model
    from tests.classify_support import VOCAB
    from tests.llm_support import word_tokenizer
    from tests.paged_support import tiny_config
    from tests.serve_support import serving

    work = Path(tempfile.mkdtemp(prefix="serve_gen_sweep-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # the checkpoint was left in $TMPDIR by every run
    ckpt = work / "gen"
    random_model(tiny_config("llama"), device="cpu", dtype="float32", seed=0).save_pretrained(ckpt)
    tok = word_tokenizer(VOCAB)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}w3{% endif %}")
    tok.save_pretrained(ckpt)
    capture = Captured()
    logging.getLogger().addHandler(capture)
    rows: list[dict[str, Any]] = []
    state: dict[str, Any] = {"model_name": "tiny"}
    kv: dict[str, Any] = {"max_tokens": 512, "tokens_per_block": 4}
    headers: dict[str, str] = {}
    load: dict[str, Any] = {}
    if a.group == "parsers":
        state.update(tool_call_parser="hermes", reasoning_parser="deepseek_r1")
    elif a.group == "auth":
        state.update(api_keys=(KEY,), enable_reset_prefix_cache=True)
        headers = {"Authorization": f"Bearer {KEY}"}
    elif a.group == "admin":
        state.update(enable_reset_prefix_cache=True)
        kv["event_buffer_max_size"] = 100
    elif a.group == "beam":
        load["max_beam_width"] = BEAM_WIDTH
    with contextlib.ExitStack() as stack, a.out.open("w") as out:
        if a.tp_size:
            served = External(external_argv(ckpt, a, state, kv, load))
            stack.callback(served.close)
        else:
            served = stack.enter_context(serving(str(ckpt), dtype="float32", max_seq_len=64, max_num_tokens=16,
                                                 kv_cache_config=kv, state=state, **load))
        http = stack.enter_context(httpx.Client(base_url=served.url, timeout=TIMEOUT, headers=headers))
        def record(rec: dict[str, Any]) -> None:
            rows.append(rec)
            out.write(json.dumps(rec) + "\n")
            out.flush()

        sweep = Sweep(served, http, capture)
        if a.group == "auth":  # the open routes' baseline: the same model served without --api-key
            plain_served = stack.enter_context(serving(str(ckpt), dtype="float32", max_seq_len=64, max_num_tokens=16,
                                                       kv_cache_config=kv, state={"model_name": "tiny"}))
            sweep.plain_port = plain_served.server.port
        all_routes = routes() + (beam_routes() if a.group == "beam" else [])
        for route in all_routes:
            sweep.baseline[route.tag] = sweep.good_answer(route)
        time.sleep(0.5)
        if isinstance(served, External):
            sweep.base_used = served.used_blocks()
        else:
            snap = served.state.engine.snapshot()["manager"]
            sweep.base_used = sum(g.used for g in snap.groups.values())
        capture.records.clear()
        if a.group != "base":
            group_cases(a, sweep, all_routes, record)
            all_routes = []
        for route in all_routes:
            cases = field_cases(route, a.nested)
            for name, body in list(cases.items())[::a.every]:
                full = f"{route.tag}.{name}"
                if a.only in full:
                    record(sweep.probe(route, full, body, route.path))
            if route.stream and not a.nested:
                for reset in (True, False):
                    full = f"{route.tag}.stream.{'reset' if reset else 'close'}_hangup"
                    if a.only in full:
                        long = {**route.good, "stream": True}
                        for key in ("max_tokens", "max_output_tokens"):
                            if key in long:
                                long[key] = 40
                        record(sweep.hangup(route, full, long, reset))
            full = f"{route.tag}.concurrency"
            if a.only in full and not a.nested:
                rounds = []
                for i in range(3):
                    rec = sweep.concurrency(route, f"{full}{i}")
                    time.sleep(1.0)
                    rec["resources"] = resources(sweep.served)
                    rounds.append(rec)
                grow = {k: rounds[2]["resources"][k] - rounds[1]["resources"][k] for k in ("threads", "fds")}
                if any(v > 0 for v in grow.values()) and rounds[2]["resources"]["fds"] > rounds[0]["resources"]["fds"]:
                    rounds[2]["grew"] = grow
                for rec in rounds:
                    record(rec)
        # a stored response for the stored-response routes
        if a.group == "base":
            stored = http.post("/v1/responses", json={**routes()[2].good, "store": True}).json().get("id", "resp_x")
            for name, method, path in get_cases(stored):
                if a.only in name and not a.nested:
                    record(sweep.probe(None, name, None if method in ("GET", "HEAD") else Raw(b""), path, method))
    mark_siblings(rows)
    bad = [(r, r["why"] if "why" in r else suspect(r)) for r in rows]
    bad = [(r, why) for r, why in bad if why]
    if a.tp_size:  # the command stopped by SIGTERM: every rank must end cleanly and leave no process
        if served.exit_status != 0:
            bad.append(({"case": "server.stop"}, [f"exit status {served.exit_status} after SIGTERM"]))
        left = [x for x in served.ranks if Path(f"/proc/{x}").exists()]
        if left:
            bad.append(({"case": "server.stop"}, [f"ranks left running: {left}"]))
    print(f"{len(rows)} cases, {len(bad)} suspects")
    if a.summary:
        for r, why in bad:
            print(f"{r['case']}: {'; '.join(why)} -- {str(r.get('body', r.get('exc', '')))[:200]!r}")


def beam_group(a: Any, sweep: Sweep, all_routes: list[Route], record: Any) -> None:
    """--group beam: on each beam route the hostile values of ``BEAM_FIELDS``, ``beam_combos`` (each 200's choices
    checked by ``beam_shape``), clients that hang up mid-search (a stream after its first chunk, or before it; a
    plain request once the search runs), 16 requests at once (good, bad, hung up, reset; three rounds), 16 good beam
    searches at once, 8 beside 8 plain requests; ``/v1/responses`` and ``/v1/messages`` given ``use_beam_search``."""
    by_tag = {r.tag: r for r in all_routes}
    # under tensor parallel kvload serves no beam search: each case must be that one 400 and hold nothing (the
    # searches' hang-ups and concurrency cases have no search to run, and are left out)
    tp = isinstance(sweep.served, External)
    for route in (r for r in all_routes if r.tag.startswith("beam_")):
        cases: dict[str, tuple[Any, int | None]] = {}
        for f in route.fields:
            for k, v in HOSTILE.items():
                cases[f"{f}.{k}"] = ({**route.good, f: v}, None)
            for k, lit in LITERALS.items():
                rest = json.dumps({kk: vv for kk, vv in route.good.items() if kk != f})[1:-1]
                cases[f"{f}.{k}"] = (Raw(f'{{{rest}, "{f}": {lit}}}'.encode()), None)
        cases.update(beam_combos(route))
        for name, (body, expect) in list(cases.items())[::a.every]:
            full = f"{route.tag}.{name}"
            if a.only not in full:
                continue
            rec = sweep.probe(route, full, body, route.path)
            rec["expect"] = expect
            if tp and not (isinstance(body, dict) and body.get("use_beam_search", True) in (False, None)):
                rec["tp_refused"] = True  # a search (false or null asks for none: judged as any request)
            elif rec["status"] == 200 and isinstance(body, dict):
                try:
                    rec["shape"] = beam_shape(body, sweep.last_text, route)
                except (ValueError, KeyError, TypeError) as e:
                    rec["shape"] = f"unreadable: {type(e).__name__}: {e}"[:200]
            record(rec)
        if tp:
            continue
        long = {**route.good, "n": BEAM_WIDTH, "max_tokens": 40, "ignore_eos": True}
        external = isinstance(sweep.served, External)  # its engine's steps cannot be counted from here
        engine = None if external else sweep.served.state.engine
        steps = 0 if external else engine.steps  # a whole search's steps, which a search its client left must not run
        sweep.http.post(route.path, json={**long, "cache_salt": "whole"}, timeout=timeout_for(route.tag))
        whole = 0 if external else engine.steps - steps
        for reset in (True, False):
            full = f"{route.tag}.stream.{'reset' if reset else 'close'}_hangup"
            if a.only in full:
                record(sweep.hangup(route, full, {**long, "stream": True}, reset))
            if external:
                continue
            full = f"{route.tag}.plain.{'reset' if reset else 'close'}_hangup"
            if a.only in full:  # a plain request: the client goes while the search runs
                record(beam_drop(sweep, route, full, long, reset, whole))
            full = f"{route.tag}.stream_early.{'reset' if reset else 'close'}_hangup"
            if a.only in full:  # a stream's client gone before its first chunk (a completion's come as it ends)
                record(beam_drop(sweep, route, full, {**long, "stream": True}, reset, whole))
        full = f"{route.tag}.concurrency"
        if a.only in full:
            rounds = []
            for i in range(3):
                rec = sweep.concurrency(route, f"{full}{i}", n=16)
                time.sleep(1.0)
                rec["resources"] = resources(sweep.served)
                rounds.append(rec)
            grow = {k: rounds[2]["resources"][k] - rounds[1]["resources"][k] for k in ("threads", "fds")}
            if any(v > 0 for v in grow.values()) and rounds[2]["resources"]["fds"] > rounds[0]["resources"]["fds"]:
                rounds[2]["grew"] = grow
            for rec in rounds:
                record(rec)
        full = f"{route.tag}.mixed_concurrency"
        if a.only in full:
            record(beam_mixed(sweep, route, by_tag[route.tag[len("beam_"):]], full))
        full = f"{route.tag}.all_beam_concurrency"
        if a.only in full:
            record(beam_mixed(sweep, route, route, full))
    for tag, extra in (("responses", {"use_beam_search": True}), ("messages", {"use_beam_search": True}),
                       ("responses", {"n": 2}), ("messages", {"length_penalty": 1.0})):
        route = by_tag[tag]
        (field, value), = extra.items()
        full = f"{tag}.{field}.{'true' if value is True else 'given'}"
        if a.only in full:
            rec = sweep.probe(route, full, {**route.good, **extra}, route.path)
            rec["expect"] = 400
            record(rec)


def beam_drop(sweep: Sweep, route: Route, name: str, body: dict[str, Any], reset: bool, whole: int
              ) -> dict[str, Any]:
    """A plain (not streamed) beam search whose client goes once the engine has run a few steps of it: it must end
    there (fewer than the ``whole`` search's steps run), holding nothing."""
    data = json.dumps(body).encode()
    head = (f"POST {route.path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    engine = sweep.served.state.engine
    rec: dict[str, Any] = {"case": name, "status": None, "dropped": True}
    start = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", sweep.served.server.port), timeout=timeout_for(name)) as sock:
            steps = engine.steps
            sock.sendall(head + data)
            deadline = time.monotonic() + timeout_for(name)
            while engine.steps < steps + 3 and time.monotonic() < deadline:
                time.sleep(0.002)
            rec["searching"] = getattr(engine, "_beam", None) is not None
            if not rec["searching"]:
                rec["exc"] = "the search was not running when the client went"
            if reset:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    except Exception as e:
        rec["exc"] = f"{type(e).__name__}: {e}"[:300]
    rec["s"] = round(time.monotonic() - start, 3)
    deadline = time.monotonic() + timeout_for(name)  # the search's end (an abort lands at its next step)
    while (getattr(engine, "_beam", None) is not None or getattr(engine, "_beam_ids", None)) and \
            time.monotonic() < deadline:
        time.sleep(0.002)
    rec["steps_run"] = engine.steps - steps
    rec = sweep.after(rec, route)
    if rec["steps_run"] >= whole:
        rec["ran_on"] = f"{rec['steps_run']} steps run, a whole search is {whole}"
    return rec


def at_once(name: str, one: Callable[[int], None], n: int, results: list[str], fine: tuple[str, ...],
            body: Callable[[list[str]], Any], wait: float) -> dict[str, Any]:
    """Case ``name``'s record of ``one(0)`` .. ``one(n - 1)`` run on ``n`` threads at once, each appending its outcome
    to ``results``: status 200 when every outcome is in ``fine`` and none is still waiting after ``3 x wait``, else
    the first other outcome (or "hung"); ``body(results)`` is what the record shows of them."""
    start = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(wait * 3)
    hung = sum(t.is_alive() for t in threads)
    worst = next((r for r in results if r not in fine), None)
    rec: dict[str, Any] = {"case": name, "status": 200 if worst is None and not hung else worst or "hung",
                           "s": round(time.monotonic() - start, 3), "body": json.dumps(body(results))[:1000]}
    if hung:
        rec["exc"] = f"{hung} clients still waiting after {wait * 3} s"
    return rec


def beam_mixed(sweep: Sweep, beam: Route, plain: Route, name: str, n: int = 16) -> dict[str, Any]:
    """``n`` requests at once, every other one a beam search, the rest ``plain`` ones (greedy, or beam searches
    too): each answered as its baseline."""
    import httpx

    results: list[str] = []
    wait = timeout_for(name) * 2

    def one(i: int) -> None:
        route = beam if i % 2 else plain
        try:
            with httpx.Client(base_url=sweep.served.url, timeout=wait) as c:
                r = c.post(route.path, json=route.good)
            results.append("ok" if r.status_code == 200 and answer_of(route, r.json()) == sweep.baseline[route.tag]
                           else f"{route.tag}: {r.status_code} {r.text[:100]}")
        except Exception as e:
            results.append(f"{type(e).__name__}: {e}"[:100])

    return sweep.after(at_once(name, one, n, results, ("ok",), list, wait), beam)


def group_cases(a: Any, sweep: Sweep, all_routes: list[Route], record: Any) -> None:
    """The cases of --group parsers, auth, admin or beam (each on its own server)."""
    if a.group == "beam":
        beam_group(a, sweep, all_routes, record)
    elif a.group == "parsers":
        for route in all_routes:
            if route.tag not in PARSER_FIELDS:
                continue
            for name, body in list(parser_cases(route).items())[::a.every]:
                full = f"{route.tag}.{name}"
                if a.only in full:
                    record(sweep.probe(route, full, body, route.path))
            tools = {"chat": {"tools": [WEATHER], "tool_choice": "auto"}, "responses": {"tools": [_R_TOOL]},
                     "messages": {"tools": [{"name": "f", "input_schema": {"type": "object"}}],
                                  "thinking": {"type": "enabled", "budget_tokens": 1024}}}[route.tag]
            for reset in (True, False):  # the parsers' streaming paths, hung up after the first chunk
                full = f"{route.tag}.stream.tools_{'reset' if reset else 'close'}_hangup"
                if a.only in full:
                    long = {**route.good, **tools, "stream": True}
                    for key in ("max_tokens", "max_output_tokens"):
                        if key in long:
                            long[key] = 40
                    record(sweep.hangup(route, full, long, reset))
    elif a.group == "auth":
        port = sweep.served.server.port
        chat = next(r for r in all_routes if r.tag == "chat")
        for rname, (method, path, body) in AUTH_ROUTES.items():
            for hname, (hdrs, passes) in list(AUTH_HEADERS.items())[::a.every]:
                full = f"auth.{rname}.{hname}"
                if a.only not in full:
                    continue
                p = path + ("&" if "?" in path else "?") + f"api_key={KEY}" if hname == "key_in_query" else path
                start = time.monotonic()
                rec: dict[str, Any] = {"case": full}
                try:
                    status, got, text = raw_request(port, method, p, hdrs, body)
                    rec.update(status=status, s=round(time.monotonic() - start, 3),
                               body=text[:8000].decode("utf-8", "replace"))
                    why = auth_judge(full, status, got, text, passes, rname)
                    if rname in AUTH_OPEN and sweep.plain_port:  # the same request to a server without --api-key
                        plain = open_view(rname, *raw_request(sweep.plain_port, method, p, hdrs, body))
                        rec["without_auth"] = plain["status"]
                        diff = open_diff(open_view(rname, status, got, text), plain)
                        if diff:
                            why.append(f"open route answers differently under --api-key: {diff}")
                except Exception as e:
                    rec.update(status=None, exc=f"{type(e).__name__}: {e}"[:300])
                    why = [f"no answer: {rec['exc']}"]
                rec = sweep.after(rec, chat)
                for k, label in (("left", "left behind"), ("log", "server log"), ("still_ok", "good request after")):
                    if rec.get(k) and rec[k] is not True:
                        why.append(f"{label}: {str(rec[k])[:160]}")
                rec["why"] = why
                record(rec)
    else:
        completion = next(r for r in all_routes if r.tag == "completion")
        for name, method, path, body in admin_cases()[::a.every]:
            if a.only in name:
                record(sweep.probe(completion, name, body, path, method))
        full = "get.reset_prefix_cache.while_streaming"
        if a.only in full:  # a reset while a stream holds blocks: 409, nothing dropped, the stream unharmed
            import httpx

            with httpx.Client(base_url=sweep.served.url, timeout=TIMEOUT) as c, \
                    c.stream("POST", "/v1/completions", json={**completion.good, "max_tokens": 40,
                                                              "stream": True}) as s:
                it = s.iter_lines()
                next(it)
                rec = sweep.probe(None, full, Raw(b"", None), "/reset_prefix_cache")
                rest = list(it)
                if not rest or rest[-1] != "data: [DONE]":
                    rec["still_ok"] = f"stream ended {rest[-1:]}"
            record(sweep.after(rec, completion))


if __name__ == "__main__":
    main()
