"""vLLM's pooling API, ``POST /pooling``: a classifier's per-token probabilities (its default task ``token_classify``,
a reward model's per-token scores: checked against transformers' decoder hidden states through the checkpoint's
``score`` head) or its ``classify`` output; a generative model's per-token hidden states (its default task
``token_embed``, checked against transformers' ``AutoModel``) or its ``embed`` output; vLLM's ``PoolingResponse``,
floats or base64; the chat form; a task the model does not have, or the other task's switch, a 400 naming the field;
``/invocations`` sends a body naming a ``task`` there. Plain JSON over HTTP, as vLLM's docs send it (the openai client
has no pooling call)."""

from __future__ import annotations

import base64
import json
import socket
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import transformers

from tests.classify_support import classifier_checkpoint
from tests.llm_support import with_tokenizer, word_tokenizer
from tests.serve_support import TIMEOUT, serving, wait_for

LONG = [(7 * i + 5) % 500 + 1 for i in range(40)]  # prefilled in three steps of max_num_tokens 16
SHORT = [88, 123, 7]
KV = {"max_tokens": 512, "tokens_per_block": 4}
#: each message's words, a space after each; the generation prompt is the word w3
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
CHAT = [{"role": "user", "content": "w5 w17 w300"}, {"role": "assistant", "content": "w88 w123"}]
CHAT_IDS = [5, 17, 300, 88, 123]


def text(ids: list[int]) -> str:
    """The word-level tokenizer's text of ``ids`` (token i is "w<i>")."""
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A tiny Llama classifier over three labels whose tokenizer has a chat template."""
    path = classifier_checkpoint(tmp_path_factory.mktemp("pool") / "llama", "llama",
                                 "LlamaForSequenceClassification", 3)
    tok = word_tokenizer(512)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(classifier):
    with serving(str(classifier), dtype="float32", max_seq_len=64, max_num_tokens=16, kv_cache_config=KV) as s:
        yield s


@pytest.fixture(scope="module")
def token_logits(classifier):
    """transformers' per-token logits of the classifier: its decoder's last hidden states through its score head."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(classifier), dtype=torch.float32, attn_implementation="eager").eval()

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model.score(model.model(input_ids=torch.tensor([ids])).last_hidden_state)[0].float()

    return logits


