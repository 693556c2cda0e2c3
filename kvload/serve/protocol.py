"""OpenAI request bodies → what the engine needs, checked field by field (no web framework needed here).

Completions and chat completions (:func:`parse`: OpenAI's fields, kvload's and vLLM's ``top_k``, ``stop_token_ids``,
``ignore_eos``, ``add_special_tokens``, ``cache_salt``, ``prompt_logprobs``, ``truncate_prompt_tokens``,
``request_id``, ``use_beam_search`` with ``length_penalty`` (:func:`_beam`), and for chat vLLM's template options,
checked by ``engine.prompts.template_options`` as ``LLM.chat`` checks them), and vLLM's ``/tokenize`` and
``/detokenize`` (:func:`parse_tokenize`, :func:`parse_detokenize`). Every problem raises :class:`BadRequest` naming
the field (``param``) and what is accepted; the app turns it into HTTP 400 with OpenAI's error body. Fields kvload
cannot honour are refused, never silently dropped: an accepted setting must act (or be what kvload does anyway:
``priority`` 0, ``best_of`` = ``n``), or is reported as ``setting_ignored`` (:attr:`Job.ignored`) where vLLM accepts
it and it can change nothing. Structured outputs come as OpenAI's ``response_format`` (``json_object``,
``json_schema``) or vLLM's ``structured_outputs`` (:func:`_structured`); chat's ``tool_choice`` named or
``"required"`` constrains the reply to tool calls the same way (:func:`_tool_choice`), as vLLM does without a
tool-call parser. Under the server's reasoning parser a chat reply is split into thinking and answer
(:func:`_reasoning`), and a grammar holds only the answer (``StructuredOutputsParams.reasoning_parser``), as vLLM's
does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs

from engine.beam_search import BeamSearchParams
from engine.messages import MessageError, chat_messages
from engine.prompts import TEMPLATE_OPTIONS, lone_surrogate, not_unicode, surrogate_in, template_options
from engine.sampling_params import (
    SamplingParams,
    check_logit_bias_count,
    check_logprobs,
    check_salt,
    check_stop_sizes,
    check_stop_token_ids_count,
    is_finite,
    is_number,
)
from engine.schema_ignored import ignored_settings
from engine.structured_params import FALSE_SCHEMA, StructuredOutputsParams
from kvload.serve.command import TOOL_CALL_PARSERS
from kvload.serve.parse_gate import aside
from pipeline.errors import GenerationError
from pipeline.limits import (
    MAX_BIAS,
    MAX_INT,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    short,
)

#: Longest ``request_id`` (or ``X-Request-Id`` header) taken: it becomes the answer's id, sent in every chunk.
MAX_REQUEST_ID_CHARS = 256

#: Most prompts one completions request may hold: each becomes engine requests checked and queued
#: before the reply starts, so one body must not keep the server busy for minutes.
MAX_PROMPTS = 1024
#: Most choices (prompts x n) one request may ask for, for the same reason.
MAX_CHOICES = 1024
#: Bytes of request body a prompt token may take in the default cap on a body: a token id is at most 7
#: characters and its ", " for vocabularies under a million; text averages under 5 bytes a token in
#: English and code, and under 12 as JSON escapes (``\\u4e2d``, an emoji's surrogate pair) in any script.
BODY_BYTES_PER_TOKEN = 16
#: What the rest of a body may add to its prompts: the other fields, brackets, whitespace.
BODY_SLACK = 1 << 20


def default_max_request_bytes(max_seq_len: int, vocab_size: int) -> int:
    """The largest body a server with this ``max_seq_len`` accepts by default: :data:`MAX_PROMPTS` prompts of
    ``max_seq_len`` tokens each, as token ids or as text, plus :data:`BODY_SLACK`. A body that could hold
    more than any request the server would serve is refused before it is read (``--max-request-bytes``)."""
    per_token = max(BODY_BYTES_PER_TOKEN, len(str(max(vocab_size - 1, 0))) + 2)
    return MAX_PROMPTS * max_seq_len * per_token + BODY_SLACK


class BadRequest(Exception):
    """A request the server refuses: HTTP ``status`` with OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        # A lone surrogate (JSON's "\ud800", quoted from the request: an unknown field's name) cannot be encoded as
        # the UTF-8 of the answer: Starlette's JSONResponse raised, the refusal became a 500 with a traceback and a
        # dropped connection. Written as its escape instead, in the message and the param alike.
        message, param = _printable(message), None if param is None else _printable(param)
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.kind = kind
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """OpenAI's error document."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class AsSent(BadRequest):
    """A refusal on the Responses or Messages path that already names the body's own fields (an unknown one): not
    renamed as the chat path's refusals are (``messages`` is no Responses ``input``, ``max_tokens`` no
    ``max_output_tokens``)."""


def renamed_as(exc: BadRequest, rename: Callable[[str], str]) -> BadRequest:
    """The chat path's refusal ``exc`` with its message and ``param`` put in another body's words by ``rename`` (the
    Responses or Messages path's); an :class:`AsSent` one already names that body's fields and stands."""
    if isinstance(exc, AsSent):
        return exc
    param = rename(exc.param) if exc.param else exc.param
    return BadRequest(rename(exc.message), param=param, status=exc.status, kind=exc.kind, code=exc.code,
                      headers=exc.headers)


def _printable(text: str) -> str:
    """``text`` with each lone surrogate written as its ``\\udXXX`` escape, so it encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@attrs.frozen
class Job:
    """One parsed request: prompts (text, token ids or chat messages), sampling, and the options around it."""

    kind: str  # "completion" or "chat"
    prompts: list[Any]  # completion: str or list[int] each; chat: one list of messages
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    logprobs: int | None  # top alternatives per token; None = not asked
    echo: bool = False
    #: vLLM's echo without generation (a completion's ``max_tokens: 0`` with ``echo``): each choice is its prompt
    #: alone, finish_reason "length"; the engine draws one token (``params.max_tokens`` 1) that no answer shows
    echo_only: bool = False
    salt: str | None = None
    max_tokens_given: bool = True
    max_tokens_field: str = "max_tokens"  # the name it was given by (chat: max_completion_tokens too)
    #: chat: the chat template's keywords (``engine.prompts.template_options``: vLLM's add_generation_prompt,
    #: continue_final_message, chat_template, chat_template_kwargs)
    template: dict[str, Any] = attrs.field(factory=dict)
    #: whether the tokenizer adds its special tokens (BOS) to text: vLLM's default, true for a completion's text,
    #: false for chat (the template holds them)
    add_special_tokens: bool = True
    #: vLLM's ``prompt_logprobs`` as asked: top alternatives per prompt token to return (``params.prompt_logprobs``,
    #: what the engine scores, may be larger: a completion's ``echo`` with ``logprobs`` scores the prompt too)
    prompt_logprobs: int | None = None
    #: vLLM's ``truncate_prompt_tokens``: keep each prompt's last k tokens; -1: as many as max_seq_len leaves
    truncate: int | None = None
    #: vLLM's ``truncation_side``: "left" cuts the start (the last k tokens kept), "right" the end (the first k)
    truncation_side: str = "left"
    #: vLLM's ``request_id``: the answer's id is ``cmpl-`` / ``chatcmpl-`` and it (an ``X-Request-Id`` header wins)
    request_id: str | None = None
    #: vLLM's ``stream_options.continuous_usage_stats``: every chunk carries its choice's usage so far
    continuous_usage: bool = False
    #: settings accepted as vLLM accepts them that can change nothing here, each (name, value, why): reported as
    #: ``setting_ignored`` once the request is served
    ignored: tuple[tuple[str, Any, str], ...] = ()
    #: vLLM's ``priority`` (lower is served first); nonzero only when the server schedules by priority
    priority: int = 0
    #: the sampling fields the request did not send that took the model's default (vLLM's default sampling params:
    #: the model's generation_config.json), not the client's choice: never reported as ``setting_ignored``
    model_defaults: tuple[str, ...] = ()
    #: the body field that asked for structured outputs (``response_format``, ``structured_outputs`` or
    #: ``tool_choice``), or None
    structured_field: str | None = None
    #: chat's ``tool_choice`` when it constrains the reply to tool calls (named or "required"), else None
    tool_choice: ToolChoice | None = None
    #: chat's ``tool_choice: "auto"`` (or tools without one) under the server's tool-call parser, else None
    auto_tools: AutoTools | None = None
    #: the server's reasoning parser (``--reasoning-parser``) when it splits this chat reply into reasoning and
    #: content; None for completions, without one, and for qwen3 under ``enable_thinking: false``
    reasoning: str | None = None
    #: the body field that gave the chat template ``reasoning_effort`` (vLLM's; ``output_config.effort`` and
    #: ``reasoning.effort`` on the other paths), reported when the template reads it not, else None
    effort_field: str | None = None
    #: vLLM's ``include_reasoning`` (default true): false leaves the thinking out of the answer (reasoning_content
    #: null, no reasoning in a stream's deltas); the reply is still split, its answer alone the content
    include_reasoning: bool = True
    #: vLLM's ``return_token_ids``: the answer carries each prompt's ``prompt_token_ids`` (a stream: each choice's
    #: first chunk)
    return_token_ids: bool = False
    #: vLLM's ``return_tokens_as_token_ids``: logprobs name tokens ``token_id:N``; None: as the server's flag says
    return_tokens_as_token_ids: bool | None = None
    #: vLLM's ``use_beam_search``: the search's parameters (``n`` is its width, ``length_penalty`` its score's
    #: exponent), else None
    beam: BeamSearchParams | None = None


@attrs.frozen
class ToolChoice:
    """A chat request's ``tool_choice`` that holds the reply to tool calls: one call of a named function, or
    (``"required"``) a JSON array of one or more ``{"name", "parameters"}`` calls of the request's tools."""

    name: str | None  # the named function; None: "required"
    tool: int | None  # the named function's index in ``tools``; None: "required"
    #: each tool's parameters schema as constrained (a tool without one takes no arguments: an empty object)
    schemas: tuple[Any, ...] = attrs.field(hash=False)

    @property
    def mode(self) -> str:
        """``"named"`` or ``"required"``."""
        return "required" if self.name is None else "named"


@attrs.frozen
class AutoTools:
    """A chat request's ``tool_choice: "auto"`` under the server's tool-call parser: the reply is free text, read
    for calls of the request's tools (``kvload.serve.tool_parser``)."""

    parser: str  # the server's --tool-call-parser
    names: frozenset[str]  # the request's tools: a block naming another is no call
    parallel: bool = True  # OpenAI's parallel_tool_calls: false keeps the reply to one call (later blocks: content)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _token_ids(values: list[Any]) -> bool:
    """Whether a non-empty JSON list holds integers only (no ``true``/``false``): at C speed, where a prompt may be
    tens of millions of ids under the default ``--max-request-bytes`` (a Python loop took seconds per pass)."""
    return set(map(type, values)) == {int}


def _need(ok: bool, field: str, expected: str, value: Any) -> None:
    if not ok:
        # an integer as its size past 20 digits: a JSON literal of 4,000 digits filled the message with them
        shown = short(value) if isinstance(value, int) and not isinstance(value, bool) else repr(value)
        raise BadRequest(f"{field}: expected {expected}, got {shown}"[:300], param=field)


def need_schema(value: Any, field: str, optional: bool = False) -> None:
    """A 400 naming ``field`` unless ``value`` is a JSON schema object (or None, when ``optional``); the schema
    ``false`` is told apart: it admits no value."""
    if value is False:
        raise BadRequest(f"{field}: {FALSE_SCHEMA}", param=field)
    _need(isinstance(value, dict) or (optional and value is None), field, "a JSON schema object", value)


def _as_api(check: Any, value: Any) -> None:
    """Run one of ``SamplingParams``' own size checks: the same bound, refused in the same words, naming the field."""
    try:
        check(value)
    except GenerationError as exc:
        raise _bad(exc) from None


def _bad(exc: GenerationError) -> BadRequest:
    msg = str(exc).removeprefix("generate: ")
    head = msg.split(":", 1)[0].split("[", 1)[0]
    return BadRequest(msg, param=head if head.isidentifier() else None)


#: vLLM's guided decoding fields, removed in its recent releases (0.11): refused, naming what replaced them.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
           "guided_decoding_backend": None, "guided_whitespace_pattern": None}
