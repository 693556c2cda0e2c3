#!/usr/bin/env bash
# GPU check for kvload: the CUDA-marked tests and the GPU benchmarks, in about 3–4 minutes on one H200
# (the steps' time limits add up to 22 minutes; the MLA steps come last).
#
# Run from anywhere (it moves to the repository root):   scripts/gpu_check.sh
# Output: a markdown summary (gpu_check.md, for BENCHMARKS.md; each step's outcome and the tail of its log)
# and logs.tar.gz (one whole log per step) in $OUT when set, else in ./gpu-check-out.
# Exits 2 when CUDA is unavailable, 1 when any step failed, 0 otherwise.
#
# On a machine with its own Python (torch + CUDA preinstalled), the project's pure-Python wheels
# in .whl/ (if present) are installed into /tmp/site and put first on PYTHONPATH.
# Each step has a time limit, so a hung step cannot take the whole lease:
#   cuda tests 150 s (the compiled-attention equality tests compile on the GPU too), paged attention 80 s
#   (gather + SDPA and the Triton paged decode kernel vs contiguous), compiled paged attention 120 s (flex at
#   batch 1 and 32 x 4,096: the issue's target is flex >= 0.7x contiguous at 32 x 4,096; each shape compiles
#   once, inside the step),
#   generation bench 120 s (sdpa) and 150 s (flex: compiles per shape) on a random Llama-1B, simulate on cuda 40 s,
#   `kvload run` and `kvload generate` on the device 60 s each, the paged decode kernel's tests 120 s,
#   generation through it 120 s and its mixed steps 60 s, MLA on the compiled path: its tests 120 s and one layer's
#   decode 120 s.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-$PWD/gpu-check-out}"
# one log per step under logs/, packed into logs.tar.gz at the end (a device tool may bring back few files)
LOG_DIR="$OUT_DIR/logs"
mkdir -p "$OUT_DIR" "$LOG_DIR" || exit 1
SUMMARY="$OUT_DIR/gpu_check.md"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
  echo "== installing .whl/*.whl into /tmp/site"
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || { echo "gpu_check: wheel install failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

# Self-check: refuse to report anything when there is no CUDA device to measure.
if ! "$PY" - >"$OUT_DIR/device.txt" 2>&1 <<'PYEOF'
import sys
import torch
if not torch.cuda.is_available():
    print(f"gpu_check: CUDA is not available (torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    sys.exit(2)
p = torch.cuda.get_device_properties(0)
print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), python {sys.version.split()[0]}")
PYEOF
then
  cat "$OUT_DIR/device.txt" >&2
  exit 2
fi

status=0
started=$(date +%s)
{
  echo "## GPU check ($(date -u '+%Y-%m-%d %H:%M UTC'))"
  echo
  sed 's/^/- /' "$OUT_DIR/device.txt"
  echo "- command: \`scripts/gpu_check.sh\`"
  echo
} >"$SUMMARY"

# step NAME LIMIT_SECONDS COMMAND...: run with a time limit, keep the log, note the outcome in the summary
step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
  local rc=$?
  local took=$((SECONDS - t0))
  tail -n 40 "$LOG_DIR/$name.log"
  local outcome="ok"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then outcome="timed out after ${limit}s"; status=1
  elif [ "$rc" -ne 0 ]; then outcome="failed (exit $rc)"; status=1; fi
  {
    echo "### $name: $outcome (${took}s)"
    echo
    echo "\`$*\`"
    echo
    echo '```'
    tail -n 60 "$LOG_DIR/$name.log"
    echo '```'
    echo
  } >>"$SUMMARY"
}

# In order of what matters most, so a run cut short still brings back the most useful part.
# Only the test files that mention CUDA: collecting the serve tests would need openai and fastapi,
# which a GPU machine's own Python may lack.
mapfile -t CUDA_FILES < <(grep -l -i "cuda" tests/test_*.py)
# (MLA on the compiled path is left to its own step at the end: its 576-wide key rows may compile slowly or not at all)
step cuda_tests 150 "$PY" -m pytest -q -p no:cacheprovider -m cuda --continue-on-collection-errors \
  -k "not (compiled_path and deepseek)" "${CUDA_FILES[@]}"
