"""The precedence contract through the front doors that fill in defaults of their own: ``kvload.LLM(...)``,
``kvload generate`` and ``kvload serve`` (their start-up: the load each makes, run to its KV plan).

tests/test_precedence_properties.py holds the contract over the load pipeline's sources; here the same rules hold
where each entry point adds its own budget default (``kv_cache_config.default_max_tokens``: LLM's 8192 tokens, or
8 x (max_new_tokens + 1024); generate's prompts x (n x max_new_tokens + 1024), serve's 8 x (default-max-tokens +
1024), each from the model's max_new_tokens when no flag or keyword gives one, the model's default being more
specific than the entry point's): an explicit user value wins over it and over a model default, and the audit
names its source; the entry point's value is audited as the entry point's (``field_derived``), never as the user's;
an explicit ``"auto"`` is the field left unset; every ``"auto"`` is captured before anything changes it; a user budget
default that a bound overrules is ``setting_ignored``. The same intent given the entry points' several ways (LLM
keywords, vLLM's names, a config object, a --config file, the flags) resolves alike.

Each entry point runs as the user calls it; its load (the one with weights) is run through the plan stages instead
and captured, so nothing loads weights or binds a port but serve's own free-port probe.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import structlog
import yaml
from hypothesis import given
from hypothesis import strategies as st

import kvload.api
import kvload.llm
from engine.sampling_params import DEFAULT_MAX_TOKENS as GENERATE_LENGTH
from kvload.cli.entry import main
from kvload.serve.command import DEFAULT_MAX_TOKENS as SERVE_LENGTH
from pipeline.config import AUTO
from pipeline.context import DEFAULT_MAX_TOKENS_FIELD
from pipeline.converter import unstructure
from pipeline.errors import ConfigError
from pipeline.paths import flatten, unflatten
from stages import BuildKvManager, plan_stages
from tests.test_precedence_properties import (
    ALL_PROPOSED,
    AUTO_DEFAULT,
    MODELS,
    PROPERTY,
    SOURCE_FIELDS,
    SPEC,
    VALUES,
    Run,
    _api_tree,
    _flag_args,
    _storable,
    proposal_values,
)
from tests.test_precedence_properties import spec_dir as spec_dir  # the fixture

#: Each entry point, the ways the user gives it settings, and the label its audit gives them
ENTRY_SOURCES = {
    "LLM": ["api", "api_object", "api_vllm", "config_file"],
    "generate": ["cli", "config_file"],
    "serve": ["cli", "config_file"],
}
LABEL = {"api": "api", "api_object": "api", "api_vllm": "api", "config_file": "config_file", "cli": "cli"}
#: max_new_tokens of the spec checkpoint's generation_config.json: each entry point sizes its pools by it
MODEL_MAX_NEW_TOKENS = 40
GENERATE = ("--prompt-ids", "1,2,3", "--prompt-ids", "4,5")
SERVE = ("--host", "127.0.0.1", "--port", "0")


class _Started(BaseException):
    """Raised once the entry point's load was captured (a BaseException: no command's handler takes it)."""


@contextlib.contextmanager
def _captured_load() -> Any:
    """The load with weights an entry point makes, run through the plan stages, its result kept in the list."""
    real, got = kvload.api.execute, []

    def execute(request: Any, stages: Any, **kwargs: Any) -> Any:
        if not any(isinstance(stage, BuildKvManager) for stage in stages):  # a check before the load: as it is
            return real(request, stages, **kwargs)
        request.load_weights = False
        got.append(real(request, plan_stages(), log=False))
        raise _Started

    with mock.patch.object(kvload.api, "execute", execute), mock.patch.object(kvload.llm, "execute", execute):
        yield got


def _cli(*argv: str) -> str:
    saved, was_configured = structlog.get_config(), structlog.is_configured()
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err), \
                contextlib.suppress(SystemExit, _Started):
            main(list(argv))
    finally:
        if was_configured:
            structlog.configure(**saved)
        else:
            structlog.reset_defaults()
    return err.getvalue().strip()


def start(entry: str, source: str, model: str, leaves: dict[str, Any], spec: Path,
          file_leaves: dict[str, Any] | None = None) -> Run:
    """The start-up of ``entry`` with ``leaves`` given the ``source`` way (over ``file_leaves`` in its config file)."""
    where = str(spec) if model == SPEC else model
    tmp = Path(tempfile.mkdtemp(prefix="prec-entry-"))
    if source == "config_file":
        leaves, file_leaves = {}, {**(file_leaves or {}), **leaves}
    config = None
    if file_leaves is not None:
        config = str(tmp / "config.yaml")
        Path(config).write_text(yaml.safe_dump(unflatten(file_leaves)), encoding="utf-8")
    error = None
    try:
        with _captured_load() as got:
            if entry == "LLM":
                try:
                    kvload.llm.LLM(where, log=False, config_file=config,
                                   **_api_tree(source if source != "config_file" else "api", leaves))
                except _Started:
                    pass
                except Exception as exc:  # refused before its load
                    error = f"{type(exc).__name__}: {exc}"
            else:
                error = _cli(entry, where, *(GENERATE if entry == "generate" else SERVE), *_flag_args(leaves),
                             *(["--config", config] if config is not None else []), "--log-level", "error")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not got:
        return Run(None, None, error or "no load")
    return Run(flatten(unstructure(got[0].args)), got[0].audit, None)


#: The fields each source of each entry point gives (generate and serve: those with a flag; LLM: every one)
def _fields(source: str) -> list[str]:
    return SOURCE_FIELDS["cli" if source == "cli" else "api"]


def _leaves(source: str, model: str) -> st.SearchStrategy[dict[str, Any]]:
    def values(path: str) -> list[Any]:
        got = [v for v in VALUES[path] if _storable(source, path, v)]
        if model == "tiny-deepseek-v4" and path == "kv_cache_config.use_kv_cache_manager_v2":
            got.remove(False)  # only V2 holds its compressed layers (tests/test_resolution.py)
        return got

    return st.fixed_dictionaries({}, optional={p: st.sampled_from(values(p)) for p in _fields(source)})


@st.composite
def entry_cases(draw: Any) -> tuple[str, str, str, dict[str, Any], dict[str, Any]]:
    entry = draw(st.sampled_from(sorted(ENTRY_SOURCES)))
    source = draw(st.sampled_from(ENTRY_SOURCES[entry]))
    model = draw(st.sampled_from([SPEC, *MODELS, SPEC]))
    proposals = draw(proposal_values) if model == SPEC else {}
    return entry, source, model, proposals, draw(_leaves(source, model))


@pytest.fixture(scope="module")
def spec(spec_dir):
    """The properties' spec checkpoint, with a generation_config.json whose max_new_tokens each entry point sizes
    its pools by."""
    path, spec_cls = spec_dir
    (path / "generation_config.json").write_text(json.dumps({"max_new_tokens": MODEL_MAX_NEW_TOKENS}))
    return path, spec_cls


def _derived(run: Run, field: str = DEFAULT_MAX_TOKENS_FIELD) -> list[dict[str, Any]]:
    return [e for e in run.of("field_derived") if e["field"] == field]


# --- the properties ------------------------------------------------------------------------------------


@PROPERTY
@given(case=entry_cases())
def test_through_an_entry_point_an_explicit_value_wins_and_its_default_is_audited_as_its_own(spec, case):
    entry, source, model, proposals, user = case
    path, spec_cls = spec
    spec_cls.proposals = proposals
    run = start(entry, source, model, user, path)
    assert run.error is None, run.error
    snapshot = run.of("user_fields_snapshotted")[0]["fields"]
    assert set(snapshot) - {"model"} == set(user)  # nothing the entry point filled in counts as the user's
    for field, value in user.items():
        assert snapshot[field] == {"value": value, "source": LABEL[source]}, field
        if value != AUTO and not (field == "max_seq_len" and value is None):
            assert run.final[field] == value, field
        if field in proposals:
            skipped = [(e["kept"], e["kept_source"]) for e in run.of("model_default_skipped") if e["field"] == field]
            assert skipped == [(value, LABEL[source])], field
    for field, value in proposals.items():
        if field not in user:
            assert run.final[field] == value, field
    derived = _derived(run)
    if DEFAULT_MAX_TOKENS_FIELD in user:  # the user's budget default: the entry point's never replaces it
        assert derived == []
    else:
        assert [(e["old"], e["source"]) for e in derived] == [(None, entry)]
        assert run.final[DEFAULT_MAX_TOKENS_FIELD] == derived[0]["new"] > 0
        # it is the entry point's, not a rule's: a bound the user gives sizes the pools instead, and nothing says
        # the entry point's value was ignored (it was never asked for)
        assert not [e for e in run.of("setting_ignored") if e["field"] == DEFAULT_MAX_TOKENS_FIELD]
    budget = run.of("kv_budget_computed")
    bounded = run.final["kv_cache_config.max_tokens"] is not None or run.final["kv_cache_config.max_gpu_total_bytes"]
    if budget and not bounded:
        default = run.final[DEFAULT_MAX_TOKENS_FIELD]
        if default is not None:  # the pools hold the default (at most the sequences generate / serve size them for)
            assert budget[0]["max_tokens"] <= default


@PROPERTY
@given(case=entry_cases(), data=st.data())
def test_through_an_entry_point_an_explicit_auto_is_the_field_left_unset(spec, case, data):
    entry, source, model, proposals, user = case
    field = data.draw(st.sampled_from([p for p in AUTO_DEFAULT if p in _fields(source)]), label="field")
    path, spec_cls = spec
    spec_cls.proposals = proposals
    base = {k: v for k, v in user.items() if k != field}
    unset, auto = start(entry, source, model, base, path), start(entry, source, model, {**base, field: AUTO}, path)
    assert auto.error == unset.error
    assert auto.final == unset.final
    assert auto.decisions() == unset.decisions()
    assert _derived(auto) == [] or [{k: e[k] for k in ("new", "source", "reason")} for e in _derived(auto)] == [
        {k: e[k] for k in ("new", "source", "reason")} for e in _derived(unset)]
    captured = [(e["explicit"], e["source"]) for e in auto.of("auto_captured") if e["field"] == field]
    assert captured == [(True, LABEL[source])]


@PROPERTY
@given(case=entry_cases())
def test_through_an_entry_point_every_auto_is_captured_before_anything_changes_it(spec, case):
    entry, source, model, proposals, user = case
    path, spec_cls = spec
    spec_cls.proposals = proposals
    run = start(entry, source, model, user, path)
    assert run.error is None, run.error
    captured = {e["field"]: e for e in run.of("auto_captured")}
    for field in AUTO_DEFAULT:
        if user.get(field, AUTO) != AUTO:
            assert field not in captured, field
            continue
        seen = captured[field]
        assert (seen["original"], seen["explicit"]) == (AUTO, field in user), field
        changes = [e for e in run.events if e.get("field") == field and "new" in e and e["event"] != "args_parsed"]
        assert changes and all(e["seq"] > seen["seq"] for e in changes), field
    # what the entry point filled in is logged with the value it replaced, before the user's intent is snapshotted
    snap = run.of("user_fields_snapshotted")[0]
    for e in run.of("field_derived"):
        if e["stage"] == "parse_args":
            assert e["seq"] < snap["seq"] and e["source"] == entry, e


#: The same intent given every way of every entry point: the resolved args agree but for the entry point's own
#: budget default, which a bound on the budget keeps from acting.
BOUND = {"kv_cache_config.max_tokens": 4096}
ENTRY_OWN = {DEFAULT_MAX_TOKENS_FIELD}


def _without_own(run: Run) -> tuple[Any, ...]:
    final = {k: v for k, v in run.final.items() if k not in ENTRY_OWN}
    decisions = [d for d in run.decisions() if not (d[0] == "field_derived" and json.loads(d[1]) in ENTRY_OWN)]
    return final, decisions


@PROPERTY
@given(data=st.data())
def test_the_same_intent_resolves_alike_through_every_entry_point_and_source(spec, data):
    model = data.draw(st.sampled_from([SPEC, *MODELS]), label="model")
    path, spec_cls = spec
    spec_cls.proposals = data.draw(proposal_values, label="proposals") if model == SPEC else {}
    user = {**data.draw(_leaves("cli", model), label="user"), **BOUND}
    runs = {(entry, source): start(entry, source, model, user, path)
            for entry, sources in ENTRY_SOURCES.items() for source in sources}
    first = runs["LLM", "api"]
    assert first.error is None, first.error
    for key, run in runs.items():
        assert run.error is None, (key, run.error)
        assert _without_own(run) == _without_own(first), key
    # within one entry point the flags and its config file are the same intent: the same args, its own default too
    for entry, sources in ENTRY_SOURCES.items():
        for source in sources[1:]:
            assert runs[entry, source].final == runs[entry, sources[0]].final, (entry, source)
            assert runs[entry, source].decisions() == runs[entry, sources[0]].decisions(), (entry, source)



@pytest.mark.parametrize("entry_source", [(e, s) for e, sources in ENTRY_SOURCES.items() for s in sources],
                         ids=lambda es: f"{es[0]}-{es[1]}")
def test_every_field_and_value_one_at_a_time_through_every_entry_point(spec, entry_source):
    """The sweep beside the properties (whose draws leave some entry x source x value out): every field x each of
    its values, one at a time, on the spec proposing every settable field: the value wins and is the user's, the
    entry point's budget default is its own, and "auto" is the field left unset."""
    entry, source = entry_source
    path, spec_cls = spec
    spec_cls.proposals = ALL_PROPOSED
    unset = start(entry, source, SPEC, {}, path)
    assert unset.error is None, unset.error
    wrong = []
    for field in _fields(source):
        for value in [v for v in VALUES[field] if _storable(source, field, v)]:
            run = start(entry, source, SPEC, {field: value}, path)
            snapshot = run.of("user_fields_snapshotted")[0]["fields"] if run.error is None else {}
            derived = [(e["old"], e["source"]) for e in _derived(run)]
            ok = (run.error is None and set(snapshot) == {"model", field}
                  and snapshot[field] == {"value": value, "source": LABEL[source]}
                  and (value == AUTO or (field == "max_seq_len" and value is None) or run.final[field] == value)
                  and derived == ([] if field == DEFAULT_MAX_TOKENS_FIELD else [(None, entry)]))
            if ok and value == AUTO and field in AUTO_DEFAULT:
                ok = (run.final, run.decisions()) == (unset.final, unset.decisions())
            if not ok:
                wrong.append((field, value, run.error))
    assert wrong == []