#: ``structured_outputs`` keys kvload takes (vLLM's StructuredOutputsParams, less structural_tag, whitespace_pattern
#: and the backend switches: kvload compiles with xgrammar, vLLM's default backend).
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")

#: vLLM's sampling fields past OpenAI's, taken as ``SamplingParams`` takes them (its checks, its words).
_SAMPLING_EXTRAS = ("repetition_penalty", "min_p", "min_tokens")

#: Fields both endpoints accept. Each acts, but ``user``: OpenAI's end-user id (for its abuse monitoring) names the
#: caller and changes nothing generated, which the README says once rather than every request in the log.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options", "user",
           "presence_penalty", "frequency_penalty", "ignore_eos", "stop_token_ids", "salt", "logprobs", "top_k",
           "logit_bias", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
           *_SAMPLING_EXTRAS, "add_special_tokens",
           "echo",  # chat's: the last message before the reply (vLLM's)
           # vLLM's: the prefix cache's salt, prompt scores, prompt truncation, the answer's id, text output (accepted
           # at the one value kvload serves) and priority (any value under --scheduling_policy priority, else 0)
           "cache_salt", "prompt_logprobs", "truncate_prompt_tokens", "request_id", "response_format", "priority",
           "return_token_ids",  # vLLM's: the prompt's token ids in the answer (a choice's own are always there)
           "return_tokens_as_token_ids",  # vLLM's: logprobs tokens as token_id:N (the server's flag the default)
           "truncation_side",  # vLLM's: which end truncate_prompt_tokens keeps
           "use_beam_search", "length_penalty",  # vLLM's beam search: n beams, the best n hypotheses as choices
           # vLLM's sampling constraints, checked by SamplingParams (bad_words by the tokenizer, at submission)
           "allowed_token_ids", "bad_words",
           # vLLM's structured outputs (compiled by xgrammar at submission); its older guided_* fields are refused
           # with a pointer to it
           "structured_outputs", *_GUIDED,
           "session_id"}  # vLLM's: a conversation's stable id, for routing; reported (kvload routes nothing)
_COMPLETION = _COMMON | {"prompt", "best_of"}
#: OpenAI's chat fields that the openai SDK takes and agents send, which change nothing kvload generates: checked and
#: reported (``service_tier`` taken at the one tier kvload serves), as ``/v1/responses`` takes its own (openai_hints)
_CHAT_HINTS = {"reasoning_effort", "verbosity", "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
               "service_tier", "store", "metadata", "modalities", "prediction"}
_CHAT = (_COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                   "parallel_tool_calls", "include_reasoning", "documents"} | TEMPLATE_OPTIONS | _CHAT_HINTS)
#: OpenAI's limits on ``metadata``: 16 pairs, keys of 64 characters, values of 512.
MAX_METADATA = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
#: OpenAI's ``reasoning_effort`` values, and vLLM's "max".
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
EFFORT_IGNORED = ("kvload does not steer how long a model thinks (its chat template may: chat_template_kwargs, e.g. "
                  "Qwen3's enable_thinking)")
#: Why a ``reasoning_effort`` the chat template does not read is reported.
EFFORT_UNREAD = ("the chat template reads neither reasoning_effort nor enable_thinking (vLLM passes the effort to the "
                 "template, and thinking off for \"none\"; kvload does not steer thinking otherwise)")


_NO_DEFAULTS: Mapping[str, Any] = MappingProxyType({})


