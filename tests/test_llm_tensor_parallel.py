"""``kvload.LLM(model, tensor_parallel_size=2)`` in a plain script (no torchrun): the LLM starts rank 1 itself, which
follows rank 0's calls, so the tokens are one process's; a lost rank is named within a bounded time; closing (or the
script's end) leaves no process; what cannot cross processes is refused naming the argument.

Real processes (gloo on CPU), bounded by timeouts; none is a speed assertion.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import kvload
from engine.beam_search import BeamSearchParams
from engine.sampling_params import SamplingParams
from pipeline.errors import GenerationError
from tests.llm_support import with_tokenizer
from tests.tp_support import DIST_TIMEOUT_S, REPO, all_children, four_kv_head_llama

VOCAB = 512
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w1{% endif %}"
KW = {"max_seq_len": 128, "kv_cache_config": {"max_tokens": 1024, "tokens_per_block": 4}, "max_beam_width": 3,
      "log": False}
SCRIPT_S = 300


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture(scope="module")
def words(tiny_checkpoints, tmp_path_factory):
    """The tiny llama with a word-level tokenizer (token i is the text "w<i>")."""
    return with_tokenizer(tiny_checkpoints("llama"), tmp_path_factory.mktemp("tp-words") / "ckpt", VOCAB)


@pytest.fixture(scope="module")
def pair(words):
    """The same LLM twice: one with tensor_parallel_size=2 started here (no torchrun), one in one process."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            mp.delenv(name, raising=False)
        mp.setenv("KVLOAD_DIST_TIMEOUT_S", str(DIST_TIMEOUT_S))
        before = all_children(os.getpid())
        with kvload.LLM(str(words), tensor_parallel_size=2, **KW) as tp, kvload.LLM(str(words), **KW) as alone:
            workers = all_children(os.getpid()) - before
            yield tp, alone, workers
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in workers), "a rank outlived LLM.close()"


def test_generate_with_two_ranks_gives_one_processs_tokens_greedy_and_sampled(pair):
    tp, alone, workers = pair
    assert len(workers) == 1  # rank 1, started by the LLM
    assert tp.audit.of("rank_joined")[0]["world_size"] == 2 and tp.args.tensor_parallel_size == 2
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    for params in (SamplingParams(max_tokens=8, ignore_eos=True),  # greedy
                   SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=7),  # the request's seed
                   SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0)):  # drawn from LLM(seed=0)'s
        got = [o.outputs[0].token_ids for o in tp.generate(prompts, params)]
        want = [o.outputs[0].token_ids for o in alone.generate(prompts, params)]
        assert got == want and all(len(t) == 8 for t in got)
    beams = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    assert [[list(s.token_ids) for s in o.sequences] for o in tp.beam_search(prompts, beams)] == \
        [[list(s.token_ids) for s in o.sequences] for o in alone.beam_search(prompts, beams)]


def test_followed_names_every_call_the_ranks_follow():
    """``llm_ranks.FOLLOWED`` (public) lists each LLM method decorated ``followed_by_ranks``, wherever the split of
    kvload/llm.py put it (classify, reward and encode were followed but not listed)."""
    import ast
    from pathlib import Path

    import kvload.llm_ranks as llm_ranks

    decorated = set()
    for module in ("llm", "llm_pooling", "llm_stream"):
        tree = ast.parse((Path(llm_ranks.__file__).parent / f"{module}.py").read_text())
        decorated |= {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                      and any(isinstance(d, ast.Name) and d.id == "followed_by_ranks" for d in node.decorator_list)}
    assert decorated == set(llm_ranks.FOLLOWED)


def test_chat_embed_and_score_follow_on_every_rank(pair):
    tp, alone, _ = pair
    conv = [{"role": "system", "content": "w5 w17"}, {"role": "user", "content": "w300 w42"}]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    (one,) = tp.chat(conv, params, chat_template=TEMPLATE)
    assert one.prompt_token_ids == [5, 17, 300, 42, 1]
    assert one.outputs[0].token_ids == alone.chat(conv, params, chat_template=TEMPLATE)[0].outputs[0].token_ids
    got = [e.outputs.embedding for e in tp.embed(["w5 w17 w300", "w9 w8"])]
    want = [e.outputs.embedding for e in alone.embed(["w5 w17 w300", "w9 w8"])]
    assert len(got) == 2 and len(got[0]) == tp.result.hf_model.config.hidden_size
    assert all(g == pytest.approx(w, abs=1e-4) for g, w in zip(got, want, strict=True))
    assert tp.score("w5 w17", ["w5 w17", "w9"])[0].outputs.score == pytest.approx(1.0, abs=1e-4)
    assert tp.reset_prefix_cache() is True


