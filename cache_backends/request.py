"""A generation request as the KV managers and schedulers see it."""

from __future__ import annotations

import enum

import attrs

#: Scheduling policies (vLLM's names): ``"fcfs"`` admits in arrival order; ``"priority"`` admits best-ranked first
#: (:func:`rank`) and lets V2 move out a worse-ranked running request for a better-ranked waiting one.
SCHEDULING_POLICY_NAMES: tuple[str, ...] = ("fcfs", "priority")


class RequestState(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"  # not admitted yet, or sent back by a scheduler (V1 preemption)
    RUNNING = "running"  # holds device blocks; scheduled every step until finished
    SUSPENDED = "suspended"  # V2 only: its pages live in the host tier until resumed
    FINISHED = "finished"


@attrs.define(eq=False)
class Request:
    """Token ids in and out, plus the bookkeeping a scheduler needs.

    ``num_computed_tokens`` counts the tokens of ``all_token_ids`` whose KV is in the cache (reused
    prefix included). It only advances through the manager's ``commit``. A step computes KV for
    ``all_token_ids[num_computed_tokens : num_computed_tokens + n]``.

    The request owns its token ids: the prompt is copied at construction (a caller reusing its list changes
    nothing here) and generated tokens are only ever appended, so the tokens of a block stay what its KV was
    computed from — a KV manager reads a request's tokens after it let go (V2's lazily keyed prefixes).
    """

    req_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    #: higher is more important (vLLM's sign is the opposite: its ``priority=v`` is ``-v`` here, converted where a
    #: user's value comes in); the V2 scheduler suspends the lowest first, V2 eviction drops its blocks first, and the
    #: "priority" scheduling policy admits the highest first (under "fcfs" admission is by arrival)
    priority: int = 0
    salt: str | None = None  # reuse scope: requests with different salts never share blocks
    #: read no cached prefix: admission claims nothing and the whole prompt is computed (a prompt whose tokens are
    #: scored needs every position's logits, which a cache hit skips); its full blocks are still cached under
    #: ``salt`` for later requests (vLLM's ``skip_reading_prefix_cache``)
    skip_prefix_read: bool = False
    #: an embedding's prefill (``LLM.embed``, ``/v1/embeddings``): the one token its logits give is dropped as it is
    #: drawn, its KV never written, so its prompt may fill ``max_seq_len`` (vLLM's ``max_model_len`` for pooling)
    #: and its blocks are those of its prompt alone
    prefill_only: bool = False
    arrival: int = 0  # admission order tie-breaker (later arrivals are suspended first)
    output_token_ids: list[int] = attrs.Factory(list)
    state: RequestState = RequestState.WAITING
    num_computed_tokens: int = 0
    num_reused_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (or a fork of a sibling's prefill)
    finish_reason: str | None = None
    #: speculative decoding: guessed next tokens, after the known ones. A scheduler may compute their KV in the step
    #: that computes the last known token (:meth:`SchedulerBase.extend_with_drafts`); the driver keeps the KV of those
    #: the model confirms (they become output tokens) and the rest is never read — drafts never enter
    #: ``all_token_ids`` unconfirmed.
    draft_token_ids: list[int] = attrs.Factory(list)
    #: V2's cache-aware admission: the cached prefix (tokens) found when the scheduler first saw the request waiting,
    #: and the scheduler step it first saw it (-1: not yet)
    cached_hint: int = -1
    queued_at: int = -1
    #: written by a preemption (V2), which resets ``num_computed_tokens`` and ``num_reused_tokens``: the most tokens it
    #: had computed, until a later step computes them again (the driver counts those as recomputed), and the prompt
    #: tokens its first admission reused (None: never preempted)
    lost_tokens: int = 0
    first_reused_tokens: int | None = None
    #: V2's prefix lookups: the leading token ids packed as block keys encode them (``hashing.pack_tokens``), kept
    #: between lookups (a waiting request is looked up every step); still right later, as tokens are only appended
    packed_ids: bytes = attrs.field(default=b"", init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        # its own copy (see above); here, not an attrs converter: a converter makes attrs check every attribute
        # write of the class (a custom __setattr__), and a running request's counters are written every step
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.req_id}: empty prompt")
        if self.max_new_tokens < 0:
            raise ValueError(f"request {self.req_id}: max_new_tokens must be >= 0")

    @property
    def rank(self) -> tuple[int, int]:
        """Sort key, best first: higher priority, then earlier arrival (vLLM's ``(priority, arrival_time)``)."""
        return (-self.priority, self.arrival)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens reused when first admitted (vLLM's ``num_cached_tokens``): after a preemption the
        re-admission finds the request's own prefix cached, which is not a hit its prompt earned."""
        return self.num_reused_tokens if self.first_reused_tokens is None else self.first_reused_tokens

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then generated tokens."""
        return self.prompt_token_ids + self.output_token_ids

    def token_span(self, lo: int, hi: int) -> list[int]:
        """``all_token_ids[lo:hi]`` (0 <= lo <= hi) without joining prompt and output: O(hi - lo), not O(num_tokens)."""
        split = len(self.prompt_token_ids)
        if hi <= split:
            return self.prompt_token_ids[lo:hi]
        if lo >= split:
            return self.output_token_ids[lo - split:hi - split]
        return self.prompt_token_ids[lo:] + self.output_token_ids[:hi - split]

    @property
    def num_tokens(self) -> int:
        """Length of :attr:`all_token_ids`."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_drafts(self) -> int:
        """Known tokens plus drafts: how far a step may compute this request."""
        return self.num_tokens + len(self.draft_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def in_prefill(self) -> bool:
        """Whether prompt tokens are still waiting for their KV."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request can ever hold KV for (worst case for no-evict admission)."""
        return self.num_prompt_tokens + (0 if self.prefill_only else self.max_new_tokens)

    @property
    def is_finished(self) -> bool:
        """Whether the request finished."""
        return self.state is RequestState.FINISHED
