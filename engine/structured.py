"""Structured outputs with xgrammar: a sample's tokens held to its ``StructuredOutputsParams`` (vLLM's default backend).

xgrammar is optional (``pip install 'kvload[structured]'``); without it a request for structured outputs is refused
in one line before anything runs. A :class:`GrammarBackend` (one per executor: one tokenizer) compiles each request's
spec (the latest :data:`COMPILED_GRAMMARS` are kept); each sample gets a :class:`Constraint` (a
``GrammarMatcher``). Every step :func:`constrain` masks the constrained rows of the (penalized) logits to the tokens
the grammar allows next, greedy or sampled alike; a speculative draft row ``j`` is masked after the matcher accepts
the first ``j`` drafts, which are then rolled back, so drafts verify exactly as a step per token would. The driver's
stop hook feeds each appended token to the matcher (:meth:`Constraint.advance`) and ends the sample ("stop") once the
grammar is complete and has taken an end-of-sequence token.

With ``StructuredOutputsParams.reasoning_parser`` a :class:`~engine.thinking_gate.ThinkingGate` holds the grammar
back while the sample thinks (``engine.thinking_gate``); :class:`Constraint` hands the grammar the answer from its first
character.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any

import torch

from engine.grammar_shape import empty_only_rules, matches_nothing, never_ending_rules, nullable_repeat_nesting
from engine.schema_all_of import unmerged_all_of
from engine.schema_ignored import for_xgrammar
from engine.schema_keywords import misshapen
from engine.schema_lengths import path_text
from engine.schema_patterns import pattern_cost
from engine.schema_refs import OUTSIDE, foreign_refs
from engine.schema_values import contradictions
from engine.structured_params import StructuredOutputsParams
from engine.thinking_gate import CONTENT, PENDING, REFUSED, GateTables, ThinkingGate, classify_start
from pipeline.errors import GenerationError
from pipeline.limits import MAX_NULLABLE_REPEAT_NESTING, MAX_PATTERN_COUNT_SQUARES

#: Compiled grammars kept per tokenizer, the most recently used (a long-running server sees many schemas; a client
#: that repeats one compiles it once). kvload keeps them, not xgrammar's own cache: with that cache bounded (64 MiB
#: by its estimate) the process still grew 26 KB for every distinct schema once the cache was full (1,500 to 3,600
#: six-property schemas: 432 -> 479 MiB); with 256 grammars held here it stayed at 336-340 MiB.
COMPILED_GRAMMARS = 256

INSTALL_HINT = "pip install 'kvload[structured]'"

_ANY_OBJECT = '{"type": "object"}'

# xgrammar's C++ errors start "[07:05:36] /project/cpp/file.cc:94: " and may say "Check failed: (...) is false: "
_CPP_PREFIX = re.compile(r"^\[[0-9:. ]+\]\s+\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"^Check failed: .*? is false:\s*")


def load_xgrammar(field: str = "structured_outputs") -> Any:
    """The xgrammar module; ``GenerationError`` naming ``field`` and the extra to install when it is missing."""
    try:
        import xgrammar
    except ImportError:
        raise GenerationError(f"generate: {field}: structured outputs need the xgrammar package, which is not "
                              f"installed; {INSTALL_HINT}") from None
    return xgrammar


def reason(exc: BaseException) -> str:
    """xgrammar's refusal as one short line, without its C++ source location."""
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    text = _CHECK_FAILED.sub("", _CPP_PREFIX.sub("", text))
    return text if len(text) <= 300 else text[:297] + "..."