def test_an_error_every_rank_raises_is_rank_0s_once_and_the_llm_goes_on(pair):
    tp, alone, _ = pair
    with pytest.raises(GenerationError) as mine:
        tp.generate([[1, 2, 3]], max_tokens=-1)
    with pytest.raises(GenerationError) as theirs:
        alone.generate([[1, 2, 3]], max_tokens=-1)
    assert str(mine.value) == str(theirs.value) and "rank" not in str(mine.value)
    assert tp.generate([[4, 5]], max_tokens=3, ignore_eos=True)[0].outputs[0].token_ids == \
        alone.generate([[4, 5]], max_tokens=3, ignore_eos=True)[0].outputs[0].token_ids


def test_a_refusal_whose_words_differ_between_processes_is_still_one_refusal(pair):
    """Rank 1 quotes its own copy of the prompt, at another address: the ranks failed alike all the same, so the
    user's own error comes back and the LLM goes on (it was broken for good, "rank 1 failed where rank 0 did not")."""
    tp, alone, _ = pair
    with pytest.raises(GenerationError, match=r"prompt 1: expected a string or a list of token ids.*object at"):
        tp.generate([[1, 2], object()], max_tokens=2)
    assert tp.generate([[4, 5]], max_tokens=3, ignore_eos=True)[0].outputs[0].token_ids == \
        alone.generate([[4, 5]], max_tokens=3, ignore_eos=True)[0].outputs[0].token_ids


def _script_report(tmp_path: Path, text: str, *args: str) -> dict:
    """Run ``text`` as a user's plain script (no torchrun variables) with ``args``; the JSON its last line prints."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TRANSFORMERS_VERBOSITY": "error", "KVLOAD_DIST_TIMEOUT_S": str(DIST_TIMEOUT_S)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    script = tmp_path / "user_script.py"
    script.write_text(text)
    r = subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=SCRIPT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


ALONE_SCRIPT = """
import json, os, sys, time
import kvload
import kvload.llm_ranks as llm_ranks
from pipeline.errors import RankError

llm_ranks.PARTED_S = 2.0

def subscriber(record):
    if record.get("event") == "request_admitted":
        raise RuntimeError("the subscriber's own fault")

report = {}
with kvload.LLM(sys.argv[1], tensor_parallel_size=2, subscribers=[subscriber], **json.loads(sys.argv[2])) as tp:
    report["workers"] = [r.proc.pid for r in tp._ranks.ranks]
    started = time.monotonic()
    try:
        tp.generate([[1, 2, 3]], max_tokens=4, ignore_eos=True)
    except RuntimeError as exc:
        report["error"], report["notes"] = str(exc), getattr(exc, "__notes__", [])
    report["took"] = time.monotonic() - started
    try:
        tp.generate([[1, 2, 3]], max_tokens=2)
    except RankError as exc:
        report["next"] = str(exc)
