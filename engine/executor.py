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

The class holds the life cycle (build, attention and linear backends, the call's loop, failures and the audit);
the rest comes from parts, one module per concern: ``engine.call_requests`` (a call's prompts and SamplingParams
checked and made live requests), ``engine.step_forward`` (a step's forward, drafts verified, tokens sampled),
``engine.step_outputs`` (new tokens reported, finished prompts' outputs) and ``engine.v4_side_state`` (DeepSeek
V4's compressor snapshots).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from cache_backends.block_tables import BlockTableStore
from cache_backends.interface import PrefixCacheInUseError, SchedulerOutput
from cache_backends.layout import DECODE_KERNEL_KINDS, cannot_generate
from cache_backends.request import Request
from engine.call_requests import CallRequests
from engine.driver import Arrival, Driver, StalledError
from engine.live_sample import LiveSample
from engine.outputs import (
    GenerationOutput,
    GenerationStats,
    RequestOutput,
    StreamEvent,
    TokenDelta,
)
from engine.pooling import PooledRows
from engine.prompts import (
    CHAT_OPTIONS,
    PromptOptions,
    template_options,
)
from engine.sampling import eos_token_ids
from engine.sampling_params import (
    SamplingParams,
    check,
    check_salt,
    defaulted_fields,
    greedy_ignored,
    inert_settings,
    is_int,
)
from engine.speculation import NgramProposer
from engine.step_forward import StepForward
from engine.step_outputs import StepOutputs
from engine.structured import GrammarBackend
from engine.v4_side_state import V4SideState
from models.deepseek_v4_paged import V4_NO_DRAFTS, V4States, uses_v4
from models.geometry import head_dim as config_head_dim
from models.geometry import kv_heads as config_kv_heads
from models.geometry import text_config
from models.paged_forward import ATTN_IMPLEMENTATION, route_paged_attention, unfoldable_mla
from pipeline.config import ATTENTION_BACKENDS, AUTO, LINEAR_BACKENDS
from pipeline.errors import GenerationError, KvRuntimeError, first_line, retitled
from pipeline.events import (
    Event,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    PrefixCacheReset,
    RequestAdmitted,
    SettingIgnored,
)
from pipeline.limits import MAX_DRAFT_LEN, MAX_INT, MAX_NGRAM, plain_flag, short_py

#: A prompt: text (needs a tokenizer) or token ids.
Prompt = str | Sequence[int]


@attrs.define
class _StepTally:
    """A call's figures summed over its steps: forward and KV seconds, drafted and accepted tokens."""

    forward_s: float = 0.0
    kv_s: float = 0.0
    drafted: int = 0
    accepted: int = 0
    per_position: list[int] = attrs.Factory(list)  # accepted drafts per draft position

    def add(self, st: Any) -> None:
        """Add one step's :class:`~engine.driver.StepStats`."""
        self.forward_s += st.compute_seconds
        self.kv_s += st.kv_seconds
        self.drafted += st.draft_tokens
        self.accepted += st.accepted_draft_tokens
        for i, n in enumerate(st.accepted_per_position):
            if i == len(self.per_position):
                self.per_position.append(0)
            self.per_position[i] += n


def _chat_option(chat: Any) -> bool | dict[str, Any]:
    """``run``'s ``chat``: a flag, or ``LLM.chat``'s template options, checked once before any work."""
    if isinstance(chat, Mapping):
        unknown = sorted(set(chat) - CHAT_OPTIONS)
        if unknown:
            raise GenerationError(f"chat: unknown template option {unknown[0]!r}; known: "
                                  f"{', '.join(sorted(CHAT_OPTIONS))}")
        return template_options(**chat)
    chat = plain_flag(chat)  # numpy's bool (a 0-d bool tensor) as Python's, as the other flags
    check(isinstance(chat, bool), "chat", "true or false, or LLM.chat's template options", chat)
    return chat


class StreamLeft(GenerationError):
    """A stream's consumer on rank 0 left: raised on every rank after the same step (``stream_stop``)."""


class GenerationExecutor(CallRequests, StepForward, StepOutputs, V4SideState):
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
        self._live: dict[str, LiveSample] = {}
        self._forks: dict[str, list[LiveSample]] = {}  # run's: a prompt's samples forked from its first one
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
                                  f"got {short_py(backend)}")
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
                                  f"got {short_py(backend)}")
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
                raise GenerationError(f"generate: {name}: expected an integer from {least} to {most}, "
                                      f"got {short_py(value)}")
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
        ``generation_failed`` message is titled as the error the caller raises
        (``kvload.llm_calls.errors_titled``)."""
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
        chat = _chat_option(chat)
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
        tally = _StepTally()
        self._live = {live.request.req_id: live for live in lives}
        self._overruled_said = set()  # (the call's params live until it ends: their ids are not reused before)
        # a prompt's index -> its samples, a first sample's request id -> the samples forked from it, each live's place:
        # a step's report reads the lives the step touched through these. It scanned every live of the call per step
        # and per finished request, O(requests**2): 16,000 one-token prompts took 16.6 s, 5.4 s now (2-core CPU)
        samples: dict[int, list[LiveSample]] = {}
        for live in lives:
            samples.setdefault(live.index, []).append(live)
        family = {first: list(kids) for first, kids in forks.items()}
        place = {live.request.req_id: i for i, live in enumerate(lives)}

        def queued(request: Request, clock: int) -> None:
            live = self._live[request.req_id]
            live.queued_at, live.arrived_wall = time.perf_counter(), time.time()

        def stepped(clock: int, st: Any) -> None:
            tally.add(st)
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
            self._announce(call, lives, items, params, per_prompt, defaulted, cut_notes, salt, salts, options)
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
            self._end_call(lives)
            self._check_flex()
            self._event(GenerationFailed(call=call, error=type(exc).__name__,
                                         message=retitled(first_line(exc, ""), self._caller),
                                         finished=len(outputs)))
            raise
        self._end_call(lives)
        # compiling a new attention shape is a one-off (later calls reuse it): reported apart, not as generation
        warmup = (self.flex.warmup_s if self.flex is not None else 0.0) - warm_before
        self._check_flex()
        wall = time.perf_counter() - start - warmup
        ordered = [outputs[i] for i in range(len(items))]
        self._finish(call, ordered, len(lives), run.engine_steps, wall, warmup, tally, before)
        return ordered

    def _announce(self, call: int, lives: list[LiveSample], items: list[tuple[str | None, list[int]]],
                  params: list[SamplingParams], per_prompt: bool, defaulted: list[str],
                  cut_notes: list[tuple[str, Any, str]], salt: str | None, salts: list[str | None],
                  options: list[PromptOptions]) -> None:
        """``generation_started``, then a ``setting_ignored`` for each setting the call takes that can do nothing."""
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

    def _end_call(self, lives: list[LiveSample]) -> None:
        """What a call holds past its driver let go, whether it finished or failed: its lives and forks, the
        proposer's n-grams, the block tables, DeepSeek V4's side state."""
        self._live, self._forks = {}, {}
        if self.proposer is not None:
            self.proposer.clear()
        self._block_tables.keep_only(())
        self._drop_v4(lives)

    def _finish(self, call: int, ordered: list[RequestOutput], samples: int, steps: int, wall: float, warmup: float,
                tally: _StepTally, before: dict[str, int]) -> None:
        """The finished call's :class:`GenerationStats` (``last_stats``) and its ``generation_finished``."""
        after = self._counters()
        stats = GenerationStats(
            requests=len(ordered),
            prompt_tokens=sum(o.computed_prompt_tokens + o.reused_prompt_tokens for o in ordered),
            reused_prompt_tokens=sum(o.reused_prompt_tokens for o in ordered),
            generated_tokens=sum(len(c.token_ids) for o in ordered for c in o.outputs), steps=steps, wall_s=wall,
            forward_s=max(0.0, tally.forward_s - warmup), kv_s=tally.kv_s, warmup_s=warmup,
            **{k: after[k] - before[k] for k in after}, samples=samples, draft_tokens=tally.drafted,
            accepted_draft_tokens=tally.accepted, accepted_per_position=tuple(tally.per_position))
        self.last_stats = stats
        self._event(GenerationFinished(
            call=call, requests=stats.samples, prompt_tokens=stats.prompt_tokens,
            reused_prompt_tokens=stats.reused_prompt_tokens, generated_tokens=stats.generated_tokens, steps=steps,
            suspends=stats.suspends, resumes=stats.resumes, preemptions=stats.preemptions,
            duration_ms=round(wall * 1000, 3), tokens_per_s=round(stats.tokens_per_s, 3),
            draft_tokens=tally.drafted, accepted_draft_tokens=tally.accepted))

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


    def _check_flex(self) -> None:
        """A compiled path that failed to build a shape is switched off, and the audit says why."""
        if self.flex is not None and self.flex.failed is not None:
            self._event(SettingIgnored(field="attention_backend", value="flex",
                                       reason=f"torch.compile failed ({self.flex.failed}); generate attends through "
                                              "gather + SDPA"))
            self.flex = None


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


    # --- checks and bookkeeping ----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._stopped is not None:
            raise GenerationError(self._stopped)
        if getattr(self.manager, "closed", False) or self.pools.released:
            raise GenerationError("generate: this result was closed (LoadResult.close released its KV pools and "
                                  "weights); load the model again")


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
