"""A request body as a ``Job`` under this server's rules (model, template, beam), its prompts as token ids."""

from __future__ import annotations

import copy
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

from fastapi import Request

from engine.serving import ServingEngine
from kvload.serve.parse_gate import pass_turn
from kvload.serve.protocol import MAX_REQUEST_ID_CHARS, BadRequest, Job, held_aside, parse, request_id, shutting_down
from kvload.serve.request_body import _load
from kvload.serve.state import ServeState
from pipeline.errors import GenerationError
from pipeline.events import SettingIgnored


def _field_error(exc: GenerationError, field: str) -> BadRequest:
    return BadRequest(str(exc).removeprefix("generate: "), param=field)


def _messages_error(exc: GenerationError, template: dict[str, Any]) -> BadRequest:
    """A conversation the tokenizer or the chat template refused; a template the request gave is named for
    what it refused (its Jinja is the client's)."""
    msg = str(exc).removeprefix("generate: ")
    given = "chat_template" in template and "chat_template given " in msg  # refused it, or was stopped
    return BadRequest(msg, param="chat_template" if given else "messages")


def _parse(state: ServeState, raw: bytes | bytearray, kind: str) -> Job:
    """The request body as a ``Job``; ``BadRequest`` naming what is wrong."""
    body = _load(raw)
    return _parse_body(state, body, kind)


#: Request fields that are template variables of their own name: the request's own value of that name.
_TEMPLATE_FIELDS = ("reasoning_effort", "tools", "documents")


def with_default_template_kwargs(state: ServeState, body: Any) -> Any:
    """A chat body with the server's ``--default-chat-template-kwargs`` (vLLM's) under its own
    ``chat_template_kwargs``: the request's value of a name wins, in ``chat_template_kwargs`` or as the field of that
    name (``reasoning_effort``, ``tools``, ``documents``), and a request's ``reasoning_effort`` over a default
    ``enable_thinking``; a malformed one is left to be refused as such."""
    defaults = state.default_chat_template_kwargs
    if not defaults or not isinstance(body, dict):
        return body
    given = body.get("chat_template_kwargs")
    if given is not None and not isinstance(given, dict):
        return body
    # a default of a name the request gives as a field of its own is not the request's: it would be refused as
    # "given both as reasoning_effort and in chat_template_kwargs"
    defaults = {k: v for k, v in defaults.items() if k not in _TEMPLATE_FIELDS or body.get(k) is None}
    if body.get("reasoning_effort") is not None and "enable_thinking" not in (given or {}):
        # vLLM's order: the request's effort sets enable_thinking (on unless "none") over the server's default (a
        # Qwen3 served with '{"enable_thinking": false}' thinks for reasoning_effort "high"); only the request's
        # own chat_template_kwargs.enable_thinking overrides its effort
        defaults.pop("enable_thinking", None)
    return {**body, "chat_template_kwargs": {**defaults, **(given or {})}}


def _parse_body(state: ServeState, body: Any, kind: str) -> Job:
    """A loaded request body as a ``Job`` (``kind``: "completion" or "chat"); ``BadRequest`` naming what is wrong."""
    if kind == "chat":
        body = with_default_template_kwargs(state, body)
    job = parse(body, kind, default_max_tokens=state.default_max_tokens,
                by_priority=getattr(state.engine.scheduler, "by_priority", False), defaults=state.sampling_defaults,
                tool_parser=state.tool_call_parser, reasoning_parser=state.reasoning_parser)
    _check_model(state, body)
    _check_template(state, job.template)
    if job.beam is not None:
        _check_beam(state, job.n)
    return job