print(json.dumps(report))
"""


def test_a_failure_on_rank_0_alone_mid_call_is_the_users_own_error_soon_and_the_ranks_stop(words, tmp_path):
    """A subscriber (rank 0's alone) raising between steps left rank 1 in the next step's collective: the call
    waited the whole collective timeout and then blamed rank 1. Now the subscriber's own error comes back within
    PARTED_S, the ranks are stopped, and the next call says the LLM cannot run any more."""
    report = _script_report(tmp_path, ALONE_SCRIPT, str(words), json.dumps(KW))
    assert report["error"] == "the subscriber's own fault", report
    assert any("rank 1" in note and "cannot run any more" in note for note in report["notes"]), report
    assert report["took"] < DIST_TIMEOUT_S / 2  # a bound, not a speed: no wait for the collective timeout
    assert "cannot run any more" in report["next"]
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in report["workers"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert report["workers"] and not any(_alive(p) for p in report["workers"])


def _streamed(llm, prompts, params, stop_after=None):
    """Each prompt's tokens as ``generate_stream`` yields them; the loop left after ``stop_after`` deltas."""
    tokens: dict[int, list[int]] = {}
    for k, delta in enumerate(llm.generate_stream(prompts, params)):
        tokens.setdefault(delta.index, []).extend(delta.token_ids)
        if stop_after is not None and k + 1 >= stop_after:
            break
    return [tokens.get(i, []) for i in range(len(prompts))]


def test_generate_stream_with_two_ranks_streams_one_processs_tokens_and_stops_every_rank_where_it_is_left(pair):
    """vLLM's LLM with tensor_parallel_size streams as it generates: kvload's started ranks follow the stream, and a
    consumer that leaves early (break) stops every rank after the same step, so the next calls still step alike."""
    tp, alone, _ = pair
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    for params in (SamplingParams(max_tokens=8, ignore_eos=True),
                   SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=7)):
        got = _streamed(tp, prompts, params)
        assert got == _streamed(alone, prompts, params) and all(len(t) == 8 for t in got)
        assert got == [o.outputs[0].token_ids for o in tp.generate(prompts, params)]
    long = SamplingParams(max_tokens=60, ignore_eos=True)
    for stop_after in (1, 3):  # left after the first delta, then a few steps in
        early = _streamed(tp, prompts, long, stop_after=stop_after)
        assert sum(map(len, early)) == stop_after
        # both ranks dropped the stream's requests after one step: what follows runs alike (no collective hangs)
        assert tp.generate([[4, 5]], max_tokens=3, ignore_eos=True)[0].outputs[0].token_ids == \
            alone.generate([[4, 5]], max_tokens=3, ignore_eos=True)[0].outputs[0].token_ids
    assert _streamed(tp, prompts, SamplingParams(max_tokens=4, ignore_eos=True)) == \
        _streamed(alone, prompts, SamplingParams(max_tokens=4, ignore_eos=True))


def test_what_cannot_cross_processes_is_refused_naming_the_argument(pair):
    tp, alone, _ = pair
    with pytest.raises(GenerationError, match=r"^generate: prompts: cannot be sent to ranks 1\.\.1, which "
                                              r"kvload\.LLM started for tensor_parallel_size=2 \(it does not "
                                              r"pickle: .*generator.*torchrun --nproc-per-node 2"):
        tp.generate(p for p in [[1, 2, 3]])
    with pytest.raises(GenerationError, match=r"^chat: chat_template_kwargs: cannot be sent .*lambda"):
        tp.chat([{"role": "user", "content": "w9"}], chat_template=TEMPLATE, chat_template_kwargs={"f": lambda: 1})
    with pytest.raises(GenerationError, match=r"^generate_stream: prompts: cannot be sent to ranks 1\.\.1"):
        next(tp.generate_stream(p for p in [[1, 2, 3]]))
    # nothing was sent: the ranks still step alike
    assert tp.generate([[6, 7]], max_tokens=3, ignore_eos=True)[0].outputs[0].token_ids == \
        alone.generate([[6, 7]], max_tokens=3, ignore_eos=True)[0].outputs[0].token_ids


SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    import kvload
    from pipeline.errors import RankError

    from tests.tp_support import all_children

    def kids():
        return all_children(os.getpid())

    class Tokens(dict):  # defined in the script: rank 1's __main__ is not this one, so it cannot unpickle these
        pass

    kw = dict(tensor_parallel_size=2, kv_cache_config={"max_tokens": 1024}, log=False)
    report = {}
    try:
        kvload.LLM("tiny-llama", **{**kw, "kv_cache_config": Tokens(max_tokens=1024)})
    except RankError as exc:
        report["unpickled_arg"], report["left"] = str(exc), sorted(kids())
    llm = kvload.LLM("tiny-llama", **kw)
    try:
        llm.generate([Tokens(prompt_token_ids=[1, 2, 3])], max_tokens=4, ignore_eos=True)
    except ValueError as exc:
        report["unpickled_call"] = str(exc)
    report["first"] = llm.generate([[1, 2, 3]], max_tokens=4, ignore_eos=True)[0].outputs[0].token_ids
    (victim,) = kids()
    os.kill(victim, signal.SIGKILL)
    start = time.monotonic()
    errors = []
    for _ in range(2):
        try:
            llm.generate([[1, 2, 3]], max_tokens=4, ignore_eos=True)
        except RankError as exc:
            errors.append(str(exc))
    report["errors"], report["took"], report["victim"] = errors, time.monotonic() - start, victim
    llm.close()
    report["after_close"] = sorted(kids())
    # a new process group, after the broken one; a call long enough to be killed in (8 x 1000 tokens)
    llm = kvload.LLM("tiny-llama", **{**kw, "kv_cache_config": {"max_tokens": 8192}})
    (victim,) = kids()
    threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()  # while it generates
    start = time.monotonic()
    try:
        llm.generate([[1, 2, 3]] * 8, max_tokens=1000, ignore_eos=True)
    except RankError as exc:
        report["mid_call"], report["mid_took"], report["mid_victim"] = str(exc), time.monotonic() - start, victim
    llm.close()
    llm = kvload.LLM("tiny-llama", **kw)
    report["second"] = llm.generate([[1, 2, 3]], max_tokens=4, ignore_eos=True)[0].outputs[0].token_ids
    report["workers"] = sorted(kids())
    print(json.dumps(report), flush=True)
    # the script ends without closing the LLM: its ranks must go with it