def _ok(served, path: str, body: dict) -> dict:
    r = served.http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_classifiers_default_task_gives_every_prompt_tokens_probabilities_as_transformers_computes_them(
        served, token_logits):
    """vLLM's default task for a classifier is token_classify: per input, in order, one row of class probabilities
    per prompt token (a prompt prefilled over several steps too) in vLLM's PoolingResponse; a prompt whose blocks the
    cache holds is computed whole and gives the same; use_activation false the logits; base64 the float32 rows'
    little-endian bytes; truncate_prompt_tokens keeps the last N tokens; /metrics counts prompt tokens only."""
    before = served.metrics()
    doc = _ok(served, "/pooling", {"model": served.state.model_name, "input": [text(LONG), SHORT]})
    assert doc["id"].startswith("pooling-") and doc["object"] == "list" and isinstance(doc["created"], int)
    assert doc["model"] == served.state.model_name
    assert [(d["index"], d["object"]) for d in doc["data"]] == [(0, "pooling"), (1, "pooling")]
    for d, ids in zip(doc["data"], [LONG, SHORT], strict=True):
        np.testing.assert_allclose(np.array(d["data"]), torch.softmax(token_logits(ids), -1).numpy(), atol=1e-5)
    tokens = len(LONG) + len(SHORT)
    assert doc["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                            "prompt_tokens_details": None}
    after = served.metrics()
    assert after["kvload_prompt_tokens_total"] - before.get("kvload_prompt_tokens_total", 0) == tokens
    assert after["kvload_generation_tokens_total"] == before.get("kvload_generation_tokens_total", 0)
    again = _ok(served, "/pooling", {"input": text(LONG), "task": "token_classify"})  # its blocks are cached now
    np.testing.assert_allclose(again["data"][0]["data"], doc["data"][0]["data"], atol=1e-6)
    raw = _ok(served, "/pooling", {"input": SHORT, "use_activation": False})
    np.testing.assert_allclose(raw["data"][0]["data"], token_logits(SHORT).numpy(), atol=1e-5)
    packed = _ok(served, "/pooling", {"input": SHORT, "encoding_format": "base64"})["data"][0]["data"]
    rows = np.frombuffer(base64.b64decode(packed), dtype="<f4").reshape(len(SHORT), 3)
    np.testing.assert_allclose(rows, doc["data"][1]["data"], atol=1e-6)
    cut = _ok(served, "/pooling", {"input": LONG, "truncate_prompt_tokens": 5})
    assert cut["usage"]["prompt_tokens"] == 5
    np.testing.assert_allclose(cut["data"][0]["data"], torch.softmax(token_logits(LONG[-5:]), -1).numpy(), atol=1e-5)


def test_task_classify_answers_what_classify_answers_and_encode_is_the_default(served):
    """task classify: each input's probabilities at its last token, /classify's; vLLM 0.10's encode names the
    default task (token_classify here); the chat form pools the templated conversation."""
    inputs = [text(LONG), text(SHORT)]
    pooled = _ok(served, "/pooling", {"input": inputs, "task": "classify"})
    own = _ok(served, "/classify", {"input": inputs})
    for mine, theirs in zip(pooled["data"], own["data"], strict=True):
        assert mine["data"] == pytest.approx(theirs["probs"], abs=1e-6)
    encode = _ok(served, "/pooling", {"input": SHORT, "task": "encode"})
    assert len(encode["data"][0]["data"]) == len(SHORT) and len(encode["data"][0]["data"][0]) == 3
    chat = _ok(served, "/pooling", {"messages": CHAT, "task": "classify"})
    assert chat["data"][0]["data"] == pytest.approx(
        _ok(served, "/classify", {"messages": CHAT})["data"][0]["probs"], abs=1e-6)
    per_token = _ok(served, "/pooling", {"messages": CHAT, "add_generation_prompt": True})
    assert len(per_token["data"][0]["data"]) == per_token["usage"]["prompt_tokens"] == len(CHAT_IDS) + 1


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"input": "w5", "task": "embed"}, "task",
     'task: "embed" is not served by this model (LlamaForSequenceClassification, a classifier); accepted: '
     '"token_classify" (the default; "encode" names it too), "classify"'),
    ({"input": "w5", "task": 3}, "task", 'task: expected one of "token_classify"'),
    # vLLM removed normalize (use_activation is every task's switch): refused whatever its value, null too
    ({"input": "w5", "normalize": True}, "normalize",
     "normalize: the parameter was removed (vLLM's: use use_activation instead); send use_activation (false: the "
     "logits as computed)"),
    ({"input": "w5", "task": "classify", "normalize": None}, "normalize", "send use_activation"),
    ({"input": "w5", "use_activation": "no"}, "use_activation", "use_activation: expected true or false"),
    ({"input": "w5", "encoding_format": "hex"}, "encoding_format",
     'encoding_format: expected one of "float", "base64", "bytes" or "bytes_only"'),
    ({"input": "w5", "dimensions": 8}, "dimensions", "no Matryoshka embeddings"),
    ({"input": "w5", "embed_dtype": "int8"}, "embed_dtype", 'embed_dtype: expected one of "float32", "float16"'),
    ({"input": "w5", "endianness": "middle"}, "endianness", 'endianness: expected one of "native", "big" or "little"'),
    ({"input": "w5", "messages": CHAT}, "messages", "not both"),
    ({}, "input", "input: required"),
    ({"input": [[1, 2], [3, 99999]]}, "input", "input[1]"),
    ({"input": " ".join(["w1"] * 65)}, "input",
     "input: 65 tokens; a reward (every token's scores) takes at most max_seq_len=64"),
])
def test_a_body_kvload_cannot_pool_is_a_400_naming_the_field(served, body, param, says):
    r = served.http.post("/pooling", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert "\n" not in error["message"]


def test_invocations_sends_a_body_naming_a_task_to_pooling(served):
    """/pooling is the route that reads task: an input or messages body naming one is answered there (and one
    without a task still goes to /classify on a classifier)."""
    body = {"input": text(SHORT), "task": "token_classify"}
    via, own = _ok(served, "/invocations", body), _ok(served, "/pooling", body)
    assert via["id"].startswith("pooling-") and via["data"] == own["data"] and via["usage"] == own["usage"]
    chat = {"messages": CHAT, "task": "classify"}
    assert _ok(served, "/invocations", chat)["data"] == _ok(served, "/pooling", chat)["data"]
    assert _ok(served, "/invocations", {"input": text(SHORT)})["id"].startswith("classify-")
    r = served.http.post("/invocations", json={"input": "w5", "task": "embed"})  # /pooling's own refusal
    assert r.status_code == 400 and r.json()["error"]["param"] == "task", r.text


def test_invocations_sends_a_body_with_a_task_and_no_input_to_pooling_which_names_the_input(served):
    """A body naming task and nothing else is a pooling request missing its input: /pooling's refusal, naming input,
    not /invocations' "none of the fields that pick a route" (which named no field)."""
    for body in ({"task": "token_classify"}, {"task": "classify", "truncate_prompt_tokens": 3}):
        r = served.http.post("/invocations", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "input" and error["message"].startswith("input: required"), error


def test_concurrent_classifier_requests_are_each_answered_as_when_alone(served):
    """Many /pooling and /classify requests on a classifier at once: each answered 200 with what it gets alone. The
    head over one request's rows runs on its own thread while the engine computes others; the engine counted those
    calls as its forward's own and failed every request of that step with a 500 ("the model's output projection ran
    2 times in one forward")."""
    inputs = [LONG, SHORT, LONG[:9], LONG[5:30]]
    bodies = [("/pooling", {"input": inputs}), ("/pooling", {"input": inputs, "task": "classify"}),
              ("/classify", {"input": inputs})]
    alone = [_ok(served, path, body)["data"] for path, body in bodies]
    with ThreadPoolExecutor(18) as pool:
        answers = list(pool.map(lambda i: served.http.post(bodies[i % 3][0], json=bodies[i % 3][1]), range(18)))
    assert [r.status_code for r in answers] == [200] * 18, [r.text[:200] for r in answers if r.status_code != 200]
    for i, r in enumerate(answers):
        for got, want in zip(r.json()["data"], alone[i % 3], strict=True):
            key = "data" if "data" in want else "probs"
            np.testing.assert_allclose(got[key], want[key], atol=1e-5)  # batched with others: float noise
    wait_for(lambda: served.state.in_flight == 0, what="every admission slot freed")


def test_a_generative_models_default_task_gives_every_tokens_normalized_hidden_state(tiny_checkpoints, tmp_path):
    """A generative model serves vLLM's embedding tasks: token_embed (its default) each prompt token's final norm
    output, L2-normalized per token as transformers' AutoModel computes it (use_activation false, vLLM's switch of
    every task: as computed), embed the last token's, as /v1/embeddings gives it; the classifier's tasks, its older
    switch names and vLLM's removed normalize are a 400 naming the field."""
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "gen", 512)
    model = transformers.AutoModel.from_pretrained(str(words), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([LONG])).last_hidden_state[0].float()
    with serving(str(words), dtype="float32", max_seq_len=64, max_num_tokens=16, kv_cache_config=KV) as s:
        doc = _ok(s, "/pooling", {"input": text(LONG)})
        np.testing.assert_allclose(doc["data"][0]["data"], torch.nn.functional.normalize(hidden, dim=-1).numpy(),
                                   atol=1e-5)
        raw = _ok(s, "/pooling", {"input": LONG, "task": "token_embed", "use_activation": False})
        np.testing.assert_allclose(raw["data"][0]["data"], hidden.numpy(), atol=1e-4)
        last = _ok(s, "/pooling", {"input": LONG, "task": "embed"})["data"][0]["data"]
        assert last == pytest.approx(_ok(s, "/v1/embeddings", {"input": LONG})["data"][0]["embedding"], abs=1e-6)
        for body, param, says in [
                ({"input": "w5", "task": "token_classify"}, "task",
                 'task: "token_classify" is not served by this model (LlamaForCausalLM, a generative model: no '
                 'classifier head); accepted: "token_embed" (the default; "encode" names it too), "embed"'),
                ({"input": "w5", "softmax": False}, "softmax",
                 "softmax: the older name of a classifier's use_activation (task classify or token_classify); task "
                 "token_embed takes use_activation (false: the hidden states as computed)"),
                ({"input": "w5", "normalize": False}, "normalize",
                 "normalize: the parameter was removed (vLLM's: use use_activation instead); send use_activation "
                 "(false: the hidden states as computed, not L2-normalized)")]:
            r = s.http.post("/pooling", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert r.json()["error"]["message"] == says


def test_pooling_takes_an_admission_slot_as_embeddings_do(classifier):
    """Past --max-concurrent-requests a pooling request is refused at once with a 503; once the slot frees it is
    served."""
    with serving(str(classifier), state={"max_concurrent_requests": 1}, kv_cache_config=KV) as s:
        with socket.create_connection(("127.0.0.1", s.server.port), timeout=TIMEOUT) as held:
            held.sendall(b'POST /pooling HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{"input": [1, ')
            wait_for(lambda: s.state.in_flight == 1, what="the slot held")
            r = s.http.post("/pooling", json={"input": "w5"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy", r.text
        wait_for(lambda: s.state.in_flight == 0, what="the slot freed")
        assert s.http.post("/pooling", json={"input": "w5"}).status_code == 200


def test_a_long_per_token_answer_does_not_stall_the_server_while_it_is_written(tmp_path):
    """A per-token answer of 8.4M floats (16 inputs of 1,024 tokens, hidden size 512) is rendered in one json.dumps,
    which holds the GIL throughout: every other request (/health here), and the engine loop, waited for all of it
    (/health took 5.8 s on a 2-core CPU). Rendered a row at a time, the other requests are answered meanwhile; the
    answer is the same text (tests/test_serve_pooling.py's others read it)."""
    import time

    import transformers as tf

    from tests.llm_support import with_tokenizer as tokenizer_into

    config = tf.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=2048)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(tmp_path / "wide")
    wide = tokenizer_into(tmp_path / "wide", tmp_path / "words", 512)
    inputs = [[(11 * i + 7 * j) % 500 + 1 for i in range(1024)] for j in range(16)]
    kv = {"max_tokens": 4096, "tokens_per_block": 16}
    with serving(str(wide), dtype="float32", max_seq_len=1024, max_num_tokens=4096, kv_cache_config=kv) as s:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(s.http.post, "/pooling", json={"input": inputs, "use_activation": False})
            waits = []
            while not answer.done():
                start = time.perf_counter()
                assert s.http.get("/health").status_code == 200
                waits.append(time.perf_counter() - start)
                time.sleep(0.02)
            r = answer.result()
        assert r.status_code == 200, r.text[:300]
        # a bound, not a speed: one json.dumps of the whole answer kept /health waiting 5.8 s here
        assert max(waits) < 2.0, f"/health waited {max(waits):.2f} s (of {len(waits)} calls)"
        doc = r.json()
        assert [len(d["data"]) for d in doc["data"]] == [1024] * 16 and len(doc["data"][3]["data"][5]) == 512


def test_per_token_pooling_beside_completions_gives_each_what_it_gets_alone(tiny_checkpoints, tmp_path):
    """/pooling token_embed requests sharing steps with completions (greedy, with logprobs, and echo-scored prompts
    whose every position's logits are read): each answered as alone. The output projection gets only the rows whose
    logits the step reads, the pooled prompts' rows taken from its input; a wrong pick of rows would give the
    completions another row's tokens or scores."""
    words = with_tokenizer(tiny_checkpoints("llama"), tmp_path / "gen", 512)
    with serving(str(words), dtype="float32", max_seq_len=64, max_num_tokens=16, kv_cache_config=KV) as s:
        name = s.state.model_name
        bodies = [("/pooling", {"input": [LONG, SHORT], "task": "token_embed"}),
                  ("/v1/completions", {"model": name, "prompt": LONG[:20], "max_tokens": 5, "temperature": 0,
                                       "logprobs": 2}),
                  ("/v1/completions", {"model": name, "prompt": text(LONG[3:25]), "max_tokens": 1, "echo": True,
                                       "logprobs": 1, "temperature": 0})]
        alone = [_ok(s, path, body) for path, body in bodies]
        with ThreadPoolExecutor(9) as pool:
            answers = list(pool.map(lambda i: s.http.post(bodies[i % 3][0], json=bodies[i % 3][1]), range(9)))
        assert [r.status_code for r in answers] == [200] * 9, [r.text[:200] for r in answers if r.status_code != 200]
        for i, r in enumerate(answers):
            got, want = r.json(), alone[i % 3]
            if i % 3 == 0:
                for g, w in zip(got["data"], want["data"], strict=True):
                    np.testing.assert_allclose(g["data"], w["data"], atol=1e-5)
                continue
            (g,), (w,) = got["choices"], want["choices"]
            assert g["text"] == w["text"] and g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
            lp = [x for x in g["logprobs"]["token_logprobs"] if x is not None]
            assert lp == pytest.approx([x for x in w["logprobs"]["token_logprobs"] if x is not None], abs=1e-4)


def test_a_classifiers_pooling_answers_vllms_bytes_one_row_of_labels_per_input(served):
    """encoding_format bytes on a classifier: task classify's probabilities as one [labels] item per input, the
    token_classify default's as [tokens, labels]; float16 big-endian as asked, the float answer within float16's
    rounding."""
    for task, shapes in (("classify", [[3], [3]]), ("token_classify", [[len(LONG), 3], [len(SHORT), 3]])):
        want = _ok(served, "/pooling", {"input": [LONG, SHORT], "task": task})["data"]
        r = served.http.post("/pooling", json={"input": [LONG, SHORT], "task": task, "encoding_format": "bytes",
                                               "embed_dtype": "float16", "endianness": "big"})
        assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream", r.text
        items = json.loads(r.headers["metadata"])["data"]
        assert [item["shape"] for item in items] == shapes
        for item, floats in zip(items, want, strict=True):
            got = np.frombuffer(r.content[item["start"]:item["end"]], dtype=">f2").reshape(item["shape"])
            np.testing.assert_allclose(got.astype(np.float32), floats["data"], rtol=2 ** -11, atol=2 ** -24)
