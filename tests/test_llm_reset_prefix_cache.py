"""``LLM.reset_prefix_cache`` (vLLM's, called by benchmarks between runs) and the server's opt-in
``POST /reset_prefix_cache``: after a reset a repeated prompt reuses nothing; refused clearly while a call runs."""

from __future__ import annotations

import pytest

import kvload
from pipeline.errors import GenerationError
from tests.llm_support import llm_kwargs, with_tokenizer
from tests.serve_support import serving, wait_for

PROMPT = "w5 w17 w300 w42 w9 w88 w123 w7 w64 w256 w11 w3 w400"  # 13 tokens: 3 full 4-token blocks + 1


@pytest.fixture(scope="module")
def words(tiny_checkpoints, tmp_path_factory):
    return with_tokenizer(tiny_checkpoints("llama"), tmp_path_factory.mktemp("words") / "ckpt", 512)


def reused(llm) -> int:
    return llm.generate(PROMPT, max_tokens=2, ignore_eos=True)[0].reused_prompt_tokens


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_reset_forgets_every_cached_prefix_and_says_so_in_the_audit(words, manager):
    with kvload.LLM(str(words), **llm_kwargs(manager)) as llm:
        assert reused(llm) == 0
        assert reused(llm) >= 12  # the prompt's full blocks came from the cache
        assert llm.reset_prefix_cache() is True
        (event,) = llm.audit.of("prefix_cache_reset")
        assert event["caller"] == "LLM.reset_prefix_cache" and sum(event["cached_blocks"].values()) > 0
        assert reused(llm) == 0  # the repeated prompt was computed afresh
        assert llm.audit.of("request_admitted")[-1]["reused_prompt_tokens"] == 0
        assert reused(llm) >= 12  # and cached again for the next one


def test_reset_while_a_stream_is_open_is_refused_and_drops_nothing(words):
    with kvload.LLM(str(words), **llm_kwargs()) as llm:
        reused(llm)
        stream = llm.generate_stream("w1 w2 w3 w4 w5", max_tokens=8, ignore_eos=True)
        next(stream)
        with pytest.raises(GenerationError, match=r"^reset_prefix_cache: this LLM is already generating"):
            llm.reset_prefix_cache()
        stream.close()
        assert not llm.audit.of("prefix_cache_reset")
        assert reused(llm) >= 12  # the refused reset forgot nothing
        assert llm.reset_prefix_cache() is True


def test_reset_with_block_reuse_off_returns_false_and_says_why(words):
    with kvload.LLM(str(words), **llm_kwargs(enable_block_reuse=False)) as llm:
        reused(llm)
        assert llm.reset_prefix_cache() is False
        ignored = [e for e in llm.audit.of("setting_ignored") if e["field"] == "LLM.reset_prefix_cache"]
        assert len(ignored) == 1 and "nothing is cached to forget" in ignored[0]["reason"]
        assert not llm.audit.of("prefix_cache_reset")


def cached_tokens(served) -> int:
    out = served.client.completions.create(model=served.state.model_name, prompt=PROMPT, max_tokens=2,
                                           extra_body={"ignore_eos": True})
    return out.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_server_resets_only_when_the_operator_enabled_it(words, manager):
    small_blocks = {"max_tokens": 512, "tokens_per_block": 4, "use_kv_cache_manager_v2": manager == "v2"}
    with serving(str(words), state={"enable_reset_prefix_cache": True}, kv_cache_config=small_blocks) as served:
        cached_tokens(served)
        assert cached_tokens(served) >= 12
        answer = served.http.post("/reset_prefix_cache")
        assert answer.status_code == 200 and answer.json() == {"reset": True}
        assert cached_tokens(served) == 0
        wait_for(lambda: served.result.audit.of("prefix_cache_reset"), what="the reset's audit record")
        assert served.result.audit.of("prefix_cache_reset")[0]["caller"] == "serve.reset_prefix_cache"
    with serving(str(words)) as served:  # the default: no client may drop everyone's cache
        assert served.http.post("/reset_prefix_cache").status_code == 404


def test_server_reads_vllms_query_parameters_and_drops_unknown_ones(words):
    """vLLM's route takes reset_running_requests and reset_external as FastAPI bools (another value refused) and
    drops any other query parameter unread. kvload dropped all of them: reset_external=true (a KV connector's cache,
    which kvload has none of) went unsaid, a misspelt value reset anyway. Now a bad value is a 400 naming it that
    resets nothing, reset_external=true is reported setting_ignored, and an unknown parameter is still dropped."""
    small_blocks = {"max_tokens": 512, "tokens_per_block": 4}
    with serving(str(words), state={"enable_reset_prefix_cache": True}, kv_cache_config=small_blocks) as served:
        cached_tokens(served)
        for query in ("reset_running_requests=maybe", "reset_external=2"):
            answer = served.http.post(f"/reset_prefix_cache?{query}")
            name, value = query.split("=")
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["param"] == name and error["message"] == f"{name}: expected true or false, got '{value}'"
        assert cached_tokens(served) >= 12  # the refused calls forgot nothing
        answer = served.http.post("/reset_prefix_cache?reset_external=True&reset_running_requests=off&verbose=1")
        assert answer.status_code == 200 and answer.json() == {"reset": True}
        assert cached_tokens(served) == 0

        def external() -> list[dict]:
            return [e for e in served.result.audit.of("setting_ignored")
                    if e["field"] == "serve.reset_prefix_cache.reset_external"]

        wait_for(lambda: external() and served.result.audit.of("prefix_cache_reset"), what="the reset's records")
        assert "no KV connector" in external()[0]["reason"]
        assert served.http.post("/reset_prefix_cache?reset_external=0").json() == {"reset": True}
        # the records reach the audit after the answer: a marker said after the call under test, waited for, shows
        # whether that call said anything (it was read at once, and lost the race under load)
        assert served.http.post("/reset_prefix_cache?reset_external=yes").json() == {"reset": True}
        wait_for(lambda: len(served.result.audit.of("prefix_cache_reset")) == 3 and len(external()) >= 2,
                 what="the later resets' records")
        assert len(external()) == 2  # the first call's and the marker's: reset_external=0 said nothing


def test_server_reset_while_a_request_holds_a_cache_is_409_and_drops_nothing(words):
    import pipeline
    from cache_backends.request import Request
    from kvload.serve.server import build_state
    from tests.kv_v1_support import run_prefill

    with pipeline.load(str(words), load_weights=True, log=False, kv_cache_config={"max_tokens": 512}) as result:
        state = build_state(result, enable_reset_prefix_cache=True)
        holder = Request("held", list(range(1, 20)), 4)
        run_prefill(state.engine.manager, holder)  # a request mid-generation: its blocks are in use
        from fastapi.testclient import TestClient

        from kvload.serve.app import create_app

        with TestClient(create_app(state)) as http:
            answer = http.post("/reset_prefix_cache")
            asked = http.post("/reset_prefix_cache?reset_running_requests=true")  # vLLM's: preempt them
        assert answer.status_code == 409
        assert answer.json()["error"]["code"] == "prefix_cache_in_use"
        assert "1 request(s) still hold a KV cache (held)" in answer.json()["error"]["message"]
        assert "reset_running_requests" not in answer.json()["error"]["message"]
        assert asked.status_code == 409 and "; reset_running_requests=true: kvload does not preempt running " \
            "requests to reset; try again when they have finished" in asked.json()["error"]["message"]
        assert state.engine.manager.stats().requests == 1