def _check_beam(state: ServeState, n: int) -> None:
    """A beam search this server can run, or the 400 that says which flags serve it: beam search needs KV cache
    manager V1 and a ``max_beam_width`` of at least ``n`` (the load routes ``max_beam_width > 1`` to V1)."""
    engine = state.engine
    if engine.ranks is not None:
        raise BadRequest("use_beam_search: not served under tensor parallel (--tp_size > 1); serve the model on one "
                         "device for beam search", param="use_beam_search")
    width = engine.executor.max_beam_width
    if width <= 1:
        v2 = type(engine.manager).__name__ == "KVCacheManagerV2"
        why = " on KV cache manager V2, which cannot fork beams" if v2 else ""
        flags = f"--max_beam_width {max(n, 2)}" + (" --use_kv_cache_manager_v2 false" if v2 else "")
        raise BadRequest(f"use_beam_search: this server was started with max_beam_width=1{why}; start it with {flags} "
                         "to serve beam search", param="use_beam_search")
    if n > width:
        raise BadRequest(f"n: {n} beams with use_beam_search exceed this server's max_beam_width={width}; send n <= "
                         f"{width}, or start the server with --max_beam_width {n}", param="n")


def _check_template(state: ServeState, template: dict[str, Any]) -> None:
    """A request's own ``chat_template`` is Jinja the server runs, as slow as the client writes it (and one request
    parses at a time): refused unless the server was started with ``--trust-request-chat-template`` (vLLM's rule)."""
    if template.get("chat_template") is not None and not state.trust_request_chat_template:
        raise BadRequest("chat_template: a request's own chat template needs a server started with "
                         "--trust-request-chat-template; this one applies the model's", param="chat_template")


def _check_model(state: ServeState, body: dict[str, Any]) -> None:
    """404 ``model_not_found`` for a ``model`` (checked a string already) that is none of the served names."""
    model = body.get("model")
    if model is not None and model not in state.served_names:
        raise _not_served(model, state.served_names)


def _not_served(model: str, served: tuple[str, ...]) -> BadRequest:
    """The 404 ``model_not_found`` for ``model``, naming every served name a request may give instead."""
    names = " or ".join(repr(name) for name in served)
    return BadRequest(f"model: {model[:300]!r} is not served here; this server serves {names}", param="model",
                      status=404, code="model_not_found")


def _encode(engine: ServingEngine, job: Job, room: bool = True) -> tuple[list[list[int]], list[bool]]:
    """Token ids of every prompt, kept to their last (``truncation_side`` "right": first) ``truncate_prompt_tokens``
    (and whether each was cut); ``BadRequest`` naming the prompt or the messages when one is unusable. ``room``
    false: a conversation is counted past the context, not refused (count_tokens, as /tokenize counts)."""
    keep = _kept_tokens(engine, job)

    def kept(ids: list[int]) -> list[int]:
        return ids if not keep else ids[:keep] if job.truncation_side == "right" else ids[-keep:]

    if job.kind == "chat":
        try:
            if keep is None:
                return [messages_tokens(engine, job.prompts[0], job.template,
                                        add_special_tokens=job.add_special_tokens, room=room)], [False]
            # cut first, then it fits; of a long templated text only the end it keeps tokenized, where that gives the
            # same ids
            ids, was_cut = kept_messages_tokens(engine, job.prompts[0], job.template, keep, job.truncation_side,
                                                add_special_tokens=job.add_special_tokens)
        except GenerationError as exc:
            raise _messages_error(exc, job.template) from None
        return [ids], [was_cut]
    out, cut = [], []
    for i, prompt in enumerate(job.prompts):
        field = "prompt" if len(job.prompts) == 1 else f"prompt[{i}]"
        # a stop asked for mid-request ends it now, not after encoding up to 1,024 prompts; between two prompts the
        # requests waiting to be parsed go first (a small one is not parsed after a thousand prompts of this one)
        if engine.stopping or (i and not pass_turn()):
            raise shutting_down()
        try:
            if keep is not None:  # vLLM's: the token ids are cut (a BOS too), then checked as any prompt's
                part = None
                if isinstance(prompt, str):  # only the end (or start) it keeps tokenized when that gives the same
                    # ids, else all of it, a long one off the gate (the same ids), then cut
                    part = kept_text_tokens(engine, prompt, keep, job.add_special_tokens, job.truncation_side)
                    if part is None:
                        prompt = text_tokens(engine, prompt, job.add_special_tokens)
                if part is not None:
                    cut.append(True)
                    prompt = part
                else:
                    ids = engine.prompt_ids(prompt)  # an empty one refused
                    cut.append(len(ids) > keep)
                    prompt = kept(ids)
            elif can_aside(engine, prompt):
                engine.check_prompt_chars(prompt)  # as encode: one too long by its characters is refused untokenized
                prompt = text_tokens(engine, prompt, job.add_special_tokens)
            if engine.stopping:
                raise shutting_down()
            out.append(engine.encode(prompt, add_special_tokens=job.add_special_tokens))
        except GenerationError as exc:
            detail = str(exc).removeprefix("generate: ").removeprefix("prompt 0: ").removeprefix("prompt 0 ")
            raise BadRequest(f"{field}: {detail}", param=field) from None
    return out, cut or [False] * len(out)


