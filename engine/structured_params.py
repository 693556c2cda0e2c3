"""``StructuredOutputsParams`` (vLLM's): what a sample's text must match, checked on construction (no torch, no
xgrammar needed: the executor compiles it, ``engine.structured``)."""

from __future__ import annotations

import hashlib
import json as _json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from engine.prompts import check_text, check_tree, lone_surrogate
from engine.reasoning import PARSERS
from engine.schema_ignored import ignored_settings
from pipeline.errors import GenerationError, did_you_mean
from pipeline.json_ints import LongInts, too_long_int, too_long_message
from pipeline.limits import (
    MAX_SCHEMA_DEPTH,
    MAX_STRUCTURED_CHARS,
    MAX_STRUCTURED_CHOICES,
    nesting_depth,
    plain_flag,
    short_py,
    unique_keys,
)
from pipeline.vllm_compat import reasoning_parser_named

#: The ways to constrain an output, in vLLM's order; exactly one is given.
KINDS = ("json", "regex", "choice", "grammar", "json_object")

_FIELD = "structured_outputs"


def _refuse(what: str, why: str) -> GenerationError:
    return GenerationError(f"generate: {_FIELD}{'.' + what if what else ''}: {why}")


#: Why the schema ``false`` (JSON Schema's boolean form: no value satisfies it) is refused, after the field's name.
FALSE_SCHEMA = ("admits no value: the schema is false, which no JSON value satisfies; give a schema some JSON value "
                "satisfies")

#: What a JSON value that is no object is called, as JSON calls it (Python's names said "got JSON NoneType").
_JSON_KINDS = {list: "a JSON array", str: "a JSON string", bool: "true or false", type(None): "null"}


def _schema_text(schema: Any) -> str:
    """A JSON schema (a dict, or its JSON text) as JSON text; one line naming ``json`` when it is neither."""
    if isinstance(schema, str):
        if len(schema) > MAX_STRUCTURED_CHARS:
            raise _refuse("json", f"expected at most {MAX_STRUCTURED_CHARS:,} characters of JSON schema, got "
                                  f"{len(schema):,}")
        check_text(f"{_FIELD}.json", schema)
        # an integer past Python's 4,300 digits was "not JSON text (Exceeds the limit (4300 digits) ... t)"
        ints = LongInts()
        try:  # standard JSON, each key once: json would keep the last of two "type"s where xgrammar may keep the
            parsed = _json.loads(schema, object_pairs_hook=unique_keys(_Refused),  # first, and 1e400 or NaN reached
                                 parse_float=_finite, parse_constant=_no_constant,  # xgrammar as "RuntimeError"
                                 parse_int=ints)
        except _Refused as exc:
            raise _refuse("json", f"{exc}; give standard JSON, each key once") from None
        except (ValueError, RecursionError) as exc:
            raise _refuse("json", f"not JSON text ({str(exc).splitlines()[0][:120]}); give a JSON schema as a dict "
                                  "or its JSON text") from None
        if ints.found:
            _long_int(parsed)
        if parsed is False:  # a boolean schema: false admits nothing (true, any value, is no object xgrammar takes)
            raise _refuse("json", FALSE_SCHEMA)
        if not isinstance(parsed, dict):
            raise _refuse("json", f"expected a JSON schema object, got {_JSON_KINDS.get(type(parsed), 'a number')}")
        _check_depth(parsed)  # a schema sent as text skips the request body's own depth check
        return schema
    if not isinstance(schema, Mapping):
        raise _refuse("json", f"expected a JSON schema (a dict, or its JSON text), got {type(schema).__name__}")
    _check_depth(schema)
    try:
        text = _json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        _long_int(schema)  # an int Python will not write as text: was "not JSON-serializable (Exceeds the limit ...)"
        raise _refuse("json", f"not JSON-serializable ({exc})") from None
    if lone_surrogate(text) is not None:  # JSON's "\ud800" in a pattern, an enum, a key: xgrammar takes UTF-8 only
        check_tree(f"{_FIELD}.json", schema)
    if len(text) > MAX_STRUCTURED_CHARS:
        raise _refuse("json", f"expected at most {MAX_STRUCTURED_CHARS:,} characters of JSON schema, got "
                              f"{len(text):,}")
    return text


def _long_int(schema: Any) -> None:
    """One line naming ``json`` and where in it an integer too long for Python to convert stands, if one does."""
    found = too_long_int(schema)
    if found is not None:
        where, digits = found
        raise _refuse("json", f"{where + ': ' if where else ''}{too_long_message(digits)}")


class _Refused(Exception):
    """A JSON schema text that parses, but not as standard JSON with each key once (the reason is the message)."""


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _Refused(f"the number {text[:40]} is past a double's range (about 1.8e308)")
    return value