def test_every_value_resolves_alike_through_every_entry_point_and_source(spec):
    """The sweep beside the same-intent property: every field with a flag x each of its values, one at a time over a
    bound budget, given every way of every entry point."""
    path, spec_cls = spec
    spec_cls.proposals = ALL_PROPOSED
    differ = []
    for field in _fields("cli"):
        for value in [v for v in VALUES[field] if _storable("cli", field, v)]:
            leaves = {field: value, **BOUND}
            runs = {(entry, source): start(entry, source, SPEC, leaves, path)
                    for entry, sources in ENTRY_SOURCES.items() for source in sources}
            first = runs["LLM", "api"]
            for (entry, source), run in runs.items():
                if run.error is not None or _without_own(run) != _without_own(first):
                    differ.append((field, value, entry, source, run.error))
                own = runs[entry, ENTRY_SOURCES[entry][0]]
                if (run.final, run.decisions()) != (own.final, own.decisions()):
                    differ.append((field, value, entry, source, "differs from the entry point's first way"))
    assert differ == []


# --- the budget defaults, one by one --------------------------------------------------------------


def test_each_entry_points_budget_default_is_its_own_and_a_user_value_wins(spec):
    """Each from the model's max_new_tokens (its generation_config.json) when it gives one, the model's default being
    more specific than the entry point's generic one (LLM's 8192 tokens, generate's 64 and serve's 256 max_tokens);
    the user's default_max_tokens over each (and over a model's), a bound over both."""
    path, spec_cls = spec
    spec_cls.proposals = {}
    expected = {"LLM": 8 * (MODEL_MAX_NEW_TOKENS + 1024), "generate": 2 * (MODEL_MAX_NEW_TOKENS + 1024),
                "serve": 8 * (MODEL_MAX_NEW_TOKENS + 1024)}
    for entry, sources in ENTRY_SOURCES.items():
        for source in sources:
            run = start(entry, source, SPEC, {}, path)
            assert [(e["new"], e["source"]) for e in _derived(run)] == [(expected[entry], entry)], (entry, source)
            assert run.of("kv_budget_computed")[0]["max_tokens"] == expected[entry], (entry, source)
        for source in ENTRY_SOURCES["LLM"] if entry == "LLM" else ["config_file"]:  # no flag sets it
            run = start(entry, source, SPEC, {DEFAULT_MAX_TOKENS_FIELD: 2048}, path)
            assert _derived(run) == [] and run.final[DEFAULT_MAX_TOKENS_FIELD] == 2048, (entry, source)
            assert run.of("user_fields_snapshotted")[0]["fields"][DEFAULT_MAX_TOKENS_FIELD] == {
                "value": 2048, "source": LABEL[source]}
            assert run.of("kv_budget_computed")[0]["max_tokens"] == 2048, (entry, source)
            bounded = start(entry, source, SPEC, {DEFAULT_MAX_TOKENS_FIELD: 2048, **BOUND}, path)
            assert [e["value"] for e in bounded.of("setting_ignored") if e["field"] == DEFAULT_MAX_TOKENS_FIELD] \
                == [2048], (entry, source)
        # the user's max_new_tokens default over the model's: each entry point sizes the pools by it, however given
        for source in sources:
            run = start(entry, source, SPEC, {"override_generation_config.max_new_tokens": 7}, path)
            assert _derived(run)[0]["new"] == {"LLM": 8 * (7 + 1024), "generate": 2 * (7 + 1024),
                                               "serve": 8 * (7 + 1024)}[entry], (entry, source)
        # generation_config "vllm" leaves the model's generation_config.json out, "auto" is it left unset
        run = start(entry, sources[0], SPEC, {"generation_config": "vllm"}, path)
        assert _derived(run)[0]["new"] == {"LLM": 8192, "generate": 2 * (GENERATE_LENGTH + 1024),
                                         "serve": 8 * (SERVE_LENGTH + 1024)}[entry]