#: How a choice's characters are written in an EBNF string literal: quotes and backslashes escaped, control
#: characters (NUL included) as xgrammar's ``\xHH`` escapes, so any string a tokenizer can spell is one literal.
_EBNF_ESCAPES = {ord("\\"): "\\\\", ord('"'): '\\"', ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t",
                 **{c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F] if chr(c) not in "\n\r\t"}}


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose root is exactly one of ``choices`` (vLLM's ``choice_as_grammar``, with control
    characters escaped too)."""
    def literal(text: str) -> str:
        return '"' + text.translate(_EBNF_ESCAPES) + '"'

    return "root ::= " + " | ".join(literal(c) for c in choices)


class Constraint:
    """One sample's grammar state: which tokens may come next, advanced token by token; with a :class:`ThinkingGate`,
    free until the thinking ends."""

    __slots__ = ("gate", "matcher", "overruled", "stop_token_ids")

    def __init__(self, matcher: Any, stop_token_ids: frozenset[int], gate: ThinkingGate | None = None) -> None:
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids
        self.gate = gate  # None: the grammar holds every token from here
        #: :func:`constrain` once set aside the sample's other token settings (they and the grammar left no token)
        self.overruled = False

    def advance(self, token: int) -> bool:
        """Take a token the sample appended; whether the sample ends ("stop"): the grammar is complete, or stuck (an
        end-of-sequence token the grammar refuses: :func:`constrain` allows only those where the vocabulary cannot
        spell what the grammar needs next). A token that ends the thinking hands the characters after the marker to
        the grammar; one read while thinking ends nothing here (the sample's own EOS, stop and length rules do).

        The mask allowed only grammar tokens, so any other refusal is a bug: ``RuntimeError``."""
        gate = self.gate
        if gate is not None and gate.pending is not None:  # qwen3's undecided start
            kind, text = gate.classify(gate.pending, token)
            if kind == REFUSED:
                raise RuntimeError(f"structured_outputs: token {token} writes <think> where it would leave content "
                                   "the grammar does not hold, yet it was drawn; the mask was not applied")
            if kind == CONTENT:  # no <think> can come of it: the grammar holds the reply from its first character
                self.gate = None
                if gate.pending and not self.matcher.accept_string(gate.pending.encode("latin-1")):
                    raise RuntimeError(f"structured_outputs: token {token} made {gate.pending!r} content, which the "
                                       "grammar refuses, yet it was drawn; the mask was not applied")
            else:
                gate.pending = gate.pending + text if kind == PENDING else None
        if self.gate is not None:
            self.gate.reader, answer = self.gate.read(self.gate.reader, token)
            if answer is None:
                return False
            self.gate = None
            if answer and not self.matcher.accept_string(answer.encode("latin-1")):
                raise RuntimeError(f"structured_outputs: token {token} ended the thinking with {answer!r}, which the "
                                   "grammar refuses, yet it was drawn; the mask was not applied")
            return False
        if not self.matcher.accept_token(int(token)):
            if token in self.stop_token_ids:
                return True
            raise RuntimeError(f"structured_outputs: token {token} is not allowed by the grammar here, yet it was "
                               "drawn; the mask was not applied")
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, start: int, count: int, drafts: Sequence[int]) -> list[int]:
        """Write this sample's ``count`` bitmask rows from ``start`` (row ``j`` follows the first ``j`` drafts); the
        rows to mask. Nothing stays changed: drafts taken are rolled back, a thinking sample's reader is not moved."""
        gate = self.gate
        if gate is None:
            return _fill(self.matcher, bitmask, start, count, drafts, rollback=True)
        reader, pending, rows = gate.reader, gate.pending, []
        for j in range(count):
            if pending is not None:  # qwen3's undecided start: <think>, or content the grammar holds
                row = gate.pending_row(pending, bitmask.shape[1])
                bitmask[start + j] = row
                rows.append(start + j)
                draft = int(drafts[j]) if j < count - 1 else -1
                if draft < 0 or not int(row[draft // 32]) >> (draft % 32) & 1:
                    break  # the last row, or a refused draft masked out of its own row: verification stops there
                kind, text = gate.classify(pending, draft)
                if kind == CONTENT:
                    if draft in self.stop_token_ids:
                        break
                    matcher = gate.matcher(pending + text)  # the row allowed it, so the grammar takes it
                    return rows + _fill(matcher, bitmask, start + j + 1, count - j - 1, drafts[j + 1:],
                                        rollback=False)
                pending = pending + text if kind == PENDING else None
                reader, answer = gate.read(reader, draft)
                if answer is not None:  # <think></think> in the drafts: the grammar holds the rows after them
                    matcher = gate.matcher(answer)
                    return rows + _fill(matcher, bitmask, start + j + 1, count - j - 1, drafts[j + 1:],
                                        rollback=False)
                continue
            refused = gate.refused(reader)
            if refused:  # free but for the marker tokens whose tail the grammar refuses
                bitmask[start + j] = gate.row(refused, bitmask.shape[1])
                rows.append(start + j)
            if j == count - 1 or drafts[j] in refused:
                break  # a refused draft is masked out of its own row: verification stops there
            reader, answer = gate.read(reader, drafts[j])
            if answer is not None:  # the drafts so far end the thinking: the grammar holds the rows after them
                matcher = gate.matcher(answer)  # refused tails were masked above, so this takes it
                return rows + _fill(matcher, bitmask, start + j + 1, count - j - 1, drafts[j + 1:], rollback=False)
        return rows


def _fill(matcher: Any, bitmask: torch.Tensor, start: int, count: int, drafts: Sequence[int],
          rollback: bool) -> list[int]:
    """``matcher``'s masks for ``count`` rows from ``start``, row ``j`` after the first ``j`` drafts (those taken are
    rolled back when ``rollback``); the rows written."""
    rows, taken = [], 0
    for j in range(count):
        matcher.fill_next_token_bitmask(bitmask, start + j)
        rows.append(start + j)
        if j == count - 1 or not matcher.accept_token(int(drafts[j])) or matcher.is_terminated():
            break  # a draft the grammar refuses is masked out of its own row: verification stops there
        taken += 1
    if taken and rollback:
        matcher.rollback(taken)
    return rows


class GrammarBackend:
    """xgrammar over one tokenizer: compiles specs (:meth:`compile`) and makes per-sample :class:`Constraint`s."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int], name: str = "model") -> None:
        self.xgr = xgr = load_xgrammar()
        if tokenizer is None:
            raise GenerationError(f"generate: structured_outputs: the grammar is matched on token text, but {name} "
                                  "has no tokenizer (presets take token ids); use allowed_token_ids instead")
        if not stop_token_ids:
            raise GenerationError(f"generate: structured_outputs: {name} has no end-of-sequence token, so a "
                                  "structured output could never end")
        try:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=sorted(stop_token_ids))
        except Exception as exc:  # a tokenizer xgrammar cannot read: one line, not its traceback
            raise GenerationError(f"generate: structured_outputs: xgrammar cannot read {name}'s tokenizer: "
                                  f"{reason(exc)}") from None
        self.info = info
        self.vocab_size = int(info.vocab_size)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        #: the tokens a detokenizer skipping special tokens shows no text for (a thinking gate reads the same)
        self.special_token_ids = frozenset(int(t) for t in getattr(tokenizer, "all_special_ids", ()) or ())
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        #: the latest compiled grammars, least recently used first; only specs :func:`check_spec` passed are kept
        self._grammars: OrderedDict[tuple[str, bool, bytes], Any] = OrderedDict()
        self._lock = threading.Lock()  # the server's handler threads share the backend
        #: thinking gates' tables over this vocabulary, built when first needed
        self.tables = GateTables(info, self.stop_token_ids, self.special_token_ids)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params`` (the latest :data:`COMPILED_GRAMMARS` kept); ``GenerationError``
        naming the field and xgrammar's reason when it refuses the schema, regex or grammar, or when matching it would
        stall every step (:func:`check_matching_cost`)."""
        key = _key(params)
        with self._lock:
            compiled = self._grammars.get(key)
            if compiled is not None:
                self._grammars.move_to_end(key)
                return compiled
        compiler = self.compiler  # outside the lock: one client's long compile does not hold up the others
        compiled = _build(params, compiler.compile_json_schema, compiler.compile_regex, compiler.compile_grammar)
        check_spec(params)  # the spec as parsed (compiling unrolls short repetitions, hiding their nesting)
        with self._lock:
            self._grammars[key] = compiled
            while len(self._grammars) > COMPILED_GRAMMARS:
                self._grammars.popitem(last=False)
        return compiled

    def constraint(self, params: StructuredOutputsParams, skip_special: bool = True) -> Constraint:
        """A fresh matcher for one sample; behind a :class:`ThinkingGate` with ``params.reasoning_parser``
        (``skip_special``: the sample's ``skip_special_tokens``, so the gate reads the text the reply shows)."""
        compiled = self.compile(params)
        gate = None
        if params.reasoning_parser is not None:
            self.tables.token_texts()  # built here (the caller's thread), not in the first step: 62 ms over SmolLM2's
            # vocabulary
            gate = ThinkingGate(self, compiled, params.reasoning_parser, skip_special)
        return Constraint(self.xgr.GrammarMatcher(compiled), self.stop_token_ids, gate)

    def token_text(self, token: int) -> str:
        """``token``'s bytes as xgrammar matches them, as Latin-1 text (one character a byte); "" past the
        vocabulary (:meth:`GateTables.token_text`)."""
        return self.tables.token_text(token)


def _key(params: StructuredOutputsParams) -> tuple[str, bool, bytes]:
    """What a compiled grammar is kept under: the kind, the whitespace rule and the spec's SHA-256."""
    return params.kind, params.disable_any_whitespace, hashlib.sha256(params.spec.encode()).digest()


def check_spec(params: StructuredOutputsParams) -> None:
    """Parse ``params``' spec without a tokenizer (xgrammar's ``Grammar.from_*``), so a bad one is refused before a
    model loads: ``GenerationError`` as :meth:`GrammarBackend.compile` words it, or naming the extra to install."""
    grammar = load_xgrammar().Grammar
    built = _build(params, grammar.from_json_schema, grammar.from_regex, _grammar_of(grammar.from_ebnf))
    if params.kind == "json":
        check_admits_a_value(str(built))
    if params.kind == "grammar" and matches_nothing(str(built)):  # xgrammar compiles it; every sample would be ""
        raise GenerationError("generate: structured_outputs.grammar: matches no text: rule root never ends (each "
                              "of its alternatives needs a rule that needs itself again, as in root ::= root); give "
                              "it an alternative that ends in a string or character class")
    check_matching_cost(params, built)


#: What the refusal of a JSON schema no JSON value satisfies says after the field's name (kvload serve finds the tool
#: it is about by it too).
NO_VALUE = "admits no value"
#: xgrammar 0.2.9's refusals of a (sub)schema no JSON value satisfies: bounds that cross (minLength/maxLength,
#: minimum/maximum, minItems/maxItems, minProperties/maxProperties, minItems past a closed prefixItems), an empty
#: enum, the schema false.
_UNSATISFIABLE = re.compile(r"is greater than|^Invalid range|^enum array must not be empty|cannot accept any value")
_WHEREVER = ("(the schema, or a part of it: xgrammar refuses a part that admits none wherever it stands, even an "
             "optional property or one branch of an anyOf)")


def check_admits_a_value(grammar_text: str) -> None:
    """``GenerationError`` naming ``structured_outputs.json`` when a rule of xgrammar's grammar for a JSON schema
    (``grammar_text``) derives no finite text (``engine.grammar_shape.never_ending_rules``: a ``$ref`` cycle with no
    way out, which xgrammar compiles, and a sample entering it ran to max_tokens and wrote no JSON) or matches only
    the empty text (``engine.grammar_shape.empty_only_rules``): xgrammar compiles an empty ``anyOf`` or ``oneOf`` so,
    and a sample held to it would end at once, empty (the root), or write a property or item with no value, which is
    no JSON."""
    endless = never_ending_rules(grammar_text)
    why = "(a $ref back to it under a required property or a minItems)"
    if "root" in endless:
        raise GenerationError(f"generate: structured_outputs.json: {NO_VALUE}: each way through the schema needs it "
                              f"again {why}, so no finite JSON satisfies it and a sample would never end; give the "
                              "$ref a way out (an optional property, an anyOf branch that does not refer back)")
    if endless:
        raise GenerationError(f"generate: structured_outputs.json: {NO_VALUE}: a part of the schema (xgrammar's rule "
                              f"{endless[0]}) admits no finite value: each way through it needs it again {why}, so a "
                              "sample that starts writing it would never end; give the $ref a way out or drop that "
                              "part")
    empty = empty_only_rules(grammar_text)
    if not empty:
        return
    why = "an empty anyOf or oneOf, which no JSON value satisfies"
    if "root" in empty:
        raise GenerationError(f"generate: structured_outputs.json: {NO_VALUE}: xgrammar's grammar for the schema "
                              f"matches only the empty text ({why}); give it a schema some JSON value satisfies")
    raise GenerationError(f"generate: structured_outputs.json: {NO_VALUE}: a part of the schema (xgrammar's rule "
                          f"{empty[0]}) matches only the empty text ({why}), so a reply holding it would not be JSON; "
                          "drop it or give it a schema some JSON value satisfies")


def parsed_schema(spec: str) -> Any:
    """The JSON schema text ``spec`` parsed once for the checks below; None when it is not JSON (xgrammar refuses it
    then, in its own words)."""
    try:
        return json.loads(spec)
    except (ValueError, RecursionError):
        return None


def check_keywords_shaped(schema: Any) -> None:
    """``GenerationError`` naming ``structured_outputs.json``, the keyword's path and what it takes when the parsed
    JSON schema (:func:`parsed_schema`) has a ``required``, ``pattern``, ``format`` or ``type`` of the wrong shape
    (``engine.schema_keywords``), which xgrammar refused in C++ words or took as any value."""
    found = misshapen(schema) if schema is not None else []
    if found:
        path, key, value, what = found[0]
        where = path_text((*path, key)).lstrip(".")
        text = json.dumps(value, ensure_ascii=False)
        raise GenerationError(f"generate: structured_outputs.json: {where}: expected {what}, got "
                              f"{text if len(text) <= 80 else text[:77] + '...'}")


#: What the refusal of a schema whose patterns xgrammar would take too long to compile says after the field's name
#: (kvload serve finds the tool it is about by it too).
SLOW_COMPILE = "too costly to compile"


def check_pattern_counts(schema: Any) -> None:
    """``GenerationError`` naming ``structured_outputs.json`` and the largest count when the squares of the repetition
    counts in the parsed JSON schema's patterns add up past :data:`~pipeline.limits.MAX_PATTERN_COUNT_SQUARES`
    (``engine.schema_patterns``): xgrammar would take seconds to minutes compiling it, on the thread that parses every
    request."""
    if schema is None:
        return
    total, path, key, n = pattern_cost(schema)
    if total > MAX_PATTERN_COUNT_SQUARES:
        where = path_text((*path, key)).lstrip(".")
        raise GenerationError(
            f"generate: structured_outputs.json: {where}: {SLOW_COMPILE}: a repetition count of {n:,} (the squares of "
            f"the schema's pattern counts add up to {total:,}, at most {MAX_PATTERN_COUNT_SQUARES:,} are taken); "
            "xgrammar's time to compile a schema's pattern grows with the square of each count (^.{3000}$: 2.6 s, "
            "^a{50000}$: 203 s); use smaller counts, or a regex spec (structured_outputs.regex), which compiles such "
            "counts at once")


def check_refs_local(schema: Any) -> None:
    """``GenerationError`` naming ``structured_outputs.json`` and the path when the parsed JSON schema has an
    ``allOf`` of more than one schema (``engine.schema_all_of``) or refers outside itself (``engine.schema_refs``):
    xgrammar would match any JSON value there (and kvload fetches nothing)."""
    if schema is None:
        return
    merged = unmerged_all_of(schema)
    if merged:
        path, n = merged[0]
        where = path_text((*path, "allOf")).lstrip(".")
        raise GenerationError(f"generate: structured_outputs.json: {where}: an allOf of {n} schemas {ANY_VALUE}: "
                              "xgrammar matches any JSON value there, dropping the type and every keyword beside it "
                              "too; merge them into one schema (an allOf of one schema is held)")
    found = foreign_refs(schema)
    if found:
        path, ref = found[0]
        where = path_text((*path, "$ref")).lstrip(".")
        shown = ref if len(ref) <= 100 else ref[:97] + "..."
        raise GenerationError(f"generate: structured_outputs.json: {where}: {shown!r} {OUTSIDE}; xgrammar resolves "
                              "only '#' and '#/...' (any JSON value would be matched there) and kvload fetches "
                              "nothing; put the schema it names under $defs and refer to it as '#/$defs/NAME'")


def check_values_admitted(schema: Any) -> None:
    """``GenerationError`` naming ``structured_outputs.json`` when a subschema of the parsed JSON schema has a
    ``const``, or an ``enum`` none of whose values, that the keywords beside it exclude (its ``type``, a bound:
    ``engine.schema_values``): no JSON value satisfies them all, and xgrammar would match the value alone."""
    found = contradictions(schema) if schema is not None else []
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise GenerationError(f"generate: structured_outputs.json: {NO_VALUE}: {found[0]}{more}; a value must "
                              "satisfy every keyword, and xgrammar would match the value alone; make them agree "
                              "(refused wherever it stands, even an optional property or one branch of an anyOf)")


#: What the refusal of an ``allOf`` of several schemas says (kvload serve finds the tool it is about by it too).
ANY_VALUE = "is not held"


#: A ``Regex("...")`` expression of xgrammar's printed grammar (a JSON schema's ``pattern``), its string JSON-escaped.
_LAZY_REGEX = re.compile(r'\bRegex\(("(?:[^"\\]|\\.)*")')
#: What :func:`check_matching_cost` says after the field's name (kvload serve finds the tool it is about by it too).
COSTLY = "too costly to match"


def check_matching_cost(params: StructuredOutputsParams, grammar: Any) -> None:
    """``GenerationError`` naming the field when ``grammar`` (xgrammar's, of ``params``) nests repetitions that can
    match nothing deeper than :data:`~pipeline.limits.MAX_NULLABLE_REPEAT_NESTING` (``engine.grammar_shape``):
    xgrammar would take seconds a token to match it, on the loop every request's step waits for."""
    text = str(grammar)
    nesting = nullable_repeat_nesting(text, cap=MAX_NULLABLE_REPEAT_NESTING + 1)
    for literal in _LAZY_REGEX.findall(text):  # a schema's pattern xgrammar keeps as a regex, converted when compiled
        try:
            inner = load_xgrammar().Grammar.from_regex(json.loads(literal))
        except Exception:  # not a form this reads: xgrammar took it, the rest is still checked
            continue
        nesting = max(nesting, nullable_repeat_nesting(str(inner), cap=MAX_NULLABLE_REPEAT_NESTING + 1))
    if nesting > MAX_NULLABLE_REPEAT_NESTING:
        raise GenerationError(
            f"generate: structured_outputs.{params.kind}: {COSTLY}: a repetition of something that may be empty "
            "nests inside another (as in (((a|b){0,30}){0,30}){0,30}, or (x*){0,9} inside {0,9}); xgrammar's "
            "matching time then grows with about the 4th power of the output's length (seconds a token within 40 "
            "tokens, stalling every request), so at most one such repetition may hold another; start the inner "
            "ones at 1 (+ or {1,n})")


#: A rule of xgrammar 0.2.9's printed grammar for the characters of a JSON-schema string with ``minLength`` or
#: ``maxLength``: "any character but ``"``, ``\``, CR and LF", which lets a tab or ``\x10`` into the string raw, and a
#: strict JSON parser (``json.loads``) then refuses the reply. Its unbounded strings already exclude every control
#: character; :func:`_strict_strings` makes the bounded ones do the same.
_LOOSE_CHARACTERS = re.compile(r'^(\S+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_STRICT_CHARACTERS = r'\1 ::= (([^\\0-\\x1f\\"\\\\]))'


def _strict_strings(schema: str, any_whitespace: bool) -> Any:
    """xgrammar's ``Grammar`` of a JSON schema whose length-bounded strings hold only characters JSON allows unescaped
    (parsed once: as xgrammar reads the schema when it has no such string), or None when the schema has no length
    bound (it then compiles as it is). A pattern in place of the bounds would do it too, but xgrammar builds a pattern
    of {0,1000} into an automaton (0.6 s a schema); this keeps its own repetition. xgrammar's refusal propagates."""
    if '"minLength"' not in schema and '"maxLength"' not in schema and "\\u" not in schema:  # no such key (nor one
        return None  # spelled with escapes): the common case, "Length" in a description too, not parsed here at all
    grammar = load_xgrammar().Grammar
    parsed = grammar.from_json_schema(schema, any_whitespace=any_whitespace)
    strict, n = _LOOSE_CHARACTERS.subn(_STRICT_CHARACTERS, str(parsed))
    return grammar.from_ebnf(strict) if n else parsed  # nothing to rewrite ("Length" in a description): no 2nd parse


def _grammar_of(ebnf: Any) -> Any:
    """``Grammar.from_ebnf`` that also takes a ``Grammar`` as it is (as a compiler's ``compile_grammar`` does)."""
    def parse(spec: Any) -> Any:
        return spec if isinstance(spec, load_xgrammar().Grammar) else ebnf(spec)

    return parse


def _build(params: StructuredOutputsParams, json_schema: Any, regex: Any, ebnf: Any) -> Any:
    """``params``' spec through xgrammar's three entry points (a compiler's or ``Grammar``'s); its refusal as one line
    naming the field."""
    kind = params.kind
    if kind == "json":  # parsed once for the four checks (each walked its own parse, on the request's thread)
        schema = parsed_schema(params.spec)
        check_keywords_shaped(schema)
        check_pattern_counts(schema)
        check_refs_local(schema)
        check_values_admitted(schema)
    try:
        spaces = not params.disable_any_whitespace
        if kind == "json":  # without the length bounds xgrammar drops, oneOf it reads as anyOf written so (both
            spec = for_xgrammar(params.spec)  # reported instead of its C++ warning lines)
            strict = _strict_strings(spec, spaces)
            return json_schema(spec, any_whitespace=spaces) if strict is None else ebnf(strict)  # a Grammar
        if kind == "json_object":  # an object, as OpenAI's json_object and vLLM's (the builtin grammar takes any
            return json_schema(_ANY_OBJECT, any_whitespace=spaces)  # JSON value: [34] too)
        if kind == "regex":
            return regex(params.spec)
        if kind == "choice":
            return ebnf(choice_grammar(params.choice or ()))
        return ebnf(params.spec)
    except Exception as exc:  # xgrammar raises RuntimeError (C++), ValueError or its own InvalidJSONError
        why = reason(exc)
        if kind == "json" and _UNSATISFIABLE.search(why):
            raise GenerationError(f"generate: structured_outputs.json: {NO_VALUE}: {why} {_WHEREVER}") from None
        lark = LARK_GRAMMAR if kind == "grammar" and looks_like_lark(params.spec) else ""
        raise GenerationError(f"generate: structured_outputs.{kind}: xgrammar refused it: {why}{lark}") from None


#: what a refused grammar written in Lark's notation is told: vLLM's examples send one (its SQL grammar), which vLLM
#: hands to its guidance backend; kvload has xgrammar alone
LARK_GRAMMAR = ("; this reads as a Lark grammar (rules `name: ...`, none `name ::= ...`), which vLLM passes to its "
                "guidance backend: kvload compiles xgrammar's EBNF only (`root ::= ...`, rules `name ::= ...`, "
                "regexes as character classes, e.g. [a-zA-Z_] [a-zA-Z0-9_]*)")


def overruled_settings(params: Any) -> list[tuple[str, Any, str]]:
    """The token settings of ``params`` (a SamplingParams) that :func:`constrain` set aside for its grammar, each as
    (name, value, why) for a ``setting_ignored``: ``allowed_token_ids``, ``bad_words``, ``min_tokens`` where set."""
    why = ("with structured_outputs' grammar, the sample's allowed_token_ids, bad_words and min_tokens (those given) "
           "left no token at some step, so the grammar alone chose that token (what is drawn always parses)")
    given = (("allowed_token_ids", params.allowed_token_ids, params.allowed_token_ids is not None),
             ("bad_words", params.bad_words, bool(params.bad_words)),
             ("min_tokens", params.min_tokens, params.min_tokens > 0))
    return [(name, f"a list of {len(value):,}" if isinstance(value, list) and len(value) > 16 else value, why)
            for name, value, is_set in given if is_set]


def looks_like_lark(grammar: str) -> bool:
    """Whether ``grammar`` has rules but none in EBNF's ``::=``: a Lark grammar (vLLM's test for one)."""
    lines = (re.sub(r"(#|//).*$", "", line).strip() for line in grammar.splitlines())
    rules = [line for line in lines if line]
    return bool(rules) and not any("::=" in line for line in rules)


def constrain(logits: torch.Tensor, raw: torch.Tensor, counts: Sequence[int],
              rows: Sequence[tuple[Constraint | None, Sequence[int]]], backend: GrammarBackend,
              overruled: list[Constraint] | None = None) -> torch.Tensor:
    """``logits`` (``counts[i]`` rows per request ``i``; ``rows[i]``: its constraint or None, and its drafts) with each
    constrained row masked to the tokens its grammar allows next; rows without a constraint are untouched. ``raw``
    (the model's own logits, for logprobs) is never changed: when ``logits`` is it, a copy is masked. A row the
    other settings (``allowed_token_ids``, ``bad_words``, ``min_tokens``) and the grammar together leave empty takes
    the grammar alone (the grammar is the hard constraint: what is drawn always parses); one the grammar alone
    leaves empty (a vocabulary that cannot spell what it needs next) takes the end-of-sequence tokens only, and its
    sample ends there ("stop"), rather than a token outside the grammar or a failed step for every request in it.
    ``overruled``: a list the constraints whose other settings were set aside for the first time are added to (and
    marked :attr:`Constraint.overruled`), for the caller to report them as ``setting_ignored``."""
    xgr = backend.xgr
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], backend.vocab_size)
    masked: list[int] = []
    start = 0
    for c, (constraint, drafts) in zip(counts, rows, strict=True):
        if constraint is not None:
            masked.extend(constraint.fill(bitmask, start, c, drafts))
        start += c
    if not masked:  # thinking rows the gate leaves free: no copy of the logits (~7 µs a row, bench_structured)
        return logits
    out = logits.clone() if logits is raw else logits
    bitmask = bitmask.to(out.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=backend.vocab_size, indices=masked)
    where = torch.tensor(masked, dtype=torch.long, device=out.device)
    # a row is empty when its largest logit is -inf: one pass over the rows in place, where gathering the masked rows
    # and testing every logit cost 6x as much (bench/bench_structured.py --parts: 1.7 ms of a 32-row step's 8 ms)
    empty = torch.isneginf(out.amax(dim=-1)[where])
    if bool(empty.any()):
        dead = where[empty]
        out[dead] = raw[dead].to(out.dtype)
        xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=backend.vocab_size, indices=dead.tolist())
        stuck = dead[torch.isneginf(out[dead]).all(dim=-1)].tolist()
        # a row the grammar alone leaves empty was not the other settings' doing: only the others are overruled
        owner = [constraint for c, (constraint, _) in zip(counts, rows, strict=True) for _ in range(c)]
        for row in sorted(set(dead.tolist()) - set(stuck)):
            constraint = owner[row]
            if constraint is not None and not constraint.overruled:
                constraint.overruled = True
                if overruled is not None:
                    overruled.append(constraint)
        if stuck:
            stops = torch.tensor(sorted(backend.stop_token_ids), dtype=torch.long, device=out.device)
            for row in stuck:
                out[row, stops] = raw[row, stops].to(out.dtype)
    return out


__all__ = ["ANY_VALUE", "COMPILED_GRAMMARS", "COSTLY", "INSTALL_HINT", "NO_VALUE", "SLOW_COMPILE", "Constraint",
           "GrammarBackend", "ThinkingGate", "check_admits_a_value", "check_keywords_shaped", "check_matching_cost",
           "check_pattern_counts", "check_refs_local", "check_spec", "check_values_admitted", "choice_grammar",
           "classify_start", "constrain", "load_xgrammar", "overruled_settings", "parsed_schema", "reason"]
