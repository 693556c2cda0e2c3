"""``KVCacheV2Scheduler``: admission with headroom for growth, suspend-to-host under pressure, resume later.

One :meth:`~KVCacheV2Scheduler.step`:

1. **Running requests**, ranked by priority (high first) then arrival (early first); decodes (one
   pending token) before prefill chunks, within ``max_num_tokens`` tokens. A prefill chunk shrinks
   to what fits. When even one token does not fit, the *lowest-ranked* running request is moved
   out — suspended to the host tier (``SchedulerOutput.suspended``) or, when the host tier is
   absent or full, preempted for recompute (``preempted``: its blocks stay in the prefix cache, so
   the recompute mostly reuses them) — and its chunk, if it had one this step, is withdrawn. This
   repeats until the chunk fits or the request itself is the lowest-ranked one, which then goes.
   A request that reached ``max_seq_len`` is not scheduled again (its driver must finish it, reason
   ``"length"``); one that has outgrown its worst case so far that it could not grow even alone
   (only a driver that feeds it past ``max_new_tokens`` does that) is preempted for good — it waits
   in ``waiting``, skipped like any never-fitting request — so it never pushes the others out.
2. If nobody had to move out this step: **resume** suspended requests, best-ranked first, while
   the batch and the token budget have room and the manager accepts (room for the pages and the
   next token, ``max_util_for_resume``); then, once none is left suspended, **admit** waiting
   requests first come first served while the batch has room and their first chunk fits.
   Under ``scheduling_policy="fcfs"`` (the default) priority orders suspensions only; admission never displaces a
   running request and is first come first served but **cache-aware**: of the first ``LPM_WINDOW`` waiting requests,
   those with the longest cached prefix of at least ``LPM_MIN_HIT`` tokens go first, ties in arrival order (SGLang's
   default longest-prefix-match policy), and a request that has waited ``LPM_AGE`` scheduler steps is overtaken no more
   (those go first, by their cached prefix too). Why: under pressure, strict arrival order admits a conversation's next
   turn only after everyone queued before it, whose prompts evict the turn's cached history first: on ``multi-turn`` at
   a quarter of the budget V1 and V2 reused 0% of prompt tokens (BENCHMARKS.md, "Cache-aware admission"). A request is
   looked up when it joins the queue, and one that found a hit is looked up again every step: its hit may have gone
   stale. Why: under pressure the running requests use nearly every page, so a history waits in the eviction queue
   beside one or two others, and the next allocation evicts its last blocks; with sliding windows that loses the whole
   hit (the shorter prefix needs window blocks let go long before). Ranked by the hit it had found, such a turn went
   ahead of the turns whose history was still cached, recomputed its whole prompt and evicted the next finished
   conversation's history, whose turn then did the same: on tiny-gemma3 ``multi-turn`` at a quarter of the budget 47 of
   192 follow-up turns lost their history, in chains of up to 18, for 56.5% of prompt tokens reused (73% of the ideal);
   ranked by the hit now, 8 did, 71.8% (92%) in 0.90x the steps (tiny-llama 42.2% -> 64.9%; BENCHMARKS.md, "Stale
   hits"). A stale hit still goes ahead of requests that never had one: a system prompt others share comes back cached
   with the first of them admitted (ranked among them, tiny-mistral ``mixed`` at a quarter of the budget took 893 steps
   instead of 857).
   **A miss looked up again**: a request whose lookup found no cached prefix (of ``LPM_MIN_HIT`` tokens) is looked
   up again every ``LPM_RELOOK`` steps once it has waited ``LPM_RELOOK_WAIT`` (if its prompt is longer than
   ``LPM_MIN_HIT`` tokens: a shorter one finds no hit that ranks), and one that finds a hit then is ranked, and looked
   up every step, as one that found it on joining. Why: a system prompt may be evicted for a few
   steps (a preemption's pressure, or its window blocks let go) and cached again by the next request on it admitted;
   a prompt on it that joined in those steps waited as one without a hit, behind every later prompt on it, until the
   system prompt was gone again and its whole prompt was recomputed (tiny-gemma3 ``mixed`` at the default budget, 54%
   of prompts on one 804-token system prompt: three of them admitted at steps 138-176 where V1 admitted them at 66-68
   with the hit, 1.295x V1's steps and 78.2% of prompt tokens reused against V1's 86.9%; looked up again, 0.882x and
   83.1%: BENCHMARKS.md, "A miss looked up again").
   **Short system prompts**: a cached prefix the request parts from (its next block differs from the cached path's:
   a system prompt other prompts went on from) ranks from ``LPM_BRANCH_HIT`` tokens, not ``LPM_MIN_HIT``; a
   conversation's history, which its next turn extends whole, keeps the higher floor. Why: below the floor a prompt on
   a 150-360-token system prompt waited in arrival order while the running requests' growth evicted the system prompt
   (GPT-OSS 20B ``mixed`` on four 245-token system prompts: 30.3% of prompt tokens reused against V1's 34.3%; ranked,
   45.0% in 0.61x V1's steps; tiny-gemma3 on five of 358 tokens: 30.6% against 34.7%, ranked 71.4% in 0.48x), and
   each one admitted keeps it cached for the next (BENCHMARKS.md, "Short system prompts ranked"). The floor's reason
   (late conversations running their turns alone at the end) is a chain of turns, which a one-shot prompt on a system
   prompt is not.
   A conversation's wait counts across its turns: a request whose prompt extends the prompt of one admitted after
   waiting ``LPM_CARRY`` steps or more (its previous turn) joins the queue with that wait already on its clock, so a
   conversation starved once is not starved again turn by turn. Why: the turns of a conversation that started late
   are the run's critical path (the next is sent when one finishes); ranked as fresh requests, their histories
   shorter than the earlier conversations', they waited behind those turns and the last ran alone at the end
   (tiny-llama ``multi-turn`` at a quarter of the budget: 1.08x V1's steps; carried, 1.001x; BENCHMARKS.md, "A
   conversation's wait carries"). The wait carried is at most ``LPM_AGE`` (the next turn joins aged, no more), and a
   request that has waited more than ``2 * LPM_AGE`` steps goes before every aged one, in arrival order: by cached
   prefix alone, an aged request without a hit was overtaken by each turn of a conversation that joined aged with its
   history cached, for as long as the conversation went on.
   **The last to start**: once the requests waiting without a cached prefix (first turns, or any whose first lookup
   found under ``LPM_MIN_HIT`` tokens; the queue beyond the window counted among them) number at most ``LPM_FEW`` of
   the running requests, those that waited ``LPM_CARRY`` steps go in among the aged. Why: a first turn's conversation
   has every turn still to run, the longest chain left, and longest prefix first puts it behind every live history;
   when a run is short beside ``LPM_AGE`` (96-token answers, three turns, half the budget) the last conversations
   started after waiting 500-950 steps and ran their turns alone at the end (tiny-llama ``multi-turn``: 1.07-1.18x
   V1's steps; now 1.00-1.02x, BENCHMARKS.md "The last conversations to start"). Few: while many first turns wait,
   putting them first is strict arrival order again, which loses the hits. Not while sliding windows free room
   (``held_back``): V2 then runs more requests at once than V1, and a waiting turn's history, whose window blocks go
   within steps, is what a first turn put ahead costs (tiny-gemma3 ``multi-turn`` at a quarter of the budget: 72.5%
   -> 70.8% reused, no step saved).
   **Short conversations**: while at most ``LPM_SHORT`` requests joined the queue with a cached prefix per request
   that joined without one (conversations of under two and a half turns on average), "few" is as many as the running
   requests, and the wait ``LPM_OWN`` times a request's own ``max_new_tokens`` (at most ``LPM_CARRY``), whenever a hit
   waits beside them. Why: there a waiting hit is mostly its conversation's last turn, so putting it behind delays no
   later turn, while a first turn started in the last wave runs its next turn alone after it: 16 two-turn
   conversations of 640-token prompts at 4,096 and 5,120 tokens of KV took 1.14x and 1.17x V1's steps, now 1.005x
   and 0.994x (BENCHMARKS.md, "Two-turn conversations"). With more turns a displaced hit delays its own
   conversation's next turns (the same rule with four-turn conversations: up to 1.09x V1's steps). The estimate
   reads the recent joins (each weighs the earlier ones down by ``1 - 1 / LPM_RECENT``), and only first joins: a
   preempted request rejoins with its own blocks cached, not as a conversation's next turn. Why: counted over the
   whole run, 200 one-shot prompts before 64 four-turn conversations kept it short for every later turn (1.101x
   V1's steps; recent, 1.078x, as with the rule off: BENCHMARKS.md, "The short-conversation estimate follows the
   recent joins").
   **The last chains**: in longer conversations "few" is as many first turns (requests waiting without a cached
   prefix) as can start before they become the run's critical path, and the wait ``LPM_OWN`` times a request's own
   ``max_new_tokens`` (at most ``LPM_CARRY``): a conversation not started has every turn still to run (``turns`` = 1
   + hits per first join, the estimate above, at most ``LPM_CHAIN_TURNS``), one in progress (running, or its turn
   waiting with a hit) about ``(turns + 1) / 2``, so they are critical once ``in progress * (turns + 1) / 2 + (first
   turns - 1) * turns <= running * turns`` (the queue beyond the window counted among the first turns): the others'
   turns left fill the batch for no longer than one chain takes. Why: by longest prefix first, those first turns (and
   turns whose history is under ``LPM_MIN_HIT`` tokens) waited behind every live history until the others' turns
   were done, then ran their turns with the batch nearly empty (search samples of Gemma 2 9B and tiny-llama
   conversations: 1.09-1.14x V1's steps, now 0.99-1.06x; BENCHMARKS.md, "The last chains").
   Under ``"priority"`` suspended and waiting requests form one queue, best-ranked first (vLLM's one priority
   queue for new and preempted requests): each is resumed or admitted in turn until one cannot be; and a waiting
   request refused for lack of room moves out the worst-ranked running request ranked below it (suspended, or
   preempted for recompute, as under pressure), one at a time, until it fits — but only if moving out every running
   request ranked below it would make it fit (their blocks no one else holds, the headroom of the rest: SGLang's
   rule), so nobody is moved out for a request that stays refused. A full batch (``max_batch_size``) displaces
   nobody (vLLM's rule).
   **Headroom** (SGLang's new-token ratio): while others run, a request is admitted only if every
   group keeps, beyond the new request's first chunk and its own estimated growth, room for the
   running requests' estimated growth (the groups of a shared arena together: ``shortfall``):
   ``ratio`` of the way from the tokens each holds to its worst
   case (:meth:`KVCacheManagerV2.growth_blocks`). ``ratio`` starts at ``INIT_RATIO``, decays by
   ``RATIO_DECAY`` every step nobody had to move out, down to ``MIN_RATIO`` (requests usually stop
   well before their worst case, so admission grows bolder while that holds), and jumps back to at
   least ``INIT_RATIO`` (plus ``RATIO_BUMP``) whenever a request is suspended or preempted: real
   pressure makes admission cautious again instead of admitting and suspending in a loop.
   ``init_ratio=0`` turns the rule off (greedy admission, TensorRT-LLM's max-utilisation policy).
   **Shared prefixes under pressure**: on a layout with sliding windows, while requests run, admission does not count
   the cached blocks of shared prefixes (radix runs others branched from: system prompts) as room, up to
   ``SHARED_HOLD`` of each pool (:meth:`KVCacheManagerV2.held_back`), and neither do a resume and a running request's
   next prefill chunk: the chunk takes what fits beside them, or, when nothing does and others advance this step,
   waits a step (the best-ranked running request never waits). Why: the windows let a system prompt's window blocks
   go long before its full-attention blocks, the room that frees is what lets V2 admit more than V1, and spending it
   used to evict the prefixes every later hit needs — first by admission (tiny-gemma3 ``mixed`` at half the budget:
   17.7% hits against V1's 32.9%, 24.3% once admission held them), then by the long prompts it admitted, whose later
   chunks took the held blocks (at a quarter of the budget tiny-mistral kept 10.9% against V1's 18.9%; with chunks
   holding too, 30.4% in a third of V1's steps), and under the priority policy by the batch requests resumed after
   urgent ones had moved them out (tiny-gemma3 at a quarter of the budget: 20.5% against V1's 22.9%; resumes holding
   too, 23.5%; BENCHMARKS.md "V1 vs V2 on mixed traffic"). Without windows V2's room is V1's and the hold cost steps
   (tiny-llama at a quarter of the budget: 1.08x V1's), so it applies to windowed layouts only, and only while a
   running sequence (or the one asking) is longer than the shortest window: a window no sequence outgrows frees
   nothing (Gemma 2 9B's 4,096 over mixed traffic of at most 2,304 tokens: holding cost 1.04x V1's steps with a
   quarter of the requests urgent; without it 0.94x). Decodes never wait
   for it, so under pressure a running request's growth still evicts them, and an empty batch admits regardless.
   **The hold gives way to V1's room** (``HOLD_GIVES_WAY``, under ``"fcfs"``): a request the hold refuses is admitted
   anyway when it and every running request fit at their worst cases with the held blocks counted as room (the
   estimate at ratio 1, plus a block a request in each windowed cycle: requests of one length cross a window's block
   boundary together) — the hold is never stricter than V1's admission. Why: finished groups' prefixes (GPT-OSS 20B
   ``shared-prefix``: each group of 3-9 followers leaves its 300-950-token prefix queued as a shared run) piled up to
   the hold's cap, half the arena, and V2 ran 4-7 requests where V1 ran 10-12, in up to 1.56x V1's steps; the same
   state evicted the next group's live prefix, as the running requests' growth took the only unshared queued block.
   At the moment of a refusal a dead group's prefix and a live system prompt between bursts look alike, so the rule
   is about room, not about which prefix: it takes 0.4-1.5 points of prefix hits from ``mixed`` traffic at tight
   budgets (where V2's hits are 9-11 points above V1's) for 3-6% fewer steps there, and removes every GPT-OSS
   ``shared-prefix`` step loss of the seeded searches (BENCHMARKS.md, "The hold gives way to V1's room"). Not under
   ``"priority"``: batch requests admitted past the hold there evicted the system prompts urgent ones return to.
   **Spread**: while others run and their worst cases with the candidate's would overcommit the pools (what V1
   refuses), at most one request that claims no cached prefix is admitted per step (hits go in as many as fit; with
   room for every worst case, as many as fit). Why: a whole prompt's prefill fills a step's compute, so two in one
   step cost their sum while a later step decodes alone, paying the weights' read a prefill would have hidden; and
   requests admitted together finish together, freeing their slots together for the next group, a convoy that
   repeats (Gemma 2 9B ``no-reuse`` at a quarter of the budget: 2 to 10 prompts at once in 29 steps, 1.029x V1's
   modeled time; spread, 1.009x; BENCHMARKS.md "Spread admissions"). Only under pressure: a burst into ample
   memory goes in at once, as on V1.
   **Wait for the prefix in flight** (under ``"fcfs"``): a waiting request whose prompt shares with a running request
   whose prompt's prefill is pending (one admitted or resumed earlier in the step, or a chunked prompt) every reuse
   unit that one has computed and the next, which that one's chunk computes in this step, is not admitted this step,
   and admission stops there (first come first served); next step the unit is cached and the request claims it. The
   unit is what a hit is a multiple of (``reuse_unit``): a block, or several where a group's blocks span several
   (DeepSeek V4's compressed ones; a block that completes no unit adds nothing to the hit, so it is not waited for).
   No wait where it gains nothing: for one that reads no cached prefix (``skip_prefix_read``), for a unit it finds
   cached already (a sharer that reads none computes it again), or for one the sharer's windows let go in the same
   step where they free what they let go (``enable_swa_scratch_reuse`` false: the hit next step would be shorter,
   not longer; :meth:`KVCacheManagerV2.window_keeps`). Why:
   admitted beside that prefill, it computed its own copy of the blocks in flight and held them while it ran
   (tiny-gemma3 ``shared-prefix``, groups of 6 on a 742-token prefix at 0.128 of the budget: three of a group went in
   a step before its first prompt's prefill ended, reusing 576 of its 736 tokens, and their copies kept the other two
   out for 10 steps: 194 steps against V1's 184, now 184; BENCHMARKS.md, "Wait for the prefix in flight"). SGLang's
   in-batch prefix caching puts such a request behind the others; here the others wait too: a later prompt let into
   the room took what the waiting ones needed next step (a single-prefix ``mixed`` sample: 1.05x V1's steps against
   0.88x). Only a unit computed in this step defers, so each step waited caches a unit more of the prefix (a sharer
   whose chunk the hold stalled kept a prompt waiting 12 steps). With room to spare it costs the request a step (its
   copy's compute saved).
   A request that claims no cached prefix is asked about before its cache is built
   (:meth:`KVCacheManagerV2.fit_tokens_new` and friends answer as the built cache would), so a refusal —
   a long prompt waiting for room, step after step — builds and cancels nothing. Under "fcfs" so is one whose
   cached prefix is whole blocks (:meth:`KVCacheManagerV2.probe_hit`: a turn whose history waits for room): when
   refused, :meth:`KVCacheManagerV2.refuse_hit` requeues its history as the youngest in the eviction queue, in the
   order building and cancelling it did (so a waiting turn keeps its history warm, as before), and when admitted
   its cache is built from the probe. So is one whose first tokens start a cached run but which can use no whole
   block of it (on any layout, DeepSeek V4's included): its probed claim is empty, a refusal changes nothing.
   **Forks**: a sample of an ``n > 1`` prompt joins ``running`` in the step its prompt's prefill completes,
   holding that prompt's KV (:meth:`KVCacheV2Scheduler.fork`), when the batch has room, the copy of the
   partial block fits and the headroom rule above admits it; otherwise its driver queues it as any request.
3. A waiting request that could never fit the pools even alone — its worst case,
   ``min(prompt + max_new_tokens, max_seq_len)`` tokens, needs more blocks than a pool has, or its
   prompt is longer than ``max_seq_len`` — is skipped and stays in ``waiting``; it is reported in
   ``stalled`` once nothing else can run. If nothing was scheduled while requests remain, ``stalled``
   says why; the scheduler never loops.

Why every request that fits the pools alone completes: the best-ranked running request is never
moved out while another runs (admission moves out only requests ranked below the one it admits),
and it was admitted only if its worst case fits the pools alone, so it advances every step until it
finishes (on a slab arena, once its used blocks are packed into the fewest slabs: the scheduler packs them,
:meth:`KVCacheManagerV2.compact_slabs`, where it would otherwise find a request alone unable to grow); then
the next one does (under "priority", better-ranked arrivals go first: a steady stream
of them can starve a worse-ranked request, as in vLLM). Suspended and waiting requests sit
at the front of ``waiting`` in state ``SUSPENDED`` / ``WAITING``, so a driver that loops
``while waiting or running`` sees them.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Callable
from operator import and_, attrgetter, gt, is_, itemgetter, le, lt, not_, or_

from cache_backends.interface import ScheduledChunk, SchedulerOutput
from cache_backends.request import Request, RequestState
from cache_backends.scheduler_base import SchedulerBase
from cache_backends.v2.lookup import HitProbe
from cache_backends.v2.manager import KVCacheManagerV2

_ARRIVAL, _PRIORITY, _RANK = attrgetter("arrival"), attrgetter("priority"), attrgetter("rank")

#: Cache-aware admission under "fcfs" (module docstring): how many waiting requests at the queue's front are ranked
#: by their cached prefix (SGLang ranks by longest prefix match only while its queue holds at most 128), after how
#: many scheduler steps in the queue a request goes first regardless, and the shortest cached prefix (tokens) that
#: lets a request go ahead. Why a floor: overtaking lets a conversation run its turns back to back, so those that
#: start late run theirs at the end with the batch half empty; a hit must save a prefill worth that. Without it, 32
#: three-turn conversations of 96 + 16-token turns and 32-token answers at 2,048 tokens of KV took 1.09x V1's steps and
#: modeled time (Llama 3.1 8B, Gemma 2 9B) for 39% reuse; a 512-token prefill of an 8B model is about two and a half
#: decode steps' weight read on an H200 (BENCHMARKS.md, "Cache-aware admission").
LPM_WINDOW, LPM_AGE, LPM_MIN_HIT = 128, 1024, 512
#: A cached prefix the request parts from (its next block differs from the cached path's: a system prompt others'
#: prompts went on from, not a conversation's history, which the next turn extends whole) ranks from this many tokens
#: (module docstring, "Short system prompts"): 64 and 128 fixed the same search samples, 64 took more hits from
#: ``shared-prefix`` samples, 256 left GPT-OSS ``mixed`` on 245-token system prompts 4 points below V1
#: (BENCHMARKS.md, "Short system prompts ranked").
LPM_BRANCH_HIT = 128
#: The shortest wait (scheduler steps) a request's next turn carries (module docstring): shorter waits are dropped so
#: that few prompts are kept; 1, 256, 512 and 768 gave the same grid and variant figures (BENCHMARKS.md, "A
#: conversation's wait carries"). At most ``LPM_WINDOW`` prompts are kept, the oldest dropped first.
LPM_CARRY = 256
#: The first turns waiting (requests that found no cached prefix, the queue beyond the window counted as such) go in
#: among the aged once they number at most this share of the running requests (module docstring, "the last to
#: start"): any share from a quarter to nearly a half gave the same variant figures (BENCHMARKS.md, "The last
#: conversations to start").
LPM_FEW = 0.25
#: The most turns the last chains' rule (module docstring) reads a conversation as having: late in a run the recent
#: joins are mostly later turns, so the estimate overshoots (six-turn conversations read as nine and more); read so,
#: the conversations in progress seemed to have more turns left than they had, second turns without a hit of
#: ``LPM_MIN_HIT`` went in early and evicted the histories waiting (tiny-llama six-turn conversations at 0.267x the
#: budget: 1.022x -> 1.057x V1's steps; capped, 1.022x; BENCHMARKS.md, "The last chains").
LPM_CHAIN_TURNS = 8
#: Short conversations (module docstring, "Short conversations"): while at most ``LPM_SHORT`` requests joined the queue
#: with a cached prefix per request that joined without one (conversations of under two and a half turns on average:
#: a waiting hit is mostly its conversation's last turn), the requests waiting without one go in among the aged once
#: they number at most the running requests and each waited ``LPM_OWN`` times its own ``max_new_tokens`` (at most
#: ``LPM_CARRY``) steps. 1 left 2-turn conversations at 4,096 tokens of KV at 1.16x V1's steps, 2 took 3-turn ones to
#: 1.09x; an own wait of 2 or 2.5 answers gave the same figures (BENCHMARKS.md, "Two-turn conversations").
LPM_SHORT, LPM_OWN = 1.5, 2
#: The short-conversation estimate reads the recent joins: each first join weighs the counts so far down by
#: ``1 - 1 / LPM_RECENT`` (about the last ``LPM_RECENT`` joins count). 200 one-shot prompts, then 64 four-turn
#: conversations at a quarter of their budget: counted over the whole run the one-shots kept the estimate short for
#: every later turn (1.101x V1's steps); 48 to 80 read the conversations (1.078x, as with the rule off), 96 and more did
#: not, 32 read 16 two-turn conversations as long once their second turns joined (4,096 tokens of KV: 1.005x ->
#: 1.163x; BENCHMARKS.md, "The short-conversation estimate follows the recent joins").
LPM_RECENT = 64
#: Every ``LPM_RELOOK`` steps the waiting requests whose lookup found no cached prefix and that have waited
#: ``LPM_RELOOK_WAIT`` steps are looked up again (module docstring, "A miss looked up again"): a system prompt evicted
#: for a few steps when they joined is cached again by the next request on it admitted. A period of 8 and 1 gave the
#: same figures on the case that showed it, 32 half the gain. The wait: in a burst whose prefixes nobody has computed
#: yet, every prompt misses on joining and its first admitted computes the prefix; looked up again within the burst,
#: the others went ahead of an earlier prompt without a hit, which then ran alone at the end (tiny-llama ``mixed``,
#: 39 prompts at once on 5 prefixes: 1.000x -> 1.136x V1's steps); 16 to 48 steps left it at 1.000x. Over 800
#: searched samples (BENCHMARKS.md, "A miss looked up again"), a period of 16 kept most of the gain, 8 all of it; a
#: look-up only after waits of 24, 48, 96, ... steps (a few per request) lost part of it: more steps on 6 of the 7
#: samples the rule moves, fewer hits on the 7th (#50: 0.882x -> 0.959x V1's steps; seed 1 #302: 0.632x -> 0.720x).
LPM_RELOOK, LPM_RELOOK_WAIT = 8, 24
_DECAY = 1 - 1 / LPM_RECENT
#: The rank above every cached prefix: a request waiting more than ``2 * LPM_AGE`` steps goes first (module docstring).
_STARVED = float("inf")


def _sort_by_rank(requests: list[Request]) -> None:
    """``requests.sort(key=Request.rank)`` in two stable sorts with C key functions (a third of the cost per step):
    by arrival, then by priority, high first (``reverse`` keeps equal priorities in arrival order)."""
    requests.sort(key=_ARRIVAL)
    requests.sort(key=_PRIORITY, reverse=True)


def _pending(request: Request) -> int:
    return request.num_tokens - request.num_computed_tokens


def _waits_for(request: Request, flight: list[Request], chunks: dict[Request, ScheduledChunk], unit: int,
               keeps: Callable[[int, int], bool] | None = None,
               cached: Callable[[Request], int] | None = None) -> bool:
    """Whether ``request`` (waiting) shares with one of ``flight`` (running, their prompt's prefill pending) every
    reuse unit that one has computed and the next, which that one computes in this step (its chunk in ``chunks``):
    admitted next step, it finds that unit cached instead of computing its own copy beside it (module docstring,
    "Wait for the prefix in flight"). ``unit``: the tokens a hit is a multiple of (the manager's ``reuse_unit``, a
    block unless some group's blocks span several, as DeepSeek V4's compressed ones do). ``keeps(m, committed)``: the
    manager's :meth:`~KVCacheManagerV2.window_keeps` (a window that frees what it lets go may free the unit's window
    blocks in the same step: the hit then is shorter than the one now, not longer). ``cached(request)``: the prefix it
    claims now (:meth:`~KVCacheManagerV2.cached_prefix_tokens`), looked up only once a sharer matches: a unit it
    already finds cached (a sharer that reads no cached prefix computes it again) is not waited for, only the unit
    after its hit where the same chunk computes that one too."""
    if request.skip_prefix_read:
        return False
    p = request.prompt_token_ids
    hit = -1  # the prefix it claims now: looked up at the first sharer that matches
    for s in flight:
        c = chunks.get(s)
        done = s.num_computed_tokens // unit * unit  # its whole units computed: cached, what a hit claims now
        end = done + unit
        # a hit claims whole units before a prompt's last token; the sharer's unit is its prompt's; and it must be
        # computed now: a chunk the hold stalls, or one that stops short of it, may leave it pending for many steps
        # (a block computed that completes no unit: the hit next step is the one now, so waiting only delays it)
        if c is None or s.num_computed_tokens + c.num_tokens < end or end >= len(p) or end > len(s.prompt_token_ids):
            continue
        q = s.prompt_token_ids
        if (s.salt == request.salt and p[done:end] == q[done:end] and p[:done] == q[:done]
                and (keeps is None or keeps(end, s.num_computed_tokens + c.num_tokens))):
            if cached is None:
                return True
            if hit < 0:
                hit = cached(request)
            if hit < end:
                return True
            # it claims that unit now (cached by another): wait only for the unit after its hit, if this chunk
            # computes it too
            f, nxt = s.num_computed_tokens + c.num_tokens, hit + unit
            if (nxt <= f and nxt < len(p) and nxt <= len(q) and p[end:nxt] == q[end:nxt]
                    and (keeps is None or keeps(nxt, f))):
                return True
    return False


#: The most of a pool (a share of its blocks) that admission and prefill chunks, while requests run on a
#: sliding-window layout, leave to cached shared prefixes rather than counting as room (module docstring, "Shared
#: prefixes under pressure"). Half: tiny-gemma3's four 512-token system prompts fill 40% of its pool at a quarter of
#: the default budget (every group holds a whole window of each): there a fifth kept 20.7% of prompt tokens against
#: V1's 23.2%, a half 22.5% (``python -m bench.bench_mixed``, 8 seeds; at half the budget both 32.7%); on 4 seeds 0.3
#: kept 22.0% and anything from a half up 22.6%.
SHARED_HOLD = 0.5
#: Whether the hold gives way (under "fcfs") to a request that it and every running request fit at their worst cases
#: with the held blocks counted as room: V1's admission rule, which the hold must never be stricter than (module
#: docstring, "The hold gives way to V1's room"). A module constant so the searches can measure it off
#: (``--patch cache_backends.v2.scheduler.HOLD_GIVES_WAY=0``).
HOLD_GIVES_WAY = True

#: Whether "fcfs" admission stops at a waiting request whose prompt shares the next reuse unit (a whole block, or the
#: blocks a hit claims together) a running request's prefill computes in this step (one admitted or resumed earlier
#: in the step, or a chunked prompt), and every unit before it: it goes in once the unit is cached (module docstring,
#: "Wait for the prefix in flight"). A module constant so the searches can measure it off
#: (``--patch cache_backends.v2.scheduler.DEFER_IN_FLIGHT=0``).
DEFER_IN_FLIGHT = True

#: a sequence length past every window: ``held_back`` answers what it holds whatever the running sequences' lengths
_ANY_LENGTH = float("inf")

#: The new-token ratio's start, floor, decay per calm step and bump on a suspension (module docstring).
INIT_RATIO, MIN_RATIO, RATIO_DECAY, RATIO_BUMP = 0.7, 0.1, 0.001, 0.1


class KVCacheV2Scheduler(SchedulerBase):
    """Max-utilisation scheduler for :class:`KVCacheManagerV2`; see the module docstring for one step."""

    manager: KVCacheManagerV2

    def __init__(self, manager: KVCacheManagerV2, max_batch_size: int, max_num_tokens: int, *,
                 init_ratio: float = INIT_RATIO, min_ratio: float | None = None,
                 scheduling_policy: str = "fcfs") -> None:
        super().__init__(manager, max_batch_size, max_num_tokens, scheduling_policy=scheduling_policy)
        min_ratio = min(MIN_RATIO, init_ratio) if min_ratio is None else min_ratio
        if not 0 <= min_ratio <= init_ratio <= 1:
            raise ValueError(f"need 0 <= min_ratio <= init_ratio <= 1, got {min_ratio} and {init_ratio}")
        self.init_ratio, self.min_ratio = init_ratio, min_ratio  # init_ratio 0: greedy admission (no headroom)
        self.new_token_ratio = init_ratio  # share of running requests' remaining growth admission keeps room for
        self._refused: Request | None = None  # the request the headroom estimate last refused (admission's head)
        self._longest = 0  # the longest running sequence this step, in tokens, admissions included (held_back)
        self._steps = 0  # steps so far: the clock of cache-aware admission's aging
        # prompts of requests admitted after waiting LPM_CARRY steps or more -> the wait their next turn carries, and
        # the prompt lengths among them (a joining request's prompt is cut at each to look it up)
        self._carried: dict[tuple[int, ...], int] = {}
        self._carried_lengths: Counter[int] = Counter()
        # requests that joined the queue with a cached prefix / without one, first joins only, each weighing the
        # earlier ones down by _DECAY (the "short conversations" estimate: the recent joins)
        self._joined_hit = self._joined_cold = 0.0
        # last step's decode chunks, request -> ScheduledChunk(request, 1): a decode's chunk is the same value step
        # after step, so it is built once per run of decodes (a chunk per running request per step cost ~0.25 us)
        self._decode_chunks: dict[Request, ScheduledChunk] = {}

    def step(self, waiting: deque[Request], running: list[Request]) -> SchedulerOutput:
        """Decide this iteration: move requests between ``waiting`` and ``running``, allocate, report."""
        self._steps += 1
        m = self.manager
        m.check_running(running)
        out = SchedulerOutput()
        reasons: list[str] = []
        chunks: dict[Request, ScheduledChunk] = {}
        budget = self.max_num_tokens
        _sort_by_rank(running)
        moved_out = False

        order, chunked = [], []  # decodes (one pending token) first, then prefill chunks
        longest = 0  # the longest running sequence's tokens: shared prefixes are held only when windows free room
        running_state = RequestState.RUNNING
        # a prefill chunk, while others run, leaves cached shared prefixes alone as admission does ("Shared prefixes
        # under pressure"): what is held is read before any decode below takes a block (an eviction may take a shared
        # one); None on a layout without windows
        held = m.held_back(SHARED_HOLD, _ANY_LENGTH) if len(running) > 1 else None
        # Decodes are reserved in one call after the scan that finds them, in running order as the loop below would
        # (the scan reads no state a reservation changes), until one does not fit or the budget is spent: that one and
        # every later decode go through the loop below. Why: a decode is nearly every running request every step; a
        # second Python pass over them cost ~30 opcodes a request, and a call to the manager each its frame and reads
        # (BENCHMARKS.md, "perfchunk60")
        decodes = []
        for r in running:
            n = len(r.prompt_token_ids) + len(r.output_token_ids)  # r.num_tokens inlined: every request, every step
            p = n - r.num_computed_tokens
            if n > longest:
                longest = n
            if p == 1:
                if r.state is running_state:
                    decodes.append(r)
                else:  # (skipped by the loop below)
                    order.append((r, 1))
            elif p > 1:
                chunked.append((r, p))
        self._longest = longest
        if decodes:
            fast = decodes if len(decodes) <= budget else decodes[:budget]
            k = m.schedule_decodes(fast)  # (the first that did not fit changed nothing: the loop below asks again)
            if k:
                budget -= k
                if k < len(decodes):
                    fast = decodes[:k]
                    order += [(r, 1) for r in decodes[k:]]
                # each chunk is last step's where the request decoded then too (a lookup, ~4x cheaper than a chunk)
                last, made = self._decode_chunks.get, {}
                for r in fast:
                    c = last(r)
                    made[r] = c if c is not None else ScheduledChunk(r, 1)
                self._decode_chunks = made
                chunks.update(made)
            else:
                order += [(r, 1) for r in decodes]
                self._decode_chunks = {}
        else:
            self._decode_chunks = {}
        order += chunked
        # what held_back(SHARED_HOLD, longest) would test first: a hold only once a sequence outgrows a window
        hold = held if chunked and held is not None and longest > m.shortest_window else None
        best = running[0] if running else None
        for r, p in order:
            if budget == 0:
                break
            if r.state is not running_state:  # moved out earlier in this loop
                continue
            want = p if p < budget else budget  # min(p, budget) without the call: every request, every step
            if p > 1 and hold is not None and r is not best:
                n = m.fit_tokens(r, want, hold)
                if n:
                    budget -= self._schedule(r, n, chunks)
                    hold = m.held_back(SHARED_HOLD, longest)
                    continue
                if chunks:  # others advance this step: wait for room rather than evict a prefix or move one out
                    continue
            n = m.schedule_tokens(r, want)
            if n:  # reserved: the common case
                budget -= n
                chunks[r] = ScheduledChunk(r, n)
                continue
            while n == 0:
                if r.num_computed_tokens >= m.options.max_seq_len:
                    reasons.append(f"request {r.req_id} reached max_seq_len={m.options.max_seq_len}; "
                                   "finish it (reason 'length')")
                    break
                why = m.never_fits(r)
                if why is not None:  # outgrew its worst case: it could never finish, so it must not push others out
                    reasons.append(why)
                    self._move_out(r, waiting, running, out, suspend=False)
                    break
                if len(running) == 1:  # cannot happen for a request whose worst case fits the pools alone
                    if m.compact_slabs():  # unless a slab arena's used blocks pin more slabs than they fill
                        n = m.fit_tokens(r, want)
                        continue
                    reasons.append(f"request {r.req_id} cannot grow past {r.num_computed_tokens} tokens although it "
                                   "runs alone")
                    break
                victim = running[-1]  # lowest priority, latest arrival
                if victim in chunks:
                    budget += chunks.pop(victim).num_tokens
                self._move_out(victim, waiting, running, out)
                moved_out = True
                if victim is r:
                    break
                n = m.fit_tokens(r, want)
            if n > 0 and r.state is RequestState.RUNNING:
                budget -= self._schedule(r, n, chunks)

        if moved_out:
            if self.init_ratio:
                self.new_token_ratio = min(1.0, max(self.new_token_ratio, self.init_ratio) + RATIO_BUMP)
        else:
            self.new_token_ratio = max(self.min_ratio, self.new_token_ratio - RATIO_DECAY)
            if self.by_priority:
                self._by_rank(waiting, running, out, chunks, budget, reasons)
            else:
                # one scan of a long queue, and none while no request waits on the host tier (the common case)
                suspended = [r for r in waiting if r.state is RequestState.SUSPENDED] if m.num_on_host else []
                if suspended:
                    budget = self._resume(suspended, waiting, running, out, chunks, budget, reasons)
                if not any(r.state is RequestState.SUSPENDED for r in suspended):
                    order = (self._cache_aware(waiting, len(running)) if len(running) < self.max_batch_size and budget
                             else list(waiting))
                    # only a prompt with chunks to go (or one resumed) can be in flight: decodes are not looked at
                    self._admit(order, waiting, running, out, chunks, budget, reasons,
                                prefilling=[r for r, _ in chunked] + out.resumed)

        out.scheduled = list(chunks.values())
        self.report_stall(out, reasons, waiting, running)
        self.extend_with_drafts(out)
        return out

    def fork(self, parent: Request, child: Request, running: list[Request]) -> bool:
        """Admit ``child`` into ``running`` holding ``parent``'s just-computed prompt (``KVCacheManagerV2.fork``) when
        the batch has room, the copies fit and the headroom rule admits it as it would a waiting request; False
        (nothing changed) otherwise."""
        m = self.manager
        if len(running) >= self.max_batch_size or m.never_fits(child) is not None or not m.fork(parent, child):
            return False
        ratio = self.new_token_ratio
        if running and ratio:
            hold = m.held_back(SHARED_HOLD, max(self._longest, child.num_tokens))
            if m.short_of(m.cycle_growth(child, ratio, 1), m.cycle_headroom(running, ratio), extra=hold):
                m.unfork(child)
                return False
        child.state = RequestState.RUNNING
        running.append(child)
        return True

    def reserve_drafts(self, request: Request, scheduled: int, drafts: int) -> int:
        """Draft slots from what is free now (never by moving a request out)."""
        return self.manager.schedule_tokens(request, scheduled + drafts) - scheduled

    # --- internals -------------------------------------------------------------------------------

    def _schedule(self, request: Request, n: int, chunks: dict[Request, ScheduledChunk]) -> int:
        if not self.manager.allocate(request, n):  # fit_tokens said it fits; this is a bookkeeping bug
            raise RuntimeError(f"request {request.req_id}: allocation of {n} tokens failed after fitting")
        chunks[request] = ScheduledChunk(request, n)
        return n

    def _move_out(self, victim: Request, waiting: deque[Request], running: list[Request],
                  out: SchedulerOutput, suspend: bool = True) -> None:
        """Suspend ``victim`` to the host tier, or preempt it for recompute when the tier cannot take it (or
        ``suspend`` is False)."""
        if suspend and self.manager.suspend(victim):
            victim.state = RequestState.SUSPENDED
            out.suspended.append(victim)
        else:
            self.manager.preempt(victim)
            victim.state = RequestState.WAITING
            victim.cached_hint = -1  # its own blocks are cached now: looked up again
            out.preempted.append(victim)
        running.remove(victim)
        waiting.appendleft(victim)

    def _resume(self, suspended: list[Request], waiting: deque[Request], running: list[Request], out: SchedulerOutput,
                chunks: dict[Request, ScheduledChunk], budget: int, reasons: list[str]) -> int:
        m = self.manager
        for r in sorted(suspended, key=_RANK):
            if len(running) >= self.max_batch_size or budget == 0:  # it could not run this step
                break
            # a resume, while others run, leaves cached shared prefixes alone as admission does
            hold = m.held_back(SHARED_HOLD, max(self._longest, r.num_tokens)) if running else None
            refusal = m.resume_refusal(r, hold)
            if refusal is not None:
                reasons.append(refusal)
                break
            m.resume(r)
            r.state = RequestState.RUNNING
            waiting.remove(r)
            running.append(r)
            self._longest = max(self._longest, r.num_tokens)  # running now: the next admission's hold counts it
            out.resumed.append(r)
            n = m.fit_tokens(r, min(_pending(r), budget)) if budget else 0
            if n:
                budget -= self._schedule(r, n, chunks)
        return budget

    def _refusal(self, request: Request, n: int, own: list[int], headroom: list[int] | None,
                 ratio: float) -> str:
        """Why :meth:`_admit` refused ``request`` (``n``: tokens of its first chunk that fit; ``own`` and
        ``headroom`` per life cycle)."""
        if n == 0 or headroom is None:
            return f"no room to admit request {request.req_id} until running requests free blocks"
        m = self.manager
        short = m.shortfall(m.per_group([k + h for k, h in zip(own, headroom, strict=True)]))
        return (f"request {request.req_id} waits: admitting it would leave less than the running "
                f"requests' estimated growth ({short}; new-token ratio {ratio:.2f})")

    def _by_rank(self, waiting: deque[Request], running: list[Request], out: SchedulerOutput,
                 chunks: dict[Request, ScheduledChunk], budget: int, reasons: list[str]) -> None:
        """The "priority" policy: suspended and waiting requests as one queue, best-ranked first, each resumed or
        admitted in turn (runs of one state at a time) until one cannot be."""
        queue = sorted(waiting, key=_RANK)
        i = 0
        while i < len(queue):
            state, j = queue[i].state, i + 1
            while j < len(queue) and queue[j].state is state:
                j += 1
            run = queue[i:j]
            if state is RequestState.SUSPENDED:
                budget = self._resume(run, waiting, running, out, chunks, budget, reasons)
                if any(r.state is RequestState.SUSPENDED for r in run):
                    return
            else:
                budget, done = self._admit(run, waiting, running, out, chunks, budget, reasons)
                if not done:
                    return
            i = j

    def _cache_aware(self, waiting: deque[Request], running: int = 0) -> list[Request]:
        """The "fcfs" admission order: of the first ``LPM_WINDOW`` waiting requests, those waiting ``LPM_AGE`` steps
        or longer in arrival order, then the rest by their cached prefix now, longest first; a request whose prefix
        was evicted since it joined goes behind every live hit but ahead of those that never had one (ties and the
        queue beyond the window in arrival order).

        A request is looked up when it joins the queue; only one that found a hit then is looked up again, every step
        (a few requests: a lookup of every waiting request per step would cost more than the scheduler's step), and
        the others every ``LPM_RELOOK`` steps once they waited ``LPM_RELOOK_WAIT``."""
        if len(waiting) < 2 or self.manager.reuse_off_reason is not None:
            return list(waiting)
        now, m = self._steps, self.manager
        # The window's requests are read in one-attribute passes (states, arrival steps, hints); Python work is done
        # only for the few that need it: those joining the window, those with a hint to look up, those aged. Why:
        # under pressure the window is full of requests that never had a hit and rank 0 step after step; a pass doing
        # all of it per request was a fifth of V2's KV work on tiny-gemma3 ``mixed`` at a quarter of the budget. Each
        # pass reads its attribute in a comprehension, not ``map(attrgetter(...))``: on CPython 3.11 a comprehension's
        # attribute load of a slotted class is specialized, twice as fast as attrgetter's generic lookup
        # (BENCHMARKS.md "ca61").
        window = list(itertools.islice(waiting, LPM_WINDOW))
        states = [r.state for r in window]
        if states.count(RequestState.WAITING) != len(window):
            window = list(itertools.compress(window, map(is_, states, itertools.repeat(RequestState.WAITING))))
        n = len(window)
        tail = list(itertools.islice(waiting, LPM_WINDOW, None))
        if not n:
            return tail
        queued = [r.queued_at for r in window]
        if min(queued) < 0:  # joined the window: its clock of waiting starts now, or earlier by the wait it carries
            for i in itertools.compress(range(n), map(lt, queued, itertools.repeat(0))):
                window[i].queued_at = queued[i] = now - (self._carry_of(window[i]) if self._carried else 0)
        ranks = [0] * n  # 0: never had a hit (or its first lookup found none)
        hinted = [i for i, r in enumerate(window) if r.cached_hint]  # a hint to look up, in window order
        # the pass's lookups share their walks: the prompts on a system prompt walk the same path (manager docstring);
        # and 0 without a lookup where no cached run starts with the request's first token (manager.may_find_prefix:
        # the lookup's own cheap miss, for all of them at once). Only for several lookups: for one, both cost more
        # than they save (the median step, BENCHMARKS.md "relook44"). An answer the tree has not changed since an
        # earlier pass is kept, not looked up again (manager.cached_prefixes: most steps under pressure)
        relook = not now % LPM_RELOOK
        memo: dict | None = {} if relook or len(hinted) > 1 else None
        floors = (LPM_MIN_HIT, min(LPM_BRANCH_HIT, LPM_MIN_HIT))  # by whether a prefix others went on from
        for i, (hit, branch) in zip(hinted, m.cached_prefixes([window[i] for i in hinted], memo) if hinted else (),
                                    strict=True):
            r = window[i]
            floor = floors[branch]
            if r.cached_hint < 0:  # joined the queue: looked up once
                ranks[i] = r.cached_hint = hit if hit >= floor else 0
                if r.first_reused_tokens is None:  # a first join (a preempted request's hit is its own blocks)
                    self._joined_hit *= _DECAY
                    self._joined_cold *= _DECAY
                    if hit:
                        self._joined_hit += 1
                    else:
                        self._joined_cold += 1
            else:
                # the running requests' growth may have evicted it while the request waited (module docstring, "a
                # stale hit"); 1: a prefix others share may come back, cached again by the first of them admitted
                ranks[i] = hit if hit >= floor else 1
        if relook:  # those whose lookup found none, again: the miss may have been momentary
            # a prompt of LPM_BRANCH_HIT tokens or fewer finds no hit that ranks: not looked up (on mixed traffic most
            # misses are such prompts; their lookups were a tenth of V2's KV work under pressure, BENCHMARKS.md)
            since, floor = now - LPM_RELOOK_WAIT, floors[True]
            again = [i for i, (k, q, r) in enumerate(zip(ranks, queued, window, strict=True))
                     if not k and q <= since and len(r.prompt_token_ids) > floor]
            # most are unrelated prompts that no cached run starts like: ruled out together (may_find_prefix)
            found = m.cached_prefixes([window[i] for i in again], memo) if again else []
            # (only those with a hit, at C speed: most of them find none)
            for i, (hit, branch) in itertools.compress(zip(again, found, strict=True), map(itemgetter(0), found)):
                # from now on looked up every step, as a hit found on joining is
                if hit >= floors[branch]:
                    ranks[i] = window[i].cached_hint = hit
        aged: list[Request] = []
        old = now - LPM_AGE
        # the last first turns, few beside the running requests, go in among the aged once they waited LPM_CARRY
        # steps: their conversations have every turn still to run (module docstring, "the last to start"); not while
        # sliding windows free room (held_back answers a list): V2 then runs more at once than V1 and a turn's
        # history, its window blocks let go within steps, is what a first turn put ahead of it costs
        # short conversations (a waiting hit mostly its conversation's last turn, putting it behind delays no turn):
        # as many as run, after a wait of LPM_OWN times their own answer's length; only beside a hit (else the order
        # is arrival order anyway)
        cold = ranks.count(0)
        short = cold < n and self._joined_hit <= LPM_SHORT * self._joined_cold
        few, chains = running if short else LPM_FEW * running, False
        if cold and not short:
            # the last chains: a conversation not started has every turn to run, one in progress (running, or a hit
            # waiting) about half of them; the first turns are the run's critical path once the work of the others
            # fills the batch no longer than one chain: in progress * (turns + 1) / 2 + (cold - 1) * turns <= running
            # * turns, turns = 1 + hits per first join (the recent joins: the short-conversation estimate's)
            joined = self._joined_hit + self._joined_cold  # (turns + 1) / (2 * turns), turns at most LPM_CHAIN_TURNS
            half = 0.5 + 0.5 * max(self._joined_cold / joined, 1 / LPM_CHAIN_TURNS) if joined else 1.0
            chain = 1 + running - (running + n - cold) * half
            if chain > few:
                few, chains = chain, True
        last = bool(cold) and cold + len(tail) <= few and m.held_back(0.0, self._longest) is None
        if last or min(queued) <= old:  # waited LPM_AGE steps or longer: first, by their cached prefix, then arrival
            mask = list(map(le, queued, itertools.repeat(old)))
            if last and (short or chains):  # a wait of their own answer's length, not LPM_CARRY's
                mask = [a or (not k and q <= now - min(LPM_CARRY, LPM_OWN * r.max_new_tokens))
                        for a, k, q, r in zip(mask, ranks, queued, window, strict=True)]
            elif last:
                mask = list(map(or_, mask, map(and_, map(not_, ranks),
                                               map(le, queued, itertools.repeat(now - LPM_CARRY)))))
            # but those that waited more than twice LPM_AGE go before them, in arrival order: a conversation's turns
            # join aged (the wait they carry), each with its history cached, and by prefix alone they overtook an aged
            # request without a hit turn after turn
            starved = now - 2 * LPM_AGE
            ranked = sorted(((ranks[i] if queued[i] >= starved else _STARVED, window[i])
                             for i in itertools.compress(range(n), mask)), key=itemgetter(0),
                            reverse=True)  # stable: equal ranks stay in arrival order
            aged = [r for _, r in ranked]
            for i in itertools.compress(range(n), mask):
                ranks[i] = -1
        if cold == n and not aged:  # (under pressure, most steps) no hit and none aged: arrival order
            return window + tail
        hits = [(ranks[i], window[i]) for i in itertools.compress(range(n), map(gt, ranks, itertools.repeat(0)))]
        hits.sort(key=itemgetter(0), reverse=True)  # stable: equal ranks stay in arrival order
        return (aged + [r for _, r in hits] + list(itertools.compress(window, map(not_, ranks)))  # rank 0 in order
                + tail)

    def _carry_of(self, request: Request) -> int:
        """The wait ``request`` carries as the next turn of a request admitted after a long wait (one whose prompt its
        own extends; that record is dropped), else 0."""
        prompt = request.prompt_token_ids
        for length in sorted(self._carried_lengths, reverse=True):  # the longest: this conversation's latest turn
            if length < len(prompt):
                wait = self._carried.pop(key := tuple(prompt[:length]), None)
                if wait is not None:
                    self._forget(key)
                    return wait
        return 0

    def _forget(self, key: tuple[int, ...]) -> None:
        self._carried_lengths[len(key)] -= 1
        if not self._carried_lengths[len(key)]:
            del self._carried_lengths[len(key)]

    def _carry(self, request: Request) -> None:
        """Keep the wait of ``request``, admitted now under cache-aware admission, for its next turn if it is long."""
        wait = self._steps - request.queued_at
        if request.queued_at < 0 or wait < LPM_CARRY:
            return
        wait = min(wait, LPM_AGE)  # enough to join aged; more would only grow turn by turn (module docstring)
        key = tuple(request.prompt_token_ids)
        if key not in self._carried:
            self._carried_lengths[len(key)] += 1
        self._carried[key] = wait
        if len(self._carried) > LPM_WINDOW:  # the oldest record goes
            old = next(iter(self._carried))
            del self._carried[old]
            self._forget(old)

    def _displaceable(self, request: Request, running: list[Request]) -> Request | None:
        """Under "priority": the worst-ranked running request when it ranks below ``request``, else None."""
        if not self.by_priority or not running:
            return None
        victim = max(running, key=_RANK)
        return victim if victim.rank > request.rank else None

    def _fits_without(self, request: Request, new: bool, running: list[Request],
                      chunks: dict[Request, ScheduledChunk], budget: int, ratio: float,
                      leaving: list[Request] | None = None) -> bool:
        """Whether ``request`` would be admitted once every running request ranked below it is moved out (their
        blocks no one else holds freed, their chunks' tokens back in the budget, the headroom of the rest); with
        ``leaving``, once those requests are gone instead.

        Why: displacement moves the worst-ranked out one at a time until the request fits; without this check a
        request that cannot fit even then (better-ranked requests hold the room) would move them all out for
        nothing, their room left idle while it waits (SGLang preempts only when the preemptible tokens suffice)."""
        m = self.manager
        victims = [v for v in running if v.rank > request.rank] if leaving is None else leaving
        rest = [v for v in running if v not in victims]
        extra = m.freed_by(victims)
        want = min(_pending(request), budget + sum(chunks[v].num_tokens for v in victims if v in chunks))
        n = m.fit_tokens_new(request, want, extra) if new else m.fit_tokens(request, want, extra)
        if n == 0:
            return False
        if not rest or not ratio:
            return True
        own = m.cycle_growth_new(request, ratio, n) if new else m.cycle_growth(request, ratio, n)
        return not m.short_of(own, m.cycle_headroom(rest, ratio), extra=extra)

    def _room_next_step(self, request: Request, new: bool, running: list[Request],
                        chunks: dict[Request, ScheduledChunk], budget: int, ratio: float) -> bool:
        """Whether ``request`` would be admitted next step without moving anyone out: the running requests that
        decode their last token this step (``max_tokens`` or ``max_seq_len`` reached; a stop is not foreseen) free
        enough room once they finish.

        Why: a request moved out to the host tier is copied there and back. Under the "priority" policy on Gemma 2
        9B's ``mixed`` with a quarter of it urgent, 17 of 55 suspended requests came back the very next step, when a
        finish freed the room anyway: a step of the urgent request's wait saved for two copies of the victim's KV,
        which every running request waits for (BENCHMARKS.md, "Modeled time")."""
        cap = self.manager.options.max_seq_len
        ending = [v for v in running
                  if v.num_computed_tokens == v.num_tokens - 1 and v.num_tokens + 1 >= min(v.max_total_tokens, cap)]
        return bool(ending) and self._fits_without(request, new, running, chunks, budget, ratio, leaving=ending)

    def _overcommits(self, request: Request, running: list[Request], budget: int) -> bool:
        """Whether admitting ``request`` (claiming nothing) beside ``running`` leaves the pools short of every one's
        worst case (V1 would refuse it): the pressure under which admission spreads whole prompts over steps."""
        m = self.manager
        n = m.fit_tokens_new(request, min(_pending(request), budget))
        return n > 0 and m.short_of(m.cycle_growth_new(request, 1.0, n), m.cycle_headroom(running, 1.0))

    def _worst_cases_fit(self, request: Request, running: list[Request], probe: HitProbe | None, asked: bool,
                         start: int, want: int, headroom: list[int] | None) -> bool:
        """Whether ``request`` and every running request fit at their worst cases with the cached shared prefixes
        counted as room (no hold): V1's admission, plus one block a request in each windowed cycle. ``headroom``:
        the running requests' estimate at the step's ratio where it was made (a lower bound of their worst cases)."""
        m = self.manager
        extra = None if probe is None else probe.less(None)
        n = m.fit_tokens_new(request, want, extra, start) if asked else m.fit_tokens(request, want, extra)
        if n == 0:
            return False
        own = m.cycle_growth_new(request, 1.0, n, start) if asked else m.cycle_growth(request, 1.0, n)
        # requests of one length cross a window's block boundary together, and a window straddling a boundary holds
        # one block more than the estimate's whole-block window: without this margin a waiver admitted with 0 blocks
        # to spare suspended a group's follower 6 steps later (BENCHMARKS.md v2stepA49, #345)
        k = len(running) + 1
        own = [x + k if w else x for x, w in zip(own, m.cycle_windowed, strict=True)]
        # the estimate at a ratio <= 1 is at most the worst cases: short with it, short with them (under pressure
        # the hold refuses the head every step, and the worst cases' pass over the running requests is the cost)
        if headroom is not None and m.short_of(own, headroom, extra=extra):
            return False
        return not m.short_of(own, m.cycle_headroom(running, 1.0), extra=extra)

    def _admit(self, candidates: list[Request], waiting: deque[Request], running: list[Request],
               out: SchedulerOutput, chunks: dict[Request, ScheduledChunk], budget: int,
               reasons: list[str], prefilling: list[Request] | None = None) -> tuple[int, bool]:
        """Admit ``candidates`` in order while they fit; the budget left, and whether none was refused.
        ``prefilling``: the running requests that may have a prompt block still to compute (every one if None)."""
        m = self.manager
        ratio = self.new_token_ratio
        # running requests' estimated growth, per life cycle (on first use): every group of a cycle needs the same
        headroom: list[int] | None = None
        others_run, cold = bool(running), False  # cold: a request that claims no cached prefix was admitted
        # the running requests whose prompt has a whole block still to compute: a waiting prompt on that block waits
        # for it (module docstring, "Wait for the prefix in flight"); the admitted join them
        U = m.reuse_unit or m.T  # a hit claims multiples of it: waiting for less gains nothing
        if U == 1:  # a prompt whose last token alone is pending is in flight too, and sits among the decodes
            prefilling = None
        flight = ([s for s in (running if prefilling is None else prefilling)
                   if s.num_computed_tokens + U <= len(s.prompt_token_ids) and s.state is RequestState.RUNNING]
                  if DEFER_IN_FLIGHT and not self.by_priority and m.reuse_off_reason is None else None)
        for r in candidates:
            if r.state is not RequestState.WAITING:
                continue
            if len(running) >= self.max_batch_size or budget == 0:
                return budget, False
            # a prompt on a prefix in flight waits for it, and (first come first served) so does everyone behind it:
            # admitted in its place, they took the room it needs next step (module docstring)
            if flight and _waits_for(r, flight, chunks, U, m.window_keeps, m.cached_prefix_tokens):
                return budget, False
            # one whole prompt per step while the batch's worst cases overcommit the pools (module docstring, "Spread")
            if cold and others_run and m.claims_nothing(r) and self._overcommits(r, running, budget):
                return budget, False
            why = m.never_fits(r)
            if why is not None:
                reasons.append(why)
                continue
            displacing = False  # whether moving out worse-ranked requests was found to make room for r
            while True:
                # a request is asked about before its cache is built where the answer does not need it: one that
                # claims no cached prefix (a long prompt waiting for room), or, under "fcfs", one whose whole-block
                # hit a probe finds (a turn whose history waits for room; or no whole block, though its first
                # tokens start a cached run): a refusal, step after step under
                # pressure, then builds and cancels nothing (priority's displacement asks the built cache)
                new = m.claims_nothing(r)
                # (a None from the probe comes with the cache built, its lookup made once: probe_hit's build)
                probe = None if new or self.by_priority else m.probe_hit(r, build=True)
                if not new and probe is None and not m.has_cache(r):
                    m.create(r)
                    m.resume(r)
                start = probe.tokens if probe is not None else 0  # what the claim would hold (built: it holds it)
                want = min(_pending(r) - start, budget)
                # kept for the next hits on their prefixes
                hold = m.held_back(SHARED_HOLD, max(self._longest, r.num_tokens), probe) if running else None
                asked = new or probe is not None
                while True:
                    extra = hold if probe is None else probe.less(hold)  # built, the claim took blocks from the pools
                    n = m.fit_tokens_new(r, want, extra, start) if asked else m.fit_tokens(r, want, extra)
                    refused, own = n == 0, []
                    if not refused and running and ratio:
                        own = m.cycle_growth_new(r, ratio, n, start) if asked else m.cycle_growth(r, ratio, n)
                        # cheap: when even the bound (>= the estimate) fits, the estimate is not needed; a head the
                        # estimate refused last step goes straight to it (the bound failed then, and most likely
                        # fails again)
                        if headroom is None and (r is self._refused or m.short_of(
                                own, extra=extra, sets=m.growth_bound_sets(r if asked else None, probe))):
                            headroom = m.cycle_headroom(running, ratio)
                        refused = headroom is not None and m.short_of(own, headroom, extra=extra)
                    # the hold never refuses what the worst cases leave room for (module docstring, "... V1's room")
                    if not (refused and hold is not None and HOLD_GIVES_WAY and not self.by_priority
                            and self._worst_cases_fit(r, running, probe, asked, start, want, headroom)):
                        break
                    hold = None
                victim = self._displaceable(r, running) if refused else None
                if victim is not None and not displacing and (
                        not self._fits_without(r, new, running, chunks, budget, ratio)
                        or self._room_next_step(r, new, running, chunks, budget, ratio)):
                    victim = None  # moving out would not make room, or room comes next step anyway: move none
                if victim is None:
                    break
                displacing = True
                # "priority": the room goes to the better-ranked request; the victim waits (suspended or preempted)
                if not new:
                    m.cancel_admission(r)
                if victim in chunks:
                    budget += chunks.pop(victim).num_tokens
                self._move_out(victim, waiting, running, out)
                headroom = None  # the running requests changed
            if refused:
                self._refused = r if headroom is not None else None
                if probe is not None:
                    m.refuse_hit(probe, r)  # what building and cancelling it would leave changed, less a copy's take
                elif not new:
                    m.cancel_admission(r)
                if not chunks:  # the reason is read only when nothing runs this step (report_stall)
                    reasons.append(self._refusal(r, n, own, headroom, ratio))
                return budget, False
            if probe is not None:  # admitted: now build it, claiming what the probe found
                m.admit_hit(probe, r)
            elif new:  # admitted: now build it (claiming nothing, as asked)
                m.create(r)
                m.resume(r)
            if running and ratio and headroom is not None:
                chunk = m.cycle_growth(r, 0.0, n)  # allocated below; the rest of its growth joins the headroom
                for c, k in enumerate(own):
                    headroom[c] += k - chunk[c]
            budget -= self._schedule(r, n, chunks)
            r.state = RequestState.RUNNING
            waiting.remove(r)
            running.append(r)
            self._longest = max(self._longest, r.num_tokens)  # running now: the next admission's hold counts it
            out.admitted.append(r)
            if not self.by_priority:
                self._carry(r)
            if flight is not None and r.num_computed_tokens + U <= len(r.prompt_token_ids):
                flight.append(r)
            cold = cold or new
        return budget, True