""")


def test_a_plain_script_names_a_killed_rank_and_leaves_no_process(tmp_path):
    report = _script_report(tmp_path, SCRIPT)
    assert report["first"] == report["second"] and len(report["first"]) == 4
    unpickle = r"cannot unpickle .*Can't get attribute 'Tokens'.*; define its class in a module the ranks can import"
    assert re.match(rf"LLM: tensor_parallel_size=2: rank 1 \(pid \d+\) {unpickle}", report["unpickled_arg"]), report
    assert "kv_cache_config" in report["unpickled_arg"] and report["left"] == []
    assert re.match(rf"generate: prompts: rank 1 \(pid \d+\) {unpickle}", report["unpickled_call"]), report
    first, again = report["errors"]
    assert first.startswith(f"generate: tensor_parallel_size=2: rank 1 (pid {report['victim']}) was killed by SIGKILL;"
                            " this LLM cannot run any more"), first
    assert again == first  # every later call says the same, at once
    assert report["took"] < DIST_TIMEOUT_S  # a bound, not a speed: no wait for the collective timeout
    assert report["mid_call"].startswith(f"generate: tensor_parallel_size=2: rank 1 (pid {report['mid_victim']}) "
                                         "was killed by SIGKILL;"), report
    assert report["mid_took"] < DIST_TIMEOUT_S
    assert report["after_close"] == [] and len(report["workers"]) == 1
    deadline = time.monotonic() + 30
    while _alive(report["workers"][0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(report["workers"][0]), "rank 1 outlived the script"


EARLY_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    import kvload
    import kvload.llm_ranks as llm_ranks
    from pipeline.errors import RankError

    from tests.tp_support import all_children

    def kids():
        return all_children(os.getpid())

    kw = dict(tensor_parallel_size=2, kv_cache_config={"max_tokens": 1024}, log=False)
    report = {}
    start = llm_ranks.SpawnedRanks.start

    def started(self):  # rank 1 took the LLM's arguments and is loading: killed long before it joins the group
        start(self)
        report["victim"] = self.ranks[0].proc.pid
        os.kill(report["victim"], signal.SIGKILL)

    llm_ranks.SpawnedRanks.start = started
    began = time.monotonic()
    try:
        kvload.LLM("tiny-llama", **kw)
    except RankError as exc:
        report["error"] = str(exc)
    report["took"], report["left"] = time.monotonic() - began, sorted(kids())
    llm_ranks.SpawnedRanks.start = start
    with kvload.LLM("tiny-llama", **kw) as llm:  # the same process starts a group again
        report["after"] = llm.generate([[1, 2, 3]], max_tokens=3, ignore_eos=True)[0].outputs[0].token_ids
    report["workers"] = sorted(kids())
    print(json.dumps(report), flush=True)
""")


def test_a_rank_that_dies_before_the_process_group_forms_is_named_at_once_and_leaves_no_process(tmp_path):
    """Rank 0 waited at the rendezvous for a rank that had died while loading until the collective timeout
    (``KVLOAD_DIST_TIMEOUT_S``, 600 s by default). It now joins once every rank says it is about to, and sees the
    rank's process end while it waits: one ``RankError`` naming the rank, its pid and how it ended; nothing left
    running; a new LLM starts in the same process afterwards (a rendezvous given up on would have stopped it)."""
    report = _script_report(tmp_path, EARLY_SCRIPT)
    assert report["error"].startswith(f"LLM: tensor_parallel_size=2: rank 1 (pid {report['victim']}) was killed by "
                                      "SIGKILL"), report
    assert report["took"] < DIST_TIMEOUT_S  # a bound, not a speed: no wait for the collective timeout
    assert report["left"] == [] and report["workers"] == []
    assert len(report["after"]) == 3


