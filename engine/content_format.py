"""vLLM's ``chat_template_content_format``: how a message's ``content`` reaches the chat template.

``"string"``: one string (a message's text parts joined by newlines); ``"openai"``: the list of parts as OpenAI's
API sends them (``[{"type": "text", "text": ...}]``; a string content is one such part, an assistant's null none);
``"auto"`` (vLLM's default): ``"openai"`` for a template that loops over a message's content, else ``"string"``. A
template written for parts (``{% for part in message['content'] %}{{ part['text'] }}``) given a string iterated over
its characters and wrote nothing of the message.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

#: The formats vLLM's ``--chat-template-content-format`` and ``LLM.chat(chat_template_content_format=...)`` take.
CONTENT_FORMATS = ("auto", "string", "openai")


class PartedMessage(dict[str, Any]):
    """A chat message as the template gets it (a dict, equal to the plain one) that also keeps its content's parts
    as sent (``parts``: ``[{"type": "text", "text": ...}]``, ``[]`` for an assistant's null), for the "openai"
    format; nothing of it shows where the message is compared, copied into JSON or logged."""

    __slots__ = ("parts",)

    def __init__(self, fields: Mapping[str, Any], parts: list[dict[str, str]]) -> None:
        super().__init__(fields)
        self.parts = parts


def resolve(content_format: str, template: Any) -> str:
    """``"string"`` or ``"openai"``: ``content_format`` itself, or for ``"auto"`` what ``template`` (the chat
    template's text in effect) loops over (:func:`template_format`)."""
    if content_format != "auto":
        return content_format
    return template_format(template) if isinstance(template, str) else "string"


def as_format(message: Mapping[str, Any], content_format: str) -> dict[str, Any]:
    """``message`` as the template gets it under ``content_format`` (``"string"`` or ``"openai"``: its
    :class:`PartedMessage` parts, else its string content as one part)."""
    out = dict(message)
    if content_format == "openai":
        parts = getattr(message, "parts", None)
        out["content"] = [dict(p) for p in parts] if parts is not None else \
            [{"type": "text", "text": message["content"]}]
    return out


@functools.lru_cache(maxsize=32)
def template_format(source: str) -> str:
    """``"openai"`` when the Jinja template loops over a message's content (``message['content']``,
    ``message.content``, filtered or assigned to a name first), else ``"string"`` (vLLM's detection for "auto");
    a template that does not parse: ``"string"``."""
    import jinja2
    from jinja2 import nodes

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template  # its tags ({% generation %})

        ast = _compile_jinja_template(source).environment.parse(source)
    except (jinja2.TemplateError, ImportError):
        return "string"
    names: set[str] = set()

    def content(node: Any) -> bool:  # the content itself, a filter over it, or a name it was assigned to
        while isinstance(node, nodes.Filter) and node.node is not None:
            node = node.node
        return ((isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content")
                or (isinstance(node, nodes.Getattr) and node.attr == "content")
                or (isinstance(node, nodes.Name) and node.name in names))

    for assign in ast.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and content(assign.node):
            names.add(assign.target.name)
    return "openai" if any(content(loop.iter) for loop in ast.find_all(nodes.For)) else "string"


__all__ = ["CONTENT_FORMATS", "PartedMessage", "as_format", "resolve", "template_format"]