def parse(body: Any, kind: str, *, default_max_tokens: int, by_priority: bool = False,
          defaults: Mapping[str, Any] = _NO_DEFAULTS, tool_parser: str | None = None,
          reasoning_parser: str | None = None) -> Job:
    """Check an OpenAI ``/v1/completions`` (``kind="completion"``) or ``/v1/chat/completions`` body
    (``by_priority``: the server schedules by priority, so a nonzero ``priority`` is taken; ``tool_parser``: the
    server's tool-call parser, which lets chat's ``tool_choice`` be ``"auto"``; ``reasoning_parser``: the server's
    reasoning parser, which splits a chat reply's thinking from its answer). ``defaults``: the
    model's sampling defaults (``SamplingDefaults.values``; max_tokens aside, which ``default_max_tokens`` carries):
    a field the request does not send, or sends as null, takes its default, as vLLM's server does; one it sends
    wins."""
    body = _object(body)
    _known(body, _COMPLETION if kind == "completion" else _CHAT)
    extras, defaulted = _extras(body, defaults)
    _model(body)
    # OpenAI's end-user id, for its abuse monitoring: it names the caller and changes nothing generated
    user = body.get("user")
    _need(user is None or isinstance(user, str), "user", "a string", user)
    _check_unicode(user, "user")  # the Responses API echoes it: a lone surrogate failed the answer's UTF-8, a 500
    prompts = _prompts(body) if kind == "completion" else [_messages(body)]

    max_tokens = body.get("max_tokens")
    field = "max_tokens"
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        if max_tokens is not None:
            raise BadRequest("max_completion_tokens: give max_tokens or max_completion_tokens, not both",
                             param="max_completion_tokens")
        max_tokens, field = body["max_completion_tokens"], "max_completion_tokens"
    given = max_tokens is not None
    # vLLM's echo without generation: max_tokens 0 with echo answers the prompt alone (lm-eval scores text so)
    echo_only = kind == "completion" and _is_int(max_tokens) and max_tokens == 0 and _flag(body, "echo", False)
    if given and not echo_only:
        _need(_is_int(max_tokens) and max_tokens >= 1, field, "an integer >= 1, or 0 with echo: true (the prompt "
              "alone, no token generated)" if kind == "completion" else "an integer >= 1", max_tokens)
    if echo_only and extras.get("min_tokens"):  # the model's default holds back nothing shown: dropped
        _need("min_tokens" in defaulted, "min_tokens", "an integer in [0, max_tokens=0]", extras["min_tokens"])
        extras["min_tokens"] = 0
    temperature, top_p, top_k, seed = _core_sampling(body, defaults)
    n = body.get("n", 1)
    n = 1 if n is None else n
    _need(_is_int(n) and 1 <= n <= MAX_N, "n", f"an integer in [1, {MAX_N}]", n)
    if len(prompts) * n > MAX_CHOICES:  # greedy n > 1 is accepted, as OpenAI and vLLM do: identical choices
        raise BadRequest(f"n: {len(prompts)} prompts x n={n} ask for {len(prompts) * n:,} choices; at most "
                         f"{MAX_CHOICES} per request", param="n")
    stream = body.get("stream", False)
    stream = False if stream is None else stream
    _need(isinstance(stream, bool), "stream", "true or false", stream)
    ignored: list[tuple[str, Any, str]] = []
    include_usage, continuous = _stream_options(body, stream, ignored)
    if kind == "chat":
        _chat_hints(body, ignored)
    stops, stop_ids = _stops(body)
    ignore_eos = body.get("ignore_eos", False)
    _need(isinstance(ignore_eos, bool), "ignore_eos", "true or false", ignore_eos)
    salt = _salt(body)
    logprobs = _logprobs(body, kind)
    echo = _flag(body, "echo", False)
    prompt_logprobs = _prompt_logprobs(body, stream, ignored)
    scored = prompt_logprobs
    if kind == "completion" and echo and logprobs is not None:  # the prompt's tokens are scored too (lm-eval's
        scored = max(logprobs, prompt_logprobs or 0)  # loglikelihood requests); each answer shows its own top k
    if scored is not None:
        extras["prompt_logprobs"] = scored
    truncate, side = _truncation(body, ignored)
    priority = _accepted_as_done(body, kind, n, by_priority)
    session = body.get("session_id")
    _need(session is None or isinstance(session, str), "session_id", "a string", session)
    if session is not None:
        ignored.append(("session_id", session[:200], "vLLM's session identity, for routing and tracing; one kvload "
                        "server routes nothing (cache_salt scopes prefix sharing)"))
    structured, structured_field, tools, tool_choice, auto = _constraints(body, kind, tool_parser)
    template = _template(body, tools) if kind == "chat" else {}
    reasoning = _reasoning(reasoning_parser, template) if kind == "chat" else None
    include_reasoning = _flag(body, "include_reasoning", True)
    if not include_reasoning and reasoning_parser is None:  # nothing is told apart to leave out
        ignored.append(("include_reasoning", False, "this server has no --reasoning-parser: a thinking model's "
                        "thinking is part of the text"))
    if structured is not None:  # under a reasoning parser the model thinks freely; the grammar holds its answer
        extras["structured_outputs"] = structured if reasoning is None else \
            attrs.evolve(structured, reasoning_parser=reasoning)
        ignored += _not_enforced(structured, structured_field, tool_choice)
    least = extras.get("min_tokens", 0)
    if not given and not echo_only and "min_tokens" not in defaulted and least > default_max_tokens:
        # the bound is the server's default, not a max_tokens the request sent: said so, with the field that raises it
        also = " (or max_completion_tokens)" if kind == "chat" else ""
        raise BadRequest(f"min_tokens: expected an integer in [0, max_tokens={default_max_tokens}], the server's "
                         f"default max_tokens (the request sends none), got {least}; send max_tokens{also} of at "
                         f"least {least}", param="min_tokens")
    try:
        # echo without generation draws one token no answer shows (vLLM's way): the engine needs max_tokens >= 1
        params = SamplingParams(max_tokens=1 if echo_only else max_tokens if given else default_max_tokens,
                                temperature=float(temperature), top_p=float(top_p), top_k=top_k, seed=seed,
                                stop=stops, stop_token_ids=stop_ids, logprobs=logprobs, ignore_eos=ignore_eos,
                                **extras)
    except GenerationError as exc:  # the API's own checks, should the two ever disagree
        raise _bad(exc) from None
    special = _flag(body, "add_special_tokens", kind == "completion")
    beam = _beam(body, n, params, echo_only, structured_field, defaulted, ignored)
    return Job(kind=kind, prompts=prompts, params=params, n=n, stream=stream, include_usage=include_usage,
               stop=stops, stop_token_ids=tuple(stop_ids), logprobs=logprobs, echo=echo, salt=salt,
               echo_only=echo_only, max_tokens_given=given, max_tokens_field=field, template=template,
               add_special_tokens=special,
               prompt_logprobs=prompt_logprobs, truncate=truncate, truncation_side=side or "left",
               request_id=request_id(body.get("request_id")),
               continuous_usage=continuous, ignored=tuple(ignored), priority=priority,
               model_defaults=tuple(defaulted), structured_field=structured_field, tool_choice=tool_choice,
               auto_tools=auto, reasoning=reasoning, include_reasoning=include_reasoning,
               effort_field="reasoning_effort" if kind == "chat" and body.get("reasoning_effort") is not None
               else None,
               return_token_ids=_flag(body, "return_token_ids", False),
               return_tokens_as_token_ids=None if body.get("return_tokens_as_token_ids") is None
               else _flag(body, "return_tokens_as_token_ids", False),
               beam=beam)


