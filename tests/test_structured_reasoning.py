"""Structured outputs behind a reasoning parser (``StructuredOutputsParams(reasoning_parser=...)``, vLLM's
``structured_outputs_config.reasoning_parser``): the sample thinks freely and the grammar holds only the answer after
``</think>``. The gate is tested on a vocabulary built for it (the marker whole, split, and in tokens that carry the
answer's first characters after it), then through ``kvload.LLM`` with a scripted model, drafts included."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import kvload
from engine.reasoning import split_reasoning
from kvload import SamplingParams, StructuredOutputsParams
from pipeline.errors import GenerationError
from tests.cli_support import read_events, run_cli
from tests.llm_support import llm_kwargs
from tests.serve_support import Script
from tests.text_support import bytelevel_checkpoint

pytest.importorskip("xgrammar")

#: Tokens past the byte alphabet: the marker whole and in pieces, and marker endings that carry the answer's start.
EXTRA = ["</th", "ink>", "ink>{", "ink>Ċ{", "ink>x", "</think>", "<think>", '{"', "nk>"]
OBJECT = StructuredOutputsParams(json={"type": "object"}, reasoning_parser="deepseek_r1")


@pytest.fixture(scope="module")
def vocab():
    """A byte-level vocabulary: every byte, then :data:`EXTRA` (Ċ is a newline, as GPT-2's byte alphabet writes it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = {"</s>": 0}
    for ch in [*sorted(pre_tokenizers.ByteLevel.alphabet()), *EXTRA]:
        ids[ch] = len(ids)
    tok = Tokenizer(models.BPE(vocab=ids, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return SimpleNamespace(ids=ids, tokenizer=PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>"))


@pytest.fixture(scope="module")
def backend(vocab):
    from engine.structured import GrammarBackend

    return GrammarBackend(vocab.tokenizer, len(vocab.ids), [0])


def allowed(backend, constraint, drafts=(), rows=1) -> list[set[int]]:
    """The tokens each of ``rows`` logits rows keeps after :func:`~engine.structured.constrain`."""
    from engine.structured import constrain

    logits = torch.zeros(rows, backend.vocab_size)
    out = constrain(logits, logits, [rows], [(constraint, list(drafts))], backend)
    return [set(torch.nonzero(out[j] > float("-inf")).flatten().tolist()) for j in range(rows)]


def names(vocab, tokens) -> set[str]:
    by_id = {i: name for name, i in vocab.ids.items()}
    return {by_id[t] for t in tokens}


def feed(vocab, constraint, *pieces: str) -> None:
    for piece in pieces:
        assert not constraint.advance(vocab.ids[piece])


def test_the_thinking_runs_free_and_the_grammar_holds_from_a_marker_split_across_tokens(vocab, backend):
    everything = set(range(len(vocab.ids)))
    held = backend.constraint(StructuredOutputsParams(json={"type": "object"}))
    assert names(vocab, allowed(backend, held)[0]) == {"{", '{"'}  # without the gate: JSON from the first token
    gated, other = backend.constraint(OBJECT), backend.constraint(OBJECT)
    assert allowed(backend, gated)[0] == everything  # thinking: "x", "<b>", anything
    feed(vocab, gated, "x", "<", "/", "t", "h", "i", "n", "k")
    assert gated.gate is not None and allowed(backend, gated)[0] == everything  # ">{" too: "{" begins an object
    feed(vocab, gated, ">")
    assert gated.gate is None  # the thinking ended: the grammar holds the answer from its first character
    assert names(vocab, allowed(backend, gated)[0]) == {"{", '{"'}
    assert allowed(backend, other)[0] == everything  # each sample has its own gate
    feed(vocab, gated, "{", "}")
    assert gated.advance(0)  # complete: its end-of-sequence token ends the sample


def test_the_token_that_ends_the_thinking_hands_the_characters_after_the_marker_to_the_grammar(vocab, backend):
    gated = backend.constraint(OBJECT)
    feed(vocab, gated, "</th")
    row = names(vocab, allowed(backend, gated)[0])
    # "ink>{" ends the thinking and begins the object; "ink>\n{" and "ink>x" would begin the answer with what no JSON
    # object begins with, so they are masked while the thinking is free
    assert {"ink>", "ink>{", "x", "<"} <= row and not {"ink>Ċ{", "ink>x"} & row
    feed(vocab, gated, "ink>{")
    assert gated.gate is None
    after = names(vocab, allowed(backend, gated)[0])
    assert '"' in after and "}" in after and "{" not in after  # the grammar took the "{"
    whole = backend.constraint(OBJECT)
    feed(vocab, whole, "</think>")  # the marker as one token, nothing after it
    assert whole.gate is None and names(vocab, allowed(backend, whole)[0]) == {"{", '{"'}


QWEN3 = StructuredOutputsParams(json={"type": "object"}, reasoning_parser="qwen3")
#: The tokens a qwen3 reply may begin with under a JSON object: <think> (whole or begun, after whitespace) or the
#: grammar's first tokens; Ġ Ċ ĉ č are space, newline, tab and carriage return in GPT-2's byte alphabet.
QWEN3_START = {"<think>", "<", "Ġ", "Ċ", "ĉ", "č", "{", '{"'}


def test_qwen3_holds_the_grammar_back_only_after_a_think_the_model_wrote(vocab, backend):
    gated = backend.constraint(QWEN3)
    feed(vocab, gated, "<think>", "x", "</think>")
    assert gated.gate is None and names(vocab, allowed(backend, gated)[0]) == {"{", '{"'}
    spaced = backend.constraint(QWEN3)
    feed(vocab, spaced, "Ċ", "<", "t")  # whitespace, then <think> begun: still undecided, only <think> can go on
    assert spaced.gate is not None and names(vocab, allowed(backend, spaced)[0]) == {"h"}
    feed(vocab, spaced, "h", "i", "n", "k", ">")
    assert spaced.gate is not None and len(allowed(backend, spaced)[0]) == len(vocab.ids)  # thinking: free


def test_qwen3_reply_without_think_is_content_the_grammar_holds_from_its_first_character(vocab, backend):
    gated = backend.constraint(QWEN3)
    # the start: <think> or what the grammar begins with; "x", "</think>" and the end-of-sequence token would be
    # content that no JSON object is
    assert names(vocab, allowed(backend, gated)[0]) == QWEN3_START
    feed(vocab, gated, "{")  # no <think> can come of it: the reply is content, held from its first character
    assert gated.gate is None
    after = names(vocab, allowed(backend, gated)[0])
    assert '"' in after and "}" in after and "<" not in after and "x" not in after
    feed(vocab, gated, "}")
    assert gated.advance(0)  # complete: its end-of-sequence token ends the sample
    spaced = backend.constraint(QWEN3)
    feed(vocab, spaced, "Ċ")  # whitespace may still come before <think>; as content it is the grammar's to take
    assert names(vocab, allowed(backend, spaced)[0]) == {"<think>", "<", "Ġ", "Ċ", "ĉ", "č"}
    begun = backend.constraint(QWEN3)
    feed(vocab, begun, "<")
    assert names(vocab, allowed(backend, begun)[0]) == {"t"}  # "<x" would be content no JSON object begins with
    free = backend.constraint(StructuredOutputsParams(regex=r"[a-z<>/]+", reasoning_parser="qwen3"))
    feed(vocab, free, "<", "x")  # the grammar takes "<x": content from its first character
    assert free.gate is None and vocab.ids[">"] in allowed(backend, free)[0]
    with pytest.raises(RuntimeError, match="not allowed by the grammar"):
        free.advance(vocab.ids["{"])


def test_qwen3_drafts_at_the_start_are_masked_row_by_row_and_change_nothing(vocab, backend):
    ids = vocab.ids
    gated = backend.constraint(QWEN3)
    rows = allowed(backend, gated, [ids["{"], ids['"'], ids["a"]], rows=4)
    assert names(vocab, rows[0]) == QWEN3_START
    assert '"' in names(vocab, rows[1]) and "{" not in names(vocab, rows[1])  # the grammar's, after "{"
    assert ids["x"] in rows[2] and ids["Ċ"] not in rows[2]  # inside the key the drafts opened
    thinking = allowed(backend, gated, [ids["<"], ids["t"], ids["h"], ids["i"], ids["n"], ids["k"], ids[">"]],
                       rows=8)
    assert [names(vocab, r) for r in thinking[1:3]] == [{"t"}, {"h"}] and len(thinking[7]) == len(ids)
    refused = allowed(backend, gated, [ids["x"], ids["a"]], rows=3)
    assert ids["x"] not in refused[0] and len(refused[1]) == len(ids)  # stops at the refused draft: not written
    assert gated.gate.pending == "" and gated.gate.reader.key == backend.constraint(QWEN3).gate.reader.key


def test_drafts_across_the_marker_are_masked_row_by_row_and_change_nothing(vocab, backend):
    ids = vocab.ids
    gated = backend.constraint(OBJECT)
    before = gated.gate.reader.key
    rows = allowed(backend, gated, [ids["</th"], ids["ink>"], ids['{"']], rows=4)
    assert len(rows[0]) == len(ids)  # thinking
    assert not {ids["ink>Ċ{"], ids["ink>x"]} & rows[1] and ids["x"] in rows[1]  # the marker may end: tails checked
    assert names(vocab, rows[2]) == {"{", '{"'}  # after the drafts that end the thinking: the grammar's first row
    assert ids["x"] in rows[3] and ids["Ċ"] not in rows[3]  # inside the key the draft opened: a raw newline is not
    assert gated.gate.reader.key == before  # the drafts were tried, not taken
    refused = allowed(backend, gated, [ids["</th"], ids["ink>x"], ids["a"]], rows=4)
    assert ids["ink>x"] not in refused[1]  # the refused draft is masked out of its own row: verification stops there
    assert len(refused[2]) == len(refused[3]) == len(ids)  # the rows after it are not written


def test_a_reasoning_parser_kvload_does_not_have_is_one_line():
    with pytest.raises(GenerationError, match=r"^generate: structured_outputs\.reasoning_parser: expected one of "
                                              r"deepseek_r1, qwen3 .*got 'granite'$"):
        StructuredOutputsParams(regex="a", reasoning_parser="granite")
    assert OBJECT.to_dict() == {"json": {"type": "object"}, "reasoning_parser": "deepseek_r1"}
    assert OBJECT.describe()["reasoning_parser"] == "deepseek_r1"


def test_a_requests_reasoning_parser_takes_tensorrt_llms_spelling_as_the_engine_wide_one_does():
    """TensorRT-LLM's ``deepseek-r1`` (any case) is kvload's ``deepseek_r1`` per request too, as ``kvload.LLM`` and
    ``--reasoning_parser`` take it: kept, described and sent under kvload's name; an unknown name is still refused."""
    for spelled in ("deepseek-r1", "DeepSeek-R1"):
        params = StructuredOutputsParams(json={"type": "object"}, reasoning_parser=spelled)
        assert params == OBJECT and params.reasoning_parser == "deepseek_r1"
        assert params.to_dict() == OBJECT.to_dict() and params.describe()["reasoning_parser"] == "deepseek_r1"
    with pytest.raises(GenerationError, match=r"got 'deepseek-r2'$"):
        StructuredOutputsParams(regex="a", reasoning_parser="deepseek-r2")


THOUGHT = "Say {not json} <b>here</b>; then answer."
ANSWER = '{"sky": "blue"}'
SCHEMA = {"type": "object", "properties": {"sky": {"type": "string"}}, "required": ["sky"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def bytes_ckpt(tiny_checkpoints, tmp_path_factory):
    return bytelevel_checkpoint(tiny_checkpoints("llama"), tmp_path_factory.mktemp("think") / "ckpt")


def scripted(ckpt, **kw):
    llm = kvload.LLM(str(ckpt), **{**llm_kwargs(), "max_seq_len": 256, **kw})
    return llm, Script(SimpleNamespace(executor=llm.result.executor, tokenizer=llm.get_tokenizer()))


def test_llm_generate_thinks_freely_then_answers_in_the_schema(bytes_ckpt):
    so = StructuredOutputsParams(json=SCHEMA, reasoning_parser="deepseek_r1")
    llm, script = scripted(bytes_ckpt)
    with llm:
        script.say(THOUGHT + "</think>" + ANSWER)
        (out,) = llm.generate("Hello", SamplingParams(structured_outputs=so, max_tokens=80))[0].outputs
        assert out.text == THOUGHT + "</think>" + ANSWER and out.finish_reason == "stop"
        assert split_reasoning("deepseek_r1", out.text) == (THOUGHT, ANSWER)
        script.say(THOUGHT + "</think>Blue.")  # an answer outside the schema: the grammar holds it
        (out,) = llm.generate("Hello", SamplingParams(structured_outputs=so, max_tokens=60))[0].outputs
        reasoning, content = split_reasoning("deepseek_r1", out.text)
        assert reasoning == THOUGHT and content.startswith('{"sky"')
        if out.finish_reason == "stop":
            assert set(json.loads(content)) == {"sky"}
        (cut,) = llm.generate("Hello", SamplingParams(structured_outputs=so, max_tokens=5))[0].outputs
        assert cut.finish_reason == "length" and split_reasoning("deepseek_r1", cut.text) == (cut.text, None)
        record = llm.audit.of("generation_started")[-1]["structured_outputs"]
        assert record["reasoning_parser"] == "deepseek_r1"


def test_llms_reasoning_parser_is_the_default_of_requests_structured_outputs(bytes_ckpt):
    """vLLM's engine-wide ``LLM(reasoning_parser=...)``: it was reported ignored (as a TensorRT-LLM decoding option), so
    the grammar held the thinking from the first character; now a request naming no parser of its own thinks freely."""
    plain = StructuredOutputsParams(json=SCHEMA)
    llm, script = scripted(bytes_ckpt, reasoning_parser="deepseek_r1")
    with llm:
        assert not [e for e in llm.audit.events if e["event"] == "setting_ignored" and e["field"] == "reasoning_parser"]
        script.say(THOUGHT + "</think>" + ANSWER)
        params = SamplingParams(structured_outputs=plain, max_tokens=80)
        (out,) = llm.generate("Hello", params)[0].outputs
        assert out.text == THOUGHT + "</think>" + ANSWER and out.finish_reason == "stop"
        assert llm.audit.of("generation_started")[-1]["structured_outputs"]["reasoning_parser"] == "deepseek_r1"
        assert params.structured_outputs.reasoning_parser is None  # the caller's SamplingParams stay as given
        own = StructuredOutputsParams(json=SCHEMA, reasoning_parser="qwen3")  # a request's own parser wins
        script.say(ANSWER)
        llm.generate("Hello", SamplingParams(structured_outputs=own, max_tokens=60))
        assert llm.audit.of("generation_started")[-1]["structured_outputs"]["reasoning_parser"] == "qwen3"


def test_llms_unknown_reasoning_parser_is_one_line_before_loading():
    with pytest.raises(ValueError) as err:
        kvload.LLM("tiny-llama", **llm_kwargs(), reasoning_parser="granite")
    assert str(err.value) == "reasoning_parser: expected one of deepseek_r1, qwen3 (or None), got 'granite'"


def test_a_config_files_reasoning_parser_acts_as_the_keyword_and_the_keyword_beats_it(bytes_ckpt, tmp_path):
    """A config file's ``reasoning_parser`` was reported ignored ("a plan or load runs no requests") while the keyword
    acted: now it is requests' default parser too, and the keyword beats it as it beats the file's other fields."""
    config = tmp_path / "llm.yaml"
    config.write_text("reasoning_parser: deepseek_r1\n")
    plain = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA), max_tokens=80)
    llm, script = scripted(bytes_ckpt, config_file=str(config))
    with llm:
        assert not [e for e in llm.audit.events if e["event"] == "setting_ignored" and e["field"] == "reasoning_parser"]
        script.say(THOUGHT + "</think>" + ANSWER)
        (out,) = llm.generate("Hello", plain)[0].outputs
        assert out.text == THOUGHT + "</think>" + ANSWER and out.finish_reason == "stop"
        assert llm.audit.of("generation_started")[-1]["structured_outputs"]["reasoning_parser"] == "deepseek_r1"
    llm, script = scripted(bytes_ckpt, config_file=str(config), reasoning_parser="qwen3")
    with llm:
        (conflict,) = [e for e in llm.audit.of("source_conflict") if e["field"] == "reasoning_parser"]
        assert (conflict["kept"], conflict["kept_source"]) == ("qwen3", "api")
        assert (conflict["overridden"], conflict["overridden_source"]) == ("deepseek_r1", "config_file")
        script.say(ANSWER)
        llm.generate("Hello", plain)
        assert llm.audit.of("generation_started")[-1]["structured_outputs"]["reasoning_parser"] == "qwen3"
    said = [e["reason"] for e in kvload.plan("tiny-llama", config_file=str(config), log=False).audit.events
            if e["event"] == "setting_ignored" and e["field"] == "reasoning_parser"]  # a plan still runs no requests
    assert len(said) == 1 and said[0].startswith("a plan or load runs no requests")


def test_a_config_files_unknown_reasoning_parser_is_one_line_naming_the_file(tmp_path):
    config = tmp_path / "llm.yaml"
    config.write_text("reasoning_parser: granite\n")
    with pytest.raises(ValueError) as err:
        kvload.LLM("tiny-llama", **llm_kwargs(), config_file=str(config))
    assert str(err.value) == (f"config file {config}: reasoning_parser: expected one of deepseek_r1, qwen3 (or null), "
                              "got 'granite'")


def test_a_plans_reasoning_parser_says_it_acts_at_generation_not_that_kvload_lacks_it():
    """It said "a TensorRT-LLM option kvload does not act on: decoding feature kvload's sampler does not have"."""
    said = [e["reason"] for e in kvload.plan("tiny-llama", reasoning_parser="qwen3", log=False).audit.events
            if e["event"] == "setting_ignored" and e["field"] == "reasoning_parser"]
    assert len(said) == 1 and said[0].startswith("a plan or load runs no requests")
    assert "kvload.LLM(reasoning_parser=...)" in said[0] and "StructuredOutputsParams(" in said[0]


def test_llm_generate_under_qwen3_holds_a_reply_without_think_to_the_schema(bytes_ckpt):
    so = StructuredOutputsParams(json=SCHEMA, reasoning_parser="qwen3")
    llm, script = scripted(bytes_ckpt)
    with llm:
        script.say(ANSWER + " Blue, I said.")  # no <think>, and text after the object that no schema takes
        (out,) = llm.generate("Hello", SamplingParams(structured_outputs=so, max_tokens=60))[0].outputs
        reasoning, content = split_reasoning("qwen3", out.text)
        assert reasoning is None and out.finish_reason == "stop"
        assert json.loads(content) == json.loads(ANSWER)  # what was drawn parses
        script.say("Blue.")  # not JSON from its first character: "B" is neither <think> nor the schema's start
        (out,) = llm.generate("Hello", SamplingParams(structured_outputs=so, max_tokens=60))[0].outputs
        assert out.text.lstrip().startswith(("<think>", "{"))  # it thought, or the schema held it from the start
        reasoning, content = split_reasoning("qwen3", out.text)
        if reasoning is None and out.finish_reason == "stop":
            assert set(json.loads(content)) == {"sky"}


@pytest.mark.parametrize("after", ["", "\n"])  # "\n" after the marker: no JSON object begins with it, so masked
def test_speculative_drafts_across_the_marker_give_the_tokens_of_one_token_a_step(bytes_ckpt, after):
    so = StructuredOutputsParams(json=SCHEMA, reasoning_parser="deepseek_r1")
    text = THOUGHT + "</think>" + after + ANSWER
    outs, stats = [], None
    for draft in (0, 4):
        llm, script = scripted(bytes_ckpt, max_draft_len=draft)
        with llm:
            script.say(text)
            # the prompt holds the reply, so the n-gram drafts guess it, across the marker too
            (out,) = llm.generate(text, SamplingParams(structured_outputs=so, max_tokens=60))[0].outputs
            outs.append(out)
            stats = llm.last_stats
    assert outs[0].token_ids == outs[1].token_ids and stats.accepted_draft_tokens > 0
    reasoning, content = split_reasoning("deepseek_r1", outs[1].text)
    assert reasoning == THOUGHT and content.startswith("{")
    if not after:
        assert content == ANSWER


# --- kvload generate --reasoning-parser ----------------------------------------------------------------------------


def generate(capsys, monkeypatch, ckpt, reply, *args):
    """``kvload generate`` in this process with its model scripted to write ``reply``."""
    import contextlib

    import kvload.api

    real = kvload.api.execute

    @contextlib.contextmanager
    def scripted(*a, **kw):
        with real(*a, **kw) as result:
            Script(SimpleNamespace(executor=result.executor, tokenizer=result.tokenizer)).say(reply)
            yield result

    def scripted_execute(request, stages, *a, **kw):  # the load; not the launcher's check of the ranks to start first
        listed = stages.stages if hasattr(stages, "stages") else stages
        loads = any(getattr(stage, "name", None) == "load_weights" for stage in listed)
        return (scripted if loads else real)(request, stages, *a, **kw)

    monkeypatch.setattr("kvload.api.execute", scripted_execute)
    return run_cli(capsys, "generate", ckpt, "--prompt", "Hello", "--max_new_tokens", "60", "--device", "cpu",
                   "--max_seq_len", "256", "--max_tokens", "1024", *args)


def test_generate_reasoning_parser_flag_lets_the_model_think_and_holds_its_answer_to_the_schema(
        capsys, monkeypatch, bytes_ckpt, tmp_path):
    audit = tmp_path / "gen.jsonl"
    r = generate(capsys, monkeypatch, bytes_ckpt, THOUGHT + "</think>Blue.", "--json-schema", json.dumps(SCHEMA),
                 "--reasoning-parser", "deepseek_r1", "--json", "--audit-log", audit)
    assert r.code == 0, r.err
    (out,) = r.json()["outputs"][0]["outputs"]
    reasoning, content = split_reasoning("deepseek_r1", out["text"])
    assert reasoning == THOUGHT and content.startswith('{"sky"')  # thought freely; "Blue." was held to the schema
    started = next(e for e in read_events(audit) if e["event"] == "generation_started")
    assert started["structured_outputs"]["reasoning_parser"] == "deepseek_r1"


def test_generate_reasoning_parser_prints_the_thinking_and_the_answer_apart(capsys, monkeypatch, bytes_ckpt):
    r = generate(capsys, monkeypatch, bytes_ckpt, THOUGHT + "</think>Blue.", "--reasoning-parser", "deepseek_r1")
    assert r.code == 0, r.err
    assert r.out.splitlines()[:2] == [f"reasoning: {THOUGHT}", "content: Blue."]  # streamed, markers in neither
    assert "setting_ignored" not in r.err  # the flag acts without a structured flag too
    r = generate(capsys, monkeypatch, bytes_ckpt, THOUGHT + "</think>Blue.", "--reasoning_parser", "qwen3")
    assert r.out.splitlines()[0] == f"content: {THOUGHT}</think>Blue."  # qwen3: no <think> written, all content
    r = generate(capsys, monkeypatch, bytes_ckpt, "<think>" + THOUGHT, "--reasoning-parser", "qwen3",
                 "--prompt", "Again")
    assert r.code == 0, r.err  # several prompts: each reply's parts on their own labelled lines
    assert r.out.splitlines()[:4] == [f"[0] reasoning: {THOUGHT}", "[0] content:", f"[1] reasoning: {THOUGHT}",
                                      "[1] content:"]


def test_generate_json_gives_the_thinking_and_the_answer_under_the_chat_replys_names(capsys, monkeypatch, bytes_ckpt):
    r = generate(capsys, monkeypatch, bytes_ckpt, THOUGHT + "</think>Blue.", "--reasoning-parser", "deepseek_r1",
                 "--json")
    assert r.code == 0, r.err
    (out,) = r.json()["outputs"][0]["outputs"]
    assert out["text"] == THOUGHT + "</think>Blue."  # the reply as the model wrote it, as without the flag
    assert (out["reasoning_content"], out["reasoning"], out["content"]) == (THOUGHT, THOUGHT, "Blue.")
    r = generate(capsys, monkeypatch, bytes_ckpt, THOUGHT, "--reasoning-parser", "deepseek_r1", "--json")
    (out,) = r.json()["outputs"][0]["outputs"]  # the thinking never ended: no answer
    assert (out["reasoning_content"], out["content"]) == (THOUGHT, None)
    r = generate(capsys, monkeypatch, bytes_ckpt, THOUGHT, "--json")
    assert "reasoning_content" not in r.json()["outputs"][0]["outputs"][0]  # without the flag: vLLM's fields only


def test_generate_reasoning_parser_on_a_model_without_a_tokenizer_says_it_is_ignored(capsys, tiny_checkpoints):
    r = run_cli(capsys, "generate", tiny_checkpoints("llama"), "--prompt-ids", "1,2,3", "--max_new_tokens", "3",
                "--device", "cpu", "--max_tokens", "256", "--reasoning-parser", "deepseek_r1")
    assert r.code == 0, r.err
    assert len(r.out.splitlines()[0].split()) == 3  # the token ids, as without the flag
    (line,) = [x for x in r.err.splitlines() if "setting_ignored" in x]
    assert "--reasoning-parser" in line and "no tokenizer" in line


def test_generate_refuses_a_reasoning_parser_kvload_does_not_have_in_one_line(capsys, bytes_ckpt):
    r = run_cli(capsys, "generate", bytes_ckpt, "--prompt", "Hi", "--regex", "a", "--reasoning-parser", "granite")
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err == "error: --reasoning-parser: no reasoning parser 'granite' in kvload; it has: deepseek_r1, qwen3\n"


def test_generate_takes_a_config_files_reasoning_parser_as_the_flag(capsys, monkeypatch, bytes_ckpt, tmp_path):
    """``kvload generate --config f.yaml`` with ``reasoning_parser:`` in it reported it ignored ("a plan or load runs
    no requests") and printed the reply whole; now it acts as ``--reasoning-parser`` does, which beats it."""
    config = tmp_path / "gen.yaml"
    config.write_text("reasoning_parser: deepseek_r1\n")
    r = generate(capsys, monkeypatch, bytes_ckpt, THOUGHT + "</think>Blue.", "--config", config)
    assert r.code == 0, r.err
    assert r.out.splitlines()[:2] == [f"reasoning: {THOUGHT}", "content: Blue."]
    assert "setting_ignored" not in r.err and "source_conflict" not in r.err, r.err
    audit = tmp_path / "schema.jsonl"  # the structured output's grammar holds only the answer, as under the flag
    r = generate(capsys, monkeypatch, bytes_ckpt, THOUGHT + "</think>Blue.", "--config", config, "--json-schema",
                 json.dumps(SCHEMA), "--json", "--audit-log", audit)
    assert r.code == 0, r.err
    (out,) = r.json()["outputs"][0]["outputs"]
    assert out["reasoning_content"] == THOUGHT and out["content"].startswith('{"sky"')
    started = next(e for e in read_events(audit) if e["event"] == "generation_started")
    assert started["structured_outputs"]["reasoning_parser"] == "deepseek_r1"
    audit = tmp_path / "both.jsonl"
    r = generate(capsys, monkeypatch, bytes_ckpt, THOUGHT + "</think>Blue.", "--config", config,
                 "--reasoning-parser", "qwen3", "--audit-log", audit)
    assert r.code == 0, r.err
    assert r.out.splitlines()[0] == f"content: {THOUGHT}</think>Blue."  # the flag's qwen3: no <think>, all content
    (conflict,) = [e for e in read_events(audit) if e["event"] == "source_conflict"]
    assert (conflict["field"], conflict["kept"], conflict["kept_source"], conflict["overridden"],
            conflict["overridden_source"]) == ("reasoning_parser", "qwen3", "cli", "deepseek_r1", "config_file")
    assert not [e for e in read_events(audit) if e["event"] == "setting_ignored"]


def test_a_config_files_reasoning_parser_on_a_model_without_a_tokenizer_is_said_ignored_under_its_key(
        capsys, tiny_checkpoints, tmp_path):
    config = tmp_path / "gen.yaml"
    config.write_text("reasoning_parser: qwen3\n")
    r = run_cli(capsys, "generate", tiny_checkpoints("llama"), "--prompt-ids", "1,2,3", "--max_new_tokens", "3",
                "--device", "cpu", "--max_tokens", "256", "--config", config)
    assert r.code == 0, r.err
    (line,) = [x for x in r.err.splitlines() if "setting_ignored" in x]
    assert "field=reasoning_parser " in line and "no tokenizer" in line and "runs no requests" not in line, line
