"""Embeddings of a decoder model, vLLM's habit for RAG: ``LLM.embed`` and ``POST /v1/embeddings`` give the final
norm's output at the prompt's last token, L2-normalized (vLLM's LAST pooling for a ``*ForCausalLM`` run as an
embedding model), checked against transformers' own ``AutoModel`` reading the same checkpoint and against OpenAI's
client."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch
import transformers

import kvload
from pipeline.errors import ConfigError, GenerationError
from tests.llm_support import llm_kwargs, with_tokenizer
from tests.serve_support import TIMEOUT, held_at_step, serving, wait_for

VOCAB = 512  # the tiny llama's
PROMPTS = [[5, 17, 300, 42, 9, 11, 23, 2, 77, 301, 64, 8, 19], [88, 123, 7]]


@pytest.fixture(scope="module")
def words(tiny_checkpoints, tmp_path_factory):
    """The tiny llama checkpoint with a word-level tokenizer (token i is the text "w<i>")."""
    return with_tokenizer(tiny_checkpoints("llama"), tmp_path_factory.mktemp("words") / "ckpt", VOCAB)


@pytest.fixture(scope="module")
def reference(words):
    """transformers' base model of the checkpoint: its last hidden state at each prompt's last token (post norm)."""
    model = transformers.AutoModel.from_pretrained(str(words), dtype=torch.float32, attn_implementation="eager")
    model.eval()

    def last(ids: list[int], normalize: bool = True) -> np.ndarray:
        with torch.no_grad():
            row = model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1].float()
        return (torch.nn.functional.normalize(row, dim=-1) if normalize else row).numpy()

    return last


def test_pooling_params_refuses_normalize_as_vllm_removed_it_for_use_activation():
    """vLLM's PoolingParams has no normalize now (use_activation is every task's switch; its constructor raises
    TypeError for it): kvload's refuses it too, a TypeError in one line naming use_activation, whatever its value."""
    for value in (False, True, None):
        with pytest.raises(TypeError) as caught:
            kvload.PoolingParams(normalize=value)
        message = str(caught.value)
        assert message == ("PoolingParams: normalize was removed, as vLLM removed it; use use_activation (False: an "
                           "embedding's hidden state as computed, not L2-normalized)")
        assert isinstance(caught.value, GenerationError)  # kvload's refusals' type too
    assert "normalize" not in kvload.PoolingParams(use_activation=False).__repr__()


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_llm_embed_gives_the_last_tokens_normalized_hidden_state_as_transformers_computes_it(words, reference,
                                                                                              manager):
    """Token ids and text alike, in order; use_activation=False gives the state as computed; a prompt whose prefix the
    cache holds (computed again only past it) embeds the same; truncate_prompt_tokens keeps the last N tokens; and
    generate afterwards is untouched."""
    with kvload.LLM(str(words), dtype="float32", **llm_kwargs(manager)) as llm:
        outs = llm.embed([PROMPTS[0], "w88 w123 w7"])
        assert [o.prompt_token_ids for o in outs] == [PROMPTS[0], PROMPTS[1]]
        for out, ids in zip(outs, PROMPTS, strict=True):
            got = np.array(out.outputs.embedding)
            assert out.outputs.hidden_size == 64 and abs(np.linalg.norm(got) - 1) < 1e-5
            np.testing.assert_allclose(got, reference(ids), atol=1e-5)
        raw = llm.embed([PROMPTS[0]], pooling_params=kvload.PoolingParams(use_activation=False))[0]
        assert raw.num_cached_tokens >= 8  # its first blocks came from the prefix cache
        np.testing.assert_allclose(raw.outputs.embedding, reference(PROMPTS[0], normalize=False), atol=1e-4)
        (cut,) = llm.embed([PROMPTS[0]], truncate_prompt_tokens=4)
        assert cut.prompt_token_ids == PROMPTS[0][-4:]
        np.testing.assert_allclose(cut.outputs.embedding, reference(PROMPTS[0][-4:]), atol=1e-5)
        per_prompt = llm.embed(PROMPTS, pooling_params=[kvload.PoolingParams(),
                                                        kvload.PoolingParams(use_activation=False)])
        np.testing.assert_allclose(per_prompt[1].outputs.embedding, reference(PROMPTS[1], normalize=False), atol=1e-4)
        assert not llm.result.executor.pooled  # no request is left waiting for a row
        assert not list(llm.audit.of("setting_ignored"))  # the one-token greedy prefill reports no setting of its own
        (gen,) = llm.generate([PROMPTS[1]], max_tokens=3, ignore_eos=True)
        assert len(gen.outputs[0].token_ids) == 3


