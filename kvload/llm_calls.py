"""A front-door call's arguments checked and shaped, as vLLM's ``LLM`` takes them: ``lora_request`` (None),
``tokenization_kwargs`` and the prompt cut, vLLM's ``prompt_token_ids=``, keywords a call does not take, errors
titled by the call made, and calls followed by ranks ``kvload.LLM`` started."""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from engine.prompts import is_token_id
from engine.sampling_params import SamplingParams, check_keywords, is_int
from pipeline.errors import (
    GenerationError,
    KvBuildError,
    did_you_mean,
    retitled,
    unknown_argument,
)
from pipeline.limits import short

if TYPE_CHECKING:
    from kvload.llm import LLM


def no_lora(call: str, lora_request: Any) -> None:
    """vLLM's ``lora_request``: None asks for the base weights, which is all kvload serves; so does vLLM's list of one
    per prompt when every one is None."""
    if isinstance(lora_request, (list, tuple)) and all(r is None for r in lora_request):
        return
    if lora_request is not None:
        raise GenerationError(f"{call}: lora_request: kvload serves the checkpoint's own weights and has no LoRA "
                              f"adapters; accepted: None, got {type(lora_request).__name__}")


#: vLLM's ``tokenization_kwargs`` keys kvload does not act on → what to do instead (``truncate_prompt_tokens`` acts)
TOKENIZATION_KWARGS_NOT_TAKEN: dict[str, str] = {
    "add_special_tokens": "kvload tokenizes a text prompt with the tokenizer's defaults (its BOS included); give the "
                          "token ids instead (tokenizer.encode(text, add_special_tokens=False))",
    **dict.fromkeys(("truncation", "max_length"),
                    "kvload cuts a prompt to its last k tokens with tokenization_kwargs={'truncate_prompt_tokens': k}"),
}


#: ``chat``'s word for ``add_special_tokens`` (its messages have no text of the caller's to encode)
_CHAT_SPECIAL_TOKENS = ("kvload's chat adds no special tokens to what the chat template writes (the template holds "
                        "them: add_special_tokens=False, the default of vLLM's chat requests); put a BOS in the "
                        "template (chat_template=...) if the model needs one more")


#: ``tokenization_kwargs``' values that ask for nothing kvload does not do already, taken as given (as
#: ``VLLM_FIELDS_AT_NO_OP`` takes SamplingParams' fields), so a script spelling vLLM's defaults out runs:
#: ``add_special_tokens`` at each call's own (True for a text prompt, vLLM's default; False on ``chat``), no
#: ``truncation``, no ``max_length``
TOKENIZATION_KWARGS_AT_NO_OP: dict[str, tuple[Any, ...]] = {"truncation": (False, None), "max_length": (None,)}


def _at_no_op(call: str, key: str, value: Any) -> bool:
    """Whether ``tokenization_kwargs[key] = value`` asks for nothing on ``call`` (bools and None by identity: 1 or
    0 is not taken as true or false)."""
    if key == "add_special_tokens":
        return value is (call != "chat")
    return any(value is v for v in TOKENIZATION_KWARGS_AT_NO_OP.get(key, ()))


