"""vLLM's newer front door habits on ``kvload.LLM`` (habits42's audit against vllm/entrypoints/llm.py and
vllm/sampling_params.py): ``tokenization_kwargs={"truncate_prompt_tokens": k}`` (where vLLM now takes the prompt cut),
``reset_prefix_cache``'s arguments, ``RequestOutputKind`` / ``output_kind``, ``get_world_size`` and
``reset_mm_cache``: each acts, or is reported ``setting_ignored``, or is one line saying what to do instead."""

from __future__ import annotations

import pytest

import kvload
from engine.sampling_params import SamplingParams
from pipeline.errors import GenerationError
from tests.llm_support import llm_kwargs, with_tokenizer

VOCAB = 512  # the tiny llama's
TEXT = "w5 w17 w300 w42 w9"  # five tokens, no BOS (the word tokenizer adds none)
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w2{% endif %}"


@pytest.fixture(scope="module")
def words(tiny_checkpoints, tmp_path_factory):
    return with_tokenizer(tiny_checkpoints("llama"), tmp_path_factory.mktemp("words") / "ckpt", VOCAB)


@pytest.fixture(scope="module")
def llm(words):
    with kvload.LLM(str(words), **llm_kwargs("v1")) as loaded:
        yield loaded


def ignored(llm) -> dict[str, str]:
    return {e["field"]: e["reason"] for e in llm.audit.of("setting_ignored")}


# --- tokenization_kwargs -------------------------------------------------------------------------


def test_tokenization_kwargs_truncate_prompt_tokens_keeps_each_prompts_last_k_tokens_as_vllm_does(llm):
    """vLLM deprecated ``SamplingParams.truncate_prompt_tokens`` for ``tokenization_kwargs`` (its warning says "pass it
    via tokenization_kwargs"); that call was refused here ("vLLM's argument, not kvload's")."""
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    cut = {"truncate_prompt_tokens": 2}
    (out,) = llm.generate([TEXT], sp, tokenization_kwargs=cut)
    assert out.prompt_token_ids == [42, 9]
    assert out.outputs[0].token_ids == llm.generate([[42, 9]], sp)[0].outputs[0].token_ids
    assert sp.truncate_prompt_tokens is None  # the caller's params stay as given
    outs = llm.generate([TEXT, "w6 w7 w8"], [sp, sp], tokenization_kwargs=cut)
    assert [o.prompt_token_ids for o in outs] == [[42, 9], [7, 8]]
    assert llm.generate([TEXT], max_tokens=1, tokenization_kwargs={"truncate_prompt_tokens": 3})[0] \
        .prompt_token_ids == [300, 42, 9]  # sampling keywords, no SamplingParams
    conv = [{"role": "user", "content": TEXT}]
    (chat,) = llm.chat(conv, sp, chat_template=TEMPLATE, tokenization_kwargs=cut)
    assert chat.prompt_token_ids == [9, 2]  # the templated "w5 ... w9 w2", its last two
    (emb,) = llm.embed([TEXT], tokenization_kwargs=cut)
    assert emb.prompt_token_ids == [42, 9]
    assert llm.generate([TEXT], sp, tokenization_kwargs={})[0].prompt_token_ids == [5, 17, 300, 42, 9]


def test_tokenization_kwargs_at_values_that_ask_for_nothing_are_taken(llm):
    """A script spelling vLLM's defaults out (``add_special_tokens=True`` on a text prompt, False on ``chat``; no
    ``truncation``, no ``max_length``) was refused as if it asked for something kvload does not do."""
    sp = SamplingParams(max_tokens=2)
    noop = {"add_special_tokens": True, "truncation": False, "max_length": None}
    plain = llm.generate([TEXT], sp)[0]
    (out,) = llm.generate([TEXT], sp, tokenization_kwargs=noop)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == (plain.prompt_token_ids, plain.outputs[0].token_ids)
    (cut,) = llm.generate([TEXT], sp, tokenization_kwargs={**noop, "truncation": None, "truncate_prompt_tokens": 2})
    assert cut.prompt_token_ids == [42, 9]
    conv = [{"role": "user", "content": TEXT}]
    (chat,) = llm.chat(conv, sp, chat_template=TEMPLATE,
                       tokenization_kwargs={"add_special_tokens": False, "truncation": False, "max_length": None})
    assert chat.prompt_token_ids == llm.chat(conv, sp, chat_template=TEMPLATE)[0].prompt_token_ids
    (emb,) = llm.embed([TEXT], tokenization_kwargs=noop)
    assert emb.prompt_token_ids == plain.prompt_token_ids