def test_vllms_pooling_runner_settings_are_taken_and_embed_bad_settings_are_one_line(words):
    """A vLLM script asks for its embedding model with runner="pooling" (older: task="embed"; convert="embed"): taken,
    reported setting_ignored (one kvload.LLM embeds and generates); dimensions and a bad truncation are refused."""
    with kvload.LLM(str(words), runner="pooling", task="embed", convert="embed", **llm_kwargs("v1")) as llm:
        said = {e["field"]: e["reason"] for e in llm.audit.of("setting_ignored")}
        assert {"runner", "task", "convert"} <= set(said), said
        assert "a *ForCausalLM one generates and embeds" in said["runner"]
        assert llm.embed("w5 w6")[0].outputs.hidden_size == 64
        with pytest.raises(GenerationError, match=r"^PoolingParams: dimensions 8: .*no Matryoshka"):
            llm.embed("w5", pooling_params=kvload.PoolingParams(dimensions=8))
        with pytest.raises(GenerationError, match=r"^PoolingParams: truncate_prompt_tokens: expected a positive"):
            llm.embed("w5", truncate_prompt_tokens=0)
        with pytest.raises(GenerationError, match=r"^embed: pooling_params: expected a kvload\.PoolingParams, got "
                                                  r"SamplingParams"):
            llm.embed("w5", pooling_params=kvload.SamplingParams())
    with pytest.raises(ConfigError, match=r"^runner: vLLM's setting; .*accepted: 'auto' or 'generate' or 'pooling', "
                                          r"got 'draft'"):
        kvload.LLM(str(words), runner="draft", **llm_kwargs("v1"))


