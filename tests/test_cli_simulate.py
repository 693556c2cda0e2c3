"""`kvload simulate` and `kvload plan --compare [--chart]` from the command line (in process)."""

from __future__ import annotations

import sys

import pytest

from tests.cli_support import read_events, run_cli

SMALL_SP = ("--requests", "8", "--workload-arg", "group_size=4", "--workload-arg", "prefix_len=64",
            "--workload-arg", "question_len=8", "--workload-arg", "answer_len=4")
REQUIRED = {"hit_rate", "ideal_hit_rate", "peak_usage", "max_concurrency", "steps", "suspends", "waits",
            "step_time_us_median", "step_time_us_p99", "budget_bytes"}


def test_simulate_compare_json_has_both_managers_at_one_budget(capsys):
    r = run_cli(capsys, "simulate", "tiny-llama", "--workload", "shared-prefix", *SMALL_SP, "--compare",
                "--device", "cpu", "--max_tokens", "4096", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert {"model", "workload", "requests", "results"} <= set(doc)
    assert (doc["model"], doc["workload"], doc["requests"]) == ("tiny-llama", "shared-prefix", 8)
    assert set(doc["results"]) == {"KVCacheManager", "KVCacheManagerV2"}
    budgets = set()
    for name, res in doc["results"].items():
        assert set(res) >= REQUIRED, name
        assert res["status"] == "ok" and res["kv_manager"] == name
        assert res["hit_rate"] == res["ideal_hit_rate"] == doc["ideal_hit_rate"]  # prefix of 2 whole blocks
        budgets.add(res["budget_bytes"])
    assert budgets == {doc["budget_bytes"]} == {4096 * 1024}


def test_simulate_says_why_v2_has_no_host_tier_on_the_priced_hardware(capsys):
    """tiny-llama recomputes an evicted token for less than a copy to the host and back costs, on an H200 as on an
    L40S: V2's result says so, and V1's (no host tier to choose) says nothing."""
    for hardware in ("h200", "l40s"):
        r = run_cli(capsys, "simulate", "tiny-llama", "--workload", "no-reuse", "--requests", "2", "--workload-arg",
                    "prompt_len=40", "--workload-arg", "answer_len=3", "--device", "cpu", "--compare", "--hardware",
                    hardware)
        assert r.code == 0, r.err
        name = {"h200": "H200", "l40s": "L40S"}[hardware]
        assert f"  KVCacheManagerV2 host tier: on {name}, recomputing an evicted token (" in r.out
        assert "KVCacheManager host tier" not in r.out


def test_simulate_without_compare_runs_the_routed_manager_and_prints_a_table(capsys):
    r = run_cli(capsys, "simulate", "tiny-llama", "--workload", "no-reuse", "--requests", "4",
                "--workload-arg", "prompt_len=40", "--workload-arg", "answer_len=3", "--device", "cpu")
    assert r.code == 0, r.err
    assert "simulate  tiny-llama  workload no-reuse (4 requests, seed 0; prompt_len=40, answer_len=3)" in r.out
    assert "KVCacheManager" in r.out and "KVCacheManagerV2" not in r.out
    for label in ("hit rate (reused / prompt tokens)", "peak usage", "max concurrency", "steps to finish",
                  "suspends / resumes", "waits (request-steps)", "step time median", "step time p99"):
        assert label in r.out
    assert "default: 4 sequence(s) of 43 tokens in the routed KVCacheManager layout" in r.out


def test_simulate_reports_v1_not_routable_for_deepseek_v4(capsys):
    r = run_cli(capsys, "simulate", "tiny-deepseek-v4", "--workload", "no-reuse", "--requests", "2",
                "--workload-arg", "prompt_len=200", "--workload-arg", "answer_len=2", "--max_seq_len", "512",
                "--device", "cpu", "--compare", "--json")
    assert r.code == 0, r.err
    v1, v2 = r.json()["results"]["KVCacheManager"], r.json()["results"]["KVCacheManagerV2"]
    assert v1["status"] == "not_routable" and "V1 cannot serve this model" in v1["reason"]
    assert v1["hit_rate"] is None and v2["status"] == "ok" and v2["steps"] > 0


def test_simulate_progress_bar_goes_to_stderr_only_when_asked(capsys):
    args = ("simulate", "tiny-llama", "--workload", "no-reuse", "--requests", "3", "--workload-arg",
            "prompt_len=10", "--workload-arg", "answer_len=2", "--device", "cpu", "--json")
    shown = run_cli(capsys, *args, "--progress")
    assert shown.code == 0 and "KVCacheManager no-reuse" in shown.err
    hidden = run_cli(capsys, *args)  # stderr is not a terminal here
    assert hidden.code == 0 and hidden.err == ""
    assert shown.json()["results"]["KVCacheManager"]["finished"] == 3


@pytest.mark.parametrize(("args", "message"), [
    (("--workload", "chat"), "error: --workload: invalid choice: 'chat'"),
    (("--workload", "no-reuse", "--requests", "0"), "error: --requests: expected an integer >= 1, got '0'"),
    (("--workload", "no-reuse", "--workload-arg", "depth=3"), "error: workload no-reuse has no parameter 'depth'"),
    (("--workload", "no-reuse", "--workload-arg", "prompt_len"), "error: --workload-arg: expected KEY=INTEGER"),
    # the simulation's own sizes: Python's "TypeError: make_workload() got multiple values for argument 'requests'"
    *[(("--workload", "shared-prefix", "--workload-arg", f"{key}=4"),
       f"error: workload shared-prefix: {key} is no workload parameter (--workload-arg) but the simulation's own: "
       f"give --{key} N") for key in ("requests", "seed")],
    (("--workload", "no-reuse", "--workload-arg", "prompt_len=64", "--workload-arg", "prompt_len=2048"),
     "error: --workload-arg prompt_len: given twice (64 and 2048)"),
    (("--workload", "long-context", "--max_seq_len", "1024"), "error: max_seq_len=1024 is below the longest"),
    (("--workload", "no-reuse", "--compare", "--use_kv_cache_manager_v2", "true"),
     "error: --compare simulates both managers; drop --use_kv_cache_manager_v2"),
    (("--workload", "long-context", "--workload-arg", "prompt_len=100", "--max_tokens", "32"),
     "error: KVCacheManager cannot finish workload long-context at a budget of 32,768 B"),
    (("--workload", "long-context", "--workload-arg", "prompt_len=100", "--max_tokens", "32", "--compare"),
     "error: neither KVCacheManager nor KVCacheManagerV2 can finish workload long-context at a budget of 32,768 B: "
     "KVCacheManager: stalled"),
])
def test_simulate_bad_input_is_one_line_and_exit_2(capsys, args, message):
    r = run_cli(capsys, "simulate", "tiny-llama", "--device", "cpu", *args)
    assert r.code == 2, r.err
    assert r.one_error_line and r.err.startswith(message), r.err


def test_many_requests_that_never_fit_name_the_first_few_and_count_the_rest(capsys):
    """Every request the pool could never admit had its own clause: 1,000 of them made a 140 KB error line."""
    r = run_cli(capsys, "simulate", "tiny-llama", "--device", "cpu", "--workload", "long-context", "--requests", "200",
                "--max_tokens", "64")
    assert r.code == 2 and r.one_error_line, r.err[:300]
    assert r.err.startswith("error: KVCacheManager cannot finish workload long-context at a budget of 65,536 B: "
                            "request lc-0 needs 256 blocks for 8192 tokens (prompt + max_new_tokens) but the pool "
                            "holds 2 blocks of 32 tokens; it can never be admitted; request lc-1 "), r.err[:300]
    assert r.err.endswith("; and 192 more reasons; raise --max_tokens or --max_gpu_total_bytes\n"), r.err[-300:]
    assert len(r.err) < 2000


@pytest.mark.parametrize("compare", [(), ("--compare",)])
def test_a_budget_past_host_memory_names_the_flag_given_not_the_bytes_it_became(capsys, compare):
    """simulate hands every manager the budget as max_gpu_total_bytes; the advice named that field (never typed) and,
    with --compare, ended in 'raise --max_tokens' for pools that were too big. The pools take no memory in a
    simulation, but 34 billion blocks' bookkeeping would."""
    r = run_cli(capsys, "simulate", "tiny-llama", "--device", "cpu", "--workload", "no-reuse", "--requests", "8",
                "--max_tokens", str(2**40), *compare)  # 1 PiB of pools
    assert r.code == 2 and r.one_error_line, r.err
    assert "bookkeeping" in r.err and r.err.rstrip().endswith(
        "lower kv_cache_config.max_tokens or raise kv_cache_config.tokens_per_block"), r.err
    assert "max_gpu_total_bytes" not in r.err and "--max_tokens" not in r.err


@pytest.mark.parametrize("v2", ["false", "true"])
def test_simulate_runs_a_budget_this_host_could_not_hold(capsys, v2):
    """A simulation reads no KV, so its pools are shapes without memory: a GPU's budget for Llama 3.1 8B, twice this
    host's memory, is simulated as given (it was refused: 'KV pools of ... B exceed the ... B of memory this host has
    available'), and the V2 host tier beside it too."""
    from cache_backends.budget import host_available_bytes

    budget = 2 * max(host_available_bytes() or 0, 2**34)
    r = run_cli(capsys, "simulate", "tests/data/configs/llama-3.1-8b-instruct", "--device", "cpu", "--workload",
                "no-reuse", "--requests", "4", "--workload-arg", "prompt_len=64", "--workload-arg", "answer_len=2",
                "--max_gpu_total_bytes", str(budget), "--use_kv_cache_manager_v2", v2, "--json")
    assert r.code == 0, r.err
    (res,) = r.json()["results"].values()
    assert res["status"] == "ok" and res["finished"] == 4
    assert budget - 2**23 < res["pool_bytes"] <= budget  # whole 4 MiB blocks of the budget


def test_simulate_runs_a_v2_host_tier_this_host_could_not_hold(capsys):
    """The V2 host tier of a simulation is unbacked too, so a GPU server's host_cache_size (more than this host has)
    is simulated as given; it was refused ('a host tier of ... B exceeds the ... B of host memory available')."""
    from cache_backends.budget import host_available_bytes

    size = 2 * max(host_available_bytes() or 0, 2**34)
    r = run_cli(capsys, "simulate", "tests/data/configs/llama-3.1-8b-instruct", "--device", "cpu", "--workload",
                "no-reuse", "--requests", "4", "--workload-arg", "prompt_len=64", "--workload-arg", "answer_len=2",
                "--max_gpu_total_bytes", str(2**32), "--host_cache_size", str(size), "--use_kv_cache_manager_v2",
                "true", "--json")
    assert r.code == 0, r.err
    (res,) = r.json()["results"].values()
    assert res["status"] == "ok" and res["finished"] == 4


@pytest.mark.parametrize("host", ["slot per block", "0"])
def test_simulate_counts_the_v2_host_tiers_bookkeeping(capsys, monkeypatch, host):
    """A V2 host tier of a slot per block (its free list: ~40 B each) beside the blocks' ~86 B; the bound counted the
    blocks only, so a budget whose blocks fit half the memory but whose slots did not ran on. (Sized in bytes: on the
    priced H200 the auto tier is none for tiny-llama, whose tokens recompute for less than their copies cost.)"""
    import stages.build_kv_manager as build

    blocks = 2**16  # --max_tokens 2**16 at one token a block
    # the blocks' bookkeeping fits half of it, theirs and their slots' does not
    monkeypatch.setattr(build, "host_available_bytes",
                        lambda: 2 * blocks * (build.BOOKKEEPING_BYTES_PER_BLOCK + 20))
    size = "0" if host == "0" else str(blocks * 1024)  # tiny-llama: 1,024 B of KV a token
    r = run_cli(capsys, "simulate", "tiny-llama", "--device", "cpu", "--workload", "no-reuse", "--requests", "2",
                "--workload-arg", "prompt_len=8", "--workload-arg", "answer_len=2", "--max_tokens", str(blocks),
                "--tokens_per_block", "1", "--use_kv_cache_manager_v2", "true", "--host_cache_size", size)
    if host == "0":  # no tier: the blocks alone, which fit
        assert r.code == 0, r.err
        return
    assert r.code == 2 and r.one_error_line, r.err
    assert f"{blocks} KV blocks and {blocks} host-tier slots need about" in r.err, r.err
    assert "kv_cache_config.host_cache_size (0: no host tier)" in r.err


def test_plan_compare_prints_v1_against_v2_at_the_routed_budget(capsys):
    r = run_cli(capsys, "plan", "tiny-gemma3", "--device", "cpu", "--max_tokens", "16384", "--compare")
    assert r.code == 0, r.err
    # 16,384 tokens in the routed V1 layout: 6 layers x 64 elems x 4 B per token = 25,165,824 B for both
    assert "capacity at one budget: 25,165,824 B (max_tokens 16384" in r.out
    table = r.out[r.out.index("capacity at one budget"):]
    assert "bytes/token" in table and "1,536" in table and "256" in table
    assert "sequences of 8,192  2" in table


def test_plan_compare_json_numbers_follow_the_layouts(capsys):
    r = run_cli(capsys, "plan", "tiny-gemma3", "--device", "cpu", "--max_tokens", "16384", "--compare", "--json")
    assert r.code == 0, r.err
    cmp = r.json()["compare"]
    assert cmp["budget_bytes"] == 16384 * 1536 and cmp["lengths"] == [1024, 4096, 8192]
    v1, v2 = cmp["managers"]["KVCacheManager"], cmp["managers"]["KVCacheManagerV2"]
    assert (v1["bytes_per_token"], v2["bytes_per_token"]) == (1536, 256)
    assert v1["pool_bytes"] <= cmp["budget_bytes"] and v2["pool_bytes"] <= cmp["budget_bytes"]
    budget = cmp["budget_bytes"]
    for row in v1["lengths"]:  # one uniform pool: whole sequences of ceil(L / 32) blocks of 49,152 B
        assert row["max_concurrency"] == budget // (-(-row["seq_len"] // 32) * 49152)
    # V2 at 8,192: one full layer (256 blocks of 8,192 B) plus five 512-token windows (17 blocks of 40,960 B)
    at_8k = next(row for row in v2["lengths"] if row["seq_len"] == 8192)
    assert at_8k["bytes_per_sequence"] == 256 * 8192 + 17 * 40960
    assert at_8k["max_concurrency"] == budget // at_8k["bytes_per_sequence"] == 9
    ratio = next(x["ratio"] for x in cmp["v2_over_v1"]["max_concurrency"] if x["seq_len"] == 8192)
    assert ratio == 4.5


def test_plan_compare_without_a_budget_uses_the_documented_default(capsys):
    r = run_cli(capsys, "plan", "tiny-llama", "--device", "cpu", "--compare", "--json")
    assert r.code == 0, r.err
    cmp = r.json()["compare"]
    assert cmp["budget"]["default"] and cmp["budget_bytes"] == 16 * 8192 * 1024
    assert "16 sequence(s) of 8,192 tokens" in cmp["budget"]["source"]


def test_plan_compare_names_why_v1_cannot_serve_deepseek_v4(capsys):
    r = run_cli(capsys, "plan", "tiny-deepseek-v4", "--device", "cpu", "--max_tokens", "65536", "--compare")
    assert r.code == 0, r.err
    assert "KVCacheManager: not routable: V1 cannot serve this model" in r.out


def test_plan_chart_writes_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "cap.png"
    r = run_cli(capsys, "plan", "tiny-gemma3", "--device", "cpu", "--max_tokens", "16384", "--chart", out)
    assert r.code == 0, r.err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert "capacity at one budget" in r.out  # --chart implies --compare


def test_plan_chart_errors_are_one_line(capsys, tmp_path, monkeypatch):
    r = run_cli(capsys, "plan", "tiny-llama", "--device", "cpu", "--chart", tmp_path / "missing" / "c.png")
    assert r.code == 2 and r.one_error_line and "--chart" in r.err and "does not exist" in r.err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    r = run_cli(capsys, "plan", "tiny-llama", "--device", "cpu", "--chart", tmp_path / "c.png")
    assert r.code == 2 and r.one_error_line and "--chart needs matplotlib" in r.err


def test_plan_chart_extension_is_checked_before_planning(capsys, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import engine.capacity

    monkeypatch.setattr(engine.capacity, "compare_capacity", lambda *a, **k: pytest.fail("planned before the check"))
    r = run_cli(capsys, "plan", "tiny-llama", "--device", "cpu", "--compare", "--chart", tmp_path / "x.txt")
    assert r.code == 2 and r.one_error_line, r.err
    assert r.err.startswith("error: --chart ") and "cannot draw to extension .txt; accepted extensions: " in r.err
    assert ".png" in r.err and ".svg" in r.err and not (tmp_path / "x.txt").exists()


def test_plan_chart_refuses_an_existing_file_unless_forced(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "cap.png"
    out.write_bytes(b"keep me")
    r = run_cli(capsys, "plan", "tiny-llama", "--device", "cpu", "--chart", out)
    assert r.code == 2 and r.one_error_line and "--chart" in r.err and "pass --force to replace it" in r.err
    assert out.read_bytes() == b"keep me"
    r = run_cli(capsys, "plan", "tiny-llama", "--device", "cpu", "--chart", out, "--force")
    assert r.code == 0, r.err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_chart_write_that_fails_keeps_the_old_chart_and_leaves_nothing(capsys, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import errno
    import os

    from matplotlib.figure import Figure

    def savefig_on_a_full_disk(self, fname, **kwargs):
        with open(fname, "wb") as f:  # a PNG cut short, as a disk that fills mid-write leaves it
            f.write(b"\x89PNG\r\n\x1a\n" + b"\x00" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    out = tmp_path / "cap.png"
    out.write_bytes(b"the old chart")
    monkeypatch.setattr(Figure, "savefig", savefig_on_a_full_disk)
    r = run_cli(capsys, "plan", "tiny-llama", "--device", "cpu", "--chart", out, "--force")
    assert r.code == 1 and r.one_error_line, r.err  # a full disk is outside the settings: exit 1
    assert "--chart" in r.err and str(out) in r.err and "No space left on device" in r.err
    assert out.read_bytes() == b"the old chart"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cap.png"]  # no temporary left beside it


def test_a_chart_is_written_under_the_longest_file_name(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / ("c" * 251 + ".png")  # 255 bytes: the usual NAME_MAX
    r = run_cli(capsys, "plan", "tiny-llama", "--device", "cpu", "--chart", out)
    assert r.code == 0, r.err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_plan_compare_refuses_a_forced_manager(capsys):
    r = run_cli(capsys, "plan", "tiny-llama", "--compare", "--use_kv_cache_manager_v2", "true")
    assert r.code == 2 and r.one_error_line and "drop --use_kv_cache_manager_v2" in r.err


@pytest.mark.parametrize(("model", "says"), [
    ("tests/data/configs/gemma-3-27b-it", "KVCacheManagerV2: pages of 11 layers for 6 groups, at most 9.1%"),
    ("tiny-gemma3", "KVCacheManagerV2: max_page_padding padded no page: no page larger than gcd(layer counts) = 1"),
])
def test_plan_compare_says_what_max_page_padding_did_to_the_v2_column(capsys, model, says):
    """On a CPU --compare's log holds the routed V1 plan's setting_ignored only: the V2 column says whether it
    padded pages, or why not, where it would otherwise be silent about a setting the user gave."""
    flags = ("plan", model, "--device", "cpu", "--max_tokens", "16384", "--max_page_padding", "0.1", "--compare")
    r = run_cli(capsys, *flags)
    assert r.code == 0, r.err
    assert says in r.out[r.out.index("capacity at one budget"):]
    v2 = run_cli(capsys, *flags, "--json").json()["compare"]["managers"]["KVCacheManagerV2"]
    assert v2["padding"].startswith(says.removeprefix("KVCacheManagerV2: "))
    off = run_cli(capsys, "plan", model, "--device", "cpu", "--max_tokens", "16384", "--compare", "--json")
    assert off.json()["compare"]["managers"]["KVCacheManagerV2"]["padding"] is None  # 0: nothing to say


SMALL_MIXED = ("simulate", "tiny-llama", "--workload", "mixed", "--requests", "6", "--device", "cpu", "--json")


@pytest.mark.parametrize(("flags", "fields"), [
    (("--attention_backend", "triton"), ["attention_backend"]),
    (("--linear_backend", "cpu_kernel"), ["linear_backend"]),
    (("--max_draft_len", "4", "--speculation_max_batch_size", "8"), ["max_draft_len", "speculation_max_batch_size"]),
    (("--generation_config", "vllm"), ["generation_config"]),
    (("--override_generation_config", '{"temperature": 0.5, "top_p": 0.9}'),
     ["override_generation_config.temperature", "override_generation_config.top_p"]),
])
def test_simulate_says_each_setting_of_the_forward_pass_it_was_given_does_nothing(capsys, tmp_path, flags, fields):
    """The replay runs no model: a setting only generation acts on is accepted, changes no figure, and is reported
    setting_ignored once, in the log and the audit (on main it was taken in silence)."""
    plain = run_cli(capsys, *SMALL_MIXED)
    audit = tmp_path / "sim.jsonl"
    r = run_cli(capsys, *SMALL_MIXED, *flags, "--audit-log", audit)
    assert r.code == 0, r.err
    drop = ("step_time_us_median", "step_time_us_p99", "step_time_us_mean", "kv_seconds", "wall_seconds")
    figures = [{k: v for k, v in doc["results"]["KVCacheManager"].items() if k not in drop}
               for doc in (plain.json(), r.json())]
    assert figures[0] == figures[1]
    ignored = [e for e in read_events(audit) if e["event"] == "setting_ignored"]
    assert [e["field"] for e in ignored] == fields
    assert all("no forward pass" in e["reason"] for e in ignored)
    assert all(f"field={field}" in r.err for field in fields)


def test_simulate_says_a_forward_setting_from_the_config_file_does_nothing_and_drafts_off_once(capsys, tmp_path):
    """A --config file's attention_backend is the user's too; max_matching_ngram_size with drafts off keeps its one
    'speculative decoding is off' line, and a plan (generate's settings shown) says nothing of them."""
    config = tmp_path / "c.yaml"
    config.write_text("attention_backend: flex\nmax_matching_ngram_size: 3\n", encoding="utf-8")
    r = run_cli(capsys, *SMALL_MIXED, "--config", config)
    assert r.code == 0, r.err
    assert r.err.count("setting_ignored") == 2
    assert "field=attention_backend value=flex" in r.err and "no forward pass" in r.err
    assert "field=max_matching_ngram_size" in r.err and "speculative decoding is off" in r.err
    plan = run_cli(capsys, "plan", "tiny-llama", "--device", "cpu", "--attention_backend", "flex")
    assert plan.code == 0 and "setting_ignored" not in plan.err


def test_compare_says_the_v2_column_used_the_host_tier_the_log_calls_ignored(capsys):
    """On a CPU --compare logs the routed V1 plan, whose setting_ignored says V1 has no host tier; the V2 column
    built the user's 1 MiB tier and said nothing of it (host_tier null): it now names the tier and its setting."""
    r = run_cli(capsys, "simulate", "tiny-gemma3", "--workload", "multi-turn", "--requests", "4", "--device", "cpu",
                "--compare", "--host_cache_size", "1MiB")
    assert r.code == 0, r.err
    assert "field=kv_cache_config.host_cache_size" in r.err and "V1 has no host tier" in r.err
    says = "KVCacheManagerV2 host tier: 1,048,576 B of host memory (kv_cache_config.host_cache_size=1,048,576 B)"
    assert says in r.out
    doc = run_cli(capsys, "simulate", "tiny-gemma3", "--workload", "multi-turn", "--requests", "4", "--device", "cpu",
                  "--compare", "--host_cache_size", "1MiB", "--json").json()["results"]
    assert doc["KVCacheManagerV2"]["host_tier"] == says.split("host tier: ")[1]
    assert doc["KVCacheManager"]["host_tier"] is None