#: A text prompt of more characters than this is tokenized off the parse gate (``parse_gate.aside``), on a copy of the
#: tokenizer, one such prompt at a time: a prompt under the character bound (~660 KB for SmolLM2 at 8,192 tokens)
#: took ~0.5 s in one turn (more on a slower tokenizer), and every request sent meanwhile waited for it. The same
#: tokenizer's encode of the whole text, so the same tokens.
ASIDE_CHARS = 64 << 10

#: each engine tokenizer's copy, and the lock that lets one prompt at a time use it
_COPIES: weakref.WeakKeyDictionary[Any, tuple[Any, threading.Lock]] = weakref.WeakKeyDictionary()
_COPIES_LOCK = threading.Lock()


def can_aside(engine: ServingEngine, text: Any) -> bool:
    """Whether ``text`` is a prompt to tokenize off the gate: text past :data:`ASIDE_CHARS` and a tokenizer that can be
    copied (the copy made here, on the gate, at the first such prompt: ~0.5 s for SmolLM2's). A tokenizer that cannot
    be copied keeps such prompts on the gate, as before, rather than share one tokenizer between two threads."""
    return isinstance(text, str) and len(text) > ASIDE_CHARS and _copy(engine) is not None


def _copy(engine: ServingEngine) -> tuple[Any, threading.Lock] | None:
    """The engine tokenizer's copy and the lock one text at a time holds to use it, made at the first call; None
    without a tokenizer, or for one that cannot be copied: then a ``setting_ignored`` warning says once, in the
    server's log, that long texts are tokenized on the parse gate (requests sent meanwhile wait for them)."""
    tok = engine.tokenizer
    if tok is None:
        return None
    with _COPIES_LOCK:
        got = _COPIES.get(tok)
        if got is None:
            try:
                got = (copy.deepcopy(tok), threading.Lock())
            except Exception as exc:  # any tokenizer class: one that cannot be copied stays on the gate
                got = (None, threading.Lock())
                engine.notify(SettingIgnored(
                    field="serve.tokenizer_copy", value=type(tok).__name__,
                    reason=f"the tokenizer cannot be copied ({type(exc).__name__}: {str(exc)[:200]}): a text past "
                           f"{ASIDE_CHARS:,} characters (a prompt, an input, a chat's conversation) is tokenized on "
                           "the parse gate, in one turn, and requests sent meanwhile wait for it (no two threads "
                           "share one tokenizer)"))
            _COPIES[tok] = got
    return got if got[0] is not None else None


def text_tokens(engine: ServingEngine, text: str, add_special_tokens: bool, where: str = "prompt 0") -> list[int]:
    """``text``'s token ids as :meth:`ServingEngine.tokenize` gives them; one past :data:`ASIDE_CHARS`
    (:func:`can_aside`) tokenized off the parse gate, on the tokenizer's copy, while the requests waiting are parsed
    (``parse_gate.aside``): the same ids. The 503 of a server shutting down when it gave up on this request
    meanwhile."""
    if not can_aside(engine, text):
        return engine.tokenize(text, add_special_tokens=add_special_tokens, where=where)
    return held_aside(functools.partial(_tokenize_aside, engine, text, add_special_tokens, where))