def test_tokenization_kwargs_a_cut_given_twice_or_a_key_kvload_lacks_is_one_line(llm):
    sp = SamplingParams(max_tokens=2)
    with pytest.raises(GenerationError, match=r"^generate: truncate_prompt_tokens: 2 in sampling_params and 3 in "
                                              r"tokenization_kwargs differ; give it once$"):
        llm.generate([TEXT], SamplingParams(truncate_prompt_tokens=2),
                     tokenization_kwargs={"truncate_prompt_tokens": 3})
    with pytest.raises(GenerationError, match=r"^embed: truncate_prompt_tokens: 2 in the call's argument and 1 in "):
        llm.embed([TEXT], truncate_prompt_tokens=2, tokenization_kwargs={"truncate_prompt_tokens": 1})
    with pytest.raises(GenerationError, match=r"^generate: tokenization_kwargs\.add_special_tokens=false: vLLM's, not "
                                              r"kvload's: .*add_special_tokens=False"):
        llm.generate([TEXT], sp, tokenization_kwargs={"add_special_tokens": False})
    with pytest.raises(GenerationError) as chat_special:  # a conversation has no text of the caller's to encode
        llm.chat([{"role": "user", "content": TEXT}], sp, chat_template=TEMPLATE,
                 tokenization_kwargs={"add_special_tokens": True})
    assert str(chat_special.value).startswith("chat: tokenization_kwargs.add_special_tokens=true: vLLM's, not kvload's")
    assert "encode" not in str(chat_special.value)
    with pytest.raises(GenerationError, match=r"^embed: tokenization_kwargs\.nosuch: not a setting kvload's "
                                              r"tokenization takes; kvload acts on tokenization_kwargs' "
                                              r"truncate_prompt_tokens only$"):
        llm.embed([TEXT], tokenization_kwargs={"nosuch": 1})
    with pytest.raises(GenerationError, match=r"^generate: tokenization_kwargs\.add_special_token: not a "
                                              r".*did you mean 'add_special_tokens'\?$"):
        llm.generate([TEXT], sp, tokenization_kwargs={"add_special_token": True})
    with pytest.raises(GenerationError,
                       match=r"^chat: tokenization_kwargs\.truncation=true: .*'truncate_prompt_tokens'"):
        llm.chat([{"role": "user", "content": TEXT}], sp, chat_template=TEMPLATE,
                 tokenization_kwargs={"truncation": True, "max_length": 4})
    with pytest.raises(GenerationError, match=r"^generate: tokenization_kwargs: expected a dict"):
        llm.generate([TEXT], sp, tokenization_kwargs=4)
    with pytest.raises(GenerationError, match=r"^generate: truncate_prompt_tokens: expected an integer >= 1"):
        llm.generate([TEXT], sp, tokenization_kwargs={"truncate_prompt_tokens": 0})


# --- reset_prefix_cache's arguments, get_world_size, reset_mm_cache --------------------------------


def test_reset_prefix_cache_takes_vllms_arguments(words):
    """vLLM's ``reset_prefix_cache(reset_running_requests=False, reset_connector=False)``: a call passing either was a
    TypeError here."""
    with kvload.LLM(str(words), **llm_kwargs("v1")) as llm:
        llm.generate(TEXT * 3, max_tokens=1)
        assert llm.reset_prefix_cache(reset_running_requests=True) is True  # nothing runs between calls: reset alike
        assert llm.reset_prefix_cache(False, False) is True
        assert "LLM.reset_prefix_cache.reset_connector" not in ignored(llm)
        assert llm.reset_prefix_cache(reset_connector=True) is True
        assert "no KV connector" in ignored(llm)["LLM.reset_prefix_cache.reset_connector"]
        assert llm.reset_prefix_cache(reset_connector=True) is True  # a benchmark's reset between runs: said once
        fields = [e["field"] for e in llm.audit.of("setting_ignored")]
        assert fields.count("LLM.reset_prefix_cache.reset_connector") == 1
        assert len(llm.audit.of("prefix_cache_reset")) == 4
        with pytest.raises(GenerationError, match=r"^reset_prefix_cache: reset_running_requests: expected true or "
                                                  r"false, got 'yes'$"):
            llm.reset_prefix_cache("yes")
        with pytest.raises(GenerationError, match=r"^reset_prefix_cache: unknown argument 'reset_conector'"):
            llm.reset_prefix_cache(reset_conector=True)


def test_get_world_size_and_reset_mm_cache_are_there_and_weight_updates_say_what_to_do(words):
    with kvload.LLM(str(words), **llm_kwargs("v1")) as llm:
        assert llm.get_world_size() == 1 and llm.get_world_size(include_dp=False) == 1
        assert llm.reset_mm_cache() is None and llm.reset_mm_cache() is None
        assert [e["field"] for e in llm.audit.of("setting_ignored")] == ["LLM.reset_mm_cache"]  # said once
        assert "no multimodal cache" in ignored(llm)["LLM.reset_mm_cache"]
        with pytest.raises(AttributeError, match=r"^LLM\.update_weights: vLLM's, not kvload's: .*new kvload\.LLM"):
            llm.update_weights({"update_info": {}})