def test_a_request_taking_the_models_default_length_fits_the_pools_of_every_entry_point(tmp_path, capsys):
    """A model whose generation_config.json says max_new_tokens 9,000 (past LLM's generic 8,192-token pools): a
    request that takes the defaults must fit what each entry point sized. kvload.LLM sized 8,192 tokens whatever the
    model said and refused ``llm.generate(prompt)`` ("the KV pools hold 256" blocks) where ``kvload generate`` ran
    it; now LLM's pools follow the model's length too, and the user's max_new_tokens still wins over the model's."""
    from models.weights import random_model
    from tests.cli_support import run_cli
    from tests.paged_support import tiny_config

    config = tiny_config("llama")
    config.max_position_embeddings = 16384
    path = tmp_path / "long"
    random_model(config, device="cpu", dtype="float32", seed=0).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 9000}))
    every_token = list(range(config.vocab_size))  # the first token generated ends each request
    with kvload.llm.LLM(str(path), device="cpu", log=False) as llm:
        assert llm.get_default_sampling_params().max_tokens == 9000  # the model's, over LLM's 64
        (out,) = llm.generate([[1, 2, 3]], stop_token_ids=every_token)
        assert len(out.outputs[0].token_ids) == 1
        (derived,) = [e for e in llm.audit.of("field_derived") if e["field"] == DEFAULT_MAX_TOKENS_FIELD]
        assert derived["new"] == 8 * (9000 + 1024) and "generation_config.json" in derived["reason"]
    with kvload.llm.LLM(str(path), device="cpu", log=False, override_generation_config={"max_new_tokens": 10}) as llm:
        assert llm.get_default_sampling_params().max_tokens == 10
        assert llm.result.kv.budget.max_tokens == 8 * (10 + 1024)
    r = run_cli(capsys, "generate", str(path), "--prompt-ids", "1,2,3", "--stop_token_ids",
                ",".join(map(str, every_token)), "--json")
    assert r.code == 0, r.err