def _tokenize_aside(engine: ServingEngine, text: str, add_special_tokens: bool, where: str = "prompt 0") -> list[int]:
    """``text``'s token ids on the server's copy of the engine's tokenizer (:func:`can_aside` made it), one text at a
    time; what :meth:`ServingEngine.encode` (or ``tokenize``) of it would tokenize."""
    copied, lock = _COPIES[engine.tokenizer]
    with lock:
        return engine.tokenize(text, add_special_tokens=add_special_tokens, where=where, tokenizer=copied)


def messages_chars(messages: Any, past: int = ASIDE_CHARS) -> int:
    """How many characters of text a conversation holds (every string in it: contents, parts, tool calls), counted
    no further than past ``past`` (20,000 messages were all counted in 46 ms, on the gate)."""
    count, todo = 0, [messages]
    while todo and count <= past:
        item = todo.pop()
        if isinstance(item, str):
            count += len(item)
        elif isinstance(item, dict):
            todo.extend(k for k in item if isinstance(k, str))
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
    return count


def messages_tokens(engine: ServingEngine, messages: list[dict[str, Any]], template: dict[str, Any], *,
                    add_special_tokens: bool, room: bool, instead: str | None = None) -> list[int]:
    """``engine.encode_messages`` of a request's conversation (chat completions, responses, Anthropic's messages and
    count_tokens, ``/tokenize``, ``/classify`` and ``/pooling`` of messages). One of more than :data:`ASIDE_CHARS`
    characters is templated and tokenized off the parse gate, on the tokenizer's copy (:func:`can_aside`), while the
    requests waiting are parsed: rendering 2 MB over 2,000 messages took ~0.6 s in one turn (the template's steps are
    counted, ``engine.prompts._bounded``). The same template on the same tokenizer's copy: the same text, the same
    ids, the same refusals. A shorter conversation is templated on the gate and its text, when long (a template that
    writes much), tokenized aside (:func:`text_tokens`)."""
    return _messages_ids(engine, messages, template, add_special_tokens, room, instead,
                         lambda engine, tokenizer: _whole_text(engine, None) if tokenizer is None else None)


def kept_messages_tokens(engine: ServingEngine, messages: list[dict[str, Any]], template: dict[str, Any], keep: int,
                         side: str = "left", *, add_special_tokens: bool) -> tuple[list[int], bool]:
    """(the ids ``truncate_prompt_tokens`` keeps of a conversation's templated text: its last ``keep``, first for
    ``side`` "right"; whether it had more), templated as :func:`messages_tokens` templates it, on the gate or off it,
    and of its text only an end long enough for the ids kept tokenized, as a text prompt's
    (:func:`kept_text_tokens`: a cut where the tokenizer splits whatever comes before or after, so the same ids as
    the whole text's, cut); all of it where the tokenizer cannot be cut so (then as before: all tokenized, then
    cut). Never refused for leaving no room: it is cut first."""
    cut = [False]

    def ends(_: ServingEngine, tokenizer: Any) -> Callable[[str, bool], list[int]]:
        whole = _whole_text(engine, tokenizer)

        def tokenize(text: str, add: bool) -> list[int]:
            if keep >= 1 and _cuts(engine.tokenizer, tokenizer):
                part = _kept_end(text, keep, side, lambda end: whole(end, add))
                if part is not None:
                    cut[0] = True
                    return part
            ids = whole(text, add)
            cut[0] = len(ids) > keep
            return ids[-keep:] if side == "left" else ids[:keep]

        return tokenize

    ids = _messages_ids(engine, messages, template, add_special_tokens, False, None, ends)
    return ids, cut[0]


def _whole_text(engine: ServingEngine, tokenizer: Any) -> Callable[[str, bool], list[int]]:
    """``tokenize(text, add_special_tokens)`` of a conversation's templated text: on the gate (``tokenizer`` None)
    :func:`text_tokens`, a long text aside; off it (in a conversation templated aside) on ``tokenizer``, the copy."""
    if tokenizer is None:
        return functools.partial(text_tokens, engine, where="messages")
    return lambda text, add: engine.tokenize(text, add_special_tokens=add, where="messages", tokenizer=tokenizer)


