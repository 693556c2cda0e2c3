"""OpenAI's completions and chat completions answers of a request: choices, stream chunks, logprobs, usage."""

from __future__ import annotations

from typing import Any

from kvload.serve.choices import _Choice, _Update
from kvload.serve.tool_reader import ToolReader


class _OpenAIDocuments:
    """The documents of a ``_Run`` (a mixin: its job, choices, prompts and state read through ``self``)."""

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.job.kind == "chat" else "text_completion"

    def _chunk(self, c: _Choice, delta: Any, update: _Update, finished: bool) -> dict[str, Any]:
        ids, lps = update.token_ids, update.logprobs
        ending = {"finish_reason": c.reason if finished else None, "stop_reason": c.stop_reason if finished else None,
                  "token_ids": ids}
        if self.job.kind == "chat":
            body = delta if isinstance(delta, dict) else {"content": delta}
            choice = {"index": c.index, "delta": body, "logprobs": self._chat_logprobs(ids, lps), **ending}
        else:
            # the prompt, in the first chunk (echo without generation: in one before the ending's)
            echo = c.echo is not None and not c.echoed and bool(ids or finished or c.echo_only)
            c.echoed = c.echoed or echo
            choice = {"index": c.index, "text": (c.echo.text if echo else "") + delta,
                      "logprobs": self._completion_logprobs(ids, lps, update.offsets, c, echo), **ending}
        doc = {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.state.model_name,
               "choices": [choice]}
        if self.job.return_token_ids and not c.opened:  # vLLM's: in the choice's first chunk (chat: its role's)
            (doc if self.job.kind == "chat" else choice)["prompt_token_ids"] = self.prompts[c.index // self.job.n]
        c.opened = True
        # vLLM's: the choice's prompt and its tokens so far, in every chunk (--enable-force-include-usage: always)
        if self.job.continuous_usage or self.state.force_include_usage:
            prompt = len(self.prompts[c.index // self.job.n])
            doc["usage"] = {"prompt_tokens": prompt, "completion_tokens": len(c.token_ids),
                            "total_tokens": prompt + len(c.token_ids)}
        return doc

    def _choice(self, c: _Choice) -> dict[str, Any]:
        ids = c.token_ids
        if self.job.kind == "chat":
            message: dict[str, Any] = {"role": self.role, "content": self.chat_echo + c.text}
            if c.thinking is not None:  # vLLM's: the thinking apart; the answer as content, or read for calls
                message = self._thinking_message(c)
            elif c.tools is not None:  # vLLM's: the content empty (but an echo), the reply read as the calls
                c.tools.feed(c.text)
                c.tools.finish()
                message = {"role": self.role, "content": self.chat_echo, "tool_calls": c.tools.message()}
            elif c.auto is not None:  # the calls the text holds, and the text around them (vLLM's: null when none)
                message = self._auto_message(c.auto, c.text)
            if self.state.reasoning_parser is not None and "reasoning_content" not in message:  # vLLM's: always there
                message.update(reasoning_content=None, reasoning=None)  # (qwen3 with its thinking switched off)
            ending = {"finish_reason": c.reason, "stop_reason": c.stop_reason, "token_ids": ids}  # the calls read
            return {"index": c.index, "message": message, "logprobs": self._chat_logprobs(ids, c.logprobs), **ending}
        ending = {"finish_reason": c.reason, "stop_reason": c.stop_reason, "token_ids": ids}
        return {"index": c.index, "text": (c.echo.text if c.echo is not None else "") + c.text,
                "logprobs": self._completion_logprobs(ids, c.logprobs, c.text_offsets, c, c.echo is not None),
                **ending, "prompt_logprobs": self._prompt_logprobs(c),
                **({"prompt_token_ids": self.prompts[c.index // self.job.n]} if self.job.return_token_ids else {})}

    def _auto_message(self, auto: ToolReader, text: str) -> dict[str, Any]:
        """An "auto" reply's message: the calls ``text`` holds, and the text around them (vLLM's: null when none)."""
        auto.feed(text)
        auto.finish()
        content = auto.content
        return {"role": self.role, "content": self.chat_echo + content if content is not None else self.chat_echo
                or None, "tool_calls": auto.calls}

    def _thinking_message(self, c: _Choice) -> dict[str, Any]:
        """A reply under ``--reasoning-parser``: ``reasoning_content`` (vLLM's newer name ``reasoning`` too; null when
        none) and the answer as content, or read for calls: "auto" tools' or a named or "required" ``tool_choice``'s
        (none when the thinking never ended)."""
        thinking, auto = c.thinking, c.auto
        thinking.feed(c.text)
        thinking.finish()
        reasoning, answer = thinking.reasoning, thinking.content
        if c.tools is not None:  # the grammar held the answer: it is the calls; qwen3's text before <think> is content
            if thinking.ended:
                c.tools.feed(thinking.answer)
                c.tools.finish()
            before = (answer or "")[:len(answer or "") - len(thinking.answer)]
            message = {"role": self.role, "content": self.chat_echo + before, "tool_calls": c.tools.message()}
        elif auto is not None and answer is not None:  # no answer (the thinking never ended): no calls, content null
            message = self._auto_message(auto, answer)
        else:
            message = {"role": self.role, "content": self.chat_echo + answer if answer is not None
                       else self.chat_echo or None}
            if auto is not None:
                message["tool_calls"] = []
        if not self.job.include_reasoning:  # vLLM's include_reasoning: false
            reasoning = None
        return {**message, "reasoning_content": reasoning, "reasoning": reasoning}

    def _thinking_delta(self, c: _Choice, text: str, finished: bool) -> dict[str, Any]:
        """A stream's delta for a reply's new ``text`` under ``--reasoning-parser``: its new thinking as
        ``reasoning_content`` (and ``reasoning``), the answer as content or, for tools, content and calls."""
        before, reasoning, answer = c.thinking.read(text)
        if finished:
            more = c.thinking.finish_read()
            before, reasoning, answer = before + more[0], reasoning + more[1], answer + more[2]
        if c.tools is not None:  # named or "required": the answer is the calls, as the whole answer reads them
            calls = c.tools.feed(answer) if answer else []  # (nothing while thinking: a reply cut there made no call)
            if finished and c.thinking.ended:
                calls += c.tools.finish()
            delta: dict[str, Any] = {"content": before} if before else {}
            if calls:
                delta["tool_calls"] = calls
        elif c.auto is not None:
            delta = self._auto_delta(c.auto, before + answer, finished)
        else:
            delta = {"content": before + answer} if before or answer else {}
        if reasoning and self.job.include_reasoning:
            return {"reasoning_content": reasoning, "reasoning": reasoning, **delta}
        return delta

    @staticmethod
    def _auto_delta(auto: ToolReader, text: str, finished: bool) -> dict[str, Any]:
        """A stream's delta for an "auto" reply's new ``text``: its content, and its calls' new names and arguments."""
        content, calls = auto.feed(text, final=finished)
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _prompt_logprobs(self, c: _Choice) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's ``prompt_logprobs`` of the choice's prompt: per token (the first None) the token's own entry then
        its top alternatives, each ``{"logprob", "rank", "decoded_token"}`` keyed by token id; None when not
        scored. A completion's echo with ``logprobs`` scores the prompt, and vLLM returns the scores then too."""
        job = self.job
        k = job.prompt_logprobs
        if k is None and job.kind == "completion" and job.echo:
            k = job.logprobs
        if k is None or c.prompt_logprobs is None:
            return None
        out: list[dict[str, dict[str, Any]] | None] = []
        for token, entry in zip(self.prompts[c.index // job.n], c.prompt_logprobs, strict=True):
            if entry is None:
                out.append(None)
                continue
            doc = {str(token): self._scored(token, entry[token], getattr(entry, "rank", None))}
            # the top k by place (1 to k); the token, when among them, takes its place there (vLLM's order)
            for place, (alt, value) in enumerate(_best(entry, k), 1):
                doc[str(alt)] = self._scored(alt, value, place)
            out.append(doc)
        return out

    def _scored(self, token: int, logprob: float, rank: int | None) -> dict[str, Any]:
        # the text, under --return-tokens-as-token-ids too (vLLM names only the answer's logprobs so)
        text = self.engine.token_piece(token)[0] if self.engine.tokenizer is not None else None
        # -inf (a token the model rules out) as -9999.0, vLLM's and OpenAI's stand-in JSON can hold
        return {"logprob": max(logprob, -9999.0), "rank": rank, "decoded_token": text}

    def _usage(self) -> dict[str, Any]:
        per_prompt = self.choices[::self.job.n]
        prompt = sum(c.prompt_tokens for c in per_prompt)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(c.reused for c in per_prompt)}}

    def _token(self, token_id: int) -> str:
        return self._piece(token_id)[0]

    def _piece(self, token_id: int) -> tuple[str, bytes]:
        """A token as logprobs name it, and its raw bytes: ``token_id:N`` under ``--return-tokens-as-token-ids``
        or the request's ``return_tokens_as_token_ids`` (vLLM's, which wins over the flag; for tokens whose text JSON
        cannot carry), its bytes still the token's own, as vLLM's are."""
        text, raw = self.engine.token_piece(token_id)
        asked = self.job.return_tokens_as_token_ids
        as_id = self.state.return_tokens_as_token_ids if asked is None else asked
        return (f"token_id:{token_id}", raw) if as_id else (text, raw)

    def _completion_logprobs(self, ids: list[int], lps: list[Any], offsets: list[int], c: _Choice,
                             echo: bool = False) -> dict[str, Any] | None:
        """OpenAI's legacy completions logprobs; with ``echo``, the prompt's tokens first (the first has none)."""
        if self.job.logprobs is None or not (lps or echo):
            return None
        tokens: list[str] = []
        values: list[float | None] = []
        top: list[dict[str, float] | None] = []
        shift = 0
        where: list[int] = []
        if echo and c.echo is not None:
            scored = c.prompt_logprobs or [None] * len(c.echo.token_ids)
            k = self.job.logprobs or 0  # the prompt may be scored with more (prompt_logprobs): `logprobs` shown
            for t, entry in zip(c.echo.token_ids, scored, strict=True):
                tokens.append(self._token(t))
                values.append(None if entry is None else entry[t])
                top.append(None if entry is None else self._top(t, entry[t], dict(_best(entry, k))))
            where = list(c.echo.offsets)
        if c.echo is not None:  # every chunk's offsets count from the start of the echoed text, as the whole answer's
            shift = len(c.echo.text)
        for t, (lp, alts) in zip(ids, lps, strict=False):
            tokens.append(self._token(t))
            values.append(lp)
            top.append(self._top(t, lp, alts))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top,
                "text_offset": where + [o + shift for o in offsets[:len(lps)]]}

    def _top(self, token: int, lp: float, alts: dict[int, float]) -> dict[str, float]:
        # the top `logprobs` tokens plus the one chosen (vLLM's and OpenAI's legacy completions; chat: exactly k)
        entry = {self._token(token): lp}
        for a, v in alts.items():
            entry.setdefault(self._token(a), v)
        return entry

    def _chat_logprobs(self, ids: list[int], lps: list[Any]) -> dict[str, Any] | None:
        if self.job.logprobs is None or not lps:
            return None
        content = []
        for t, (lp, alts) in zip(ids, lps, strict=False):
            token, raw = self._piece(t)
            top = []
            for a, v in alts.items():
                alt, alt_raw = self._piece(a)
                top.append({"token": alt, "logprob": v, "bytes": list(alt_raw)})
            content.append({"token": token, "logprob": lp, "bytes": list(raw), "top_logprobs": top})
        return {"content": content}


def _best(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely of a logprob entry's tokens (its top alternatives and the scored token)."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]