def tokenization_cut(call: str, tokenization_kwargs: Any) -> Any:
    """vLLM's ``tokenization_kwargs`` (where vLLM now takes the prompt cut, ``SamplingParams.truncate_prompt_tokens``
    and the pooling calls' argument being deprecated for it): its ``truncate_prompt_tokens`` (None when it has none);
    None or ``{}`` asks for nothing, and so do vLLM's other keys at values that ask for nothing
    (:data:`TOKENIZATION_KWARGS_AT_NO_OP`); another key or value is refused naming it, with what to do instead."""
    if tokenization_kwargs is None:
        return None
    if not isinstance(tokenization_kwargs, Mapping):
        raise GenerationError(f"{call}: tokenization_kwargs: expected a dict (kvload acts on its "
                              f"truncate_prompt_tokens) or None, got {short(tokenization_kwargs)}")
    for key, value in tokenization_kwargs.items():
        if key == "truncate_prompt_tokens" or (isinstance(key, str) and _at_no_op(call, key, value)):
            continue
        # a plain name as written; anything else (a newline, a lone surrogate, not a str) as its repr, cut, so the
        # message stays one printable line
        name = key if isinstance(key, str) and key.isidentifier() and len(key) <= 80 else short(key)
        if key in TOKENIZATION_KWARGS_NOT_TAKEN:
            why = _CHAT_SPECIAL_TOKENS if call == "chat" and key == "add_special_tokens" \
                else TOKENIZATION_KWARGS_NOT_TAKEN[key]
            raise GenerationError(f"{call}: tokenization_kwargs.{name}={short(value)}: vLLM's, not kvload's: {why}; "
                                  "kvload acts on tokenization_kwargs' truncate_prompt_tokens only")
        known = ["truncate_prompt_tokens", *TOKENIZATION_KWARGS_NOT_TAKEN]
        typo = did_you_mean(key, known) if isinstance(key, str) else ""
        raise GenerationError(f"{call}: tokenization_kwargs.{name}: not a setting kvload's tokenization takes; kvload "
                              f"acts on tokenization_kwargs' truncate_prompt_tokens only{typo}")
    return tokenization_kwargs.get("truncate_prompt_tokens")


def _one_cut(call: str, given: Any, cut: Any, where: str) -> Any:
    """The prompt cut of a call that has it twice (``where``'s and ``tokenization_kwargs``'): one value, or one line
    when they differ."""
    if cut is None or given is None:
        return given if cut is None else cut
    for value in (given, cut):  # no cut at all (NaN, a str): its own check answers, where "they differ" misled
        if not is_int(value):
            return value
    if given == cut:
        return cut
    raise GenerationError(f"{call}: truncate_prompt_tokens: {short(given)} in {where} and {short(cut)} in "
                          "tokenization_kwargs differ; give it once")


def call_cut(call: str, truncate_prompt_tokens: Any, tokenization_kwargs: Any) -> Any:
    """A pooling call's prompt cut: its ``truncate_prompt_tokens`` argument or ``tokenization_kwargs``' (vLLM's newer
    place for it), one value; one line when they differ."""
    cut = tokenization_cut(call, tokenization_kwargs)
    return _one_cut(call, truncate_prompt_tokens, cut, "the call's argument")


def cut_sampling(call: str, sampling_params: Any, sampling: dict[str, Any], cut: Any) -> tuple[Any, dict[str, Any]]:
    """``generate`` / ``chat``'s sampling with ``tokenization_kwargs``' ``truncate_prompt_tokens`` (``cut``) set: on
    the keywords when no SamplingParams is given, else on a copy of each (the caller's objects stay as given)."""
    if cut is None:
        return sampling_params, sampling
    if sampling_params is None:
        keyword = sampling.get("truncate_prompt_tokens")
        return None, {**sampling, "truncate_prompt_tokens": _one_cut(call, keyword, cut, "the keywords")}
    many = isinstance(sampling_params, (list, tuple))
    cut_params = []
    for i, params in enumerate(sampling_params if many else [sampling_params]):
        if isinstance(params, SamplingParams):  # anything else: refused by the call, naming it
            where = f"sampling_params[{i}]" if many else "sampling_params"
            with errors_titled(call):
                cut_copy = attrs.evolve(params, truncate_prompt_tokens=_one_cut(call, params.truncate_prompt_tokens,
                                                                                cut, where))
            # vLLM's no-op fields too (evolve takes the settings only): generate checks them again on the copy
            object.__setattr__(cut_copy, "_vllm_fields", params._vllm_fields)
            params = cut_copy
        cut_params.append(params)
    return (cut_params if many else cut_params[0]), sampling


@contextlib.contextmanager
def errors_titled(call: str) -> Iterator[None]:
    """Errors the shared executor titles ``generate:`` name the call the user made (``chat:``, ``beam_search:``,
    ``reward:``), a prompt the KV pools cannot hold (``KvBuildError``) too."""
    try:
        yield
    except (GenerationError, KvBuildError) as e:
        if e.args and isinstance(e.args[0], str):
            e.args = (retitled(e.args[0], call), *e.args[1:])
        raise


