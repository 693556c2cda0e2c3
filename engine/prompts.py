"""Prompts as callers pass them → text or token ids, checked before any reaches the tokenizer or the model.

Accepted, as vLLM's ``LLM.generate`` takes them: a string, a list of token ids (ints, numpy integers, or
a 1-D integer numpy array / torch tensor), vLLM's prompt dicts ``{"prompt": "..."}`` (TextPrompt) and
``{"prompt_token_ids": [...]}`` (TokensPrompt), and, with ``chat=True``, a conversation (a list of
``{"role", "content"}`` messages). No torch or numpy import here: arrays are recognised by their
``tolist`` and ``ndim``.
"""

from __future__ import annotations

import functools
import math
import numbers
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any, NotRequired, TypedDict

import attrs

from pipeline.errors import GenerationError, first_line
from pipeline.limits import checked_flag, short_py

#: Keys of vLLM's prompt dicts kvload acts on; any other key (multi_modal_data, ...) is refused. A TokensPrompt may
#: carry its text too (vLLM's ``prompt``, the ``RequestOutput.prompt`` then), and either its prefix cache salt.
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
#: Keys of vLLM's prompt dicts kvload does not take → what to do instead (said after the refusal).
VLLM_PROMPT_KEYS_NOT_TAKEN = {
    "multi_modal_data": "kvload serves text-only models",
    "mm_processor_kwargs": "kvload serves text-only models",
    "multi_modal_uuids": "kvload serves text-only models",
    "prompt_embeds": "kvload takes text or token ids",
}


class TextPrompt(TypedDict):
    """vLLM's ``TextPrompt`` (``vllm.inputs``): ``TextPrompt(prompt="...")`` is the dict ``{"prompt": "..."}``;
    ``cache_salt`` scopes its prefix reuse, as ``generate``'s ``salt`` does for a whole call."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """vLLM's ``TokensPrompt`` (``vllm.inputs``): ``TokensPrompt(prompt_token_ids=[...])`` is the dict
    ``{"prompt_token_ids": [...]}``; ``prompt``: the text of those ids, if known (``RequestOutput.prompt``);
    ``cache_salt`` as :class:`TextPrompt`'s."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


@attrs.frozen
class PromptOptions:
    """What a vLLM prompt dict says beside its text or ids: the text of a TokensPrompt (None: none given) and its
    prefix cache salt (None: the call's)."""

    text: str | None = None
    cache_salt: str | None = None


#: Message roles a chat template takes.
ROLES = ("system", "user", "assistant", "developer", "tool")


def is_token_id(value: Any) -> bool:
    """An integer token id: ``int`` or a numpy integer, never a bool."""
    if type(value) is int:  # the common case, first: the ABC check below took ~5 us an id (5 s for 10**6 ids)
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and type(value).__name__ != "bool_"


def array_ints(value: Any) -> Any:
    """A 1-D integer array or tensor → a list of ints; anything else is returned unchanged (prompts' token ids, and
    ``generate``'s ``priority``, one per prompt)."""
    if not hasattr(value, "tolist") or getattr(value, "ndim", None) != 1:
        return value
    dtype = str(getattr(value, "dtype", ""))
    if "int" not in dtype or dtype.startswith("torch.bool"):  # int64, torch.int32, uint16: not float, not bool
        return value
    return value.tolist()


def is_conversation(value: Any) -> bool:
    """A chat conversation: a non-empty list of message mappings."""
    return (isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)) and len(value) > 0
            and all(isinstance(m, Mapping) for m in value))


