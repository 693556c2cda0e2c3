"""The event bus: numbers events and hands their wire dicts to every subscriber, in order."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import attrs

from pipeline.events import Event

Subscriber = Callable[[dict[str, Any]], None]
Emit = Callable[[Event], dict[str, Any]]


class EventBus:
    """Assigns ``stage`` and a monotonic ``seq`` to each event and fans it out to subscribers."""

    def __init__(self, subscribers: list[Subscriber] | tuple[Subscriber, ...] = ()) -> None:
        self._subscribers: list[Subscriber] = list(subscribers)
        self._seq = 0

    def subscribe(self, subscriber: Subscriber) -> None:
        """Add a subscriber; it sees events emitted from now on."""
        self._subscribers.append(subscriber)

    def unsubscribe(self, subscriber: Subscriber) -> None:
        """Stop sending events to a subscriber (a closed file sink)."""
        self._subscribers.remove(subscriber)

    def emit(self, event: Event, stage: str) -> dict[str, Any]:
        """Publish one event as ``stage``; returns its wire dict, stamped with ``ts`` (ISO 8601, UTC)."""
        record = attrs.evolve(event, stage=stage, seq=self._seq).to_dict()
        # when it happened: metadata beside the event, never part of what a replay or --verify compares
        record["ts"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds")
        self._seq += 1
        for subscriber in self._subscribers:
            subscriber(record)
        return record

    def emitter(self, stage: str) -> Emit:
        """An ``emit(event)`` callable bound to one stage name (what a stage's ``run`` receives)."""
        return lambda event: self.emit(event, stage)
