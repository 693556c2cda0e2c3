"""Text as the serving engine takes and gives it: prompts and conversations tokenized and checked against
``max_seq_len`` before tokenizing, token ids shown as text and as the bytes a token spells (:class:`ServingText`, a
part of :class:`~engine.serving.ServingEngine`)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.call_requests import POOLED
from engine.prompts import apply_template, check_text, missing_template
from engine.token_bound import fewest_tokens, token_bound
from pipeline.errors import GenerationError

#: a SentencePiece byte-fallback token: the byte it stands for
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character → byte: byte-level BPE vocabularies spell every byte as one printable
    character (bytes that are printable Latin-1 as themselves, the rest shifted past 255). Written out rather than
    imported: transformers moved ``bytes_to_unicode`` between releases."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    shifted = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer's vocabulary is byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen): its pieces spell bytes."""
    if tokenizer is None:
        return False
    if getattr(tokenizer, "byte_decoder", None) is not None:  # transformers' Python GPT-2-style tokenizers
        return True
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    # a Sequence decoder does not list its parts but names them in its repr
    return decoder is not None and (type(decoder).__name__ == "ByteLevel" or "ByteLevel(" in repr(decoder))


def _token_piece(tokenizer: Any, token_id: int, byte_level: bool) -> tuple[str, bytes]:
    """(text with special tokens shown, raw bytes) of one token; see :meth:`ServingEngine.token_piece`."""
    if tokenizer is None:
        return str(token_id), str(token_id).encode()
    text = tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    spelled = tokenizer.convert_ids_to_tokens(token_id)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    if isinstance(spelled, str) and token_id not in added:  # an added token is stored as its text, not as bytes
        fallback = _BYTE_FALLBACK.fullmatch(spelled)
        if fallback is not None:
            return text, bytes([int(fallback[1], 16)])
        decoder = _byte_decoder()
        if byte_level and spelled and all(c in decoder for c in spelled):
            return text, bytes(decoder[c] for c in spelled)
    return text, text.encode()


