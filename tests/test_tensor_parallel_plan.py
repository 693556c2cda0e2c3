"""Tensor parallel in one process: the setting, its checks against the checkpoint, and each rank's KV geometry."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipeline
from models import load_hf_config, resolve_checkpoint
from models.geometry import head_sharding, layers_from_config
from pipeline.errors import ConfigError, ModelError, RankError
from pipeline.ranks import Ranks, rank_audit_path, ranks_from_env, timeout_s
from stages.apply_model_defaults import validate_model_defaults
from tests.cli_support import run_cli

CONFIGS = Path(__file__).parent / "data" / "configs"


def hf(name: str):
    return load_hf_config(resolve_checkpoint(str(CONFIGS / name)))


def per_layer_elems(name: str, tp: int) -> int:
    return layers_from_config(hf(name), name, tp)[0].entry_elems


def test_tensor_parallel_size_defaults_to_one_and_is_checked_where_set():
    assert pipeline.LlmArgs(model="m").tensor_parallel_size == 1
    with pytest.raises(ConfigError, match="tensor_parallel_size: expected an integer >= 1, got 0"):
        pipeline.LlmArgs(model="m", tensor_parallel_size=0)


def test_a_model_may_not_set_the_tensor_parallel_size():
    with pytest.raises(ModelError, match="key 'tensor_parallel_size' may not be set by a model"):
        validate_model_defaults({"tensor_parallel_size": 2}, "SomeSpec")


@pytest.mark.parametrize(("name", "tp", "mode", "kv_per_rank"), [
    ("llama-3.1-8b-instruct", 2, "shard", 4),  # 8 KV heads over 2 ranks
    ("qwen2.5-7b-instruct", 2, "shard", 2),  # 4 KV heads over 2 ranks
    ("qwen2.5-7b-instruct", 4, "shard", 1),
    ("llama-3.1-8b-instruct", 16, "replicate", 1),  # 8 KV heads, 16 ranks: each head on 2 ranks
    ("deepseek-r1-0528", 8, "latent", 1),  # the MLA latent is whole on every rank
])
def test_kv_heads_shard_replicate_or_stay_whole(name, tp, mode, kv_per_rank):
    heads = head_sharding(hf(name), tp, name)
    assert (heads.mode, heads.kv_heads_per_rank) == (mode, kv_per_rank)
    if mode == "latent":
        assert per_layer_elems(name, tp) == per_layer_elems(name, 1)
    else:
        assert per_layer_elems(name, tp) * heads.kv_heads == per_layer_elems(name, 1) * kv_per_rank


@pytest.mark.parametrize(("name", "tp", "message"), [
    ("qwen2.5-7b-instruct", 8, "Qwen2ForCausalLM has 28 attention heads, which do not divide by 8 ranks; "
                               "accepted: 1, 2, 4, 28"),
    ("qwen2.5-7b-instruct", 7, "has 4 KV heads: 7 ranks neither divide them nor are a multiple of them; "
                               r"accepted: 1, 2, 4, 28 \(28 only to plan and run: loading weights needs a size that "
                               "divides the 4 KV heads\\)$"),
    ("llama-3.1-8b-instruct", 3, r"accepted: 1, 2, 4, 8, 16, 32 \(16, 32 only to plan and run: "),
])
def test_other_combinations_are_refused_in_one_line(name, tp, message):
    with pytest.raises(ModelError, match=message) as info:
        head_sharding(hf(name), tp, hf(name).architectures[0])
    assert "\n" not in str(info.value)


def test_plan_json_reports_bytes_per_token_per_rank_and_in_total(capsys):
    one = run_cli(capsys, "plan", str(CONFIGS / "llama-3.1-8b-instruct"), "--json").json()["kv"]
    two = run_cli(capsys, "plan", str(CONFIGS / "llama-3.1-8b-instruct"), "--tp_size", "2", "--json").json()["kv"]
    assert two["bytes_per_token_per_rank"] == one["bytes_per_token"] / 2
    assert two["bytes_per_token_total"] == one["bytes_per_token"]
    assert two["tensor_parallel"]["heads"]["kv_heads_per_rank"] == 4
    assert two["tensor_parallel"]["size"] == 2


def test_plan_table_and_aliases_in_one_process(capsys):
    for flag in ("--tp_size", "--tp-size", "--tensor_parallel_size", "--tensor-parallel-size"):
        r = run_cli(capsys, "plan", "tiny-llama", flag, "2")
        assert r.code == 0, r.err
        assert "tensor parallel  2 ranks, 2 of 4 query heads and 1 of 2 KV heads per rank" in r.out
        assert "bytes/token 512 per rank, 1,024 in total" in r.out


def test_bad_sizes_are_one_line_exit_2(capsys):
    r = run_cli(capsys, "plan", "tiny-llama", "--tp_size", "3")
    assert (r.code, r.one_error_line) == (2, True)
    assert "tensor_parallel_size=3: LlamaForCausalLM has 4 attention heads" in r.err
    # the Python API in one process cannot hold 2 ranks' pools (the CLI starts its ranks: test_tensor_parallel_launch)
    with pytest.raises(RankError) as caught:
        pipeline.load("tiny-llama", tensor_parallel_size=2, kv_cache_config={"max_tokens": 4096}, log=False)
    assert str(caught.value) == (
        "tensor_parallel_size=2: building the KV pools needs all 2 ranks, and this process runs alone; launch it with "
        "torchrun --nproc-per-node 2, or from the command line, where kvload run, generate and serve start the 2 ranks "
        "themselves (plan shows one rank's view without them)")


def test_rank_from_the_environment_and_audit_file_per_rank():
    assert ranks_from_env({}) == Ranks(0, 1, 0)
    assert ranks_from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == Ranks(1, 2, 1)
    with pytest.raises(RankError, match="RANK=2 WORLD_SIZE=2: expected 0 <= RANK < WORLD_SIZE"):
        ranks_from_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(RankError, match="WORLD_SIZE='two': expected an integer"):
        ranks_from_env({"WORLD_SIZE": "two"})
    assert rank_audit_path("logs/audit.jsonl", Ranks(0, 2, 0)) == "logs/audit.jsonl"
    assert rank_audit_path("logs/audit.jsonl", Ranks(1, 2, 1)) == "logs/audit.rank1.jsonl"
    for ranks in (Ranks(0, 2, 0), Ranks(1, 2, 1)):  # left empty for the check to say so (Path("") is ".")
        assert rank_audit_path("", ranks) == ""


@pytest.fixture
def rank_1(monkeypatch):
    """This process as rank 1 of 2 (torchrun's variables), and a stage class recording the ranks that ran it."""
    from pipeline import ranks

    monkeypatch.setattr(ranks, "_output", None)  # what the rank would tell the others: this process's, left as it was
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(name, value)
    ran: list[int] = []

    class Record:
        name = "record"

        def run(self, ctx, emit):
            ran.append(ctx.ranks.rank)

    return Record, ran


@pytest.mark.parametrize("folder", ["a.rank1.jsonl", "a.jsonl"])
def test_rank_n_of_the_python_api_refuses_its_audit_file_or_the_path_as_given_before_any_stage_runs(tmp_path, rank_1,
                                                                                                   folder):
    # the CLI's --audit-log checked the file each rank writes (<stem>.rankN<suffix>); the API's audit_log checked only
    # the path as given, so rank 1 ran every stage and failed at the end with a bare IsADirectoryError, publishing
    # onto a folder. Both now set the sink up alike (pipeline.ranks.rank_audit_sink). And the path as given is
    # checked on every rank: were only its own file, rank 1 would run and publish while rank 0 refused the folder
    from pipeline.context import LoadRequest
    from pipeline.run import execute

    (tmp_path / folder).mkdir()
    Record, ran = rank_1
    with pytest.raises(ConfigError) as caught:
        execute(LoadRequest(model="tiny-llama"), [Record()], audit_log=tmp_path / "a.jsonl", log=False)
    assert str(caught.value) == f"audit_log {tmp_path / folder}: is a directory, expected a file path"
    assert ran == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder]
    (tmp_path / folder).rmdir()  # a file it can write: rank 1 runs and publishes its own
    assert execute(LoadRequest(model="tiny-llama"), [Record()], audit_log=tmp_path / "a.jsonl", log=False)
    assert ran == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.rank1.jsonl"]