# --- RequestOutputKind --------------------------------------------------------------------------


def test_request_output_kind_imports_and_final_only_is_what_generate_returns(llm):
    """``from vllm.sampling_params import RequestOutputKind`` had no kvload counterpart, and
    ``SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)`` (which vLLM's LLM.generate sets itself) was refused."""
    from kvload.sampling_params import RequestOutputKind

    assert kvload.RequestOutputKind is RequestOutputKind
    plain = SamplingParams(max_tokens=3, ignore_eos=True)
    final = SamplingParams(max_tokens=3, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    assert final == plain == SamplingParams(max_tokens=3, ignore_eos=True, output_kind=RequestOutputKind.CUMULATIVE)
    assert llm.generate([TEXT], final)[0].outputs[0].token_ids == llm.generate([TEXT], plain)[0].outputs[0].token_ids
    plain.output_kind = RequestOutputKind.FINAL_ONLY  # vLLM's LLM.generate sets it so on the params it is given
    with pytest.raises(GenerationError, match=r"^generate: output_kind: vLLM's SamplingParams field, not kvload's: .*"
                                              r"LLM\.generate_stream yields a TokenDelta per token; accepted: "
                                              r"RequestOutputKind\.CUMULATIVE or RequestOutputKind\.FINAL_ONLY"):
        SamplingParams(output_kind=RequestOutputKind.DELTA)


def test_vllms_no_op_fields_read_back_as_given_or_as_vllms_defaults():
    """``params.output_kind`` after ``SamplingParams(output_kind=FINAL_ONLY)`` raised AttributeError: the value was
    taken and dropped. vLLM's fields at values that ask for nothing now read back as given (constructor, attribute
    set, copies and pickles too) and as vLLM's defaults when not given; they stay out of comparison and ``to_dict``,
    and a name that is no field still raises AttributeError."""
    import pickle

    from kvload.sampling_params import RequestOutputKind

    given = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY, n=2, best_of=2, logits_processors=[])
    assert (given.output_kind, given.best_of, given.logits_processors) == (RequestOutputKind.FINAL_ONLY, 2, [])
    plain = SamplingParams(max_tokens=3, n=2)
    assert (plain.output_kind, plain.best_of, plain.skip_clone, plain.routed_experts_prompt_start) == (
        RequestOutputKind.CUMULATIVE, None, False, 0)
    assert given == plain and "output_kind" not in given.to_dict() and "output_kind" not in repr(given)
    plain.output_kind = RequestOutputKind.FINAL_ONLY  # as vLLM's LLM.generate sets it
    plain.max_tokens = 5  # another field set after it keeps it
    for copy in (plain, plain.clone(), pickle.loads(pickle.dumps(plain))):
        assert copy.output_kind is RequestOutputKind.FINAL_ONLY and copy.max_tokens == 5
    with pytest.raises(GenerationError, match=r"^generate: output_kind: vLLM's SamplingParams field"):
        plain.output_kind = RequestOutputKind.DELTA
    assert plain.output_kind is RequestOutputKind.FINAL_ONLY  # a refused value changes nothing
    with pytest.raises(AttributeError, match="no attribute 'outputs_kind'"):
        plain.outputs_kind  # noqa: B018


def test_a_no_op_field_set_on_a_shallow_copy_leaves_the_original_alone():
    """``copy.copy(params)`` then ``c.output_kind = FINAL_ONLY`` changed the original's ``output_kind`` too: both
    copies held one dict of vLLM's fields, and setting one wrote into it. In vLLM's params (and for kvload's own
    fields here) an attribute set on a shallow copy is the copy's."""
    import copy

    from kvload.sampling_params import RequestOutputKind

    original = SamplingParams(max_tokens=3)
    shallow = copy.copy(original)
    shallow.output_kind = RequestOutputKind.FINAL_ONLY
    shallow.best_of = 1
    assert shallow.output_kind is RequestOutputKind.FINAL_ONLY and shallow.best_of == 1
    assert original.output_kind is RequestOutputKind.CUMULATIVE and original.best_of is None


