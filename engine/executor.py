"""The generation executor: continuous batching over the routed KV cache manager and scheduler.

One step (:meth:`engine.driver.Driver.step`): the scheduler admits, suspends, resumes and allocates;
the executor packs every scheduled chunk — prefill pieces (chunked by ``max_num_tokens``) and decode
tokens of many requests — into one forward with per-token positions (``PagedBatch``), each layer
writing and reading K/V through the request's block tables (``manager.block_tables(req)``, every layer
group's at once, kept as array rows across steps in a ``BlockTableStore``) on the attention path
``attention_backend`` chose (compiled flex over the pools, or gather + SDPA); it samples the next
token of each request whose known tokens are all in the cache after this step (greedy = argmax;
else transformers' temperature, top-k and top-p warpers and a per-request seeded ``torch.Generator``,
with top-``logprobs`` kept when asked); the driver commits the KV, appends the tokens, and finishes
requests with "stop" (EOS, a stop token id, a stop string in the text) or "length" (``max_tokens``,
``max_seq_len``); their blocks return to the pool (with reuse on, full blocks stay cached for later
prompts).

The ``n`` samples of a prompt share one prefill (``engine.driver``'s forks): the first sample prefills alone,
the step that completes its prompt draws every sample's first token from its logits (each sample with its own
generator), and the other samples join holding the prompt's KV — its whole blocks shared, the block of its
partial end copied (copy-on-write) — so the prompt is computed once for any ``n``, prefix reuse on or off.

A prompt whose prefix is cached (V2's radix tree, V1's full blocks) is admitted with that prefix
already computed: its prefill starts after it, and the output reports ``reused_prompt_tokens``.

Every ``generate`` call is one segment of the loaded result's audit log: ``generation_started``,
the driver's ``request_admitted`` / ``request_suspended`` / ``request_resumed`` / ``request_finished``,
then ``generation_finished`` (or ``generation_failed``), all with stage ``generate``, numbered on
from the load's own events.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import random
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from cache_backends.block_tables import BlockTableStore
from cache_backends.interface import PrefixCacheInUseError, SchedulerOutput
from cache_backends.layout import DECODE_KERNEL_KINDS, cannot_generate
from cache_backends.paged_attention import PagedBatch, SeqChunk
from cache_backends.request import Request
from engine.driver import Arrival, Driver, StalledError, at_length
from engine.messages import check_messages
from engine.outputs import (
    CompletionOutput,
    GenerationOutput,
    GenerationStats,
    GenerationTimings,
    RequestMetrics,
    RequestOutput,
    StreamEvent,
    TokenDelta,
)
from engine.penalties import penalize
from engine.pooling import PooledRows
from engine.prompts import (
    CHAT_OPTIONS,
    PromptOptions,
    array_ints,
    check_text,
    is_conversation,
    normalize,
    template_options,
    templated,
)
from engine.sampling import Logprob, eos_token_ids, sample_rows, top_logprobs
from engine.sampling_params import (
    SamplingParams,
    check,
    check_keywords,
    check_salt,
    defaulted_fields,
    greedy_ignored,
    inert_settings,
    is_int,
)
from engine.speculation import NgramProposer, verify_drafted
from engine.stopping import SampleText
from engine.structured import Constraint, GrammarBackend, constrain, overruled_settings
from models.classifier import head_of, not_generative
from models.deepseek_v4_paged import V4_NO_DRAFTS, V4Snapshot, V4States, prefix_digest, step_states, uses_v4
from models.geometry import head_dim as config_head_dim
from models.geometry import kv_heads as config_kv_heads
from models.geometry import text_config
from models.paged_forward import ATTN_IMPLEMENTATION, route_paged_attention, run_forward, unfoldable_mla
from pipeline.config import ATTENTION_BACKENDS, AUTO, LINEAR_BACKENDS
from pipeline.errors import GenerationError, KvBuildError, KvRuntimeError, first_line, retitled
from pipeline.events import (
    Event,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    PrefixCacheReset,
    RequestAdmitted,
    SettingIgnored,
)
from pipeline.limits import MAX_DRAFT_LEN, MAX_INT, MAX_NGRAM, int_text, plain_scalar, short

#: A prompt: text (needs a tokenizer) or token ids.
Prompt = str | Sequence[int]


#: A pooled request as a refusal names it, by the call that makes it (``LLM.classify``, ``LLM.reward``; an
#: embedding otherwise: ``LLM.embed``, ``LLM.score``'s embeddings)
POOLED = {"embed": "an embedding", "classify": "a classification", "reward": "a reward (every token's scores)",
          "encode": "a pooled request"}


class StreamLeft(GenerationError):
    """A stream's consumer on rank 0 left: raised on every rank after the same step (``stream_stop``)."""


@attrs.define(eq=False)
class _Live:
    """Executor-side state of one request of the current call."""

    index: int
    request: Request
    prompt: str | None
    arrival_step: int
    generator: torch.Generator | None = None
    params: SamplingParams = attrs.Factory(SamplingParams)
    sample: int = 0  # which of the prompt's n samples
    parent: _Live | None = None  # the prompt's first sample (which prefills for the others)
    text: SampleText | None = None  # None without a tokenizer
    logprobs: list[dict[int, float]] | None = None  # one entry per generated token, with SamplingParams.logprobs
    #: with SamplingParams.prompt_logprobs, on the prompt's first sample (which prefills): one entry per prompt token,
    #: None for the first (vLLM's shape)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    stop_reason: str | int | None = None
    finish_reason: str | None = None
    queued_at: float = 0.0
    arrived_wall: float = 0.0  # time.time() when queued (RequestMetrics.arrival_time)
    admitted_at: float | None = None  # first admission (RequestMetrics.scheduled_ts)
    first_token_at: float | None = None
    finished_at: float = 0.0
    reported: int = 0  # generated tokens already reported (streamed)
    #: with SamplingParams.structured_outputs: this sample's grammar state (``engine.structured``)
    constraint: Constraint | None = None


@attrs.frozen
class PromptScores:
    """Logprob entries of consecutive prompt tokens from one step (``prompt_logprobs``): ``entries[j]`` is the token at
    position ``first + j``'s, as ``engine.sampling.top_logprobs`` gives them (its top alternatives plus itself)."""

    first: int
    entries: list[dict[int, float]]


