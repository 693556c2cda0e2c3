"""Beam search over kvload's executor, as vLLM's ``LLM.beam_search`` does it: one generate step per token.

Each step asks the executor for one token of every live beam with its ``2 * beam_width`` most likely next tokens
(``logprobs``); the beams share their prompt and common prefix through the prefix cache, so a step computes
each beam's new token (plus, on V1, the rest of its last partial block). Per prompt, the candidates
(beam, token) are ranked by cumulative log-probability: the best ``beam_width`` that are not EOS go on; an EOS
candidate ranked among the first ``beam_width`` ends its hypothesis there (``ignore_eos``: EOS is an ordinary
token). At the end every hypothesis — finished or still running at ``max_tokens`` — is scored
``cumulative_logprob / generated_tokens ** length_penalty`` and the best ``beam_width`` are returned, best first.
With ``ignore_eos`` this is transformers' ``generate(num_beams=...)`` run without an EOS token.

The width is bounded by the load's ``max_beam_width`` (TensorRT-LLM sizes its engine by it, and kvload's router
sends beam search to KV cache manager V1 by TensorRT-LLM's rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from engine.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams, _plain_int, check, is_finite, is_int, is_number
from pipeline.errors import GenerationError
from pipeline.limits import MAX_N

if TYPE_CHECKING:
    from engine.executor import Executor


@attrs.frozen(init=False)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``beam_width`` beams, up to ``max_tokens`` new tokens each, greedy."""

    beam_width: int
    max_tokens: int = DEFAULT_MAX_TOKENS
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __init__(self, *, beam_width: int, max_tokens: int = DEFAULT_MAX_TOKENS, ignore_eos: bool = False,
                 length_penalty: float = 1.0, temperature: float = 0.0) -> None:
        """Keywords only; ``temperature`` is taken for vLLM's signature and must be 0 (beam search is greedy)."""
        beam_width, max_tokens = _plain_int(beam_width), _plain_int(max_tokens)
        check(is_int(beam_width) and 1 <= beam_width <= MAX_N, "beam_width", f"an integer in [1, {MAX_N}]",
              beam_width)
        check(is_int(max_tokens) and max_tokens >= 1, "max_tokens", "an integer >= 1", max_tokens)
        check(isinstance(ignore_eos, bool), "ignore_eos", "true or false", ignore_eos)
        check(is_finite(length_penalty), "length_penalty", "a finite number",
              length_penalty)
        check(is_number(temperature) and temperature == 0, "temperature",
              "0 (beam search keeps the most likely beams; sample with generate instead)", temperature)
        self.__attrs_init__(beam_width, max_tokens, ignore_eos, float(length_penalty))


@attrs.frozen
class BeamSequence:
    """One finished hypothesis: its generated ids, their summed log-probability and its length-penalised score."""

    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop": it ended with EOS; "length": it reached max_tokens
    text: str | None = None


@attrs.frozen
class BeamSearchOutput:
    """A prompt's best hypotheses, best first (``beam_width`` of them, fewer only if the vocabulary is smaller)."""

    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    sequences: tuple[BeamSequence, ...]


def beam_search(executor: Executor, prompts: Any, params: BeamSearchParams, *, max_beam_width: int,
                salt: str | None = None) -> list[BeamSearchOutput]:
    """Run beam search for every prompt (see the module doc); one :class:`BeamSearchOutput` per prompt, in order."""
    if not isinstance(params, BeamSearchParams):
        raise GenerationError(f"beam_search: params: expected a BeamSearchParams, got {type(params).__name__}")
    k = params.beam_width
    if k > max_beam_width:
        raise GenerationError(f"beam_search: beam_width={k} exceeds max_beam_width={max_beam_width}, the width the "
                              f"model was loaded for; load it with max_beam_width >= {k}")
    items = executor._prompts(prompts, chat=False)
    eos = set() if params.ignore_eos else set(executor.eos_token_ids)
    step = SamplingParams._beam_step(2 * k)  # the top 2k extend the beams even when an end takes k of them
    # per prompt: live beams (generated ids, cumulative log-probability) and finished hypotheses
    live: list[list[tuple[tuple[int, ...], float]]] = [[((), 0.0)] for _ in items]
    done: list[list[tuple[tuple[int, ...], float, str]]] = [[] for _ in items]
    room = [min(params.max_tokens, executor.max_seq_len - len(ids)) for _, ids in items]
    for t in range(max(room)):
        asks = [(i, beam) for i, beams in enumerate(live) if t < room[i] for beam in beams]
        if not asks:
            break
        outs = executor.run([list(items[i][1]) + list(beam[0]) for i, beam in asks], step, salt=salt)
        candidates: list[list[tuple[float, tuple[int, ...]]]] = [[] for _ in items]
        for (i, (tokens, cum)), out in zip(asks, outs, strict=True):
            (first,) = out.outputs[0].logprobs or [{}]
            candidates[i] += [(cum + lp, (*tokens, tok)) for tok, lp in first.items()]
        for i, cands in enumerate(candidates):
            if t >= room[i]:
                continue
            cands.sort(key=lambda c: -c[0])  # stable: equal scores keep the beams' order, then the tokens'
            nxt: list[tuple[tuple[int, ...], float]] = []
            for rank, (cum, tokens) in enumerate(cands):
                if tokens[-1] in eos:
                    if rank < k:  # an ending as likely as the kept beams is a hypothesis of its own
                        done[i].append((tokens, cum, "stop"))
                    continue
                nxt.append((tokens, cum))
                if len(nxt) == k:
                    break
            live[i] = nxt if len(done[i]) < k or not eos else []
    outputs = []
    for i, (text, ids) in enumerate(items):
        hyps = done[i] + [(tokens, cum, "length") for tokens, cum in live[i]]
        scored = sorted(((cum / max(1, len(tokens)) ** params.length_penalty, tokens, cum, why)
                         for tokens, cum, why in hyps), key=lambda h: -h[0])[:k]
        outputs.append(BeamSearchOutput(text, tuple(ids), tuple(
            BeamSequence(tokens, cum, score, why, _decode(executor, tokens)) for score, tokens, cum, why in scored)))
    return outputs


def _decode(executor: Executor, tokens: Sequence[int]) -> str | None:
    """A hypothesis' text without special tokens (None without a tokenizer)."""
    tokenizer = executor.tokenizer
    return tokenizer.decode(list(tokens), skip_special_tokens=True) if tokenizer is not None else None


__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamSequence", "beam_search"]
