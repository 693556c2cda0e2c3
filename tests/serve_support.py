"""Running ``kvload serve`` inside a test: a loaded result, its server on a free 127.0.0.1 port, clients."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

import pipeline

#: Seconds any single HTTP call of a test may take.
TIMEOUT = 60.0


@attrs.define
class Served:
    """A running server and what it serves."""

    result: Any
    state: Any
    server: Any
    client: openai.OpenAI
    http: httpx.Client

    @property
    def url(self) -> str:
        return self.server.url

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as ``name{label=value,...}`` → value, parsed by prometheus_client."""
        text = self.http.get("/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out


@contextlib.contextmanager
def serving(model: str = "tiny-llama", *, before: Callable[[Any], Any] | None = None,
            state: dict[str, Any] | None = None, **load_kwargs: Any) -> Iterator[Served]:
    """Load ``model`` with weights, run ``before(result)`` (e.g. reference generations), then serve it
    (``state``: keywords of ``build_state``)."""
    from kvload.serve.server import ServerThread, build_state

    load_kwargs.setdefault("kv_cache_config", {"max_tokens": 2048})
    result = pipeline.load(model, load_weights=True, log=False, **load_kwargs)
    try:
        if before is not None:
            before(result)
        served = build_state(result, **(state or {}))
        with ServerThread(served) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
            try:
                yield Served(result, served, server, client, http)
            finally:
                client.close()
    finally:
        result.close()


def wait_for(check: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``check`` until it holds; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        time.sleep(0.05)


@contextlib.contextmanager
def held_at_step(served: Served, step: int) -> Iterator[tuple[Any, Any]]:
    """The engine's forward held at its ``step``-th call from now (1: the next) until the block ends or ``release`` is
    set; yields ``(reached, release)``: events set once it is held (the steps before it ran: their tokens are out)
    and to let it go on. The hold gives up after ``TIMEOUT``, so a failure is not a hang."""
    import threading

    executor = served.state.engine.executor
    forward, reached, release, calls = executor.forward_scored, threading.Event(), threading.Event(), [0]

    def held(*args: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] == step:
            reached.set()
            release.wait(TIMEOUT)
        return forward(*args, **kw)

    executor.forward_scored = held  # an instance attribute shadows the method
    try:
        yield reached, release
    finally:
        release.set()
        executor.forward_scored = forward


def answers_while_held(served: Served, target: Any, name: str, request: Callable[[httpx.Client], Any],
                       check: Callable[[httpx.Client], Any]) -> Any:
    """Hold ``target.name`` (a method the server calls while preparing a request) until ``check`` ran against the
    server from another client, with ``request`` in flight: what a handler that worked on the event loop would
    block. Returns ``request``'s response (the hold gives up after ``TIMEOUT``, so a failure is not a hang)."""
    import threading

    entered, release = threading.Event(), threading.Event()
    original = getattr(target, name)

    def held(*args: Any, **kw: Any) -> Any:
        entered.set()
        release.wait(TIMEOUT)
        return original(*args, **kw)

    results: list[Any] = []

    def call() -> None:
        with httpx.Client(base_url=served.url, timeout=TIMEOUT) as http:
            results.append(request(http))

    own = name in vars(target)  # an instance attribute already (else the hold shadows the class's method)
    setattr(target, name, held)
    thread = threading.Thread(target=call)
    thread.start()
    try:
        assert entered.wait(TIMEOUT)
        with httpx.Client(base_url=served.url, timeout=TIMEOUT / 4) as http:
            check(http)
        assert not release.is_set() and thread.is_alive()  # answered while the request was still held
    finally:
        release.set()
        thread.join(TIMEOUT)
        if own:
            setattr(target, name, original)
        else:
            delattr(target, name)
    (response,) = results
    return response


def fails_once(monkeypatch: Any, owner: object, name: str, exc: BaseException) -> None:
    """``owner.name`` raises ``exc`` on its first call, then works (a fault injected into one engine step)."""
    real, calls = getattr(owner, name), []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(None)
        if len(calls) == 1:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


def aborted_on_submit(monkeypatch: Any, engine: Any) -> None:
    """Every request the engine takes is aborted at once, as a server stop ends each request in flight
    (``ServingEngine._fail_all``, finish reason ``"abort"``)."""
    submit = engine.submit_group

    def stopped(*args: Any, **kwargs: Any) -> list[str]:
        rids = submit(*args, **kwargs)
        for rid in rids:
            engine.abort(rid)
        return rids

    monkeypatch.setattr(engine, "submit_group", stopped)


class Script:
    """A scripted model in a served engine (or any object with its ``executor`` and ``tokenizer``, as ``kvload.LLM``'s
    result): every reply is the text last given to :meth:`say`, token by token, then the end-of-sequence token. The
    model's own logits still come out, but for the scripted token, raised above them all (greedy and any sampling pick
    it; logprobs stay real numbers), so everything after the forward (penalties, sampling, logprobs, text, the server)
    is what serves a real model. With speculative drafts, row ``j`` of a request raises the token ``j`` places on."""

    def __init__(self, engine: Any) -> None:
        self.tokenizer = engine.tokenizer
        self.eos = self.tokenizer.eos_token_id
        self.ids: list[int] = []
        executor = engine.executor
        forward = executor.forward_scored

        def scripted(out: Any, live: Any) -> Any:
            logits, rows, counts = forward(out, live)
            if logits is None:
                return logits, rows, counts
            logits = logits.clone()  # the forward's is an inference tensor: not to be written outside its mode
            row = 0
            for i, count in zip(rows, counts, strict=True):
                done = len(out.scheduled[i].request.output_token_ids)
                for j in range(count):  # row j follows j drafts: past a wrong draft verification stops anyway
                    token = self.ids[done + j] if done + j < len(self.ids) else self.eos
                    logits[row, token] = logits[row].max() + 20.0
                    row += 1
            return logits, rows, counts

        executor.forward_scored = scripted  # the serving loop's forward (an instance attribute shadows the method)

    def say(self, text: str) -> list[int]:
        """Script every reply from now on as ``text``; its token ids (the end-of-sequence token follows them)."""
        self.ids = self.tokenizer.encode(text, add_special_tokens=False)
        assert self.tokenizer.decode(self.ids) == text, "the tokenizer cannot spell the script exactly"
        return list(self.ids)


def typed_events(served: Served, path: str, body: dict[str, Any], models: Any) -> list[Any]:
    """POST a streamed request and read its server-sent events, each validated by ``models`` (a pydantic
    ``TypeAdapter`` of the client SDK's event union) and named by its own ``type``, as OpenAI's Responses API and
    Anthropic's Messages API send them."""
    out = []
    with served.http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                event = models.validate_python(json.loads(line[6:]))
                assert event.type == kind  # the SSE event name is the event's type
                out.append(event)
    return out


def answered_meanwhile(served: Served, monkeypatch: Any, path: str, big_body: dict[str, Any], small_path: str,
                       small_body: dict[str, Any], hold: str = "__call__"
                       ) -> tuple[httpx.Response, httpx.Response, list[str]]:
    """``big_body`` posted to ``path``, its long text's tokenizing (``hold`` "apply_chat_template": its long
    conversation's templating) held until a small request (``small_body`` to ``small_path``) is answered, or until
    that request waits at the parse gate behind it; (the big answer, the small one, the order of "small answered" and
    "big tokenized")."""
    gate = served.server.server.config.app.state.parse_gate
    tok = served.state.engine.tokenizer
    real = getattr(type(tok), hold)
    entered = threading.Event()
    order: list[str] = []

    def held(self: Any, text: Any, *args: Any, **kwargs: Any) -> Any:
        if len(text if isinstance(text, str) else repr(text) if hold != "__call__" else "") > 65536:
            entered.set()
            # the small request answered meanwhile, or (main) queued at the gate this tokenizing holds
            for _ in range(int(TIMEOUT / 0.01)):
                if "small answered" in order or gate.waiting():
                    break
                time.sleep(0.01)
            order.append("big tokenized")
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tok), hold, held)
    answers: dict[str, httpx.Response] = {}

    def send_big() -> None:
        with httpx.Client(base_url=served.url, timeout=TIMEOUT) as http:
            answers["big"] = http.post(path, json=big_body)

    big = threading.Thread(target=send_big)
    big.start()
    try:
        while big.is_alive() and not entered.wait(0.05):
            pass
        assert entered.is_set(), answers["big"].text[:300]  # its long text tokenized
        with httpx.Client(base_url=served.url, timeout=TIMEOUT) as http:
            small = http.post(small_path, json=small_body)
        order.append("small answered")
    finally:
        big.join(TIMEOUT)
    monkeypatch.setattr(type(tok), hold, real)
    return answers["big"], small, order