def followed_by_ranks(method: Callable[..., Any]) -> Callable[..., Any]:
    """A method that runs the engine: with ranks this LLM started (``tensor_parallel_size`` outside torchrun), every
    rank makes the call too (:mod:`kvload.llm_ranks`)."""
    @functools.wraps(method)
    def call(self: LLM, *args: Any, **kwargs: Any) -> Any:
        ranks = self.__dict__.get("_ranks")
        if ranks is None:
            return method(self, *args, **kwargs)
        return ranks.call(method.__name__, method, self, args, kwargs)

    return call


def checked_keywords(method: Callable[..., Any]) -> Callable[..., Any]:
    """A public call's keywords checked before it runs: one it does not take is a ``GenerationError`` naming it, with
    the argument (or, for a call that takes sampling fields as keywords, the field) it is close to; Python's own
    TypeError ("unexpected keyword argument 'pooling_param'") suggested nothing."""
    params = list(inspect.signature(method).parameters.values())
    own = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]
    by_position = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.name != "self"]
    sampling = any(p.kind is p.VAR_KEYWORD for p in params)
    taken, call = frozenset(own), method.__name__

    @functools.wraps(method)
    def checked(self: LLM, *args: Any, **kwargs: Any) -> Any:
        extra = [k for k in kwargs if k not in taken]
        if extra:
            if sampling:  # the rest are sampling fields: checked as the call would, with its own names suggested too
                with errors_titled(call):
                    check_keywords({k: kwargs[k] for k in extra}, own)
            else:
                name = extra[0]
                if name in by_position:
                    raise GenerationError(f"{call}: {name}: given by position ({call}({', '.join(by_position)}, "
                                          "...)), not as a keyword")
                raise GenerationError(unknown_argument(call, name, own))
        return method(self, *args, **kwargs)

    return checked


def _is_ids_row(value: Any) -> bool:
    """A prompt's token ids as a row: a list or tuple, or a 1-D array / tensor (not a text, not a dict)."""
    return getattr(value, "ndim", None) == 1 or isinstance(value, (list, tuple))


def legacy_ids(value: Any) -> tuple[list[Any], bool]:
    """vLLM's older ``generate(prompt_token_ids=...)`` as prompts, and whether it was one prompt's ids: one list of
    token ids, or a list of them; anything else is refused naming the keyword (a text was taken as a prompt's text,
    a number said "prompts: expected a string or a list of prompts")."""
    if getattr(value, "ndim", None) == 1:
        return [value], True
    if getattr(value, "ndim", None) == 2:
        return list(value), False
    if isinstance(value, (list, tuple)):
        if not value:  # said by the prompts' own check, under this name
            return [], False
        if not any(_is_ids_row(t) or isinstance(t, (str, bytes, Mapping)) for t in value):
            return [value], True  # one prompt's ids: each checked as a token id, under this name
        if all(_is_ids_row(t) for t in value):
            return list(value), False
    raise GenerationError(f"generate: prompt_token_ids: expected a list of token ids (ints) or a list of such "
                          f"lists, got {short(value)}")


def as_legacy_ids(message: str, flat: bool) -> str:
    """A prompt's error (``generate: prompt 1: ...``, ``generate: prompts: ...``) named by ``prompt_token_ids``, the
    keyword the ids were given as (``prompt_token_ids[1]``; one list's: ``prompt_token_ids``)."""
    found = re.match(r"generate: prompt(?:s| (\d+)): ", message)
    if found is None:
        return message
    where = "prompt_token_ids" if flat or found.group(1) is None else f"prompt_token_ids[{found.group(1)}]"
    rest = message[found.end():].replace("expected a string or a list of token ids", "expected a list of token ids")
    return f"generate: {where}: {rest}"


def one_or_many(data: Any) -> list[Any]:
    """``LLM.score``'s side as a list of prompts: one prompt (a text, a prompt dict, token ids) or a list of them."""
    if isinstance(data, (str, Mapping)) or getattr(data, "ndim", None) == 1:
        return [data]
    if isinstance(data, Sequence) and data and all(is_token_id(t) for t in data):
        return [data]
    return list(data) if isinstance(data, Sequence) else [data]
