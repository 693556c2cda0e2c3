"""The precedence contract, as properties over every field, every source and the bundled presets.

DESIGN.md "Configuration" and "Stages" 2-4: an explicit user value (one equal to the default, and an explicit
``"auto"``, included) always wins over a model default and the audit names its source; an explicit ``"auto"`` behaves
as the field left unset (same resolved args, same decisions); the original of every ``"auto"`` field is captured
before anything changes it; the audit replays to the resolved args, and the user values it records reproduce the run;
a setting that changes a resolved value changes the KV plan (or other args) or is named by ``setting_ignored``.

Sources: the Python API (``pipeline.plan(**overrides)``), a ``--config`` YAML file (``config_file=``) and the command
line (``kvload plan`` in this process, its ``--audit-log`` read back). kvload reads no configuration from the
environment. Models: every bundled preset, and a registered spec proposing any subset of the fields a model may set
(``stages.apply_model_defaults.MODEL_SETTABLE``), each with a value of its own.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import pytest
import structlog
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipeline
from kvload.cli.entry import main
from kvload.cli.flags import FLAGS
from models import ModelSpec, presets, register_model, unregister_model
from models.checkpoint import PRESETS_DIR
from pipeline.audit import AuditLog
from pipeline.config import AUTO, GenerationDefaults, KvCacheConfig, LlmArgs, framework_defaults, public_fields
from pipeline.converter import unstructure
from pipeline.errors import KvloadError
from pipeline.paths import flatten, unflatten
from pipeline.vllm_compat import SAME_MEANING
from stages.apply_model_defaults import MODEL_SETTABLE

PRESETS = presets()
SPEC = "<spec>"  # the registered spec below, whose proposals each example chooses
MODELS = [*PRESETS, SPEC]

#: Values every field takes that keep a plan of every model valid: its default among them, "auto" where it takes one.
VALUES: dict[str, list[Any]] = {
    "dtype": [AUTO, "float32", "float16", "bfloat16"],
    "device": [AUTO, "cpu"],
    "max_batch_size": [2048, 1, 8],
    "max_seq_len": [None, AUTO, 64, 512],
    "max_num_tokens": [8192, 256],
    "max_beam_width": [1],  # > 1 with V2 is a RouteError (tests/test_resolution.py)
    "scheduling_policy": ["fcfs", "priority"],
    "weights_seed": [0, 5],
    "attention_backend": [AUTO, "flex", "sdpa", "triton", "cpu_kernel"],
    "linear_backend": [AUTO, "torch", "cpu_kernel"],
    "max_draft_len": [0, 4],
    "max_matching_ngram_size": [2, 1, 3],
    "speculation_max_batch_size": [1, 4],
    "tensor_parallel_size": [1],  # more ranks: tests/test_tensor_parallel_plan.py
    "generation_config": [AUTO, "vllm"],
    "override_generation_config.temperature": [None, 0.5],
    "override_generation_config.top_p": [None, 0.9],
    "override_generation_config.top_k": [None, 5],
    "override_generation_config.min_p": [None, 0.1],
    "override_generation_config.repetition_penalty": [None, 1.2],
    "override_generation_config.max_new_tokens": [None, 7],
    "override_generation_config.do_sample": [None, True],  # false with a temperature: refused
    "kv_cache_config.use_kv_cache_manager_v2": [AUTO, True, False],
    "kv_cache_config.tokens_per_block": [32, 16, 64, 128],
    "kv_cache_config.enable_block_reuse": [True, False],
    "kv_cache_config.enable_partial_reuse": [True, False],
    "kv_cache_config.free_gpu_memory_fraction": [0.9, 0.5, 1.0],
    "kv_cache_config.max_tokens": [None, 1024, 4096],
    "kv_cache_config.default_max_tokens": [None, 2048],
    "kv_cache_config.max_gpu_total_bytes": [0, 2**30],
    "kv_cache_config.host_cache_size": [None, 0, 2**24],
    "kv_cache_config.dtype": [AUTO, "float32", "float16", "bfloat16", "float8_e4m3fn"],
    "kv_cache_config.max_util_for_resume": [0.95, 0.5],
    "kv_cache_config.enable_swa_scratch_reuse": [True, False],
    "kv_cache_config.event_buffer_max_size": [0, 16],
    "kv_cache_config.pool_arena": [AUTO, True, False],
    "kv_cache_config.max_page_padding": [0.0, 0.1],
}
FIELDS = sorted(VALUES)
#: Fields whose default is "auto" (``max_seq_len``'s is null: its "auto" is a value of its own, vLLM's -1).
AUTO_DEFAULT = sorted(p for p, v in flatten(framework_defaults()).items() if v == AUTO)
#: Fields each source can give: the API and a YAML file every one, the command line those with a flag.
CLI_FLAG = {f.path: f for f in FLAGS if f.const is None}
CLI_FIELDS = sorted({f.path for f in FLAGS} | {p for p in FIELDS if p.startswith("override_generation_config.")})
#: The Python API three ways: keyword dicts, config objects (``KvCacheConfig(...)``: its explicit fields only), and
#: vLLM's keyword names of kvload fields (``block_size=``, ``max_model_len=-1``); the audit says "api" for each.
SOURCES = ["api", "api_object", "api_vllm", "config_file", "cli"]
LABEL = {"api": "api", "api_object": "api", "api_vllm": "api", "config_file": "config_file", "cli": "cli"}
SOURCE_FIELDS = {**dict.fromkeys(("api", "api_object", "api_vllm", "config_file"), FIELDS),
                 "cli": [p for p in FIELDS if p in CLI_FIELDS]}
VLLM_NAME = {path: name for name, path in SAME_MEANING.items()}


def test_the_tables_cover_every_field():
    """A field added to the config classes must get values here (and so every property below)."""
    every = {a.name for a in public_fields(LlmArgs)} - {"model", "kv_cache_config", "override_generation_config"}
    every |= {f"kv_cache_config.{a.name}" for a in public_fields(KvCacheConfig)}
    every |= {f"override_generation_config.{a.name}" for a in public_fields(GenerationDefaults)}
    assert set(VALUES) == every
    assert set(VALUES) >= MODEL_SETTABLE
    for path, values in VALUES.items():
        assert flatten(framework_defaults())[path] == values[0], path  # the default first


def _storable(source: str, path: str, value: Any) -> bool:
    """Whether ``source`` can give ``value`` for ``path`` (a flag cannot say null; vLLM's None is its unset)."""
    return value is not None or not (source == "cli" or (source == "api_vllm" and path in VLLM_NAME))


def _api_tree(source: str, leaves: dict[str, Any]) -> dict[str, Any]:
    """The keywords of an API call giving ``leaves`` the ``source`` way."""
    if source == "api_vllm":
        named = {VLLM_NAME.get(p, p): (-1 if p == "max_seq_len" and v == AUTO else v) for p, v in leaves.items()}
        return unflatten(named)
    tree = unflatten(leaves)
    if source == "api_object":
        for key, cls in (("kv_cache_config", KvCacheConfig), ("override_generation_config", GenerationDefaults)):
            if key in tree:
                tree[key] = cls(**tree[key])
    return tree


# --- running one plan from one source -------------------------------------------------------


class Run:
    """What one plan gave: the resolved args (flat), the audit's events, or the error."""

    def __init__(self, final: dict[str, Any] | None, audit: AuditLog | None, error: str | None) -> None:
        self.final, self.audit, self.error = final, audit, error

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.audit.events if self.audit is not None else []

    def of(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == name]

    def decisions(self) -> list[Any]:
        """What the run decided, leaving out how the user spelled it: every resolved value and derived field, the
        route, the budget, each setting said to be ignored."""
        keep = {
            "auto_resolved": ("field", "new", "source"),
            "field_derived": ("field", "new", "source"),
            "route_fallback": ("field", "new"),
            "executor_routed": ("kv_manager", "scheduler", "use_kv_cache_manager_v2"),
            "setting_ignored": ("field", "value"),
            "kv_budget_computed": None,
            "sampling_defaults_resolved": None,
        }
        out = []
        for e in self.events:
            if e["event"] not in keep:
                continue
            keys = keep[e["event"]] or [k for k in e if k not in ("seq", "ts", "stage", "reason", "event")]
            out.append((e["event"], *[json.dumps(e.get(k), sort_keys=True, default=str) for k in keys]))
        return sorted(out)


def _plan_api(model: str, leaves: dict[str, Any], config_file: str | None = None, source: str = "api") -> Run:
    try:
        result = pipeline.plan(model, log=False, config_file=config_file, **_api_tree(source, leaves))
    except KvloadError as exc:
        return Run(None, getattr(exc, "audit", None), f"{type(exc).__name__}: {exc}")
    return Run(flatten(unstructure(result.args)), result.audit, None)


def _plan_yaml(model: str, leaves: dict[str, Any], tmp: Path) -> Run:
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(unflatten(leaves)), encoding="utf-8")
    return _plan_api(model, {}, config_file=str(path))


