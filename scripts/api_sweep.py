"""Hostile-input sweep of kvload's Python API (``kvload.LLM`` and its parameter classes), to find what still breaks.

Every keyword of ``SamplingParams``, ``BeamSearchParams``, ``PoolingParams``, ``StructuredOutputsParams``, a set of
``LLM(...)``'s and the calls ``generate`` / ``chat`` / ``embed`` / ``score`` / ``beam_search`` / ``generate_stream``
is given hostile values (wrong types, NaN, infinities, negatives, 2**63, lone surrogates, empty and nested junk), a
typo of its name, and the prompts odd forms (empty, out-of-vocabulary or negative ids, a mix, 10**6 tokens, lists of
sampling params of the wrong length). One tiny llama (a word-level tokenizer: token i is "w<i>") is loaded once and
every call case runs on it. Each case is one JSON line: the exception's type and message (or "accepted"), the time,
a hang (past ``--timeout``), whether the same LLM still gives the baseline's tokens afterwards, and what was left:
threads, open file descriptors, child processes, files in ``$TMPDIR`` and ``$KVLOAD_CACHE``. ``hf_overrides.*``
loads the llama with each hostile ``LLM(hf_overrides=...)`` dict (a value taken must then generate); ``classify.*``,
``classify_pool.*``, ``classify_reward.*`` and ``ce_score.*`` call ``LLM.classify`` and ``LLM.reward`` on a tiny
3-label classifier and ``LLM.score`` on a one-label cross-encoder (``tests/classify_support.py``), both checked to
answer as before after each case. The front door's newer arguments (``tokenization_kwargs`` on every call that takes
it: itself, its ``truncate_prompt_tokens``, keys kvload lacks, the cut given twice; ``output_kind``;
``reset_prefix_cache``'s, ``get_world_size``'s and ``reset_mm_cache``'s arguments) are ``front_door_cases``.

sweep69 added values the first list never tried (``NEW_VALUES``: an int past 4,300 digits, alias bombs, a million-item
list, str / int subclasses whose own methods raise, a generator, a 10**7 numpy array, a tensor with requires_grad, a
NaN dict key) and the doors ``kvload.plan`` / ``load``, ``KvCacheConfig`` / ``LlmArgs``, ``simulate``, ``build_state``
and the CLI (``plan.``, ``plan_kv.``, ``load.``, ``kv_config.``, ``llm_args.``, ``simulate.``, ``serve.``, ``cli.``).
Cases run in a worker process that is killed at ``--timeout`` (an alias bomb written out in C holds the GIL) and
started again after the case that hung.

    python scripts/api_sweep.py --out /tmp/api_sweep.jsonl            # every case (a few minutes)
    python scripts/api_sweep.py --out /tmp/api_sweep.jsonl --only sp.  # the cases whose name starts "sp."
    python scripts/api_sweep.py --out /tmp/api_sweep.jsonl --only plan,simulate --kinds alias_bomb,bigint
    python scripts/api_sweep.py --out /tmp/api_sweep.jsonl --summary   # the suspects of a results file

A suspect: an exception that is neither ValueError nor TypeError (an IndexError, a RuntimeError from torch), a
message of more than one line, that cannot be printed (a lone surrogate) or that does not name the argument, a typo
(``*.typo``) not answered with "did you mean", a hang, leftovers, an LLM that no longer gives the baseline's tokens,
or a hostile value accepted (judge these: ``None`` is often a real default).
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


class Make:
    """A value built afresh for each case (a generator is consumed once; a big array is not kept between cases)."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self.build = build


class Fresh(Mapping[str, Any]):
    """A dict of hostile values whose :class:`Make` entries are built anew on each lookup: ``value=X[kind]`` in a
    case's defaults gives each case its own (the same generator given to two cases reached the second consumed)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.raw = values  # the entries as given (Make unbuilt): for building another Fresh on them

    def __getitem__(self, key: str) -> Any:
        value = self.raw[key]
        return value.build() if isinstance(value, Make) else value

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)


class DunderError(Exception):
    """Raised by :class:`EvilStr` / :class:`EvilInt`'s own methods: a case ending in it shows which method kvload
    called on a user's object without guarding it (``raised_in`` is then that method, the record's ``called_from``
    kvload's line)."""


def _evil(name: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any) -> Any:
        raise DunderError(f"hostile {type(self).__name__}.{name} called")
    method.__name__ = name
    return method


_DUNDERS = ("__repr__", "__str__", "__eq__", "__ne__", "__hash__", "__bool__", "__len__", "__iter__", "__format__",
            "__index__", "__int__", "__float__", "__lt__", "__le__", "__gt__", "__ge__")
#: A ``str`` / ``int`` subclass each of whose methods a check could call raises.
EvilStr = type("EvilStr", (str,), {name: _evil(name) for name in _DUNDERS if name not in ("__index__",)})
EvilInt = type("EvilInt", (int,), {name: _evil(name) for name in _DUNDERS})


def alias_bomb(levels: int = 40) -> list[Any]:
    """A few hundred bytes that hold 2**levels items when written out: any repr / json.dumps / walk never returns."""
    bomb: list[Any] = []
    for _ in range(levels):
        bomb = [bomb, bomb]
    return bomb


def _numpy_big() -> Any:
    import numpy

    return numpy.zeros(10 ** 7)  # where a scalar is wanted: 80 MB of it (calloc: no page is touched until read)


def _tensor_grad() -> Any:
    import torch

    return torch.tensor(1.0, requires_grad=True)  # .numpy() refuses it; .item() does not


def _generator() -> Any:
    return (i for i in [1, 2, 3])


#: sweep69's values: what the first list never tried (each hit a real bug somewhere). A case given one of these runs
#: in the worker process the supervisor kills at ``--timeout`` (an alias bomb in C code holds the GIL: no thread
#: timeout and no SIGALRM ends it).
NEW_VALUES: dict[str, Any] = {
    "bigint": 10 ** 5000,  # past Python's 4,300-digit str() limit: str/repr of it raises ValueError
    "alias_bomb": Make(alias_bomb), "dict_bomb": Make(lambda: {"a": alias_bomb(), "b": alias_bomb()}),
    "million_list": Make(lambda: [1] * 10 ** 6), "evil_str": Make(lambda: EvilStr("abc")),
    "evil_int": Make(lambda: EvilInt(3)), "generator": Make(_generator), "numpy_big": Make(_numpy_big),
    "tensor_grad": Make(_tensor_grad), "nan_key": Make(lambda: {math.nan: 1}),
}
HOSTILE: Fresh = Fresh({
    "str": "abc", "float": 1.5, "bool": True, "none": None, "list": [1], "dict": {"a": 1}, "bytes": b"1",
    "nan": math.nan, "inf": math.inf, "-inf": -math.inf, "neg": -1, "zero": 0, "huge": 2 ** 63,
    "surrogate": "\ud800", "empty_str": "", "empty_list": [], "nested": [{"a": [None, b"x"]}], "object": object(),
    **NEW_VALUES,
})
#: Kinds of value that nothing in the API should accept silently.
NEVER_OK = {"bytes", "nan", "dict", "nested", "object", "surrogate", "bigint", "alias_bomb", "dict_bomb",
            "evil_str", "evil_int", "numpy_big", "nan_key"}
PROMPT = "w5 w17 w300 w42 w9"
BASE_IDS = [5, 17, 300, 42, 9]
VOCAB = 512
SPECS = {"json", "regex", "choice", "grammar", "json_object"}  # StructuredOutputsParams' one-of fields
#: Hostile kinds that are real values of one argument (a JSON schema is a dict, template variables are).
TAKES = {"so.json.dict", "chat.chat_template_kwargs.dict"}
#: Cases that write a file on purpose (the audit log the user asked for).
WRITES = ("llm.audit_log.",)


