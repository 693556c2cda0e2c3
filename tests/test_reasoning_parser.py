"""The ``deepseek_r1`` and ``qwen3`` reasoning parsers (``kvload serve --reasoning-parser NAME``) as a unit: a chat
reply split into its thinking and its answer at ``<think>`` / ``</think>``, the markers never shown, and a stream
read in any pieces gives what the whole reply gives. The request side: which chat replies are split, and the grammar
requests refused on them in a line naming the field and the flag."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.reasoning import END, START, ReasoningText, split_reasoning
from kvload.serve.protocol import BadRequest, parse
from tests.text_support import pieces


def streamed(parser: str, text: str, cuts: list[int]) -> tuple[str, str]:
    """``text`` fed in pieces of the ``cuts`` sizes (cycled; 0: an empty piece): the reasoning and content a stream
    sends, joined."""
    reader = ReasoningText(parser)
    reasoning, content = [], []
    for piece in pieces(text, cuts):
        r, c = reader.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = reader.finish()
    return "".join(reasoning) + r, "".join(content) + c


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("<think>Two and two.</think>It is 4.", "Two and two.", "It is 4."),
    ("Two and two.</think>\n\nIt is 4.", "Two and two.", "\n\nIt is 4."),  # <think> was in the prompt
    ("Two and two, so", "Two and two, so", None),  # never closed (cut by max_tokens): all thinking, vLLM's
    ("Done.</think>", "Done.", None),  # nothing after it: content null, vLLM's
    ("", "", None),
    ("<think></think>It is 4.", "", "It is 4."),
    ("Hm.\n<think>Two.</think>4", "Hm.\nTwo.", "4"),  # text before a <think> the model writes stays thinking
    ("a</think>b<think>c</think>d", "a", "b<think>c</think>d"),  # after the first </think>, all answer, as written
    ("a<think>b<think>c</think>d", "ab<think>c", "d"),  # only the first <think> opens
])
def test_deepseek_r1_is_thinking_up_to_the_first_end_marker(text, reasoning, content):
    assert split_reasoning("deepseek_r1", text) == (reasoning, content)


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("<think>Two and two.</think>It is 4.", "Two and two.", "It is 4."),
    ("It is 4.", None, "It is 4."),  # no <think>: no thinking, all content (enable_thinking false writes none)
    ("", None, ""),
    ("Two and two.</think>It is 4.", None, "Two and two.</think>It is 4."),  # no <think>: as written
    ("<think>Two and two, so", "Two and two, so", None),  # opened, never closed (cut short): thinking, as streamed
    ("<think>Two.</think>", "Two.", None),
    ("\n<think>Two.</think>\n4", "Two.", "\n\n4"),  # text before <think> is content
])
def test_qwen3_is_thinking_only_from_a_start_marker_the_model_writes(text, reasoning, content):
    assert split_reasoning("qwen3", text) == (reasoning, content)


def deepseek_r1(text: str) -> tuple[str | None, str | None]:
    """The oracle: everything up to the first ``</think>`` (less a ``<think>`` there) is thinking, the rest content."""
    head, end, tail = text.partition(END)
    return head.replace(START, "", 1), (tail or None) if end else None


def qwen3(text: str) -> tuple[str | None, str | None]:
    """The oracle: no ``<think>``, no thinking; else thinking from it up to the next ``</think>``."""
    before, start, rest = text.partition(START)
    if not start:
        return None, text
    reasoning, _, after = rest.partition(END)
    return reasoning, before + after or None


#: Reply text made of what could be mistaken for a marker: pieces of both, "<", "/", ">", and plain characters.
_TEXT = st.lists(st.sampled_from([START, END, "<", "</", "<th", "</thi", "think", ">", "/", "nk>", "x", " ", "\n", "é",
                                  "🙂"]), max_size=12).map("".join)


@settings(max_examples=400, deadline=None)
@given(text=_TEXT, cuts=st.lists(st.integers(0, 9), min_size=1).filter(any),
       parser=st.sampled_from(["deepseek_r1", "qwen3"]))
def test_any_reply_read_whole_or_in_any_pieces_splits_as_the_parser_says(text, cuts, parser):
    """Whole, the reply splits as the oracle's ``str.partition`` does; streamed in any pieces, the reasoning and
    content sent are exactly the whole reply's (a marker cut between pieces is held, never sent as text)."""
    reasoning, content = split_reasoning(parser, text)
    assert (reasoning, content) == (deepseek_r1 if parser == "deepseek_r1" else qwen3)(text)
    assert streamed(parser, text, cuts) == (reasoning or "", content or "")


def answer_after_thinking(parser: str, text: str) -> str | None:
    """The oracle of where the thinking ends: the text after the first ``</think>`` (qwen3: after a ``<think>``)."""
    if parser == "qwen3":
        at = text.find(START)
        if at < 0:
            return None
        text = text[at + len(START):]
    _, marker, answer = text.partition(END)
    return answer if marker else None