def _extras(body: dict[str, Any], defaults: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The request's SamplingParams keywords past the core ones (OpenAI's penalties, vLLM's extras), the model's
    defaults for those it does not send; and the names of every sampling field the model's defaults fill."""
    # OpenAI's penalties and vLLM's extras: null is absent; SamplingParams checks the rest (bool is no number)
    extras = {name: body[name] for name in ("presence_penalty", "frequency_penalty", *_SAMPLING_EXTRAS)
              if body.get(name) is not None}
    for name, value in extras.items():  # the type here; SamplingParams says the range (1e400 is a number past it)
        expected = "an integer" if name == "min_tokens" else "a number"
        _need(_is_int(value) if name == "min_tokens" else is_number(value), name, expected, value)
    defaulted = [name for name in ("temperature", "top_p", "top_k", *_SAMPLING_EXTRAS)
                 if name in defaults and body.get(name) is None]  # the model's, checked when it was loaded
    extras.update({name: defaults[name] for name in defaulted if name in _SAMPLING_EXTRAS})
    if body.get("logit_bias") is not None:
        extras["logit_bias"] = _logit_bias(body["logit_bias"])
    if body.get("allowed_token_ids") is not None:  # JSON's true is no token id, nor 1.0: SamplingParams refuses them
        _need(isinstance(body["allowed_token_ids"], list), "allowed_token_ids",
              "a non-empty list of token ids (integers >= 0)", body["allowed_token_ids"])
        extras["allowed_token_ids"] = body["allowed_token_ids"]
    if body.get("bad_words") is not None:
        _need(isinstance(body["bad_words"], list), "bad_words", "a list of non-empty strings", body["bad_words"])
        extras["bad_words"] = body["bad_words"]
    for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"):  # vLLM's
        if body.get(name) is not None:
            extras[name] = _flag(body, name, False)
    return extras, defaulted


def _core_sampling(body: dict[str, Any], defaults: Mapping[str, Any]) -> tuple[Any, Any, Any, Any]:
    """``temperature``, ``top_p``, ``top_k`` (the model's defaults where not sent) and ``seed``, checked."""
    temperature = body.get("temperature")
    if temperature is None:
        temperature = defaults.get("temperature", 0.0)
    else:
        _need(is_finite(temperature) and 0 <= temperature <= 2, "temperature", "a number in [0, 2] (0 = greedy)",
              temperature)
    top_p = body.get("top_p")
    if top_p is None:
        top_p = defaults.get("top_p", 1.0)
    else:
        _need(is_finite(top_p) and 0 < top_p <= 1, "top_p", "a number in (0, 1]", top_p)
    top_k = body.get("top_k")
    if top_k is None:
        top_k = defaults.get("top_k", 0)
    else:
        _need(_is_int(top_k) and top_k >= -1, "top_k", "an integer >= 1, or 0 / -1 for all tokens", top_k)
    seed = body.get("seed")
    # -1 is vLLM's "no seed" (its SamplingParams' rule, which kvload.SamplingParams and --seed keep too)
    _need(seed is None or (_is_int(seed) and -1 <= seed <= MAX_INT), "seed",
          "an integer in [0, 2**63 - 1], or -1 for none (vLLM's)", seed)
    return temperature, top_p, top_k, seed


def _stops(body: dict[str, Any]) -> tuple[tuple[str, ...], list[int]]:
    """The request's ``stop`` strings and ``stop_token_ids``, checked."""
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    else:
        _need(isinstance(stop, list) and all(isinstance(s, str) for s in stop), "stop", "a string or a list of strings",
              stop)
        stops = tuple(stop)
    _need(all(stops), "stop", "non-empty strings", stop)
    _as_api(check_stop_sizes, stops)  # the Python API's bounds, in its words
    for i, text in enumerate(stops):  # as prompts and salt: a stop string no decoded text could ever contain
        problem = not_unicode(f"stop[{i}]", text)
        if problem is not None:
            raise BadRequest(problem, param="stop")
    stop_ids = body.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else stop_ids  # 0, "" and false are no list: refused, never read as none
    _need(isinstance(stop_ids, list), "stop_token_ids", "a list of token ids (integers >= 0)", stop_ids)
    _as_api(check_stop_token_ids_count, len(stop_ids))
    _need(all(_is_int(t) and t >= 0 for t in stop_ids), "stop_token_ids", "a list of token ids (integers >= 0)",
          stop_ids)
    return stops, stop_ids


def _truncation(body: dict[str, Any], ignored: list[tuple[str, Any, str]]) -> tuple[int | None, str | None]:
    """vLLM's ``truncate_prompt_tokens`` and ``truncation_side``, checked (a side with nothing cut said ignored)."""
    truncate = body.get("truncate_prompt_tokens")
    _need(truncate is None or (_is_int(truncate) and (truncate >= 1 or truncate == -1) and truncate <= MAX_INT),
          "truncate_prompt_tokens", "an integer >= 1 (keep the prompt's last k tokens), or -1 (as many as the "
          "context length leaves after max_tokens)", truncate)
    side = body.get("truncation_side")
    _need(side in (None, "left", "right"), "truncation_side",
          '"left" (keep the last tokens) or "right" (keep the first ones)', side)
    if side is not None and truncate is None:
        ignored.append(("truncation_side", side, "no truncate_prompt_tokens: no prompt is cut"))
    return truncate, side


def _constraints(body: dict[str, Any], kind: str, tool_parser: str | None) -> tuple[Any, Any, Any, Any, Any]:
    """What holds the reply: the structured output asked for and the field that asked (``tool_choice`` when a named
    or required tool call does), chat's tools, a forced tool choice and an ``auto`` one (free text, parsed after)."""
    structured, structured_field = _structured(body)
    tools = _tools(body) if kind == "chat" else None
    tool_choice, tool_params = _tool_choice(body, tools, tool_parser) if kind == "chat" else (None, None)
    auto = tool_choice if isinstance(tool_choice, AutoTools) else None
    if auto is not None:  # the reply is free text (response_format or structured_outputs may still hold it)
        tool_choice = None
    if tool_choice is not None:
        if structured is not None:  # two constraints on one reply: which was meant is not for the server to guess
            raise BadRequest(f"tool_choice: {_shown(body['tool_choice'])} holds the reply to tool calls, and "
                             f"{structured_field} constrains it too; give one", param="tool_choice")
        structured, structured_field = tool_params, "tool_choice"
    return structured, structured_field, tools, tool_choice, auto


#: What beam search takes of the sampling fields a request sent, each (field, its neutral value or None for "not
#: sent"): any other value is refused with use_beam_search, as beam search ranks by the model's own log-probabilities
#: and ends only at EOS or max_tokens (``engine.beam_search``). vLLM drops these silently; kvload says so.
#: ``logprobs`` / ``top_logprobs`` are served: each hypothesis keeps its tokens' entries (the prompt is not scored).
_NOT_WITH_BEAM = (("stop", None), ("stop_token_ids", None), ("bad_words", None), ("allowed_token_ids", None),
                  ("logit_bias", None), ("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1),
                  ("min_tokens", 0), ("prompt_logprobs", None))


def _beam(body: dict[str, Any], n: int, params: SamplingParams, echo_only: bool, structured_field: str | None,
          defaulted: list[str], ignored: list[tuple[str, Any, str]]) -> BeamSearchParams | None:
    """vLLM's ``use_beam_search`` (``n`` beams; ``max_tokens``, ``ignore_eos`` and ``length_penalty`` as its
    ``to_beam_search_params`` takes them) as :class:`BeamSearchParams`, or None without it; a sampling field beam
    search cannot honour is refused (:data:`_NOT_WITH_BEAM`), and ``length_penalty`` without it is reported."""
    penalty = body.get("length_penalty")
    _need(penalty is None or is_finite(penalty), "length_penalty", "a finite number (1.0: the mean log-probability "
          "per token ranks the hypotheses)", penalty)
    if not _flag(body, "use_beam_search", False):
        if penalty is not None:
            ignored.append(("length_penalty", penalty, "only beam search (use_beam_search: true) ranks by it"))
        return None
    with_beam = " does not go with use_beam_search"
    if params.temperature > 0 and "temperature" not in defaulted:
        raise BadRequest(f"temperature: {short(body.get('temperature'))}{with_beam}: beam search keeps the most likely "
                         "beams (send 0 or leave it out)", param="temperature")
    for name, neutral in _NOT_WITH_BEAM:
        value = body.get(name)
        if value is not None and value is not False and value != [] and value != {} and value != neutral:
            raise BadRequest(f"{name}: {short(value)}{with_beam} (beam search ranks the beams by the model's own "
                             "log-probabilities and ends them only at EOS or max_tokens; leave it out)", param=name)
    if params.prompt_logprobs is not None:  # a completion's echo with logprobs scores its prompt (lm-eval's way)
        raise BadRequest(f"echo: true with logprobs{with_beam}: beam search does not score the prompt, whose tokens' "
                         "logprobs would be null; leave out echo or logprobs", param="echo")
    if structured_field is not None:
        raise BadRequest(f"{structured_field}{with_beam}: structured outputs are not served with beam search",
                         param=structured_field)
    if echo_only:
        raise BadRequest(f"max_tokens: 0 (echo without generation){with_beam}; ask for max_tokens >= 1",
                         param="max_tokens")
    if body.get("priority"):
        ignored.append(("priority", body["priority"], "a beam search is served in arrival order"))
    # the model's default penalties and min_tokens (not the request's): the search takes none, as vLLM's
    for name in ("repetition_penalty", "min_tokens"):
        if name in defaulted and getattr(params, name) not in (0, 1.0):
            ignored.append((name, getattr(params, name), "the model's default; beam search ranks by the model's own "
                                                         "log-probabilities"))
    return BeamSearchParams(beam_width=n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                            length_penalty=float(1.0 if penalty is None else penalty), logprobs=params.logprobs)


def _not_enforced(structured: StructuredOutputsParams, field: str | None,
                  tool_choice: ToolChoice | None) -> list[tuple[str, Any, str]]:
    """What the schema holds that xgrammar does not enforce (``engine.schema_ignored``), named as the request named
    it: under ``structured_outputs.json``, ``response_format.json_schema.schema`` or each constraining tool's
    ``tools[i].function.parameters``."""
    if tool_choice is not None:
        tools = [tool_choice.tool] if tool_choice.tool is not None else range(len(tool_choice.schemas))
        return [entry for i in tools
                for entry in ignored_settings(tool_choice.schemas[i], f"tools[{i}].function.parameters")]
    return structured.ignored_settings("response_format.json_schema.schema" if field == "response_format"
                                       else "structured_outputs.json")


def _reasoning(parser: str | None, template: dict[str, Any]) -> str | None:
    """The reasoning parser that reads this chat reply: the server's, unless qwen3's thinking is switched off
    (``chat_template_kwargs: {"enable_thinking": false}``, tested as Qwen3's template tests it: the reply is then
    plain content, and a grammar holds it from its first token)."""
    if parser is None or (parser == "qwen3" and template.get("enable_thinking") is False):
        return None
    return parser


def openai_hints(body: dict[str, Any], ignored: list[tuple[str, Any, str]]) -> None:
    """OpenAI's ``service_tier`` (taken at the one tier kvload serves), ``prompt_cache_key``,
    ``prompt_cache_retention`` and ``safety_identifier`` (they change nothing here, so reported, not refused: agents
    send them on every request)."""
    tier = body.get("service_tier")
    _need(tier in (None, "auto", "default"), "service_tier", '"auto" or "default" (kvload serves one tier)', tier)
    retention = body.get("prompt_cache_retention")
    if retention is not None:
        _need(retention in ("in_memory", "24h"), "prompt_cache_retention", '"in_memory" or "24h"', retention)
        ignored.append(("prompt_cache_retention", retention, "kvload keeps a cached prefix while its blocks are not "
                        "needed for others (evicted least recently used), whatever is asked"))
    for key, why in (("prompt_cache_key", "a routing hint for OpenAI's prompt cache; kvload caches every prompt's "
                      "prefix whatever the key (cache_salt scopes sharing)"),
                     ("safety_identifier", "an end user's id for OpenAI's abuse checks; kvload runs none")):
        value = body.get(key)
        _need(value is None or isinstance(value, str), key, "a string", value)
        if value is not None:
            ignored.append((key, value[:200], why))


def metadata(value: Any) -> dict[str, str]:
    """OpenAI's ``metadata``: up to 16 string pairs (keys of 64 characters, values of 512); null: none."""
    if value is None:
        return {}
    expected = (f"an object of at most {MAX_METADATA} string keys (up to {MAX_METADATA_KEY} characters) to string "
                f"values (up to {MAX_METADATA_VALUE})")
    _need(isinstance(value, dict) and len(value) <= MAX_METADATA
          and all(isinstance(k, str) and len(k) <= MAX_METADATA_KEY and isinstance(v, str)
                  and len(v) <= MAX_METADATA_VALUE for k, v in value.items()), "metadata", expected, value)
    _check_unicode(value, "metadata")  # the Responses API echoes it: a lone surrogate failed the answer's UTF-8
    return dict(value)


def _chat_hints(body: dict[str, Any], ignored: list[tuple[str, Any, str]]) -> None:
    """Chat's :data:`_CHAT_HINTS`: checked, and those given reported as ``setting_ignored`` (null is absent)."""
    openai_hints(body, ignored)
    store = _flag(body, "store", False)
    if store:  # false is what kvload does anyway
        ignored.append(("store", True, "kvload keeps no chat completion (OpenAI's stored completions are not served)"))
    pairs = metadata(body.get("metadata"))
    if pairs:  # OpenAI keeps them with a stored completion, to filter by
        ignored.append(("metadata", pairs, "kept only with a stored chat completion, and kvload keeps none"))
    effort = body.get("reasoning_effort")
    if effort is not None:
        _need(effort in EFFORTS, "reasoning_effort", ", ".join(f'"{e}"' for e in EFFORTS[:-1]) + f' or "{EFFORTS[-1]}"',
              effort)
    modalities = body.get("modalities")  # OpenAI's output kinds: text is what kvload writes
    _need(modalities is None or modalities == ["text"], "modalities", '["text"] (kvload writes text; no audio)',
          modalities)
    prediction = body.get("prediction")  # OpenAI's predicted output: a latency hint, the reply the same either way
    if prediction is not None:
        content = prediction.get("content") if isinstance(prediction, dict) else None
        _need(isinstance(prediction, dict) and set(prediction) == {"type", "content"}
              and prediction["type"] == "content" and (isinstance(content, str) or (isinstance(content, list) and all(
                  isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                  for p in content))), "prediction", '{"type": "content", "content": a string or text parts}',
              prediction)
        ignored.append(("prediction", "content", "a latency hint (OpenAI's predicted outputs): the reply is the "
                        "same either way, and kvload drafts no tokens from it"))
    verbosity = body.get("verbosity")
    if verbosity is not None:
        _need(verbosity in ("low", "medium", "high"), "verbosity", '"low", "medium" or "high"', verbosity)
        ignored.append(("verbosity", verbosity, "kvload does not steer how long an answer is (max_tokens bounds it)"))


def _stream_options(body: dict[str, Any], stream: bool, ignored: list[tuple[str, Any, str]]) -> tuple[bool, bool]:
    """OpenAI's ``stream_options.include_usage`` (default false) and vLLM's ``continuous_usage_stats`` (usage in
    every chunk; it turns ``include_usage`` on unless that is given, as vLLM's default of true for it does); OpenAI's
    ``include_obfuscation`` is reported, as ``/v1/responses`` reports it."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    _need(isinstance(options, dict) and set(options) <= {"include_usage", "continuous_usage_stats",
                                                         "include_obfuscation"},
          "stream_options", 'an object {"include_usage": bool, "continuous_usage_stats": bool, "include_obfuscation": '
          'bool}', options)
    if not stream:
        raise BadRequest("stream_options: only allowed with stream=true", param="stream_options")
    obfuscation = options.get("include_obfuscation")
    if obfuscation is not None:
        _need(isinstance(obfuscation, bool), "stream_options.include_obfuscation", "true or false", obfuscation)
        ignored.append(("stream_options.include_obfuscation", obfuscation,
                        "kvload's stream chunks carry no obfuscation padding"))
    continuous = options.get("continuous_usage_stats")
    continuous = False if continuous is None else continuous
    _need(isinstance(continuous, bool), "stream_options.continuous_usage_stats", "true or false", continuous)
    include_usage = options.get("include_usage")
    include_usage = continuous if include_usage is None else include_usage
    _need(isinstance(include_usage, bool), "stream_options.include_usage", "true or false", include_usage)
    if continuous and not include_usage:  # vLLM's rule: usage per chunk only with usage at the end
        ignored.append(("stream_options.continuous_usage_stats", True,
                        "stream_options.include_usage is false: usage is sent per chunk only with it (vLLM's rule)"))
        continuous = False
    return include_usage, continuous


def _salt(body: dict[str, Any]) -> str | None:
    """kvload's ``salt`` or vLLM's ``cache_salt``, one setting by two names: the prefix-reuse scope of the request."""
    salt, cache = body.get("salt"), body.get("cache_salt")
    _need(salt is None or (isinstance(salt, str) and lone_surrogate(salt) is None), "salt",
          "a string of valid Unicode text", salt)
    _need(cache is None or (isinstance(cache, str) and bool(cache) and lone_surrogate(cache) is None), "cache_salt",
          "a non-empty string of valid Unicode text (vLLM's)", cache)
    if salt is not None and cache is not None and salt != cache:
        raise BadRequest("cache_salt: salt and cache_salt differ; they are one setting (cache_salt is vLLM's name "
                         "for kvload's salt, the prefix-reuse scope): give one, or the same value to both",
                         param="cache_salt")
    if cache is None:
        _as_api(check_salt, salt)  # the Python API's bound on its length, in its words
        return salt
    try:
        check_salt(cache)
    except GenerationError as exc:  # the same bound, named as the request named it
        raise BadRequest("cache_salt" + str(exc).removeprefix("generate: salt"), param="cache_salt") from None
    return cache


def _prompt_logprobs(body: dict[str, Any], stream: bool, ignored: list[tuple[str, Any, str]]) -> int | None:
    """vLLM's ``prompt_logprobs``: top alternatives per prompt token, in [0, MAX_LOGPROBS] as the Python API takes
    it; a stream has no place for them (vLLM refuses k > 0 there and returns nothing for 0)."""
    value = body.get("prompt_logprobs")
    if value is None:
        return None
    _as_api(functools.partial(check_logprobs, name="prompt_logprobs"), value)
    if stream:
        if value > 0:
            raise BadRequest("prompt_logprobs: not available with stream=true (as in vLLM); ask without streaming",
                             param="prompt_logprobs")
        ignored.append(("prompt_logprobs", 0, "stream=true: a stream carries no prompt logprobs (vLLM's rule)"))
        return None
    return value


def _accepted_as_done(body: dict[str, Any], kind: str, n: int, by_priority: bool = False) -> int:
    """vLLM's fields accepted at the one value that is what kvload does anyway (so they act), refused otherwise;
    ``priority`` also at any value when the server schedules by priority (returned, vLLM-signed: lower first)."""
    priority = body.get("priority")
    _need(priority is None or _is_int(priority), "priority", "an integer", priority)
    if priority and by_priority:  # --scheduling_policy priority: lower is served first (the engine negates it)
        _need(abs(priority) <= MAX_INT, "priority", "an integer of at most 2**63 - 1 in size", priority)
    elif priority:  # vLLM: any priority but 0 is an error unless the server schedules by priority
        raise BadRequest(f"priority: {short(priority)}: kvload serve schedules first come, first served (vLLM's "
                         "default policy, fcfs), where only priority 0 is accepted (or any, with "
                         "--scheduling_policy priority)", param="priority")
    best_of = body.get("best_of")
    if kind == "completion" and best_of is not None:
        _need(_is_int(best_of) and best_of >= 1, "best_of", "an integer >= 1", best_of)
        if best_of != n:
            raise BadRequest(f"best_of: {short(best_of)} with n={n} is not supported: kvload serve returns every "
                             "sample it draws, so only best_of = n is accepted (drawing more to keep the best is not "
                             "done; vLLM's V1 engine dropped best_of too)", param="best_of")
    return int(priority or 0)


_FORMATS = ('an object {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
            '{"name": ..., "schema": {...}, "strict"?: bool, "description"?: str}}')


def _structured(body: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str | None]:
    """OpenAI's ``response_format`` and vLLM's ``structured_outputs`` as one :class:`StructuredOutputsParams` (None:
    plain text), with the field that asked; vLLM's removed ``guided_*`` fields are refused naming their successor."""
    for name, key in _GUIDED.items():
        if body.get(name) is not None:
            instead = f'structured_outputs: {{"{key}": ...}}' if key else "structured_outputs (compiled with xgrammar)"
            raise BadRequest(f"{name}: vLLM's older guided decoding field, removed in its recent releases; send "
                             f"{instead} instead (or OpenAI's response_format for JSON)", param=name)
    fmt, given = body.get("response_format"), body.get("structured_outputs")
    asked: dict[str, Any] | None = None
    if fmt is not None:
        _need(isinstance(fmt, dict) and isinstance(fmt.get("type"), str), "response_format", _FORMATS, fmt)
        kind = fmt["type"]
        if kind in ("text", "json_object"):
            _need(set(fmt) == {"type"}, "response_format", _FORMATS, fmt)
            asked = {"json_object": True} if kind == "json_object" else None
        elif kind == "json_schema":
            _need(set(fmt) == {"type", "json_schema"} and isinstance(fmt["json_schema"], dict), "response_format",
                  _FORMATS, fmt)
            spec = fmt["json_schema"]
            extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
            if extra:
                raise BadRequest(f"response_format.json_schema.{extra[0][:60]}: not supported; accepted: name, schema, "
                                 "strict, description", param="response_format")
            _need(isinstance(spec.get("name"), str) and bool(spec["name"]), "response_format.json_schema.name",
                  "a non-empty string", spec.get("name"))
            _need(spec.get("description") is None or isinstance(spec["description"], str),
                  "response_format.json_schema.description", "a string", spec.get("description"))
            _need(spec.get("strict") is None or isinstance(spec["strict"], bool), "response_format.json_schema.strict",
                  "true or false (the schema is enforced either way)", spec.get("strict"))
            need_schema(spec.get("schema"), "response_format.json_schema.schema")
            asked = {"json": spec["schema"]}
        else:
            raise BadRequest(f"response_format: type {kind[:40]!r} is not supported; expected {_FORMATS} (or vLLM's "
                             "structured_outputs for a regex, choices or a grammar)", param="response_format")
    if given is not None:
        if asked is not None:
            raise BadRequest("structured_outputs: given with a response_format that asks for JSON too; give one",
                             param="structured_outputs")
        _need(isinstance(given, dict), "structured_outputs", 'an object with one of json, regex, choice, grammar, '
              'json_object, e.g. {"regex": "[0-9]+"}', given)
        unknown = sorted(set(given) - set(_STRUCTURED_KEYS))
        if unknown:
            raise BadRequest(f"structured_outputs.{unknown[0][:60]}: not supported by kvload serve; accepted keys: "
                             f"{', '.join(_STRUCTURED_KEYS)}", param="structured_outputs")
        asked = {k: v for k, v in given.items() if v is not None}
        if asked.get("disable_any_whitespace") is False:
            del asked["disable_any_whitespace"]
        field = "structured_outputs"
    else:
        field = "response_format"
    if asked is None:
        return None, None
    try:
        return StructuredOutputsParams(**asked), field
    except GenerationError as exc:
        msg = str(exc).removeprefix("generate: ")
        if field == "response_format":  # named as the request named it (the schema's own path kept)
            head, rest = msg.split(":", 1)
            msg = head.replace("structured_outputs.json", "response_format.json_schema.schema", 1) \
                if head.startswith("structured_outputs.json") else "response_format"
            msg += ":" + rest
        raise BadRequest(msg, param=field) from None


def request_id(value: Any, field: str = "request_id") -> str | None:
    """vLLM's ``request_id`` (or the ``X-Request-Id`` header, ``field``): printable text of at most
    :data:`MAX_REQUEST_ID_CHARS` characters, or None."""
    ok = isinstance(value, str) and 1 <= len(value) <= MAX_REQUEST_ID_CHARS and value.isprintable()
    _need(value is None or ok, field, f"a printable string of 1 to {MAX_REQUEST_ID_CHARS} characters", value)
    return value


def _logit_bias(value: Any) -> dict[int, Any]:
    """OpenAI's ``logit_bias``: token ids (JSON's string keys) to numbers; SamplingParams bounds them."""
    expected = f'an object of token ids to numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}], e.g. {{"50256": -100}}'
    _need(isinstance(value, dict), "logit_bias", expected, value)
    _as_api(check_logit_bias_count, len(value))  # counted before each key is read, in the Python API's words
    _need(all(isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 19 and int(k) <= MAX_INT
              and is_finite(b) and -MAX_BIAS <= b <= MAX_BIAS for k, b in value.items()), "logit_bias", expected, value)
    biases: dict[int, Any] = {}
    spelled: dict[int, str] = {}
    for key, bias in value.items():
        token = int(key)
        if token in spelled:  # "1" and "001" are one token: which bias was meant is not for the server to guess
            raise BadRequest(f"logit_bias: token {token} is given twice ({spelled[token]!r} and {key!r}); give each "
                             "token once", param="logit_bias")
        spelled[token], biases[token] = key, bias
    return biases


def _flag(body: dict[str, Any], field: str, default: bool) -> bool:
    """A true-or-false field; absent or null: ``default``."""
    value = body.get(field)
    if value is None:
        return default
    _need(isinstance(value, bool), field, "true or false", value)
    return value


def _template(body: dict[str, Any], tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """vLLM's chat template options in ``body`` (null: absent), checked by the Python API's ``LLM.chat`` rules,
    as ``apply_chat_template`` keywords, with the request's ``tools`` (checked by :func:`_tools`)."""
    given = {k: body[k] for k in TEMPLATE_OPTIONS if body.get(k) is not None}
    _check_unicode(given.get("chat_template_kwargs"), "chat_template_kwargs")
    _check_unicode(given.get("chat_template"), "chat_template")
    try:
        options = template_options(**given)
    except GenerationError as exc:
        msg = str(exc).removeprefix("chat: ")
        raise BadRequest(msg, param=msg.split(":", 1)[0]) from None
    if tools is not None:
        if "tools" in options:
            raise BadRequest("tools: given both as tools and in chat_template_kwargs; give one", param="tools")
        options["tools"] = tools
    documents = body.get("documents")
    if documents is not None:  # vLLM's: a RAG template's documents (a template that reads none shows nothing)
        _need(isinstance(documents, list) and all(isinstance(d, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in d.items()) for d in documents), "documents",
            'a list of objects of strings, e.g. [{"title": ..., "text": ...}]', documents)
        _check_unicode(documents, "documents")
        if "documents" in options:
            raise BadRequest("documents: given both as documents and in chat_template_kwargs; give one",
                             param="documents")
        options["documents"] = documents
    effort = body.get("reasoning_effort")  # checked by _chat_hints
    if effort is not None:  # vLLM's: the template's variable, and thinking on unless "none" (Qwen3's switch)
        if "reasoning_effort" in options:
            raise BadRequest("reasoning_effort: given both as reasoning_effort and in chat_template_kwargs; give one",
                             param="reasoning_effort")
        options["reasoning_effort"] = effort
        options.setdefault("enable_thinking", effort != "none")
    return options


_TOOLS = 'a list of {"type": "function", "function": {"name": ..., "description"?, "parameters"?}}'
_TOOL_CHOICES = ('"none", "required", or {"type": "function", "function": {"name": ...}} ("auto" needs a tool-call '
                 f"parser: kvload serve --enable-auto-tool-choice --tool-call-parser {'|'.join(TOOL_CALL_PARSERS)})")
#: The parameters of a tool that gives none (or ``{}``): no arguments, as OpenAI reads it (vLLM's "required" too).
_NO_PARAMETERS: Mapping[str, Any] = MappingProxyType({"type": "object", "properties": {}})


def _tools(body: dict[str, Any], empty: bool = False) -> list[dict[str, Any]] | None:
    """OpenAI's ``tools``, passed to the chat template as vLLM does (the model sees them); None when there are none.
    ``[]`` is a 400 unless ``empty`` (``/tokenize``, where vLLM takes it): vLLM's chat refuses it, as OpenAI does."""
    tools = body.get("tools")
    if tools is None:
        return None
    _need(isinstance(tools, list), "tools", _TOOLS, tools)
    if not tools and not empty:
        raise BadRequest("tools: must not be an empty array (vLLM's and OpenAI's rule); give at least one tool or "
                         "leave tools out", param="tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        _need(isinstance(tool, dict) and tool.get("type", "function") == "function" and isinstance(function, dict)
              and isinstance(function.get("name"), str) and bool(function["name"]), f"tools[{i}]",
              'a {"type": "function", "function": {"name": ..., "description"?, "parameters"?}} object', tool)
        description = function.get("description")  # type: ignore[union-attr]
        # the template renders it into the prompt: a number or object was shown to the model as Python wrote it
        # (OpenAI's and vLLM's: a string; /v1/responses and /v1/messages check theirs so)
        _need(description is None or isinstance(description, str), f"tools[{i}].function.description", "a string",
              description)
        strict = function.get("strict")  # type: ignore[union-attr]
        # likewise rendered (a template that writes the tool as JSON): any JSON was taken (vLLM's: a bool; /v1/responses
        # checks its tools[i].strict so)
        _need(strict is None or isinstance(strict, bool), f"tools[{i}].function.strict", "true or false", strict)
        parameters = function.get("parameters")  # type: ignore[union-attr]
        need_schema(parameters, f"tools[{i}].function.parameters", optional=True)
        _check_unicode(function.get("name"), f"tools[{i}].function.name")  # type: ignore[union-attr]
        _check_unicode(tool, f"tools[{i}]")  # the chat template renders the tools into the prompt text
    first: dict[str, int] = {}
    for j, tool in enumerate(tools):
        # whatever tool_choice says: which one a call means (its schema, under "auto" the parser's) is not for the
        # server to guess, and the template shows the model two tools of one name
        tool_name = tool["function"]["name"]
        if first.setdefault(tool_name, j) != j:
            raise BadRequest(f"tools[{j}].function.name: {tool_name[:80]!r} is given twice (tools[{first[tool_name]}] "
                             "too); each tool needs its own name", param=f"tools[{j}].function.name")
    return tools or None


def _check_unicode(value: Any, field: str) -> None:
    """``BadRequest`` naming where in ``value`` (its keys too) a string holds a lone surrogate (JSON's ``"\\ud800"``):
    no tokenizer encodes one, and the chat template puts such values in the prompt."""
    found = surrogate_in(value, field)
    problem = not_unicode(*found) if found is not None else None
    if problem is not None:
        raise BadRequest(problem, param=field)


def _shown(choice: Any) -> str:
    """A ``tool_choice`` as a refusal names it."""
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        return f"function {name!r}"[:80] if isinstance(name, str) else "a named function"
    return repr(choice)[:60]


#: How a server starts with a tool-call parser, as a refusal of "auto" says it.
_AUTO_FLAGS = f"--enable-auto-tool-choice --tool-call-parser {'|'.join(TOOL_CALL_PARSERS)}"


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None, parser: str | None = None
                 ) -> tuple[ToolChoice | AutoTools | None, StructuredOutputsParams | None]:
    """Chat's ``tool_choice`` as vLLM serves it: ``"none"`` (or no tools): the reply is text; a named function: the
    reply is held to its ``parameters`` schema; ``"required"``: to a JSON array of one or more ``{"name": <a tool's
    name>, "parameters": <its schema>}`` (vLLM's anyOf schema). ``"auto"`` (and tools without a ``tool_choice``,
    which means it) lets the model choose text or calls: under the server's tool-call ``parser`` the reply is free
    text read for calls (:class:`AutoTools`), else refused (vLLM's rule)."""
    choice = body.get("tool_choice")
    parallel = _flag(body, "parallel_tool_calls", True)  # checked whatever the choice: a named one or none is one call
    if parser is not None and tools and choice in (None, "auto"):
        return AutoTools(parser, frozenset(tool["function"]["name"] for tool in tools), parallel), None
    if choice is None or choice == "none":
        if choice is None and tools:
            raise BadRequest('tools: without tool_choice the model may call them or not ("auto", the default of '
                             "OpenAI and vLLM), which needs a tool-call parser: start kvload serve with "
                             f'{_AUTO_FLAGS}, or pass tool_choice "required" or {{"type": "function", "function": '
                             '{"name": ...}} to hold the reply to tool calls, or "none" to show the tools to the '
                             "chat template only", param="tools")
        return None, None
    if choice == "auto":
        if parser is not None:  # vLLM's rule: "auto" with nothing to call is no choice
            raise BadRequest('tool_choice: "auto" needs the functions it may call in tools; got none',
                             param="tools")
        raise BadRequest('tool_choice: "auto": the model would choose between text and tool calls, which needs a '
                         f"tool-call parser: start kvload serve with {_AUTO_FLAGS} (vLLM's flags); else accepted: "
                         '"required" or {"type": "function", "function": {"name": ...}} (the reply is held to tool '
                         'calls), or "none" (the reply is text)', param="tool_choice")
    if choice == "required":
        name = None
    else:
        function = choice.get("function") if isinstance(choice, dict) else None
        _need(isinstance(choice, dict) and set(choice) == {"type", "function"} and choice["type"] == "function"
              and isinstance(function, dict) and set(function) == {"name"} and isinstance(function["name"], str)
              and bool(function["name"]), "tool_choice", _TOOL_CHOICES, choice)
        name = function["name"]  # type: ignore[index]
    if not tools:
        raise BadRequest(f"tool_choice: {_shown(choice)} needs the functions it may call in tools; got none",
                         param="tools")
    names = [tool["function"]["name"] for tool in tools]  # each once: _tools checked them
    if name is not None and name not in names:
        listed = ", ".join(repr(n[:40]) for n in names[:20]) + (", ..." if len(names) > 20 else "")
        raise BadRequest(f"tool_choice.function.name: {name[:80]!r} is not among the tools ({listed})",
                         param="tool_choice")
    schemas = tuple(tool["function"].get("parameters") or dict(_NO_PARAMETERS) for tool in tools)
    if name is not None:
        index = names.index(name)
        return ToolChoice(name, index, schemas), _tool_params(schemas[index], f"tools[{index}].function.parameters")
    for i, schema in enumerate(schemas):  # each on its own first, so a refusal names the tool
        _tool_params(schema, f"tools[{i}].function.parameters")
    # vLLM's parallel_tool_calls=false with "required": the array holds exactly one call (a named choice makes one)
    return ToolChoice(None, None, schemas), _tool_params(_required_schema(names, schemas, not parallel), "tools")


def _tool_params(schema: Any, field: str) -> StructuredOutputsParams:
    """``schema`` as structured outputs; ``BadRequest`` naming ``field`` when it is unusable (too large, too deep)."""
    try:
        return StructuredOutputsParams(json=schema)
    except GenerationError as exc:
        raise BadRequest(field + ":" + str(exc).split(":", 2)[-1], param=field) from None


def _required_schema(names: list[str], schemas: tuple[Any, ...], single: bool = False) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice: "required"``: an array of one or more calls (``single``: exactly one, vLLM's
    ``parallel_tool_calls: false``), each ``{"name": <one of the tools' names>, "parameters": <that tool's schema>}``
    (name first, so a stream names a call before its arguments).
    Each tool's ``$defs`` move to the top, where its ``#/$defs/...`` references then point; a name two tools define
    differently is refused. A tool whose schema refers to its own root (``"#"``, a tree) or into it
    (``"#/properties/..."``) is itself put in ``$defs`` and those references pointed there: nested in the array they
    would mean the array (the grammar then refused valid arguments, or took a list of calls as a child)."""
    defs: dict[str, Any] = {}
    calls = []
    for i, (name, schema) in enumerate(zip(names, schemas, strict=True)):
        root = f"kvload_tool_{i}_parameters"
        if _refers_to_root(schema):
            schema = _rerooted(schema, "#/$defs/" + root)
            if root in (schema.get("$defs") or {}):
                raise BadRequest(f"tools[{i}].function.parameters.$defs.{root}: a name kvload uses for the tool's "
                                 'own schema with tool_choice "required"; rename it',
                                 param=f"tools[{i}].function.parameters")
            defs[root] = {k: v for k, v in schema.items() if k != "$defs"}
            schema = {"$ref": "#/$defs/" + root, **({"$defs": schema["$defs"]} if "$defs" in schema else {})}
        own = schema.get("$defs")
        if own is not None:
            _need(isinstance(own, dict), f"tools[{i}].function.parameters.$defs", "an object of schemas", own)
            for key, value in own.items():
                if key in defs and defs[key] != value:
                    raise BadRequest(f"tools[{i}].function.parameters.$defs.{key[:60]}: another tool defines it "
                                     'differently; with tool_choice "required" the tools share one $defs (vLLM\'s '
                                     "rule): rename one", param=f"tools[{i}].function.parameters")
                defs[key] = value
            schema = {k: v for k, v in schema.items() if k != "$defs"}
        calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                      "parameters": schema},
                      "required": ["name", "parameters"], "additionalProperties": False})
    doc: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if single:
        doc["maxItems"] = 1
    if defs:
        doc["$defs"] = defs
    return doc


def _refs(node: Any) -> Any:
    """Every ``$ref`` string in a JSON document, depth first."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str):
                yield ref
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _outside_defs(ref: str) -> bool:
    """Whether ``ref`` is a local reference that is not into ``$defs`` (``"#"``, ``"#/properties/..."``)."""
    return ref == "#" or (ref.startswith("#/") and not ref.startswith("#/$defs/"))


def _refers_to_root(schema: Mapping[str, Any]) -> bool:
    """Whether ``schema`` has a local reference that is not into its ``$defs``."""
    return any(_outside_defs(ref) for ref in _refs(schema))


def _rerooted(node: Any, root: str) -> Any:
    """``node`` with each local reference outside ``$defs`` pointed under ``root`` (where the schema now lives)."""
    if isinstance(node, dict):
        out = {k: _rerooted(v, root) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and _outside_defs(ref):
            out["$ref"] = root + ref[1:]
        return out
    if isinstance(node, list):
        return [_rerooted(v, root) for v in node]
    return node


@attrs.frozen
class TokenizeJob:
    """One parsed ``POST /tokenize``: a text prompt, or chat messages with the chat template's options."""

    prompt: str | None  # None: messages
    messages: list[dict[str, str]] | None
    template: dict[str, Any]  # template_options' keywords (messages only)
    add_special_tokens: bool
    return_token_strs: bool


#: vLLM's TokenizeCompletionRequest and TokenizeChatRequest fields kvload acts on.
_TOKENIZE_PROMPT = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_TOKENIZE_CHAT = {"model", "messages", "add_special_tokens", "return_token_strs", "tools"} | TEMPLATE_OPTIONS


def parse_tokenize(body: Any) -> TokenizeJob:
    """Check a vLLM ``/tokenize`` body: ``{"prompt": str, "add_special_tokens"?: true, "return_token_strs"?}`` or
    ``{"messages": [...], the chat template's options, "add_special_tokens"?: false, "return_token_strs"?}``."""
    body = _object(body)
    if "messages" in body and "prompt" in body:
        raise BadRequest("messages: give prompt (text) or messages (a conversation), not both", param="messages")
    chat = "messages" in body
    allowed = _TOKENIZE_CHAT if chat else _TOKENIZE_PROMPT
    _known(body, allowed)
    _model(body)
    strs = _flag(body, "return_token_strs", False)
    if chat:
        return TokenizeJob(None, _messages(body), _template(body, _tools(body, empty=True)),
                           _flag(body, "add_special_tokens", False), strs)
    if "prompt" not in body:
        raise BadRequest("prompt: required (the text to tokenize), or messages (a conversation)", param="prompt")
    _need(isinstance(body["prompt"], str), "prompt", "a string", body["prompt"])
    return TokenizeJob(body["prompt"], None, {}, _flag(body, "add_special_tokens", True), strs)


def parse_detokenize(body: Any) -> list[int]:
    """Check a vLLM ``/detokenize`` body, ``{"tokens": [ids]}``; the token ids."""
    body = _object(body)
    _known(body, {"model", "tokens"})
    _model(body)
    tokens = body.get("tokens")
    _need(isinstance(tokens, list) and all(_is_int(t) and 0 <= t <= MAX_INT for t in tokens), "tokens",
          "a list of token ids (integers >= 0)", tokens)
    return list(tokens)


def not_an_object(body: Any) -> BadRequest:
    """The 400 for a request body that is JSON but not an object, naming what it is in JSON's words (it said
    Python's: "got NoneType" for ``null``, "got list" for an array)."""
    kind = ("null" if body is None else "true or false" if isinstance(body, bool) else "a number"
            if isinstance(body, int | float) else "a string" if isinstance(body, str) else "an array"
            if isinstance(body, list) else type(body).__name__)
    return BadRequest(f"the request body must be a JSON object ({{...}}), got {kind}")


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise not_an_object(body)
    return body


#: vLLM's request fields kvload serve does not take → what kvload does instead (said before the accepted fields).
VLLM_FIELDS_NOT_SERVED: dict[str, str] = {
    "thinking_token_budget": "kvload does not bound a model's thinking; max_tokens bounds the whole reply",
    "logprob_token_ids": "kvload returns the top logprobs (top_logprobs on chat) tokens and the sampled one, not "
                         "chosen ids",
    "stream_interval": "kvload streams every token as it comes",
    "repetition_detection": "kvload does not end a reply on repeated n-grams; repetition_penalty, frequency_penalty "
                            "and presence_penalty discourage repeats",
    "suffix": "kvload does no fill-in-the-middle (vLLM refuses it too)",
    **dict.fromkeys(("kv_transfer_params", "ec_transfer_params"), "kvload serves no disaggregated prefill"),
    "vllm_xargs": "kvload has no sampler plugins to read them",
    "watermarking": "kvload does not watermark its output",
    "return_prompt_text": "POST /tokenize with the same messages and return_token_strs gives the templated prompt's "
                          "tokens; return_token_ids its ids in the answer",
    "return_token_offsets": "kvload returns token ids (return_token_ids) and logprobs' tokens, not character offsets",
    "routed_experts_prompt_start": "kvload returns no MoE routing decisions",
    **dict.fromkeys(("prompt_embeds", "mm_processor_kwargs", "media_io_kwargs"), "kvload serves text-only models "
                    "from text or token ids"),
}


#: OpenAI's request fields kvload does not serve → what to do instead (refused naming it, unless null: see _known).
OPENAI_FIELDS_NOT_SERVED: dict[str, str] = {
    **dict.fromkeys(("functions", "function_call"), "the deprecated form of tools and tool_choice, which kvload "
                    "serves: send those"),
    "audio": 'kvload writes text only (modalities ["text"])',
    "web_search_options": "kvload searches nothing; it answers from the model alone",
}


def _known(body: dict[str, Any], allowed: set[str] | frozenset[str]) -> None:
    """``BadRequest`` naming the first field kvload does not serve. OpenAI's or vLLM's field sent as null, its unset
    default, asks for nothing and is taken (clients that serialize every field of a request type send them so)."""
    unknown = sorted(k for k in set(body) - allowed
                     if not (body[k] is None and (k in VLLM_FIELDS_NOT_SERVED or k in OPENAI_FIELDS_NOT_SERVED)))
    if unknown:  # the name cut short: a 12,000-character key was quoted whole, twice, in a 24 KB answer
        why = VLLM_FIELDS_NOT_SERVED.get(unknown[0])
        theirs = OPENAI_FIELDS_NOT_SERVED.get(unknown[0])
        raise BadRequest(f"{unknown[0][:80]}: not supported by kvload serve"
                         + (f" (vLLM's field: {why})" if why else "")
                         + (f" (OpenAI's field: {theirs})" if theirs else "")
                         + f"; accepted fields: {', '.join(sorted(allowed))}", param=unknown[0][:80])


def _model(body: dict[str, Any]) -> None:
    model = body.get("model")
    _need(model is None or isinstance(model, str), "model", "a string (the served model's name)", model)


#: What a prompt list (completions' ``prompt``, embeddings' ``input``) may be.
PROMPTS_EXPECTED = "a non-empty string, a list of strings, a list of token ids, or a list of token id lists"


def _prompts(body: dict[str, Any], field: str = "prompt", noun: str = "prompts",
             required: str = "a string, a list of strings, token ids, or a list of token id lists") -> list[Any]:
    """``body[field]`` as a list of texts and token id lists (one text or one id list: a list of one); ``BadRequest``
    naming the field or the item otherwise."""
    if field not in body:
        raise BadRequest(f"{field}: required ({required})", param=field)
    prompt = body[field]
    if isinstance(prompt, str):
        _need(bool(prompt), field, PROMPTS_EXPECTED, prompt)
        return [prompt]
    _need(isinstance(prompt, list) and bool(prompt), field, PROMPTS_EXPECTED, prompt)
    if _token_ids(prompt):
        return [list(prompt)]
    _bad_token_id(prompt, field)
    if len(prompt) > MAX_PROMPTS:
        raise BadRequest(f"{field}: a list of {len(prompt):,} {noun}; at most {MAX_PROMPTS} per request (send "
                         "several requests)", param=field)
    for i, p in enumerate(prompt):
        if isinstance(p, list) and p and not _token_ids(p):
            _bad_token_id(p, f"{field}[{i}]")
        ok = (isinstance(p, str) and bool(p)) or (isinstance(p, list) and bool(p) and _token_ids(p))
        _need(ok, f"{field}[{i}]", "a non-empty string or a non-empty list of token ids", p)
    return list(prompt)


def _bad_token_id(ids: list[Any], field: str) -> None:
    """``BadRequest`` naming the first element that is no integer of a list that starts with a token id: ``[1, 2.0]``
    was read as a list of prompts and refused as ``prompt[0]: ... got 1``, naming the one id that was right."""
    if type(ids[0]) is int:
        i, bad = next((i, v) for i, v in enumerate(ids) if type(v) is not int)
        _need(False, f"{field}[{i}]", "a token id (an integer >= 0; the list's first item is one)", bad)


#: A list of more than this many items (a chat's ``messages``, a Responses ``input``, Anthropic's ``messages``) is
#: checked and structured off the parse gate (:func:`items_aside`): 20,000 messages took ~0.1-0.2 s of one turn.
ASIDE_ITEMS = 1024


def items_aside(items: Any, work: Callable[[], Any]) -> Any:
    """``work()``, the check and structuring of the list ``items``; off the parse gate (``parse_gate.aside``: the
    requests waiting are parsed meanwhile) when it holds more than :data:`ASIDE_ITEMS` items. The same code either
    way, so the same result and the same refusals (raised once the turn is back); the 503 of a server shutting down
    when it gave up on this request meanwhile."""
    if not isinstance(items, list) or len(items) <= ASIDE_ITEMS:
        return work()
    return held_aside(work)


def shutting_down() -> BadRequest:
    """The 503 ``server_shutting_down`` of a request the server stopped taking."""
    # Connection: close, as uvicorn closes every connection once a stop is asked for
    return BadRequest("the server is shutting down and takes no new requests; retry on another server", status=503,
                      kind="server_error", code="server_shutting_down", headers={"Connection": "close"})


def held_aside(work: Callable[[], Any]) -> Any:
    """``work()`` off the parse gate (``parse_gate.aside``); :func:`shutting_down`'s 503 when the server gave up on
    this request meanwhile."""
    result, held = aside(work)
    if not held:
        raise shutting_down()
    return result


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    _need(isinstance(messages, list) and bool(messages), "messages", "a non-empty list of {role, content} objects",
          messages)
    try:  # the checks LLM.chat makes too: an agent's next turn (tool_calls, tool_call_id) as vLLM passes it
        return items_aside(messages, lambda: chat_messages(messages))
    except MessageError as exc:
        raise BadRequest(str(exc), param=exc.field) from None


def _logprobs(body: dict[str, Any], kind: str) -> int | None:
    value = body.get("logprobs")
    if kind == "completion":
        if value is None:
            return None
        _as_api(check_logprobs, value)
        return value
    top = body.get("top_logprobs")
    _need(value is None or isinstance(value, bool), "logprobs", "true or false", value)
    if top is not None:
        _need(_is_int(top) and 0 <= top <= MAX_LOGPROBS, "top_logprobs", f"an integer in [0, {MAX_LOGPROBS}]", top)
        if not value:
            raise BadRequest("top_logprobs: needs logprobs=true", param="top_logprobs")
    return (top or 0) if value else None


__all__ = ["ASIDE_ITEMS", "BODY_BYTES_PER_TOKEN", "BODY_SLACK", "MAX_CHOICES", "MAX_LOGPROBS", "MAX_N", "MAX_PROMPTS",
           "MAX_STOP", "MAX_STOP_CHARS", "MAX_STOP_TOKEN_IDS", "AsSent", "BadRequest", "Job", "TokenizeJob",
           "ToolChoice", "default_max_request_bytes", "items_aside", "parse", "parse_detokenize", "parse_tokenize",
           "renamed_as"]