def _fd_count() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def _children() -> list[int]:
    """Our live child processes (not zombies already reaped)."""
    out = []
    me = str(os.getpid())
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[1] == me:
            out.append(int(pid))
    return out


def _files(*folders: Path) -> set[str]:
    found: set[str] = set()
    for folder in folders:
        if folder.is_dir():
            found |= {str(p) for p in folder.rglob("*")}
    return found


def _tokens(llm: Any) -> list[int]:
    from kvload import SamplingParams

    return list(llm.generate(BASE_IDS, SamplingParams(max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids)


def _safe_repr(value: Any) -> str:
    """What a call returned, for the record: cut, never hanging on an alias bomb nor raising on a huge int."""
    import reprlib

    cut = reprlib.Repr()
    cut.maxlevel, cut.maxstring, cut.maxother, cut.maxlong = 3, 80, 80, 80
    try:
        return cut.repr(value)[:160]
    except Exception as e:  # a huge int (reprlib writes it out first), a user's __repr__
        return f"<unprintable {type(value).__name__}: {type(e).__name__}>"


def run_case(name: str, fn: Callable[[], Any], llm: Any, baseline: Any, timeout: float,
             watch: list[Path], probe: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Run ``fn`` in a thread (a hang is seen, not waited for), then check the LLM and what was left."""
    threads, fds, files = {t.ident for t in threading.enumerate()}, _fd_count(), _files(*watch)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            value = fn()
            if hasattr(value, "__next__"):  # a stream: drain it, as a user's loop would
                value = list(value)
            box["value"] = value
        except BaseException as e:  # recorded, whatever it is
            box["exc"] = e

    start = time.monotonic()
    worker = threading.Thread(target=target, name=f"sweep-{name}", daemon=True)
    worker.start()
    worker.join(timeout)
    rec: dict[str, Any] = {"case": name, "s": round(time.monotonic() - start, 3)}
    if worker.is_alive():
        rec["hang"] = True
        return rec
    exc = box.get("exc")
    if exc is None:
        rec["outcome"] = "accepted"
        rec["value"] = _safe_repr(box.get("value"))
    else:
        rec["outcome"] = type(exc).__name__
        rec["mro"] = [c.__name__ for c in type(exc).__mro__]
        rec["message"] = str(exc)[:600]
        if name.endswith(".typo"):  # said past the cut of a long message (every field listed first)
            rec["suggests"] = "did you mean" in str(exc)
        frames = []
        tb = exc.__traceback__
        while tb is not None:
            frames.append(f"{Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno}")
            tb = tb.tb_next
        if frames:
            rec["raised_in"] = frames[-1]
        if isinstance(exc, DunderError) and len(frames) > 1:  # the line of kvload's that called the user's method
            rec["called_from"] = frames[-2]
    if llm is not None and baseline is not None:
        try:
            rec["llm_ok"] = (probe or (lambda: _tokens(llm)))() == baseline
        except BaseException as e:
            rec["llm_ok"] = False
            rec["llm_error"] = f"{type(e).__name__}: {e}"[:300]
    time.sleep(0.02)  # a thread ending on its own has a moment to do so
    left = [t.name for t in threading.enumerate() if t.ident not in threads and t.is_alive()]
    if left:
        rec["threads_left"] = left
    if _fd_count() > fds:
        rec["fds_left"] = _fd_count() - fds
    if _children():
        rec["children"] = _children()
    new_files = sorted(_files(*watch) - files)
    if new_files:
        rec["files_left"] = new_files[:5]
        for left in reversed(new_files):  # the next case starts clean (generation_config="abc" read audit_log's abc)
            path = Path(left)
            if path.is_file() or path.is_symlink():
                path.unlink()
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()
    return rec


def param_cases(kvload: Any, llm: Any) -> Iterator[tuple[str, Callable[[], Any]]]:
    """Every field of the parameter classes given every hostile value; a value the class takes is then used."""
    import attrs

    def fields(cls: type) -> list[str]:
        return [f.name for f in attrs.fields(cls) if f.init]

    for field in fields(kvload.SamplingParams):
        for kind in HOSTILE:
            def go(field: str = field, value: Any = HOSTILE[kind]) -> Any:
                kw = {field: value} if field == "max_tokens" else {"max_tokens": 3, field: value}
                return llm.generate(BASE_IDS, kvload.SamplingParams(**kw))
            yield f"sp.{field}.{kind}", go
            yield f"gen_kw.{field}.{kind}", lambda field=field, value=HOSTILE[kind]: llm.generate(
                BASE_IDS, **{field: value, **({} if field == "max_tokens" else {"max_tokens": 3})})
    for field in fields(kvload.BeamSearchParams):
        for kind in HOSTILE:
            def beam(field: str = field, value: Any = HOSTILE[kind]) -> Any:
                kw = {"beam_width": 2, "max_tokens": 3, field: value}
                return llm.beam_search([{"prompt_token_ids": BASE_IDS}], kvload.BeamSearchParams(**kw))
            yield f"beam.{field}.{kind}", beam
    for field in fields(kvload.PoolingParams):
        for kind in HOSTILE:
            yield f"pool.{field}.{kind}", lambda field=field, value=HOSTILE[kind]: llm.embed(
                [BASE_IDS], pooling_params=kvload.PoolingParams(**{field: value}))
    for field in fields(kvload.StructuredOutputsParams):
        for kind in HOSTILE:
            # a field that is not the spec is given with one (a regex), so its own check is what answers
            spec = {} if field in SPECS else {"regex": "w1"}
            yield f"so.{field}.{kind}", lambda field=field, value=HOSTILE[kind], spec=spec: llm.generate(
                PROMPT, kvload.SamplingParams(max_tokens=3, structured_outputs=kvload.StructuredOutputsParams(
                    **spec, **{field: value})))
    typos = {"sp.typo": lambda: kvload.SamplingParams(temprature=0.5),
             "beam.typo": lambda: kvload.BeamSearchParams(beam_widht=2),
             "pool.typo": lambda: kvload.PoolingParams(use_activaton=False),
             "so.typo": lambda: kvload.StructuredOutputsParams(jsn={}),
             "gen_kw.typo": lambda: llm.generate(BASE_IDS, temprature=0.5, max_tokens=3),
             "chat.typo": lambda: llm.chat([{"role": "user", "content": "w1"}], max_tokns=3),
             "embed.typo": lambda: llm.embed([BASE_IDS], pooling_param=kvload.PoolingParams()),
             "score.typo": lambda: llm.score(PROMPT, PROMPT, truncate_prompt_token=2),
             "beam_search.typo": lambda: llm.beam_search([BASE_IDS], kvload.BeamSearchParams(beam_width=2),
                                                         concurency_limit=1),
             "stream.typo": lambda: llm.generate_stream(BASE_IDS, max_token=3),
             # a typo of the call's own argument, not of a sampling field
             "gen_own.typo": lambda: llm.generate(BASE_IDS, prioriy=[0], max_tokens=3),
             "chat_own.typo": lambda: llm.chat([{"role": "user", "content": "w1"}], chat_templte="{{ 1 }}"),
             "metrics.typo": lambda: llm.get_metrics(metric_name_prefix="vllm"),
             "chat_no_template.typo": lambda: _without_template(llm, lambda: llm.chat(
                 [{"role": "user", "content": "w1"}], max_tokns=3))}
    yield from typos.items()


def _without_template(llm: Any, call: Callable[[], Any]) -> Any:
    """``call`` on a tokenizer without a chat template (the word tokenizer's own state), restored after."""
    template = llm.tokenizer.chat_template
    llm.tokenizer.chat_template = None
    try:
        return call()
    finally:
        llm.tokenizer.chat_template = template


def call_cases(kvload: Any, llm: Any) -> Iterator[tuple[str, Callable[[], Any]]]:
    """The calls' own arguments and the prompts' odd forms."""
    sp = kvload.SamplingParams(max_tokens=3)
    prompts = Fresh({
        **{f"hostile_{k}": v for k, v in HOSTILE.raw.items()},
        "oov_id": [VOCAB + 5], "neg_id": [1, -3], "huge_id": [2 ** 63], "float_ids": [1.0, 2.0], "bool_ids": [True],
        "mix_str_ids": ["w1", 2], "dict_no_prompt": {"text": "w1"}, "dict_empty": {}, "dict_ids_oov": {
            "prompt_token_ids": [VOCAB]}, "dict_prompt_int": {"prompt": 5}, "dict_both": {
            "prompt": "w1", "prompt_token_ids": [1]}, "list_empty_str": [""], "list_empty_ids": [[]],
        "list_mixed": ["w1", [2, 3], {"prompt": "w4"}], "million_ids": [1] * 10 ** 6,
        "million_words": "w1 " * 10 ** 6, "nested_lists": [[[1, 2]]], "tuple_ids": (1, 2, 3), "set": {1, 2},
        "generator": Make(lambda: (i for i in [1, 2])), "unknown_word": "zzz qqq",
    })
    for kind in prompts:
        yield f"generate.prompt.{kind}", lambda value=prompts[kind]: llm.generate(value, sp)
        yield f"stream.prompt.{kind}", lambda value=prompts[kind]: llm.generate_stream(value, sp)
        yield f"embed.prompt.{kind}", lambda value=prompts[kind]: llm.embed(value)
        yield f"beam_search.prompt.{kind}", lambda value=prompts[kind]: llm.beam_search(
            value, kvload.BeamSearchParams(beam_width=2, max_tokens=2))
    yield "score.prompt.empty_list", lambda: llm.score([], [PROMPT])
    yield "score.prompt.oov", lambda: llm.score([VOCAB + 1], [PROMPT])
    yield "score.prompt.mismatch", lambda: llm.score([PROMPT, PROMPT], [PROMPT, PROMPT, PROMPT])
    yield "score.prompt.none", lambda: llm.score(None, PROMPT)
    for kind, value in {"none": None, "int": 5, "str": "hi", "empty_list": [], "list_of_str": ["hi"],
                        "no_role": [{"content": "w1"}], "bad_role": [{"role": 5, "content": "w1"}],
                        "content_int": [{"role": "user", "content": 5}], "content_none": [
                            {"role": "user", "content": None}], "surrogate": [{"role": "user", "content": "\ud800"}],
                        "bytes": [{"role": "user", "content": b"w1"}]}.items():
        yield f"chat.messages.{kind}", lambda value=value: llm.chat(value, sp)
    msgs = [{"role": "user", "content": "w1 w2"}]
    chat_kw = ["chat_template", "chat_template_content_format", "add_generation_prompt", "continue_final_message",
               "tools", "chat_template_kwargs", "salt", "use_tqdm"]
    for kw in chat_kw:
        for kind in HOSTILE:
            yield f"chat.{kw}.{kind}", lambda kw=kw, value=HOSTILE[kind]: llm.chat(msgs, sp, **{kw: value})
    for kw in ["salt", "chat", "priority", "lora_request", "prompt_token_ids", "use_tqdm", "sampling_params"]:
        for kind in HOSTILE:
            def gen(kw: str = kw, value: Any = HOSTILE[kind]) -> Any:
                base: dict[str, Any] = {} if kw in ("sampling_params", "prompt_token_ids") else {"sampling_params": sp}
                args = () if kw == "prompt_token_ids" else (BASE_IDS,)
                return llm.generate(*args, **base, **{kw: value})
            yield f"generate.{kw}.{kind}", gen
    for kw in ["truncate_prompt_tokens", "pooling_params", "salt", "use_tqdm", "lora_request"]:
        for kind in HOSTILE:
            yield f"embed.{kw}.{kind}", lambda kw=kw, value=HOSTILE[kind]: llm.embed([BASE_IDS], **{kw: value})
            yield f"score.{kw}.{kind}", lambda kw=kw, value=HOSTILE[kind]: llm.score(PROMPT, "w1 w2", **{kw: value})
    for kw in ["concurrency_limit", "use_tqdm", "lora_request", "params"]:
        for kind in HOSTILE:
            def beam(kw: str = kw, value: Any = HOSTILE[kind]) -> Any:
                kwargs = {"params": kvload.BeamSearchParams(beam_width=2, max_tokens=2), kw: value}
                return llm.beam_search([BASE_IDS, [1, 2]], **kwargs)
            yield f"beam_search.{kw}.{kind}", beam
    for kw in ["salt", "chat", "lora_request", "sampling_params"]:
        for kind in HOSTILE:
            yield f"stream.{kw}.{kind}", lambda kw=kw, value=HOSTILE[kind]: llm.generate_stream(
                BASE_IDS, **({"sampling_params": sp} if kw != "sampling_params" else {}), **{kw: value})
    # lists of sampling params against the prompts
    yield "generate.sp_list.short", lambda: llm.generate([BASE_IDS, [1, 2]], [sp])
    yield "generate.sp_list.long", lambda: llm.generate([BASE_IDS], [sp, sp, sp])
    yield "generate.sp_list.empty", lambda: llm.generate([BASE_IDS], [])
    yield "generate.sp_list.junk", lambda: llm.generate([BASE_IDS, [1, 2]], [sp, "x"])
    yield "generate.sp_list.beam", lambda: llm.generate([BASE_IDS], kvload.BeamSearchParams(beam_width=2))
    yield "generate.sp_list.pool", lambda: llm.generate([BASE_IDS], kvload.PoolingParams())
    yield "embed.pool_list.short", lambda: llm.embed([BASE_IDS, [1, 2]], pooling_params=[kvload.PoolingParams()])
    yield "embed.pool_list.sp", lambda: llm.embed([BASE_IDS], pooling_params=sp)
    yield "stream.sp_list.short", lambda: llm.generate_stream([BASE_IDS, [1, 2]], [sp])
    yield "generate.priority.short", lambda: llm.generate([BASE_IDS, [1, 2]], sp, priority=[0])
    yield "beam_search.params.sp", lambda: llm.beam_search([BASE_IDS], sp)


#: ``tokenization_kwargs={"truncate_prompt_tokens": v}``'s values: the hostile ones and cuts near the edges.
#: (A dict in the cut is one of them, named under truncate_prompt_tokens: its refusal rightly names that key, where
#: the first list had it among TK_KEYS and charged it with not naming tokenization_kwargs.)
CUT_VALUES: Fresh = Fresh({**HOSTILE.raw, "neg2": -2, "big": 10 ** 6, "float_int": 2.0, "minus_one": -1,
                              "dict_cut": {"truncate_prompt_tokens": 2}})
#: ``tokenization_kwargs`` dicts with keys kvload does not take (vLLM's others, junk, non-str keys, a typo).
TK_KEYS: dict[str, Any] = {
    "add_special_tokens": {"add_special_tokens": False}, "truncation": {"truncation": True},
    "max_length": {"max_length": 4}, "unknown": {"nosuch": 1}, "int_key": {5: 1}, "none_key": {None: 2},
    "tuple_key": {("a",): 1}, "bytes_key": {b"truncate_prompt_tokens": 2}, "surrogate_key": {"\ud800": 1},
    "newline_key": {"a\nb": 1}, "long_key": {"k" * 100_000: 1},
    "cut_and_unknown": {"truncate_prompt_tokens": 2, "nosuch": 1},
}


def tokenization_kwargs_cases(calls: dict[str, Callable[[Any], Any]]) -> Iterator[tuple[str, Callable[[], Any]]]:
    """Each call's ``tokenization_kwargs`` cases: the argument itself hostile, its cut hostile, keys kvload lacks, the
    cut's name one letter short."""
    for call, fn in calls.items():
        for kind in HOSTILE:  # the argument itself
            yield f"{call}.tokenization_kwargs.{kind}", lambda fn=fn, value=HOSTILE[kind]: fn(value)
        for kind in CUT_VALUES:  # its cut
            yield f"{call}_tk.truncate_prompt_tokens.{kind}", lambda fn=fn, value=CUT_VALUES[kind]: fn(
                {"truncate_prompt_tokens": value})
        for kind in TK_KEYS:
            yield f"{call}.tokenization_kwargs.key_{kind}", lambda fn=fn, value=TK_KEYS[kind]: fn(value)
        yield f"{call}.tokenization_kwargs.typo", lambda fn=fn: fn({"truncate_prompt_token": 2})


def front_door_cases(kvload: Any, llm: Any) -> Iterator[tuple[str, Callable[[], Any]]]:
    """b5271df's front door: ``tokenization_kwargs`` on every call that takes it (itself hostile, its cut hostile, keys
    kvload lacks, the cut given twice), ``SamplingParams(output_kind=...)``, ``reset_prefix_cache``'s arguments,
    ``get_world_size(include_dp=...)`` and ``reset_mm_cache``; each followed by the baseline call."""
    sp = kvload.SamplingParams(max_tokens=3)
    msgs = [{"role": "user", "content": "w1 w2"}]
    calls: dict[str, Callable[[Any], Any]] = {
        "generate": lambda tk: llm.generate(BASE_IDS, sp, tokenization_kwargs=tk),
        "gen_kw": lambda tk: llm.generate(BASE_IDS, max_tokens=3, tokenization_kwargs=tk),
        "gen_list": lambda tk: llm.generate([BASE_IDS, [1, 2, 3]], [sp, sp], tokenization_kwargs=tk),
        "chat": lambda tk: llm.chat(msgs, sp, tokenization_kwargs=tk),
        "embed": lambda tk: llm.embed([BASE_IDS], tokenization_kwargs=tk),
        "score": lambda tk: llm.score(PROMPT, "w1 w2", tokenization_kwargs=tk),
        "encode": lambda tk: llm.encode([BASE_IDS], pooling_task="embed", tokenization_kwargs=tk),
    }
    yield from tokenization_kwargs_cases(calls)
    yield "stream.tokenization_kwargs.cut", lambda: llm.generate_stream(
        BASE_IDS, sp, tokenization_kwargs={"truncate_prompt_tokens": 2})
    # the cut given twice: the same value is one cut, different values one line naming both
    two = kvload.SamplingParams(max_tokens=3, truncate_prompt_tokens=2)
    twice: dict[str, Callable[[], Any]] = {
        "generate.truncate_prompt_tokens.twice_differ": lambda: llm.generate(
            BASE_IDS, two, tokenization_kwargs={"truncate_prompt_tokens": 3}),
        "generate.truncate_prompt_tokens.twice_same": lambda: llm.generate(
            BASE_IDS, two, tokenization_kwargs={"truncate_prompt_tokens": 2}),
        "generate.truncate_prompt_tokens.twice_bool": lambda: llm.generate(
            BASE_IDS, kvload.SamplingParams(max_tokens=3, truncate_prompt_tokens=1),
            tokenization_kwargs={"truncate_prompt_tokens": True}),
        "generate.truncate_prompt_tokens.twice_float": lambda: llm.generate(
            BASE_IDS, two, tokenization_kwargs={"truncate_prompt_tokens": 2.0}),
        "generate.truncate_prompt_tokens.twice_list_one": lambda: llm.generate(
            [BASE_IDS, [1, 2, 3]], [sp, two], tokenization_kwargs={"truncate_prompt_tokens": 3}),
        "gen_kw.truncate_prompt_tokens.twice_differ": lambda: llm.generate(
            BASE_IDS, max_tokens=3, truncate_prompt_tokens=2, tokenization_kwargs={"truncate_prompt_tokens": 3}),
        "gen_kw.truncate_prompt_tokens.twice_nan": lambda: llm.generate(
            BASE_IDS, max_tokens=3, truncate_prompt_tokens=math.nan,
            tokenization_kwargs={"truncate_prompt_tokens": math.nan}),
        "chat.truncate_prompt_tokens.twice_differ": lambda: llm.chat(
            msgs, two, tokenization_kwargs={"truncate_prompt_tokens": 3}),
        "embed.truncate_prompt_tokens.twice_differ": lambda: llm.embed(
            [BASE_IDS], truncate_prompt_tokens=2, tokenization_kwargs={"truncate_prompt_tokens": 3}),
        "embed.truncate_prompt_tokens.twice_pool": lambda: llm.embed(
            [BASE_IDS], pooling_params=kvload.PoolingParams(truncate_prompt_tokens=2),
            tokenization_kwargs={"truncate_prompt_tokens": 3}),
        "embed.truncate_prompt_tokens.twice_bool": lambda: llm.embed(
            [BASE_IDS], truncate_prompt_tokens=1, tokenization_kwargs={"truncate_prompt_tokens": True}),
        "score.truncate_prompt_tokens.twice_differ": lambda: llm.score(
            PROMPT, "w1 w2", truncate_prompt_tokens=2, tokenization_kwargs={"truncate_prompt_tokens": 3}),
        "encode.truncate_prompt_tokens.twice_differ": lambda: llm.encode(
            [BASE_IDS], pooling_task="embed", truncate_prompt_tokens=2,
            tokenization_kwargs={"truncate_prompt_tokens": 3}),
    }
    yield from twice.items()
    kinds = Fresh({**HOSTILE.raw, "delta": kvload.RequestOutputKind.DELTA, "int_two": 2, "name": "FINAL_ONLY",
             "final_only": kvload.RequestOutputKind.FINAL_ONLY, "cumulative": kvload.RequestOutputKind.CUMULATIVE})
    for kind in kinds:
        yield f"sp.output_kind.{kind}", lambda value=kinds[kind]: llm.generate(
            BASE_IDS, kvload.SamplingParams(max_tokens=3, output_kind=value))
        yield f"gen_kw.output_kind.{kind}", lambda value=kinds[kind]: llm.generate(
            BASE_IDS, max_tokens=3, output_kind=value)
        yield f"stream_sp.output_kind.{kind}", lambda value=kinds[kind]: llm.generate_stream(
            BASE_IDS, kvload.SamplingParams(max_tokens=3, output_kind=value))
    for arg in ("reset_running_requests", "reset_connector"):
        for kind in HOSTILE:
            yield f"reset_prefix_cache.{arg}.{kind}", lambda arg=arg, value=HOSTILE[kind]: llm.reset_prefix_cache(
                **{arg: value})
    yield "reset_prefix_cache.positional.three", lambda: llm.reset_prefix_cache(True, True, True)
    yield "reset_prefix_cache.typo", lambda: llm.reset_prefix_cache(reset_running_request=True)
    for kind in HOSTILE:
        yield f"get_world_size.include_dp.{kind}", lambda value=HOSTILE[kind]: llm.get_world_size(include_dp=value)
    yield "get_world_size.typo", lambda: llm.get_world_size(include_pd=True)
    yield "get_world_size.positional.two", lambda: llm.get_world_size(True, True)
    yield "reset_mm_cache.positional.one", lambda: llm.reset_mm_cache(True)
    # reset_mm_cache takes no argument (as vLLM's), so a keyword is no typo of one: Python's TypeError names it (the
    # first list called this ".typo" and charged it with no "did you mean")
    yield "reset_mm_cache.reset.keyword", lambda: llm.reset_mm_cache(reset=True)


LLM_KWARGS = ["seed", "max_seq_len", "max_model_len", "max_num_seqs", "max_num_tokens", "dtype", "device",
              "kv_cache_config", "tensor_parallel_size", "gpu_memory_utilization", "max_beam_width", "block_size",
              "enable_prefix_caching", "config_file", "audit_log", "log", "subscribers", "tokenizer", "revision",
              "trust_remote_code", "enforce_eager", "scheduling_policy", "generation_config",
              "kv_events_config", "quantization",
              # LlmArgs fields the first list lacked (sweep49: pipeline.config.LlmArgs against this list)
              "max_batch_size", "weights_seed", "attention_backend", "linear_backend", "max_draft_len",
              "max_matching_ngram_size", "speculation_max_batch_size", "override_generation_config",
              "reasoning_parser"]


def llm_cases(kvload: Any, ckpt: Path, kinds: list[str]) -> Iterator[tuple[str, Callable[[], Any]]]:
    """``LLM(...)`` keywords (each case a load: a value taken loads the model, then closes it)."""
    base = {"device": "cpu", "max_seq_len": 64, "log": False, "kv_cache_config": {"max_tokens": 256}}

    def build(**kw: Any) -> Any:
        llm = kvload.LLM(str(ckpt), **{**base, **kw})
        llm.close()
        return "loaded"

    for kw in LLM_KWARGS:
        for kind in kinds:
            yield f"llm.{kw}.{kind}", lambda kw=kw, kind=kind: build(**{kw: HOSTILE[kind]})
    yield "llm.typo", lambda: build(max_seq_lne=64)
    yield "llm.model.none", lambda: kvload.LLM(None, log=False)
    yield "llm.model.int", lambda: kvload.LLM(5, log=False)
    yield "llm.model.empty", lambda: kvload.LLM("", log=False)
    yield "llm.model.surrogate", lambda: kvload.LLM("\ud800", log=False)
    yield "llm.kv.max_tokens.nan", lambda: build(kv_cache_config={"max_tokens": math.nan})
    yield "llm.kv.typo", lambda: build(kv_cache_config={"max_tokes": 256})
    yield "llm.kv.tokens_per_block.zero", lambda: build(kv_cache_config={"max_tokens": 256, "tokens_per_block": 0})


#: ``LLM(hf_overrides=...)``'s hostile dicts: each a load of the tiny llama (a refusal names ``hf_overrides``).
HF_OVERRIDES: dict[str, Any] = {
    "not_dict": [1], "str": "x", "empty": {}, "callable": len, "nan": {"rope_theta": math.nan},
    "inf": {"rope_theta": math.inf}, "bytes": {"max_position_embeddings": b"1"}, "object": {"x_y": object()},
    "deep": {"a": __import__("functools").reduce(lambda acc, _: {"k": acc}, range(200), 1)},
    "layers_neg": {"num_hidden_layers": -1}, "layers_zero": {"num_hidden_layers": 0},
    "layers_huge": {"num_hidden_layers": 10 ** 9}, "layers_str": {"num_hidden_layers": "x"},
    "layers_float": {"num_hidden_layers": 1.5}, "layers_bool": {"num_hidden_layers": True},
    "layers_none": {"num_hidden_layers": None}, "vocab_small": {"vocab_size": 8}, "vocab_zero": {"vocab_size": 0},
    "vocab_neg": {"vocab_size": -5}, "vocab_big": {"vocab_size": 4096}, "vocab_str": {"vocab_size": "x"},
    "heads_zero": {"num_attention_heads": 0}, "kv_heads_odd": {"num_key_value_heads": 3},
    "hidden_zero": {"hidden_size": 0}, "hidden_odd": {"hidden_size": 63}, "head_dim_neg": {"head_dim": -8},
    "max_pos_zero": {"max_position_embeddings": 0}, "max_pos_neg": {"max_position_embeddings": -1},
    "max_pos_str": {"max_position_embeddings": "x"}, "arch_junk": {"architectures": ["NoSuchForCausalLM"]},
    "arch_str": {"architectures": "LlamaForCausalLM"}, "arch_empty": {"architectures": []},
    "arch_int": {"architectures": [5]}, "sliding_str": {"sliding_window": "x"}, "sliding_neg": {"sliding_window": -1},
    "sliding_zero": {"sliding_window": 0}, "rope_str": {"rope_parameters": "x"}, "rope_list": {"rope_parameters": [1]},
    "rope_junk": {"rope_parameters": {"rope_type": "nosuch"}}, "rope_theta_str": {"rope_theta": "x"},
    "rope_theta_neg": {"rope_theta": -1.0}, "rope_scaling_junk": {"rope_scaling": {"type": "yarn", "factor": "x"}},
    "dotted_key": {"a.b": 1}, "underscore_key": {"_name_or_path": "x"}, "int_key": {5: 1},
    "surrogate_key": {"\ud800": 1}, "surrogate_value": {"model_type": "\ud800"}, "method_key": {"to_dict": 1},
    "model_type": {"model_type": "gpt2"}, "torch_dtype": {"torch_dtype": "int3"}, "dtype_junk": {"dtype": "x"},
    "tie_str": {"tie_word_embeddings": "x"}, "eps_neg": {"rms_norm_eps": -1.0}, "act_junk": {"hidden_act": "nosuch"},
    "num_labels_neg": {"num_labels": -1}, "id2label_junk": {"id2label": "x"},
    "text_config_junk": {"text_config": {"num_hidden_layers": -1}}, "intermediate_zero": {"intermediate_size": 0},
}


def hf_cases(kvload: Any, ckpt: Path) -> Iterator[tuple[str, Callable[[], Any]]]:
    """``LLM(ckpt, hf_overrides=...)``: each a load that must load a working model or refuse in one line."""
    base = {"device": "cpu", "max_seq_len": 64, "log": False, "kv_cache_config": {"max_tokens": 256}}

    def build(value: Any) -> Any:
        from kvload import SamplingParams

        llm = kvload.LLM(str(ckpt), hf_overrides=value, **base)
        try:  # a value taken must give a model that runs
            return llm.generate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids
        finally:
            llm.close()

    for kind in HF_OVERRIDES:
        yield f"hf_overrides.{kind}", lambda value=HF_OVERRIDES[kind]: build(value)


#: ``kvload.plan`` / ``load``'s own keywords (the ``LlmArgs`` overrides are :data:`LLM_ARGS_FIELDS`).
PLAN_KWARGS = ["config_file", "audit_log", "subscribers", "stages", "log"]
#: ``engine.simulator.simulate``'s keywords (``model`` and ``workload`` too: they are arguments a caller passes).
SIMULATE_KWARGS = ["model", "workload", "requests", "seed", "params", "compare", "config_file", "source", "audit_log",
                   "progress", "log", "subscribers", "hardware"]
#: ``kvload serve``'s flags with a text value, given odd and huge text on ``kvload plan tiny-llama`` (the parse and
#: the checks are the same for every command).
CLI_FLAGS = ["max_tokens", "max_gpu_total_bytes", "tokens_per_block", "kv_cache_free_gpu_memory_fraction",
             "host_cache_size", "max_seq_len", "max_batch_size", "dtype", "device", "scheduling_policy",
             "generation_config", "override_generation_config", "tp_size", "config", "audit"]
CLI_VALUES: dict[str, str] = {
    "digits_5000": "9" * 5000, "digits_100k": "9" * 100_000, "exp_huge": "1e400", "nan": "nan", "inf": "inf",
    "neg": "-1", "fullwidth": "\uff11\uff12", "underscore": "1_000", "hex": "0x10", "spaces": " 64 ",
    "long_text": "a" * 100_000, "json_list": "[1, 2]", "json_bomb": "[" * 50_000, "newline": "64\n65",
    "empty": "", "surrogate_escape": "\udcff",
}
#: A flag whose refusal names the setting it sets (``--tp_size 64``: "tensor_parallel_size=64: ...").
CLI_NAMES = {"tp_size": "tensor_parallel_size", "config": "config file", "audit": "audit log"}
#: A YAML config file whose alias bomb expands to 2**40 items (each level names the last twice).
YAML_BOMB = "a0: &a0 [1, 1]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}]\n" for i in range(1, 41))
PLAN_BASE: dict[str, Any] = {"log": False, "kv_cache_config": {"max_tokens": 256}}


def _fields(cls: type) -> list[str]:
    import attrs

    return [f.name for f in attrs.fields(cls) if f.init and not f.name.startswith("_")]


def door_cases(kvload: Any, work: Path) -> Iterator[tuple[str, Callable[[], Any]]]:
    """The doors the first sweep did not try: ``kvload.plan`` / ``load`` (their keywords, the ``LlmArgs`` overrides,
    ``kv_cache_config``'s fields), ``KvCacheConfig(...)`` / ``LlmArgs(...)`` built directly, ``simulate``'s keywords
    and ``build_state``'s (the server's Python door), each given every hostile value."""
    from engine.simulator import simulate
    from pipeline.config import KvCacheConfig, LlmArgs

    bomb_file = work / "bomb.yaml"
    bomb_file.write_text(YAML_BOMB)
    for kw in PLAN_KWARGS + [f for f in _fields(LlmArgs) if f not in ("model", "kv_cache_config")]:
        for kind in HOSTILE:
            yield f"plan.{kw}.{kind}", lambda kw=kw, value=HOSTILE[kind]: kvload.plan(
                "tiny-llama", **{**PLAN_BASE, kw: value})
    for field in _fields(KvCacheConfig):
        for kind in HOSTILE:
            yield f"plan_kv.{field}.{kind}", lambda field=field, value=HOSTILE[kind]: kvload.plan(
                "tiny-llama", log=False, kv_cache_config={"max_tokens": 256, field: value})
            yield f"kv_config.{field}.{kind}", lambda field=field, value=HOSTILE[kind]: KvCacheConfig(**{field: value})
    for kind in HOSTILE:
        yield f"plan.model.{kind}", lambda value=HOSTILE[kind]: kvload.plan(value, **PLAN_BASE)
        yield f"plan.kv_cache_config.{kind}", lambda value=HOSTILE[kind]: kvload.plan(
            "tiny-llama", log=False, kv_cache_config=value)
        yield f"load.load_weights.{kind}", lambda value=HOSTILE[kind]: kvload.load(
            "tiny-llama", load_weights=value, **PLAN_BASE)
        yield f"load.kv_cache_config.{kind}", lambda value=HOSTILE[kind]: kvload.load(
            "tiny-llama", log=False, kv_cache_config=value)
    for field in _fields(LlmArgs):
        for kind in HOSTILE:
            yield f"llm_args.{field}.{kind}", lambda field=field, value=HOSTILE[kind]: LlmArgs(
                **{"model": "tiny-llama", field: value})
    yield "plan.config_file.yaml_bomb", lambda: kvload.plan("tiny-llama", config_file=bomb_file, **PLAN_BASE)
    yield "plan.typo", lambda: kvload.plan("tiny-llama", max_seq_lne=64, **PLAN_BASE)
    yield "plan_kv.typo", lambda: kvload.plan("tiny-llama", log=False, kv_cache_config={"max_tokes": 256})
    sim = {"requests": 2, "log": False}
    for kw in SIMULATE_KWARGS:
        for kind in HOSTILE:
            def simulate_one(kw: str = kw, value: Any = HOSTILE[kind]) -> Any:
                args = {"model": "tiny-llama", "workload": "no-reuse", **sim, kw: value}
                simulate(args.pop("model"), args.pop("workload"), **args)
                return "simulated"
            yield f"simulate.{kw}.{kind}", simulate_one
    yield "simulate.config_file.yaml_bomb", lambda: simulate("tiny-llama", "no-reuse", config_file=str(bomb_file),
                                                            **sim)
    yield "simulate.typo", lambda: simulate("tiny-llama", "no-reuse", reqests=2, log=False)


def serve_cases(kvload: Any) -> Iterator[tuple[str, Callable[[], Any]]]:
    """``build_state``'s keywords (``kvload serve``'s Python door) on one loaded tiny llama; a state built is closed."""
    import inspect

    from kvload.serve.server import build_state

    result = kvload.load("tiny-llama", log=False, load_weights=True, kv_cache_config={"max_tokens": 256})

    def build(**kw: Any) -> Any:
        state = build_state(result, **kw)
        close = getattr(state, "close", None) or getattr(getattr(state, "engine", None), "close", None)
        if close is not None:
            close()
        return "built"

    for kw in [p for p in inspect.signature(build_state).parameters if p != "result"]:
        for kind in HOSTILE:
            yield f"serve.{kw}.{kind}", lambda kw=kw, value=HOSTILE[kind]: build(**{kw: value})
    yield "serve.typo", lambda: build(max_concurent_requests=4)


class CliRefused(ValueError):
    """``kvload`` exited 2: its stderr is the message (what a user reads)."""


def cli_cases(work: Path) -> Iterator[tuple[str, Callable[[], Any]]]:
    """``python -m kvload plan tiny-llama --FLAG V`` with odd and huge text, and a config file holding an alias bomb;
    exit 2 is a refusal (checked as the calls' are: one line naming the flag), 0 "accepted", anything else raised."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def kvload_cli(*argv: str) -> Any:
        try:
            r = subprocess.run([sys.executable, "-m", "kvload", "plan", "tiny-llama", "--max_tokens", "256", *argv],
                               capture_output=True, text=True, env=env, timeout=60, errors="backslashreplace")
        except subprocess.TimeoutExpired as e:
            raise TimeoutError(f"kvload {' '.join(a[:20] for a in argv)} ran past 60 s") from e
        if r.returncode == 2:
            raise CliRefused(r.stderr.strip())
        if r.returncode != 0 or "Traceback" in r.stderr:
            raise RuntimeError(f"exit {r.returncode}: {r.stderr.strip()[-600:]}")
        return "accepted"

    for flag in CLI_FLAGS:
        for kind, value in CLI_VALUES.items():
            yield f"cli.{flag}.{kind}", lambda flag=flag, value=value: kvload_cli(f"--{flag}", value)
    bomb_file = work / "cli_bomb.yaml"
    bomb_file.write_text(YAML_BOMB)
    yield "cli.config.yaml_bomb", lambda: kvload_cli("--config", str(bomb_file))


CLASSIFY_GROUPS = ("classify", "ce_score")


def classify_cases(kvload: Any, cls: Any, ce: Any) -> Iterator[tuple[str, Callable[[], Any]]]:
    """``LLM.classify`` and ``LLM.reward`` on a 3-label classifier and ``LLM.score`` on a one-label cross-encoder."""
    prompts = Fresh({
        **{f"hostile_{k}": v for k, v in HOSTILE.raw.items()}, "oov_id": [VOCAB + 5], "neg_id": [1, -3],
        "huge_id": [2 ** 63], "list_empty_ids": [[]], "list_empty_str": [""], "million_ids": [1] * 10 ** 6,
        "nested_lists": [[[1, 2]]], "dict_empty": {}, "mix": ["w1", [2, 3], {"prompt": "w4"}], "unknown": "zzz"})
    for kind in prompts:
        yield f"classify.prompt.{kind}", lambda value=prompts[kind]: cls.classify(value)
        yield f"classify_reward.prompt.{kind}", lambda value=prompts[kind]: cls.reward(value)
        yield f"ce_score.prompt.{kind}", lambda value=prompts[kind]: ce.score(value, PROMPT)
        yield f"ce_score.prompt2.{kind}", lambda value=prompts[kind]: ce.score(PROMPT, value)
    for kw in ["truncate_prompt_tokens", "pooling_params", "salt", "use_tqdm", "lora_request"]:
        for kind in HOSTILE:
            yield f"classify.{kw}.{kind}", lambda kw=kw, value=HOSTILE[kind]: cls.classify([BASE_IDS], **{kw: value})
            yield f"classify_reward.{kw}.{kind}", lambda kw=kw, value=HOSTILE[kind]: cls.reward(
                [BASE_IDS], **{kw: value})
            yield f"ce_score.{kw}.{kind}", lambda kw=kw, value=HOSTILE[kind]: ce.score(PROMPT, "w1 w2", **{kw: value})
    import attrs

    for field in [f.name for f in attrs.fields(kvload.PoolingParams) if f.init]:
        for kind in HOSTILE:
            yield f"classify_pool.{field}.{kind}", lambda field=field, value=HOSTILE[kind]: cls.classify(
                [BASE_IDS], pooling_params=kvload.PoolingParams(**{field: value}))
    pool_calls: dict[str, Callable[[Any], Any]] = {
        "classify": lambda tk: cls.classify([BASE_IDS], tokenization_kwargs=tk),
        "classify_reward": lambda tk: cls.reward([BASE_IDS], tokenization_kwargs=tk),
        "classify_encode": lambda tk: cls.encode([BASE_IDS], pooling_task="classify", tokenization_kwargs=tk),
        "ce_score": lambda tk: ce.score(PROMPT, "w1 w2", tokenization_kwargs=tk),
    }
    yield from tokenization_kwargs_cases(pool_calls)
    yield "classify.truncate_prompt_tokens.twice_differ", lambda: cls.classify(
        [BASE_IDS], truncate_prompt_tokens=2, tokenization_kwargs={"truncate_prompt_tokens": 3})
    yield "classify_reward.truncate_prompt_tokens.twice_differ", lambda: cls.reward(
        [BASE_IDS], truncate_prompt_tokens=2, tokenization_kwargs={"truncate_prompt_tokens": 3})
    yield "classify.typo", lambda: cls.classify([BASE_IDS], pooling_param=kvload.PoolingParams())
    yield "classify.pool_list.short", lambda: cls.classify([BASE_IDS, [1, 2]], pooling_params=[kvload.PoolingParams()])
    yield "classify.pool_list.sp", lambda: cls.classify([BASE_IDS], pooling_params=kvload.SamplingParams())
    yield "classify.on_ce", lambda: ce.classify([BASE_IDS])
    yield "classify_reward.on_ce", lambda: ce.reward([BASE_IDS])
    # named by the field the refusal names (PoolingParams' normalize, removed as in vLLM); "pool" was no argument
    yield "classify_reward.normalize.removed", lambda: cls.reward([BASE_IDS], pooling_params=kvload.PoolingParams(
        normalize=True))
    yield "ce_score.mismatch", lambda: ce.score([PROMPT, PROMPT], [PROMPT, PROMPT, PROMPT])
    yield "ce_score.empty", lambda: ce.score([], [PROMPT])
    yield "classify_gen.generate", lambda: cls.generate(BASE_IDS, kvload.SamplingParams(max_tokens=2))
    yield "classify_gen.embed", lambda: cls.embed([BASE_IDS])


def suspect(r: dict[str, Any]) -> list[str]:
    """Why a result looks wrong ([] when it does not)."""
    why = []
    if r.get("hang"):
        return ["hang"]
    refused = r.get("outcome") not in (None, "accepted")
    if r.get("outcome") == "DunderError":  # kvload called a method of the user's object that raised, unguarded
        return [f"called the value's own method unguarded at {r.get('called_from')}"]
    if refused and not {"ValueError", "TypeError"} & set(r.get("mro", [])) \
            and not (r["case"].startswith("llm.model.") and r["outcome"] == "ModelError") \
            and not (r["case"].startswith("hf_overrides.") and "KvloadError" in r.get("mro", [])):  # the model's
        why.append(f"raises {r['outcome']}")
    msg = r.get("message", "")
    if "\n" in msg.strip():
        why.append("multi-line message")
    try:  # a lone surrogate of the user's echoed as it was: print(error) raises UnicodeEncodeError
        msg.encode()
    except UnicodeEncodeError:
        why.append("unprintable message")
    if r.get("outcome") not in (None, "accepted"):
        arg = r["case"].split(".")[1] if r["case"].count(".") >= 2 else ""
        also = CLI_NAMES.get(arg, arg) if r["case"].startswith("cli.") else arg  # the flag or the setting it sets
        if arg and arg not in ("prompt", "prompt2", "messages", "sp_list", "pool_list", "kv", "model") \
                and not any(name in msg or name.replace("_", " ") in msg for name in (arg, also)):
            why.append(f"message does not name {arg}")
    if r["case"].startswith("hf_overrides.") and refused and "hf_overrides" not in msg:
        why.append("message does not name hf_overrides")
    # each typo is of a name close to a real one
    if r["case"].endswith(".typo") and not r.get("suggests", "did you mean" in msg):
        why.append("typo not suggested")
    if r.get("outcome") == "accepted" and r["case"].rsplit(".", 1)[-1] in NEVER_OK \
            and r["case"] not in TAKES:
        why.append("hostile value accepted")
    if r.get("llm_ok") is False:
        why.append("LLM broken after")
    for key in ("threads_left", "fds_left", "children", "files_left"):
        if key in r and not (key == "files_left" and r["case"].startswith(WRITES)):
            why.append(key)
    return why


def summary(path: Path) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    bad = [(r, suspect(r)) for r in rows]
    bad = [(r, w) for r, w in bad if w]
    print(f"{len(rows)} cases, {len(bad)} suspects")
    for r, why in bad:
        said = r.get("message", r.get("value", ""))[:160]
        print(f"{r['case']}: {'; '.join(why)} -- {r.get('outcome', 'hang')}: {said!r}")


def _worker(a: argparse.Namespace, status: Any) -> int:
    """Run the cases after ``--after`` in this process, writing each result to ``--out`` and ``BEGIN`` / ``END`` lines
    to ``status`` (the supervisor's pipe); 3 when a case hung in a thread (the LLM is then busy: start afresh)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(tempfile.mkdtemp(dir=a.work))  # the supervisor's folder: it goes with the run, a worker killed or not
    os.environ["TMPDIR"] = str(work / "tmp")
    os.environ["KVLOAD_CACHE"] = str(work / "cache")
    (work / "tmp").mkdir()
    (work / "cwd").mkdir()
    os.chdir(work / "cwd")  # a value taken as a path (audit_log="abc") is written here, not in the checkout
    tempfile.tempdir = None
    import kvload
    from models.weights import random_model
    from tests.llm_support import with_tokenizer
    from tests.paged_support import tiny_config

    raw = work / "raw"
    random_model(tiny_config("llama"), device="cpu", dtype="float32", seed=0).save_pretrained(raw)
    ckpt = with_tokenizer(raw, work / "ckpt", VOCAB)
    watch = [work / "tmp", work / "cache", work / "cwd"]
    llm = kvload.LLM(str(ckpt), device="cpu", max_seq_len=64, log=False, max_beam_width=2,
                     kv_cache_config={"tokens_per_block": 4, "max_tokens": 512})
    llm.tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                                   "{% if add_generation_prompt %}w1{% endif %}")  # the word tokenizer has none
    baseline = _tokens(llm)
    probe, probe_baseline = None, baseline
    only = tuple(a.only.split(","))  # several prefixes, comma-separated
    if any(p.startswith(o) or o.startswith(p) for p in CLASSIFY_GROUPS for o in only):
        from tests.classify_support import classifier_checkpoint

        kw = {"device": "cpu", "max_seq_len": 64, "log": False, "kv_cache_config": {"max_tokens": 512}}
        cls = kvload.LLM(str(classifier_checkpoint(work / "cls", "llama", "LlamaForSequenceClassification", 3)),
                         **kw)
        ce = kvload.LLM(str(classifier_checkpoint(work / "ce", "qwen3", "Qwen3ForSequenceClassification", 1)),
                        **kw)

        def probe() -> Any:  # both classifiers still give their first answers
            return cls.classify([BASE_IDS])[0].outputs.probs, ce.score(PROMPT, "w1 w2")[0].outputs.score

        probe_baseline = probe()
    kinds = set(a.kinds.split(",")) if a.kinds else None
    print("READY", file=status, flush=True)
    # the doors of sweep69 run without the LLM (nothing of theirs touches it); the door groups build lazily
    groups: list[tuple[Iterator[tuple[str, Callable[[], Any]]], bool]] = [
        (param_cases(kvload, llm), True), (call_cases(kvload, llm), True), (front_door_cases(kvload, llm), True),
        (llm_cases(kvload, ckpt, a.llm_kinds.split(",")), True), (hf_cases(kvload, ckpt), True)]
    if probe is not None:
        groups.append((classify_cases(kvload, cls, ce), True))
    groups += [(_lazy(lambda: door_cases(kvload, work), ("plan", "load", "kv_config", "llm_args", "simulate"),
                      only), False),
               (_lazy(lambda: serve_cases(kvload), ("serve",), only), False),
               (_lazy(lambda: cli_cases(work), ("cli",), only), False)]
    skipping = bool(a.after)
    with a.out.open("a") as out:
        for group, uses_llm in groups:
            for name, fn in group:
                if skipping:
                    skipping = name != a.after
                    continue
                if not name.startswith(only) or (kinds is not None and name.rsplit(".", 1)[-1] not in kinds):
                    continue
                print(f"BEGIN {name}", file=status, flush=True)
                classify = name.startswith(CLASSIFY_GROUPS)
                rec = run_case(name, fn, llm if uses_llm else None,
                               (probe_baseline if classify else baseline) if uses_llm else None, a.timeout, watch,
                               probe if classify else None)
                out.write(json.dumps(rec) + "\n")
                out.flush()
                print(f"END {name}", file=status, flush=True)
                if rec.get("hang"):  # the LLM (or a lock of kvload's) is busy: go on in a new process
                    return 3
    return 0


def _lazy(build: Callable[[], Iterator[tuple[str, Callable[[], Any]]]], prefixes: tuple[str, ...],
          only: tuple[str, ...]) -> Iterator[tuple[str, Callable[[], Any]]]:
    """``build()``'s cases, built only when ``--only`` can select one of them (their setup loads a model)."""
    if any(p.startswith(o) or o.startswith(p) for p in prefixes for o in only):
        yield from build()


def _bound_memory(gib: int) -> None:
    """In the worker before exec: at most ``gib`` GiB of address space."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (gib << 30, gib << 30))


def _supervise(a: argparse.Namespace) -> int:
    """Run the cases in a worker process, killing it when one case runs past ``--timeout`` (a hang in C code holds the
    GIL: the worker's own thread timeout never fires) and going on in a new worker after that case."""
    import select
    import signal
    import subprocess

    a.out.write_text("")
    work = tempfile.mkdtemp(prefix="api_sweep-")
    # the checkpoints and whatever the cases wrote go with the run (every earlier run left its folder in /tmp)
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    after = ""
    while True:
        read_end, write_end = os.pipe()
        argv = [sys.executable, __file__, "--worker", str(write_end), "--out", str(a.out), "--only", a.only,
                "--timeout", str(a.timeout), "--llm-kinds", a.llm_kinds, "--kinds", a.kinds, "--after", after,
                "--work", work, "--max-memory", str(a.max_memory)]
        # a bound on memory: an alias bomb written out grows a string until the timeout, on a shared machine
        proc = subprocess.Popen(argv, pass_fds=(write_end,), start_new_session=True,
                                preexec_fn=lambda: _bound_memory(a.max_memory))
        os.close(write_end)
        current, pending, lines = "", b"", []
        while True:
            wait = a.timeout + 10 if current else 900  # between cases: a group's setup (a model load)
            # read the fd itself (a buffered readline takes several lines at once, and select then sees none)
            if not lines and not select.select([read_end], [], [], wait)[0]:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                os.close(read_end)
                if not current:
                    print(f"the worker stopped between cases (after {after or 'its start'})", file=sys.stderr)
                    return 1
                with a.out.open("a") as out:
                    out.write(json.dumps({"case": current, "hang": True, "s": wait, "in_c": True}) + "\n")
                print(f"{current}: hung (worker killed); going on after it", file=sys.stderr)
                after = current
                break
            if not lines:
                chunk = os.read(read_end, 65536)
                pending += chunk
                *done, pending = pending.split(b"\n")
                lines += [d.decode() for d in done]
                if chunk:
                    continue
            if not lines:  # the worker ended
                rc = proc.wait()
                os.close(read_end)
                if rc == 0:
                    return 0
                if current:  # died inside a case (killed by the memory bound, a crash in C)
                    with a.out.open("a") as out:
                        out.write(json.dumps({"case": current, "outcome": f"worker died ({rc})",
                                              "mro": [], "message": ""}) + "\n")
                    after = current
                elif rc != 3 or not after:
                    print(f"the worker failed ({rc}) outside any case", file=sys.stderr)
                    return 1
                break
            word, _, name = lines.pop(0).strip().partition(" ")
            if word == "BEGIN":
                current = name
            elif word == "END":
                current, after = "", name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="results, one JSON line a case")
    ap.add_argument("--only", default="",
                    help="run only the cases whose name starts with this (or one of these, comma-separated)")
    ap.add_argument("--kinds", default="", help="run only the cases whose last name part (the value's kind) is one of "
                    "these, comma-separated (e.g. the new values: " + ",".join(NEW_VALUES) + ")")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a case may take before it counts as a hang")
    ap.add_argument("--max-memory", type=int, default=6, help="GiB of address space the worker may use")
    ap.add_argument("--llm-kinds", default="str,float,neg,nan,huge,dict,bigint,alias_bomb,evil_str,numpy_big",
                    help="hostile kinds given to LLM(...)'s keywords (each case may be a load)")
    ap.add_argument("--summary", action="store_true", help="print the suspects of --out and stop")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # the status pipe's fd: this is the worker
    ap.add_argument("--after", default="", help=argparse.SUPPRESS)  # the worker starts after this case
    ap.add_argument("--work", default="", help=argparse.SUPPRESS)  # the supervisor's scratch folder
    a = ap.parse_args()
    if a.summary:
        summary(a.out)
        return
    if a.worker is not None:
        with os.fdopen(a.worker, "w") as status:
            code = _worker(a, status)
        sys.stdout.flush()
        os._exit(code)  # a case's thread still running (a hang) must not keep the worker alive
    code = _supervise(a)
    summary(a.out)
    sys.exit(code)


if __name__ == "__main__":
    main()