# --- what a started server reports ------------------------------------------------------------------------


def _served_report(argv: list[str]) -> dict[str, Any]:
    """``kvload serve ARGV`` started for real (weights loaded), asked /v1/models and /metrics once listening, then
    stopped: the max_model_len and cache_config_info labels it reports."""
    import httpx

    from kvload.serve import server

    seen: dict[str, Any] = {}

    def serve(state: Any, host: str, port: int, **kwargs: Any) -> None:
        with server.ServerThread(state) as thread, httpx.Client(base_url=thread.url, timeout=60) as http:
            seen["max_model_len"] = http.get("/v1/models").json()["data"][0]["max_model_len"]
            info = [line for line in http.get("/metrics").text.splitlines()
                    if line.startswith("kvload_cache_config_info{")]
            seen["info"] = dict(item.split("=", 1) for item in info[0][info[0].index("{") + 1:
                                                                        info[0].index("}")].split(","))

    with mock.patch.object(server, "serve", serve):
        err = _cli("serve", *argv, *SERVE, "--log-level", "error")
    assert "max_model_len" in seen, err
    return seen


#: The intents the server's report is checked for: each by flags and by a --config file, beside kvload.LLM's
SERVED_INTENTS = [
    {"max_seq_len": 256},
    {"max_seq_len": AUTO},
    {"kv_cache_config.tokens_per_block": 16, "kv_cache_config.enable_block_reuse": False},
    {"kv_cache_config.use_kv_cache_manager_v2": True, "kv_cache_config.tokens_per_block": 64},
]