def test_a_no_op_list_changed_in_place_is_refused_at_generate_not_dropped(llm):
    """``SamplingParams(logits_processors=[])`` now reads back its list, so ``params.logits_processors.append(fn)``
    (vLLM's way to add one) worked, and generate ran without the processor, saying nothing: the list was taken as a
    no-op when built and never looked at again. A generate call checks these fields again as it checks ``stop``
    changed in place, and refuses one that now asks for something, naming it."""
    params = SamplingParams(max_tokens=2, logits_processors=[], extra_args={})
    assert llm.generate([TEXT], params)[0].outputs[0].token_ids  # as built: nothing asked
    params.logits_processors.append(lambda ids, logits: logits)
    with pytest.raises(GenerationError, match=r"^generate: logits_processors: vLLM's SamplingParams field"):
        llm.generate([TEXT], params)
    params.logits_processors.clear()
    params.extra_args["mine"] = 1
    with pytest.raises(GenerationError, match=r"^generate: extra_args: vLLM's SamplingParams field"):
        llm.generate([TEXT], params)
    # the prompt cut given in tokenization_kwargs runs the call on a copy of the params: checked as the params
    with pytest.raises(GenerationError, match=r"^generate: extra_args: vLLM's SamplingParams field"):
        llm.generate([TEXT], params, tokenization_kwargs={"truncate_prompt_tokens": 3})


def test_tokenization_kwargs_key_that_is_no_plain_name_is_refused_in_one_printable_line(llm):
    """A key with a newline or a lone surrogate was put in the message as it was: a two-line refusal, and one whose
    ``print`` raised UnicodeEncodeError; it is named by its repr now (a plain name still as written)."""
    sp = SamplingParams(max_tokens=2)
    for key, shown in (("a\nb", "'a\\nb'"), ("\ud800", "'\\ud800'")):
        with pytest.raises(GenerationError) as refused:
            llm.generate([TEXT], sp, tokenization_kwargs={key: 1})
        message = str(refused.value)
        assert message.startswith(f"generate: tokenization_kwargs.{shown}: not a setting kvload's tokenization takes")
        assert "\n" not in message
        message.encode()  # printable: no lone surrogate
    with pytest.raises(GenerationError, match=r"^embed: tokenization_kwargs\.nosuch: "):
        llm.embed([TEXT], tokenization_kwargs={"nosuch": 1})
    assert llm.generate([TEXT], sp)[0].outputs[0].token_ids  # the same LLM answers after


def test_a_mistyped_tokenization_kwargs_cut_is_answered_with_did_you_mean(llm):
    """``{"truncate_prompt_token": 2}`` (one letter short) was refused as "not a setting kvload's tokenization takes",
    as a key kvload lacks is, without the "did you mean" every other typo of the API gets."""
    with pytest.raises(GenerationError, match=r"^generate: tokenization_kwargs\.truncate_prompt_token: .*; did you "
                                              r"mean 'truncate_prompt_tokens'\?$"):
        llm.generate([TEXT], SamplingParams(max_tokens=2), tokenization_kwargs={"truncate_prompt_token": 2})
    with pytest.raises(GenerationError, match=r"^score: tokenization_kwargs\.truncate_prompts_tokens: .*did you mean"):
        llm.score(TEXT, "w1 w2", tokenization_kwargs={"truncate_prompts_tokens": 2})
    with pytest.raises(GenerationError) as far:  # a key far from it gets no guess
        llm.generate([TEXT], SamplingParams(max_tokens=2), tokenization_kwargs={"add_special_tokens": False})
    assert "did you mean" not in str(far.value)


def test_a_cut_given_twice_that_is_no_cut_is_refused_for_its_value_not_as_two_values_that_differ(llm):
    """NaN in both places (or a text beside a number) was "nan in the keywords and nan in tokenization_kwargs differ;
    give it once": the user read that their two values disagree, where neither is a cut."""
    nan = float("nan")
    for keyword, cut in ((nan, float("nan")), ("abc", 2), (2, "abc")):
        with pytest.raises(GenerationError) as refused:
            llm.generate([TEXT], max_tokens=2, truncate_prompt_tokens=keyword,
                         tokenization_kwargs={"truncate_prompt_tokens": cut})
        assert str(refused.value).startswith("generate: truncate_prompt_tokens: expected an integer >= 1")
        assert "differ" not in str(refused.value)
    with pytest.raises(GenerationError, match=r"^embed: truncate_prompt_tokens: 2 in the call's argument and 3 in "):
        llm.embed([TEXT], truncate_prompt_tokens=2, tokenization_kwargs={"truncate_prompt_tokens": 3})
    with pytest.raises(GenerationError, match=r"truncate_prompt_tokens: expected a positive integer"):
        llm.embed([TEXT], truncate_prompt_tokens=nan, tokenization_kwargs={"truncate_prompt_tokens": nan})
    (out,) = llm.generate([TEXT], max_tokens=1, truncate_prompt_tokens=2,
                          tokenization_kwargs={"truncate_prompt_tokens": 2})
    assert out.prompt_token_ids == [42, 9]  # the same cut twice is one cut
