"""Stage 2: freeze the record of what the user set, and capture every ``"auto"`` before anything mutates."""

from __future__ import annotations

from types import MappingProxyType

from pipeline.bus import Emit
from pipeline.config import AUTO, AUTO_FIELDS
from pipeline.context import AutoOrigin, Context
from pipeline.events import AutoCaptured, UserFieldsSnapshotted
from pipeline.paths import get_in


class SnapshotUserFields:
    """Writes ``ctx.user_fields`` (read-only) and ``ctx.auto_originals``."""

    name = "snapshot_user_fields"

    def run(self, ctx: Context, emit: Emit) -> None:
        """Snapshot user-set paths with raw values and sources; record each field that is ``"auto"`` now."""
        ctx.user_fields = MappingProxyType(dict(ctx.user_values))
        emit(UserFieldsSnapshotted(
            fields={path: {"value": uv.value, "source": uv.source} for path, uv in ctx.user_fields.items()}
        ))
        for path in AUTO_FIELDS:
            if get_in(ctx.args, path) == AUTO:
                user = ctx.user_fields.get(path)
                origin = AutoOrigin(explicit=user is not None, source=user.source if user else "default")
                ctx.auto_originals[path] = origin
                emit(AutoCaptured(field=path, original=AUTO, explicit=origin.explicit, source=origin.source))