def normalize(prompts: Any, options: list[PromptOptions] | None = None, *, take_salt: bool | None = None) -> list[Any]:
    """Every prompt as a ``str``, a ``list[int]`` or (chat) a list of messages; ``GenerationError`` naming one.

    ``options``: a list to fill with each prompt's :class:`PromptOptions`. ``take_salt`` (default: whether ``options``
    is given): false for a caller that cannot honour a prompt dict's ``cache_salt``, which is then refused."""
    take_salt = options is not None if take_salt is None else take_salt
    prompts = array_ints(prompts)
    if isinstance(prompts, (str, Mapping)):
        prompts = [prompts]
    if hasattr(prompts, "tolist") and getattr(prompts, "ndim", None) == 2:  # a batch of equal-length id rows
        prompts = [array_ints(row) for row in prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise GenerationError(f"generate: prompts: expected a string or a list of prompts (strings, lists of token "
                              f"ids, or {{'prompt': ...}} / {{'prompt_token_ids': [...]}} dicts), got "
                              f"{type(prompts).__name__}")
    if not prompts:
        raise GenerationError("generate: prompts: expected at least one prompt, got an empty list")
    if all(is_token_id(p) for p in prompts):  # vLLM's rule (prompt_to_seq): a flat list of token ids is one prompt
        prompts = [prompts]
    elif any(is_token_id(p) for p in prompts):
        raise GenerationError("generate: prompts: a list of prompts mixes token ids with other prompts; give one "
                              "prompt of token ids as [1, 2, 3] and several as [[1, 2, 3], [4, 5]]")
    out = []
    for i, prompt in enumerate(prompts):
        said = PromptOptions()
        if isinstance(prompt, Mapping):
            prompt, said = _from_dict(i, prompt)
            if said.cache_salt is not None and not take_salt:
                raise GenerationError(f"generate: prompt {i}: a prompt dict's 'cache_salt' is not taken here "
                                      "(LLM.generate takes it); give the prompt without it")
        if options is not None:
            options.append(said)
        prompt = array_ints(prompt)
        if isinstance(prompt, str) or is_conversation(prompt):
            out.append(prompt)
            continue
        if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, bytearray)) \
                or not all(is_token_id(t) for t in prompt):
            raise GenerationError(f"generate: prompt {i}: expected a string or a list of token ids (ints), "
                                  f"got {_not_ids(prompt)}")
        out.append([int(t) for t in prompt])
    return out


def _not_ids(value: Any) -> str:
    """What a prompt that is no list of token ids is, for its error: a list's first item that is no token id, else the
    value cut short (a huge int or a list nesting itself many times was written out whole: an error, or a hang)."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        bad = next((j for j, t in enumerate(value) if not is_token_id(t)), None)
        if bad is not None:
            return f"a list whose item {bad} is {short_py(value[bad])}"
    return short_py(value)


def _from_dict(i: int, prompt: Mapping[str, Any]) -> tuple[Any, PromptOptions]:
    """vLLM's TextPrompt / TokensPrompt → its text or token ids, and what else it says."""
    unknown = sorted(str(k) for k in prompt if k not in PROMPT_KEYS)
    if unknown or not ("prompt" in prompt or "prompt_token_ids" in prompt):
        # a key is quoted cut to 80 characters: a huge one made the line as long
        what = f"key {unknown[0][:80]!r} is not supported" if unknown else f"has keys {sorted(prompt)}"
        instead = VLLM_PROMPT_KEYS_NOT_TAKEN.get(unknown[0]) if unknown else None
        raise GenerationError(f"generate: prompt {i}: a prompt dict {what}"
                              + (f" (vLLM's; {instead})" if instead else "")
                              + "; give {'prompt': TEXT} or {'prompt_token_ids': [IDS]} (with its text as 'prompt', "
                                "if known), and a 'cache_salt' if you like")
    salt = prompt.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and salt):  # vLLM's key holds a string (None: not given)
        raise GenerationError(f"generate: prompt {i}: 'cache_salt' must be a non-empty string, got {short_py(salt)}")
    text = prompt.get("prompt")
    if "prompt" in prompt and not isinstance(text, str):
        raise GenerationError(f"generate: prompt {i}: 'prompt' must be a string, got {type(text).__name__}")
    if "prompt_token_ids" not in prompt:
        return text, PromptOptions(cache_salt=salt)
    ids = array_ints(prompt["prompt_token_ids"])
    if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Sequence) \
            or not all(is_token_id(t) for t in ids):
        raise GenerationError(f"generate: prompt {i}: 'prompt_token_ids' must be a list of token ids (ints), "
                              f"got {_not_ids(ids)}")
    if text is not None:
        check_text(f"prompt {i}", text)
    return list(ids), PromptOptions(text=text, cache_salt=salt)


