"""What a driver relies on in a step's output: ``ScheduledChunk`` is an immutable value (both schedulers build one per
running request per step, so its constructor is hand-written: it must keep attrs' frozen interface), and speculative
drafts only take the token budget the step's real tokens left, whichever chunks carry them."""

from __future__ import annotations

from collections import deque

import attrs
import pytest

from cache_backends.interface import ScheduledChunk
from cache_backends.request import Request
from cache_backends.v1 import GuaranteedNoEvictScheduler
from cache_backends.v2 import KVCacheV2Scheduler
from tests.kv_v1_support import make_manager as make_v1
from tests.kv_v2_support import full_sliding_layers
from tests.kv_v2_support import make_manager as make_v2


def test_a_scheduled_chunk_is_a_frozen_value_with_its_two_fields():
    r, other = Request("a", [1, 2, 3], 4), Request("b", [1, 2, 3], 4)
    c = ScheduledChunk(r, 3)
    assert (c.request, c.num_tokens) == (r, 3)
    assert ScheduledChunk(request=r, num_tokens=3) == c and hash(ScheduledChunk(r, 3)) == hash(c)
    assert c != ScheduledChunk(r, 4) and c != ScheduledChunk(other, 3) and c != (r, 3)
    assert repr(c) == f"ScheduledChunk(request={r!r}, num_tokens=3)"
    assert [f.name for f in attrs.fields(ScheduledChunk)] == ["request", "num_tokens"]
    assert attrs.evolve(c, num_tokens=5) == ScheduledChunk(r, 5) and c.num_tokens == 3
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        c.num_tokens = 4  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        del c.request  # type: ignore[misc]
    with pytest.raises(TypeError):
        ScheduledChunk(r)  # type: ignore[call-arg]


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_drafts_take_only_the_budget_the_real_tokens_left_in_chunk_order(kind):
    # budget 8: four decoding requests take 4 tokens; of the 4 left, the first drafting chunk takes 3 (all it has),
    # the second the 1 left, the third none; a request without drafts in between changes nothing
    if kind == "v1":
        manager = make_v1(64)
        scheduler = GuaranteedNoEvictScheduler(manager, 8, 8)
    else:
        manager = make_v2(full_sliding_layers(), 64)
        scheduler = KVCacheV2Scheduler(manager, 8, 8)
    requests = [Request(str(i), [10 * i + 1, 10 * i + 2, 10 * i + 3], 20) for i in range(4)]
    waiting, running = deque(requests[:1]), []
    for r in requests[1:]:  # admitted one per step with budget 8: each prefill takes 3 tokens
        waiting.append(r)
    while waiting or any(r.num_computed_tokens < r.num_tokens for r in running):
        out = scheduler.step(waiting, running)
        for c in out.scheduled:
            manager.commit(c.request, c.num_tokens)
    for r in requests:  # each has its prompt computed; one sampled token pending
        r.output_token_ids.append(7)
    drafts = {"0": [1, 2, 3], "1": [], "2": [4, 5, 6], "3": [8, 9]}
    for r in requests:
        r.draft_token_ids = list(drafts[r.req_id])
    out = scheduler.step(waiting, running)
    got = {c.request.req_id: c.num_tokens for c in out.scheduled}
    assert got == {"0": 4, "1": 1, "2": 2, "3": 1}
    assert out.num_tokens == 8