def _flag_args(leaves: dict[str, Any]) -> list[str]:
    argv: list[str] = []
    generation: dict[str, Any] = {}
    for path, value in leaves.items():
        if path.startswith("override_generation_config."):
            generation[path.split(".", 1)[1]] = value
        elif path == "kv_cache_config.enable_block_reuse":
            argv.append("--enable_prefix_caching" if value else "--disable_kv_cache_reuse")
        else:
            text = str(value).lower() if isinstance(value, bool) else str(value)
            argv += [CLI_FLAG[path].name, text]
    if generation:
        argv += ["--override_generation_config", json.dumps(generation)]
    return argv


def _cli(*argv: str) -> tuple[int, str]:
    """``kvload ARGV`` in this process: (exit status, stderr)."""
    saved, was_configured = structlog.get_config(), structlog.is_configured()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exc:  # argparse: a usage error
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        if was_configured:
            structlog.configure(**saved)
        else:
            structlog.reset_defaults()
    return code, err.getvalue().strip()


def _plan_cli(model: str, leaves: dict[str, Any], tmp: Path, config_file: str | None = None) -> Run:
    log = tmp / "audit.jsonl"
    config = ["--config", config_file] if config_file is not None else []
    code, err = _cli("plan", model, *_flag_args(leaves), *config, "--audit-log", str(log), "--force", "--json",
                     "--log-level", "error")
    if code != 0:
        return Run(None, None, err)
    verified, err = _cli("audit", str(log), "--verify")
    assert verified == 0, err  # kvload audit --verify: the file replays to the args it recorded
    audit = AuditLog.from_jsonl(log)
    return Run(flatten(audit.final_args()), audit, None)