class GenerationExecutor:
    """Runs ``generate`` calls over a loaded model, its KV cache manager and scheduler (V1 or V2).

    Build it with :meth:`from_result` (``LoadResult.generate`` does). The model's attention is
    switched to kvload's paged attention for the duration of each call and switched back after, so
    ``model.generate`` keeps working between calls.
    """

    def __init__(self, model: Any, manager: Any, scheduler: Any, *, tokenizer: Any = None,
                 emit: Callable[[Event], Any] | None = None, name: str = "model", ranks: Any = None) -> None:
        self.model = model
        # tensor parallel: every rank runs this loop; RankLockstep keeps their decisions identical
        self.lockstep = RankLockstep(ranks) if ranks is not None and ranks.distributed else None
        self.manager = manager
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}  # token id -> its text, for Logprob.decoded_token (at most the vocab)
        self.name = name
        self.pools = manager.pools
        self.groups = [g.name for g in manager.layout.groups]
        self.max_seq_len = manager.options.max_seq_len
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        #: every EOS id is a special token, whose text ``skip_special_tokens`` leaves out (so keeping it under
        #: ``include_stop_str_in_output`` shows nothing); fixed with the tokenizer, so found once, not per request
        special = set(getattr(tokenizer, "all_special_ids", None) or ())
        self.eos_is_special = all(t in special for t in self.eos_token_ids)
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self._emit = emit
        self._calls = 0
        #: ``kvload.LLM(seed=...)``: the bases of unseeded samples come from this generator, so a run repeats (None:
        #: fresh randomness each call); ``llm_seed`` is the seed it started from, for the audit
        self.call_seeds: random.Random | None = None
        self.llm_seed: int | None = None
        #: ``kvload.LLM(reasoning_parser=...)``: vLLM's engine-wide reasoning parser, taken by each request's structured
        #: outputs that name none of their own (their grammar holds only the answer after the thinking)
        self.reasoning_parser: str | None = None
        self._caller = "generate"  # the user's call (:meth:`called_as`), which titles the audit's generation_failed
        self._live: dict[str, _Live] = {}
        self._forks: dict[str, list[_Live]] = {}  # run's: a prompt's samples forked from its first one
        #: the call's (SamplingParams id, setting) pairs a grammar overruled and said so (``_compute``): one
        #: setting_ignored per SamplingParams of the call, however many samples or steps it was overruled in
        self._overruled_said: set[tuple[int, str]] = set()
        width = max(-(-self.max_seq_len // g.tokens_per_block) for g in manager.layout.groups)
        #: every live request's block tables as tensor rows, appended to step by step
        self._block_tables = BlockTableStore(self.groups, width)
        #: the compiled attention path (None: gather + SDPA), set by ``from_result`` from ``attention_backend``
        self.flex: Any = None
        #: the paged decode kernel decode steps attend through (``attention_backend: triton`` on CUDA,
        #: ``cpu_kernel`` on CPU, where it runs); None: gather + SDPA
        self.decode_kernel: Callable[..., torch.Tensor] | None = None
        #: the small-batch linear kernel installed on the model (``linear_backend: cpu_kernel`` where it runs),
        #: active around each forward; None: torch's F.linear
        self.linear: Any = None
        #: speculative decoding's draft proposer (``max_draft_len`` > 0: :meth:`use_speculation`); None: off
        self.proposer: NgramProposer | None = None
        #: the widest beam search this load serves (``max_beam_width``; :meth:`beam_search`)
        self.max_beam_width = 1
        #: SamplingParams fields a call that passes no SamplingParams takes unless its keywords set them: the model's
        #: generation_config.json (``LoadResult.sampling_defaults``, set by ``from_result``); empty: kvload's own
        self.sampling_defaults: dict[str, Any] = {}
        #: where each of them came from (``SamplingDefaults.sources``: the model's file or the user's override), for
        #: refusals that name a default the caller did not give
        self.sampling_sources: dict[str, str] = {}
        self.last_stats: GenerationStats | None = None
        #: the requests that want their prompt's pooled hidden state (``LLM.embed``, ``/v1/embeddings``)
        self.pooled = PooledRows()
        #: xgrammar over this model's tokenizer, built by the first request for structured outputs (:meth:`grammars`)
        self._grammars: GrammarBackend | None = None
        self._grammars_lock = threading.Lock()
        #: set by :meth:`stop`: the running call (and any later one) fails with this message between two steps
        self._stopped: str | None = None
        #: a stream on ranks kvload.LLM started: asked each step on rank 0 whether its consumer left, the answer sent
        #: with the step's tokens, so every rank stops after the same step (None: no such stream)
        self.stream_stop: Callable[[], bool] | None = None
        self._stream_left = False  # the last step's answer
        why = cannot_generate(name, manager.layout.layers, manager.layout.manager)
        if why is not None:
            raise GenerationError(why)
        #: DeepSeek V4: every running request's compressor side state (the partial window and CSA's overlap, which
        #: are no full compressed entry yet), dropped when the request finishes, and the snapshots of cached prefixes
        #: at reuse boundaries, kept with the window group's block that ends there; None for other models
        self.v4: V4States | None = None
        self._v4_key: str | None = None  # the window group whose blocks key the snapshots (None: reuse off)
        if uses_v4(manager.layout.layers):
            unit = getattr(manager, "reuse_unit", None) if self._reuse_off() is None else None
            key = next((g for g in manager.layout.groups if g.compress_rate is None
                        and g.tokens_per_block == manager.layout.tokens_per_block), None)
            if unit is None or key is None:
                self.v4 = V4States()
            else:  # the manager reuses a prefix only up to a boundary whose side state was snapshotted
                self.v4 = V4States(unit, manager.layout.tokens_per_block)
                self._v4_key = key.name
                manager.limit_reuse(key.name, self._v4_reusable)
                if hasattr(manager, "watch_moves"):  # a slab arena may move the blocks the snapshots are kept with
                    manager.watch_moves(self._v4_moved)

    @classmethod
    def from_result(cls, result: Any) -> GenerationExecutor:
        """An executor over a ``pipeline.load(..., load_weights=True)`` result, emitting into its audit log."""
        if result.kv_manager is not None and getattr(result.kv_manager, "closed", False):
            raise GenerationError("generate: this result was closed (LoadResult.close released its KV pools and "
                                  "weights); load the model again")
        if result.kv_manager is None or result.scheduler is None:
            raise GenerationError("generate: this result has no KV cache manager (it came from pipeline.plan); "
                                  "use pipeline.load(MODEL, load_weights=True, ...)")
        if result.hf_model is None:
            raise GenerationError("generate: this result has no model weights (loaded without load_weights=True); "
                                  "use pipeline.load(MODEL, load_weights=True, ...)")
        bus = result.bus
        emit = bus.emitter("generate") if bus is not None else None
        executor = cls(result.hf_model, result.kv_manager, result.scheduler, tokenizer=result.tokenizer, emit=emit,
                       name=result.model.name if result.model is not None else "model", ranks=result.context.ranks)
        executor.use_attention(getattr(result.args, "attention_backend", "sdpa"), result.args.max_num_tokens)
        executor.use_linear(getattr(result.args, "linear_backend", "torch"))
        executor.use_speculation(getattr(result.args, "max_draft_len", 0),
                                 getattr(result.args, "max_matching_ngram_size", 2),
                                 getattr(result.args, "speculation_max_batch_size", 1))
        executor.max_beam_width = result.args.max_beam_width
        defaults = getattr(result, "sampling_defaults", None)
        executor.sampling_defaults = dict(defaults.values) if defaults is not None else {}
        executor.sampling_sources = dict(defaults.sources) if defaults is not None else {}
        return executor

    def use_attention(self, backend: str, max_num_tokens: int) -> None:
        """Run attention on ``"flex"`` (compiled, over the pools), ``"sdpa"`` (gather + SDPA, the reference),
        ``"triton"`` or ``"cpu_kernel"`` (decode steps on a paged decode kernel for CUDA or for CPUs, the rest on
        gather + SDPA)."""
        from cache_backends.flex_paged import MAX_INDEX_BYTES, FlexPagedAttention, flex_unsupported

        resolved = [b for b in ATTENTION_BACKENDS if b != AUTO]
        if backend not in resolved:
            raise GenerationError(f"generate: attention_backend: expected one of {', '.join(resolved)} (resolved), "
                                  f"got {backend!r}")
        self.flex = None
        self.decode_kernel = None
        if backend == "sdpa":
            return
        if self.v4 is not None:  # an accepted setting never silently does nothing
            self._event(SettingIgnored(field="attention_backend", value=backend, reason=(
                "DeepSeek V4's layers attend through their own forward (each sequence's window and compressed entries "
                "gathered from the pools, the model's softmax with its sinks); generate attends that way")))
            return
        if self.pools.slabs is not None:  # the kernels take a block's slots as entries_per_block; the arena's differ
            self._event(SettingIgnored(field="attention_backend", value=backend, reason=(
                "a slab arena's layer views step over the other layers' entries between two blocks (pool_arena), "
                "which the compiled and paged decode kernels do not read; generate attends through gather + SDPA")))
            return
        if backend in ("triton", "cpu_kernel"):
            kernel, why = self._decode_kernel(backend)
            if why is not None:
                self._event(SettingIgnored(field="attention_backend", value=backend,
                                           reason=f"{why}; generate attends through gather + SDPA"))
            self.decode_kernel = kernel
            return
        why = flex_unsupported(self.manager.layout, self.pools.device)
        if why is None and any(layer.kind == "mla" for layer in self.manager.layout.layers):
            why = unfoldable_mla(self.model)
        if why is not None:  # say so: an accepted setting never silently does nothing
            self._event(SettingIgnored(field="attention_backend", value="flex",
                                       reason=f"{why}; generate attends through gather + SDPA"))
            return
        need = FlexPagedAttention.index_bytes(self.pools, max_num_tokens)
        if need > MAX_INDEX_BYTES:
            self._event(SettingIgnored(
                field="attention_backend", value="flex",
                reason=f"the compiled kernel's block-mask indices would take {need:,} B of memory (more than "
                       f"{MAX_INDEX_BYTES:,} B: one row of pool-block ids per packed token, for up to "
                       f"max_num_tokens={max_num_tokens} tokens); lower max_num_tokens or the KV budget, "
                       "or let generate attend through gather + SDPA"))
            return
        self.flex = FlexPagedAttention(self.pools, max_num_tokens)

    def use_linear(self, backend: str) -> None:
        """Run the model's projections on ``"torch"`` (F.linear) or ``"cpu_kernel"`` (steps of few rows on the small-
        batch kernel for CPUs, where it runs; a ``setting_ignored`` event says why where it does not)."""
        from models.small_linear import KernelUnavailable, LinearRoute, load_small_linear, small_linear_unsupported

        if backend not in LINEAR_BACKENDS or backend == AUTO:
            resolved = [b for b in LINEAR_BACKENDS if b != AUTO]
            raise GenerationError(f"generate: linear_backend: expected one of {', '.join(resolved)} (resolved), "
                                  f"got {backend!r}")
        self.linear = None
        if backend == "torch":
            return
        weight = self.model.get_input_embeddings().weight
        why = small_linear_unsupported(weight.device, weight.dtype)
        if why is None:
            from models.gguf_cache import cache_root

            try:
                route = LinearRoute(load_small_linear(cache_root() / "kernels"), self.model)
            except KernelUnavailable as exc:
                why = str(exc)
            else:
                if route.layers:
                    self.linear = route
                else:  # an accepted setting never silently does nothing
                    why = ("none of the model's linear layers holds a plain float32 host tensor (tensor parallel "
                           "shards them as DTensors)")
        if why is not None:
            self._event(SettingIgnored(field="linear_backend", value=backend,
                                       reason=f"{why}; generate multiplies through torch's F.linear"))

    def use_speculation(self, max_draft_len: int, max_matching_ngram_size: int = 2, max_batch_size: int = 1) -> None:
        """Speculative decoding by n-gram lookup (``engine.speculation``): up to ``max_draft_len`` drafts per
        request and step while at most ``max_batch_size`` requests run; ``max_draft_len`` 0 turns it off."""
        for name, value, least, most in (("max_draft_len", max_draft_len, 0, MAX_DRAFT_LEN),
                                         ("max_matching_ngram_size", max_matching_ngram_size, 1, MAX_NGRAM),
                                         ("speculation_max_batch_size", max_batch_size, 1, MAX_INT)):
            if not (is_int(value) and least <= value <= most):
                raise GenerationError(f"generate: {name}: expected an integer from {least} to {most}, got {value!r}")
        if max_draft_len and self.v4 is not None:  # a rejected draft would leave its projections in the compressor
            self._event(SettingIgnored(field="max_draft_len", value=max_draft_len, reason=V4_NO_DRAFTS))
            max_draft_len = 0
        self.proposer = NgramProposer(max_draft_len, max_matching_ngram_size, self.max_seq_len, max_batch_size) \
            if max_draft_len else None

    def _decode_kernel(self, backend: str) -> tuple[Callable[..., torch.Tensor] | None, str | None]:
        """The paged decode kernel ``backend`` names for this model's attention layers here, or None and why not."""
        kinds = {layer.kind for layer in self.manager.layout.layers}
        if not kinds & DECODE_KERNEL_KINDS:
            return None, (f"the paged decode kernel serves full and sliding-window layers; this model has "
                          f"{sorted(kinds)}")
        config = text_config(self.model.config)
        head_dim = config_head_dim(config)
        groups = [g for g in self.manager.layout.groups if g.kind in DECODE_KERNEL_KINDS]
        if backend == "triton":
            from cache_backends.paged_decode import paged_decode, paged_decode_unsupported

            for group in groups:
                why = paged_decode_unsupported(self.pools.device, group.tokens_per_block, head_dim)
                if why is not None:
                    return None, why
            return paged_decode, None
        from cache_backends.cpu_decode import KernelUnavailable, cpu_decode_unsupported, load_cpu_kernel
        from models.gguf_cache import cache_root

        group = int(config.num_attention_heads) // config_kv_heads(config)
        why = cpu_decode_unsupported(self.pools.device, head_dim, group, self.pools.dtype)
        if why is not None:
            return None, why
        try:
            return load_cpu_kernel(cache_root() / "kernels"), None
        except KernelUnavailable as exc:
            return None, str(exc)

    # --- the call ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def called_as(self, caller: str) -> Iterator[None]:
        """Run calls in the block as the user's ``caller`` (``chat``, ``generate_stream``, ``beam_search``): the audit's
        ``generation_failed`` message is titled as the error the caller raises (``kvload.llm``'s ``_named``)."""
        before, self._caller = self._caller, caller
        try:
            yield
        finally:
            self._caller = before

    def stop(self, message: str) -> None:
        """Make the running call fail with ``GenerationError(message)`` after its current step (its requests freed,
        ``generation_failed`` recorded), and every later call at its start: the owner is closing this executor."""
        self._stopped = message

    def run(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        salt: str | None = None,
        chat: bool | Mapping[str, Any] = False,
        on_delta: Callable[[TokenDelta], Any] | None = None,
        arrival_steps: Sequence[int] | None = None,
        priority: Sequence[int] | None = None,
        pool: bool = False,
        every_token: bool = False,
        **sampling: Any,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched continuously; one :class:`RequestOutput` per prompt, in order.

        ``prompts``: one string, or a list of strings (tokenized; ``chat=True`` applies the tokenizer's
        chat template) and/or lists of token ids. ``sampling_params``: one :class:`SamplingParams` for
        every prompt, or a list of them (one per prompt); its fields may instead be given as keywords
        (``max_tokens=32, temperature=0.8``), not both. ``salt`` scopes prefix reuse: prompts under
        different salts never share cached blocks. ``on_delta`` is called with a :class:`TokenDelta` for
        every token of every sample as it is produced. ``arrival_steps[i]`` (default 0) is the step at
        which prompt ``i`` joins, to exercise requests arriving while others run. ``priority[i]`` (vLLM's
        argument and sign: lower is served first, default 0) ranks prompt ``i`` under ``scheduling_policy="priority"``;
        under "fcfs" only 0 is accepted, as vLLM does.

        With ``n > 1`` a prompt's first sample prefills alone; the step that completes its prompt draws every
        sample's first token from those logits, and the others join holding a fork of the prompt's KV (whole
        blocks shared, the partial last block copied), so the prompt is computed once (prefix reuse on or off). A
        sample the pools have no room for yet waits, and computes what the prefix cache no longer holds.

        ``pool``: every request's prompt's last hidden state is captured as it is computed (``LLM.embed``), for the
        caller to :meth:`PooledRows.take` from :attr:`pooled` by each output's ``request_id``; with ``every_token``
        each prompt token's (``LLM.reward``), the prompt computed whole (its cached prefix not read: no forward
        would give those tokens' rows).
        """
        self._check_open()
        if not pool:
            self.check_generates("generate")
        check_salt(salt)
        if isinstance(chat, Mapping):  # LLM.chat's template options, checked here (once, before any work)
            unknown = sorted(set(chat) - CHAT_OPTIONS)
            if unknown:
                raise GenerationError(f"chat: unknown template option {unknown[0]!r}; known: "
                                      f"{', '.join(sorted(CHAT_OPTIONS))}")
            chat = template_options(**chat)
        else:
            check(isinstance(chat, bool), "chat", "true or false, or LLM.chat's template options", chat)
        # a chat's sampling settings are checked before its template is applied: a mistyped keyword is the first
        # mistake to fix, and on a tokenizer without a template it read "chat needs a chat template"
        early = self._params(sampling_params, sampling, 0, pooled=pool) if chat else None
        options: list[PromptOptions] = []
        items = self._prompts(prompts, chat, checked=False, options=options)
        salts = self._salts(salt, options)
        per_prompt = isinstance(sampling_params, Sequence)
        params = self._params(sampling_params, sampling, len(items), pooled=pool) if early is None \
            else self._fitted(early, per_prompt, len(items), pooled=pool)
        cut_notes: list[tuple[str, Any, str]] = []  # said as setting_ignored once the call has started
        items = self._check_items(self._truncated(items, params, cut_notes, pool=pool), pool=pool)  # cut, then fits
        defaulted = [] if per_prompt else sorted(defaulted_fields(sampling_params, sampling, self.sampling_defaults))
        arrivals = self._arrivals(arrival_steps, len(items))
        ranks = self._priorities(priority, len(items))
        call = self._calls
        self._calls += 1
        lives = self._lives(call, items, params, salts, arrivals, ranks, pool=pool, every_token=every_token)
        if pool:
            for live in lives:
                self.pooled.want(live.request.req_id, every_token=every_token)
        now_arrivals, forks = [], {}
        for live in lives:
            if live.parent is not None:  # forked from the prompt's first sample when its prefill completes
                forks.setdefault(live.parent.request.req_id, []).append(live)
            else:
                now_arrivals.append(Arrival(live.request, live.arrival_step))

        before = self._counters()
        proposer = self.proposer
        driver = Driver(self.manager, self.scheduler, emit=self._driver_event, stop=self._stops,
                        propose=proposer.propose if proposer is not None else None)
        for kids in forks.values():
            driver.fork(kids[0].parent.request, [k.request for k in kids])
        #: first sample's request id -> the prompt's other samples, until the step that completes its prompt draws
        #: their first tokens (:meth:`_compute`)
        self._forks = forks
        outputs: dict[int, RequestOutput] = {}
        warm_before = self.flex.warmup_s if self.flex is not None else 0.0
        start = time.perf_counter()
        forward_s = kv_s = 0.0
        drafted = accepted = 0
        per_position: list[int] = []  # accepted drafts per draft position, summed over the steps
        self._live = {live.request.req_id: live for live in lives}
        self._overruled_said = set()  # (the call's params live until it ends: their ids are not reused before)
        # a prompt's index -> its samples, a first sample's request id -> the samples forked from it, each live's place:
        # a step's report reads the lives the step touched through these. It scanned every live of the call per step
        # and per finished request, O(requests**2): 16,000 one-token prompts took 16.6 s, 5.4 s now (2-core CPU)
        samples: dict[int, list[_Live]] = {}
        for live in lives:
            samples.setdefault(live.index, []).append(live)
        family = {first: list(kids) for first, kids in forks.items()}
        place = {live.request.req_id: i for i, live in enumerate(lives)}

        def queued(request: Request, clock: int) -> None:
            live = self._live[request.req_id]
            live.queued_at, live.arrived_wall = time.perf_counter(), time.time()

        def stepped(clock: int, st: Any) -> None:
            nonlocal forward_s, kv_s, drafted, accepted
            forward_s += st.compute_seconds
            kv_s += st.kv_seconds
            drafted += st.draft_tokens
            accepted += st.accepted_draft_tokens
            for i, n in enumerate(st.accepted_per_position):
                if i == len(per_position):
                    per_position.append(0)
                per_position[i] += n
            if proposer is not None:
                for req in st.finished:
                    proposer.forget(req.req_id)
            if self.v4 is not None:
                for req in st.finished:
                    self.v4.free(req.req_id)
                self.prune_v4()
            touched: dict[str, None] = {}  # the step's requests, the samples forked from them, the finished ones
            for chunk in st.output.scheduled if st.output is not None else ():
                touched[chunk.request.req_id] = None
                for kid in family.get(chunk.request.req_id, ()):
                    touched[kid.request.req_id] = None
            touched.update(dict.fromkeys(req.req_id for req in st.finished))
            order = sorted(place[r] for r in touched if r in place)  # in the call's order, as every live was
            self._report_tokens(st.finished, [lives[i] for i in order], samples, outputs, on_delta)
            if self._stream_left and (driver.has_work or driver.forks_pending):  # every rank, after the same step
                raise StreamLeft("generate_stream: the consumer on rank 0 stopped reading")
            # between steps: nothing is half-computed
            if self._stopped is not None and (driver.has_work or driver.forks_pending):
                raise GenerationError(self._stopped)

        # from generation_started on, whatever fails (a subscriber raising on that very event, which the subscribers
        # before it did receive, or on a setting_ignored) ends the call with generation_failed: no audit is left
        # with a call that started and never ended
        try:
            p0 = params[0]
            self._event(GenerationStarted(
                call=call, requests=len(lives), prompt_tokens=sum(len(ids) for _, ids in items),
                max_new_tokens=p0.max_tokens, temperature=float(p0.temperature), top_p=float(p0.top_p),
                seed=p0.seed, salted=any(s is not None for s in salts), kv_manager=type(self.manager).__name__,
                top_k=p0.top_k, n=p0.n,
                stop_strings=len(p0.stop), stop_token_ids=list(p0.stop_token_ids), logprobs=p0.logprobs,
                per_prompt_params=per_prompt, repetition_penalty=float(p0.repetition_penalty),
                presence_penalty=float(p0.presence_penalty), frequency_penalty=float(p0.frequency_penalty),
                min_tokens=p0.min_tokens, min_p=float(p0.min_p), model_defaults=defaulted, llm_seed=self.llm_seed,
                structured_outputs=p0.structured_outputs.describe() if p0.structured_outputs is not None else None))
            has_text = self.tokenizer is not None  # a setting that does nothing (greedy draws nothing: a seed, top-p,
            for p in {id(p): p for p in params}.values():  # top-k or n; a text setting with no text) is said to
                dropped = p.structured_outputs.ignored_settings() if p.structured_outputs is not None else []
                for name, value, why in (greedy_ignored(p, model_defaults=defaulted)
                                         + inert_settings(p, has_text, self.eos_is_special)
                                         + dropped):  # ... and what a schema holds that xgrammar does not enforce
                    self._event(SettingIgnored(field=f"generate.{name}", value=value, reason=why))
            for name, value, why in cut_notes:
                self._event(SettingIgnored(field=f"generate.{name}", value=value, reason=why))
            given = salt if salt is not None else next((o.cache_salt for o in options if o.cache_salt), None)
            unscoped = self.salt_ignored() if given is not None else None  # with reuse off a salt would do nothing
            if unscoped is not None:
                self._event(SettingIgnored(field="generate.salt" if salt is not None else "generate.cache_salt",
                                           value=given, reason=unscoped))
            with self.paged_attention():
                try:
                    run = driver.run(now_arrivals, self._compute, on_arrival=queued, on_step=stepped)
                except StalledError as exc:
                    raise KvRuntimeError(f"generate: the {type(self.scheduler).__name__} cannot make progress: "
                                         f"{exc}") from None
        except BaseException as exc:
            self._abort(driver)
            for live in lives:  # an embed call that failed leaves no request waiting for its row
                self.pooled.take(live.request.req_id)
            if proposer is not None:
                proposer.clear()
            self._live, self._forks = {}, {}
            self._block_tables.keep_only(())
            self._drop_v4(lives)
            self._check_flex()
            self._event(GenerationFailed(call=call, error=type(exc).__name__,
                                         message=retitled(first_line(exc, ""), self._caller),
                                         finished=len(outputs)))
            raise
        self._live, self._forks = {}, {}
        if proposer is not None:
            proposer.clear()
        self._block_tables.keep_only(())
        self._drop_v4(lives)
        # compiling a new attention shape is a one-off (later calls reuse it): reported apart, not as generation
        warmup = (self.flex.warmup_s if self.flex is not None else 0.0) - warm_before
        self._check_flex()
        wall = time.perf_counter() - start - warmup
        after = self._counters()
        ordered = [outputs[i] for i in range(len(items))]
        steps = run.engine_steps
        stats = GenerationStats(
            requests=len(ordered),
            prompt_tokens=sum(o.computed_prompt_tokens + o.reused_prompt_tokens for o in ordered),
            reused_prompt_tokens=sum(o.reused_prompt_tokens for o in ordered),
            generated_tokens=sum(len(c.token_ids) for o in ordered for c in o.outputs), steps=steps, wall_s=wall,
            forward_s=max(0.0, forward_s - warmup), kv_s=kv_s, warmup_s=warmup,
            **{k: after[k] - before[k] for k in after}, samples=len(lives), draft_tokens=drafted,
            accepted_draft_tokens=accepted, accepted_per_position=tuple(per_position))
        self.last_stats = stats
        self._event(GenerationFinished(
            call=call, requests=stats.samples, prompt_tokens=stats.prompt_tokens,
            reused_prompt_tokens=stats.reused_prompt_tokens, generated_tokens=stats.generated_tokens, steps=steps,
            suspends=stats.suspends, resumes=stats.resumes, preemptions=stats.preemptions,
            duration_ms=round(wall * 1000, 3), tokens_per_s=round(stats.tokens_per_s, 3), draft_tokens=drafted,
            accepted_draft_tokens=accepted))
        return ordered

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: Any, *,
                    salt: str | None = None, concurrency_limit: int | None = None) -> list[Any]:
        """Beam search (``engine.beam_search``): the best ``params.beam_width`` hypotheses of every prompt, at most
        ``concurrency_limit`` prompts at once."""
        from engine.beam_search import beam_search

        self._check_open()
        self.check_generates("beam_search")
        refused = self.beam_refusal()
        if refused is not None:
            raise GenerationError(refused)
        return beam_search(self, prompts, params, max_beam_width=self.max_beam_width, salt=salt,
                           concurrency_limit=concurrency_limit)

    def check_generates(self, call: str) -> None:
        """``GenerationError`` when the model cannot generate: a sequence-classification model (``models.classifier``)
        has a classifier head where a generative one has its language-model head."""
        head = head_of(self.model)
        if head is not None:
            raise GenerationError(not_generative(call, head))

    def beam_refusal(self) -> str | None:
        """Why this model cannot beam search (one line, for ``LLM.beam_search`` and the server), or None."""
        if self.v4 is None:
            return None
        return (f"beam_search: {self.name} is a DeepSeek V4 model, whose compressor side state kvload does not fork "
                "or reorder between beams; use generate")

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        salt: str | None = None,
        chat: bool = False,
        stream: Callable[[StreamEvent], Any] | None = None,
        arrival_steps: Sequence[int] | None = None,
        priority: Sequence[int] | None = None,
        **sampling: Any,
    ) -> list[GenerationOutput]:
        """:meth:`run` with one sample per prompt, as flat :class:`GenerationOutput`s (the original shape).

        ``stream`` is called with a :class:`StreamEvent` for every token as it is produced. ``n > 1``
        is refused here: use :meth:`run` (or ``kvload.LLM.generate``), which returns ``RequestOutput``s.
        """
        on_delta = None
        # stream=True (read as "stream it") raised "'bool' object is not callable" at the first token, mid-call
        if stream is not None and not callable(stream):
            raise GenerationError(f"generate: stream: expected a callable (called with a StreamEvent per token) or "
                                  f"None, got {type(stream).__name__}; kvload.LLM.generate_stream yields the tokens")
        if stream is not None:
            tokens: dict[int, list[int]] = {}

            def on_delta(d: TokenDelta) -> None:
                ids = tokens.setdefault(d.index, [])
                ids.extend(d.token_ids)
                stream(StreamEvent(d.index, ids[-1], tuple(ids), _flat(d.output) if d.output is not None else None))

        self._check_open()
        n = self._params(sampling_params, dict(sampling), 0 if isinstance(sampling_params, Sequence) else 1)
        if any(p.n != 1 for p in n):
            raise GenerationError(f"generate: n={max(p.n for p in n)}: LoadResult.generate returns one output per "
                                  "prompt; use kvload.LLM(...).generate (or result.executor.run), whose "
                                  "RequestOutputs hold n samples each")
        outs = self.run(prompts, sampling_params, salt=salt, chat=chat, on_delta=on_delta, arrival_steps=arrival_steps,
                        priority=priority, **sampling)
        return [_flat(o) for o in outs]

    def _params(self, sampling_params: Any, keywords: dict[str, Any], count: int,
                pooled: bool = False) -> list[SamplingParams]:
        """One SamplingParams per prompt (``count`` of them; 0: as many as a given list holds), checked; ``pooled``:
        they stand for ``LLM.embed``'s list of ``pooling_params``, which a wrong length is said of."""
        if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, (str, bytes)):
            keywords = check_keywords(keywords)
            if keywords:
                raise GenerationError("generate: pass sampling settings either as sampling_params or as keywords "
                                      f"({', '.join(sorted(keywords))}), not both")
            for i, p in enumerate(sampling_params):  # a None here took kvload's built-in defaults, silently, where a
                if not isinstance(p, SamplingParams):  # call given no SamplingParams takes the model's
                    raise GenerationError(f"generate: sampling_params[{i}]: expected a SamplingParams, got "
                                          f"{type(p).__name__}" + (" (sampling_params=None, not a list, takes the "
                                                                   "model's defaults)" if p is None else ""))
            params = self._fitted(list(sampling_params), True, count, pooled=pooled)
        else:  # no SamplingParams: the keywords over the model's sampling defaults (vLLM's default params)
            params = [SamplingParams.build(sampling_params, keywords, self.sampling_defaults,
                                           self.sampling_sources)] * max(count, 1)
        for p in {id(p): p for p in params}.values():  # a list changed in place since it was built (vLLM's habit)
            p.recheck()
        params = self._with_reasoning_parser(params)
        for p in params:
            if p.stop and self.tokenizer is None:
                raise GenerationError(f"generate: stop: stop strings are matched on the text, but {self.name} has no "
                                      "tokenizer; use stop_token_ids")
            if p.logprobs is not None and p.logprobs > self.vocab_size:
                raise GenerationError(f"generate: logprobs: expected at most the vocabulary size "
                                      f"({self.vocab_size}), got {p.logprobs}")
            self._check_vocab("stop_token_ids", p.stop_token_ids)
            self._check_vocab("logit_bias", p.logit_bias)
            self._check_vocab("allowed_token_ids", p.allowed_token_ids or ())
        for p in {id(p): p for p in params}.values():
            if p.bad_words:
                object.__setattr__(p, "_bad_words_token_ids", self._bad_words_token_ids(p.bad_words))
            self._check_something_allowed(p)
            if p.structured_outputs is not None:  # compiled now: a bad schema is refused before anything runs
                self.grammars().compile(p.structured_outputs)
        return params

    def _with_reasoning_parser(self, params: list[SamplingParams]) -> list[SamplingParams]:
        """``params`` with the LLM's reasoning parser on each structured outputs that names none (vLLM's engine-wide
        ``structured_outputs_config.reasoning_parser``): copies, so the caller's SamplingParams stay as given."""
        if self.reasoning_parser is None:
            return params
        done: dict[int, SamplingParams] = {}
        for p in params:
            wanted = p.structured_outputs
            if id(p) in done or wanted is None or wanted.reasoning_parser is not None:
                continue
            gated = copy.copy(p)
            gate = attrs.evolve(wanted, reasoning_parser=self.reasoning_parser)
            object.__setattr__(gated, "structured_outputs", gate)
            done[id(p)] = gated
        return [done.get(id(p), p) for p in params]

    @staticmethod
    def _fitted(params: list[SamplingParams], per_prompt: bool, count: int,
                pooled: bool = False) -> list[SamplingParams]:
        """:meth:`_params`' list for ``count`` prompts (0: any): a list given is as long, one given is repeated."""
        if not per_prompt:
            return params[:1] * max(count, 1)
        if count and len(params) != count:
            name, kind = ("pooling_params", "PoolingParams") if pooled else ("sampling_params", "SamplingParams")
            raise GenerationError(f"generate: {name}: expected one {kind} or a list of {count} (one per prompt), "
                                  f"got a list of {len(params)}")
        return params

    def grammars(self) -> GrammarBackend:
        """xgrammar over this model's tokenizer (built once; the server's handler threads share it);
        ``GenerationError`` without xgrammar or a tokenizer."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids, self.name)
            return self._grammars

    def _check_vocab(self, what: str, ids: Iterable[int]) -> None:
        """``GenerationError`` naming ``what`` and the first of ``ids`` outside the vocabulary."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise GenerationError(f"generate: {what}: token id {int_text(bad)} is outside the vocabulary "
                                  f"(0..{self.vocab_size - 1})")

    def _check_something_allowed(self, p: SamplingParams) -> None:
        """``GenerationError`` when no token is left to draw: every allowed id (``allowed_token_ids``, else the whole
        vocabulary) is a one-token bad word, or a stop token held back by ``min_tokens``. Every logit would be -inf:
        greedy would return token 0, a banned token, and sampling fail inside torch (vLLM has the same hole)."""
        banned = {w[0] for w in p._bad_words_token_ids if len(w) == 1}
        held = (set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))) if p.min_tokens else set()
        if p.allowed_token_ids is None:
            if len(banned) + len(held) < self.vocab_size:  # the usual case, without a set of the whole vocabulary
                return
            pool: set[int] = set(range(self.vocab_size))
        else:
            pool = set(p.allowed_token_ids)
        if pool - banned:
            if pool - banned - held:
                return
            by = "min_tokens (it holds back the stop and end-of-sequence tokens until then)"
        else:
            by = "bad_words"
        if p.allowed_token_ids is not None:
            raise GenerationError(f"generate: allowed_token_ids: every allowed token is banned by {by}, so no token "
                                  "could be generated; allow another token")
        if by == "bad_words":
            raise GenerationError(f"generate: bad_words: they ban every token of the vocabulary ({self.vocab_size:,} "
                                  "ids), so no token could be generated; ban fewer words")
        also, fewer = (" or a one-token bad word", "ban fewer words") if banned else ("", "give fewer stop_token_ids")
        raise GenerationError(f"generate: min_tokens: every token of the vocabulary ({self.vocab_size:,} ids) is a "
                              f"stop or end-of-sequence token it holds back{also}, so no first token could be "
                              f"generated; lower min_tokens or {fewer}")

    def _bad_words_token_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """``bad_words`` as token id sequences, vLLM's way: each word as given (left-stripped), and after a space
        where that gives a different first token in as many tokens (a word inside the text, not at its start)."""
        if self.tokenizer is None:
            raise GenerationError(f"generate: bad_words: banned words are tokenized, but {self.name} has no tokenizer "
                                  "(presets take token ids); use allowed_token_ids or logit_bias instead")
        out: list[tuple[int, ...]] = []
        for i, word in enumerate(words):
            bare = tuple(int(t) for t in self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(int(t) for t in self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if not bare:
                raise GenerationError(f"generate: bad_words[{i}]: {short(word)} gives no tokens")
            for ids in (bare, spaced) if spaced and spaced[0] != bare[0] and len(spaced) == len(bare) else (bare,):
                bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
                if bad is not None:
                    raise GenerationError(f"generate: bad_words[{i}]: {short(word)} tokenizes to id {int_text(bad)}, "
                                          f"outside the vocabulary (0..{self.vocab_size - 1})")
                out.append(ids)
        return tuple(out)

    def _salts(self, salt: str | None, options: list[PromptOptions]) -> list[str | None]:
        """Each prompt's prefix-reuse salt: its dict's ``cache_salt`` (vLLM's), else the call's ``salt``; the two given
        and different is refused, as the server refuses ``salt`` and ``cache_salt`` that differ."""
        out = []
        for i, said in enumerate(options):
            if said.cache_salt is None:
                out.append(salt)
                continue
            if salt is not None and said.cache_salt != salt:
                raise GenerationError(f"generate: prompt {i}: its cache_salt and the call's salt differ; give one (a "
                                      "prompt's cache_salt scopes that prompt, salt= every prompt of the call)")
            check_salt(said.cache_salt, f"prompt {i}: cache_salt")
            out.append(said.cache_salt)
        return out

    def _lives(self, call: int, items: list[tuple[str | None, list[int]]], params: list[SamplingParams],
               salts: list[str | None], arrivals: list[int], ranks: list[int] | None = None, *,
               pool: bool = False, every_token: bool = False) -> list[_Live]:
        """Every sample of every prompt as a request, with its generator (seeded as SamplingParams says); ``pool``:
        each an embedding's prefill (``Request.prefill_only``), its one token dropped; ``every_token``: its prompt
        computed whole (no cached prefix read), every token's row pooled."""
        lives = []
        # unseeded samples: a fresh base per call, or the next of the LLM's seeded sequence (vLLM's engine seed)
        random_base = (self.call_seeds or random.SystemRandom()).getrandbits(62)
        if self.lockstep is not None:
            random_base = self.lockstep.ranks.broadcast(random_base)  # one fresh seed, rank 0's, on every rank
        unseeded = 0  # unseeded samples drawn so far: each takes the next offset from random_base
        for i, ((text, ids), p) in enumerate(zip(items, params, strict=True)):
            room = self.max_seq_len - len(ids)  # a sequence never grows past max_seq_len
            base = p.seed if p.seed is not None else random_base
            parent = None
            for j in range(p.n):
                req_id = f"{call}.{i}" if p.n == 1 else f"{call}.{i}.{j}"
                # a scored prompt is prefilled whole by its first sample (a cached prefix computes no logits), whose
                # blocks are cached as any request's: the later samples, and later requests, reuse them
                cap = room if p.max_tokens is None else min(p.max_tokens, room)  # None: vLLM's "up to the context"
                request = Request(req_id, ids, 1 if pool else cap, salt=salts[i], prefill_only=pool,
                                  skip_prefix_read=(p.prompt_logprobs is not None and j == 0) or every_token,
                                  priority=ranks[i] if ranks is not None else 0)
                if j == 0:
                    self._check_fits(i, request, p.max_tokens)
                gen = None
                if not p.greedy:  # vLLM's rule: a seeded prompt's sample j is seed + j, whatever else the call holds
                    # (a prompt's samples do not change with its place in the batch); unseeded samples each draw on
                    # from the call's base, so no two share a stream
                    offset = j if p.seed is not None else unseeded
                    unseeded += p.seed is None
                    gen = torch.Generator(device=self.pools.device).manual_seed(base + offset)
                live = _Live(i, request, text, arrivals[i], gen, params=p, sample=j, parent=parent)
                if self.tokenizer is not None and p.detokenize:  # detokenize=False: token ids only, no decoding
                    live.text = SampleText(self.tokenizer, p.stop, include_stop=p.include_stop_str_in_output,
                                           skip_special=p.skip_special_tokens, spaced=p.spaces_between_special_tokens)
                if p.logprobs is not None:
                    live.logprobs = []
                if p.prompt_logprobs is not None and j == 0:
                    live.prompt_logprobs = [None] * len(ids)
                if p.structured_outputs is not None:  # each sample its own grammar state
                    live.constraint = self.grammars().constraint(p.structured_outputs,
                                                                 skip_special=p.skip_special_tokens)
                lives.append(live)
                parent = parent or live
        return lives

    def _stops(self, request: Request, token: int) -> bool:
        """The driver's stop hook: EOS (unless ignored), a stop token id, or a stop string in the text."""
        live = self._live[request.req_id]
        p = live.params
        if live.constraint is not None and live.constraint.advance(token):
            return True  # the grammar is complete (its end-of-sequence token taken, ignore_eos or not)
        if token in self.eos_token_ids and not p.ignore_eos:
            return True
        if token in p.stop_token_ids:
            live.stop_reason = token
            return True
        if p.stop:
            # the sample's last token (max_tokens or max_seq_len ends it next): decode it as final, so a stop string
            # completed by a token that also starts an unfinished character still ends it as "stop", not as a text
            # cut at the stop string under "length"
            hit = live.text.update(request.output_token_ids,
                                   final=at_length(request, self.manager.options.max_seq_len),
                                   search=len(request.output_token_ids) > p.min_tokens)
            if hit is not None:
                live.stop_reason = hit
                return True
        return False

    def _check_flex(self) -> None:
        """A compiled path that failed to build a shape is switched off, and the audit says why."""
        if self.flex is not None and self.flex.failed is not None:
            self._event(SettingIgnored(field="attention_backend", value="flex",
                                       reason=f"torch.compile failed ({self.flex.failed}); generate attends through "
                                              "gather + SDPA"))
            self.flex = None

    def _reuse_off(self) -> str | None:
        """Why the manager shares no prefix between requests, or None when prefix reuse is on."""
        off = getattr(self.manager, "reuse_off_reason", None)  # V2 says why (a layout that cannot be keyed, ...)
        return off or (None if self.manager.options.enable_block_reuse else "enable_block_reuse is false")

    def salt_ignored(self) -> str | None:
        """Why a reuse salt does nothing here (the manager shares no prefix between requests), or None when it
        scopes what is shared; ``generate`` and ``kvload serve`` report it as ``setting_ignored``."""
        off = self._reuse_off()
        return None if off is None else f"prefix reuse is off: nothing is shared to scope ({off})"

    def reset_prefix_cache(self, caller: str) -> tuple[bool, Event]:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``): (whether it did, the event that says so),
        for the caller to record (the serving loop's bus is its own thread's). A ``prefix_cache_reset`` when it did;
        a ``setting_ignored`` naming ``caller`` when it could not act: prefix reuse is off (nothing is cached), or
        requests still hold a cache (the manager's ``PrefixCacheInUseError``: their blocks may be cached)."""
        off = self._reuse_off()
        if off is not None:
            return False, SettingIgnored(field=caller, value=True,
                                         reason=f"prefix reuse is off: nothing is cached to forget ({off})")
        stats = self.manager.stats()
        cached = {name: g.evictable for name, g in stats.groups.items()}
        try:
            self.manager.reset_prefix_cache()
        except PrefixCacheInUseError as exc:
            return False, SettingIgnored(field=caller, value=True, reason=first_line(exc, "requests hold a cache"))
        self.prune_v4()  # every block went back to the free list: their snapshots go too
        return True, PrefixCacheReset(caller=caller, cached_blocks=cached)

    @contextlib.contextmanager
    def paged_attention(self) -> Iterator[None]:
        """kvload's paged attention for the block's forwards: routed per thread (``route_paged_attention``), so any
        other call of the model, from another thread or this one, keeps the model's own attention meanwhile."""
        if getattr(self.model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:  # else switched for good
            route_paged_attention(self.model)
        yield

    @contextlib.contextmanager
    def stream_stopped_by(self, stop: Callable[[], bool]) -> Iterator[None]:
        """While the block runs, ``stop()`` (rank 0's; the others' answer is not read) says at each step whether a
        stream's consumer left; every rank then raises ``StreamLeft`` after that step (see ``stream_stop``)."""
        self.stream_stop, self._stream_left = stop, False
        try:
            yield
        finally:
            self.stream_stop, self._stream_left = None, False

    # --- one step ----------------------------------------------------------------------------

    def _compute(self, out: SchedulerOutput) -> dict[str, int | list[int]]:
        """The step's forward: every scheduled chunk packed into one row; next tokens of requests that reach the end
        (with drafts: the drafts the model confirmed, then the token after them)."""
        logits, rows, counts = self.forward_scored(out, self._live)
        if not rows:
            return {}
        lives = [self._live[out.scheduled[i].request.req_id] for i in rows]
        if self._forks:
            logits, lives, counts = self._with_forks(out, rows, logits, lives, counts)
        # penalties and min_tokens pick from changed logits; logprobs stay the model's own (vLLM's raw_logprobs)
        picks = penalize(logits, counts, [(live.params, live.request) for live in lives], self.eos_token_ids)
        if any(live.constraint is not None for live in lives):
            overruled: list[Constraint] = []
            picks = constrain(picks, logits, counts, [(live.constraint, live.request.draft_token_ids)
                                                      for live in lives], self.grammars(), overruled)
            # one line per SamplingParams of the call, not per sample, prompt or step: a set per step said one
            # again for each step a sample sharing it (another prompt, another of its n) was first overruled in
            said, first = self._overruled_said, {id(c) for c in overruled}
            for live in (lv for lv in lives if id(lv.constraint) in first) if first else ():  # (most steps: none)
                for name, value, why in overruled_settings(live.params):
                    if (id(live.params), name) not in said:
                        said.add((id(live.params), name))
                        self._event(SettingIgnored(field=f"generate.{name}", value=value, reason=why))
        if len(logits) == len(lives):
            tokens: dict[str, int | list[int]] = dict(self._sample(picks, lives, logits))
        else:
            tokens = self._verify(picks, lives, counts, logits)
        if self.lockstep is not None and self.stream_stop is not None:
            tokens, self._stream_left = self.lockstep.ranks.broadcast((tokens, self.stream_stop()))
        elif self.lockstep is not None:
            tokens = self.lockstep.ranks.broadcast(tokens)  # rank 0's tokens: the next step's inputs everywhere
        return tokens

    def _with_forks(self, out: SchedulerOutput, rows: list[int], logits: Any, lives: list[_Live],
                    counts: list[int]) -> tuple[Any, list[_Live], list[int]]:
        """The step's rows plus one per sample forked from a first sample whose prompt this step completes: a copy of
        that sample's logits row, so every sample draws its first token from the one prefill (each with its own
        generator, penalties and grammar, as if it had prefilled itself)."""
        extra: list[int] = []  # logits row each forked sample draws from
        starts = list(itertools.accumulate(counts, initial=0))
        for k, i in enumerate(rows):
            chunk = out.scheduled[i]
            req = chunk.request
            if req.req_id in self._forks and req.num_computed_tokens + chunk.num_tokens >= req.num_prompt_tokens:
                kids = self._forks.pop(req.req_id)
                extra += [starts[k]] * len(kids)
                lives = [*lives, *kids]
        if not extra:
            return logits, lives, counts
        return torch.cat([logits, logits[extra]]), lives, [*counts, *[1] * len(extra)]

    def _verify(self, logits: Any, lives: list[_Live], counts: list[int], raw: Any) -> dict[str, int | list[int]]:
        """Speculative decoding: each request's drafts up to the first the model's argmax disagrees with, then the
        argmax after them (greedy), or kept and drawn as ``engine.speculation.verify_sampled`` says (sampled);
        requests without drafts sample as usual. ``logits`` pick (penalized), ``raw`` give the logprobs."""
        starts = list(itertools.accumulate(counts, initial=0))
        plain = [i for i, c in enumerate(counts) if c == 1]
        tokens: dict[str, int | list[int]] = {}
        if plain:
            rows = [starts[i] for i in plain]
            tokens.update(self._sample(logits[rows], [lives[i] for i in plain], raw[rows]))
        for i, _, kept in verify_drafted(logits, counts, [live.request.draft_token_ids for live in lives],
                                         [(live.params, live.generator) for live in lives]):
            live = lives[i]
            tokens[live.request.req_id] = kept
            if live.params.logprobs is not None:
                rows = raw[starts[i]:starts[i] + len(kept)]
                live.logprobs.extend(top_logprobs(rows, live.params.logprobs, kept))
        return tokens

    def forward_scored(self, out: SchedulerOutput, live: Mapping[str, Any]) -> tuple[Any, list[int], list[int]]:
        """:meth:`forward` where some requests score their prompt: each scheduled one whose live entry (its
        ``params``, ``request`` and ``prompt_logprobs`` list, None when not asked) is still in prefill has this step's
        prompt entries written into its list. ``generate`` and the serving loop share it."""
        scoring = {}
        for chunk in out.scheduled:  # only a scheduled chunk can score: the step's requests, not every live one
            lv = live.get(chunk.request.req_id)
            if lv is not None and lv.prompt_logprobs is not None and chunk.request.in_prefill:
                scoring[chunk.request.req_id] = lv.params.prompt_logprobs
        logits, rows, counts, scores = self.forward(out, live, scoring or None)
        for req_id, got in scores.items():
            live[req_id].prompt_logprobs[got.first:got.first + len(got.entries)] = got.entries
        return logits, rows, counts

    def forward(self, out: SchedulerOutput, live: Collection[str],
                scoring: Mapping[str, int] | None = None) -> tuple[Any, list[int], list[int], dict[str, PromptScores]]:
        """One packed forward of the scheduled chunks: ``(logits, rows, counts, scores)``. ``rows``: the indices in
        ``out.scheduled`` of the chunks that reach their request's last known token; ``counts``: how many logits rows
        each has, in order (1, or 1 + the drafts it computed: the row before each draft verifies it, the last gives
        the token after them); ``logits`` None when none reaches it. ``live``: the request ids whose block-table
        rows must be kept (the serving loop shares this with ``generate``). ``scoring``: request id → top
        alternatives, for requests whose prompt tokens are scored (``prompt_logprobs``): ``scores`` holds, per such
        request with prompt tokens in this step, (first position, its tokens' logprob entries) — the logits row after
        each prompt token gives the next one's entry."""
        chunks, rows, step_tables, keep, count = [], [], [], [], []
        need: list[int] = []  # of the kept rows, how many (the last ones) the step reads logits of
        scored: list[tuple[int, Request, int, int]] = []  # (chunk, request, first position, rows) of prompt scores
        store = self._block_tables
        for i, scheduled in enumerate(out.scheduled):
            req = scheduled.request
            start = req.num_computed_tokens
            end = start + scheduled.num_tokens
            known = req.num_tokens
            ids = req.token_span(start, min(end, known))
            if end > known:  # this chunk computes drafts after the last known token
                ids += req.draft_token_ids[:end - known]
            count.append(1 + max(0, end - known))
            # the rows after prompt tokens 0..P-2 give tokens 1..P-1's logprobs (token 0 has none)
            n_scored = min(end, req.num_prompt_tokens - 1) - start if scoring and req.req_id in scoring else 0
            if n_scored > 0:
                scored.append((i, req, start + 1, n_scored))
            # a row after every token: its logits for a scored prompt, its hidden state (the output projection's
            # input) for a per-token pooled one, whose logits no one reads (PooledRows.capture projects only `need`)
            need.append(max(count[-1], end - start) if n_scored > 0 else count[-1])
            if n_scored > 0 or (self.pooled and self.pooled.every_token(req.req_id)):
                keep.append(max(count[-1], end - start))
            else:
                keep.append(count[-1])
            chunks.append(SeqChunk(ids, start, {}))
            tables = self.manager.block_tables(req)  # every group's list, in self.groups order
            step_tables.append(tables)
            rows.append(store.update_all(req.req_id, tables))  # only what changed since the last step is written
        if len(store) > 2 * len(live) + 8:  # rows of requests finished in earlier steps go back
            store.keep_only(live)
        if self.lockstep is not None:  # before the forward's collectives: a divergence fails here, never hangs
            self.lockstep.check_schedule(out, [dict(zip(self.groups, t, strict=True)) for t in step_tables])
        batch = PagedBatch.build(chunks, self.pools, store.tables(rows), flex=self.flex,
                                 decode_kernel=self.decode_kernel)
        if any(k > 1 for k in keep):
            batch.keep_last(keep)
        if self.v4 is not None:
            self.v4.keep_only(live)  # a request that left (finished, aborted, preempted) takes its side state along
            self._v4_restore(out)
            step_states(batch, self.v4, [s.request.req_id for s in out.scheduled])
        offsets = list(itertools.accumulate(keep, initial=0))  # of the output projection's input rows
        # of the logits rows: the kept rows of each chunk but its unread per-token pooled ones
        select = [r for i in range(len(keep)) for r in range(offsets[i + 1] - need[i], offsets[i + 1])] \
            if need != keep else None
        at = list(itertools.accumulate(need, initial=0))
        # pooling requests: the output projection's input at the prompt's last token (embed, classify), or at each of
        # its tokens as the prompt's chunks are computed (reward)
        pooling = [(s.request.req_id, s.request.num_computed_tokens, offsets[i], offsets[i + 1], ends)
                   for i, s in enumerate(out.scheduled)
                   if self.pooled.wanted(s.request.req_id)
                   and ((ends := s.request.num_computed_tokens + s.num_tokens >= s.request.num_prompt_tokens)
                        or self.pooled.every_token(s.request.req_id))] \
            if self.pooled else []
        with self.linear.active() if self.linear is not None else contextlib.nullcontext(), \
                self.pooled.capture(self.model, pooling, select):
            logits = run_forward(self.model, batch)
        if self._v4_key is not None:
            self._v4_file(out)
        if self.v4 is not None and self._forks:  # the samples forked from a prompt just computed continue its state
            for s in out.scheduled:
                req = s.request
                if req.req_id in self._forks and req.num_computed_tokens + s.num_tokens >= req.num_prompt_tokens:
                    for kid in self._forks[req.req_id]:
                        self.v4.copy(req.req_id, kid.request.req_id)
        scores: dict[str, PromptScores] = {}
        for i, req, first, n in scored:
            block = logits[at[i]:at[i] + n]
            scores[req.req_id] = PromptScores(first, top_logprobs(block, scoring[req.req_id],
                                                                  req.prompt_token_ids[first:first + n]))
        reach = [i for i, s in enumerate(out.scheduled)
                 if s.request.num_computed_tokens + s.num_tokens >= s.request.num_tokens]
        if not reach:
            return None, [], [], scores
        counts = [count[i] for i in reach]
        if len(reach) < len(out.scheduled) or need != count:  # the (last count) logits rows of the chunks that reach
            # their end
            picked = [r for i in reach for r in range(at[i + 1] - count[i], at[i + 1])]
            logits = logits[picked]
        return logits, reach, counts, scores

    def _sample(self, logits: Any, lives: list[_Live], raw: Any) -> dict[str, int]:
        """Next token of each live request from its logits row, drawn as its SamplingParams say; logprobs kept (of
        ``raw``, the model's own logits, where ``logits`` are penalized)."""
        groups: dict[int, list[int]] = {}  # rows sharing one SamplingParams are warped together
        for row, live in enumerate(lives):
            groups.setdefault(id(live.params), []).append(row)
        tokens = [0] * len(lives)
        for rows in groups.values():
            params = lives[rows[0]].params
            whole = len(rows) == len(lives)
            block = logits if whole else logits[rows]
            picked = sample_rows(block, params, [lives[r].generator for r in rows])
            for r, token in zip(rows, picked, strict=True):
                tokens[r] = token
            if params.logprobs is not None:
                own = raw if whole else raw[rows]
                for r, entry in zip(rows, top_logprobs(own, params.logprobs, picked), strict=True):
                    lives[r].logprobs.append(entry)
        return {live.request.req_id: token for live, token in zip(lives, tokens, strict=True)}

    def _report_tokens(self, finished: list[Request], touched: list[_Live], samples: Mapping[int, list[_Live]],
                       outputs: dict[int, RequestOutput], on_delta: Callable[[TokenDelta], Any] | None) -> None:
        """After a step: first-token times, finished samples and prompts, ``on_delta`` for each new token, of the
        lives the step ``touched`` (``samples``: each prompt's, by its index)."""
        now = time.perf_counter()
        done = {r.req_id for r in finished}
        for live in touched:
            tokens = live.request.output_token_ids
            if live.logprobs is not None and len(live.logprobs) > len(tokens):  # confirmed drafts after a stop token
                del live.logprobs[len(tokens):]
            if len(tokens) == live.reported:  # no token this step (mid-prefill, waiting, or finished earlier)
                continue
            new = tokens[live.reported:]
            new_logprobs = live.logprobs[live.reported:] if live.logprobs is not None else None
            live.reported = len(tokens)
            if live.first_token_at is None:
                live.first_token_at = now
            ended = live.request.req_id in done
            if ended:
                live.finished_at = now
                live.finish_reason = live.request.finish_reason or "length"
            if live.text is not None:
                ids = tokens
                if (ended and live.finish_reason == "stop" and not isinstance(live.stop_reason, str)
                        and not live.params.include_stop_str_in_output):
                    ids = tokens[:-1]  # the EOS or stop token that ended it is not part of the text (vLLM: unless
                    # include_stop_str_in_output, which keeps it, decoded as any token: a special one shows only
                    # with skip_special_tokens false)
                if ended:
                    live.text.update(ids, final=True)
                elif on_delta is not None:
                    live.text.update(ids)
            output = None
            if ended and all(s.finish_reason is not None for s in samples[live.index]):
                output = outputs[live.index] = self._output(samples[live.index])
            if on_delta is not None:
                text = live.text.delta(final=ended) if live.text is not None else ""
                self._name_tokens(new_logprobs, live.params)
                on_delta(TokenDelta(live.index, live.sample, list(new), text, new_logprobs,
                                    live.finish_reason if ended else None,
                                    live.stop_reason if ended else None, output))

    def _name_tokens(self, entries: Sequence[Mapping[int, Any] | None] | None, params: SamplingParams) -> None:
        """vLLM's ``Logprob.decoded_token`` on each entry's values: the token's text with special tokens shown (the
        server's token text), decoded once per token id; left None without a tokenizer or with ``detokenize=False``."""
        if entries is None or self.tokenizer is None or not params.detokenize:
            return
        texts = self._token_texts
        for entry in entries:
            for token, logprob in (entry or {}).items():
                if isinstance(logprob, Logprob) and logprob.decoded_token is None:
                    text = texts.get(token)
                    if text is None:
                        text = texts[token] = self.tokenizer.decode([token], skip_special_tokens=False,
                                                                    clean_up_tokenization_spaces=False)
                    logprob.decoded_token = text

    def _output(self, samples: list[_Live]) -> RequestOutput:
        """The RequestOutput of one prompt whose samples all finished."""
        first = samples[0]
        completions = []
        for s in samples:
            req = s.request
            cumulative = sum(lp[t] for lp, t in zip(s.logprobs, req.output_token_ids, strict=True)) \
                if s.logprobs is not None else None
            # detokenize=False: "" as vLLM's text (a str); None only where the model has no tokenizer (a preset)
            text = s.text.text if s.text is not None else "" if self.tokenizer is not None else None
            completions.append(CompletionOutput(
                index=s.sample, text=text,
                token_ids=list(req.output_token_ids), cumulative_logprob=cumulative, logprobs=s.logprobs,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason))
        for s in samples:
            self._name_tokens(s.logprobs, s.params)
        self._name_tokens(first.prompt_logprobs, first.params)
        started = [s.first_token_at for s in samples if s.first_token_at is not None]
        end = max(s.finished_at for s in samples)
        first_token = min(started) if started else end
        admitted = [s.admitted_at for s in samples if s.admitted_at is not None]
        metrics = RequestMetrics(
            arrival_time=first.arrived_wall, queued_ts=first.queued_at,
            scheduled_ts=min(admitted) if admitted else first.queued_at, first_token_ts=first_token,
            last_token_ts=end, first_token_latency=first_token - first.queued_at,
            num_generation_tokens=sum(len(s.request.output_token_ids) for s in samples))
        return RequestOutput(
            request_id=first.request.req_id.rsplit(".", 1)[0] if first.params.n > 1 else first.request.req_id,
            prompt=first.prompt, prompt_token_ids=list(first.request.prompt_token_ids), outputs=completions,
            prompt_logprobs=first.prompt_logprobs,
            computed_prompt_tokens=sum(s.request.num_prompt_tokens - s.request.num_cached_tokens for s in samples),
            reused_prompt_tokens=sum(s.request.num_cached_tokens for s in samples),
            timings=GenerationTimings(first_token_s=first_token - first.queued_at, total_s=end - first.queued_at),
            metrics=metrics, num_cached_tokens=first.request.num_cached_tokens)

    # --- checks and bookkeeping ----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._stopped is not None:
            raise GenerationError(self._stopped)
        if getattr(self.manager, "closed", False) or self.pools.released:
            raise GenerationError("generate: this result was closed (LoadResult.close released its KV pools and "
                                  "weights); load the model again")

    def _prompts(self, prompts: Any, chat: bool | Mapping[str, Any], checked: bool = True,
                 options: list[PromptOptions] | None = None) -> list[tuple[str | None, list[int]]]:
        """Each prompt as (text or None, token ids), validated (``engine.prompts.normalize`` says what is taken).

        ``chat``: true, or the chat template's options (``engine.prompts.template_options``, from ``LLM.chat``);
        a chat prompt's text is the templated text. ``checked=False`` leaves the ids' checks (empty, vocabulary,
        length) to :meth:`_check_items`, for a caller that cuts the prompts first. ``options``: a list to fill with
        what each vLLM prompt dict says beside its prompt (its salt; a TokensPrompt's text is the item's text); None:
        a dict's ``cache_salt`` is refused (``engine.prompts.normalize``)."""
        template = dict(chat) if isinstance(chat, Mapping) else {}
        items: list[tuple[str | None, list[int]]] = []
        said: list[PromptOptions] = [] if options is None else options
        for i, prompt in enumerate(normalize(prompts, said, take_salt=options is not None)):
            if isinstance(prompt, str):
                if chat:
                    check_text(f"prompt {i}", prompt)
                    items.append(self._converse(i, [{"role": "user", "content": prompt}], template))
                else:
                    items.append((prompt, self._tokenize(i, prompt)))
                continue
            if is_conversation(prompt):
                if not chat:
                    raise GenerationError(f"generate: prompt {i}: a conversation (a list of messages) needs "
                                          "chat=True (or LLM.chat)")
                items.append(self._converse(i, prompt, template))
                continue
            if chat:
                raise GenerationError(f"generate: prompt {i}: chat=True needs text prompts, got token ids")
            items.append((said[i].text, prompt))  # a TokensPrompt's own text, if it gave one (vLLM's)
        return self._check_items(items) if checked else items

    def _check_items(self, items: list[tuple[str | None, list[int]]], *, pool: bool = False,
                     what: str | None = None) -> list[tuple[str | None, list[int]]]:
        """``items`` unchanged once every prompt's ids are non-empty, in the vocabulary and leave room to generate
        (``pool``, an embedding's: fit in ``max_seq_len``, vLLM's ``max_model_len``, nothing being generated).
        ``what``: the pooled request as the refusal names it; None: as the call running names it (:data:`POOLED`)."""
        what = what or POOLED.get(self._caller, POOLED["embed"])
        for i, (_, ids) in enumerate(items):
            if not ids:
                raise GenerationError(f"generate: prompt {i}: empty (no tokens)")
            self._check_vocab(f"prompt {i}", ids)
            if pool and len(ids) > self.max_seq_len:
                raise GenerationError(f"generate: prompt {i}: {len(ids)} tokens; {what} takes at most "
                                      f"max_seq_len={self.max_seq_len} (vLLM's max_model_len); shorten it, keep its "
                                      "last tokens (truncate_prompt_tokens) or raise max_seq_len")
            if not pool and len(ids) >= self.max_seq_len:
                raise GenerationError(f"generate: prompt {i}: {len(ids)} tokens leave no room to generate under "
                                      f"max_seq_len={self.max_seq_len}; shorten it or raise max_seq_len")
        return items

    def _truncated(self, items: list[tuple[str | None, list[int]]], params: list[SamplingParams],
                   notes: list[tuple[str, Any, str]] | None = None, *,
                   pool: bool = False) -> list[tuple[str | None, list[int]]]:
        """Each prompt's ids cut to the last ``truncate_prompt_tokens`` of its SamplingParams (vLLM's left truncation,
        a BOS included; the text stays as given, as vLLM's ``RequestOutput.prompt`` does); a k past ``max_seq_len``
        (vLLM's ``max_model_len``) is refused, as vLLM's is. A cut to ``max_seq_len`` tokens keeps one fewer, leaving
        room for the one token vLLM generates there (a sequence never grows past ``max_seq_len`` here), which is what
        -1 asks for; ``notes`` gets a (field, value, reason) for each prompt a k of ``max_seq_len`` cut so. ``pool``
        (an embedding's prefill, which generates nothing): -1 and k = ``max_seq_len`` keep ``max_seq_len`` tokens."""
        out, short = [], []
        for i, ((text, ids), p) in enumerate(zip(items, params, strict=True)):
            keep = p.truncate_prompt_tokens
            if keep is None:
                out.append((text, ids))
                continue
            if keep == -1:  # vLLM's -1, "cap at the model's max length": here one token short of it (below)
                keep = self.max_seq_len if pool else self.max_seq_len - 1
            elif keep > self.max_seq_len:  # vLLM's _validate_truncation_size refuses it too
                raise GenerationError(f"generate: truncate_prompt_tokens: {int_text(keep)} is greater than "
                                      f"max_seq_len (vLLM's max_model_len) {self.max_seq_len}; use at most "
                                      f"{self.max_seq_len} (or -1 for that many)")
            if not pool and len(ids) >= self.max_seq_len and keep >= self.max_seq_len:
                keep = self.max_seq_len - 1
                short.append(i)
            out.append((text, ids[-keep:] if len(ids) > keep else ids))
        if short and notes is not None:  # one line for the call, however many prompts
            which = f"prompt {short[0]}" if len(short) == 1 else f"{len(short)} prompts (the first: {short[0]})"
            notes.append(("truncate_prompt_tokens", self.max_seq_len,
                          f"{which} kept the last {self.max_seq_len - 1} tokens, not {self.max_seq_len}: a sequence "
                          f"never grows past max_seq_len={self.max_seq_len}, so one token is left to generate "
                          "(vLLM keeps max_model_len tokens and generates one past it)"))
        return out

    def _tokenize(self, i: int, text: str) -> list[int]:
        check_text(f"prompt {i}", text)  # a lone surrogate would reach the tokenizer as a TypeError
        return [int(t) for t in self._text_tokenizer(i)(text)["input_ids"]]

    def _text_tokenizer(self, i: int) -> Any:
        """The tokenizer for text prompt ``i``; ``GenerationError`` when the model has none."""
        if self.tokenizer is None:
            raise GenerationError(f"generate: prompt {i} is text, but {self.name} has no tokenizer (presets have "
                                  "random weights and none); pass token ids instead")
        return self.tokenizer

    def _converse(self, i: int, messages: Any, template: Mapping[str, Any]) -> tuple[str, list[int]]:
        """A conversation through the chat template (the tokenizer's, or ``template["chat_template"]``): (the
        templated text, its token ids)."""
        return templated(self.tokenizer, self.name, f"prompt {i}", check_messages(f"prompt {i}", messages), template)

    @staticmethod
    def _arrivals(arrival_steps: Sequence[int] | None, n: int) -> list[int]:
        if arrival_steps is None:
            return [0] * n
        steps = list(arrival_steps)
        if len(steps) != n or not all(is_int(s) and s >= 0 for s in steps):
            raise GenerationError(f"generate: arrival_steps: expected {n} integers >= 0 (one per prompt), "
                                  f"got {arrival_steps!r}")
        return steps

    def priority_refusal(self, value: Any) -> str | None:
        """Why a user's (vLLM-signed) ``priority`` is refused, or None: an integer within int64, and under the "fcfs"
        policy only 0 (vLLM's rule: "priority scheduling is not enabled")."""
        if not is_int(value) or abs(value) > MAX_INT:
            return f"expected an integer (at most 2**63 - 1 in size), got {short(value)}"
        if value != 0 and not getattr(self.scheduler, "by_priority", False):
            return (f"got priority {value} but priority scheduling is not enabled (scheduling_policy is \"fcfs\"); "
                    "load with scheduling_policy=\"priority\" (--scheduling_policy priority) or send 0")
        return None

    def _priorities(self, priority: Sequence[int] | None, n: int) -> list[int] | None:
        """vLLM's ``priority`` list (lower first) as kvload's ranks (higher first: each value negated); None: all 0."""
        if priority is None:
            return None
        priority = array_ints(priority)  # a 1-D integer array, as a prompt's ids may be (it was refused whole)
        if isinstance(priority, (str, bytes)) or not isinstance(priority, Sequence) or len(priority) != n:
            raise GenerationError(f"generate: priority: expected a list of {n} integers (one per prompt), "
                                  f"got {short(priority)}")
        priority = [plain_scalar(v) for v in priority]  # a 0-d torch tensor item as an int, as numpy's int64 is
        for i, value in enumerate(priority):
            why = self.priority_refusal(value)
            if why is not None:
                raise GenerationError(f"generate: priority[{i}]: {why}")
        return [-int(v) for v in priority]

    def _check_fits(self, index: int, request: Request, asked: int | None = None) -> None:
        """``KvBuildError`` when a request could not complete even alone in empty pools (it would never run).

        ``asked``: the max_new_tokens the caller gave, when max_seq_len cut it to the request's (the
        message quotes what was sent, then the cut).
        """
        short = self.manager.layout.sequence_shortfall(request.max_total_tokens, self.pools.num_blocks)
        if short is not None:  # a shared arena: every group's blocks together
            where, need, have = short
            length = "nothing generated" if request.prefill_only else f"max_new_tokens {request.max_new_tokens}"
            if asked is not None and asked > request.max_new_tokens:
                length = (f"max_new_tokens {asked} (cut to {request.max_new_tokens} by "
                          f"max_seq_len={self.max_seq_len})")
            prompt = request.num_prompt_tokens
            fits = self.manager.layout.longest_sequence(self.pools.num_blocks, request.max_total_tokens - 1)
            if fits <= prompt:  # not one new token fits after this prompt: max_new_tokens cannot help
                advice = f"or shorten the prompt (the pools hold one sequence of {fits:,} tokens)"
            else:
                advice = f"or lower max_new_tokens to at most {fits - prompt:,}"
            shortfall = f"{prompt} prompt tokens + {length} need {need} blocks of {where} but the KV pools hold {have}"
            exc = KvBuildError(f"generate: prompt {index}: {shortfall}; raise kv_cache_config.max_tokens "
                               f"(--max_tokens) {advice}")
            # the parts, for a face that words its own advice (the server: a client cannot raise --max_tokens)
            exc.shortfall, exc.longest_sequence = shortfall, fits
            raise exc

    def _v4_reusable(self, request: Request, m: int, block: int) -> bool:
        """The manager's :meth:`limit_reuse` check: whether the side state of ``request``'s first ``m`` tokens was
        snapshotted with the window-group ``block`` that ends there (DeepSeek V4)."""
        assert self.v4 is not None and self._v4_key is not None
        if block < 0:
            return False
        gen = self.manager.block_life(self._v4_key, block)[0]
        return self.v4.snapshots.get(block, gen, m, lambda: prefix_digest(request.salt, request.token_span(0, m))) \
            is not None

    def _v4_moved(self, group: str, pairs: list[tuple[int, int]]) -> None:
        """The manager moved ``group``'s blocks (a slab arena's compaction): the snapshots kept with them follow."""
        assert self.v4 is not None
        if group == self._v4_key:
            self.v4.snapshots.move(pairs, lambda b: self.manager.block_life(group, b)[0])

    def _v4_restore(self, out: SchedulerOutput) -> None:
        """A request that continues a reused prefix (no side state at its start) gets it back from the snapshot the
        manager's check found (DeepSeek V4)."""
        assert self.v4 is not None
        states, key = self.v4.states, self._v4_key
        for s in out.scheduled:
            req = s.request
            start = req.num_computed_tokens
            state = states.get(req.req_id)
            if not start or key is None or (state is not None and state.pos == start):
                continue
            block = self.manager.block_table(req, key)[start // self.v4.snapshots.T - 1]
            if block < 0:
                continue
            snap = self.v4.snapshots.get(block, self.manager.block_life(key, block)[0], start,
                                         lambda r=req, n=start: prefix_digest(r.salt, r.token_span(0, n)))
            if snap is not None:  # else V4States.for_step says, in one line, that the state cannot be rebuilt
                self.v4.restore(req.req_id, snap)

    def _v4_file(self, out: SchedulerOutput) -> None:
        """Keep the snapshots a step took at reuse boundaries, each with the window-group block that ends there."""
        assert self.v4 is not None and self._v4_key is not None
        key, T = self._v4_key, self.v4.snapshots.T
        for s in out.scheduled:
            req = s.request
            state = self.v4.states.get(req.req_id)
            if state is None or not state.captured:
                continue
            table = self.manager.block_table(req, key)
            for pos, layers in state.captured.items():
                block = table[pos // T - 1]
                if block >= 0:
                    self.v4.snapshots.put(block, self.manager.block_life(key, block)[0],
                                          V4Snapshot(pos, prefix_digest(req.salt, req.token_span(0, pos)), layers))
            state.captured = {}

    def prune_v4(self) -> None:
        """Drop the DeepSeek V4 snapshots whose block left the prefix cache (after each step, and a reset)."""
        if self.v4 is not None and self._v4_key is not None and self.v4.snapshots.by_block:
            key = self._v4_key
            self.v4.snapshots.prune(lambda b: self.manager.block_life(key, b))

    def _drop_v4(self, lives: Iterable[_Live]) -> None:
        """Drop the side state of a call's requests (DeepSeek V4), finished or not."""
        if self.v4 is not None:
            for live in lives:
                self.v4.free(live.request.req_id)
            self.prune_v4()  # a call that failed freed its requests' blocks after its last step: their snapshots go

    def _counters(self) -> dict[str, int]:
        stats = self.manager.stats()
        return {"suspends": stats.suspends, "resumes": stats.resumes, "preemptions": stats.preemptions}

    def _abort(self, driver: Driver) -> None:
        """Free every request of a failed call, so the pools hold nothing of it."""
        for req in [*driver.running, *driver.waiting]:
            if not req.is_finished:
                with contextlib.suppress(Exception):  # freeing must not hide the original error
                    self.scheduler.finish(req, "aborted")
        driver.running.clear()
        driver.waiting.clear()

    def _event(self, event: Event) -> None:
        if self._emit is not None:
            self._emit(event)

    def _driver_event(self, event: Event) -> None:
        """The driver's events, passed on; a request's first admission is timed (``RequestMetrics.scheduled_ts``)."""
        if isinstance(event, RequestAdmitted):
            live = self._live.get(event.req_id)
            if live is not None and live.admitted_at is None:
                live.admitted_at = time.perf_counter()
        self._event(event)


def _flat(out: RequestOutput) -> GenerationOutput:
    """The one-sample GenerationOutput form of a RequestOutput (``LoadResult.generate``'s shape)."""
    c = out.outputs[0]
    return GenerationOutput(
        index=int(out.request_id.rsplit(".", 1)[-1]), req_id=out.request_id, prompt=out.prompt,
        prompt_token_ids=out.prompt_token_ids, token_ids=c.token_ids, text=c.text, finish_reason=c.finish_reason,
        reused_prompt_tokens=out.reused_prompt_tokens, timings=out.timings, stop_reason=c.stop_reason,
        logprobs=c.logprobs)



class RankLockstep:
    """Tensor parallel: every rank's scheduler must decide the same; the sampled tokens are rank 0's.

    The schedulers are deterministic and get identical inputs (agreed args, min-reduced pools, the same
    prompts, rank 0's tokens), so their decisions match; :meth:`check_schedule` proves it each step
    before the forward's collectives run, so a divergence fails every rank with one line instead of
    hanging them or mixing different batches' activations.
    """

    def __init__(self, ranks: Any) -> None:
        self.ranks = ranks
        self.steps = 0

    def check_schedule(self, out: SchedulerOutput, tables: list[Any]) -> None:
        """All-gather this step's decision (requests, chunk sizes, block tables); raise if any rank differs."""
        decision = [(s.request.req_id, s.request.num_computed_tokens, s.num_tokens, t)
                    for s, t in zip(out.scheduled, tables, strict=True)]
        everyone = self.ranks.all_gather(decision)
        self.steps += 1
        if any(d != everyone[0] for d in everyone[1:]):
            other = next(r for r, d in enumerate(everyone) if d != everyone[0])
            def brief(d: list[Any]) -> str:
                return ", ".join(f"{req} +{n}" for req, _, n, _ in d) or "nothing"

            raise KvRuntimeError(f"generate: step {self.steps}: the ranks' schedulers diverged: rank {other} scheduled "
                                 f"{brief(everyone[other])} (or other blocks), rank 0 {brief(everyone[0])}")


__all__ = ["GenerationExecutor", "Prompt", "RankLockstep"]
