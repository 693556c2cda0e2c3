"""`kvload plan` through a subprocess: output, --json, exit codes, one-line errors."""

from __future__ import annotations

import json

import pytest

from tests.cli_support import kvload_process as kvload


def test_plan_deepseek_v4_shows_auto_to_true_and_why():
    r = kvload("plan", "tiny-deepseek-v4")
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if "use_kv_cache_manager_v2  " in line)
    assert "true" in row and "model_default" in row and '"auto" → true' in row
    assert "KVCacheManagerV2 + KVCacheV2Scheduler" in r.stdout


def test_plan_json_is_one_document_on_stdout():
    r = kvload("plan", "tiny-llama", "--use_kv_cache_manager_v2", "true", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"model", "args", "provenance", "route", "sampling_defaults", "kv"}
    assert doc["args"]["kv_cache_config"]["use_kv_cache_manager_v2"] is True
    assert doc["route"]["kv_manager"] == "KVCacheManagerV2"
    assert doc["provenance"]["kv_cache_config.use_kv_cache_manager_v2"][0]["source"] == "cli"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--use_kv_cache_manager_v2", "yes"],
         "error: --use_kv_cache_manager_v2: expected auto, true or false, got 'yes'"),
        (["--tokens_per_block", "0"], "error: --tokens_per_block: expected an integer >= 1, got 0"),
        (["--max_page_padding", "0.5"], "error: --max_page_padding: expected a number in [0, 0.5)"),
        (["--max_page_padding", "-0.1"], "error: --max_page_padding: expected a number in [0, 0.5)"),
        (["--use-kv-cache-manager-v2", "false"], "error: kv_cache_config.use_kv_cache_manager_v2=false"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, message):
    model = "tiny-deepseek-v4" if "false" in args else "tiny-llama"
    r = kvload("plan", model, *args)
    assert r.returncode == 2
    assert r.stderr.startswith(message)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stdout == ""


GEMMA3_27B = "tests/data/configs/gemma-3-27b-it"
V2_AT = ("--use_kv_cache_manager_v2", "true", "--device", "cpu", "--max_tokens", "65536", "--max_seq_len", "8192")


def test_a_budget_below_the_padded_floor_names_the_floor_at_max_page_padding_0():
    """Gemma 3 27B at --max_page_padding 0.1 and a 17,000,000 B budget: the six 11-layer pages need 17,301,504 B, gcd
    pages 16,252,928 B, and the refusal says both. plan shows it under the geometry (exit 0: what it plans); run stops
    on it: exit 2, the same one line, no traceback."""
    args = (GEMMA3_27B, "--use_kv_cache_manager_v2", "true", "--device", "cpu", "--max_gpu_total_bytes", "17000000",
            "--max_page_padding", "0.1")
    pages = ", ".join(f"{name} 2883584" for name in (*(f"sliding_w1024.{i}" for i in range(5)), "full"))
    want = ("KV budget 17000000 B (max_gpu_total_bytes caps it at 17000000 B) cannot hold one block per layer group: "
            f"at least 17301504 B needed (bytes per block: {pages}), 16252928 B with kv_cache_config.max_page_padding "
            "0; raise kv_cache_config.max_gpu_total_bytes, set kv_cache_config.max_page_padding to 0 or lower "
            "kv_cache_config.tokens_per_block")
    planned = kvload("plan", *args)
    assert planned.returncode == 0, planned.stderr
    assert f"  load/run would stop here: {want}" in planned.stdout.splitlines()
    run = kvload("run", *args)
    assert run.returncode == 2 and run.stderr == f"error: {want}\n" and "Traceback" not in run.stderr


def test_plan_shows_the_padded_pages_max_page_padding_opts_into():
    """--max_page_padding 0.1 on Gemma 3 27B: 6 groups of 11-layer pages, and the memory line names what they leave
    unused; without it the 31 gcd groups and no such line."""
    r = kvload("plan", GEMMA3_27B, *V2_AT, "--max_page_padding", "0.1")
    assert r.returncode == 0, r.stderr
    assert ("memory: one arena shared by 6 groups" in r.stdout
            and "pages of 11 layers, unused layer slots a page: sliding_w1024.4 3, full 1 (at most 9.1% of the bytes "
                "a sequence holds, 7.7% at 8,192 tokens)" in r.stdout)
    row = next(line for line in r.stdout.splitlines() if "kv_cache_config.max_page_padding" in line)
    assert "0.1" in row and "cli" in row  # the audit shows the setting and where it came from
    doc = json.loads(kvload("plan", GEMMA3_27B, *V2_AT, "--max_page_padding", "0.1", "--json").stdout)
    assert doc["args"]["kv_cache_config"]["max_page_padding"] == 0.1
    assert doc["kv"]["memory"]["padding"]["unused_slots"] == {"sliding_w1024.4": 3, "full": 1}
    default = kvload("plan", GEMMA3_27B, *V2_AT)
    assert "memory: one arena shared by 31 groups" in default.stdout and "unused layer slots" not in default.stdout