def plan(source: str, model: str, leaves: dict[str, Any], spec_dir: Path,
         file_leaves: dict[str, Any] | None = None) -> Run:
    """One plan of ``model`` with ``leaves`` given by ``source`` (over ``file_leaves`` in a --config file)."""
    where = str(spec_dir) if model == SPEC else model
    tmp = Path(tempfile.mkdtemp(prefix="prec-"))
    config_file = None
    if file_leaves is not None:
        config_file = str(tmp / "under.yaml")
        Path(config_file).write_text(yaml.safe_dump(unflatten(file_leaves)), encoding="utf-8")
    try:
        if source.startswith("api"):
            return _plan_api(where, leaves, config_file=config_file, source=source)
        if source == "config_file":
            return _plan_yaml(where, leaves, tmp)
        return _plan_cli(where, leaves, tmp, config_file=config_file)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- the model whose proposals each example picks -------------------------------------------------


ARCH = "PrecedencePropertyForCausalLM"


@pytest.fixture(scope="module")
def spec_dir(tmp_path_factory):
    """A checkpoint of a registered architecture whose model defaults are ``PropertySpec.proposals``."""

    @register_model(ARCH, replace=True)
    class PropertySpec(ModelSpec):
        proposals: ClassVar[dict[str, Any]] = {}

        def get_model_defaults(self, args: Any) -> dict[str, Any]:
            return unflatten(type(self).proposals)

    config = json.loads((PRESETS_DIR / "tiny-llama" / "config.json").read_text())
    config["architectures"] = [ARCH]
    path = tmp_path_factory.mktemp("spec") / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    yield path, PropertySpec
    unregister_model(ARCH)


#: A model may propose any concrete value (never "auto", never null).
proposal_values = st.fixed_dictionaries({}, optional={
    p: st.sampled_from([v for v in VALUES[p] if v not in (AUTO, None)]) for p in sorted(MODEL_SETTABLE)})


