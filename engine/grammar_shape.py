"""How deep a compiled grammar nests repetitions that can repeat nothing, read from xgrammar's normalized EBNF.

xgrammar keeps a bounded repetition (``x{0,30}``, a schema's ``maxLength``) as one repeat expression, matched by its
Earley parser without unrolling: compiling ``(((a|b){0,30}){0,30}){0,30}`` takes 1 ms. But a repeat whose body can
match the empty string, nested inside another such repeat, can split the same text across its iterations in ever
more ways, and the parser tracks each: matching that 31-character regex costs xgrammar 0.2 s per token by the 20th
token and 2.2 s by the 38th (xgrammar 0.2.9, 2 cores), on the engine loop thread that every request's step waits
on. One such repeat alone (``((a|b){0,100}){0,100}``, ``(.?){0,2000}``) stays near 1 ms a token, so
:func:`nullable_repeat_nesting` counts the deepest chain of them for the caller to bound.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

# one token of xgrammar's printed grammar: a string, a character class (maybe starred), a lookahead's opening, a
# bracket or bar, a repeat's bounds, a rule name, or a character of anything else
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\][*+?]?|\(=|[()|]|\{\s*-?\d+\s*,\s*-?\d+\s*\}'
                    r"|[A-Za-z_][A-Za-z0-9_.]*|\S")
_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*)\s*::=\s*(.*)$")


class _Node:
    """A parsed expression: ``kind`` is "alt" (of sequences), "seq", "ref", "repeat" (of a ref), "empty" (``""``),
    "maybe" (a character class starred or optional: empty or not) or "atom" (a non-empty string or a character
    class)."""

    __slots__ = ("items", "kind", "name")

    def __init__(self, kind: str, items: list[_Node] | None = None, name: str = "") -> None:
        self.kind, self.items, self.name = kind, items or [], name


def _parse(tokens: list[str]) -> _Node:
    """``tokens`` of one rule's body as a tree (a lookahead's tokens are skipped: it matches nothing itself)."""
    pos = 0

    def alternation() -> _Node:
        nonlocal pos
        options = [sequence()]
        while pos < len(tokens) and tokens[pos] == "|":
            pos += 1
            options.append(sequence())
        return options[0] if len(options) == 1 else _Node("alt", options)

    def sequence() -> _Node:
        nonlocal pos
        items: list[_Node] = []
        while pos < len(tokens) and tokens[pos] not in ("|", ")"):
            tok = tokens[pos]
            pos += 1
            if tok == "(=":  # a lookahead: skip to its closing bracket
                depth = 1
                while pos < len(tokens) and depth:
                    depth += {"(": 1, "(=": 1, ")": -1}.get(tokens[pos], 0)
                    pos += 1
                continue
            if tok == "(":
                node = alternation()
                pos += 1  # its ")"
            elif tok.startswith('"'):
                node = _Node("empty" if tok == '""' else "atom")
            elif tok.startswith("["):
                node = _Node("maybe" if tok.endswith(("*", "?")) else "atom")
            elif tok[0].isalpha() or tok[0] == "_":
                node = _Node("ref", name=tok)
            else:
                node = _Node("atom")
            if pos < len(tokens) and tokens[pos].startswith("{"):  # a repeat of what precedes it
                low = int(tokens[pos][1:].split(",")[0])
                pos += 1
                node = _Node("repeat", [node])
                if low == 0:
                    node.name = "nullable"  # zero repetitions match the empty string whatever the body
            items.append(node)
        return items[0] if len(items) == 1 else _Node("seq", items)

    return alternation()


def _rules(text: str) -> dict[str, _Node]:
    rules = {}
    for line in text.splitlines():
        m = _RULE.match(line.strip())
        if m:
            rules[m.group(1)] = _parse(_TOKEN.findall(m.group(2)))
    return rules


def _refs(node: _Node) -> Iterator[str]:
    stack = [node]
    while stack:
        n = stack.pop()
        if n.kind == "ref":
            yield n.name
        stack.extend(n.items)


def nullable_repeat_nesting(grammar_text: str, cap: int = 8) -> int:
    """The deepest chain of repeats each inside the body of the one before (through rule references) whose bodies
    can match the empty string, in xgrammar's printed grammar ``grammar_text`` (``str(xgrammar.Grammar)``), counted
    no further than ``cap``. Both passes are worklists over the rules (a schema's grammar may chain thousands)."""
    rules = _rules(grammar_text)
    users: dict[str, set[str]] = {name: set() for name in rules}
    for name, body in rules.items():
        for ref in _refs(body):
            if ref in users:
                users[ref].add(name)
    nullable = dict.fromkeys(rules, False)

    def can_be_empty(node: _Node) -> bool:
        if node.kind in ("empty", "maybe"):
            return True
        if node.kind == "atom":
            return False
        if node.kind == "ref":
            return nullable.get(node.name, False)
        if node.kind == "repeat":
            return node.name == "nullable" or can_be_empty(node.items[0])
        if node.kind == "alt":
            return any(can_be_empty(i) for i in node.items)
        return all(can_be_empty(i) for i in node.items)  # seq

    depth = dict.fromkeys(rules, 0)

    def deepest(node: _Node) -> int:
        if node.kind == "ref":
            return depth.get(node.name, 0)
        if node.kind == "repeat":
            body = node.items[0]
            return deepest(body) + (1 if can_be_empty(body) else 0)
        return max((deepest(i) for i in node.items), default=0)

    # least fixed points: a rule only ever turns nullable, its depth only grows (to cap, so recursion through a
    # nullable repeat ends there); a rule is looked at again when one it refers to changed
    for values, value in ((nullable, can_be_empty), (depth, lambda body: min(cap, deepest(body)))):
        todo = list(rules)
        queued = set(todo)
        while todo:
            name = todo.pop()
            queued.discard(name)
            new = value(rules[name])
            if new != values[name]:
                values[name] = new
                for user in users[name] - queued:
                    todo.append(user)
                    queued.add(user)
    return max(depth.values(), default=0)


def matches_nothing(grammar_text: str, root: str = "root") -> bool:
    """Whether rule ``root`` of xgrammar's printed grammar ``grammar_text`` derives no text at all (``root ::= root``,
    or rules that only ever refer on to each other): xgrammar compiles such a grammar, and a sample held to it could
    only end at once, empty. A least fixed point of the rules that derive some text; what this does not read (a rule
    it does not know, a construct it does not parse) counts as deriving text, so a grammar is never called empty
    wrongly."""
    return root in never_ending_rules(grammar_text)


def never_ending_rules(grammar_text: str) -> list[str]:
    """The rules of xgrammar's printed grammar ``grammar_text`` that derive no finite text, in the order printed: each
    way through them needs a rule that needs itself again (a JSON schema's ``$ref`` back to itself under a required
    property or a ``minItems``), so a sample that enters one never ends it. Least fixed point as in
    :func:`matches_nothing`."""
    rules = _rules(grammar_text)
    derives = dict.fromkeys(rules, False)

    def ends(node: _Node) -> bool:
        if node.kind in ("empty", "maybe", "atom"):
            return True
        if node.kind == "ref":
            return derives.get(node.name, True)  # not a rule of this text: not ours to judge
        if node.kind == "repeat":
            return node.name == "nullable" or ends(node.items[0])
        if node.kind == "alt":
            return any(ends(i) for i in node.items)
        return all(ends(i) for i in node.items)  # seq

    _fixed_point(rules, derives, ends)
    return [name for name in rules if not derives[name]]


def empty_only_rules(grammar_text: str) -> list[str]:
    """The rules of xgrammar's printed grammar ``grammar_text`` that derive the empty text and nothing else, in the
    order printed. xgrammar compiles an empty ``anyOf`` or ``oneOf`` of a JSON schema into such a rule, ``("")``: the
    place it stands (the root, a property, an item) then takes no JSON value, only nothing, and a reply would not
    parse. Least fixed points as in :func:`matches_nothing`; what this does not read counts as deriving text."""
    rules = _rules(grammar_text)
    derives = dict.fromkeys(rules, False)
    solid = dict.fromkeys(rules, False)  # derives some non-empty text

    def ends(node: _Node) -> bool:
        if node.kind in ("empty", "maybe", "atom"):
            return True
        if node.kind == "ref":
            return derives.get(node.name, True)
        if node.kind == "repeat":
            return node.name == "nullable" or ends(node.items[0])
        if node.kind == "alt":
            return any(ends(i) for i in node.items)
        return all(ends(i) for i in node.items)

    def text(node: _Node) -> bool:
        if node.kind in ("maybe", "atom"):
            return True
        if node.kind == "empty":
            return False
        if node.kind == "ref":
            return solid.get(node.name, True)
        if node.kind in ("repeat", "alt"):
            return any(text(i) for i in node.items)
        return all(ends(i) for i in node.items) and any(text(i) for i in node.items)  # seq

    _fixed_point(rules, derives, ends)
    _fixed_point(rules, solid, text)
    return [name for name in rules if derives[name] and not solid[name]]


def _fixed_point(rules: dict[str, _Node], values: dict[str, bool], test: Callable[[_Node], bool]) -> None:
    """Turn ``values[name]`` True for each rule whose body passes ``test`` until none changes: a worklist (a rule only
    ever turns True; one is looked at again when one it uses turned)."""
    users: dict[str, set[str]] = {name: set() for name in rules}
    for name, body in rules.items():
        for ref in _refs(body):
            if ref in users:
                users[ref].add(name)
    todo = list(rules)
    while todo:
        name = todo.pop()
        if not values[name] and test(rules[name]):
            values[name] = True
            todo.extend(users[name])


__all__ = ["empty_only_rules", "matches_nothing", "never_ending_rules", "nullable_repeat_nesting"]
