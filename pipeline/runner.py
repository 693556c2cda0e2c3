"""The pipeline runner: stages in order, each wrapped in started/finished/failed events."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from pipeline.bus import Emit, EventBus
from pipeline.context import Context
from pipeline.converter import unstructure
from pipeline.errors import KvloadError, RankLostError, first_line
from pipeline.events import PipelineFinished, StageFailed, StageFinished, StageStarted
from pipeline.limits import short
from pipeline.ranks import lost_rank_message


class Stage(Protocol):
    """A pipeline stage: a name, and ``run(ctx, emit)``; ``error`` types its unexpected failures."""

    name: str

    def run(self, ctx: Context, emit: Emit) -> None:
        """Read the context, write this stage's outputs, report every change through ``emit``."""


class Pipeline:
    """Runs stages once, in order, over one :class:`Context`; users may pass their own list."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence):  # an int was "'int' object is not
            # iterable"; a generator, read once, "zip() argument 2 is longer than argument 1": neither named stages
            raise TypeError(f"stages: expected a list of stage objects (pipeline.plan_stages(), ...) or a Pipeline, "
                            f"got {short(stages)}")
        names = [getattr(s, "name", None) for s in stages]
        for i, (stage, name) in enumerate(zip(stages, names, strict=True)):
            if not isinstance(name, str) or not name:
                # a stage's name given for the stage (stages=["parse_args", ...]) said only "needs a 'name'"
                got = f"the string {short(stage)}, a name" if isinstance(stage, str) else \
                    f"{short(stage)} (no non-empty string 'name')"
                raise TypeError(f"stages[{i}]: expected a stage object (a non-empty string 'name' and "
                                "run(ctx, emit); kvload's own: pipeline.plan_stages(), or from stages import "
                                f"ParseArgs, ...), got {got}")
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        self.stages = list(stages)

    @property
    def names(self) -> list[str]:
        """Stage names in run order."""
        return [s.name for s in self.stages]

    def run(self, ctx: Context, bus: EventBus) -> Context:
        """Run every stage; on failure emit ``stage_failed``, release what was built, raise a typed error."""
        for stage in self.stages:
            emit = bus.emitter(stage.name)
            emit(StageStarted())
            start = time.perf_counter()
            try:
                stage.run(ctx, emit)
            except BaseException as exc:
                elapsed = (time.perf_counter() - start) * 1000
                typed = exc if isinstance(exc, KvloadError) else _typed(stage, exc)
                if isinstance(exc, (KvloadError, Exception)):
                    emit(StageFailed(error=type(typed).__name__, message=str(typed), duration_ms=round(elapsed, 3)))
                ctx.close()
                if typed is exc:
                    raise
                raise typed from exc
            emit(StageFinished(duration_ms=round((time.perf_counter() - start) * 1000, 3)))
        bus.emit(
            PipelineFinished(
                args=unstructure(ctx.args) if ctx.args is not None else {},
                route=ctx.route.to_dict() if ctx.route is not None else None,
                stages=self.names,
            ),
            "pipeline",
        )
        return ctx


def _typed(stage: Any, exc: BaseException) -> BaseException:
    if not isinstance(exc, Exception):  # KeyboardInterrupt and friends pass through untouched
        return exc
    lost = lost_rank_message(exc)  # a peer rank died in a collective of torch's own (sharding the weights)
    if lost is not None:
        return RankLostError(f"{stage.name}: {lost}")
    error_type = getattr(stage, "error", None)
    if error_type is None:
        return exc
    detail = first_line(exc)
    return error_type(f"{stage.name}: {type(exc).__name__}: {detail}")
