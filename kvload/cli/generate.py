"""``kvload generate``: its flags, and the command that loads the weights, generates for every prompt and prints."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
from typing import Any

from kvload.cli.files import _audit_subscribers
from kvload.cli.flags import _request, add_model_flags
from kvload.cli.output import print_result, prints
from kvload.cli.parser import HelpFormatter
from kvload.cli.sampling_defaults import length_bound, length_source, peek_sampling_defaults
from kvload.cli.token_printer import _TokenPrinter
from kvload.cli.values import _bounded, at_least, integer, number, token_ids
from pipeline.errors import ConfigError, GenerationError
from pipeline.limits import MAX_INT, MAX_LOGPROBS, MAX_N

#: Prompt tokens per request that ``kvload generate`` budgets for on CPU when no KV bound is given.
GENERATE_PROMPT_ALLOWANCE = 1024


def cmd_generate(ns: argparse.Namespace) -> int:
    """Load the weights, build the routed KV manager, generate for every prompt, stream, end with throughput."""
    from engine.prompts import check_text
    from engine.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams
    from kvload.api import execute
    from pipeline.context import DEFAULT_MAX_TOKENS_FIELD, CallerDefault
    from stages import load_stages

    audit = _audit_subscribers(ns)
    prompts = ns.prompts or []
    if not prompts:
        raise ConfigError("--prompt: give at least one --prompt TEXT (or --prompt-ids IDS for a model without a "
                          "tokenizer)")
    if ns.chat and any(not isinstance(p, str) for p in prompts):  # refused here, not after seconds of loading
        raise ConfigError("--chat: wraps each --prompt TEXT in the chat template, and --prompt-ids gives token ids, "
                          "which it cannot wrap; give the conversation's text with --prompt, or leave out --chat")
    for i, prompt in enumerate(prompts):  # text no tokenizer could encode, named before anything loads
        if isinstance(prompt, str):
            check_text(f"prompt {i}", prompt)
    request = _request(ns, load_weights=True, kv_events_reader=False, generates=True)  # prints outputs, no KV events
    request.token_ids = {f"prompt {i} (--prompt-ids)": p for i, p in enumerate(prompts) if not isinstance(p, str)}
    request.prompt_lengths = {what: len(ids) for what, ids in request.token_ids.items()}  # room under max_seq_len
    request.token_ids |= {"--stop_token_ids": ns.stop_token_ids}  # both checked against the config's vocab_size
    if any(isinstance(p, str) for p in prompts):  # a model without a tokenizer is refused before its weights load
        request.text_prompts = "--prompt"
    # counted by the tokenizer alone (a chat prompt through its template) before the weights load
    texts = {f"prompt {i} (--prompt)": p for i, p in enumerate(prompts) if isinstance(p, str)}
    if texts:
        request.prompt_counter = functools.partial(_count_prompts, texts, ns.chat)
    if ns.config is not None and request.config is None:  # read once: its max_seq_len sizes the pools below, and
        # parse_args takes the same tree (read already when the tensor-parallel check needed it)
        from pipeline.sources import read_yaml

        request.config = read_yaml(ns.config)
    # a flag left out takes the model's sampling default (its generation_config.json, as the load will resolve it),
    # else kvload's; a flag given wins. The others are no generation_config keys: always the flags' values
    sampling = {name: value for name, value in (
        ("max_tokens", ns.max_new_tokens), ("temperature", ns.temperature), ("top_p", ns.top_p), ("top_k", ns.top_k),
        ("repetition_penalty", ns.repetition_penalty), ("min_p", ns.min_p)) if value is not None}
    sampling.update(seed=ns.seed, stop=ns.stop, stop_token_ids=ns.stop_token_ids, n=ns.n, logprobs=ns.logprobs,
                    ignore_eos=ns.ignore_eos, presence_penalty=ns.presence_penalty,
                    frequency_penalty=ns.frequency_penalty, min_tokens=ns.min_tokens)
    peeked = peek_sampling_defaults(request)
    model = peeked.values
    max_new_tokens = sampling.get("max_tokens", model.get("max_tokens", DEFAULT_MAX_TOKENS))
    if ns.min_tokens > max_new_tokens:  # named as what set the length: a flag left out is one to give, not to lower
        bound, advice = length_bound("--max_new_tokens", "max_tokens" in sampling, peeked, max_new_tokens,
                                     "generate", ns.min_tokens)
        raise ConfigError(f"--min_tokens: expected at most {bound}, got {ns.min_tokens}{advice}")
    from kvload.cli.structured_flags import flag_named, reasoning_ignored, structured_outputs

    structured = structured_outputs(ns)  # its spec parsed by xgrammar: a bad one is refused before the weights load
    if structured is not None:
        sampling["structured_outputs"] = structured
    SamplingParams.build(None, sampling, model)  # checked before anything loads
    # Applies only when nothing else bounds the KV budget (CPU without --max_tokens/--max_gpu_total_bytes) and the
    # user set no default_max_tokens. Capped at the integer bound: a product past it is refused by the budget naming
    # --max_new_tokens (the reason), not as a field the user never typed, and it must not fail a run whose
    # --max_tokens leaves the default unused.
    request.caller_defaults[DEFAULT_MAX_TOKENS_FIELD] = CallerDefault(
        *_generate_pool_tokens(len(prompts), ns.n, max_new_tokens, _user_max_seq_len(request),
                               length_source("--max_new_tokens", "max_tokens" in sampling, peeked, max_new_tokens,
                                             "generate", "the samples' max_new_tokens")),
        sequences=len(prompts) * ns.n)  # the checkpoint's max_seq_len caps it too, once resolved
    with execute(request, load_stages(), subscribers=audit) as result:  # generation events reach the audit too
        # --reasoning-parser, else the --config file's reasoning_parser (parse_args took them, as kvload.LLM's): the
        # default parser of the structured output (a flag's names it already), and how each reply is printed
        taken = result.context.reasoning_parser
        result.executor.reasoning_parser = taken.value if taken is not None else None
        ignored = reasoning_ignored(ns, taken, has_text=result.tokenizer is not None)
        split = taken.value if taken is not None and ignored is None else None  # (reasoning, content), as served
        if ignored is not None and result.bus is not None:
            from pipeline.events import SettingIgnored

            result.bus.emitter("generate")(SettingIgnored(field=ignored[0], value=ignored[1], reason=ignored[2]))
        first = prints(result)  # under torchrun every rank generates; rank 0 prints
        printer = None if ns.json or not first else _TokenPrinter(result.tokenizer,
                                                                  several=len(prompts) > 1 or ns.n > 1,
                                                                  labelled_samples=ns.n > 1,
                                                                  logprobs=ns.logprobs is not None,
                                                                  reasoning_parser=split)
        # what only the loaded model can refuse (no tokenizer to match the grammar on) names the flag too
        with flag_named(ns.structured[0][1]) if structured is not None else contextlib.nullcontext():
            outputs = result.executor.run(prompts, salt=ns.salt, chat=ns.chat, on_delta=printer, **sampling)
        stats = result.executor.last_stats
        if not first:
            pass
        elif ns.json:
            print_result(json.dumps({"model": result.model.to_dict(), "route": result.route.to_dict(),
                                     "outputs": [_output_document(o, split) for o in outputs],
                                     "stats": stats.to_dict()},
                                    indent=2, default=str))
        else:
            print_result(stats.line())
    return 0


def _count_prompts(texts: dict[str, str], chat: bool, tokenizer: Any, name: str) -> dict[str, int]:
    """Each ``--prompt`` text's length in tokens as the executor will send it (through the chat template with
    ``--chat``, as a user message), counted before the weights load; a tokenizer without a template is refused
    for ``--chat`` there, not after the weights."""
    from engine.prompts import check_text, missing_template, templated

    missing = missing_template(tokenizer, {}, name) if chat else None
    if missing is not None:  # the executor's refusal, after the weights had loaded
        raise GenerationError(f"--chat: {missing}; leave out --chat to send each --prompt as it is")
    lengths = {}
    for what, text in texts.items():
        if chat:  # as the executor templates a --chat prompt: a user message
            check_text(what, text)
            _, ids = templated(tokenizer, name, what, [{"role": "user", "content": text}], {})
        else:  # as the executor tokenizes a text prompt: the tokenizer's special tokens added
            ids = tokenizer(text)["input_ids"]
        lengths[what] = len(ids)
    return lengths


def _output_document(output: Any, reasoning_parser: str | None) -> dict[str, Any]:
    """One prompt's ``--json`` form; under ``--reasoning-parser`` each sample also has its ``reasoning_content`` (and
    vLLM's newer ``reasoning``) and ``content``, as ``kvload serve`` names a chat reply's parts."""
    document = output.to_dict()
    if reasoning_parser is not None:
        from engine.reasoning import split_reasoning

        for sample in document["outputs"]:
            reasoning, content = split_reasoning(reasoning_parser, sample["text"] or "")
            sample.update(reasoning_content=reasoning, reasoning=reasoning, content=content)
    return document


def _generate_pool_tokens(prompts: int, n: int, max_new_tokens: int, max_seq_len: int | None,
                          length: tuple[str, bool] = ("--max_new_tokens", True)) -> tuple[int, str, str]:
    """generate's default pool size, its source and reason: each prompt's ``n`` samples of ``max_new_tokens`` plus
    the prompt allowance, but never more than ``n`` sequences of ``max_seq_len`` (no sample grows past it).
    ``length`` is :func:`length_source`'s answer: what set max_new_tokens and whether it is the user's to lower (the
    flag, their override_generation_config), else the flag to give below the default that applied."""
    per_prompt = n * max_new_tokens + GENERATE_PROMPT_ALLOWANCE
    source, lowered = length
    flags = f"{source}, --n or the number of prompts" if lowered else f"--n or the number of prompts, or {source}"
    formula = f"(n x max_new_tokens + {GENERATE_PROMPT_ALLOWANCE})"
    if max_seq_len is not None and n * max_seq_len < per_prompt:
        per_prompt = n * max_seq_len
        flags = "--max_seq_len, --n or the number of prompts"
        formula = f"n x max_seq_len (less than n x max_new_tokens + {GENERATE_PROMPT_ALLOWANCE})"
    tokens = min(MAX_INT, prompts * per_prompt)
    return tokens, "generate", (f"{flags} (generate sizes the pools for prompts x {formula} = {tokens} tokens when "
                                "no --max_tokens is given)")


def _user_max_seq_len(request: Any) -> int | None:
    """The max_seq_len the user set (the flag, else the --config file's), or None: the checkpoint's applies later
    (also for "auto", which the KV plan lowers from it to what the pools sized here hold)."""
    if request.overrides.get("max_seq_len") == "auto":
        return None
    if request.overrides.get("max_seq_len") is not None:
        return int(request.overrides["max_seq_len"])
    value = (request.config or {}).get("max_seq_len")  # a bad one is reported by parse_args, naming the file
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class _PromptAction(argparse.Action):
    """Appends ``--prompt`` and ``--prompt-ids`` values to one list, in command-line order."""

    def __call__(self, parser: Any, ns: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        setattr(ns, self.dest, [*(getattr(ns, self.dest) or []), values])


_GENERATE_EPILOG = """\
Output: with one prompt, the reply streams to stdout as it is generated (token ids, space separated,
for a model without a tokenizer); with several, each reply is printed as soon as it finishes, as
"[i] text" (i = the prompt's position; "[i.j]" for its sample j with --n). With --logprobs K each reply is
followed by its tokens, one a line: the token (quoted text, or its id), its logprob, then the other tokens
among the K most likely with theirs. With --reasoning-parser each reply's thinking and answer print apart, after
"reasoning:" and "content:" (in --json: each sample's reasoning_content and content). The last line gives prompt,
reused and generated tokens, wall time and tokens/s. --json prints one document instead (outputs, timings, stats).

KV budget: on CPU with neither --max_tokens nor --max_gpu_total_bytes, generate sizes the pools for
prompts x (n x max_new_tokens + 1024) tokens, at most prompts x n x max_seq_len (--max_seq_len, the --config
file's, else the checkpoint's: no sample grows past it; the kv_budget_computed event says so); requests that do
not fit at once wait (V1) or are suspended to the host tier (V2).

examples:
  kvload generate smollm2-135m --chat --prompt "What is the capital of France?"
  kvload generate smollm2-135m --prompt "Once upon a time" --prompt "The sky is" --max_new_tokens 32
  kvload generate tiny-llama --prompt-ids 1,2,3,4 --temperature 0.8 --top_p 0.9 --seed 7
  kvload generate smollm2-135m --prompt "The sky is" --n 3 --temperature 0.8 --top_k 50 --stop .
  kvload generate smollm2-135m --chat --prompt "Is Paris in France?" --choice yes --choice no
  kvload generate smollm2-135m --chat --prompt "The capital of France, in JSON" --json-schema @city.json
  kvload generate ./ckpt --use_kv_cache_manager_v2 true --max_tokens 4096 --audit-log gen.jsonl
"""


def add_generate_command(sub: Any) -> None:
    """``generate``: load weights, build the routed KV manager, generate with continuous batching."""
    p = sub.add_parser(
        "generate", help="load the weights and generate text through the routed KV cache manager",
        formatter_class=HelpFormatter, epilog=_GENERATE_EPILOG,
        description="Run all stages with weights, then generate for every prompt at once through the routed "
                    "KV cache manager and scheduler (continuous batching: prefill chunks and decodes share "
                    "each forward). Generation events join the audit log.")
    add_model_flags(p)
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", dest="prompts", action=_PromptAction, metavar="TEXT",
                   help="a prompt (repeat for several; needs a tokenizer)")
    g.add_argument("--prompt-ids", "--prompt_ids", dest="prompts", action=_PromptAction, type=token_ids,
                   metavar="IDS", help="a prompt as token ids, e.g. 1,2,3 (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap each --prompt in the tokenizer's chat template")
    from engine.sampling_params import (  # one default length for the CLI and Python
        DEFAULT_MAX_TOKENS,
        MAX_REPETITION_PENALTY,
        MIN_REPETITION_PENALTY,
    )

    g.add_argument("--max_new_tokens", "--max-new-tokens", dest="max_new_tokens", default=None,
                   metavar="N", type=at_least(1),
                   help=f"most tokens generated per sample (SamplingParams.max_tokens; default: the model's, else "
                        f"{DEFAULT_MAX_TOKENS}); --max_tokens is the KV cache budget")
    g.add_argument("--temperature", default=None, metavar="T",
                   type=_bounded(number, lambda v: v >= 0, "a number >= 0"),
                   help="sampling temperature; 0 = greedy (default: the model's, else 0)")
    g.add_argument("--top_p", "--top-p", dest="top_p", default=None, metavar="P",
                   type=_bounded(number, lambda v: 0 < v <= 1, "a number in (0, 1]"),
                   help="nucleus sampling: keep the most likely tokens up to this probability (default: the "
                        "model's, else 1)")
    g.add_argument("--top_k", "--top-k", dest="top_k", default=None, metavar="K",
                   type=_bounded(integer, lambda v: v >= -1, "an integer >= 1, or 0 / -1 for all tokens"),
                   help="sample among the K most likely tokens only (default: the model's, else 0 = all)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a sample when its text contains TEXT (repeatable; TEXT is not printed)")
    g.add_argument("--stop_token_ids", "--stop-token-ids", dest="stop_token_ids", default=[], metavar="IDS",
                   type=token_ids, help="end a sample at any of these token ids, e.g. 2,7")
    g.add_argument("--n", default=1, metavar="N", type=_bounded(integer, lambda v: 1 <= v <= MAX_N,
                                                                f"an integer in [1, {MAX_N}]"),
                   help=f"samples per prompt (at most {MAX_N}), sharing the prompt's KV blocks (one prefill); "
                        "with --temperature > 0")
    g.add_argument("--logprobs", default=None, metavar="K",
                   type=_bounded(integer, lambda v: 0 <= v <= MAX_LOGPROBS, f"an integer in [0, {MAX_LOGPROBS}]"),
                   help="report the K most likely tokens' log-probabilities per generated token (printed after "
                        "each reply; in --json, each sample's logprobs)")
    # -1 is vLLM's "no seed" (SamplingParams(seed=-1), a request's "seed": -1), as the Python API and the server take it
    g.add_argument("--seed", default=None, metavar="S",
                   type=_bounded(integer, lambda v: v >= -1, "an integer >= 0, or -1 for none (vLLM's)"),
                   help="sampling seed (each prompt's sample j uses S + j, vLLM's rule); absent or -1 = a fresh "
                        "random seed")
    g.add_argument("--salt", default=None, metavar="TEXT",
                   help="prefix-reuse scope: prompts under different salts never share cached blocks")
    g.add_argument("--ignore_eos", "--ignore-eos", dest="ignore_eos", action="store_true",
                   help="keep generating past end-of-sequence until --max_new_tokens (benchmarks)")
    g.add_argument("--repetition_penalty", "--repetition-penalty", dest="repetition_penalty", default=None,
                   metavar="R", type=_bounded(number, lambda v: MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY,
                                              f"a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]"),
                   help="divide a positive logit (multiply a negative one) of each token already in the prompt or "
                        "output by R, greedy or sampled (default: the model's, else 1 = off)")
    g.add_argument("--presence_penalty", "--presence-penalty", dest="presence_penalty", default=0.0, metavar="P",
                   type=_bounded(number, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
                   help="subtract P from the logit of each token the output already holds (default: 0 = off)")
    g.add_argument("--frequency_penalty", "--frequency-penalty", dest="frequency_penalty", default=0.0,
                   metavar="F", type=_bounded(number, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
                   help="subtract F per time the output holds a token from its logit (default: 0 = off)")
    g.add_argument("--min_tokens", "--min-tokens", dest="min_tokens", default=0, metavar="N",
                   type=at_least(0),
                   help="no EOS, stop token or stop string ends a sample before it has N tokens (default: 0)")
    g.add_argument("--min_p", "--min-p", dest="min_p", default=None, metavar="P",
                   type=_bounded(number, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
                   help="sample only among tokens at least P times as likely as the most likely one (default: the "
                        "model's, else 0)")
    from kvload.cli.structured_flags import add_structured_flags

    add_structured_flags(p)
    p.set_defaults(func=cmd_generate, prompts=None)