def _messages_ids(engine: ServingEngine, messages: list[dict[str, Any]], template: dict[str, Any],
                  add_special_tokens: bool, room: bool, instead: str | None,
                  tokenizing: Callable[[ServingEngine, Any], Callable[[str, bool], list[int]] | None]) -> list[int]:
    """:func:`messages_tokens`, the templated text's ids from ``tokenizing(engine, tokenizer)`` (``tokenizer``: the
    copy a conversation templated off the gate is tokenized on, None on the gate; its None: the tokenizer's own
    call, as ``encode_messages`` makes it)."""
    more = {} if instead is None else {"instead": instead}
    if messages_chars(messages) <= ASIDE_CHARS or _copy(engine) is None:
        return engine.encode_messages(messages, template, add_special_tokens=add_special_tokens, room=room,
                                      tokenize=tokenizing(engine, None), **more)

    def render() -> list[int]:
        copied, lock = _COPIES[engine.tokenizer]
        with lock:
            return engine.encode_messages(messages, template, add_special_tokens=add_special_tokens, room=room,
                                          tokenizer=copied, tokenize=tokenizing(engine, copied), **more)

    return held_aside(render)


#: whether each engine tokenizer may be cut (:func:`engine.token_bound.cut_points`: read once, from its whole JSON)
_CUTS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()

#: Token ids tokenized past those a cut keeps, before the cut (the most special tokens a tokenizer adds on both ends
#: are added to it): what tells a long enough end of a text from one too short.
_CUT_MARGIN = 16
#: The first end of a text tokenized for ``truncate_prompt_tokens`` k: ``k * _FIRST_CHARS_PER_TOKEN`` characters;
#: four times more each time it holds too few tokens, up to the whole text.
_FIRST_CHARS_PER_TOKEN = 8


def kept_text_tokens(engine: ServingEngine, text: str, keep: int, add_special_tokens: bool,
                     side: str = "left") -> list[int] | None:
    """The ids ``truncate_prompt_tokens`` keeps of a text prompt (its last ``keep``, or first for ``side`` "right"),
    tokenizing only an end of it long enough to hold them: a 20 MB prompt cut to 100 tokens was tokenized whole.
    The end starts (or stops) where the tokenizer splits the whole text whatever comes before (or after):
    :func:`engine.token_bound.cut_points`; tokens are made within pieces split there, so the end's ids past the cut
    are the whole text's. None where that cannot be told (another tokenizer, a text with no such place, or no more
    than ``keep`` tokens in all): the caller tokenizes all of it, as before."""
    from engine.prompts import check_text

    if engine.tokenizer is None or keep < 1 or not _cuts(engine.tokenizer):
        return None
    check_text("prompt 0", text)  # refused in the words of the whole text (where its lone surrogate is)
    return _kept_end(text, keep, side, lambda part: text_tokens(engine, part, add_special_tokens))


def _cuts(tok: Any, read: Any = None) -> bool:
    """Whether the engine's tokenizer ``tok`` may be cut (:func:`engine.token_bound.cut_points`), read once, from
    ``read`` (its copy, off the gate) or ``tok`` itself."""
    from engine.token_bound import cut_points

    with _COPIES_LOCK:
        cuts = _CUTS.get(tok)
        if cuts is None:
            cuts = _CUTS[tok] = cut_points(tok if read is None else read)
    return cuts


def _kept_end(text: str, keep: int, side: str, tokenize: Callable[[str], list[int]]) -> list[int] | None:
    """:func:`kept_text_tokens` of a tokenizer that may be cut, ``tokenize(part)`` the ids of an end of ``text`` (the
    special tokens the tokenizer adds included); None when no end short of the whole text tells them."""
    extra = len(tokenize("")) + _CUT_MARGIN
    chars = keep * _FIRST_CHARS_PER_TOKEN + 1024
    while chars < len(text):
        at = _cut_at(text, len(text) - chars if side == "left" else chars)
        if at is None:
            return None
        part = text[at:] if side == "left" else text[:at]
        ids = tokenize(part)
        if len(ids) > keep + extra:  # past the margin: the whole text's ids there, and more of them than kept
            return ids[-keep:] if side == "left" else ids[:keep]
        chars *= 4
    return None