HANDSHAKE_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    import kvload
    import kvload.llm_ranks as llm_ranks
    from pipeline.errors import RankError

    from tests.tp_support import all_children

    def kids():
        return all_children(os.getpid())

    def listening(port):
        found = []
        for name in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in open(name).read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    found.append(local)
        return found

    kw = dict(tensor_parallel_size=2, kv_cache_config={"max_tokens": 1024}, log=False)
    report = {}
    shm = set(os.listdir("/dev/shm"))
    joining = llm_ranks.SpawnedRanks._joining

    def joined(self):  # every rank said it is about to join; rank 1 is then in torch's rendezvous, reaching for
        joining(self)  # rank 0's store, which rank 0 opens once this returns
        victim, report["port"] = self.ranks[0].proc.pid, self.port
        report["victim"] = victim
        time.sleep(1.0)
        os.kill(victim, signal.SIGSTOP)  # held mid-handshake: rank 0 now joins and waits for it

        def kill():
            time.sleep(1.0)  # rank 0 waits in the rendezvous by now
            report["killed_at"] = time.monotonic()
            os.kill(victim, signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()

    llm_ranks.SpawnedRanks._joining = joined
    try:
        kvload.LLM("tiny-llama", **kw)
    except RankError as exc:
        report["error"] = str(exc)
    report["took"] = time.monotonic() - report["killed_at"]
    report["left"], report["listening"] = sorted(kids()), listening(report["port"])
    report["shm"] = sorted(set(os.listdir("/dev/shm")) - shm)
    llm_ranks.SpawnedRanks._joining = joining
    with kvload.LLM("tiny-llama", **kw) as llm:  # the same process starts a group again
        report["after"] = llm.generate([[1, 2, 3]], max_tokens=3, ignore_eos=True)[0].outputs[0].token_ids
    report["workers"] = sorted(kids())
    print(json.dumps(report), flush=True)
""")


def test_a_rank_killed_while_rank_0_waits_in_the_rendezvous_is_named_at_once_and_leaves_nothing(tmp_path):
    """Every rank said it joins, rank 0 entered torch's rendezvous, and rank 1 died there (held mid-handshake by
    SIGSTOP, then SIGKILL while rank 0 waits): rank 0 waited inside ``init_process_group`` until the collective
    timeout (``KVLOAD_DIST_TIMEOUT_S``). Now it watches its ranks while the group forms: one ``RankError`` naming the
    rank, its pid and the signal, soon after the kill; no process left, the rendezvous port no longer listening, no
    shared memory; a new LLM then starts in the same process."""
    report = _script_report(tmp_path, HANDSHAKE_SCRIPT)
    assert report.get("error", "").startswith(f"LLM: tensor_parallel_size=2: rank 1 (pid {report['victim']}) was "
                                              "killed by SIGKILL"), report
    assert report["took"] < DIST_TIMEOUT_S / 2  # a bound, not a speed: no wait for the collective timeout
    assert report["left"] == [] and report["listening"] == [] and report["shm"] == []
    assert report["workers"] == [] and len(report["after"]) == 3


NCCL_GROUP_SCRIPT = textwrap.dedent("""
    import json, os, signal, threading, time
    import torch.distributed as dist
    import kvload
    import kvload.llm_ranks as llm_ranks
    import pipeline.ranks as ranks
    from pipeline.errors import RankError

    from tests.tp_support import all_children

    def kids():
        return all_children(os.getpid())

    kw = dict(tensor_parallel_size=2, kv_cache_config={"max_tokens": 1024}, log=False)
    report, seen = {}, {}
    rank_zero, hosted, backend = llm_ranks.SpawnedRanks.rank_zero, ranks._hosted_init, dist.get_backend

    def spy(self):
        seen["ranks"] = self
        return rank_zero(self)

    def then_as_on_cuda(*args):  # the group formed; on NCCL rank 0 then makes its gloo group, a rendezvous of its own
        hosted(*args)
        dist.get_backend = lambda *a: "nccl"
        victim = report["victim"] = seen["ranks"].ranks[0].proc.pid

        def kill():
            time.sleep(1.0)  # rank 0 waits in new_group's rendezvous by now
            report["killed_at"] = time.monotonic()
            os.kill(victim, signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()

    llm_ranks.SpawnedRanks.rank_zero, ranks._hosted_init = spy, then_as_on_cuda
    try:
        kvload.LLM("tiny-llama", **kw)
    except RankError as exc:
        report["error"] = str(exc)
    report["took"] = time.monotonic() - report["killed_at"]
    report["left"] = sorted(kids())
    llm_ranks.SpawnedRanks.rank_zero, ranks._hosted_init, dist.get_backend = rank_zero, hosted, backend
    with kvload.LLM("tiny-llama", **kw) as llm:
        report["after"] = llm.generate([[1, 2, 3]], max_tokens=3, ignore_eos=True)[0].outputs[0].token_ids
    print(json.dumps(report), flush=True)
""")


def test_a_rank_killed_while_rank_0_forms_its_object_group_on_nccl_is_named_at_once(tmp_path):
    """On CUDA the NCCL init does not wait for the ranks (torch's barrier is off without a device id); rank 0's next
    rendezvous, the gloo group it passes objects on, does, and it was not watched: a rank killed there was waited for
    until the collective timeout, then named by no rank. Emulated on CPU (rank 0 takes the NCCL branch after its
    group formed): one ``RankError`` naming rank 1 and the signal, soon after the kill; nothing left; a new LLM then
    starts."""
    report = _script_report(tmp_path, NCCL_GROUP_SCRIPT)
    assert report.get("error", "").startswith(f"LLM: tensor_parallel_size=2: rank 1 (pid {report['victim']}) was "
                                              "killed by SIGKILL"), report
    assert report["took"] < DIST_TIMEOUT_S / 2  # a bound, not a speed: no wait for the collective timeout
    assert report["left"] == [] and len(report["after"]) == 3


RANK_IN_COLLECTIVE = """
import os, signal, sys, datetime
import torch, torch.distributed as dist
from kvload import llm_ranks

rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=600))
if rank == 1:  # as a rank's main() sets itself up
    llm_ranks._exit_on_term(llm_ranks.TERM_GRACE_S)
    print("waiting", flush=True)
    dist.all_reduce(torch.ones(4))  # rank 0 never joins: the rank that left mid-call