def check_text(where: str, text: str) -> None:
    """``GenerationError`` when ``text`` is not valid Unicode (a lone surrogate: no tokenizer can encode it).

    ``where`` names it (``prompt 0``, ``messages[1].content``). Bytes that were not UTF-8 on a command
    line arrive as lone surrogates too (Python's surrogateescape), so they are refused the same way.
    """
    problem = not_unicode(where, text)
    if problem is not None:
        raise GenerationError(f"generate: {problem}")


def not_unicode(where: str, text: str) -> str | None:
    """``where: not valid Unicode text (a lone surrogate at character N; text must be UTF-8)`` when ``text`` holds a
    lone surrogate, else None: the one wording of that refusal, whichever error (the API's, HTTP's) carries it."""
    at = lone_surrogate(text)
    if at is None:
        return None
    return f"{where}: not valid Unicode text (a lone surrogate at character {at}; text must be UTF-8)"


def check_tree(where: str, value: Any) -> None:
    """:func:`check_text` of every string in a JSON-like ``value`` (its keys too), naming where it lies
    (``where.key``, ``where[2]``): a schema or template variables carry text to a grammar or a prompt as well."""
    found = surrogate_in(value, where)
    if found is not None:
        check_text(*found)


def surrogate_in(value: Any, where: str) -> tuple[str, str] | None:
    """The first string in a JSON-like ``value`` (keys included) holding a lone surrogate, as (its path from
    ``where``, the string), or None."""
    return _first_leaf(value, where, lambda node: isinstance(node, str) and lone_surrogate(node) is not None)


def non_json_in(value: Any, where: str) -> tuple[str, Any] | None:
    """The first value in ``value`` (keys included) that JSON cannot hold (bytes, an object, a key that is not a
    string), as (its path from ``where``, the value), or None."""
    return _first_leaf(value, where, lambda node: not (node is None or isinstance(node, (str, int, float))))


def _first_leaf(value: Any, where: str, bad: Callable[[Any], bool]) -> tuple[str, Any] | None:
    """The first leaf of ``value`` (a mapping's keys are leaves too) for which ``bad`` holds, with its path from
    ``where`` (``where.key``, ``where[2]``). A walk with a stack: a document's depth is bounded elsewhere, not here.
    A container met again (the same object held twice) is not walked again: it held no such leaf the first time, and
    a list holding itself twice at each of 40 levels (a few hundred bytes) was 2**40 leaves walked (never returned)."""
    stack: list[tuple[Any, str, bool]] = [(value, where, False)]
    walked: set[tuple[int, bool]] = set()  # the containers walked, as a value or as a key (a tuple key is judged
    while stack:  # whole first); each is held by ``value``, so its id stays its own while this runs
        node, at, is_key = stack.pop()
        if isinstance(node, (Mapping, list, tuple)):
            if (id(node), is_key) in walked:
                continue
            walked.add((id(node), is_key))
        if is_key:  # a key is a leaf: a tuple key is judged whole (JSON has no such key), then its items
            if bad(node):
                return at, node
            if isinstance(node, tuple):
                stack.extend((item, at, True) for item in reversed(node))
        elif isinstance(node, Mapping):
            for key, item in reversed(list(node.items())):  # reversed: the first key is looked at first
                stack.append((item, at if bad(key) else f"{at}.{key}", False))
                stack.append((key, at, True))
        elif isinstance(node, (list, tuple)):
            stack.extend((item, f"{at}[{j}]", False) for j, item in reversed(list(enumerate(node))))
        elif bad(node):
            return at, node
    return None