@pytest.mark.parametrize("intent", SERVED_INTENTS, ids=lambda i: ",".join(f"{k}={v}" for k, v in i.items()))
def test_a_started_server_reports_what_the_same_intent_gives_kvload_llm(intent, tmp_path):
    leaves = {**intent, "kv_cache_config.max_tokens": 2048}
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(unflatten(leaves)), encoding="utf-8")
    with kvload.llm.LLM("tiny-llama", log=False, **_api_tree("api_vllm", leaves)) as llm:
        args = llm.args
        expected = {"max_model_len": str(args.max_seq_len),
                    "block_size": f'"{args.kv_cache_config.tokens_per_block}"',
                    "enable_prefix_caching": f'"{args.kv_cache_config.enable_block_reuse}"',
                    "kv_cache_manager": '"v2"' if args.kv_cache_config.use_kv_cache_manager_v2 else '"v1"'}
    for argv in (["tiny-llama", *_flag_args(leaves)], ["tiny-llama", "--config", str(config)]):
        seen = _served_report(argv)
        got = {"max_model_len": str(seen["max_model_len"]), **{k: seen["info"][k] for k in list(expected)[1:]}}
        assert got == expected, argv


# --- a setting the user turned on through an entry point's switch -------------------------------------


EVENTS_ON = {"enable_kv_cache_events": True, "publisher": "null"}