@settings(max_examples=400, deadline=None)
@given(text=_TEXT, cuts=st.lists(st.integers(0, 9), min_size=1).filter(any),
       parser=st.sampled_from(["deepseek_r1", "qwen3"]))
def test_a_reply_read_piece_by_piece_from_forks_ends_its_thinking_where_the_parser_does(text, cuts, parser):
    """What a structured output's gate relies on: each piece read by a fork of the reader before it (the reader it
    forked from unchanged), the thinking ends at the piece the parser ends it in, and the answers read from then on
    are the text after the marker, exactly."""
    reader, answer, at = ReasoningText(parser), None, 0
    for cut in [*cuts, len(text)]:
        piece, at = text[at:at + cut], at + cut
        before = reader.key
        after = reader.fork()
        after.feed(piece)
        assert reader.key == before
        if after.ended:
            answer = (answer or "") + after.answer
        reader = after
        if at >= len(text):
            break
    assert answer == answer_after_thinking(parser, text)
    whole = ReasoningText(parser)
    before_text, _, after_text = (a + b for a, b in zip(whole.read(text), whole.finish_read(), strict=True))
    assert whole.answer == after_text == (answer or "") and whole.ended == (answer is not None)
    assert before_text + after_text == (split_reasoning(parser, text)[1] or "")  # the content, in its two places


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_stream_sends_text_at_once_and_holds_only_what_may_become_a_marker(parser):
    reader = ReasoningText(parser)
    if parser == "qwen3":
        assert reader.feed("<thi") == ("", "")  # may be <think>
        assert reader.feed("nk>") == ("", "")
    assert reader.feed("Two and") == ("Two and", "")
    assert reader.feed(" two <") == (" two ", "")  # "<" may begin </think>
    assert reader.feed("b>") == ("<b>", "")
    assert reader.feed("</th") == ("", "")
    assert reader.feed("ink>It is") == ("", "It is")
    assert reader.feed(" 4 </th") == ("", " 4 </th")  # the answer's own text, as written
    assert reader.finish() == ("", "")
    held = ReasoningText(parser)
    held.feed("<think>Cut </thi")
    assert held.finish() == ("</thi", "")  # the reply ended: what was held is thinking's text


def job(body: dict, parser: str | None = "deepseek_r1", kind: str = "chat", tools: str | None = None):
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else \
        {"model": "m", "prompt": "hi"}
    return parse({**base, **body}, kind, default_max_tokens=16, reasoning_parser=parser, tool_parser=tools)


TOOLS = [{"type": "function", "function": {"name": "get_time"}}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


def test_chat_replies_are_split_and_completions_are_not():
    assert job({}).reasoning == "deepseek_r1" and job({}, "qwen3").reasoning == "qwen3"
    assert job({}, None).reasoning is None
    assert job({}, kind="completion").reasoning is None  # vLLM splits chat only
    assert job(OFF, "qwen3").reasoning is None  # Qwen3's switch: a plain answer
    assert job(OFF).reasoning == "deepseek_r1"  # deepseek_r1 reads no switch (as vLLM's)
    assert job({"chat_template_kwargs": {"enable_thinking": 0}}, "qwen3").reasoning == "qwen3"  # the template's test
    auto = job({"tools": TOOLS}, tools="hermes")
    assert auto.reasoning == "deepseek_r1" and auto.auto_tools is not None  # calls read from the answer


@pytest.mark.parametrize(("body", "field"), [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
])
@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_grammar_on_a_reply_that_thinks_holds_only_the_answer_after_the_thinking(body, field, parser):
    """vLLM's gate: the thinking runs free and the grammar holds what follows it. Once a 400 (kvload could not gate
    the grammar); now served with the grammar behind the parser's own end of thinking."""
    served = job(body, parser)
    assert served.structured_field == field and served.reasoning == parser
    assert served.params.structured_outputs.reasoning_parser == parser
    assert job(body, None).params.structured_outputs.reasoning_parser is None  # without the parser: all of it
    if field != "tool_choice":  # completions are not split: their grammar holds the whole text
        assert job(body, kind="completion").params.structured_outputs.reasoning_parser is None
    if parser == "qwen3":  # no thinking: the grammar holds the whole answer, as without the parser
        assert job({**body, **OFF}, parser).params.structured_outputs.reasoning_parser is None
    with pytest.raises(BadRequest) as info:  # a client cannot ask for a gate itself (vLLM's requests have none)
        job({"structured_outputs": {"regex": "a", "reasoning_parser": parser}}, None)
    assert info.value.message.startswith("structured_outputs.reasoning_parser: not supported by kvload serve")
