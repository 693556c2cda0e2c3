"""Stage 5: pick the KV manager and scheduler from the resolved tri-state, then freeze the args."""

from __future__ import annotations

from cache_backends.kinds import kind_for
from pipeline.bus import Emit
from pipeline.config import V2_FIELD as V2
from pipeline.config import freeze, set_field
from pipeline.context import Context, Route
from pipeline.errors import RouteError
from pipeline.events import ExecutorRouted, RouteFallback, SettingIgnored

#: V2-only settings: harmless under V1, but a user who set them should hear they do nothing.
_V2_ONLY = {
    "kv_cache_config.host_cache_size": "V1 has no host tier",
    "kv_cache_config.max_util_for_resume": "V1 never suspends or resumes",
    "kv_cache_config.enable_swa_scratch_reuse": "V1 keeps no per-window pools",
    "kv_cache_config.enable_partial_reuse": "V1 reuses full blocks only",
    "kv_cache_config.max_page_padding": "V1 keeps one uniform pool, no arena of layer groups to cut into pages",
}

#: Settings of the forward pass and of sampling, each with what acts on it: a caller whose pools are unbacked
#: (``kvload simulate``, ``engine.simulator.simulate``) runs no model, so a user who set one must hear it does nothing.
_FORWARD_ONLY = {
    "attention_backend": "kvload generate, serve and kvload.LLM attend through it",
    "linear_backend": "kvload generate, serve and kvload.LLM compute the projections through it",
    "max_draft_len": "drafts are verified by a forward pass; the replay commits one token per decode and step",
    "max_matching_ngram_size": "it shapes the n-gram drafts of generation",
    "speculation_max_batch_size": "it bounds the n-gram drafts of generation",
    "generation_config": "it sets the sampling defaults of generation",
    "override_generation_config": "it sets the sampling defaults of generation",
    "weights_seed": "it seeds a preset's random weights",
}


class RouteExecutor:
    """Writes ``ctx.route``; the only stage that may change the tri-state after ``resolve_auto``."""

    name = "route_executor"
    error = RouteError

    def run(self, ctx: Context, emit: Emit) -> None:
        """Apply the routing rules (true: V2; false: V1; beam search: V1 unless V2 was the user's), then freeze args."""
        kv = ctx.args.kv_cache_config
        v2 = kv.use_kv_cache_manager_v2
        if v2 is not True and v2 is not False:  # identity, never truthiness: "auto" is a truthy string
            raise RouteError(f"{V2}: still {v2!r} at routing; resolve_auto must run before route_executor")
        user = ctx.user_fields.get(V2)
        user_set = user is not None and user.value is v2  # an explicit true/false, not an explicit "auto"
        needs_v2 = ctx.model.v2_required if ctx.model is not None else None
        beams = ctx.args.max_beam_width
        origin = f"set by the user via {user.source}" if user_set else self._origin(ctx)

        if v2 is False and needs_v2:
            raise RouteError(
                f"{V2}=false ({origin}) cannot serve this model: {needs_v2}; remove the setting or set it to true"
            )
        fallback_reason = None
        if v2 is True and beams > 1:
            if user_set:
                raise RouteError(
                    f"{V2}=true ({origin}) cannot serve beam search (max_beam_width={beams}): KV cache manager V2 "
                    "has no beam support; set max_beam_width to 1 or use_kv_cache_manager_v2 to false"
                )
            if needs_v2:
                raise RouteError(
                    f"max_beam_width={beams}: {needs_v2}, and V2 has no beam support; set max_beam_width to 1"
                )
            fallback_reason = f"V2 ({origin}) has no beam support and max_beam_width={beams}; falling back to V1"
            set_field(ctx.args, V2, False)
            emit(RouteFallback(field=V2, old=True, new=False, source="route", reason=fallback_reason))
            v2 = False

        kind = kind_for(v2)
        manager, scheduler = kind.manager, kind.scheduler
        reason = fallback_reason or f"{V2}={'true' if v2 else 'false'} ({origin}): {kind.summary}"
        ctx.route = Route(manager, scheduler, v2, reason, fallback_reason is not None)
        emit(ExecutorRouted(kv_manager=manager, scheduler=scheduler, use_kv_cache_manager_v2=v2, reason=reason))
        self._warn_ignored(ctx, emit, v2)
        freeze(ctx.args)

    @staticmethod
    def _origin(ctx: Context) -> str:
        if V2 in ctx.model_defaults:
            return f"model default of {ctx.spec.name}"
        return "resolved from \"auto\""

    @staticmethod
    def _warn_ignored(ctx: Context, emit: Emit, v2: bool) -> None:
        kv = ctx.args.kv_cache_config
        asked = set(ctx.user_fields) | set(ctx.model_defaults)
        if "max_beam_width" in ctx.user_fields and ctx.args.max_beam_width > 1:
            # routed (V1 can hold beams) and it bounds LLM.beam_search, but the pools are not sized by it as
            # TensorRT-LLM's would be, and generate still returns one sequence per prompt: the user must hear that
            emit(SettingIgnored(field="max_beam_width", value=ctx.args.max_beam_width,
                                reason="the KV pools are not sized for beams (beams share their blocks by forking, and "
                                       "prefix cache) and generate returns one sequence per prompt; it bounds "
                                       "LLM.beam_search's beam_width (and kvload serve's n with use_beam_search)"))
        drafts_off = ctx.args.max_draft_len == 0
        if drafts_off:
            for path in ("max_matching_ngram_size", "speculation_max_batch_size"):
                if path in ctx.user_fields:
                    emit(SettingIgnored(field=path, value=getattr(ctx.args, path),
                                        reason="speculative decoding is off (max_draft_len=0)"))
        if ctx.request is not None and ctx.request.pools_unbacked:
            for path, user in ctx.user_fields.items():
                key = path.split(".", 1)[0]
                if key not in _FORWARD_ONLY or (drafts_off and key in ("max_draft_len", "max_matching_ngram_size",
                                                                        "speculation_max_batch_size")):
                    continue  # drafts off: max_draft_len 0 asks nothing, the other two are said just above
                emit(SettingIgnored(field=path, value=user.value, reason=(
                    f"a simulation replays the scheduler's and KV manager's decisions with no forward pass or "
                    f"sampling; {_FORWARD_ONLY[key]}")))
        if not v2 and ctx.args.scheduling_policy == "priority" and "scheduling_policy" in ctx.user_fields:
            # it acts (admission order) but only in part: the user must hear which part cannot
            emit(SettingIgnored(field="scheduling_policy", value="priority",
                                reason="in part: V1's GuaranteedNoEvictScheduler never preempts, so priority orders "
                                       "admission only and a better-ranked request never displaces a running one "
                                       "(routed to KVCacheManager; V2 does both)"))
        if not v2:
            for path, why in _V2_ONLY.items():
                value = getattr(kv, path.rsplit(".", 1)[1])
                if path in asked and value not in (None, False):
                    emit(SettingIgnored(field=path, value=value, reason=f"{why} (routed to KVCacheManager)"))
        elif not kv.enable_block_reuse and kv.enable_partial_reuse and "kv_cache_config.enable_partial_reuse" in asked:
            emit(SettingIgnored(field="kv_cache_config.enable_partial_reuse", value=True,
                                reason="partial reuse needs enable_block_reuse=true"))