def lone_surrogate(text: str) -> int | None:
    """Where ``text`` stops encoding as UTF-8 (JSON's ``\\ud800`` escapes decode to lone surrogates), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def missing_template(tokenizer: Any, template: Mapping[str, Any], name: str) -> str | None:
    """Why a conversation cannot be templated for model ``name``, or None: it needs a tokenizer, and either its chat
    template or ``template["chat_template"]`` (the one check, and wording, of every chat path)."""
    if tokenizer is None:
        return f"chat needs a chat template, and {name} has no tokenizer (presets have random weights and none)"
    if not getattr(tokenizer, "chat_template", None) and "chat_template" not in template:
        return f"chat needs a chat template, and the tokenizer of {name} has none"
    return None


def templated(tokenizer: Any, name: str, where: str, messages: list[dict[str, Any]],
              template: Mapping[str, Any]) -> tuple[str, list[int]]:
    """A conversation through the chat template (the tokenizer's, or ``template["chat_template"]``) of model ``name``:
    (the templated text, its token ids); ``GenerationError`` naming ``where`` when it cannot be templated."""
    missing = missing_template(tokenizer, template, name)
    if missing is not None:
        raise GenerationError(f"generate: {where}: {missing}")
    text = apply_template(tokenizer, where, messages, tokenize=False, **template)
    # what apply_chat_template(tokenize=True) does: the template already holds the special tokens
    return text, [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


@functools.lru_cache(maxsize=32)
def _template_names(source: str) -> frozenset[str] | None:
    """The variables a Jinja chat template reads (None: it does not parse here, e.g. transformers' own tags)."""
    import jinja2
    from jinja2 import meta

    try:
        return frozenset(meta.find_undeclared_variables(
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)))
    except jinja2.TemplateError:  # transformers' own tags ({% generation %}): taken as reading anything
        return None


def template_reads(tokenizer: Any, template: Mapping[str, Any], names: Sequence[str]) -> bool:
    """Whether the chat template a conversation goes through (``template["chat_template"]`` or the tokenizer's)
    reads any of ``names``; true when that cannot be told (no template as text, one that does not parse here)."""
    source = template.get("chat_template") or getattr(tokenizer, "chat_template", None)
    if not isinstance(source, str):
        return True
    read = _template_names(source)
    return read is None or any(name in read for name in names)


#: Steps one chat template rendering may take: the lines of the template's own code it runs and the Python calls
#: (filters, the sandbox's attribute checks) they make. Jinja's sandbox bounds a ``range`` (100,000 items) but not a
#: loop inside a loop: two nested ranges ran 10**10 steps, for ever in practice, and the Jinja a server runs may be a
#: client's. SmolLM2's template takes under 4,000 steps for a 200-turn conversation; this many take about half a second.
TEMPLATE_MAX_STEPS = 1_000_000
#: ... and the seconds: one step may be costly (a filter over 100,000 items, a string multiplied to 100 MB).
TEMPLATE_MAX_SECONDS = 5.0
#: ... and the characters it may write: a conversation of a million tokens renders to a few million; past this the
#: text is refused before the tokenizer sees it (tokenizing a 1 GB rendering, ``{{ 'x' * 10**9 }}``, took a server
#: past 20 GB, where the kernel killed it).
TEMPLATE_MAX_CHARS = 16 * 2**20


_STOPPED = " without finishing (a loop inside a loop?); it was stopped"


class _TemplateRanAway(Exception):
    """A chat template past a bound (raised into its code by :func:`_bounded`); the message says which, as a phrase
    that follows "the model's chat template"."""


def _bounded(render: Callable[[], Any]) -> Any:
    """``render()`` with a chat template's steps counted and timed (``sys.settrace``, in this thread only; code run
    before the template, such as its compilation, is left to the tracer already set, a debugger's or coverage's),
    raising ``_TemplateRanAway`` into the template past :data:`TEMPLATE_MAX_STEPS` or
    :data:`TEMPLATE_MAX_SECONDS`: a loop is stopped where it is."""
    previous = sys.gettrace()
    steps = 0
    deadline = math.inf  # set when the template's code first runs

    def step(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal steps
        steps += 1
        if steps & 63 == 0:  # both bounds every 64 steps: a step is a few hundred nanoseconds, a clock read is not free
            if steps > TEMPLATE_MAX_STEPS:
                raise _TemplateRanAway(f"ran more than {TEMPLATE_MAX_STEPS:,} steps{_STOPPED}")
            if time.monotonic() > deadline:
                raise _TemplateRanAway(f"ran longer than {TEMPLATE_MAX_SECONDS:g} s{_STOPPED}")
        return step

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal deadline
        if frame.f_code.co_filename == "<template>":  # Jinja's name for the code of a template made from a string
            if deadline == math.inf:
                deadline = time.monotonic() + TEMPLATE_MAX_SECONDS
            return step(frame, event, arg)  # its lines are steps, and so is each call into it
        if deadline != math.inf:  # a call the template made (a filter, the sandbox's checks)
            step(frame, event, arg)
        if previous is None:
            return None
        local = previous(frame, event, arg)
        if sys.gettrace() is not trace:  # coverage's tracer re-installs itself when called: the bound goes back on
            sys.settrace(trace)
        return local

    sys.settrace(trace)
    try:
        return render()
    finally:
        sys.settrace(previous)


def apply_template(tokenizer: Any, where: str, messages: list[dict[str, Any]], *, content_format: str = "auto",
                   **kwargs: Any) -> Any:
    """``tokenizer.apply_chat_template``; a template that refuses the conversation (Mistral's and Llama 2's raise
    when roles do not alternate) is a ``GenerationError`` naming it, not a jinja2 traceback, and so is one that
    runs past :data:`TEMPLATE_MAX_STEPS` or :data:`TEMPLATE_MAX_SECONDS` (it might never end) or writes more than
    :data:`TEMPLATE_MAX_CHARS`. ``content_format``: vLLM's ``chat_template_content_format``, how each message's
    content reaches the template (:mod:`engine.content_format`; "auto": as the template in effect reads it)."""
    from engine.content_format import as_format, resolve

    kwargs.setdefault("add_generation_prompt", True)
    shape = resolve(content_format, kwargs.get("chat_template") or getattr(tokenizer, "chat_template", None))
    messages = [as_format(m, shape) for m in messages]
    whose = "the chat_template given" if kwargs.get("chat_template") is not None else "the model's chat template"
    try:
        text = _bounded(lambda: tokenizer.apply_chat_template(messages, **kwargs))
        if isinstance(text, str) and len(text) > TEMPLATE_MAX_CHARS:
            raise _TemplateRanAway(f"wrote {len(text):,} characters, more than a prompt holds (at most "
                                   f"{TEMPLATE_MAX_CHARS:,}); the text was not tokenized")
        return text
    except _TemplateRanAway as exc:
        raise GenerationError(f"generate: {where}: {whose} {exc}") from None
    except Exception as exc:  # jinja2.TemplateError from raise_exception(), or a template's own TypeError
        import jinja2

        if isinstance(exc, jinja2.TemplateSyntaxError):  # the template is broken, not the conversation wrong
            raise GenerationError(f"generate: {where}: {whose} is not a Jinja template: line {exc.lineno}: "
                                  f"{first_line(exc, 'syntax error')}"[:300]) from None
        raise GenerationError(f"generate: {where}: {whose} refused the conversation: "
                              f"{first_line(exc, type(exc).__name__)}"[:300]) from None


#: The keywords of :func:`template_options` a chat request sends (``LLM.chat``'s too).
TEMPLATE_OPTIONS = frozenset({"add_generation_prompt", "continue_final_message", "chat_template",
                              "chat_template_kwargs"})
#: ... and all of them: ``LLM.chat``'s, passed on to ``GenerationExecutor.run`` as ``chat`` (the content format is
#: the server's setting in ``kvload serve``, vLLM's ``--chat-template-content-format``, not a request's).
CHAT_OPTIONS = TEMPLATE_OPTIONS | {"chat_template_content_format"}


#: Names a ``chat_template_kwargs`` key may not take: chat's own arguments (and the conversation itself).
CHAT_ARGUMENTS = frozenset({"messages", "conversation", "add_generation_prompt", "continue_final_message",
                            "chat_template"})
#: ``apply_chat_template``'s own settings (transformers 5's, less ``tools`` and ``documents``, which are template
#: variables too): such a key reached it as that setting, not the template. It did nothing (``padding``,
#: ``return_tensors``: kvload tokenizes the text itself), failed as if the template had refused the conversation
#: (``return_assistant_tokens_mask``, ``sanitize_control_tokens`` need ``tokenize=True``), or raised a TypeError
#: (``self``).
APPLY_SETTINGS = frozenset({"self", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
                            "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_options(add_generation_prompt: Any = True, continue_final_message: Any = False,
                     chat_template: Any = None, chat_template_kwargs: Any = None,
                     chat_template_content_format: Any = None) -> dict[str, Any]:
    """vLLM's ``LLM.chat`` template options, checked, as ``apply_chat_template`` keywords: whether to open the
    assistant's turn, or instead to continue the conversation's last (assistant) message; a template of the
    caller's own (a Jinja string) in place of the tokenizer's; extra variables for the template; and, given,
    ``chat_template_content_format`` as :func:`apply_template`'s ``content_format``."""
    from engine.content_format import CONTENT_FORMATS

    if chat_template_content_format is not None and (not isinstance(chat_template_content_format, str)
                                                     or chat_template_content_format not in CONTENT_FORMATS):
        raise GenerationError(f"chat: chat_template_content_format: expected one of {', '.join(CONTENT_FORMATS)}, "
                              f"got {short_py(chat_template_content_format)}")
    add_generation_prompt = checked_flag(add_generation_prompt,
                                         lambda why: GenerationError(f"chat: add_generation_prompt: {why}"))
    continue_final_message = checked_flag(continue_final_message,
                                          lambda why: GenerationError(f"chat: continue_final_message: {why}"))
    if add_generation_prompt and continue_final_message:  # vLLM's rule: the turn is either opened or continued
        raise GenerationError("chat: continue_final_message: cannot be true with add_generation_prompt true (the "
                              "assistant's turn is either continued or opened); pass add_generation_prompt=False")
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
        raise GenerationError(f"chat: chat_template: expected a Jinja template string, got {short_py(chat_template)}")
    extra = {} if chat_template_kwargs is None else chat_template_kwargs
    if not isinstance(extra, dict) or not all(isinstance(k, str) and k.isidentifier() for k in extra):
        raise GenerationError("chat: chat_template_kwargs: expected a dict of template variables (names as keys), "
                              f"got {short_py(chat_template_kwargs)}")
    own = sorted(CHAT_ARGUMENTS & set(extra))
    if own:
        raise GenerationError(f"chat: chat_template_kwargs: {own[0]!r} is not a template variable; pass it as "
                              "chat's own argument")
    settings = sorted(APPLY_SETTINGS & set(extra))
    if settings:
        raise GenerationError(f"chat: chat_template_kwargs: {settings[0]!r} is not a template variable but a setting "
                              "of transformers' apply_chat_template, which kvload does not take (it renders the "
                              "template as text and tokenizes that itself)")
    for name, value in (("chat_template", chat_template), ("chat_template_kwargs", extra)):
        found = surrogate_in(value, name)  # the template puts it in the prompt text, which no tokenizer encodes:
        if found is not None:  # tokenizers raised "TypeError: TextEncodeInput must be Union[...]"
            raise GenerationError(f"chat: {not_unicode(*found)}")
    options: dict[str, Any] = {**extra, "add_generation_prompt": add_generation_prompt,
                               "continue_final_message": continue_final_message}
    if chat_template is not None:
        options["chat_template"] = chat_template
    if chat_template_content_format is not None:
        options["content_format"] = chat_template_content_format
    return options


__all__ = ["APPLY_SETTINGS", "CHAT_ARGUMENTS", "CHAT_OPTIONS", "PROMPT_KEYS", "ROLES", "TEMPLATE_MAX_CHARS",
           "TEMPLATE_MAX_SECONDS", "TEMPLATE_MAX_STEPS", "TEMPLATE_OPTIONS", "VLLM_PROMPT_KEYS_NOT_TAKEN", "TextPrompt",
           "TokensPrompt", "apply_template", "array_ints", "check_text", "is_conversation", "is_token_id",
           "lone_surrogate", "missing_template", "normalize", "not_unicode", "template_options", "template_reads"]