def _cut_at(text: str, near: int) -> int | None:
    """A place at or before ``near`` (within 64 Ki characters) where a letter is followed by a space: the tokenizers
    :func:`engine.token_bound.cut_points` allows split there, whatever the text around it."""
    at = near
    for _ in range(1 << 12):
        at = text.rfind(" ", max(0, near - (1 << 16)), at)
        if at <= 0:
            return None
        if text[at - 1].isalpha():
            return at
    return None


def _kept_tokens(engine: ServingEngine, job: Job) -> int | None:
    """How many of each prompt's last tokens ``truncate_prompt_tokens`` keeps (None: all), bounded as vLLM bounds
    it: by the context length less ``max_tokens`` when given, else by the context length (which -1 asks for); a
    sequence never grows past it here, so without ``max_tokens`` at most one token fewer is kept (one to generate:
    :func:`cut_short` says when that made a difference)."""
    if job.truncate is None:
        return None
    limit = engine.executor.max_seq_len
    # echo with max_tokens 0 runs one token it never shows (job.params.max_tokens is 1): the user asked for none
    wanted = job.params.max_tokens if job.max_tokens_given and not job.echo_only else 0
    room = limit - wanted
    if room < 1:  # no truncation can help: max_tokens alone fills the context (a prompt needs a token)
        raise BadRequest(f"{job.max_tokens_field}: {wanted} leaves no room for a prompt in this model's context "
                         f"length of {limit} tokens (truncate_prompt_tokens cannot help); ask for fewer",
                         param=job.max_tokens_field)
    if job.truncate > room:
        given = f"- {job.max_tokens_field} = {limit} - {wanted} = {room}" if job.max_tokens_given else f"= {limit}"
        raise BadRequest(f"truncate_prompt_tokens: {job.truncate} is more than max_model_len {given}; request a "
                         "smaller truncation size (or -1 for that many)", param="truncate_prompt_tokens")
    keep = room if job.truncate == -1 else job.truncate  # a max_tokens past the context is refused as such (submit)
    return min(keep, limit - 1)


def cut_short(engine: ServingEngine, job: Job, cut: list[bool]) -> tuple[str, Any, str] | None:
    """The ``setting_ignored`` (field, value, reason) when ``truncate_prompt_tokens`` asked to keep the whole context
    length (k = max_model_len without ``max_tokens``, or with echo's ``max_tokens`` 0) and a prompt that long kept one
    token fewer (-1 means that)."""
    limit = engine.executor.max_seq_len
    if job.truncate != limit or (job.max_tokens_given and not job.echo_only) or not any(cut):
        return None
    if job.echo_only:  # nothing is generated, but the sequence still holds the one token it runs
        return ("truncate_prompt_tokens", limit,
                f"a prompt kept its last {limit - 1} tokens, not max_model_len={limit}: a sequence never grows past "
                "it here, and echo with max_tokens 0 still runs one token (vLLM echoes max_model_len tokens)")
    return ("truncate_prompt_tokens", limit,
            f"a prompt kept its last {limit - 1} tokens, not max_model_len={limit}: a sequence never grows past it "
            "here, so one token is left to generate (vLLM keeps max_model_len tokens and refuses the request: "
            "no max_tokens fits)")


def _header_request_id(request: Request) -> str | None:
    """The ``X-Request-Id`` header (vLLM's), checked as ``request_id`` is, and ASCII: a header's other bytes are read
    as Latin-1, so UTF-8 sent there came back in the answer's id as mojibake (``Ã¿``). Given twice is a 400: which one
    names the request is not for the server to guess."""
    values = request.headers.getlist("x-request-id")
    if len(values) > 1:
        raise BadRequest(f"X-Request-Id: given {len(values)} times; give it once", param="X-Request-Id")
    value = values[0] if values else None
    if value is not None and not value.isascii():
        raise BadRequest(f"X-Request-Id: expected printable ASCII of 1 to {MAX_REQUEST_ID_CHARS} characters (a header "
                         f"carries no other text; send request_id in the body for Unicode), got {value[:60]!r}",
                         param="X-Request-Id")
    return request_id(value, "X-Request-Id")
