"""What the app serves (``ServeState``: the loaded model, its engine, limits, defaults) and its CORS policy."""

from __future__ import annotations

import time
from typing import Any

import attrs

from engine.serving import ServingEngine
from kvload.serve.command import MAX_CONCURRENT_DEFAULT, READ_TIMEOUT_DEFAULT
from kvload.serve.metrics import ServeMetrics
from kvload.serve.responses_store import ResponseStore


@attrs.frozen
class CorsPolicy:
    """Which browser origins may call the server, with which methods and headers (vLLM's flags and defaults)."""

    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False


@attrs.define
class ServeState:
    """What the app serves: the loaded result, its engine and metrics, the served model name, limits and defaults."""

    result: Any
    engine: ServingEngine
    metrics: ServeMetrics
    model_name: str  # the first served name: every answer's ``model`` (vLLM's rule)
    max_request_bytes: int  # a larger body is refused unread (413); build_state derives it from max_seq_len
    default_max_tokens: int = 256
    #: the model's sampling defaults (``SamplingDefaults.values``): what a request that does not send a field takes
    sampling_defaults: dict[str, Any] = attrs.Factory(dict)
    read_timeout_s: float = READ_TIMEOUT_DEFAULT  # a body not all in by then is a 408 (the head: server._Deadlines)
    max_concurrent_requests: int = MAX_CONCURRENT_DEFAULT  # generation requests in the server at once; more: 503
    #: a request's own chat_template (Jinja run here, its cost the client's to choose) only when the operator says so
    trust_request_chat_template: bool = False
    #: ``POST /reset_prefix_cache`` exists only when the operator says so: any client could otherwise drop every
    #: tenant's cached prefixes, over and over (vLLM keeps it to its dev mode)
    enable_reset_prefix_cache: bool = False
    #: the tool-call parser (``--tool-call-parser``, with ``--enable-auto-tool-choice``) that lets chat's
    #: ``tool_choice`` be ``"auto"``; None: "auto" is refused
    tool_call_parser: str | None = None
    #: the reasoning parser (``--reasoning-parser``) that splits each chat reply into reasoning_content and content;
    #: None: a reply is all content
    reasoning_parser: str | None = None
    #: SHA-256 of each accepted API key (``--api-key``); empty: no key required. Never the keys: no repr shows one
    api_key_digests: tuple[bytes, ...] = attrs.field(default=(), repr=False)
    #: the responses kept for previous_response_id and GET /v1/responses/{id} (``--responses-store-max``)
    responses: ResponseStore = attrs.Factory(ResponseStore)
    #: chat completions' reply role when the request asks for a generation prompt (vLLM's ``--response-role``)
    response_role: str = "assistant"
    #: cross-origin requests from browsers (vLLM's ``--allowed-origins`` ...); None: no CORS headers at all
    cors: CorsPolicy | None = None
    #: logprobs name each token ``token_id:N`` rather than its text (vLLM's ``--return-tokens-as-token-ids``)
    return_tokens_as_token_ids: bool = False
    #: every stream carries usage, in each chunk and a last one, whatever ``stream_options`` says (vLLM's
    #: ``--enable-force-include-usage``)
    force_include_usage: bool = False
    #: the path prefix a proxy keeps in front of every endpoint (vLLM's ``--root-path``); "": none
    root_path: str = ""
    #: the other names a request's ``model`` may give (vLLM's ``--served-model-name A B``: any of them is served)
    aliases: tuple[str, ...] = ()
    #: chat template variables every chat request gets unless it sends its own of that name (vLLM's
    #: ``--default-chat-template-kwargs``, e.g. Qwen3's ``{"enable_thinking": false}``)
    default_chat_template_kwargs: dict[str, Any] = attrs.Factory(dict)
    #: the periodic throughput line (vLLM's "Avg prompt throughput ..."; ``kvload.serve.stats_log``), started and
    #: stopped with the engine; None: no line (``--disable-log-stats``)
    stats_logger: Any = None
    #: every answer carries ``X-Request-Id``, the request's own or a fresh one (vLLM's ``--enable-request-id-headers``)
    request_id_headers: bool = False
    #: the largest request head in bytes (vLLM's ``--h11-max-incomplete-event-size``; None: uvicorn's 16 KiB) and the
    #: most headers one may have (``--h11-max-header-count``; None: no count, the head's size bounds them): 431 past
    h11_max_incomplete_event_size: int | None = None
    h11_max_header_count: int | None = None
    in_flight: int = 0  # generation requests in the server now (only the event loop's thread touches it)
    created: int = attrs.Factory(lambda: int(time.time()))

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name a request's ``model`` may give: the model name first, then its aliases."""
        return (self.model_name, *self.aliases)