# The managers on the device: pools in GPU memory, V2's pinned host tier, suspend/resume copies.
step simulate_cuda 40 "$PY" -m kvload.cli simulate tiny-gemma3 --workload long-context --compare --device cuda
# The main job on the device: all six stages, the routed V2 manager built in GPU memory (default sizing:
# the free-memory fraction), then generation through the CLI on a sliding-window preset, V1 and V2, and on an
# MLA preset with float8 pools (written through byte views, as on the CPU).
# (and a budget past the card's memory: one line naming the flag, exit 2, nothing allocated)
step cli_run 60 bash -c "'$PY' -m kvload.cli run tiny-deepseek-v4 --device cuda && { '$PY' -m kvload.cli run tiny-llama \
  --device cuda --max_gpu_total_bytes 400000000000; test \$? -eq 2; }"
step cli_generate 60 bash -c "'$PY' -m kvload.cli generate tiny-gemma3 --device cuda --prompt-ids 5,6,7,8,9,10,11,12 \
  --max_new_tokens 16 --max_tokens 4096 --json && '$PY' -m kvload.cli generate tiny-gemma3 --device cuda \
  --prompt-ids 5,6,7,8,9,10,11,12 --max_new_tokens 16 --max_tokens 4096 --use_kv_cache_manager_v2 true --json \
  && '$PY' -m kvload.cli generate tiny-deepseek-v3 --device cuda --prompt-ids 5,6,7,8,9,10,11,12 --max_new_tokens 16 \
  --max_tokens 4096 --kv_cache_dtype fp8 --json"
step paged_attention 80 "$PY" -m bench.bench_attention --device cuda --batch 1,8,32,64 --lengths 512,2048,8192 \
  --heads 32 --kv-heads 8 --head-dim 128 --dtype bfloat16 --reps 20 --no-flex
# Generation: a Llama-3.2-1B-shaped checkpoint with random weights (written once under $KVLOAD_CACHE; no
# download), kvload's executor against transformers' model.generate, 1 / 8 / 32 prompts of 32 new tokens.
export KVLOAD_CACHE="${KVLOAD_CACHE:-/tmp/kvload-cache}"
GEN=(-m bench.bench_generate --model random-llama-1b --dtype bfloat16 --device cuda --batches 1,8,32 --new-tokens 32 --repeats 3)
step generate 120 "$PY" "${GEN[@]}" --attention sdpa
# Never measured yet, so before the flex steps (measured once): the Triton paged decode kernel (attention_backend: triton): its tests natively (on a CPU they run in Triton's
# interpreter), then generation through it. (The paged_attention step above times it per layer: triton_x.)
step triton_tests 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_paged_decode.py
step generate_triton 120 "$PY" "${GEN[@]}" --attention triton
# Mixed steps (decode rows beside a new prompt's 256-token chunk): the decode rows on the Triton kernel, the chunk on
# gather + SDPA, against gather + SDPA for the whole step (one layer, plan included).
step mixed_triton 60 "$PY" -m bench.bench_attention --device cuda --batch 8,32 --lengths 2048,8192 --heads 32 \
  --kv-heads 8 --head-dim 128 --dtype bfloat16 --reps 20 --mixed-chunk 256
step paged_attention_flex 120 "$PY" -m bench.bench_attention --device cuda --batch 1,32 --lengths 4096 \
  --heads 32 --kv-heads 8 --head-dim 128 --dtype bfloat16 --block 32 --reps 50
step generate_flex 150 "$PY" "${GEN[@]}" --attention flex

# MLA (DeepSeek V3) on the compiled path, absorbed: tokens and logits against model.generate on the GPU (a shape that
# fails to compile fails this step: the test asserts the kernel ran), then one layer's decode at DeepSeek V3's 128
# heads (576-wide keys, 512-wide values) against the model's own expand-every-step attention and gather + SDPA.
step mla_flex_tests 120 "$PY" -m pytest -q -p no:cacheprovider -m cuda -k "compiled_path and deepseek" \
  tests/test_paged_generation.py
step mla_flex_attention 120 "$PY" -m bench.bench_attention --mla --device cuda --dtype bfloat16 --heads 128 \
  --batch 1,32 --lengths 4096 --block 32 --reps 20

echo "total: $(( $(date +%s) - started ))s; summary: $SUMMARY" | tee -a "$SUMMARY"
tar czf "$OUT_DIR/logs.tar.gz" -C "$LOG_DIR" . && rm -rf "$LOG_DIR"
exit "$status"
