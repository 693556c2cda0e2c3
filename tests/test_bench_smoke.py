"""The benchmark scripts still run (tiny sizes; no timing is asserted, only that they measure something)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import bench_block_pool, bench_hashing, bench_scheduler, run_all


def test_block_pool_repeat_times_every_allocator():
    r = bench_block_pool.one_repeat(n=10, iters=5, pool_blocks=1_000)
    assert set(r) == set(bench_block_pool.IMPLS)
    assert all(v["alloc_med"] > 0 and v["free_max"] >= v["free_med"] for v in r.values())


def test_scheduler_bench_steps_every_request_once_per_decode_step():
    times = bench_scheduler.decode_steps_us("v2", True, running=8, steps=3, seed=0)
    assert len(times) == 3 and all(t > 0 for t in times)


def test_run_all_writes_the_markdown_report(tmp_path, capsys):
    out = tmp_path / "bench.md"
    assert run_all.main(["--quick", "--only", "hashing", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("## kvload benchmarks (quick sizes)") and "- cpu: " in text
    assert "### Prefix hashing" in text and "| 32 |" in text
    assert text in capsys.readouterr().out
    assert bench_hashing.run(True)[0].rows


def test_grid_compares_v1_and_v2_per_cell_and_judges_the_targets():
    from bench import bench_grid

    rows, table = bench_grid.grid(("tiny-llama",), ("no-reuse",), ("default",), quick=True)
    (row,) = rows
    assert row["status"] == {"v1": "ok", "v2": "ok"} and row["v1"].finished == row["v2"].finished == 128
    assert row["steps_ratio"] == row["v2"].steps / row["v1"].steps and "ok" in row
    assert table.rows[0][:3] == ["tiny-llama", "no-reuse", "default"]
    assert any(note.startswith("Every cell") for note in table.notes)


def test_the_grids_decisions_file_holds_each_cells_clock_free_figures_and_repeats_exactly(tmp_path):
    from bench import bench_grid

    args = ["--only", "grid", "--quick", "--presets", "tiny-llama", "--workloads", "no-reuse", "--budgets", "tight"]
    bench_grid.main([*args, "--decisions", str(tmp_path / "a.jsonl")])
    bench_grid.main([*args, "--decisions", str(tmp_path / "b.jsonl")])
    (line,) = (tmp_path / "a.jsonl").read_text().splitlines()
    cell = json.loads(line)
    assert (cell["preset"], cell["workload"], cell["budget"]) == ("tiny-llama", "no-reuse", "tight")
    assert cell["v1"]["finished"] == cell["v2"]["finished"] > 0 and "step_time_us_median" not in cell["v2"]
    # the point of the file: two runs of the same tree compare equal byte for byte (no clock inside)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    with pytest.raises(SystemExit) as exc:  # accepted only where it acts: the timing table has no decisions to write
        bench_grid.main(["--only", "timing", "--decisions", str(tmp_path / "c.jsonl")])
    assert exc.value.code == 2 and not (tmp_path / "c.jsonl").exists()


def test_the_split_bench_runs_both_rules_and_puts_the_old_one_back():
    from bench import bench_grid
    from cache_backends.layout import KvLayout

    rule = KvLayout.split_length
    table = bench_grid.split_pools(workloads=("no-reuse",), budgets=("default",), quick=True)
    (row,) = table.rows
    before, after = (int(n.replace(",", "")) for n in row[2].split(" (")[0].split(" -> "))
    assert row[:2] == ["no-reuse", "default"] and after < before  # windows for short requests: fewer steps
    assert KvLayout.split_length is rule


def test_the_grids_mixed_urgent_cells_run_mixed_traffic_with_urgent_requests_under_the_priority_policy(monkeypatch):
    import engine.simulator
    from bench import bench_grid

    seen = []
    real = engine.simulator.simulate

    def spy(preset, workload, **kw):
        seen.append((workload.name, sum(r.priority > 0 for r in workload.requests), kw.get("scheduling_policy")))
        return real(preset, workload, **kw)

    monkeypatch.setattr(engine.simulator, "simulate", spy)
    rows, _ = bench_grid.grid(("tiny-llama",), ("mixed-urgent",), ("default",), quick=True)
    (row,) = rows
    assert row["workload"] == "mixed-urgent" and row["status"] == {"v1": "ok", "v2": "ok"}
    assert seen and all(name == "mixed" and urgent > 0 and policy == "priority" for name, urgent, policy in seen)


def test_step_cost_bench_pairs_both_sides_of_every_figure_and_restores_the_wall_clock():
    import time

    from bench import bench_step_cost
    from engine.driver import Driver

    figures = bench_step_cost.measure(pairs=1, quick=True)
    assert set(figures) == set(bench_step_cost.FIGURES)
    assert all(len(r["a"]) == len(r["b"]) == 1 and r["a"][0] > 0 and r["b"][0] > 0 for r in figures.values())
    assert Driver.step.__globals__["time"] is time  # thread CPU time only inside the measurement
    table = bench_step_cost.table({"this tree": figures}, "cmd")
    assert [row[1] for row in table.rows] == list(bench_step_cost.FIGURES)
    assert all(row[-1] in ("met", "**missed**") for row in table.rows)


def test_step_cost_bench_runs_both_sides_at_the_asked_fraction_of_the_default_budget():
    # --budget 0.25: the grid's tight cells, where requests wait (the V2 scheduler's carried waits cost nothing
    # at the default budget, where none waits): both sides at the same bytes, a quarter of simulate's default
    from bench import bench_step_cost
    from engine.simulator import simulate
    from engine.workloads import make_workload

    wl = make_workload("multi-turn", 4, 0)
    base = simulate("tiny-llama", wl, **bench_step_cost.CPU).budget.bytes
    a, b = bench_step_cost._at_budget("tiny-llama", wl, 0.25, ({"x": 1}, {"y": 2}))
    assert a == {"x": 1, "max_gpu_total_bytes": base // 4} and b == {"y": 2, "max_gpu_total_bytes": base // 4}
    # no --budget: still the same bytes for both (the default's); left to their own defaults, V2 on a sliding-window
    # model got a third of V1's bytes (its layout's), and the CPU figure compared V2 queueing with V1 not
    wl = make_workload("mixed", 8, 0)
    base = simulate("tiny-gemma3", wl, **bench_step_cost.CPU).budget.bytes
    sides = ({"use_kv_cache_manager_v2": False}, {"use_kv_cache_manager_v2": True})
    a, b = bench_step_cost._at_budget("tiny-gemma3", wl, None, sides)
    assert a["max_gpu_total_bytes"] == b["max_gpu_total_bytes"] == base
    assert simulate("tiny-gemma3", wl, kv_cache_config=sides[1], **bench_step_cost.CPU).budget.bytes < base


def test_step_cost_bench_counts_opcodes_or_times_whole_runs_instead_of_the_median_step():
    from bench import bench_step_cost

    only = ["multi-turn V2/V1"]
    ops = bench_step_cost.measure(1, True, only, opcodes=True)
    assert set(ops) == set(only) and all(len(ops[only[0]][s]) == 1 and ops[only[0]][s][0] > 1000 for s in "ab")
    row = bench_step_cost.table({"this tree": ops}, "cmd", opcodes=True).rows[0]
    assert row[2:] == [f"{ops[only[0]]['a'][0]:,.0f}", f"{ops[only[0]]['b'][0]:,.0f}",
                       f"{ops[only[0]]['b'][0] / ops[only[0]]['a'][0]:.2f}x"]
    whole = bench_step_cost.measure(1, True, only, total=True)[only[0]]
    step = bench_step_cost.measure(1, True, only)[only[0]]
    assert all(whole[s][0] * 1e3 > 10 * step[s][0] for s in "ab")  # a run of ~150 steps (ms) vs its median step (µs)


def test_pressure_bench_runs_both_managers_per_cell_and_refuses_an_unknown_cell(capsys):
    from bench import bench_pressure

    bench_pressure.main(["--only", "tiny-llama long-context"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny-llama")]
    assert len(lines) == 1
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    assert float(cells[1]) > 0 and float(cells[2]) > 0
    assert cells[4] == "2,049 / 2,049"  # two at a time on both managers: the same steps (the grid's cell)
    with pytest.raises(SystemExit):
        bench_pressure.main(["--only", "no such cell"])


def test_arena_calls_bench_times_each_call_on_an_arena_shaped_as_a_finish_finds_it(capsys):
    from bench import bench_arena_calls

    pool, tables = bench_arena_calls._arena(3, 4)
    pool.release_tables(list(enumerate(tables)), 0)  # a finish: the cached blocks queued, each partial last one freed
    assert sorted(pool.evictable.blocks()) == sorted(b for table in tables for b in table[:-1])
    figures = bench_arena_calls.measure(3, 4, 2)
    assert list(figures) == list(bench_arena_calls.CALLS)
    assert all(len(runs) == 2 and min(runs) > 0 for runs in figures.values())
    bench_arena_calls.main(["--groups", "3", "--blocks", "4", "--repeat", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]  # past the header
    assert [row.split("|")[1].strip() for row in rows] == list(bench_arena_calls.CALLS)
    with pytest.raises(SystemExit) as refused:
        bench_arena_calls.main(["--groups", "0"])
    assert refused.value.code == 2 and "--groups must be at least 1, got 0" in capsys.readouterr().err


def test_host_copies_bench_counts_a_suspend_a_resume_and_a_fork_on_a_31_group_arena(capsys):
    from bench import bench_host_copies

    model = "tests/data/configs/gemma-3-27b-it"
    for count in (bench_host_copies._timed, bench_host_copies._opcodes):
        figures = bench_host_copies._run(model, "meta", 20, 2, count)  # the suspend and resume assert they happened
        assert list(figures) == list(bench_host_copies.CALLS)
        assert all(len(runs) == 2 and min(runs) > 0 for runs in figures.values())
    with pytest.raises(SystemExit) as refused:
        bench_host_copies.main(["--tokens", "32"])
    assert refused.value.code == 2 and "a multiple of 16 ends on a block" in capsys.readouterr().err


def test_opcode_counter_counts_the_kv_work_alike_every_run_and_only_inside_its_block():
    """The deterministic measure quoted beside CPU times: the same run counts the same once module-level memos are
    warm (the first run fills a few), work outside the KV calls counts nothing, and the patched methods are
    restored."""
    import sys

    from bench.common import kv_opcode_counter
    from cache_backends.v2.scheduler import KVCacheV2Scheduler
    from engine.simulator import simulate
    from engine.workloads import make_workload

    def python_work() -> int:  # not KV work: its opcodes must not count
        total = 0
        for i in range(1000):
            total += i
        return total

    def theirs(frame, event, arg):  # a tracer already set (a debugger's, coverage's): put back after the block
        return None

    step = KVCacheV2Scheduler.step
    wl = make_workload("no-reuse", 16, 0)
    counts = []
    sys.settrace(theirs)
    try:
        for _ in range(3):
            with kv_opcode_counter() as count:
                python_work()
                assert count[0] == 0
                simulate("tiny-llama", wl, kv_cache_config={"use_kv_cache_manager_v2": True})
            counts.append(count[0])
            assert sys.gettrace() is theirs
    finally:
        sys.settrace(None)
    assert counts[1] == counts[2] > 1000 and abs(counts[0] - counts[1]) < counts[1] / 1000
    assert KVCacheV2Scheduler.step is step


def test_opcode_counter_leaves_out_what_a_collection_inside_the_kv_work_runs():
    """A gc callback (hypothesis installs one once a @given test ran) ran under the trace whenever a collection landed
    inside a counted call, and where one lands depends on allocations outside the KV work: the same run counted
    differently. With collections at nearly every allocation the count is the one without them."""
    import gc

    from bench.common import kv_opcode_counter
    from engine.simulator import simulate
    from engine.workloads import make_workload

    wl = make_workload("no-reuse", 8, 0)
    kv = {"use_kv_cache_manager_v2": True}

    def count_one() -> int:
        with kv_opcode_counter() as count:
            simulate("tiny-llama", wl, kv_cache_config=kv)
        return count[0]

    count_one()  # module-level memos warm
    quiet = count_one()
    calls: list[str] = []

    def callback(phase, info):  # Python code a collection runs, as hypothesis' is
        calls.append(phase)

    threshold = gc.get_threshold()
    gc.callbacks.append(callback)
    gc.set_threshold(1)
    try:
        busy = count_one()
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(callback)
    assert calls  # collections did run during the run, outside the counted calls
    assert busy == quiet
    assert gc.isenabled()


def test_radix_runs_prototype_evicts_exactly_as_the_block_queue_on_the_no_reuse_pattern():
    from bench import proto_radix_runs as proto

    nblocks = 20 * (proto.PROMPT_BLOCKS + proto.DECODE_BLOCKS) + 50
    ops = proto.lifecycle_ops(3, 120, 20)  # 2,400 blocks through a pool of 450: most allocations evict
    handed = {}
    for impl in (proto.Main(nblocks), proto.Runs(nblocks), proto.RunsBlockQueue(nblocks)):
        assert proto.replay(impl, ops) >= 0
        handed[type(impl).__name__] = impl.handed
    assert len(handed["Main"]) == 120 * (proto.PROMPT_BLOCKS + proto.DECODE_BLOCKS)
    assert handed["Main"] == handed["Runs"] == handed["RunsBlockQueue"]
    assert len(set(handed["Main"])) == nblocks  # every block handed out, the cached ones evicted and reused


def test_radix_runs_manager_prototype_steps_and_evicts_as_main_on_no_reuse():
    import cache_backends.v2 as v2
    from bench import proto_radix_runs_sim as sim
    from engine.simulator import simulate
    from engine.workloads import make_workload

    # at this budget cached blocks are evicted and nothing is suspended; partial reuse off: the runs keep no finished
    # request's partial last block, as main keeps one for a follow-up turn to copy
    wl = make_workload("no-reuse", 128, 0)
    facts = {}
    for name, cls in (("main", v2.KVCacheManagerV2), ("runs", sim.RunsManagerV2), ("ids", sim.RunsIdsManagerV2),
                      ("bq", sim.RunsBlockQueueManagerV2)):
        saved, v2.KVCacheManagerV2 = v2.KVCacheManagerV2, cls
        try:
            report = simulate("tiny-llama", wl, device="cpu", log=False, progress=False,
                              kv_cache_config={"use_kv_cache_manager_v2": True, "max_tokens": 49152,
                                               "enable_partial_reuse": False})
        finally:
            v2.KVCacheManagerV2 = saved
        (result,) = report.results.values()
        m = result.metrics
        facts[name] = (m.engine_steps, m.evictions, m.finished)
    assert facts["main"][1] > 0 and facts["main"][2] == 128  # the pool filled up and cached blocks were evicted
    assert facts["runs"] == facts["ids"] == facts["bq"] == facts["main"]


def test_bench_attention_mla_paths_agree_and_print_a_row(capsys):
    # the bench checks gather + expand + SDPA against the absorbed form before timing (no compile: --no-flex)
    from bench import bench_attention

    bench_attention.main(["--mla", "--no-flex", "--batch", "2", "--lengths", "24", "--heads", "2", "--nope-dim", "8",
                          "--rope-dim", "4", "--kv-rank", "16", "--v-dim", "8", "--block", "4", "--reps", "1",
                          "--ragged"])
    out = capsys.readouterr().out
    assert "MLA decode, one layer" in out and "heads=2 nope=8 rope=4 kv_rank=16 v=8" in out
    (row,) = [line for line in out.splitlines() if line.split()[:2] == ["2", "24"]]
    assert len(row.split()) == 10  # batch, len, 6 times (flex 0), gather_x, abs_x


def test_bench_linear_checks_the_kernel_against_torch_and_prints_a_row_per_row_count(capsys, tmp_path):
    from bench import bench_linear
    from cache_backends.cpu_kernel_build import compiler

    if compiler() is None:
        pytest.skip("no C compiler to build the CPU kernel with")
    bench_linear.main(["--shape", "tiny", "--rows", "1,3,20", "--reps", "1", "--kernel-cache", str(tmp_path)])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["1", "3", "20"] and all(len(r) == 8 for r in rows)


@pytest.mark.parametrize("flag", ["--compare-attention", "--compare-linear"])
def test_bench_generate_refuses_a_bad_backend_before_loading(flag, capsys, monkeypatch):
    from bench import bench_generate

    monkeypatch.setattr(bench_generate.pipeline, "load", lambda *a, **k: pytest.fail("loaded before refusing"))
    with pytest.raises(SystemExit) as exc:
        bench_generate.main([flag, "sdpa,fast" if "attention" in flag else "torch,fast"])
    assert exc.value.code == 2
    assert f"{flag}: fast is not one of" in capsys.readouterr().err


def test_bench_generate_refuses_bad_draft_lengths_before_loading(capsys, monkeypatch):
    from bench import bench_generate

    monkeypatch.setattr(bench_generate.pipeline, "load", lambda *a, **k: pytest.fail("loaded before refusing"))
    for argv in (["--compare-draft", "0,x"], ["--compare-draft", "0,-1"], ["--draft-max-batch", "0"]):
        with pytest.raises(SystemExit) as exc:
            bench_generate.main(argv)
        assert exc.value.code == 2
    assert "--compare-draft: expected comma-separated integers >= 0" in capsys.readouterr().err


def test_bench_generate_n_samples_every_prompt_and_counts_the_prompt_once(capsys):
    from bench import bench_generate

    with pytest.raises(SystemExit) as exc:
        bench_generate.main(["--n", "0"])
    assert exc.value.code == 2 and "--n: expected an integer >= 1, got 0" in capsys.readouterr().err
    bench_generate.main(["--model", "tiny-llama", "--n", "4", "--batches", "2", "--new-tokens", "3", "--repeats", "1",
                         "--threads", "1", "--attention", "sdpa", "--linear", "torch", "--json"])
    (row,) = json.loads(capsys.readouterr().out)["scenarios"]
    assert row["n"] == 4 and row["kvload_prefill_tokens"] == row["prompt_tokens"] == 12 + 200  # computed once
    assert row["kvload_runs"] and row["hf_runs"]


def test_bench_generate_text_prompts_are_the_bundled_passages_cut_to_each_length():
    from types import SimpleNamespace

    from bench import bench_generate

    tokenizer = lambda text: {"input_ids": [ord(c) for c in text]}  # noqa: E731 - one character, one token
    result = SimpleNamespace(tokenizer=tokenizer)
    passages = [p.strip() for p in bench_generate.TEXT_PROMPTS.read_text().split("\n\n\n") if p.strip()]
    assert len(passages) >= 4
    prompts = bench_generate.scenario_prompts("text", result, [12, 5000], vocab=0)
    assert [len(p) for p in prompts] == [12, 5000]
    assert prompts[0] == [ord(c) for c in passages[0][:12]]
    assert prompts[1][:20] == [ord(c) for c in passages[1][:20]]  # prompt i starts at passage i, then cycles on
    with pytest.raises(SystemExit, match="needs a model with a tokenizer"):
        bench_generate.scenario_prompts("text", SimpleNamespace(tokenizer=None), [4], vocab=0)


def test_sampling_bench_prints_a_row_per_batch_and_setting_with_the_plain_pick_as_its_unit(capsys):
    from bench import bench_sampling

    bench_sampling.main(["--vocab", "1000", "--repeats", "3"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "µs" not in line]
    assert len(rows) == 3 * len(bench_sampling.SETTINGS)
    assert all(row.split("|")[5].strip() == "1.0x" for row in rows if "| none |" in row)


def test_bench_structured_masks_every_constrained_row_and_prints_each_setting(capsys):
    """One round at batch 2: the constrained rows' picks obey their grammar (the mask was applied), the table has a
    row per setting and the pieces of constrain."""
    pytest.importorskip("xgrammar")
    from tests.conftest import needs_smollm2

    if needs_smollm2.args[0]:
        pytest.skip(needs_smollm2.kwargs["reason"])
    import torch

    from bench import bench_structured

    tokenizer = bench_structured.smollm2_tokenizer()
    backend = bench_structured.GrammarBackend(tokenizer, 49_152, {tokenizer.eos_token_id})
    rows = bench_structured.Rows(backend, bench_structured.SETTINGS["regex"], 2)
    tokens, spent = rows.pick(torch.randn(2, 49_152, generator=torch.Generator().manual_seed(0)))
    assert spent > 0 and all(tokenizer.decode([t]).isalpha() and tokenizer.decode([t]).islower() for t in tokens)
    bench_structured.main(["--repeats", "2", "--batches", "2", "--parts"])
    out = capsys.readouterr().out
    assert all(f"| 2 | {name} |" in out for name in bench_structured.SETTINGS)
    assert "| 2 | regex: apply bitmask |" in out and "empty-row scan: amax (now)" in out


def test_responses_store_bench_keeps_every_response_and_a_chained_turn_costs_about_an_independent_one(capsys):
    from bench import bench_responses_store

    bench_responses_store.main(["--responses", "60", "--reply", "100"])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    held: dict[str, int] = {}
    for row in rows:  # the first "independent" row: 200 characters of input
        held.setdefault(row[1].strip(), int(row[3].strip().replace(",", "")))
    assert len(rows) == 5 and held["the same conversation sent whole each turn, store: false"] == 0
    # a chained turn holds its own text and a link, not the chain: no more than a 200-character independent one
    assert 0 < held["one chain of 60 turns"] <= held["independent"]


def test_serve_n_bench_sides_generate_the_same_tokens_and_count_the_prompts_they_compute(tiny_checkpoints, tmp_path):
    """bench_serve_n's three sides against a served tiny model: each choice the same tokens, the prompt computed once
    by the forked side, once per request with own salts, and the server's counters read back."""
    import asyncio
    import os

    from bench import bench_serve_n
    from tests.serve_support import serving
    from tests.test_serve_vllm import words_checkpoint

    path = words_checkpoint(tiny_checkpoints, tmp_path)
    prompt = " ".join(f"w{10 + i}" for i in range(20))  # 21 tokens with the BOS
    with serving(str(path), max_seq_len=64, kv_cache_config={"max_tokens": 1024, "tokens_per_block": 8},
                 state={"model_name": "words"}) as s:
        got = {}
        for side in ("forked", "one salt", "own salts"):
            before = bench_serve_n.counters(s.http, os.getpid())
            r = asyncio.run(bench_serve_n.side_run(s.url, side, "words", prompt, 3, 5, 4))
            after = bench_serve_n.counters(s.http, os.getpid())
            got[side] = (r["ids"], after["computed"] - before["computed"], after["steps"] - before["steps"])
            assert len(r["ttft"]) == 3 and r["wall"] >= max(r["ttft"]) > 0 and after["cpu"] >= before["cpu"]
    assert got["forked"][0] == got["one salt"][0] == got["own salts"][0]
    assert all(len(ids) == 4 for ids in got["forked"][0]) and len(set(map(tuple, got["forked"][0]))) > 1
    assert got["forked"][1] == 21 and got["own salts"][1] == 3 * 21
    assert 21 <= got["one salt"][1] <= 3 * 21 and got["forked"][2] >= 4