@pytest.mark.parametrize("text", ["inf", "nan", "1e400"])
def test_a_collective_timeout_torch_cannot_take_is_named_before_anything_runs(capsys, monkeypatch, text):
    """``KVLOAD_DIST_TIMEOUT_S=inf`` (as in "wait for ever") ended every rank with "agree_ranks: OverflowError:
    cannot convert float infinity to integer", and ``nan`` with "torch.distributed cannot start (...); launch the
    ranks with torchrun" (under torchrun): NaN passed the check of ``> 0``. Now one line naming the variable, exit 2,
    from the rank's first look at its environment."""
    monkeypatch.setenv("KVLOAD_DIST_TIMEOUT_S", text)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    r = run_cli(capsys, "plan", "tiny-llama", "--tp_size", "2")
    assert (r.code, r.one_error_line, r.out) == (2, True, "")
    assert r.err == (f"error: environment KVLOAD_DIST_TIMEOUT_S={text!r}: expected a number of seconds in (0, "
                     "604800] (a week)\n")
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process waits for no one: the variable is not read
    assert run_cli(capsys, "plan", "tiny-llama").code == 0


def test_a_rendezvous_port_in_use_is_one_line_naming_it():
    # rank 0 listens at MASTER_ADDR:MASTER_PORT; another process holding it was "launch the ranks with torchrun"
    import os
    import socket
    import subprocess
    import sys

    from tests.tp_support import REPO

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "RANK": "0",
               "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "KVLOAD_DIST_TIMEOUT_S": "30"}
        r = subprocess.run([sys.executable, "-m", "kvload", "plan", "tiny-llama", "--tp_size", "2"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr == (f"error: torch.distributed cannot start: the rendezvous address MASTER_ADDR:MASTER_PORT "
                        f"127.0.0.1:{port} is already in use by another process; give a free port (torchrun "
                        "--master-port PORT, or MASTER_PORT)\n")


def test_a_collective_timeout_is_bounded_and_finite():
    """A week at most (a billion seconds waited that long for a rank that never came), and a number."""
    assert timeout_s({}) == 600.0 and timeout_s({"KVLOAD_DIST_TIMEOUT_S": "604800"}) == 604800.0
    for text in ("1e9", "604801", "-5", "0", "ten"):
        with pytest.raises(RankError, match=r"expected a number of seconds in \(0, 604800\] \(a week\)"):
            timeout_s({"KVLOAD_DIST_TIMEOUT_S": text})


def test_a_single_process_run_records_rank_zero_of_one():
    result = pipeline.plan("tiny-llama", log=False)
    joined = result.audit.of("rank_joined")
    assert [(e["rank"], e["world_size"], e["tensor_parallel_size"]) for e in joined] == [(0, 1, 1)]
    assert result.audit.of("ranks_agreed") == []  # alone: nothing to compare


def test_loading_weights_refuses_kv_heads_transformers_cannot_replicate(checkpoint_dir):
    from stages.load_weights import check_plan_matches_pools

    ok = pipeline.plan(str(checkpoint_dir()), tensor_parallel_size=2, log=False)  # 2 KV heads: 1 per rank
    check_plan_matches_pools(ok.context)
    one = pipeline.plan(str(checkpoint_dir(name="one", num_key_value_heads=1)), tensor_parallel_size=2, log=False)
    assert one.kv.heads["mode"] == "replicate"  # plan accepts it: the pools replicate the head
    # and says that a load will not (generate and serve refuse it before any rank starts)
    assert any("plan and run only, generate and serve refuse it" in line for line in one.kv.render())
    with pytest.raises(ModelError, match="cannot split its 1 KV heads over 2 ranks .* divides the KV heads \\(1\\)"):
        check_plan_matches_pools(one.context)


class FakeRanks:
    """Two ranks in one process: rank 1 reports whatever the test says it decided."""

    distributed = True

    def __init__(self, other):
        self.other = other

    def all_gather(self, obj):
        return [obj, self.other(obj)]


def test_a_diverging_schedule_fails_before_the_forward():
    from cache_backends.interface import ScheduledChunk, SchedulerOutput
    from cache_backends.request import Request
    from engine.executor import RankLockstep
    from pipeline.errors import KvRuntimeError

    out = SchedulerOutput(scheduled=[ScheduledChunk(Request("0.0", [1, 2, 3], 4), 3)])
    RankLockstep(FakeRanks(lambda mine: mine)).check_schedule(out, [{"uniform": [0]}])  # the same: no error
    other = RankLockstep(FakeRanks(lambda mine: []))
    with pytest.raises(KvRuntimeError, match="step 1: the ranks' schedulers diverged: rank 1 scheduled nothing"):
        other.check_schedule(out, [{"uniform": [0]}])



def test_ranks_whose_accelerators_choose_the_auto_host_tier_differently_all_go_without_one():
    """Rank 0 keeps the auto tier (its device is not one kvload prices), rank 1's H200 drops it: every rank must build
    the same manager, or one suspends where the other preempts and the schedule check parts them mid-run."""
    from pipeline.context import LoadRequest
    from pipeline.run import execute
    from stages import plan_stages
    from stages.rank_budget import agree_rest

    def plan(hardware):
        overrides = {"device": "cpu", "kv_cache_config": {"use_kv_cache_manager_v2": True, "max_tokens": 8192}}
        return execute(LoadRequest(model="tiny-llama", overrides=overrides, pools_unbacked=True, hardware=hardware),
                       plan_stages(), log=False).kv

    keep, drop = plan(None), plan("h200")
    assert keep.host_bytes > 0 and drop.host_bytes == 0
    rank0 = agree_rest(FakeRanks(lambda mine: (None, 0)), keep.layout, keep.pools, None, None, keep.host_slots,
                       keep.host_bytes)
    rank1 = agree_rest(FakeRanks(lambda mine: (None, keep.host_bytes)), drop.layout, drop.pools, None, 0,
                       drop.host_slots, drop.host_bytes)
    assert rank0[1:] == rank1[1:] == (0, {}, 0)


@settings(max_examples=200, deadline=None)
@given(heads=st.integers(1, 64), n_kv=st.integers(1, 64), latent=st.booleans(), most=st.integers(2, 70))
def test_the_sizes_an_error_lists_are_exactly_those_head_sharding_takes(heads, n_kv, latent, most):
    # one rule for the split, the message listing sizes and the refusal to load weights on a replicating size: a
    # message that lists a size the split then refuses (or leaves one out) sends users round in circles
    from types import SimpleNamespace

    from models.geometry import accepted_sizes

    cfg = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=n_kv, num_hidden_layers=2, head_dim=8,
                          hidden_size=8 * heads, **({"kv_lora_rank": 16, "qk_rope_head_dim": 8} if latent else {}))
    taken, replicating = [], []
    for t in range(1, min(heads, most) + 1):
        try:
            sharding = head_sharding(cfg, t)
        except ModelError:
            continue
        taken.append(t)
        if sharding.mode == "replicate":
            replicating.append(t)
    listed = accepted_sizes(heads, None if latent else n_kv, most=most)
    sizes, _, note = listed.partition(" (")
    assert [int(x) for x in sizes.split(", ")] == taken
    assert note.split(" only")[0].split(", ") == ([str(t) for t in replicating] if replicating else [""])
