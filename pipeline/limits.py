"""Bounds on what a user's input may make kvload build, checked before anything is built.

Every size a user controls (a flag, a YAML value, a ``config.json`` field, an audit record) is
checked against these limits first, so a hostile value gets one line naming it instead of an
out-of-memory kill, a hang in walking a YAML alias bomb, or a traceback from an overflow.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

#: The largest integer any setting may hold: values reach torch as int64 (seeds, sizes, counts).
MAX_INT = 2**63 - 1
#: Deepest nesting accepted in a YAML config, a ``config.json`` or an audit record (real ones nest < 6).
MAX_DEPTH = 32
#: Most nodes a YAML config may expand to, aliases counted at every use (LlmArgs has ~20 leaves).
MAX_YAML_NODES = 10_000
#: Longest integer literal a text input may hold before it is refused unparsed (int64 has 19 digits).
MAX_INT_DIGITS = 40
#: Most samples one prompt may ask for (``n``): each is a request with its own state, so ``n`` is
#: checked before any is built. OpenAI's API caps ``n`` at 128; the Python API, the CLI and the server share it.
MAX_N = 128
#: Most stop strings one request may give, and the longest: a sample's text is searched for each at every
#: step, over the longest one's length (and a stream holds that much back). OpenAI takes 4 stop strings and
#: vLLM any number; lists of 5 to 10 are common in evaluation harnesses. The Python API and the server share them.
MAX_STOP = 16
MAX_STOP_CHARS = 1024
#: Most ``stop_token_ids`` one request may give (a set of them is built per sample); enough for every token of a
#: vocabulary that holds a newline, say. The Python API and the server share it.
MAX_STOP_TOKEN_IDS = 4096
#: Most top alternatives per generated token ``logprobs`` may ask for (OpenAI's and vLLM's default limit): each
#: is kept for every generated token of every sample. The Python API and the server share it.
MAX_LOGPROBS = 20
#: Most prompt tokens one server request may have scored (completions' ``echo`` with ``logprobs``): each costs its
#: logits row while prefilled and ~4 KB of answer at ``logprobs=20``, so 262,144 keep one request near 1 GB.
MAX_SCORED_PROMPT_TOKENS = 262_144
#: Most tokens one server request may generate with ``logprobs`` (its choices × ``max_tokens``): each keeps its top
#: tokens' log-probabilities until the answer is sent, as a scored prompt token does (1,024 choices × 8,191 tokens at
#: ``logprobs=20`` were ~170 million entries, tens of GB, from one request).
MAX_LOGPROB_TOKENS = MAX_SCORED_PROMPT_TOKENS
#: Most tokens one ``logit_bias`` may bias (OpenAI sets no number; each is a scatter per step, and a body's share).
MAX_LOGIT_BIAS = 4096
#: Most ``allowed_token_ids`` (a vocabulary of 262,144 is Gemma 3's, the largest kvload serves) and ``bad_words``
#: (each at most ``MAX_STOP_CHARS`` characters): both are walked on every step of their request.
MAX_ALLOWED_TOKEN_IDS = 262_144
MAX_BAD_WORDS = 1024
#: A ``logit_bias`` value's bound (OpenAI's: -100 bans a token, 100 all but forces it).
MAX_BIAS = 100.0
#: Longest suffix speculative decoding matches (``max_matching_ngram_size``) and most drafts per step
#: (``max_draft_len``): the proposer keeps an entry per n-gram length for every token of every running request
#: (a 32k-token prompt's index at 8: ~30 MiB, built in ~0.2 s at its first draft; its KV is far more), and each
#: draft is a row of the next step. TensorRT-LLM's default match is 2.
MAX_NGRAM = 8
MAX_DRAFT_LEN = 64
#: ``repetition_penalty``'s bounds: past them a logit of float32 overflows (or a tiny one divides to inf); vLLM users
#: set 1.0-2.0 (and below 1 to favour repetition). The Python API, the server, the CLI and a model's
#: ``generation_config.json`` share them.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
#: Longest structured-output spec (a JSON schema's text, a regex, a grammar, the choices together; characters):
#: compiled before the request runs, in time that grows faster than its length. xgrammar on this project's 2-core
#: VM: 40,000 alternatives of a regex or a grammar (~0.4M characters) 10 s; a schema of 30,000 optional properties
#: (0.9M) 53 s, of 50,000 enum values 32 s; at 100,000 characters each stays near a second. Real schemas are a few
#: KB; OpenAI caps a ``json_schema`` at 100,000 characters of property names and enums.
MAX_STRUCTURED_CHARS = 100_000
#: Deepest a JSON schema may nest (objects and arrays of its document): xgrammar's compile time grows with the cube
#: of it (a chain of 100 nested objects, 200 levels, 0.25 s; 400 objects 6 s; 1,000 objects 202 s).
MAX_SCHEMA_DEPTH = 64
#: Deepest a structured-output spec may nest repetitions whose body may be empty (``engine.grammar_shape``): xgrammar
#: compiles ``(((a|b){0,30}){0,30}){0,30}`` (two of them, one in the other) in 1 ms, then takes 0.2 s to match its 20th
#: token and 2.2 s its 38th, each on the engine loop; one alone (``((a|b){0,100}){0,100}``) stays near 1 ms a token.
MAX_NULLABLE_REPEAT_NESTING = 1
#: Most a JSON schema's pattern repetition counts may add up to, squared (``engine.schema_patterns``): xgrammar compiles
#: a schema's ``^.{1000}$`` in 0.25 s, four of them (4,000,000) in 1 s; ``^a{50000}$`` (2.5e9) took 203 s.
MAX_PATTERN_COUNT_SQUARES = 4_000_000
#: Most ``choice`` strings one structured request may give (each is a branch of its grammar).
MAX_STRUCTURED_CHOICES = 4096
#: Longest prefix-reuse salt (characters): it is hashed into every block key of its request and cached per salt
#: (1,024 salts at a time), so its size multiplies; a tenant id or a UUID is far shorter.
MAX_SALT_CHARS = 1024


def plain_scalar(value: Any) -> Any:
    """A numpy scalar or 0-d torch tensor of an integer (float) dtype as Python's int (float); anything else, bools
    included, unchanged for the checks to judge. vLLM takes them where it takes numbers (``max_tokens=np.int64(64)``,
    a seed from an array); numpy and torch are looked up only when the caller's program imported them, so the CLI
    path imports neither."""
    if type(value) in (int, float, bool, str) or value is None:
        return value
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.generic):
        if isinstance(value, np.integer):
            return int(value)
        return float(value) if isinstance(value, np.floating) else value
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and value.ndim == 0:
        dtype = value.dtype
        if dtype.is_floating_point:
            return float(value.item())
        if dtype != torch.bool and not dtype.is_complex:
            return int(value.item())
    return value


def plain_flag(value: Any) -> Any:
    """A numpy bool or 0-d torch bool tensor as Python's bool (a flag computed from an array: ``ignore_eos=mask.any()``,
    which vLLM takes as it takes any truthy value); anything else unchanged for the checks to judge (1, "yes" and a
    bool tensor of more than one value stay refused where a flag is wanted, and a bool stays no count)."""
    if type(value) is bool or value is None:
        return value
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.bool_):
        return bool(value)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and value.ndim == 0 and value.dtype == torch.bool:
        return bool(value.item())
    return value


def checked_flag(value: Any, refuse: Callable[[str], Exception], python: bool = True) -> bool:
    """A flag argument as Python's bool (numpy's bool and a 0-d bool tensor taken: :func:`plain_flag`); anything else
    raises ``refuse("expected true or false, got V")``, the caller's error naming the argument: 1, "yes" or "no"
    would silently mean what was not meant. V as Python writes it (:func:`short_py`), or with ``python`` false as
    JSON and YAML do (:func:`short`: a config file's ``null``)."""
    value = plain_flag(value)
    if not isinstance(value, bool):
        raise refuse(f"expected true or false, got {short_py(value) if python else short(value)}")
    return value


def plain_value(value: Any) -> Any:
    """A numpy scalar or 0-d torch tensor as Python's bool, int or float (:func:`plain_flag`, then
    :func:`plain_scalar`); anything else unchanged for the checks to judge (a bool stays no count, 1 stays no flag)."""
    return plain_scalar(plain_flag(value))


#: Most items (containers and leaves) an event records of a user's value; a larger value is recorded as its
#: :func:`short` description: a list holding itself twice at each of 40 levels is 2**40 items written out (the audit's
#: line and the console's never came), and one of 10,000 is no setting anyone means.
RECORDED_ITEMS = 10_000
#: Bits past which an integer cannot be written as text (Python's 4,300-digit limit): recorded as its size instead.
_WRITABLE_BITS = 14_000


class _TooLarge(Exception):
    """:func:`plain_values` met more than :data:`RECORDED_ITEMS` items or nesting past :data:`MAX_DEPTH`."""


def plain_values(value: Any) -> Any:
    """``value`` with each numpy scalar and 0-d torch tensor in it (in dicts, lists and tuples too) as Python's bool,
    int or float (:func:`plain_flag`, :func:`plain_scalar`): what an event records of a user's value stays JSON (a
    flag ``np.True_`` an ignored knob took broke ``json.dumps`` of the audit's events; the file's line read the
    text ``"tensor(True)"`` for a 0-d tensor's). A value too large to write (past :data:`RECORDED_ITEMS` items, nested
    past :data:`MAX_DEPTH`, or an integer past Python's digit limit, whose text raised ``ValueError`` in the logger)
    is recorded as its :func:`short` description."""
    try:
        return _plain_values(value, [RECORDED_ITEMS], 0)
    except _TooLarge:
        return short(value)


def _plain_values(value: Any, left: list[int], depth: int) -> Any:
    left[0] -= 1
    if left[0] < 0 or depth > MAX_DEPTH:
        raise _TooLarge
    if type(value) is int:
        return value if value.bit_length() <= _WRITABLE_BITS else int_text(value)
    if type(value) in (bool, float, str) or value is None:
        return value
    if isinstance(value, dict):
        return {_plain_values(k, left, depth + 1): _plain_values(v, left, depth + 1) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_plain_values(v, left, depth + 1) for v in value)
    value = plain_value(value)
    if type(value) is int and value.bit_length() > _WRITABLE_BITS:
        return int_text(value)
    return value


def int_text(value: int) -> str:
    """An integer for an error message: its digits when short, its size when long (never a 5,000-digit line)."""
    if abs(value) < 10**24:
        return int.__repr__(value)  # int's own: a subclass's __str__ may raise (or say anything)
    digits = int(abs(value).bit_length() * 0.30103) + 1
    return f"an integer of about {digits} digits"


#: Most items of a list :func:`short` writes out (when each is a plain value it can write whole).
_SHOWN_ITEMS = 8


def _shown_whole(value: Any, width: int) -> bool:
    """Whether :func:`short` writes a list item as it is: None, a bool, a float, an int of at most 24 digits, a
    string of at most ``width`` characters (never a container: a list nesting itself is 2**depth items)."""
    kind = type(value)
    return (value is None or kind in (bool, float) or (kind is int and abs(value) < 10**24)
            or (kind is str and len(value) <= width))


def short(value: Any, width: int = 60) -> str:
    """``repr`` of a value cut to ``width`` characters, safe for huge integers and shared (alias bomb) containers."""
    if isinstance(value, bool) or value is None:  # as JSON and YAML spell them: what the user wrote
        return "null" if value is None else "true" if value else "false"
    if isinstance(value, int):
        return int_text(value)
    if isinstance(value, Mapping):
        return f"a mapping of {len(value)} keys"
    if isinstance(value, (list, tuple)):
        if len(value) <= _SHOWN_ITEMS and all(_shown_whole(v, width) for v in value):
            text = repr(value)  # a few plain values: written as given (``['a.yaml']``, not "a list of 1 items")
            return text if len(text) <= width else text[: width - 3] + "..."
        return f"a list of {len(value)} item{'' if len(value) == 1 else 's'}"
    try:
        text = repr(value)
    except Exception as exc:  # a user's object whose own __repr__ raises: the refusal must still be said
        return f"a {type(value).__name__} whose repr raised {type(exc).__name__}"
    return text if len(text) <= width else text[: width - 3] + "..."


def short_py(value: Any, width: int = 60) -> str:
    """:func:`short` with None, True and False as Python writes them: a Python argument's value, as its caller wrote
    it (a config file's or a request's is JSON's ``null`` / ``true``)."""
    return repr(value) if value is None or isinstance(value, bool) else short(value, width)


def short_text(text: str, width: int = 60) -> str:
    """A user's text quoted for a message, cut to ``width`` characters."""
    return repr(text) if len(text) <= width else repr(text[: width - 3]) + "..."


def nesting_depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """How deep containers nest in ``value``, counting no further than ``limit + 1`` (iterative: no recursion)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                return deepest
        children = node.values() if isinstance(node, Mapping) else node if isinstance(node, (list, tuple)) else ()
        for child in children:
            seen += 1
            if isinstance(child, (Mapping, list, tuple)):
                stack.append((child, depth + 1))
            if seen > MAX_YAML_NODES * 100:  # a shared-reference bomb: stop walking, it is too big anyway
                return limit + 1
    return deepest


#: A JSON string literal (escapes included): brackets inside one do not nest anything.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
#: Every byte but JSON's brackets, for ``bytes.translate`` to delete.
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(raw: bytes, limit: int = MAX_DEPTH) -> int:
    """:func:`nesting_depth` of the value JSON text holds (the top level is 0), read from its brackets outside
    strings before any parsing, counting no further than ``limit + 1``. The bulk runs in C: walking a parsed
    request visits every token id of its prompts (0.4 s for a million), this reads ~2 brackets a prompt.
    """
    depth, deepest = 0, 1
    for b in _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS):
        if b in b"[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit + 1:
                    break
        else:
            depth -= 1
    return deepest - 1


def node_count(value: Any, limit: int) -> int:
    """Nodes in ``value`` counted at every occurrence (shared references each time), stopping past ``limit``."""
    count = 0
    stack = [value]
    while stack:
        node = stack.pop()
        count += 1
        if count > limit:
            return count
        if isinstance(node, Mapping):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return count


def unique_keys(error: Callable[[str], Exception]) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A ``json`` ``object_pairs_hook`` refusing a key given twice in one object (``json`` keeps the last silently).

    ``error(message)`` builds the exception to raise, so each reader names its own file.
    """

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise error(f"key {key!r} appears twice in one object")
            out[key] = value
        return out

    return hook