class ServingText:
    """Prompts and conversations to token ids (checked for length), token ids to text and bytes."""

    def encode(self, prompt: str | Sequence[int], *, chat: bool = False, add_special_tokens: bool = True) -> list[int]:
        """Token ids of one prompt (text through the tokenizer, ``chat`` wraps it as one user message), checked as
        ``generate`` checks a prompt. ``add_special_tokens=False``: text without the tokenizer's BOS (vLLM's)."""
        limit = self.executor.max_seq_len
        if isinstance(prompt, str) and not chat:
            self._check_chars("generate: prompt 0", prompt)
        if isinstance(prompt, str) and not add_special_tokens and not chat:
            prompt = self.prompt_ids(prompt, add_special_tokens=False)
        if not chat and not isinstance(prompt, str) and len(prompt) >= limit:  # ids: refused by their count first, as
            # generate words it, not after each of them is checked (a server's body of tens of millions of ids held
            # its one parsing worker, which every request waits on, for a minute)
            raise GenerationError(f"generate: prompt 0: {len(prompt)} tokens leave no room to generate under "
                                  f"max_seq_len={limit}; shorten it or raise max_seq_len")
        ((_, ids),) = self.executor._prompts([prompt], chat)
        return ids

    def prompt_ids(self, prompt: str | Sequence[int], *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of one prompt, unchecked but for being empty: text through the tokenizer
        (``add_special_tokens``: its BOS), ids as given; ``GenerationError`` worded as ``generate`` words a prompt
        of no tokens (what serving cuts to ``truncate_prompt_tokens`` before :meth:`encode` checks the rest)."""
        ids = (self.tokenize(prompt, add_special_tokens=add_special_tokens, where="prompt 0")
               if isinstance(prompt, str) else list(prompt))
        if not ids:
            raise GenerationError("generate: prompt 0: empty (no tokens)")
        return ids

    def encode_messages(self, messages: list[dict[str, str]], template: Mapping[str, Any] | None = None, *,
                        add_special_tokens: bool = False, room: bool = True,
                        instead: str = "use /v1/completions with token ids",
                        tokenize: Callable[[str, bool], list[int]] | None = None, tokenizer: Any = None) -> list[int]:
        """Token ids of a chat conversation through the chat template (the tokenizer's, or
        ``template["chat_template"]``), ready for the reply. ``template``: ``engine.prompts.template_options``'
        keywords (vLLM's add_generation_prompt, continue_final_message, chat_template, chat_template_kwargs);
        ``add_special_tokens``: the tokenizer's BOS on top of what the template writes (vLLM's, off by default);
        ``room``: refuse a conversation that leaves no room to generate (off for /tokenize); ``instead``: what the
        refusal of a tokenizer without a chat template offers (the endpoint's own field for a prompt); ``tokenize``:
        ``tokenize(text, add_special_tokens)``, the templated text's ids as the tokenizer gives them (the server's
        tokenizes a long one off its parse gate, on a copy of the tokenizer: the same ids); ``tokenizer``: a copy of
        the engine's to render and tokenize with (the server's for a long conversation, off its parse gate)."""
        template = dict(template or {})
        for j, m in enumerate(messages):  # a lone surrogate would reach the tokenizer as a TypeError
            check_text(f"messages[{j}].content", m["content"])
        tok = self.tokenizer if tokenizer is None or self.tokenizer is None else tokenizer
        missing = missing_template(tok, template, self.executor.name)
        if missing is not None:
            raise GenerationError(f"messages: {missing}; {instead}")
        # what apply_chat_template(tokenize=True) does (and LLM.chat): the text, then its ids with no special
        # tokens of the tokenizer's own unless asked (the template already holds them)
        text = apply_template(tok, "messages", messages, tokenize=False, content_format=self.content_format, **template)
        # what else the template renders (its variables, its own text) may hold a lone surrogate the checks above miss
        check_text("messages: the chat template's text", text)
        if room:
            self._check_chars("messages", text, tok)
        ids = ([int(t) for t in tok(text, add_special_tokens=add_special_tokens)["input_ids"]] if tokenize is None
               else tokenize(text, add_special_tokens))
        if room and len(ids) >= self.executor.max_seq_len:
            raise GenerationError(f"messages: {len(ids)} tokens leave no room to generate under "
                                  f"max_seq_len={self.executor.max_seq_len}")
        return ids

    def _check_chars(self, where: str, text: str, tokenizer: Any = None) -> None:
        """``GenerationError`` worded as a prompt too long for ``max_seq_len`` when ``text`` has more characters than
        that many of the tokenizer's longest tokens cover (``engine.token_bound``): refused before tokenizing it,
        which for tens of megabytes took a minute of the server's one parsing worker. ``tokenizer``: the engine's
        copy to read the bound from, the first time (off the server's parse gate)."""
        limit = self.executor.max_seq_len
        fewest, per_token = self._fewest_tokens(text, limit, tokenizer)
        if fewest >= limit:
            raise GenerationError(f"{where}: at least {fewest:,} tokens ({self._chars_said(text)}, a token of "
                                  f"this tokenizer covering at most {per_token}) leave no room to generate "
                                  f"under max_seq_len={limit}; shorten it or raise max_seq_len")

    def check_embedding_chars(self, where: str, text: str, what: str = POOLED["embed"]) -> None:
        """As :meth:`_check_chars` for an embedding's input (``what``: the pooled request, as
        ``engine.call_requests.POOLED`` names it), which may fill ``max_seq_len`` (nothing is generated): worded as the
        executor words one past it."""
        limit = self.executor.max_seq_len
        fewest, per_token = self._fewest_tokens(text, limit + 1)
        if fewest > limit:
            raise GenerationError(f"{where}: at least {fewest:,} tokens ({self._chars_said(text)}, a token of this "
                                  f"tokenizer covering at most {per_token}); {what} takes at most "
                                  f"max_seq_len={limit} (vLLM's max_model_len); shorten it, keep its last tokens "
                                  "(truncate_prompt_tokens) or raise max_seq_len")

    def _chars_said(self, text: str) -> str:
        """``text``'s characters as a refusal by :meth:`_fewest_tokens` counts them: "its M characters", and where
        the tokenizer drops some (``Bound.dropped``, not counted) how many, so the count follows from the kept ones."""
        said = f"its {len(text):,} characters"
        dropped = "" if isinstance(self._bound, bool) or self._bound is None else self._bound.dropped
        left_out = sum(text.count(c) for c in dropped)  # on a refusal only: a pass over the text per dropped character
        return said + (f", {left_out:,} of them ones this tokenizer drops" if left_out else "")

    def _fewest_tokens(self, text: str, at_least: int, tokenizer: Any = None) -> tuple[int, int | None]:
        """(the fewest tokens ``text`` can have, exact from ``at_least`` up, the most characters a token covers);
        (0, None) when unbounded. ``tokenizer``: a copy of the engine's to read the vocabulary of (the same
        bound)."""
        if self.tokenizer is None:
            return 0, None
        if self._bound is False:  # found once: reading the tokenizer's vocabulary takes a tenth of a second
            self._bound = token_bound(self.tokenizer if tokenizer is None else tokenizer)
        bound = None if isinstance(self._bound, bool) else self._bound
        return fewest_tokens(text, bound, at_least), None if bound is None else bound.per_token

    def tokenize(self, text: str, *, add_special_tokens: bool = True, where: str = "prompt",
                 tokenizer: Any = None) -> list[int]:
        """Token ids of ``text`` as the tokenizer gives them (``add_special_tokens``: its BOS and the like), no
        other check (vLLM's /tokenize); ``GenerationError`` naming ``where`` without a tokenizer. ``tokenizer``: a
        copy of the engine's to encode with (the server's for a big prompt tokenized off its parse gate)."""
        check_text(where, text)
        if self.tokenizer is None:
            raise GenerationError(f"{where}: the model {self.executor.name} has no tokenizer (presets have random "
                                  "weights and none); only token ids are served")
        tok = self.tokenizer if tokenizer is None else tokenizer
        return [int(t) for t in tok(text, add_special_tokens=add_special_tokens)["input_ids"]]

    def check_prompt_chars(self, text: str) -> None:
        """What :meth:`encode` checks of a text prompt before tokenizing it: refused when it has more characters
        than ``max_seq_len`` of the tokenizer's longest tokens cover."""
        self._check_chars("generate: prompt 0", text)

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """The tokenizer's own string of each token (``convert_ids_to_tokens``: ``Ġthe``, ``<|im_end|>``)."""
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(list(token_ids))]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of token ids with special tokens shown (vLLM's /detokenize); ``GenerationError`` naming ``tokens``
        without a tokenizer or for an id outside its vocabulary."""
        tok = self.tokenizer
        if tok is None:
            raise GenerationError(f"tokens: the model {self.executor.name} has no tokenizer (presets have random "
                                  "weights and none); there is no text to give")
        size = len(tok)
        bad = next((i for i, t in enumerate(token_ids) if not 0 <= t < size), None)
        if bad is not None:
            raise GenerationError(f"tokens[{bad}]: token id {token_ids[bad]} is outside the tokenizer's vocabulary "
                                  f"(0..{size - 1})")
        return tok.decode(list(token_ids))

    def decode(self, token_ids: Sequence[int]) -> str | None:
        """Text of token ids without special tokens; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def token_piece(self, token_id: int) -> tuple[str, bytes]:
        """One token as logprobs show it: its text with special tokens shown (``<|im_end|>``, not ""), and its raw
        bytes (a byte-level piece of a multi-byte character is its own byte, not the UTF-8 of "\ufffd"); without a
        tokenizer, the id as text."""
        piece = self._pieces.get(token_id)
        if piece is None:
            if self._byte_level is None:
                self._byte_level = _byte_level(self.tokenizer)
            piece = self._pieces[token_id] = _token_piece(self.tokenizer, token_id, self._byte_level)
        return piece
