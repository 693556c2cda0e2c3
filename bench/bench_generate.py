"""Generation throughput: kvload's executor against transformers' ``model.generate``, side by side in one run.

Run from the repository root::

    python -m bench.bench_generate                     # SmolLM2-135M on CPU: 1 prompt, then 8 of mixed lengths
    python -m bench.bench_generate --manager v2 --new-tokens 64 --repeats 5
    python -m bench.bench_generate --model random-llama-1b --device cuda --dtype bfloat16 --batches 1,8,32
    python -m bench.bench_generate --n 8 --batches 8 --new-tokens 16   # 8 sampled completions per prompt (GRPO's shape)

Each scenario generates exactly ``--new-tokens`` tokens per prompt on both sides (kvload with
``ignore_eos``, ``model.generate`` with ``min_new_tokens``), greedy, from the same token-id prompts
(seeded random ids: throughput does not depend on what the text says). ``model.generate`` gets the
prompts as one left-padded batch with an attention mask; kvload gets them as a list and batches them
continuously (prefill chunks of ``--max-num-tokens`` beside decodes). Tokens/s = generated tokens /
wall time of the call, and also generated tokens / CPU time of the calling thread (``time.thread_time``;
with ``--threads 1`` torch computes on that thread, so other processes on a shared machine barely move
it); medians over ``--repeats`` runs after one warm-up, kvload and transformers
interleaved so both see the same machine. Each kvload repeat uses its own reuse salt, so no run
reads prefixes a previous run cached.

``--n N`` (above 1) samples ``N`` completions of every prompt at temperature 1 (seeded), as RL rollouts, best-of-n
and self-consistency do: kvload through ``executor.run(n=N)``, ``model.generate`` with ``num_return_sequences=N``
(``do_sample``, no top-k); tokens/s counts every sample's tokens, and ``prefill_tok`` is the prompt tokens kvload
computed (``GenerationStats``: prompt tokens less those whose KV came from the cache or a sibling sample).

``--model`` is anything ``kvload generate`` takes (a preset, a checkpoint directory, ``smollm2-135m``),
or ``random-llama-1b``: a Llama-3.2-1B-shaped checkpoint with random weights, written once under the
kvload cache (``$KVLOAD_CACHE`` or ``~/.cache/kvload``) — meant for a GPU; or ``random-deepseek-mla``: a
DeepSeek V3 checkpoint (multi-head latent attention) with DeepSeek-V2-Lite's attention shape (hidden 2048,
16 heads, ``kv_lora_rank`` 512, rope 64, nope 128, v 128) but 2 dense layers and a 32k vocabulary
(~210 M parameters), random weights, written there too — small enough for a CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import pipeline
from pipeline.config import ATTENTION_BACKENDS, LINEAR_BACKENDS

#: Prompt lengths of the mixed scenarios, cycled to the batch size (short chats to long documents).
MIXED_LENGTHS = (12, 200, 45, 90, 7, 150, 30, 64)
SINGLE_LENGTH = 64

#: Llama-3.2-1B's shape (about 1.2 B parameters with the tied 128k vocabulary).
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 8192,
            "tie_word_embeddings": True, "rms_norm_eps": 1e-5}


#: DeepSeek-V2-Lite's attention (MLA) in a DeepSeek V3 checkpoint of 2 dense layers and a 32k vocabulary.
DEEPSEEK_MLA = {"hidden_size": 2048, "intermediate_size": 4096, "num_hidden_layers": 2, "first_k_dense_replace": 2,
                "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
                "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "head_dim": 64,
                "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256, "n_group": 1,
                "topk_group": 1, "vocab_size": 32000, "max_position_embeddings": 8192, "tie_word_embeddings": False,
                "rms_norm_eps": 1e-6}

#: ``--model`` names that build a random-weights checkpoint: (transformers config class, architecture, shape)
RANDOM_MODELS = {"random-llama-1b": ("LlamaConfig", "LlamaForCausalLM", LLAMA_1B),
                 "random-deepseek-mla": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK_MLA)}


def random_llama_dir(root: Path, name: str = "random-llama-1b", dtype: str = "bfloat16", **shape: Any) -> Path:
    """A checkpoint of ``RANDOM_MODELS[name]`` with seeded random weights (built once; later calls reuse it)."""
    path = root / f"bench-{name}-{dtype}"
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    import transformers

    from models.weights import random_model

    config_class, architecture, base = RANDOM_MODELS[name]
    config = getattr(transformers, config_class)(**{**base, **shape})
    config.architectures = [architecture]
    model = random_model(config, device="cpu", dtype=dtype, seed=0)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tmp.rename(path)
    return path


def model_argument(name: str, dtype: str) -> str:
    """What ``pipeline.load`` gets for ``--model``."""
    if name not in RANDOM_MODELS:
        return name
    from models.gguf_cache import cache_root

    return str(random_llama_dir(cache_root(), name, dtype="bfloat16" if dtype == "auto" else dtype))


def prompts_for(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Seeded random token-id prompts (ids from 10 up, clear of the usual special ids)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in lengths]


#: English prose and Python code, for ``--prompts text``: what n-gram drafts are for (names and phrases recur).
TEXT_PROMPTS = Path(__file__).with_name("text_prompts.txt")


def scenario_prompts(kind: str, result: pipeline.LoadResult, lengths: list[int], vocab: int,
                     seed: int = 0) -> list[list[int]]:
    """The prompts of one scenario: random ids (:func:`prompts_for`), or the bundled passages tokenized, prompt ``i``
    starting at passage ``i`` and cut (or cycled) to ``lengths[i]`` tokens."""
    if kind == "random":
        return prompts_for(lengths, vocab, seed)
    if result.tokenizer is None:
        raise SystemExit("--prompts text needs a model with a tokenizer (smollm2-135m or a checkpoint)")
    passages = [p.strip() for p in TEXT_PROMPTS.read_text().split("\n\n\n") if p.strip()]
    out = []
    for i, n in enumerate(lengths):
        ids: list[int] = []
        j = i
        while len(ids) < n:
            ids += result.tokenizer(passages[j % len(passages)])["input_ids"]
            j += 1
        out.append(ids[:n])
    return out


def sync(device: torch.device) -> None:
    """Wait for queued CUDA work, so wall times cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int, prompt_lookup: int = 0,
                n: int = 1) -> int:
    """``model.generate`` over the prompts as one left-padded batch; returns the tokens generated. ``prompt_lookup``:
    transformers' own n-gram speculation (``prompt_lookup_num_tokens``; one prompt only); ``n`` > 1: that many
    sampled sequences per prompt (``num_return_sequences``, temperature 1, no top-k or top-p)."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        extra: dict[str, Any] = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
        if n > 1:
            extra.update(num_return_sequences=n, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=pad_id, **{"do_sample": False, **extra})
    return (out.shape[1] - width) * len(prompts) * n


def attention_in_use(executor: Any, requested: str) -> str:
    """The attention backend a generate call runs on: ``requested``, or ``sdpa`` where it was ignored."""
    if requested != "sdpa" and executor.flex is None and executor.decode_kernel is None:
        return "sdpa"
    return requested


def linear_in_use(executor: Any, requested: str) -> str:
    """The projections a generate call runs on: ``requested``, or ``torch`` where the kernel was ignored."""
    return requested if requested == "torch" or executor.linear is not None else "torch"


def bench_scenario(result: pipeline.LoadResult, prompts: list[list[int]], args: argparse.Namespace,
                   device: torch.device, backends: list[str] | None = None,
                   linears: list[str] | None = None, drafts: list[int] | None = None) -> list[dict[str, Any]]:
    """Median tokens/s of kvload and of ``model.generate`` on one prompt set: a row per (attention, linear, draft
    length) triple.

    ``backends`` (default: the loaded one only), ``linears`` and ``drafts`` (``max_draft_len``; the same): every
    repeat runs kvload once per triple, switched on the executor between calls (``GenerationExecutor.use_attention``
    / ``use_linear`` / ``use_speculation``), then ``model.generate``, so all see the same machine.
    """
    model = result.hf_model
    pad_id = model.generation_config.pad_token_id
    if not isinstance(pad_id, int):
        pad_id = 0
    attentions = backends or [attention_in_use(result.executor, result.args.attention_backend)]
    lins = linears or [linear_in_use(result.executor, result.args.linear_backend)]
    draft_lens = drafts or [result.args.max_draft_len]
    names = [(a, lin, d) for a in attentions for lin in lins for d in draft_lens]
    kv_rates: dict[tuple[str, str, int], list[float]] = {n: [] for n in names}
    kv_cpu: dict[tuple[str, str, int], list[float]] = {n: [] for n in names}
    kv_stats: dict[tuple[str, str, int], Any] = {}
    paths: dict[str, tuple[Any, Any]] = {}  # backend -> the executor's (flex, decode_kernel) for it
    hf_rates: list[float] = []
    hf_cpu: list[float] = []
    lookup = args.hf_prompt_lookup if len(prompts) == 1 else 0  # transformers' assisted decoding takes one prompt
    lookup_rates: list[float] = []
    for rep in range(args.repeats + 1):  # the first round warms every side up and is not counted
        for name in names:
            attention, linear, draft = name
            if backends:  # each backend set up once (flex compiles its shapes once), then swapped in
                if attention not in paths:
                    result.executor.use_attention(attention, result.args.max_num_tokens)
                    if attention_in_use(result.executor, attention) != attention:
                        raise SystemExit(f"--compare-attention: {attention} does not run here (see the load's audit)")
                    paths[attention] = (result.executor.flex, result.executor.decode_kernel)
                result.executor.flex, result.executor.decode_kernel = paths[attention]
            if linears:
                result.executor.use_linear(linear)
                if linear_in_use(result.executor, linear) != linear:
                    raise SystemExit(f"--compare-linear: {linear} does not run here (see the load's audit)")
            if drafts:
                result.executor.use_speculation(draft, result.args.max_matching_ngram_size,
                                                result.args.speculation_max_batch_size)
            sync(device)
            start, cpu = time.perf_counter(), time.thread_time()
            salt = f"bench-{rep}-{attention}-{linear}-{draft}"
            if args.n > 1:
                runs = result.executor.run(prompts, max_tokens=args.new_tokens, ignore_eos=True, n=args.n,
                                           temperature=1.0, seed=rep, salt=salt)
                sync(device)
                generated = sum(len(c.token_ids) for o in runs for c in o.outputs)
            else:
                outs = result.generate(prompts, max_new_tokens=args.new_tokens, ignore_eos=True, salt=salt)
                sync(device)
                generated = sum(len(o.token_ids) for o in outs)
            kv_time, kv_thread = time.perf_counter() - start, time.thread_time() - cpu
            if rep:
                kv_rates[name].append(generated / kv_time)
                kv_cpu[name].append(generated / kv_thread)
                kv_stats[name] = result.executor.last_stats
        start, cpu = time.perf_counter(), time.thread_time()
        hf_generated = hf_generate(model, prompts, args.new_tokens, pad_id, n=args.n)
        sync(device)
        hf_time, hf_thread = time.perf_counter() - start, time.thread_time() - cpu
        if rep:
            hf_rates.append(hf_generated / hf_time)
            hf_cpu.append(hf_generated / hf_thread)
        if lookup:
            start = time.perf_counter()
            generated = hf_generate(model, prompts, args.new_tokens, pad_id, lookup)
            sync(device)
            if rep:
                lookup_rates.append(generated / (time.perf_counter() - start))
    hf, hfc = statistics.median(hf_rates), statistics.median(hf_cpu)
    rows = []
    for name in names:
        kv, kvc, stats = statistics.median(kv_rates[name]), statistics.median(kv_cpu[name]), kv_stats.get(name)
        rows.append({
            "prompts": len(prompts),
            "prompt_tokens": sum(len(p) for p in prompts),
            "new_tokens": args.new_tokens,
            "attention": name[0],
            "linear": name[1],
            "max_draft_len": name[2],
            "draft_tokens": stats.draft_tokens if stats else None,
            "accepted_draft_tokens": stats.accepted_draft_tokens if stats else None,
            "kvload_tokens_per_s": kv,
            "hf_tokens_per_s": hf,
            "ratio": kv / hf,
            "kvload_runs": kv_rates[name],
            "hf_runs": hf_rates,
            # tokens per second of the calling thread's CPU time: with --threads 1 torch computes on this
            # thread, so this is the figure that other processes on a shared machine do not move
            "kvload_cpu_tokens_per_s": kvc,
            "hf_cpu_tokens_per_s": hfc,
            "cpu_ratio": kvc / hfc,
            "kvload_cpu_runs": kv_cpu[name],
            "hf_cpu_runs": hf_cpu,
            "hf_prompt_lookup_tokens_per_s": statistics.median(lookup_rates) if lookup_rates else None,
            "n": args.n,
            "kvload_prefill_tokens": stats.prompt_tokens - stats.reused_prompt_tokens if stats else None,
            "kvload_steps": stats.steps if stats else None,
            "kvload_forward_share": stats.forward_s / stats.wall_s if stats else None,
        })
    return rows


def pools_short_by(result: pipeline.LoadResult, scenarios: list[list[int]], new_tokens: int, n: int) -> float:
    """How many times larger the pools must be for every group to hold each scenario's prompts at once (1.0: they
    do): a V2 group whose blocks span more tokens than ``--tokens-per-block`` rounds each prompt further up."""
    pools = getattr(result.kv_manager, "pools", None)
    layout = getattr(pools, "layout", None)
    if layout is None:
        return 1.0
    grow, slabs = 1.0, getattr(pools, "slabs", None)
    need_slabs = 0
    for g in layout.groups:
        span = g.tokens_per_block
        need = n * max(sum(-(-(length + new_tokens) // span) for length in ls) for ls in scenarios)
        if slabs:  # a slab arena: the groups draw on the same slabs, so their needs add up
            per_slab = pools.num_blocks[g.name] // slabs
            need_slabs += -(-need // per_slab)
        else:
            grow = max(grow, need / pools.num_blocks[g.name])
    return max(grow, need_slabs / slabs) if slabs else grow


def main(argv: list[str] | None = None) -> None:
    """Parse flags, load once, run each scenario, print a table (or ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m",
                   help="a kvload model argument, random-llama-1b or random-deepseek-mla")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="model dtype (auto: the checkpoint's)")
    p.add_argument("--manager", default="auto", choices=("auto", "v1", "v2"), help="KV cache manager")
    p.add_argument("--batches", default="1,8", help="comma-separated prompt counts: 1 = one prompt of "
                                                     "--single-length tokens; more = mixed lengths "
                                                     f"{MIXED_LENGTHS}")
    p.add_argument("--single-length", type=int, default=SINGLE_LENGTH, metavar="N",
                   help=f"prompt tokens of the one-prompt scenario (default {SINGLE_LENGTH})")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per scenario (after one warm-up)")
    p.add_argument("--max-num-tokens", type=int, default=512, help="most tokens in one kvload forward")
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS,
                   help="kvload's attention_backend (flex compiles each new shape once, in the warm-up round)")
    p.add_argument("--compare-attention", default="", metavar="A,B,...",
                   help="time kvload on each of these attention backends in the same run, switched between calls "
                        "(e.g. sdpa,cpu_kernel); --attention is then the one the load resolves first")
    p.add_argument("--linear", default="auto", choices=LINEAR_BACKENDS,
                   help="kvload's linear_backend (cpu_kernel: steps of few rows on the small-batch kernel)")
    p.add_argument("--compare-linear", default="", metavar="A,B",
                   help="time kvload on each of these linear backends in the same run, switched between calls "
                        "(torch,cpu_kernel)")
    p.add_argument("--draft-len", type=int, default=0, metavar="K",
                   help="kvload's max_draft_len: speculative decoding by n-gram lookup (0: off)")
    p.add_argument("--compare-draft", default="", metavar="A,B",
                   help="time kvload at each of these max_draft_len values in the same run (e.g. 0,4)")
    p.add_argument("--hf-prompt-lookup", type=int, default=0, metavar="K",
                   help="also time model.generate with prompt_lookup_num_tokens=K (transformers' n-gram speculation; "
                        "one-prompt scenarios only)")
    p.add_argument("--draft-max-batch", type=int, default=1, metavar="N",
                   help="kvload's speculation_max_batch_size: draft only while at most N requests run")
    p.add_argument("--prompts", default="random", choices=("random", "text"),
                   help="random: seeded random token ids; text: the bundled English and code passages "
                        f"({TEXT_PROMPTS.name}), cut or cycled to the scenario's lengths (n-gram drafts need text "
                        "that repeats)")
    p.add_argument("--n", type=int, default=1, metavar="N",
                   help="sampled completions per prompt (temperature 1, seeded); 1: greedy, one per prompt")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    if args.n < 1:
        p.error(f"--n: expected an integer >= 1, got {args.n}")
    backends = [b for b in args.compare_attention.split(",") if b] or None
    linears = [b for b in args.compare_linear.split(",") if b] or None
    try:
        drafts = [int(d) for d in args.compare_draft.split(",") if d] or None
    except ValueError:
        p.error(f"--compare-draft: expected comma-separated integers >= 0, got {args.compare_draft!r}")
    if any(d < 0 for d in drafts or []) or args.draft_len < 0:
        p.error("--draft-len / --compare-draft: expected integers >= 0")
    if args.draft_max_batch < 1:
        p.error("--draft-max-batch: expected an integer >= 1")
    for flag, names, allowed in (("--compare-attention", backends, ATTENTION_BACKENDS),
                                 ("--compare-linear", linears, LINEAR_BACKENDS)):
        bad = [n for n in names or [] if n not in allowed or n == "auto"]
        if bad:  # before minutes of loading, not after
            p.error(f"{flag}: {', '.join(bad)} is not one of {', '.join(a for a in allowed if a != 'auto')}")
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    if args.single_length < 1:
        p.error("--single-length: expected an integer >= 1")
    lengths = {b: [args.single_length] if b == 1 else [MIXED_LENGTHS[i % len(MIXED_LENGTHS)] for i in range(b)]
               for b in batches}
    T = args.tokens_per_block  # pools that hold every prompt of a scenario at once, block rounding included
    max_tokens = args.n * max(sum(-(-(n + args.new_tokens) // T) * T for n in ls) for ls in lengths.values())
    kv: dict[str, Any] = {"max_tokens": max_tokens, "tokens_per_block": args.tokens_per_block}
    if args.manager != "auto":
        kv["use_kv_cache_manager_v2"] = args.manager == "v2"
    overrides: dict[str, Any] = {"device": args.device, "max_num_tokens": args.max_num_tokens,
                                 "attention_backend": args.attention, "linear_backend": args.linear,
                                 "max_draft_len": args.draft_len, "speculation_max_batch_size": args.draft_max_batch,
                                 "max_seq_len": max(*MIXED_LENGTHS, args.single_length) + args.new_tokens}
    if args.dtype != "auto":
        overrides["dtype"] = args.dtype
    result = pipeline.load(model_argument(args.model, args.dtype), load_weights=True, kv_cache_config=kv, log=False,
                           **overrides)
    grow = pools_short_by(result, list(lengths.values()), args.new_tokens, args.n)
    if grow > 1:  # blocks of more tokens than --tokens-per-block (DeepSeek V4's HCA): loaded again, large enough
        result.close()
        kv["max_tokens"] = -(-int(max_tokens * grow) // T) * T
        result = pipeline.load(model_argument(args.model, args.dtype), load_weights=True, kv_cache_config=kv,
                               log=False, **overrides)
    with result:
        device = result.kv_manager.pools.device
        vocab = result.hf_model.get_input_embeddings().num_embeddings
        rows = [row for b in batches
                for row in bench_scenario(result, scenario_prompts(args.prompts, result, lengths[b], vocab, seed=b),
                                          args, device, backends, linears, drafts)]
        flex = result.executor.flex
        head = {"model": args.model, "device": str(device), "dtype": str(result.args.dtype),
                "kv_manager": result.route.kv_manager, "threads": torch.get_num_threads(),
                "attention": "/".join(dict.fromkeys(r["attention"] for r in rows)),
                "compiled_shapes": flex.compiles if flex is not None else 0,
                "warmup_s": flex.warmup_s if flex is not None else 0.0,
                "new_tokens": args.new_tokens, "repeats": args.repeats}
    if args.json:
        print(json.dumps({**head, "scenarios": rows}, indent=2))
        return
    per = f"{args.new_tokens} new tokens per prompt" if args.n == 1 else \
        f"{args.n} samples x {args.new_tokens} new tokens per prompt"
    print(f"{head['model']} on {head['device']} ({head['dtype']}, {head['threads']} threads), {head['kv_manager']}, "
          f"attention {head['attention']}, {per}, median of {args.repeats}")
    if head["compiled_shapes"]:
        print(f"compiled {head['compiled_shapes']} attention shapes in {head['warmup_s']:.1f} s (warm-up round, "
              "not in tokens/s)")
    print("wall: tokens / wall time; cpu: tokens / CPU time of the calling thread (--threads 1: all of torch's work)")
    print(f"{'prompts':>7} {'prompt_tok':>10} {'attention':>10} {'linear':>10} {'drafts':>9} {'kvload_tok/s':>12} "
          f"{'generate_tok/s':>14} {'ratio':>6} {'kv_cpu_tok/s':>12} {'gen_cpu_tok/s':>13} {'cpu_ratio':>9} "
          f"{'kv_steps':>8} {'forward%':>8} {'prefill_tok':>11}")
    for r in rows:
        accepted = f"{r['accepted_draft_tokens']}/{r['draft_tokens']}" if r["max_draft_len"] else "-"
        print(f"{r['prompts']:>7} {r['prompt_tokens']:>10} {r['attention']:>10} {r['linear']:>10} {accepted:>9} "
              f"{r['kvload_tokens_per_s']:>12.1f} "
              f"{r['hf_tokens_per_s']:>14.1f} {r['ratio']:>6.2f} {r['kvload_cpu_tokens_per_s']:>12.1f} "
              f"{r['hf_cpu_tokens_per_s']:>13.1f} {r['cpu_ratio']:>9.2f} {r['kvload_steps']:>8} "
              f"{100 * r['kvload_forward_share']:>7.1f}% {r['kvload_prefill_tokens']:>11}")
        if r["hf_prompt_lookup_tokens_per_s"]:
            print(f"{'':>7} model.generate with prompt_lookup_num_tokens={args.hf_prompt_lookup}: "
                  f"{r['hf_prompt_lookup_tokens_per_s']:.1f} tok/s (kvload {r['kvload_tokens_per_s']:.1f}: "
                  f"{r['kvload_tokens_per_s'] / r['hf_prompt_lookup_tokens_per_s']:.2f}x)")


if __name__ == "__main__":
    main()