else:
    print("left", flush=True)
    signal.pause()
"""


def test_a_rank_waiting_in_a_collective_rank_0_left_ends_on_sigterm(tmp_path):
    """Ctrl-C on a tensor-parallel script leaves rank 1 in a collective rank 0 never joins; rank 0 then sends it
    SIGTERM, whose Python handler never runs there (the main thread is in gloo's wait), so only the SIGKILL
    ``PARTED_TERM_S`` later ended it. The rank's watcher (``_exit_on_term``) ends it with SIGTERM's status (without it,
    or with its wakeup socket closed, the rank was still waiting when the check gave up)."""
    from tests.tp_support import free_port

    script = tmp_path / "rank.py"
    script.write_text(RANK_IN_COLLECTIVE)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for r in (0, 1)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["left", "waiting"]
        time.sleep(0.5)  # rank 1 is inside all_reduce
        procs[1].send_signal(signal.SIGTERM)
        try:
            rc = procs[1].wait(timeout=20)  # a bound on a hang, not a speed
        except subprocess.TimeoutExpired:
            rc = None
        assert rc == 143
    finally:
        for p in procs:
            p.kill()
            p.wait()


FOUR_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    import kvload
    from pipeline.errors import RankError

    from tests.tp_support import all_children

    def kids():
        return all_children(os.getpid())

    report = {}
    for victim_rank in (2, 3):
        llm = kvload.LLM(sys.argv[1], tensor_parallel_size=4, max_seq_len=2048, kv_cache_config={"max_tokens": 8192},
                         log=False)
        victim = llm._ranks.ranks[victim_rank - 1].proc.pid
        threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()  # while it generates (8 x 1000 tokens)
        start = time.monotonic()
        try:
            llm.generate([[1, 2, 3]] * 8, max_tokens=1000, ignore_eos=True)
            report[victim_rank] = {"error": None}
        except Exception as exc:
            report[victim_rank] = {"error": f"{type(exc).__name__}: {exc}", "victim": victim,
                                   "took": time.monotonic() - start}
        llm.close()
        report[victim_rank]["left"] = sorted(kids())
    print(json.dumps(report), flush=True)
""")