def _no_constant(name: str) -> float:
    raise _Refused(f"{name} is not standard JSON")


def _check_depth(schema: Any) -> None:
    """One line naming ``json`` when the schema's document nests deeper than xgrammar compiles in reasonable time."""
    if nesting_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise _refuse("json", f"nests deeper than {MAX_SCHEMA_DEPTH} levels of objects and arrays")


def _string(what: str, value: Any, expected: str) -> None:
    if not isinstance(value, str) or not value:
        shown = repr(value) if isinstance(value, str) else type(value).__name__
        raise _refuse(what, f"expected {expected}, got {shown}")
    if len(value) > MAX_STRUCTURED_CHARS:
        raise _refuse(what, f"expected at most {MAX_STRUCTURED_CHARS:,} characters, got {len(value):,}")
    check_text(f"{_FIELD}.{what}", value)


def _choices(value: Any) -> Any:
    """``choice``: a list → a tuple, counted before it is copied (anything else is left for the check to name)."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        if len(value) > MAX_STRUCTURED_CHOICES:
            raise _refuse("choice", f"expected at most {MAX_STRUCTURED_CHOICES:,} strings, got a list of "
                                    f"{len(value):,}")
        return tuple(value)
    return value


#: vLLM's ``StructuredOutputsParams`` fields kvload does not have → what to do instead.
VLLM_FIELDS_NOT_TAKEN: dict[str, str] = {
    "disable_fallback": "kvload compiles every spec with xgrammar alone, so there is no other backend to fall back to",
    "disable_additional_properties": "write \"additionalProperties\": false in the schema's objects",
    "whitespace_pattern": "JSON whitespace is xgrammar's: any (the default) or compact with "
                          "disable_any_whitespace=True",
    "structural_tag": "kvload takes no structural tags; constrain the output with json, regex, choice or grammar",
}


def _unknown_field(name: str) -> GenerationError:
    """The one line for a keyword that is no field: vLLM's with what to do instead, else the fields there are."""
    why = VLLM_FIELDS_NOT_TAKEN.get(name)
    if why is not None:
        return _refuse(name, f"vLLM's StructuredOutputsParams field, not kvload's: {why}")
    fields = sorted(a.name for a in attrs.fields(StructuredOutputsParams) if a.init)
    return _refuse("", f"unknown field {name[:80]!r}; fields are {', '.join(fields)}{did_you_mean(name, fields)}")