def _user_leaves(source: str, model: str) -> st.SearchStrategy[dict[str, Any]]:
    def values(path: str) -> list[Any]:
        got = [v for v in VALUES[path] if _storable(source, path, v)]
        if model == "tiny-deepseek-v4" and path == "kv_cache_config.use_kv_cache_manager_v2":
            got.remove(False)  # only V2 holds its compressed layers: a RouteError (tests/test_resolution.py)
        return got

    return st.fixed_dictionaries({}, optional={p: st.sampled_from(values(p)) for p in SOURCE_FIELDS[source]})


@st.composite
def cases(draw: Any) -> tuple[str, str, dict[str, Any], dict[str, Any]]:
    source = draw(st.sampled_from(SOURCES))
    model = draw(st.sampled_from([SPEC, *MODELS, SPEC]))  # the model that proposes every settable field, oftener
    proposals = draw(proposal_values) if model == SPEC else {}
    user = draw(_user_leaves(source, model))
    return source, model, proposals, user


PROPERTY = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                            HealthCheck.too_slow])


# --- the properties ------------------------------------------------------------------------------------


@PROPERTY
@given(case=cases())
def test_an_explicit_value_always_wins_and_the_audit_names_its_source(spec_dir, case):
    source, model, proposals, user = case
    path, spec_cls = spec_dir
    spec_cls.proposals = proposals
    run = plan(source, model, user, path)
    assert run.error is None, run.error
    snapshot = run.of("user_fields_snapshotted")[0]["fields"]
    for field, value in user.items():
        assert snapshot[field] == {"value": value, "source": LABEL[source]}, field
        parsed = [e for e in run.of("args_parsed") if e["field"] == field]
        assert [(e["new"], e["source"]) for e in parsed] == [(value, LABEL[source])], field
        if value != AUTO and not (field == "max_seq_len" and value is None):
            assert run.final[field] == value, field  # explicit (also equal to the default) wins
        if field in proposals:
            skipped = [e for e in run.of("model_default_skipped") if e["field"] == field]
            assert [(e["kept"], e["kept_source"]) for e in skipped] == [(value, LABEL[source])], field
            assert not [e for e in run.of("model_default_applied") if e["field"] == field], field
    for field, value in proposals.items():
        if field not in user:
            assert run.final[field] == value, field
            applied = [e for e in run.of("model_default_applied") if e["field"] == field]
            assert [(e["new"], e["source"]) for e in applied] == [(value, "model_default")], field


@PROPERTY
@given(case=cases(), data=st.data())
def test_a_flag_or_argument_wins_over_the_config_file_and_both_over_a_model_default(spec_dir, case, data):
    source, model, proposals, user = case
    if source == "config_file":
        source = "api"  # a file under the Python keywords, or under the flags
    file_leaves = data.draw(_user_leaves("config_file", model), label="file")
    path, spec_cls = spec_dir
    spec_cls.proposals = proposals
    run = plan(source, model, {k: v for k, v in user.items() if k in SOURCE_FIELDS[source]}, path, file_leaves)
    assert run.error is None, run.error
    snapshot = run.of("user_fields_snapshotted")[0]["fields"]
    conflicts = {e["field"]: e for e in run.of("source_conflict")}
    for field in set(user) | set(file_leaves):
        value, label = (user[field], LABEL[source]) if field in user else (file_leaves[field], "config_file")
        assert snapshot[field] == {"value": value, "source": label}, field
        if value != AUTO and not (field == "max_seq_len" and value is None):
            assert run.final[field] == value, field
        if field in user and field in file_leaves and user[field] != file_leaves[field]:
            seen = conflicts.pop(field)
            assert (seen["kept"], seen["kept_source"], seen["overridden"], seen["overridden_source"]) == (
                user[field], LABEL[source], file_leaves[field], "config_file")
        if field in proposals:
            skipped = [(e["kept"], e["kept_source"]) for e in run.of("model_default_skipped") if e["field"] == field]
            assert skipped == [(value, label)], field
    assert not conflicts