def test_v1_embeddings_serves_openais_client_in_base64_and_float(words, reference):
    """OpenAI's client (base64 by default, then float) gets transformers' vectors for token ids and text, usage
    counting the inputs' tokens; an unusable body is a 400 naming the field, an unknown model a 404."""
    with serving(str(words), dtype="float32", kv_cache_config={"max_tokens": 512, "tokens_per_block": 4}) as s:
        default = s.client.embeddings.create(model=s.state.model_name, input=[PROMPTS[0], "w88 w123 w7"])
        assert [d.index for d in default.data] == [0, 1]
        assert default.usage.prompt_tokens == default.usage.total_tokens == len(PROMPTS[0]) + len(PROMPTS[1])
        for d, ids in zip(default.data, PROMPTS, strict=True):
            np.testing.assert_allclose(d.embedding, reference(ids), atol=1e-5)
        floats = s.client.embeddings.create(model=s.state.model_name, input=PROMPTS[1], encoding_format="float")
        np.testing.assert_allclose(floats.data[0].embedding, reference(PROMPTS[1]), atol=1e-5)
        raw = s.http.post("/v1/embeddings", json={"input": [PROMPTS[1]], "encoding_format": "base64"}).json()
        decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
        np.testing.assert_allclose(decoded, reference(PROMPTS[1]), atol=1e-5)
        # vLLM's switch since it removed normalize (a 400 below, whatever its value)
        unnormalized = s.http.post("/v1/embeddings", json={"input": PROMPTS[1], "use_activation": False}).json()
        np.testing.assert_allclose(unnormalized["data"][0]["embedding"], reference(PROMPTS[1], normalize=False),
                                   atol=1e-4)
        for body, param, said in [
                ({"input": PROMPTS[1], "dimensions": 8}, "dimensions", "no Matryoshka"),
                ({"input": PROMPTS[1], "extra_body": {"normalize": False}}, "normalize",
                 "normalize: the parameter was removed (vLLM's: use use_activation instead); send use_activation "
                 "(false: the hidden state as computed"),
                ({"input": PROMPTS[1], "extra_body": {"normalize": None}}, "normalize", "use use_activation instead"),
                ({"input": PROMPTS[1], "extra_body": {"use_activation": "no"}}, "use_activation",
                 "expected true or false"),
                ({"input": []}, "input", "expected a non-empty string"),
                ({"input": [PROMPTS[1], [1, 2.5]]}, "input[1][1]", "expected a token id"),
                ({"input": [[1, VOCAB]]}, "input", "outside the vocabulary"),
                ({"input": "w1", "encoding_format": "hex"}, "encoding_format",
                 'expected one of "float", "base64", "bytes" or "bytes_only"'),
                ({"input": "w1", "extra_body": {"messages": []}}, "messages", "not supported by kvload serve")]:
            with pytest.raises(openai.BadRequestError) as refused:
                s.client.embeddings.create(model=s.state.model_name, **body)
            error = refused.value.body
            assert error["param"] == param and said in error["message"], error
        with pytest.raises(openai.NotFoundError):
            s.client.embeddings.create(model="another-model", input=PROMPTS[1])
        assert not s.state.engine.executor.pooled  # every row was handed over
        done = s.client.completions.create(model=s.state.model_name, prompt=PROMPTS[1], max_tokens=2,
                                           extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 2


def test_an_input_embedded_in_the_step_of_a_decoding_completion_gets_its_own_row(words, reference):
    """The embedding request joins a step that also decodes another request's token (their rows packed in one
    forward): each gets its own row, the vector transformers' and the completion's tokens those it gets alone."""
    import threading

    with serving(str(words), dtype="float32", kv_cache_config={"max_tokens": 512, "tokens_per_block": 4}) as s:
        ask = {"model": s.state.model_name, "prompt": PROMPTS[0], "max_tokens": 10, "extra_body": {"ignore_eos": True}}
        alone = s.client.completions.create(**ask).choices[0].text
        results: dict[str, object] = {}
        executor = s.state.engine.executor
        with held_at_step(s, 3) as (reached, release):  # the completion's prefill and first decode ran
            threads = [threading.Thread(target=lambda: results.update(done=s.client.completions.create(**ask)))]
            threads[0].start()
            assert reached.wait(TIMEOUT)
            threads.append(threading.Thread(target=lambda: results.update(
                embedded=s.client.embeddings.create(model=s.state.model_name, input=PROMPTS[1]))))
            threads[1].start()
            wait_for(lambda: bool(executor.pooled), what="the embedding request queued")
            release.set()
            for thread in threads:
                thread.join(TIMEOUT)
        np.testing.assert_allclose(results["embedded"].data[0].embedding, reference(PROMPTS[1]), atol=1e-5)
        assert results["done"].choices[0].text == alone


def test_vllm_serves_launch_line_for_an_embedding_model_is_taken_by_the_cli(capsys):
    """``vllm serve MODEL --runner pooling`` (older: ``--task embed``; ``--convert embed``): taken, each said
    ignored (kvload serve answers /v1/embeddings whatever the runner); a task kvload has not is one line, exit 2."""
    from tests.cli_support import run_cli

    r = run_cli(capsys, "plan", "tiny-llama", "--runner", "pooling", "--task", "embed", "--convert", "embed")
    assert r.code == 0, r.err
    warned = [line for line in r.err.splitlines() if "setting_ignored" in line]
    for key in ("runner", "task", "convert"):
        assert any(f"field={key} " in line and "/v1/embeddings" in line for line in warned), (key, warned)
    r = run_cli(capsys, "plan", "tiny-llama", "--task", "reward")
    assert r.code == 2 and "--task: vLLM's setting; kvload serves a checkpoint as its architectures[0] says" in r.err, \
        r.err
    assert len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err


def test_llm_score_is_the_cosine_of_the_pairs_embeddings_one_to_many_and_pairwise(words, reference):
    """vLLM's LLM.score of an embedding model: one prompt against each of a list, or two lists pairwise; each score
    the cosine similarity of transformers' vectors; lists of other lengths are one line."""
    def cosine(a: list[int], b: list[int]) -> float:
        return float(np.dot(reference(a), reference(b)))  # unit vectors

    third = [300, 5, 61, 2]
    with kvload.LLM(str(words), dtype="float32", **llm_kwargs("v1")) as llm:
        many = llm.score(PROMPTS[0], [PROMPTS[1], "w300 w5 w61 w2"])
        assert [round(o.outputs.score, 5) for o in many] == [round(cosine(PROMPTS[0], PROMPTS[1]), 5),
                                                             round(cosine(PROMPTS[0], third), 5)]
        assert many[1].prompt_token_ids == PROMPTS[0] + third
        pairwise = llm.score([PROMPTS[1], third], [third, PROMPTS[1]])
        assert [round(o.outputs.score, 5) for o in pairwise] == [round(cosine(PROMPTS[1], third), 5)] * 2
        assert llm.score(PROMPTS[1], PROMPTS[1])[0].outputs.score == pytest.approx(1.0, abs=1e-5)
        with pytest.raises(GenerationError, match=r"^score: data_1 has 2 prompts and data_2 3; give one data_1 "):
            llm.score([PROMPTS[0], PROMPTS[1]], [third, third, third])


LONG = [(7 * i + 3) % VOCAB for i in range(70)]  # longer than the tests' max_seq_len (64)


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_an_embedding_takes_a_prompt_of_max_seq_len_tokens_as_vllms_max_model_len(words, reference, manager):
    """Nothing is generated for an embedding, so its prompt may fill max_seq_len (vLLM's max_model_len) where a
    generate call's must leave one token; a longer one is refused naming the embedding's limit, and
    truncate_prompt_tokens=-1 keeps max_seq_len tokens (said nowhere as cut short)."""
    with kvload.LLM(str(words), dtype="float32", **llm_kwargs(manager)) as llm:
        (full,) = llm.embed([LONG[:64]])
        assert full.prompt_token_ids == LONG[:64]
        np.testing.assert_allclose(full.outputs.embedding, reference(LONG[:64]), atol=1e-5)
        with pytest.raises(GenerationError, match=r"^embed: prompt 0: 65 tokens; an embedding takes at most "
                                                  r"max_seq_len=64 \(vLLM's max_model_len\)"):
            llm.embed([LONG[:65]])
        (cut,) = llm.embed([LONG], truncate_prompt_tokens=-1)
        assert cut.prompt_token_ids == LONG[-64:]
        np.testing.assert_allclose(cut.outputs.embedding, reference(LONG[-64:]), atol=1e-5)
        assert not [e for e in llm.audit.of("setting_ignored") if "truncate_prompt_tokens" in e["field"]]
        with pytest.raises(GenerationError, match=r"^generate: prompt 0: 64 tokens leave no room to generate"):
            llm.generate([LONG[:64]], max_tokens=1)  # generate keeps its limit
        assert not llm.result.executor.pooled


def test_v1_embeddings_takes_max_seq_len_tokens_and_metrics_count_its_prompt_but_no_generated_token(words, reference):
    """/v1/embeddings: an input of max_seq_len tokens is embedded, one longer is a 400 naming the limit; /metrics
    (parsed by prometheus_client) counts the inputs' prompt tokens and no generated token, each request ending "stop"
    with zero generation tokens (vLLM's pooling requests), while a completion still counts its tokens."""
    with serving(str(words), dtype="float32", max_seq_len=64,
                 kv_cache_config={"max_tokens": 512, "tokens_per_block": 4}) as s:
        before = s.metrics()
        done = s.client.embeddings.create(model=s.state.model_name, input=[LONG[:64], PROMPTS[1]],
                                          encoding_format="float")
        np.testing.assert_allclose(done.data[0].embedding, reference(LONG[:64]), atol=1e-5)
        after = s.metrics()

        def grew(name: str) -> float:
            return after.get(name, 0) - before.get(name, 0)

        assert grew("kvload_prompt_tokens_total") == 64 + len(PROMPTS[1])
        assert grew("kvload_generation_tokens_total") == 0
        assert grew("kvload_request_generation_tokens_count") == 2
        assert grew("kvload_request_generation_tokens_sum") == 0
        assert grew("kvload_request_success_total{finished_reason=stop}") == 2
        assert grew("kvload_request_success_total{finished_reason=length}") == 0
        with pytest.raises(openai.BadRequestError) as refused:
            s.client.embeddings.create(model=s.state.model_name, input=LONG[:65])
        assert refused.value.body["param"] == "input"
        assert "input: 65 tokens; an embedding takes at most max_seq_len=64" in refused.value.body["message"]
        s.client.completions.create(model=s.state.model_name, prompt=PROMPTS[1], max_tokens=2,
                                    extra_body={"ignore_eos": True})
        assert s.metrics()["kvload_generation_tokens_total"] - after["kvload_generation_tokens_total"] == 2


def test_pooling_params_misspelt_normalize_points_to_use_activation():
    """README: a mistyped keyword of every parameter class is named with the field it is close to, its example being
    PoolingParams(normalise=False); the refusal listed the fields and suggested nothing. It names normalize now and,
    that being removed, use_activation; a misspelt real field keeps its own suggestion."""
    with pytest.raises(TypeError) as caught:
        kvload.PoolingParams(normalise=False)
    assert str(caught.value) == (
        "PoolingParams: unknown field 'normalise'; fields are dimensions, truncate_prompt_tokens, use_activation; "
        "did you mean 'normalize'? normalize was removed, as vLLM removed it; use use_activation (False: an "
        "embedding's hidden state as computed, not L2-normalized)")
    assert isinstance(caught.value, GenerationError)
    with pytest.raises(TypeError, match=r"; did you mean 'use_activation'\?$"):
        kvload.PoolingParams(use_activaton=False)