@attrs.frozen(init=False)
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``regex`` (the
    text fully matches it), ``choice`` (the text is one of these strings), ``grammar`` (an EBNF/GBNF grammar,
    xgrammar's dialect, rule ``root``) or ``json_object=True`` (any JSON object). ``disable_any_whitespace`` (with
    ``json`` or ``json_object``): no whitespace between JSON tokens beyond one space after ``:`` and ``,`` (xgrammar's
    compact form; the default lets the model put any, as vLLM does). ``reasoning_parser`` (``"deepseek_r1"`` or
    ``"qwen3"``, or TensorRT-LLM's spelling of one, ``"deepseek-r1"``, taken as it and kept under kvload's name, as the
    engine-wide ``reasoning_parser`` takes it; vLLM sets its engine's ``structured_outputs_config.reasoning_parser``
    for this): the sample thinks freely and the grammar holds only its answer, the text after the thinking as that
    reasoning parser reads it (``engine.reasoning``); under ``qwen3`` a reply that does not begin with ``<think>`` is
    content, held from its first character. Set on ``SamplingParams(structured_outputs=...)``; needs xgrammar
    (``pip install 'kvload[structured]'``)."""

    json: Any = attrs.field(default=None, hash=False)  # a dict is not hashable
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    reasoning_parser: str | None = None
    #: the compiled spec's text (a schema as JSON text, the choices as JSON), set on construction
    _spec: str = attrs.field(default="", init=False, eq=False, repr=False)

    def __init__(self, *, json: Mapping[str, Any] | str | None = None, regex: str | None = None,
                 choice: Sequence[str] | None = None, grammar: str | None = None,
                 json_object: bool | None = None, disable_any_whitespace: bool = False,
                 reasoning_parser: str | None = None, **unknown: Any) -> None:
        """Keywords only; exactly one of the five kinds (``json_object=False`` counts as not given)."""
        if unknown:  # one line naming it, as SamplingParams words an unknown field (Python's TypeError named none)
            raise _unknown_field(next(iter(unknown)))
        # TensorRT-LLM's name of a parser (deepseek-r1) is that parser, as kvload.LLM(reasoning_parser=...) takes it
        reasoning_parser = reasoning_parser_named(reasoning_parser) or reasoning_parser
        json_object, disable_any_whitespace = plain_flag(json_object), plain_flag(disable_any_whitespace)
        self.__attrs_init__(json, regex, _choices(choice), grammar, json_object, disable_any_whitespace,
                            reasoning_parser)

    def __attrs_post_init__(self) -> None:
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise _refuse("json_object", f"expected true or false, got {short_py(self.json_object)}")
        if self.json is False:  # not "json not given", as json_object=False is: the schema false
            raise _refuse("json", FALSE_SCHEMA)
        for kind, expected in (("regex", "a non-empty string"), ("grammar", "a non-empty string"),
                               ("choice", "a non-empty list of non-empty strings")):
            if getattr(self, kind) is False:  # JSON's false is no text nor list: it was taken for "not given"
                raise _refuse(kind, f"expected {expected}, got False")
        given = [k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(given) != 1:
            got = "none" if not given else " and ".join(given)
            raise _refuse("", f"give exactly one of {', '.join(KINDS)}; got {got}")
        kind = given[0]
        if not isinstance(self.disable_any_whitespace, bool):
            raise _refuse("disable_any_whitespace",
                          f"expected true or false, got {short_py(self.disable_any_whitespace)}")
        if self.disable_any_whitespace and kind not in ("json", "json_object"):
            raise _refuse("disable_any_whitespace", f"applies to json and json_object (JSON's whitespace); {kind} "
                                                    "outputs match their own spec exactly")
        if self.reasoning_parser is not None and (not isinstance(self.reasoning_parser, str)
                                                 or self.reasoning_parser not in PARSERS):
            shown = repr(self.reasoning_parser) if isinstance(self.reasoning_parser, str) else \
                type(self.reasoning_parser).__name__
            raise _refuse("reasoning_parser", f"expected one of {', '.join(PARSERS)} (or None: the grammar holds the "
                                              f"whole output), got {shown}"[:300])
        if kind == "json":
            spec = _schema_text(self.json)
        elif kind == "choice":
            if not isinstance(self.choice, tuple) or not self.choice:
                raise _refuse("choice", f"expected a non-empty list of non-empty strings, got {short_py(self.choice)}")
            for i, text in enumerate(self.choice):
                _string(f"choice[{i}]", text, "a non-empty string")
            spec = _json.dumps(list(self.choice), ensure_ascii=False)
            if len(spec) > MAX_STRUCTURED_CHARS:
                raise _refuse("choice", f"expected at most {MAX_STRUCTURED_CHARS:,} characters in all, got "
                                        f"{len(spec):,}")
        elif kind == "json_object":
            spec = ""
        else:
            _string(kind, getattr(self, kind), "a non-empty string")
            spec = getattr(self, kind)
        object.__setattr__(self, "_spec", spec)

    @property
    def kind(self) -> str:
        """Which constraint is given: one of :data:`KINDS`."""
        return next(k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False)

    @property
    def spec(self) -> str:
        """The text compiled: the JSON schema's text, the regex, the grammar, the choices as a JSON list, or ""
        (``json_object``)."""
        return self._spec

    def describe(self) -> dict[str, Any]:
        """What the audit records: the kind, the spec's size and SHA-256 (never the spec: a schema may be large, or
        the client's secret), and the reasoning parser whose answer it holds (None: the whole output)."""
        return {"kind": self.kind, "chars": len(self._spec),
                "sha256": hashlib.sha256(self._spec.encode("utf-8")).hexdigest(),
                "any_whitespace": not self.disable_any_whitespace, "reasoning_parser": self.reasoning_parser}

    def ignored_settings(self, field: str = f"{_FIELD}.json") -> list[tuple[str, Any, str]]:
        """What the JSON schema holds that xgrammar does not enforce (``engine.schema_ignored``: length bounds it
        drops, ``not``, ``contains``, ...) as ``setting_ignored`` entries (name, value, why), named by their path under
        ``field``; none for the other kinds."""
        if self.kind != "json":
            return []
        return ignored_settings(_json.loads(self._spec), field)

    def to_dict(self) -> dict[str, Any]:
        """Plain form: the one field given (vLLM's keys)."""
        value = getattr(self, self.kind)
        data = {self.kind: list(value) if isinstance(value, tuple) else value}
        if self.disable_any_whitespace:
            data["disable_any_whitespace"] = True
        if self.reasoning_parser is not None:
            data["reasoning_parser"] = self.reasoning_parser
        return data


__all__ = ["FALSE_SCHEMA", "KINDS", "VLLM_FIELDS_NOT_TAKEN", "StructuredOutputsParams"]