@PROPERTY
@given(case=cases(), data=st.data())
def test_an_explicit_auto_is_the_field_left_unset(spec_dir, case, data):
    source, model, proposals, user = case
    field = data.draw(st.sampled_from([p for p in AUTO_DEFAULT if p in SOURCE_FIELDS[source]]), label="field")
    path, spec_cls = spec_dir
    spec_cls.proposals = proposals
    base = {k: v for k, v in user.items() if k != field}
    unset = plan(source, model, base, path)
    auto = plan(source, model, {**base, field: AUTO}, path)
    assert auto.error == unset.error
    assert auto.final == unset.final
    assert auto.decisions() == unset.decisions()
    captured = [(e["field"], e["explicit"], e["source"]) for e in auto.of("auto_captured") if e["field"] == field]
    assert captured == [(field, True, LABEL[source])]


@PROPERTY
@given(case=cases())
def test_every_auto_is_captured_before_anything_changes_it_and_resolved_with_its_original(spec_dir, case):
    source, model, proposals, user = case
    path, spec_cls = spec_dir
    spec_cls.proposals = proposals
    run = plan(source, model, user, path)
    assert run.error is None, run.error
    captured = {e["field"]: e for e in run.of("auto_captured")}
    for field in AUTO_DEFAULT + (["max_seq_len"] if user.get("max_seq_len") == AUTO else []):
        if user.get(field, AUTO) != AUTO:
            assert field not in captured, field
            continue
        seen = captured[field]
        assert (seen["original"], seen["explicit"], seen["source"]) == (
            AUTO, field in user, LABEL[source] if field in user else "default"), field
        changes = [e for e in run.events if e.get("field") == field and "new" in e and e["event"] != "args_parsed"]
        assert changes and all(e["seq"] > seen["seq"] for e in changes), field
        resolved = [e for e in changes if e["event"] == "auto_resolved"]
        assert len(resolved) == 1 and resolved[0]["original"] == AUTO, field
        assert resolved[0]["new"] != AUTO
    # the snapshot of user intent comes before every model default, and holds the values as given
    snap = run.of("user_fields_snapshotted")[0]
    assert all(e["seq"] > snap["seq"] for e in run.of("model_default_applied") + run.of("model_default_skipped"))


@PROPERTY
@given(case=cases())
def test_the_audit_replays_to_the_resolved_args_and_its_user_values_reproduce_the_run(spec_dir, case):
    source, model, proposals, user = case
    path, spec_cls = spec_dir
    spec_cls.proposals = proposals
    run = plan(source, model, user, path)
    assert run.error is None, run.error
    assert flatten(run.audit.replay()) == run.final
    assert run.audit.verify() == []
    # the run again from what its audit recorded as the user's: the same args, the same decisions
    recorded = {p: entry["value"] for p, entry in run.of("user_fields_snapshotted")[0]["fields"].items()
                if p != "model"}
    again = plan("api", model, recorded, path)
    assert again.final == run.final
    assert again.decisions() == run.decisions()


#: The settings a plan acts on (the KV plan, the route, the resolved args); the others act when a load builds the
#: manager or loads weights, or generate runs (block reuse, partial reuse, resume threshold, window scratch: the V2
#: manager; the model dtype: the weights, and the plan only through kv_cache_config.dtype and linear_backend when
#: they are "auto"; batch and token limits, policy, drafts, backends, sampling defaults, weights seed: the engine).
PLAN_FIELDS = ["device", "max_seq_len", "kv_cache_config.use_kv_cache_manager_v2",
               "kv_cache_config.tokens_per_block", "kv_cache_config.free_gpu_memory_fraction",
               "kv_cache_config.max_tokens", "kv_cache_config.default_max_tokens",
               "kv_cache_config.max_gpu_total_bytes", "kv_cache_config.host_cache_size", "kv_cache_config.dtype",
               "kv_cache_config.pool_arena", "kv_cache_config.event_buffer_max_size",
               "kv_cache_config.max_page_padding"]


def _plan_of(run: Run, model: str, leaves: dict[str, Any], spec_dir: Path) -> Any:
    """The KV plan of the same run through the API (the CLI's audit holds no KvPlan object)."""
    result = pipeline.plan(str(spec_dir) if model == SPEC else model, log=False, **unflatten(leaves))
    assert flatten(unstructure(result.args)) == run.final
    return result.kv.to_dict() if result.kv is not None else None