def test_bench_generate_sizes_pools_that_hold_a_scenario_in_every_group():
    """DeepSeek V4's HCA group has 128-token blocks: pools sized in ``--tokens-per-block`` units hold fewer of its
    sequences at once than the scenario has (it would run in waves); the bench's larger budget holds them all."""
    import pipeline
    from bench import bench_generate

    lengths = [list(bench_generate.MIXED_LENGTHS)]
    tight = sum(-(-(n + 32) // 32) * 32 for n in lengths[0])
    grown = None
    for budget in (tight, None):
        kv = {"max_tokens": budget or grown, "tokens_per_block": 32, "pool_arena": False}  # per-group pools
        with pipeline.load("tiny-deepseek-v4", load_weights=False, kv_cache_config=kv, log=False,
                           max_seq_len=232) as result:
            grow = bench_generate.pools_short_by(result, lengths, 32, 1)
            spans = {g.tokens_per_block for g in result.kv_manager.pools.layout.groups}
        if budget:
            assert spans == {32, 128} and grow > 1
            grown = -(-int(tight * grow) // 32) * 32
        else:
            assert grow == 1.0


def test_bench_v4_prefill_refuses_bad_flags_before_loading(capsys, monkeypatch, tmp_path):
    from bench import bench_v4_prefill

    monkeypatch.setattr(bench_v4_prefill.kvload, "LLM", lambda *a, **k: pytest.fail("loaded before refusing"))
    for argv, said in ((["--lengths", "600,300"], "--lengths: expected LO,HI"),
                       (["--lengths", "x"], "--lengths: expected LO,HI"),
                       (["--repeats", "0"], "--repeats: expected an integer >= 1"),
                       (["--against", str(tmp_path)], "--against: ")):
        with pytest.raises(SystemExit) as exc:
            bench_v4_prefill.main(argv)
        assert exc.value.code == 2
        assert said in capsys.readouterr().err


def test_bench_v4_prefill_alternates_two_trees_forwards_and_puts_its_own_back(capsys):
    import models.deepseek_v4_paged as v4_paged
    from bench import bench_v4_prefill

    own = v4_paged.paged_v4_forward
    root = str(Path(v4_paged.__file__).parents[1])
    bench_v4_prefill.main(["--prompts", "2", "--lengths", "40,70", "--repeats", "1", "--against", root])
    assert v4_paged.paged_v4_forward is own
    assert re.search(r"thread CPU [\d.]+ s \(this tree\) vs [\d.]+ s \(.*\): [\d.]+x", capsys.readouterr().out)


def test_the_arena_bench_runs_split_and_arena_through_pool_arena_and_says_what_auto_picks():
    # DeepSeek V4's groups of unequal pages: pools split once against one slab arena they take memory from
    from bench import bench_grid

    table = bench_grid.arena_pools(workloads=("mixed",), budgets=("default",), quick=True)
    (row,) = table.rows
    assert row[:2] == ["mixed", "default"] and int(row[2].replace(",", "")) > 0
    split, arena = (int(n.replace(",", "")) for n in row[4].split(" (")[0].split(" -> "))
    assert arena < split  # the groups lend each other the memory they do not use
    assert row[3] in ("arena", "split")


def test_bench_v4_arena_refuses_bad_flags_before_loading(capsys, monkeypatch):
    from bench import bench_v4_arena

    monkeypatch.setattr(bench_v4_arena.kvload, "LLM", lambda *a, **k: pytest.fail("loaded before refusing"))
    for argv in (["--slabs", "x"], ["--slabs", "0"], ["--lengths", "9,3"]):
        with pytest.raises(SystemExit) as err:
            bench_v4_arena.main(argv)
        assert err.value.code == 2


def test_bench_v4_arena_runs_split_and_arena_at_one_budget_with_the_same_tokens(capsys):
    from bench import bench_v4_arena

    bench_v4_arena.main(["--slabs", "8", "--prompts", "2", "--lengths", "20,40", "--new-tokens", "2",
                         "--repeats", "1", "--max-seq-len", "256"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    split, arena = (next(line for line in lines if f", {mode}: pools" in line) for mode in ("split", "arena"))
    assert "8 slabs (786,432 B budget), arena: pools 786,432 B" in arena  # the arena: exactly its slabs
    assert "8 slabs (786,432 B budget), split: pools" in split and "tokens equal: True" in out


def test_the_arena_slabs_bench_sweeps_budgets_in_slabs_of_one_max_seq_len_sequence():
    # pool_arena "auto"'s floor is one max_seq_len sequence's slabs; the sweep prices budgets as multiples of it
    from bench import bench_grid

    table = bench_grid.arena_slabs(workloads=("v4-arena-prompts",), factors=(1.0, 1.5))
    assert [row[2] for row in table.rows] == ["4 (1.0x 4)", "6 (1.5x 4)"]  # 605 tokens: 2 window slabs, 1 csa, 1 hca
    assert {row[1] for row in table.rows} == {"605"}  # max_seq_len: the workload's longest sequence
    assert [row[3] for row in table.rows] == ["arena", "arena"]  # at or above the floor
    for row in table.rows:
        split, arena = (int(n) for n in row[4].split(" (")[0].split(" -> "))
        assert row[4].endswith(f"({arena / split:.2f}x)")
    short = bench_grid.arena_slabs(workloads=("long-context",), factors=(1.0,), max_seq_len=1024, quick=True)
    assert short.rows == [["long-context", "1,024", "- (its longest sequence is 8,192 tokens)", "-", "-", "-", "-"]]


def test_the_grid_bench_refuses_max_seq_len_outside_the_arena_slabs_sweep(capsys):
    from bench import bench_grid

    for argv in (["--max-seq-len", "1024"], ["--only", "arena-slabs", "--max-seq-len", "0"]):
        with pytest.raises(SystemExit) as err:
            bench_grid.main(argv)
        assert err.value.code == 2
    assert "--max-seq-len: a positive integer, for --only arena-slabs alone" in capsys.readouterr().err


def test_the_v2_loss_search_replays_a_found_case_to_its_recorded_figures():
    # BENCHMARKS.md "Searching for V2's losses": sample 28 of seed 0 was the worst case found (GPT-OSS 20B's config,
    # shared-prefix in groups of 3 at 0.42x the default budget: V2 1.56x V1's steps, the held-back shared prefixes),
    # until the hold gave way to V1's room ("The hold gives way to V1's room": 0.90x, every prefix hit the ideal's).
    # A scheduler change that moves it must update the figures here and the table there, not leave the tool's
    # replay lines pointing at figures it no longer gives.
    from bench import search_v2_losses as s

    case = s.sample(0, 28)
    line = ("preset=tests/data/configs/gpt-oss-20b,workload=shared-prefix,wseed=455,budget=0.422,policy=fcfs,"
            "requests=60,group_size=3,prefix_len=426,question_len=101,answer_len=13")
    assert s.case_str(case) == line and s.parse_case(line) == case
    r = s.run_case(s.parse_case(line))
    assert (r["v1"]["steps"], r["v2"]["steps"]) == (80, 72)
    assert (round(r["v1"]["hit"], 3), round(r["v2"]["hit"], 3)) == (0.526, 0.539)
    assert r["steps_ratio"] == 72 / 80 and r["hit_deficit"] == r["v1"]["hit"] - r["v2"]["hit"]


def test_the_v2_loss_search_prints_its_worst_cases_with_their_replay_lines(capsys):
    from bench import search_v2_losses as s

    s.main(["--samples", "3", "--seed", "0", "--top", "2"])
    out = capsys.readouterr().out
    assert out.startswith("3 samples (seed 0, from 0)") and "Worst 2 by V2/V1 steps" in out
    assert re.search(r"\| [\d.]+ \| [\d,]+ / [\d,]+ \| .*`preset=.*,workload=", out)


def test_the_v2_loss_search_patches_a_constant_and_reruns_a_recorded_search(tmp_path, capsys):
    # --patch sets a module constant for the run (a rule tried without editing code); --against reruns the samples a
    # --json file recorded and prints those whose figures changed, with the loss counts before and after.
    from bench import search_v2_losses as s
    from cache_backends.v2 import scheduler

    base = tmp_path / "base.jsonl"
    s.main(["--samples", "2", "--seed", "0", "--start", "28", "--top", "1", "--json", str(base)])
    gives_way = scheduler.HOLD_GIVES_WAY
    rerun = tmp_path / "rerun.jsonl"
    capsys.readouterr()
    try:
        s.main(["--patch", "cache_backends.v2.scheduler.HOLD_GIVES_WAY=0", "--against", str(base),
                "--json", str(rerun)])
        assert scheduler.HOLD_GIVES_WAY == 0
    finally:
        scheduler.HOLD_GIVES_WAY = gives_way
    out = capsys.readouterr().out
    # sample #28 (GPT-OSS shared-prefix, cause A): the hold that never gives way waits on finished groups' prefixes
    assert re.search(r"^#28 steps 0\.900 -> 1\.550, ", out, re.M)
    assert re.search(r"^2 samples: steps better on 0, worse on 1; before 0 over 1.02x V1's steps", out, re.M)
    rows = [json.loads(line) for line in rerun.read_text().splitlines()]  # the next comparison's base
    assert len(rows) == 2 and (rows[0]["index"], round(rows[0]["steps_ratio"], 3)) == (28, 1.55)
    for bad, says in ((["--patch", "cache_backends.v2.scheduler.NO_SUCH=1"], "has no NO_SUCH"),
                      (["--patch", "cache_backends.v2.scheduler.SHARED_HOLD=0.5 +"], "--patch"),
                      (["--against", str(tmp_path / "missing.jsonl")], "No such file"),
                      (["--against", str(base), "--seed", "3"], "--seed do not apply")):
        with pytest.raises(SystemExit):
            s.main(bad if bad[0] == "--against" else [*bad, "--against", str(base)])
        err = capsys.readouterr().err.strip().splitlines()
        assert says in err[-1] and not any("Traceback" in line for line in err)