def test_a_rank_killed_mid_generation_among_four_is_named_at_once_and_the_others_end(tmp_path):
    # With four ranks a death did not reach rank 0: gloo's ring all-reduce in the forward had it wait on a living
    # neighbour stuck on the dead rank, so killing rank 2 left rank 0 in the forward until the collective timeout
    # (then a RankError); killing rank 3 gave gloo's raw "Connection reset by peer" RuntimeError after PARTED_S (30 s)
    # of waiting for rank 1. Now rank 0 ends the other ranks once one dies mid-call and names the one that died.
    ckpt = four_kv_head_llama(tmp_path / "ckpt")
    report = _script_report(tmp_path, FOUR_SCRIPT, str(ckpt))
    for rank in ("2", "3"):
        got = report[rank]
        assert got["error"] is not None and got["error"].startswith(
            f"RankError: generate: tensor_parallel_size=4: rank {rank} (pid {got['victim']}) was killed by SIGKILL; "
            "this LLM cannot run any more"), got
        assert got["took"] < DIST_TIMEOUT_S / 2, got  # a bound, not a speed: neither timeout nor PARTED_S waited out
        assert got["left"] == [], got


# --- the watch over a call's ranks (no model: processes that stand in for ranks) ------------------------------------


def _stand_in_ranks(world: int):
    """A ``SpawnedRanks`` whose ranks 1..world-1 are ``sleep`` processes (each with its socket and stderr file)."""
    import socket
    import tempfile
    from multiprocessing.connection import Connection
    from unittest import mock

    from kvload import llm_ranks

    # the module's `pair` (an LLM of two ranks, rank 0 in this process) holds a process group until the module ends,
    # which SpawnedRanks refuses to start beside; these stand-ins start none
    with mock.patch("torch.distributed.is_initialized", return_value=False):
        spawned = llm_ranks.SpawnedRanks(world, "stand-in", {})
    spawned._loading = False
    for rank in range(1, world):
        mine, theirs = socket.socketpair()
        theirs.close()
        proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
        spawned.ranks.append(llm_ranks._Rank(rank, proc, Connection(mine.detach()),
                                             tempfile.TemporaryFile()))  # noqa: SIM115 (close() closes it)
    return spawned


def test_the_watch_over_a_stream_ends_when_the_llm_closes_though_the_stream_is_never_read_again():
    """A stream its consumer holds unread keeps its call open (lock and watch) until collected; close() ends the
    ranks, and the watch with them: it had polled the ended ranks every 50 ms for as long as the stream lived."""
    spawned = _stand_in_ranks(3)
    assert spawned._lock.acquire(blocking=False)  # as begin() holds it for the stream's life
    spawned._start_watch()
    watcher = spawned._watcher
    spawned.close()
    watcher.join(30)  # a bound, not a speed: it ends at its next poll (50 ms)
    assert not watcher.is_alive()
    assert all(r.proc.returncode is not None for r in spawned.ranks)
    spawned.end("generate_stream", None)  # the stream collected at last: nothing left to stop
    assert spawned._lock.acquire(blocking=False)


def test_a_ctrl_c_as_the_watch_starts_breaks_the_llm_like_any_other_mid_call():
    """The ranks were sent the call: a KeyboardInterrupt between that and rank 0's own call (the watch starting) must
    leave the LLM broken and the ranks ended, as one inside the call does, not a usable LLM out of step with them."""
    spawned = _stand_in_ranks(3)
    spawned._send = lambda *a: None  # the ranks "took" the call

    def interrupted() -> None:
        raise KeyboardInterrupt

    spawned._start_watch = interrupted
    with pytest.raises(KeyboardInterrupt):
        spawned.call("generate", lambda llm: "done", object(), (), {})
    try:
        assert spawned.broken is not None and "interrupted" in spawned.broken
        assert all(r.proc.returncode is not None for r in spawned.ranks)
    finally:
        spawned.close()


#: rank 2's ``sitecustomize``: once rank 0 creates the flag file (mid-generation), its MLP's activation raises
_RANK_2_RAISES = """
import os
if os.environ.get("RANK") == "2":
    import torch.nn.functional as F

    silu = F.silu

    def failing(*args, **kwargs):
        if os.path.exists(os.environ["KVLOAD_TEST_FLAG"]):
            raise RuntimeError("rank two broke on its own")
        return silu(*args, **kwargs)

    F.silu = failing
"""