@PROPERTY
@given(case=cases(), data=st.data())
def test_a_setting_that_changes_a_value_changes_the_plan_or_is_said_to_be_ignored(spec_dir, case, data):
    source, model, proposals, user = case
    field = data.draw(st.sampled_from([p for p in PLAN_FIELDS if p in SOURCE_FIELDS[source]]), label="field")
    value = data.draw(st.sampled_from([v for v in VALUES[field] if _storable(source, field, v)
                                       and not (model == "tiny-deepseek-v4" and v is False
                                                and field.endswith("use_kv_cache_manager_v2"))]), label="value")
    path, spec_cls = spec_dir
    spec_cls.proposals = proposals
    base = {k: v for k, v in user.items() if k != field}
    before, after = plan(source, model, base, path), plan(source, model, {**base, field: value}, path)
    if before.error or after.error or before.final[field] == after.final[field] or value == 0:
        return  # refused (tested elsewhere), no value changed, or "none" asked for (no host tier, no events, no cap)
    if [e for e in after.of("setting_ignored") if e["field"] == field]:
        return
    planned, unset = _plan_of(after, model, {**base, field: value}, path), _plan_of(before, model, base, path)
    if planned is None or planned["total_bytes"] is None:
        return  # no pools planned (no rule bounds the budget on this CPU): nothing could act, the plan says why
    acted = planned != unset
    others = {k for k in after.final if after.final[k] != before.final[k]} - {field}
    assert acted or others, f"{field}={value!r} changed the args and nothing else, with no setting_ignored"


#: One value for every field a model may set, none of them the framework default (the spec's proposals in the sweeps).
ALL_PROPOSED = {p: next(v for v in VALUES[p][1:] if v not in (AUTO, None)) for p in sorted(MODEL_SETTABLE)}


#: A budget that bounds the pools on this CPU (without one a plan has no pools for a setting to act on).
BUDGET = {"kv_cache_config.max_tokens": 4096}


@pytest.mark.parametrize("source", SOURCES)
def test_every_auto_field_given_auto_is_unset_on_every_model(spec_dir, source):
    """The sweep beside the property: every "auto"-default field x every model (the spec proposing every settable
    field), explicitly "auto" against left out, from one source."""
    path, spec_cls = spec_dir
    spec_cls.proposals = ALL_PROPOSED
    for model, field in itertools.product(MODELS, [p for p in AUTO_DEFAULT if p in SOURCE_FIELDS[source]]):
        unset = plan(source, model, BUDGET, path)
        auto = plan(source, model, {**BUDGET, field: AUTO}, path)
        assert (auto.error, auto.final, auto.decisions()) == (unset.error, unset.final, unset.decisions()), \
            (model, field)


def test_every_plan_setting_that_changes_a_value_acts_or_is_said_to_be_ignored_on_every_model(spec_dir):
    """The sweep beside the property: every plan field x each of its values x every model, one at a time over a
    bounded budget."""
    path, spec_cls = spec_dir
    spec_cls.proposals = ALL_PROPOSED
    silent = []
    for model, field in itertools.product(MODELS, PLAN_FIELDS):
        base = BUDGET if field != "kv_cache_config.max_tokens" else {}
        before = plan("api", model, base, path)
        for value in VALUES[field]:
            if value == 0 or (model == "tiny-deepseek-v4" and value is False and field.endswith("manager_v2")):
                continue
            after = plan("api", model, {**base, field: value}, path)
            if after.error or before.error or after.final[field] == before.final[field]:
                continue
            if [e for e in after.of("setting_ignored") if e["field"] == field]:
                continue
            planned, unset = _plan_of(after, model, {**base, field: value}, path), _plan_of(before, model, base, path)
            if planned is None or planned["total_bytes"] is None:
                continue
            others = {k for k in after.final if after.final[k] != before.final[k]} - {field}
            if planned == unset and not others:
                silent.append((model, field, value))
    assert silent == []


def test_the_property_tables_count():
    """What the properties range over (the report's counts)."""
    assert len(MODELS) == len(PRESETS) + 1 == 7
    assert len(FIELDS) == 37 and len(MODEL_SETTABLE) == 12 and len(AUTO_DEFAULT) == 8
    assert [len(SOURCE_FIELDS[s]) for s in SOURCES] == [37, 37, 37, 37, 32]
