"""The engine requests of one HTTP request: checked, queued, aborted; their answer collected or streamed."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import attrs
from fastapi import Request
from starlette.requests import ClientDisconnect

from engine.prompts import template_reads
from engine.reasoning import ReasoningText
from engine.sampling_params import SamplingParams
from engine.schema_refs import OUTSIDE
from engine.serving import EngineStopped, ServeEvent
from engine.stopping import SampleText
from engine.structured import ANY_VALUE, COSTLY, NO_VALUE, SLOW_COMPILE
from engine.structured_params import StructuredOutputsParams
from kvload.serve.admission import CLAIMED
from kvload.serve.choices import _Choice, _Echo, _Update
from kvload.serve.messages_input import MessagesRequest
from kvload.serve.messages_input import renamed as messages_renamed
from kvload.serve.messages_input import renamed_error as messages_error
from kvload.serve.messages_input import to_chat as messages_to_chat
from kvload.serve.openai_output import _OpenAIDocuments
from kvload.serve.protocol import EFFORT_UNREAD, BadRequest, Job, shutting_down
from kvload.serve.request_body import _load, on_disconnect
from kvload.serve.request_input import _encode, _header_request_id, _parse, _parse_body, cut_short
from kvload.serve.responses_input import ResponsesRequest, renamed, renamed_error, to_chat
from kvload.serve.responses_output import in_progress
from kvload.serve.state import ServeState
from kvload.serve.tool_calls import ToolCallText
from kvload.serve.tool_parser import tool_reader
from pipeline.errors import GenerationError, KvBuildError
from pipeline.events import SettingIgnored, StructuredOutputsRequested
from pipeline.limits import MAX_LOGPROB_TOKENS, MAX_SCORED_PROMPT_TOKENS


class _Run(_OpenAIDocuments):
    """The engine requests of one HTTP request, and their answer."""

    def __init__(self, state: ServeState, request: Request, loop: asyncio.AbstractEventLoop) -> None:
        self.state = state
        self.engine = state.engine
        self.request = request
        self.loop = loop
        self.job: Job = None  # type: ignore[assignment]  # set by prepare
        self.prompts: list[list[int]] = []
        self.queue: asyncio.Queue[tuple[int, ServeEvent] | None] = asyncio.Queue()  # None: the client left
        self.choices: list[_Choice] = []
        self.open: set[int] = set()
        self.id = ""
        self.created = 0
        self.role = "assistant"  # chat: the reply's role (vLLM's: the last message's without a generation prompt)
        self.chat_echo = ""  # chat's echo: the last message's content, put before each reply (vLLM's)
        # prepare runs on a worker thread: cancel (the event loop's) and each submit take turns under this lock,
        # so a request the server gave up on while it was being submitted never stays queued in the engine
        self.lock = threading.Lock()
        self.cancelled = False
        self.responses: ResponsesRequest | None = None  # a /v1/responses request: what its answer echoes
        self.messages: MessagesRequest | None = None  # a /v1/messages request: where its chat messages came from
        self.streamed: list[dict[str, Any]] = []  # a Responses stream's output items so far (the open one last)

    def prepare(self, raw: bytes | bytearray, kind: str) -> None:
        """Parse, tokenize, check and queue the request (on a worker thread); ``BadRequest`` when refused.
        ``kind`` "responses": OpenAI's Responses body ("messages": Anthropic's Messages body), served as the chat
        body saying the same, its refusals named in its own words."""
        if kind == "messages":
            self._prepare_messages(raw)
            return
        if kind != "responses":
            self._prepare(_parse(self.state, raw, kind))
            return
        try:
            chat, self.responses = to_chat(_load(raw), self.state.tool_call_parser, self.state.responses)
            if self.responses.store:  # what a kept response holds is about what its request sent
                self.state.responses.check_size(len(raw), self.engine.executor.max_seq_len)
            job = _parse_body(self.state, chat, "chat")
            job = attrs.evolve(job, max_tokens_field="max_output_tokens",
                               effort_field=job.effort_field and "reasoning.effort",
                               structured_field="text.format" if job.structured_field == "response_format"
                               else job.structured_field,
                               ignored=tuple((renamed(name, self.responses), value, why)
                                             for name, value, why in job.ignored) + self.responses.ignored)
            self._prepare(job)
        except BadRequest as exc:
            raise renamed_error(exc, self.responses) from None

    def prepare_body(self, body: Any, kind: str) -> None:
        """:meth:`prepare` of a chat (``kind`` "chat") or completions ("completion") body already loaded: an
        ``/invocations`` body, read to pick its route."""
        self._prepare(_parse_body(self.state, body, kind))

    def _prepare_messages(self, raw: bytes | bytearray) -> None:
        """:meth:`prepare` for Anthropic's Messages body: served as the chat body saying the same, refusals and
        reported settings named in its own words."""
        try:
            chat, self.messages = messages_to_chat(_load(raw), self.state.tool_call_parser,
                                                   self.state.reasoning_parser)
            job = _parse_body(self.state, chat, "chat")
            job = attrs.evolve(job, max_tokens_field="max_tokens",
                               effort_field=job.effort_field and "output_config.effort",
                               ignored=tuple((messages_renamed(name, self.messages), value, why)
                                             for name, value, why in job.ignored) + self.messages.ignored)
            self._prepare(job)
        except BadRequest as exc:
            raise messages_error(exc, self.messages) from None

    def _prepare(self, job: Job) -> None:
        """:meth:`prepare` once the body is a ``Job``."""
        self.job = job
        # vLLM's: an X-Request-Id header names the request, else its request_id, else a fresh id
        given = _header_request_id(self.request) or job.request_id
        prefix = "resp_" if self.responses is not None else "msg_" if self.messages is not None \
            else "chatcmpl-" if job.kind == "chat" else "cmpl-"
        self.id = prefix + (given or uuid.uuid4().hex)
        if given and self.responses is not None and self.responses.store:  # a fresh id names nothing kept
            header = "x-request-id" in self.request.headers
            self.state.responses.claim(self.id, "X-Request-Id" if header else "request_id")
            self.request.scope[CLAIMED] = self.id  # let go by _Admission once the request ends, however it ends
        self.prompts, cut = _encode(self.engine, job)
        short = cut_short(self.engine, job, cut)
        if short is not None:  # reported with the request's other ignored settings (submit)
            job = self.job = attrs.evolve(job, ignored=(*job.ignored, short))
        scored = sum(map(len, self.prompts)) if job.params.prompt_logprobs is not None else 0
        if scored > MAX_SCORED_PROMPT_TOKENS:
            field = "prompt_logprobs" if job.prompt_logprobs is not None else "echo"
            why = "prompt_logprobs" if field == "prompt_logprobs" else "echo: with logprobs"
            raise BadRequest(f"{why} every prompt token is scored and returned; at most "
                             f"{MAX_SCORED_PROMPT_TOKENS:,} prompt tokens per request, got {scored:,} (send fewer "
                             "prompts per request)", param=field)
        tok = self.engine.tokenizer
        offsets = job.kind == "completion" and job.logprobs is not None
        p = job.params
        text = {"skip_special": p.skip_special_tokens, "spaced": p.spaces_between_special_tokens}
        self.choices = [_Choice(i, self.engine, SampleText(tok, job.stop, include_stop=p.include_stop_str_in_output,
                                                           **text) if tok is not None else None,
                                track_offsets=offsets, min_tokens=p.min_tokens,
                                offsets=SampleText(tok, **text) if offsets and tok is not None else None)
                        for i in range(len(self.prompts) * job.n)]
        if job.echo and job.kind == "completion":  # a cut prompt is echoed as what the model saw: its kept tokens
            echoes = [_Echo.of(ids if was_cut else prompt, ids, tok, p.skip_special_tokens,
                               p.spaces_between_special_tokens)
                      for prompt, ids, was_cut in zip(job.prompts, self.prompts, cut, strict=True)]
            for c in self.choices:
                c.echo, c.echo_only = echoes[c.index // job.n], job.echo_only
        if job.tool_choice is not None:
            for c in self.choices:
                c.tools = ToolCallText(job.tool_choice)
        if job.auto_tools is not None:
            for c in self.choices:
                c.auto = tool_reader(job.auto_tools.parser, job.auto_tools.names, job.auto_tools.parallel)
        if job.reasoning is not None:
            for c in self.choices:
                c.thinking = ReasoningText(job.reasoning)
                if self.responses is not None:  # usage.output_tokens_details.reasoning_tokens
                    c.gauge = ReasoningText(job.reasoning)
        if job.kind == "chat":  # vLLM's reply role, and its echo: the last message when it is the reply's role
            last = job.prompts[0][-1]
            self.role = self.state.response_role if job.template.get("add_generation_prompt", True) else last["role"]
            self.chat_echo = last["content"] if job.echo and last["role"] == self.role else ""
        self.created = int(time.time())
        if self.responses is not None and self.responses.store:  # GET answers it while it is generated, not a 404
            self.state.responses.begin(self.id, functools.partial(in_progress, self))
            self.request.scope[CLAIMED] = self.id  # dropped by _Admission once the request ends, however it ends
        self.submit()

    def cancel(self) -> None:
        """Give up on the request from the event loop: what is queued is aborted, nothing more is queued."""
        with self.lock:
            self.cancelled = True
            self.abort()

    def submit(self) -> None:
        """Check every engine request fits, then queue them all (nothing queued when one is refused)."""
        job = self.job
        plan = []
        for i, ids in enumerate(self.prompts):
            if self.engine.stopping:  # as in _encode: up to 1,024 checks would only end in EngineStopped
                raise shutting_down()
            if self.cancelled:  # given up on (its client left: Departure.on_leave): the other checks are for no one
                raise ClientDisconnect()
            params = job.params
            room = self.engine.room(ids)
            if not job.max_tokens_given:  # the default never asks for more than max_seq_len leaves
                cap = max(1, min(params.max_tokens, room))
                params = self._default_cut(params, cap, i, len(ids), f"max_seq_len={self.engine.executor.max_seq_len}")
            elif 0 < room < params.max_tokens:  # asked for: refused, as vLLM does, not silently cut (a prompt with
                raise self._too_long(i, ids, params.max_tokens)  # no room at all is the prompt's error, below
            try:
                self.engine.check(ids, params)
            except GenerationError as exc:  # a sampling value the model cannot take (stop_token_ids, logprobs)
                msg = str(exc).removeprefix("generate: ")
                head = msg.split(":", 1)[0].split("[", 1)[0]  # bad_words[2]: the field
                if head.split(".", 1)[0] == "structured_outputs" and job.structured_field is not None:
                    # the schema xgrammar refused (or xgrammar missing), named as the request named it
                    field, msg = (job.structured_field, msg) if job.tool_choice is None else \
                        self._refused_tool(ids, params, msg)
                    if field != "structured_outputs":
                        msg = field + ":" + msg.split(":", 1)[1]
                    raise BadRequest(msg, param=field) from None
                raise BadRequest(msg, param=head if head.isidentifier() else "prompt") from None
            except KvBuildError as exc:
                fits = getattr(exc, "longest_sequence", None)
                if job.max_tokens_given or fits is None or fits <= len(ids):
                    raise self._never_fits(job, i, len(ids), exc) from None
                # the default asks no more than the KV cache holds after the prompt, as it asks no more than
                # max_seq_len leaves: a server whose --max_tokens is under prompt + default refused every client that
                # sends no max_tokens (most chat clients), telling it to lower a max_tokens it never sent
                params = self._default_cut(params, fits - len(ids), i, len(ids),
                                           f"the KV cache (one sequence of {fits:,} tokens)")
                try:
                    self.engine.check(ids, params)
                except KvBuildError as again:
                    raise self._never_fits(job, i, len(ids), again) from None
            plan.append((ids, params))
        if job.params.logprobs is not None:
            most = sum(params.max_tokens for _, params in plan) * job.n
            if most > MAX_LOGPROB_TOKENS:
                raise BadRequest(f"logprobs: every generated token's top log-probabilities are kept until the answer "
                                 f"is sent; at most {MAX_LOGPROB_TOKENS:,} generated tokens per request with logprobs, "
                                 f"and this one may generate {most:,} ({len(plan) * job.n:,} choices × max_tokens); "
                                 "ask for fewer choices or tokens per request", param="logprobs")
        # once per HTTP request (not per prompt or choice), and only for one that is served
        # under beam search n is its width, not identical greedy samples
        self.engine.report_ignored(job.params, 1 if job.beam is not None else job.n, request=self.id, salt=job.salt,
                                   model_defaults=job.model_defaults)
        if job.params.structured_outputs is not None:  # what was asked, never the spec itself
            self.engine.notify(StructuredOutputsRequested(request=self.id, field=job.structured_field or "",
                                                          tool_choice=job.tool_choice and job.tool_choice.mode,
                                                          **job.params.structured_outputs.describe()))
        if job.effort_field is not None and not template_reads(self.engine.tokenizer, job.template,
                                                               ("reasoning_effort", "enable_thinking")):
            job = attrs.evolve(job, ignored=(*job.ignored, (job.effort_field, job.template["reasoning_effort"],
                                                            EFFORT_UNREAD)))
        if job.ignored:  # accepted as vLLM accepts them, yet they can change nothing here
            self.engine.notify(*[SettingIgnored(field=f"serve.{name}", value=value, reason=f"{why} (request {self.id})",
                                                request=self.id)
                                 for name, value, why in job.ignored])
        try:
            for i, (ids, params) in enumerate(plan):
                indices = range(i * job.n, (i + 1) * job.n)  # the prompt's n choices: one prefill, n forks of it
                sinks = [functools.partial(_post, self.loop, self.queue, index) for index in indices]
                with self.lock:
                    if self.cancelled:
                        return
                    try:
                        if job.beam is not None:  # the prompt's n best hypotheses, best first
                            rids = self.engine.submit_beam(ids, attrs.evolve(job.beam, max_tokens=params.max_tokens),
                                                           sinks, salt=job.salt)
                        else:
                            rids = self.engine.submit_group(ids, params, sinks, salt=job.salt,
                                                            priority=job.priority, echo_only=job.echo_only)
                    except EngineStopped as exc:  # a 503 naming the cause, not a 500 with a traceback
                        if self.engine.loop_error is None:
                            raise shutting_down() from None
                        # the loop died (a bug, /health says "down"): this server will answer nothing more
                        raise BadRequest(str(exc), status=500, kind="server_error") from None
                    for index, rid in zip(indices, rids, strict=True):
                        self.choices[index].req_id = rid
                        self.open.add(index)
        except BaseException:
            with self.lock:
                self.abort()
            raise

    def _refused_tool(self, ids: list[int], params: Any, msg: str) -> tuple[str, str]:
        """The field to name when xgrammar refused ``tool_choice``'s schema, and the refusal: the named function's
        parameters; for "required", the first tool whose parameters are refused on their own, with that refusal (its
        paths within the tool's parameters, not within the schema of all the calls) (``tools`` when none is: their
        combination); ``tool_choice`` when it is not the schema (xgrammar missing)."""
        choice = self.job.tool_choice
        schema_words = ("xgrammar refused it", ANY_VALUE, COSTLY, NO_VALUE, OUTSIDE, SLOW_COMPILE)
        if not any(words in msg for words in schema_words):
            return "tool_choice", msg
        tools = [choice.tool] if choice.tool is not None else range(len(choice.schemas))
        for i in tools:
            alone = attrs.evolve(params, structured_outputs=StructuredOutputsParams(json=choice.schemas[i]))
            try:
                self.engine.check(ids, alone)
            except GenerationError as exc:
                return f"tools[{i}].function.parameters", str(exc).removeprefix("generate: ")
            except KvBuildError:  # past the schema's checks: not this one
                continue
        return "tools", msg

    def _never_fits(self, job: Any, i: int, prompt: int, exc: KvBuildError) -> BadRequest:
        """A request that could not complete even alone in the KV cache, with the advice a client can follow: fewer
        ``max_tokens`` when some would fit after its prompt, else a shorter prompt (``prompt``/``messages``)."""
        where = "" if len(self.prompts) == 1 else f"prompt {i}: "
        text = getattr(exc, "shortfall", None)
        longest = getattr(exc, "longest_sequence", None)
        if text is None or longest is None:  # not _check_fits' refusal: its own words
            text, advice = str(exc).removeprefix("generate: "), ""
        elif longest > prompt:
            advice = (f"; lower max_tokens to at most {longest - prompt:,}, or serve with a larger KV budget "
                      "(--max_tokens)")
        else:
            advice = (f"; shorten the prompt (the KV cache holds one sequence of {longest:,} tokens), or serve with a "
                      "larger KV budget (--max_tokens)")
        prompt_field = "messages" if job.kind == "chat" else "prompt"
        field = job.max_tokens_field if job.max_tokens_given and longest is not None and longest > prompt \
            else prompt_field
        text = text.replace("max_new_tokens", "max_tokens")
        return BadRequest(f"{field}: this request could never fit the KV cache: {where}{text}{advice}", param=field)

    def _default_cut(self, params: SamplingParams, cap: int, i: int, prompt: int, bound: str) -> SamplingParams:
        """The server's default ``max_tokens`` (the client sent none) cut to ``cap``, what ``bound`` leaves after the
        prompt. A ``min_tokens`` the request sent past it is refused, as vLLM refuses it (its default max_tokens is
        what the context leaves, and min_tokens may not exceed max_tokens); the model's own default is cut with it."""
        if params.min_tokens > cap and "min_tokens" not in self.job.model_defaults:
            where = "" if len(self.prompts) == 1 else f" (prompt {i})"
            also = " (or max_completion_tokens)" if self.job.kind == "chat" else ""
            raise BadRequest(f"min_tokens: expected an integer in [0, max_tokens={cap}], what {bound} leaves after the "
                             f"prompt's {prompt} tokens{where} (the request sends no max_tokens{also}), got "
                             f"{params.min_tokens}; lower min_tokens or shorten the prompt", param="min_tokens")
        return attrs.evolve(params, max_tokens=cap, min_tokens=min(params.min_tokens, cap))

    def _too_long(self, i: int, ids: list[int], max_tokens: int) -> BadRequest:
        """vLLM's refusal of a ``max_tokens`` past what the context length leaves after the prompt, in its words."""
        limit, field = self.engine.executor.max_seq_len, self.job.max_tokens_field
        where = "" if len(self.prompts) == 1 else f" (prompt {i})"
        return BadRequest(f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                          f"context length is {limit} tokens and your request has {len(ids)} input tokens "
                          f"({max_tokens} > {limit} - {len(ids)}){where}", param=field)

    def abort(self) -> None:
        """Abort every engine request still open (the client went away or something failed)."""
        for index in self.open:
            self.engine.abort(self.choices[index].req_id)
        self.open.clear()

    async def _next(self) -> tuple[int, ServeEvent] | None:
        """The next engine event; None when the client disconnected (its requests are then aborted)."""
        item = await self.queue.get()
        if item is None:
            self.abort()
        return item

    async def collect(self) -> dict[str, Any]:
        """Wait for every choice; the whole response document (empty when the client went away: its requests are
        then aborted)."""
        try:
            async with on_disconnect(self.request, lambda: self.queue.put_nowait(None)):
                while self.open:
                    item = await self._next()
                    if item is None:
                        return {}
                    index, ev = item
                    self.choices[index].update(ev)
                    if ev.finished:
                        self.open.discard(index)
        finally:
            self.abort()
        failed = next((c for c in self.choices if c.finish_reason == "error"), None)
        if failed is not None:  # the engine's failure (an out-of-memory forward): said once in the operator's log
            # (engine_step_failed), so a 500 here with no traceback, and the keep-alive connection serves on
            raise BadRequest(failed.error or "the engine failed this request", status=500, kind="server_error")
        doc = {"id": self.id, "object": "chat.completion" if self.job.kind == "chat" else "text_completion",
               "created": self.created, "model": self.state.model_name,
               "choices": [self._choice(c) for c in self.choices], "usage": self._usage()}
        if self.job.kind == "chat":  # vLLM's: the conversation's prompt scores, once per answer
            doc["prompt_logprobs"] = self._prompt_logprobs(self.choices[0])
            if self.job.return_token_ids:  # and its tokens, the template's output
                doc["prompt_token_ids"] = self.prompts[0]
        return doc

    async def stream(self) -> AsyncIterator[str]:
        """Server-sent events: a chunk per step with new text, a last chunk with the finish reason (or an error chunk),
        then [DONE]."""
        try:
            if self.job.kind == "chat":
                nothing = _Update("", [], [], [])
                for c in self.choices:
                    yield _sse(self._chunk(c, {"role": self.role, "content": ""}, nothing, False))
                if self.chat_echo:  # vLLM's: the echoed message in a chunk of its own, after the role's
                    for c in self.choices:
                        yield _sse(self._chunk(c, self.chat_echo, nothing, False))
            async for c, update, finished, delta in self.deltas():
                if delta is None:
                    err = BadRequest(c.error or "the engine failed this request", status=500, kind="server_error")
                    yield _sse(err.body())
                    yield "data: [DONE]\n\n"  # vLLM's too: a client reading to [DONE] is not left waiting on the close
                    return
                if c.echo_only and not c.echoed:  # echo without generation: the prompt, then the ending on its own
                    yield _sse(self._chunk(c, "", update, False))
                yield _sse(self._chunk(c, delta, update, finished))
            if self.job.include_usage or self.state.force_include_usage:
                yield _sse({"id": self.id, "object": self._chunk_object, "created": self.created,
                            "model": self.state.model_name, "choices": [], "usage": self._usage()})
            yield "data: [DONE]\n\n"
        finally:  # a closed connection cancels this generator: free what it still holds
            self.abort()

    async def deltas(self) -> AsyncIterator[tuple[_Choice, _Update, bool, Any]]:
        """Each engine event that says something, as (choice, update, finished, delta): the delta a stream sends for
        it (the new text, or under a reasoning parser or tools chat's delta object); None for a choice the engine
        failed, which ends it. Ends when every choice has finished or the client went away."""
        while self.open:
            item = await self._next()
            if item is None:
                return
            index, ev = item
            c = self.choices[index]
            update = c.update(ev)
            if ev.finished:
                self.open.discard(index)
            if c.finish_reason == "error":
                yield c, update, True, None
                return
            if update.text or update.token_ids or ev.finished:
                delta: Any = update.text
                if c.thinking is not None:  # the thinking as it comes; the answer as content (or read for calls)
                    delta = self._thinking_delta(c, update.text, ev.finished)
                elif c.tools is not None:  # the text as tool call deltas (none yet: an empty delta, its tokens)
                    calls = c.tools.feed(update.text) + (c.tools.finish() if ev.finished else [])
                    delta = {"tool_calls": calls} if calls else {}
                elif c.auto is not None:  # the text outside the calls; each call named, then its arguments as read
                    delta = self._auto_delta(c.auto, update.text, ev.finished)
                yield c, update, ev.finished, delta


def _post(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any], index: int, ev: ServeEvent) -> None:
    """The engine's sink: hand the event to the request's queue on the server's event loop."""
    with contextlib.suppress(RuntimeError):  # the loop closed: the server is going away
        loop.call_soon_threadsafe(queue.put_nowait, (index, ev))


def _sse(doc: dict[str, Any]) -> str:
    return f"data: {json.dumps(doc, separators=(',', ':'))}\n\n"