RAISES_SCRIPT = textwrap.dedent("""
    import json, os, sys, threading, time
    inject = os.path.join(os.getcwd(), "inject")
    os.environ["PYTHONPATH"] = inject + os.pathsep + os.environ["PYTHONPATH"]  # the ranks' sitecustomize
    flag = os.environ["KVLOAD_TEST_FLAG"] = os.path.join(os.getcwd(), "flag")
    import kvload

    from tests.tp_support import all_children

    def kids():
        return all_children(os.getpid())

    llm = kvload.LLM(sys.argv[1], tensor_parallel_size=4, max_seq_len=2048, kv_cache_config={"max_tokens": 8192},
                     log=False)
    failing = llm._ranks.ranks[1].proc.pid
    threading.Timer(1.0, lambda: open(flag, "w").close()).start()  # while it generates (8 x 1000 tokens)
    start = time.monotonic()
    try:
        llm.generate([[1, 2, 3]] * 8, max_tokens=1000, ignore_eos=True)
        report = {"error": None}
    except Exception as exc:
        report = {"error": f"{type(exc).__name__}: {exc}", "failing": failing, "took": time.monotonic() - start}
    llm.close()
    report["left"] = sorted(kids())
    print(json.dumps(report), flush=True)
""")


def test_a_rank_that_raises_alone_mid_generation_among_four_is_named_and_the_others_end(tmp_path):
    # rank 2 of 4 raised on its own mid-forward (not killed): it answered rank 0 with its error and stayed alive, so
    # rank 0 waited in the forward's all-reduce for it until the collective timeout, then raised gloo's raw "Timed
    # out waiting ... for recv". Now the ranks are ended once a rank failed the call alone, and it is named.
    ckpt = four_kv_head_llama(tmp_path / "ckpt")
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(_RANK_2_RAISES)
    got = _script_report(tmp_path, RAISES_SCRIPT, str(ckpt))
    assert got["error"] is not None and got["error"].startswith(
        f"RankError: generate: tensor_parallel_size=4: rank 2 (pid {got['failing']}) failed the call while rank 0 was "
        "still in it: RuntimeError: rank two broke on its own; this LLM cannot run any more"), got
    assert got["took"] < DIST_TIMEOUT_S / 2, got  # a bound, not a speed: the collective timeout was not waited out
    assert got["left"] == [], got


def test_under_torchrun_rank_0_alone_publishes_the_kv_events_of_an_llm(tmp_path):
    # each rank runs the script, so each built the ZeroMQ publisher: rank 1's bind of the same endpoint failed, and
    # with it that rank's LLM; now rank 0 publishes, as serve does (vLLM's one publisher per engine)
    import msgspec
    import zmq

    from tests.tp_support import free_port, torchrun

    port = free_port()
    script = tmp_path / "events.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        import kvload
        with kvload.LLM("tiny-llama", tensor_parallel_size=2, kv_cache_config={{"max_tokens": 1024}}, log=False,
                        kv_events_config={{"enable_kv_cache_events": True, "endpoint": "tcp://*:{port}"}}) as llm:
            time.sleep(1.0)  # a SUB socket hears only what is sent after it joined
            out = llm.generate([list(range(1, 70))], kvload.SamplingParams(max_tokens=2, temperature=0))
            time.sleep(0.5)  # the publisher's thread sends it
            # one write: print() writes each piece apart when unbuffered (PYTHONUNBUFFERED=1), and the two ranks'
            # pieces interleaved on the shared pipe ("rankrank 1  0 [...]")
            sys.stdout.write(f"rank {{os.environ['RANK']}} {{out[0].outputs[0].token_ids}}\\n")
    """))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        r = torchrun(str(script))
        assert r.returncode == 0, r.stderr[-3000:]
        assert sorted(line.split()[1] for line in r.stdout.splitlines() if line.startswith("rank")) == ["0", "1"]
        batches = []
        while sub.poll(2000):
            batches.append(msgspec.msgpack.decode(sub.recv_multipart()[2]))
    finally:
        sub.close(linger=0)
        ctx.term()
    stored = [e for b in batches for e in b["events"] if e["type"] == "BlockStored"]
    assert [e["token_ids"] for e in stored] == [list(range(1, 65))]  # two 32-token blocks, once: one publisher
    assert {b["data_parallel_rank"] for b in batches} == {0}