@pytest.mark.parametrize("entry", ["LLM", "serve"])
def test_kv_events_the_user_turned_on_stay_on_over_a_model_default_of_none(spec, entry):
    """vLLM's enable_kv_cache_events (LLM's kv_events_config, serve's --kv-events-config) turns KV cache events on:
    the entry point fills event_buffer_max_size for it. A model proposing 0 (events off) turned them off again, with
    nothing said (the user's explicit switch lost to a model default); a model's own buffer size keeps them on."""
    from kvload.serve.command import EVENT_BUFFER_DEFAULT

    path, spec_cls = spec
    for proposed, expected in ((0, EVENT_BUFFER_DEFAULT), (16, 16)):
        spec_cls.proposals = {"kv_cache_config.event_buffer_max_size": proposed}
        with _captured_load() as got:
            if entry == "LLM":
                with contextlib.suppress(_Started):
                    kvload.llm.LLM(str(path), log=False, kv_events_config=EVENTS_ON)
            else:
                _cli("serve", str(path), *SERVE, "--kv-events-config", json.dumps(EVENTS_ON), "--log-level", "error")
        assert got, entry
        run = Run(flatten(unstructure(got[0].args)), got[0].audit, None)
        assert run.final["kv_cache_config.event_buffer_max_size"] == expected, proposed
        skipped = [(e["proposed"], e["kept"], e["kept_source"]) for e in run.of("model_default_skipped")
                   if e["field"] == "kv_cache_config.event_buffer_max_size"]
        assert skipped == ([(0, EVENT_BUFFER_DEFAULT, entry)] if proposed == 0 else []), proposed
        assert flatten(run.audit.replay()) == run.final and run.audit.verify() == []


@pytest.mark.parametrize("way", ["LLM keyword", "LLM config_file", "serve flag", "serve config_file"])
def test_kv_events_turned_on_beside_a_user_buffer_of_none_are_refused_however_the_buffer_is_given(tmp_path, way):
    """The user's event_buffer_max_size 0 (events off) beside vLLM's enable_kv_cache_events is a contradiction each
    entry point refuses before anything loads. kvload.LLM read only its keyword: the same 0 in its config_file left
    the events off without a word (the switch accepted, not acting, no setting_ignored)."""
    config = tmp_path / "events.yaml"
    config.write_text(yaml.safe_dump({"kv_cache_config": {"event_buffer_max_size": 0}}), encoding="utf-8")
    with _captured_load() as got:
        if way.startswith("LLM"):
            given = {"config_file": str(config)} if way.endswith("config_file") else {
                "kv_cache_config": {"event_buffer_max_size": 0}}
            with pytest.raises(ConfigError, match="enable_kv_cache_events is true but kv_cache_config"
                                                  r"\.event_buffer_max_size is 0"):
                kvload.llm.LLM("tiny-llama", log=False, kv_events_config=EVENTS_ON, **given)
        else:
            given = ["--config", str(config)] if way.endswith("config_file") else ["--event_buffer_max_size", "0"]
            err = _cli("serve", "tiny-llama", *SERVE, *given, "--kv-events-config", json.dumps(EVENTS_ON))
            assert "enable_kv_cache_events is true but kv_cache_config.event_buffer_max_size is 0" in err
    assert got == []  # refused before the load
