"""``kvload serve``: the subcommand's flags and what it does (imports the web stack only when it runs)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from engine.reasoning import PARSERS
from kvload.metrics import METRIC_NAMINGS
from pipeline.limits import MAX_INT
from pipeline.text import one_line

#: ``kv_cache_config.event_buffer_max_size`` when ``--kv-events-config`` turns events on and nothing set it
EVENT_BUFFER_FIELD = "kv_cache_config.event_buffer_max_size"
EVENT_BUFFER_DEFAULT = 10_000

#: ``max_tokens`` of a request that gives none, when neither ``--default-max-tokens`` nor the model's
#: generation_config.json (max_new_tokens) says.
DEFAULT_MAX_TOKENS = 256
#: Sequences of ``--default-max-tokens`` + this many prompt tokens that the CPU default KV budget holds.
SERVE_DEFAULT_SEQUENCES = 8
SERVE_PROMPT_ALLOWANCE = 1024
#: Request-time audit records a server keeps in memory by default (a few hundred bytes each).
AUDIT_KEEP_DEFAULT = 100_000
#: Seconds a client has to send a request's head, and then its body (``--request-read-timeout``).
READ_TIMEOUT_DEFAULT = 30.0
#: The longest read timeout taken (a day): a longer one is no longer a timeout anyone means.
MAX_TIMEOUT_S = 86400.0
#: Generation requests a server holds at once by default (``--max-concurrent-requests``); more get 503.
MAX_CONCURRENT_DEFAULT = 256
#: Responses ``/v1/responses`` keeps by default (``--responses-store-max``), the least recently used dropped past it.
RESPONSES_STORE_MAX_DEFAULT = 1000
#: The tool-call parsers ``--tool-call-parser`` takes (vLLM's names; ``kvload.serve.tool_parser`` reads them).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic", "llama4_pythonic")
#: trtllm-serve's ``--tool_parser`` names → kvload's reader of the same format: TensorRT-LLM's qwen3 reads
#: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, vLLM's hermes format (its other parsers,
#: qwen3_coder's XML, kimi_k2's, deepseek_v3's, ... read formats kvload has no reader for)
TRTLLM_TOOL_PARSERS = {"qwen3": "hermes"}
#: The reasoning parsers ``--reasoning-parser`` takes (vLLM's names; ``engine.reasoning`` reads them).
REASONING_PARSERS = PARSERS

_EPILOG = """\
Endpoints (OpenAI-compatible): POST /v1/completions, POST /v1/chat/completions (stream=true for
server-sent events), POST /v1/responses (OpenAI's Responses API, run as chat; GET and DELETE
/v1/responses/{id} for the --responses-store-max newest kept), GET /v1/models,
/v1/models/{id}, /health, /version, /metrics (Prometheus,
kvload_*), POST /v1/embeddings, vLLM's POST /score and /rerank (the cosine of two
embeddings; a one-label classifier scores each pair through its head), vLLM's POST /classify (a
*ForSequenceClassification checkpoint's class probabilities; a *ForTokenClassification one's at the
last token), vLLM's POST /pooling (by task: every prompt
token's class probabilities or hidden state, or the pooled ones), vLLM's POST /tokenize and /detokenize,
GET /load ({"server_load": N}) and
SageMaker's GET|POST /ping and POST /invocations (a chat, completions, embeddings or classify, rerank, score or
pooling body, picked by its fields as vLLM does), and kvload's own
GET /v1/kvload/audit (the load's audit log as JSON Lines, generation events included),
GET /v1/kvload/explain?field=NAME (one field's provenance chain), GET /v1/kvload/kv_events.

Sampling defaults follow kvload generate: a field the request does not send takes the model's
generation_config.json value (--generation-config vllm: none), else kvload's: greedy (temperature 0);
max_tokens defaults to --default-max-tokens, else the model's max_new_tokens, else 256. A request body larger than
--max-request-bytes is refused with HTTP 413 before it is read; a request whose headers, or then
body, take longer than --request-read-timeout to arrive gets HTTP 408 and its connection closed;
past --max-concurrent-requests completion requests at once, more get HTTP 503 at once.
Every request joins one engine loop (continuous batching); a client that disconnects has its
request aborted and its KV blocks freed. Should that loop itself fail (a bug), the requests in flight get
HTTP 500 naming it and the server exits 1 (SIGINT/SIGTERM/SIGHUP: exit 0), for its supervisor to restart.

API key: --api-key KEY (--api-key KEY MODEL works), else $KVLOAD_API_KEY, else $VLLM_API_KEY: every path but /health,
/metrics and /version then needs 'Authorization: Bearer KEY' (HTTP 401 otherwise). Prefer the
variable: a key on the command line shows in ps. The audit names where the key came from, never it.

KV budget: on CPU with neither --max_tokens nor --max_gpu_total_bytes, the pools hold
8 x (--default-max-tokens + 1024) tokens, at most 8 x max_seq_len (the kv_budget_computed event says so).

examples:
  kvload serve smollm2-135m --port 8000
  curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]}'
  kvload serve tiny-llama --max_tokens 8192 --use_kv_cache_manager_v2 true
  KVLOAD_API_KEY=$(cat key.txt) kvload serve smollm2-135m --host 0.0.0.0
  kvload serve smollm2-135m --uds /run/kvload/kvload.sock   # curl --unix-socket /run/kvload/kvload.sock http://x/health
  kvload serve tiny-llama -tp 2      # starts 2 ranks: rank 0 serves, rank 1 follows it (under torchrun too)
"""


def add_serve_command(sub: Any) -> None:
    """``serve``: load, build the routed KV manager, answer OpenAI-style HTTP requests."""
    from kvload.cli.flags import _underscored, add_model_flags
    from kvload.cli.parser import HelpFormatter
    from kvload.cli.values import _bounded, at_least, integer, json_object, number, size

    p = sub.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API (continuous batching)",
        formatter_class=HelpFormatter, epilog=_EPILOG,
        description="Run all stages with weights, then serve OpenAI-compatible completions and chat "
                    "completions through the routed KV cache manager, with Prometheus metrics and the audit "
                    "log over HTTP. Needs the serve extra: pip install 'kvload[serve]'.")
    add_model_flags(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", action=_Given, help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", default=8000, metavar="N", action=_Given,
                   type=_bounded(integer, lambda v: 0 <= v <= 65535, "an integer in [0, 65535]"),
                   help="TCP port (default 8000; 0 = any free port)")
    g.add_argument("--uds", default=None, metavar="PATH",
                   help="listen on this Unix domain socket instead of --host/--port, which are then ignored (vLLM's "
                        "flag): its directory must exist; a socket file a killed server left is replaced, anything "
                        "else at PATH is refused; the file is removed when the server stops. Who may connect follows "
                        "the file's permissions (the umask; vLLM's too). With --ssl-certfile it serves HTTPS over it")
    g.add_argument("--served-model-name", "--served_model_name", dest="served_model_name", default=None,
                   metavar="NAME", type=_model_name, nargs="+",
                   help="the model name clients send and /v1/models lists (default: MODEL's name); several, as vLLM "
                        "takes them: a request may give any, answers and metrics carry the first")
    g.add_argument("--default-max-tokens", "--default_max_tokens", dest="default_max_tokens", default=None,
                   metavar="N", type=at_least(1),
                   help=f"max_tokens of a request that gives none (default: the model's max_new_tokens from its "
                        f"generation_config.json, else {DEFAULT_MAX_TOKENS}; never past max_seq_len)")
    g.add_argument("--kv-events-file", "--kv_events_file", dest="kv_events_file", default=None, metavar="FILE.jsonl",
                   help="also append every KV cache event to this file as it happens (needs "
                        "--event_buffer_max_size N > 0)")
    g.add_argument("--kv-events-config", "--kv_events_config", dest="kv_events_config", default=None,
                   metavar="JSON", type=json_object,
                   help="vLLM's KV events config: publish the KV cache events as vLLM does, e.g. "
                        "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
                        "\"tcp://*:5557\"}' (keys: enable_kv_cache_events, publisher null|zmq (default zmq when "
                        "events are on, as in vLLM), endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, "
                        "topic; zmq needs kvload[kv-events])")
    g.add_argument("--seed", default=0, metavar="S",
                   type=_bounded(integer, lambda v: 0 <= v < 2**63, "an integer from 0 to 2**63 - 1"),
                   help="vLLM's: sampled requests that send no seed draw theirs from this seed's sequence, so the "
                        "same requests in the same order sample the same after a restart (default 0, as vLLM's V1 "
                        "engine; another seed, e.g. --seed $RANDOM, gives other draws)")
    tls = p.add_argument_group("HTTPS (vLLM's flags; uvicorn serves TLS)")
    tls.add_argument("--ssl-certfile", "--ssl_certfile", dest="ssl_certfile", default=None, metavar="CERT",
                     help="serve HTTPS with this PEM certificate (chain); the key in --ssl-keyfile, or in this file")
    tls.add_argument("--ssl-keyfile", "--ssl_keyfile", dest="ssl_keyfile", default=None, metavar="KEY",
                     help="the certificate's PEM private key (unencrypted)")
    tls.add_argument("--ssl-ca-certs", "--ssl_ca_certs", dest="ssl_ca_certs", default=None, metavar="CA",
                     help="PEM certificates client certificates are checked against (with --ssl-cert-reqs)")
    tls.add_argument("--ssl-cert-reqs", "--ssl_cert_reqs", dest="ssl_cert_reqs", default=None, metavar="{0,1,2}",
                     type=_tls_cert_reqs, help="client certificates: 0 none (default), 1 optional, 2 required "
                                               "(Python's ssl.CERT_*)")
    cors = p.add_argument_group("cross-origin requests from browsers (CORS; vLLM's flags and defaults)")
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "headers")):
        cors.add_argument(flag, _underscored(flag), default=None, metavar="JSON", type=_CORS_LISTS[what],
                          help=f"the {what} allowed, a JSON list of strings (default [\"*\"]: any)")
    cors.add_argument("--allow-credentials", "--allow_credentials", dest="allow_credentials", action="store_true",
                      help="let browsers send cookies and HTTP authentication (default: not)")
    g.add_argument("--default-chat-template-kwargs", "--default_chat_template_kwargs",
                   dest="default_chat_template_kwargs", default=None, metavar="JSON", type=json_object,
                   help="chat template variables every chat request gets unless it sends its own of that name, as a "
                        "JSON object, e.g. '{\"enable_thinking\": false}' for Qwen3 (vLLM's flag)")
    g.add_argument("--response-role", "--response_role", dest="response_role", default="assistant", metavar="ROLE",
                   type=_role, help="chat completions' reply role when the request asks for a generation prompt "
                                    "(vLLM's flag; default %(default)s)")
    g.add_argument("--return-tokens-as-token-ids", "--return_tokens_as_token_ids", dest="return_tokens_as_token_ids",
                   action="store_true", help="logprobs name each token 'token_id:N' rather than its text, for tokens "
                                             "whose text JSON cannot carry (vLLM's flag)")
    g.add_argument("--enable-force-include-usage", "--enable_force_include_usage", dest="enable_force_include_usage",
                   action="store_true", help="every stream carries usage, in each chunk and a last one, whatever "
                                             "stream_options says (vLLM's flag)")
    for key in ("return_tokens_as_token_ids", "enable_force_include_usage"):  # vLLM's --X/--no-X switches
        g.add_argument("--no-" + key.replace("_", "-"), "--no_" + key, dest=key, action="store_false",
                       help=argparse.SUPPRESS)
    g.add_argument("--root-path", "--root_path", dest="root_path", default="", metavar="/PREFIX", type=_root_path,
                   help="the path prefix a proxy keeps in front of the endpoints: /PREFIX/v1/models is served as "
                        "/v1/models (which still answers too; vLLM's flag)")
    g.add_argument("--uvicorn-log-level", "--uvicorn_log_level", dest="uvicorn_log_level", default=None,
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="uvicorn's log level (vLLM's flag; default: --log-level's); info and below log a line "
                        "per HTTP request")
    g.add_argument("--disable-uvicorn-access-log", "--disable_uvicorn_access_log", dest="disable_uvicorn_access_log",
                   action="store_true", help="no line per HTTP request, whatever the log level (vLLM's flag)")
    g.add_argument("--enable-request-id-headers", "--enable_request_id_headers", dest="enable_request_id_headers",
                   action="store_true", help="every answer carries an X-Request-Id header: the request's own, else a "
                                             "fresh id (vLLM's flag)")
    g.add_argument("--h11-max-incomplete-event-size", "--h11_max_incomplete_event_size",
                   dest="h11_max_incomplete_event_size", default=None, metavar="BYTES",
                   type=at_least(1),
                   help="the largest request head (request line and headers) in bytes; a larger one gets HTTP 431 "
                        "(vLLM's flag; default uvicorn's 16384)")
    g.add_argument("--h11-max-header-count", "--h11_max_header_count", dest="h11_max_header_count", default=None,
                   metavar="N", type=at_least(1),
                   help="the most headers a request may have; more get HTTP 431 (vLLM's flag; default: no count, "
                        "the head's size bounds them)")
    # vLLM's front-end flags kvload serve cannot honour: parsed, so the refusal is one line saying why (cmd_serve)
    g.add_argument("--api-server-count", "--api_server_count", "-asc", dest="api_server_count", default=None,
                   metavar="N", type=integer, help=argparse.SUPPRESS)
    g.add_argument("--middleware", action="append", default=None, metavar="IMPORT_PATH", help=argparse.SUPPRESS)
    for flag in ("--disable-log-requests", "--enable-log-requests", "--enable-prompt-tokens-details",
                 "--disable-fastapi-docs", "--disable-frontend-multiprocessing", "--enable-server-load-tracking",
                 "--enable-log-outputs", "--log-error-stack"):
        g.add_argument(flag, _underscored(flag), action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--guided-decoding-backend", "--guided_decoding_backend", dest="guided_decoding_backend",
                   default=None, metavar="NAME", choices=("auto", "xgrammar"), help=argparse.SUPPRESS)
    g.add_argument("--chat-template-content-format", "--chat_template_content_format",
                   dest="chat_template_content_format", default="auto", choices=("auto", "string", "openai"),
                   help="how a chat message's content reaches the chat template (vLLM's flag): string (text parts "
                        "joined by newlines), openai (the list of {\"type\": \"text\", \"text\": ...} parts; a "
                        "string is one part) or auto (default): openai for a template that loops over a message's "
                        "content, else string")
    g.add_argument("--max-log-len", "--max_log_len", dest="max_log_len", default=None, metavar="N",
                   type=at_least(0), help=argparse.SUPPRESS)
    g.add_argument("--audit-keep", "--audit_keep", dest="audit_keep", default=AUDIT_KEEP_DEFAULT, metavar="N",
                   type=at_least(0),
                   help="request-time audit records (request_admitted, request_finished, ...) kept in memory for "
                        "GET /v1/kvload/audit, the newest; the load's are always kept and --audit-log FILE gets "
                        "every record (default %(default)s, a few hundred bytes each)")
    g.add_argument("--max-request-bytes", "--max_request_bytes", dest="max_request_bytes", default=None,
                   metavar="BYTES", type=_bounded(size, lambda v: v >= 1,
                                                  "a byte count >= 1 such as 1048576 or 64MiB"),
                   help="refuse a request body larger than this with HTTP 413, before reading it (default: "
                        "what 1024 prompts of max_seq_len tokens can take, 16 bytes a token, plus 1 MiB; "
                        "64MiB = 64*2**20)")
    g.add_argument("--request-read-timeout", "--request_read_timeout", dest="request_read_timeout",
                   default=READ_TIMEOUT_DEFAULT, metavar="SECONDS",
                   type=_bounded(number, lambda v: 0 < v <= MAX_TIMEOUT_S,
                                 f"seconds in (0, {MAX_TIMEOUT_S:g}]"),
                   help="a client gets this long to send a request's headers, and again this long for its body; "
                        "past either, HTTP 408 and the connection closes, so a client that stops sending or "
                        "trickles holds nothing (default %(default)g)")
    g.add_argument("--max-concurrent-requests", "--max_concurrent_requests", dest="max_concurrent_requests",
                   default=MAX_CONCURRENT_DEFAULT, metavar="N",
                   type=at_least(1),
                   help="completion, chat, responses, messages and (de)tokenize requests the server holds at once, "
                        "from their headers until their answer ends (queued for the engine included); more get HTTP "
                        "503 at once, before their body is read, and /health and /metrics keep answering "
                        "(default %(default)s)")
    g.add_argument("--responses-store-max", "--responses_store_max", dest="responses_store_max",
                   default=RESPONSES_STORE_MAX_DEFAULT, metavar="N",
                   type=at_least(0),
                   help="responses of POST /v1/responses kept in memory (all but those sent with store: false, as "
                        "OpenAI keeps them) for previous_response_id and GET/DELETE /v1/responses/{id}; past N the "
                        "least recently used is dropped (kvload_responses_evicted_total counts them); 0 keeps none "
                        "(default %(default)s)")
    g.add_argument("--chat-template", "--chat_template", dest="chat_template", default=None,
                   metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) for every chat request in place "
                        "of the tokenizer's, e.g. for a base model without one (vLLM's flag)")
    g.add_argument("--trust-request-chat-template", "--trust_request_chat_template",
                   dest="trust_request_chat_template", action="store_true",
                   help="accept a request's own chat_template (Jinja the server runs, as slow as the client "
                        "writes it, up to 1,000,000 steps or 5 s, like every template); without it such a request "
                        "gets HTTP 400 and the model's template applies to every other (vLLM's flag)")
    g.add_argument("--enable-reset-prefix-cache", "--enable_reset_prefix_cache", dest="enable_reset_prefix_cache",
                   action="store_true",
                   help="serve POST /reset_prefix_cache (vLLM's, there in dev mode only): drops every cached prefix, "
                        "for benchmarks between runs; off by default, as any client could drop everyone's cache")
    g.add_argument("--metrics-name-prefix", "--metrics_name_prefix", dest="metrics_name_prefix", default="kvload",
                   metavar="{kvload,vllm}", type=_metrics_name_prefix,
                   help="names of GET /metrics' series: kvload (default: kvload_num_requests_waiting{model_name}) "
                        "or vllm: vLLM's own names and labels (vllm:num_requests_waiting{model_name,engine=\"0\"}), "
                        "so vLLM's Grafana dashboard, alerts and autoscalers read kvload unchanged; series vLLM has "
                        "no name for keep their kvload_ name")
    g.add_argument("--enable-auto-tool-choice", "--enable_auto_tool_choice", dest="enable_auto_tool_choice",
                   action="store_true",
                   help='serve chat\'s tool_choice "auto" (and tools without a tool_choice, which means it): the '
                        "reply is free text, read for tool calls by --tool-call-parser (vLLM's flag; needs it). "
                        'Without it such a request gets HTTP 400; "none", "required" and a named function need no '
                        "parser")
    g.add_argument("--tool-call-parser", "--tool_call_parser", dest="tool_call_parser", default=None, metavar="NAME",
                   type=_tool_call_parser,
                   help="how an \"auto\" reply's tool calls are read (vLLM's flag; needs --enable-auto-tool-choice): "
                        "hermes: each <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> block, as "
                        "Qwen2.5, Hermes and SmolLM2-style chat templates ask for; llama3_json: a reply of "
                        "{\"name\": ..., \"parameters\": {...}} objects separated by ';' (Llama 3.1/3.2); "
                        "pythonic: a reply that is a Python list of calls, [f(a=1), g()] (Llama 3.2/4, ToolACE)")
    g.add_argument("--tool_parser", "--tool-parser", dest="trtllm_tool_parser", default=None, metavar="NAME",
                   type=_trtllm_tool_parser,
                   help="trtllm-serve's flag: qwen3 reads an \"auto\" reply's <tool_call> JSON blocks, as "
                        "--enable-auto-tool-choice --tool-call-parser hermes does (TensorRT-LLM serves tool calls "
                        "whenever its parser is set)")
    g.add_argument("--reasoning-parser", "--reasoning_parser", dest="reasoning_parser", default=None, metavar="NAME",
                   type=_reasoning_parser,
                   help="split each chat reply into the model's thinking (message.reasoning_content, streamed as "
                        "delta.reasoning_content) and its answer (content), at <think> ... </think> (vLLM's flag). "
                        "deepseek_r1: everything up to </think> is thinking (the <think> is usually in the prompt; "
                        "no </think> at all: all thinking), for DeepSeek-R1, QwQ and Qwen3 thinking models; qwen3: "
                        "thinking only from a <think> the model writes, none under chat_template_kwargs "
                        "{\"enable_thinking\": false}. Completions are not split; tool calls are read from the "
                        "answer only; response_format, structured_outputs and a named or \"required\" tool_choice "
                        "get HTTP 400 on such a chat reply. TensorRT-LLM's deepseek-r1 is deepseek_r1; the --config "
                        "file's reasoning_parser acts as this flag, which beats it")
    g.add_argument("--api-key", "--api_key", dest="api_key", default=None, metavar="KEY", nargs="+",
                   action=_ApiKeys,
                   help="require 'Authorization: Bearer KEY' (any KEY given; repeat the flag, or list several as "
                        "vLLM takes them) on every path but /health, /metrics and /version, else HTTP 401 (vLLM's "
                        "flag). `--api-key KEY MODEL` works: with no MODEL before, the last value is MODEL. A key on "
                        "the command line shows in ps to every user of the machine: prefer $KVLOAD_API_KEY (one key; "
                        "vLLM's $VLLM_API_KEY is read when neither is given). --api-key=KEY takes exactly one (a key "
                        "may start with '-'). The audit says where the key came from, never the key")
    p.set_defaults(func=cmd_serve)
    # MODEL may come last in --api-key's values (`--api-key KEY MODEL`): optional to argparse (add_model_flags), and
    # required by _finish
    p.finish = _finish


class _Given(argparse.Action):
    """Store the value and note the flag as given on the command line (``--uds`` reports the --host/--port it
    ignores, and only those the operator set)."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(ns, self.dest, values)
        ns.listen_given = {**getattr(ns, "listen_given", {}), f"--{self.dest}": values}


class _ApiKeys(argparse.Action):
    """``--api-key``'s values, each use adding to the list (checked in :func:`_finish`, once MODEL is known)."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        keys = [*(getattr(ns, self.dest) or []), *values]
        setattr(ns, self.dest, keys)
        # where each use's values end and how many it took: MODEL may be the last of a use's values, and a later
        # use (`--api-key K MODEL --api-key K2`) must not hide it
        ns.api_key_runs = [*getattr(ns, "api_key_runs", []), (len(keys), len(values))]


def _finish(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    from kvload.cli.flags import take_model_option

    """MODEL, else the last value of the one ``--api-key KEY ... MODEL`` that took more than one (argparse's
    nargs="+" took it for a key; vLLM takes several keys to one flag, so ``MODEL --api-key K1 K2`` stays two keys;
    two such uses are refused: either may end with MODEL); then each key checked."""
    ns.model_after_api_key = False
    take_model_option(parser, ns, required=False)  # vLLM's --model MODEL
    if ns.model is None:
        # one value: a key, never MODEL (a server with no key instead)
        ends = [end for end, n in getattr(ns, "api_key_runs", []) if n >= 2]
        if not ends and len(ns.served_model_name or ()) >= 2:  # it took MODEL for a name: say so, and what to do
            parser.error("the following arguments are required: MODEL (--served-model-name takes every value after "
                         "it; give MODEL first: kvload serve MODEL --served-model-name NAME ...)")
        if not ends:
            parser.error("the following arguments are required: MODEL")
        if len(ends) > 1:  # `--api-key A B --api-key C D`: B or D may be MODEL, or neither; guessing serves a key
            parser.error(f"no MODEL before --api-key, and {len(ends)} --api-key flags took several values, so which "
                         "value is MODEL is unclear; give MODEL first (kvload serve MODEL --api-key KEY ...)")
        ns.model = ns.api_key.pop(ends[0] - 1)
        ns.model_after_api_key = True
    if ns.trtllm_tool_parser is not None:  # TensorRT-LLM's parser serves "auto" by itself, no other flag needed
        if ns.tool_call_parser is not None and ns.tool_call_parser != ns.trtllm_tool_parser:
            parser.error(f"--tool_parser reads as --tool-call-parser {ns.trtllm_tool_parser}, and --tool-call-parser "
                         f"{ns.tool_call_parser} was given too; give one")
        ns.tool_call_parser, ns.enable_auto_tool_choice = ns.trtllm_tool_parser, True
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:  # vLLM's rule, in its words
        parser.error("--enable-auto-tool-choice requires --tool-call-parser (kvload has: "
                     f"{', '.join(TOOL_CALL_PARSERS)})")
    if ns.tool_call_parser is not None and not ns.enable_auto_tool_choice:  # else a parser that reads nothing
        parser.error(f"--tool-call-parser {ns.tool_call_parser} requires --enable-auto-tool-choice (the parser reads "
                     'the replies to tool_choice "auto", which only that flag serves)')
    if ns.api_key:
        from kvload.serve.auth import check_api_key
        from pipeline.errors import ConfigError

        for key in ns.api_key:
            try:
                check_api_key("--api-key", key)
            except ConfigError as exc:  # never quotes the key
                parser.error(f"argument --api-key/--api_key: {str(exc).removeprefix('--api-key: ')}")


def serve_max_tokens(flag: int | None, sampling_defaults: dict[str, Any]) -> int:
    """``max_tokens`` of a request that gives none: ``--default-max-tokens`` when given (the operator's), else the
    model's max_new_tokens (its generation_config.json), else :data:`DEFAULT_MAX_TOKENS`."""
    return flag if flag is not None else sampling_defaults.get("max_tokens", DEFAULT_MAX_TOKENS)


def _tls_cert_reqs(text: str) -> int:
    """``--ssl-cert-reqs``: 0, 1 or 2 (``kvload.serve.tls.cert_reqs``; imported only when given)."""
    from kvload.serve.tls import cert_reqs

    return cert_reqs(text)


def _model_name(text: str) -> str:
    """``--served-model-name``: a blank name fell back to MODEL's without a word, so it is refused."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a non-empty name (or leave the flag out to serve as MODEL's "
                                         f"name), got {text!r}")
    return text


def _tool_call_parser(text: str) -> str:
    """``--tool-call-parser``: one of :data:`TOOL_CALL_PARSERS`."""
    if text not in TOOL_CALL_PARSERS:
        raise argparse.ArgumentTypeError(f"no tool-call parser {text!r} in kvload; it has: "
                                         f"{', '.join(TOOL_CALL_PARSERS)}")
    return text


def _trtllm_tool_parser(text: str) -> str:
    """trtllm-serve's ``--tool_parser``: kvload's reader of one of :data:`TRTLLM_TOOL_PARSERS`."""
    if text not in TRTLLM_TOOL_PARSERS:
        raise argparse.ArgumentTypeError(
            f"no reader for TensorRT-LLM's tool parser {text!r} in kvload; it reads TensorRT-LLM's "
            f"{', '.join(TRTLLM_TOOL_PARSERS)} (<tool_call> JSON blocks), and vLLM's {', '.join(TOOL_CALL_PARSERS)} "
            "by --enable-auto-tool-choice --tool-call-parser NAME")
    return TRTLLM_TOOL_PARSERS[text]


def _metrics_name_prefix(text: str) -> str:
    """``--metrics-name-prefix``: one of :data:`~kvload.metrics.METRIC_NAMINGS`."""
    if text not in METRIC_NAMINGS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(METRIC_NAMINGS)}, got {text!r}")
    return text


def _reasoning_parser(text: str) -> str:
    """``--reasoning-parser``: kvload's name of one of :data:`REASONING_PARSERS` (TensorRT-LLM's spelling of one,
    ``trtllm-serve --reasoning_parser deepseek-r1``, taken as it)."""
    from kvload.cli.structured_flags import reasoning_parser_name

    return reasoning_parser_name(text)


def _event_buffer_size(ns: argparse.Namespace) -> Any:
    """``kv_cache_config.event_buffer_max_size`` as the run will see it (the flag, else the ``--config`` file), read
    before minutes of loading; a file that does not parse is left for the pipeline to name."""
    from kvload.cli.flags import cli_overrides

    given = cli_overrides(ns).get("kv_cache_config", {}).get("event_buffer_max_size")
    if given is not None or ns.config is None:
        return given
    from pipeline.errors import ConfigError
    from pipeline.sources import read_yaml

    try:
        kv = read_yaml(ns.config).get("kv_cache_config")
    except ConfigError:
        return True  # not the events' problem: the load names the file
    return kv.get("event_buffer_max_size") if isinstance(kv, dict) else None


def _role(text: str) -> str:
    """A reply role: a non-empty name of printable ASCII letters, digits, ``_`` or ``-``, at most 64 characters."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", text):
        from pipeline.limits import short_text

        raise argparse.ArgumentTypeError(f"expected a role name such as assistant (letters, digits, _ or -, at most "
                                         f"64), got {short_text(text)}")
    return text


def _root_path(text: str) -> str:
    """A URL path prefix such as ``/api/v1``: "/" then segments without spaces, ``?`` or ``#``; "" or "/": none."""
    import re

    if text and not re.fullmatch(r"(/[^/\s?#%]+)*/?", text):
        from pipeline.limits import short_text

        raise argparse.ArgumentTypeError(f"expected a path prefix such as /api (starting with /, no spaces, ?, # or "
                                         f"%), got {short_text(text)}")
    return text.rstrip("/")  # Starlette strips the prefix only before a "/": "/api/" would match nothing


def _json_strings(text: str, fits: Callable[[str], bool] = bool, what: str = "") -> tuple[str, ...]:
    """A JSON list of strings (``'["https://a.example"]'``), as vLLM's CORS flags take; each one ``fits``, else the
    refusal says it expected ``what``."""
    import json

    from pipeline.limits import short_text

    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value) or len(value) > 1024:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"*\"]', got "
                                         f"{short_text(text)}")
    if not all(map(fits, value)):
        raise argparse.ArgumentTypeError(f"expected a JSON list of {what}, got {short_text(text)}")
    return tuple(value)


#: RFC 9110's token: what an HTTP method or header name is spelled with ("*" among them).
_HTTP_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def _http_token(value: str) -> bool:
    """An HTTP method or header name (RFC 9110's token), or ``*``."""
    return _HTTP_TOKEN.fullmatch(value) is not None


def _origin(value: str) -> bool:
    """An origin a browser can send (``https://ui.example``, ``null``) or ``*``: printable ASCII without spaces."""
    return value.isascii() and value.isprintable() and " " not in value


#: Each CORS flag's argparse type. Starlette writes the methods and header names into every preflight's answer: a
#: newline there made h11 drop the connection, a character beyond Latin-1 a 500, at each preflight, after a start
#: that took them; an origin no browser can send matches no request.
_CORS_LISTS: dict[str, Callable[[str], tuple[str, ...]]] = {
    "origins": functools.partial(_json_strings, fits=_origin, what="origins (printable ASCII without spaces, such "
                                                                  "as \"https://ui.example\" or \"*\")"),
    "methods": functools.partial(_json_strings, fits=_http_token, what="HTTP methods (tokens such as \"GET\" or "
                                                                       "\"*\")"),
    "headers": functools.partial(_json_strings, fits=_http_token, what="HTTP header names (tokens such as "
                                                                       "\"content-type\" or \"*\")"),
}


def _cors(ns: argparse.Namespace) -> Any:
    """The CORS policy the flags give: vLLM's defaults (any origin, method and header; no credentials)."""
    from kvload.serve.state import CorsPolicy

    def given(value: tuple[str, ...] | None) -> tuple[str, ...]:  # an explicit [] allows none, not any
        return ("*",) if value is None else value

    return CorsPolicy(origins=given(ns.allowed_origins), methods=given(ns.allowed_methods),
                      headers=given(ns.allowed_headers), credentials=ns.allow_credentials)


def _kv_events_config(ns: argparse.Namespace, buffer_size: Any) -> Any:
    """``--kv-events-config`` checked (None when not given) against the run's ``event_buffer_max_size``
    (:func:`_event_buffer_size`); ``ConfigError`` naming it."""
    if ns.kv_events_config is None:
        return None
    from kvload.serve.kv_publisher import parse_kv_events_config
    from pipeline.errors import ConfigError

    config = parse_kv_events_config(ns.kv_events_config)
    if config.enable_kv_cache_events and buffer_size == 0:
        raise ConfigError("--kv-events-config: enable_kv_cache_events is true but kv_cache_config."
                          "event_buffer_max_size is 0 (events off); drop that setting or give N > 0")
    return config


def cmd_serve(ns: argparse.Namespace) -> int:
    """Load with weights, build the engine, serve until interrupted."""
    if not getattr(ns, "model_after_api_key", False):
        return _cmd_serve(ns)
    from pipeline.errors import KvloadError

    try:
        return _cmd_serve(ns)
    except KvloadError as exc:  # `--api-key K1 K2` with MODEL forgotten: K2 was taken as MODEL; never quote it
        if len(ns.model) >= 4 and ns.model in str(exc):
            said = str(exc).replace(ns.model, "<the last --api-key value>")
            exc.args = (f"{said} (no MODEL was given, so the last value after --api-key was taken as MODEL; give "
                        "MODEL first, or write --api-key=KEY)",)
            if hasattr(exc, "detail"):
                exc.detail = exc.args[0]
        raise


def _cmd_serve(ns: argparse.Namespace) -> int:
    from pipeline.ranks import ranks_from_env

    # under torchrun rank 0 serves HTTP and the other ranks follow its loop step by step (ServingEngine.follow); a
    # torchrun variable that is not a rank (RANK=junk) is named first, not after seconds of importing the server
    ranks = ranks_from_env()
    from kvload.cli.files import _audit_subscribers
    from kvload.cli.flags import _request

    _check_installed()
    from kvload.api import execute
    from kvload.cli.flags import _knob_dest
    from kvload.serve.auth import resolve_api_keys
    from kvload.serve.server import chat_template_text, mirror_kv_events, serve
    from kvload.serve.stats_log import interval_from_env
    from kvload.serve.tls import tls_from_flags
    from stages import load_stages

    audit = _audit_subscribers(ns)  # published by main once the server stopped cleanly
    buffer_size, events_config = _events_flags(ns)
    events_on = events_config is not None and events_config.enable_kv_cache_events
    _refuse_unserved_flags(ns)
    # the flag, else $KVLOAD_API_KEY, else $VLLM_API_KEY; an empty or unsendable one refused now, naming its source
    api_keys, key_source, unused = resolve_api_keys(ns.api_key, os.environ)
    # vLLM's --disable-log-stats acts here: no periodic throughput line (the other commands report it ignored); the
    # interval, vLLM's VLLM_LOG_STATS_INTERVAL, is checked now, before minutes of loading
    stats_off = getattr(ns, _knob_dest("disable_log_stats"), None) is True
    stats_interval = None if stats_off else interval_from_env(os.environ)
    address = _probe_listener(ns, ranks.is_first)
    tls = tls_from_flags(ns.ssl_keyfile, ns.ssl_certfile, ns.ssl_ca_certs, ns.ssl_cert_reqs)  # a bad file: now
    template = chat_template_text(ns.chat_template) if ns.chat_template is not None else None  # and a bad template
    request = _request(ns, load_weights=True, generates=True)
    request.overrides.pop("disable_log_stats", None)  # acted on above, not an engine setting to report ignored
    _serving_defaults(ns, request, events_on and buffer_size is None)
    publisher = None
    if ranks.is_first and events_config is not None and events_config.publishes:
        from kvload.serve.kv_publisher import ZmqKvEventPublisher

        publisher = ZmqKvEventPublisher(events_config)  # a taken port fails now, before minutes of loading
    # closed after the load's own teardown, also when the load fails
    with contextlib.closing(publisher) if publisher is not None else contextlib.nullcontext(), \
            execute(request, load_stages(), subscribers=audit) as result:  # request events reach the audit too
        if ns.json and result.bus is not None:  # the output flag every command shares: serve prints no document
            from pipeline.events import SettingIgnored

            result.bus.emitter("serve")(SettingIgnored(
                field="--json", value=True, reason="kvload serve prints no result document; its answers are the "
                                                   "HTTP API's JSON (--log-format json makes its log JSON)"))
        if result.bus is not None:
            _report_ignored_serve_flags(ns, result.bus.emitter("serve"))
            _report_ignored_listen_flags(ns, result.bus.emitter("serve"))
        import random

        # always seeded (0 by default, vLLM V1's): rank 0 draws; under tensor parallel its seeds reach the others in
        # the step orders
        result.executor.call_seeds, result.executor.llm_seed = random.Random(ns.seed), ns.seed
        # --reasoning-parser, else the --config file's reasoning_parser (parse_args took them, as kvload.LLM's)
        taken = result.context.reasoning_parser
        reasoning_parser = taken.value if taken is not None else None
        if not ranks.is_first:
            return _follow(ns, result)
        if result.bus is not None:
            _announce_auth(result.bus.emitter("serve"), ns.host, address, key_source, unused)
        _start_publishing(result, events_config, publisher)
        state = _state(ns, result, template, api_keys, key_source, reasoning_parser, stats_interval)
        _warn_when_the_audit_log_fails(state, getattr(ns, "audit_sink", None))
        mirror = None
        if ns.kv_events_file is not None:  # a full disk later stops the mirror with a warning, never a request
            mirror = mirror_kv_events(state, ns.kv_events_file, "--kv-events-file")
        ready = _ready_line(ns, result, state, ranks, key_source if api_keys else None, reasoning_parser)

        try:
            level = getattr(ns, "effective_log_level", None) or ns.log_level or "warning"  # uvicorn's default: info
            serve(state, ns.host, ns.port, log_level=ns.uvicorn_log_level or level, ready=ready,
                  access_log=False if ns.disable_uvicorn_access_log else None, tls=tls, uds=ns.uds)
        finally:
            if mirror is not None:
                result.kv_manager.kv_events.mirror = None
                mirror.close()
            if publisher is not None:
                result.kv_manager.kv_events.publisher = None
    return 0


def _events_flags(ns: argparse.Namespace) -> tuple[int | None, Any]:
    """The event buffer's size as set (None: not read, or not set) and vLLM's ``--kv-events-config``; a
    ``--kv-events-file`` checked: writable, and events on."""
    from kvload.cli.files import _check_output_path

    # the flag, else the --config file's: read once, and only where an events flag asks
    buffer_size = _event_buffer_size(ns) if ns.kv_events_file is not None or ns.kv_events_config is not None \
        else None
    events_config = _kv_events_config(ns, buffer_size)
    events_on = events_config is not None and events_config.enable_kv_cache_events
    if ns.kv_events_file is not None:
        _check_output_path("--kv-events-file", ns.kv_events_file)
        if not buffer_size and not events_on:
            from pipeline.errors import ConfigError

            raise ConfigError("--kv-events-file: KV cache events are off; add --event_buffer_max_size N (N > 0), or "
                              "kv_cache_config.event_buffer_max_size in the --config file")
    return buffer_size, events_config


def _check_installed() -> None:
    """The server's own packages (the ``serve`` extra), named when one is missing."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        from pipeline.errors import ConfigError

        raise ConfigError(f"serve: {exc.name} is not installed; pip install 'kvload[serve]'") from None


def _probe_listener(ns: argparse.Namespace, listens: bool) -> str | None:
    """Where the server will listen, tried before minutes of loading (a taken port, a missing directory); the
    address bound (None on a Unix socket), or the host flag on a rank that does not listen."""
    from kvload.serve.server import bind

    address = ns.host
    if listens and ns.uds is not None:  # a missing directory, a user's file, a live server: now, not after
        from kvload.serve.uds import UnixListener  # minutes of loading (the probe's file is removed again)

        UnixListener(ns.uds).close()
        address = None
    elif listens:  # the one rank that listens
        probe = bind(ns.host, ns.port)  # a taken port fails now, before minutes of loading
        address = probe.getsockname()[0]
        probe.close()
    return address


def _serving_defaults(ns: argparse.Namespace, request: Any, events_switch: bool) -> None:
    """The load's defaults where serving differs from the other commands: pools for a few sequences of the requests'
    default max_tokens when no --max_tokens is given, and an event buffer when vLLM's switch alone turns events on."""
    from kvload.cli.sampling_defaults import length_source, peek_sampling_defaults
    from pipeline.context import DEFAULT_MAX_TOKENS_FIELD, CallerDefault

    # capped like generate's: past 2**63 - 1 the budget names --default-max-tokens
    peeked = peek_sampling_defaults(request)
    default_max_tokens = serve_max_tokens(ns.default_max_tokens, peeked.values)
    tokens = min(MAX_INT, SERVE_DEFAULT_SEQUENCES * (default_max_tokens + SERVE_PROMPT_ALLOWANCE))
    # at most 8 sequences of max_seq_len, wherever the length came from: no request grows past max_seq_len, so pools
    # for more are not the 8 sequences this default is for (a --max_tokens sizes them as the operator chooses).
    # Errors say "lower" the reason's start: the flag or the user's override_generation_config, else the flag to give
    # below the default that applied, never "lower --default-max-tokens" of a flag the operator did not give
    length, _ = length_source("--default-max-tokens", ns.default_max_tokens is not None, peeked, default_max_tokens,
                              "serve", "the requests' default max_tokens")
    request.caller_defaults[DEFAULT_MAX_TOKENS_FIELD] = CallerDefault(
        tokens, "serve", f"{length} (serve sizes the pools for {SERVE_DEFAULT_SEQUENCES} x (default-max-tokens + "
                         f"{SERVE_PROMPT_ALLOWANCE}) = {tokens} tokens when no --max_tokens is given)",
        sequences=SERVE_DEFAULT_SEQUENCES)
    if events_switch:  # vLLM's switch turns the recording on, as it does there
        request.caller_defaults[EVENT_BUFFER_FIELD] = CallerDefault(
            EVENT_BUFFER_DEFAULT, "serve", f"--kv-events-config enables KV cache events (vLLM's "
            f"enable_kv_cache_events); GET /v1/kvload/kv_events keeps the newest {EVENT_BUFFER_DEFAULT:,}",
            over_default=True)


def _state(ns: argparse.Namespace, result: Any, template: str | None, api_keys: Any, key_source: str | None,
           reasoning_parser: str | None, stats_interval: float | None) -> Any:
    """The server's state over the loaded engine, from its flags."""
    from kvload.serve.server import build_state

    return build_state(result, model_name=ns.served_model_name, default_max_tokens=ns.default_max_tokens,
                       audit_keep=ns.audit_keep, max_request_bytes=ns.max_request_bytes,
                       read_timeout_s=ns.request_read_timeout,
                       max_concurrent_requests=ns.max_concurrent_requests,
                       trust_request_chat_template=ns.trust_request_chat_template, chat_template=template,
                       chat_template_flag="--chat-template", api_keys=api_keys,
                       api_key_source=key_source or "api_keys",
                       enable_reset_prefix_cache=ns.enable_reset_prefix_cache,
                       tool_call_parser=ns.tool_call_parser, reasoning_parser=reasoning_parser,
                       metrics_naming=ns.metrics_name_prefix, responses_store_max=ns.responses_store_max,
                       cors=_cors(ns), response_role=ns.response_role,
                       return_tokens_as_token_ids=ns.return_tokens_as_token_ids,
                       force_include_usage=ns.enable_force_include_usage, root_path=ns.root_path,
                       default_chat_template_kwargs=ns.default_chat_template_kwargs,
                       log_stats_interval_s=stats_interval,
                       request_id_headers=ns.enable_request_id_headers,
                       h11_max_incomplete_event_size=ns.h11_max_incomplete_event_size,
                       h11_max_header_count=ns.h11_max_header_count,
                       chat_template_content_format=ns.chat_template_content_format)


def _ready_line(ns: argparse.Namespace, result: Any, state: Any, ranks: Any, key_source: str | None,
                reasoning_parser: str | None) -> Callable[[str], None]:
    """What the server prints once it listens: the model, where, the manager and its KV tokens, the parsers, whether
    an API key is required (``key_source``: where it came from; None: none is)."""

    def ready(url: str) -> None:
        if getattr(ns, "held_log", None) is not None:  # loaded: the load's warnings now, later ones as they come
            ns.held_log.pass_through()
        kv = result.kv
        # said where the operator looks: a key picked up from the environment (VLLM_API_KEY) is no surprise later
        auth = f"; API key required ({key_source})" if key_source is not None else ""
        tp = f", tensor parallel over {ranks.world_size} ranks" if ranks.distributed else ""
        # how chat replies are read, where a client's author looks when reasoning_content or tool_calls is missing
        parsers = "".join(f"; {what} parser {name}" for what, name in (("tool-call", ns.tool_call_parser),
                                                                     ("reasoning", reasoning_parser)) if name)
        # one_line: a --served-model-name or --uds path holding an escape sequence was printed raw to the terminal
        print(one_line(f"kvload serve: {state.model_name} at {url} ({type(result.kv_manager).__name__}, "
                       f"{kv.capacity_tokens:,} KV tokens{tp}){parsers}{auth}; Ctrl-C stops"),
              file=sys.stderr, flush=True)

    return ready


#: ``vllm serve`` flags about request logging and usage details that kvload serve takes and does not act on → why.
IGNORED_SERVE_FLAGS: dict[str, str] = {
    **dict.fromkeys(("--disable-log-requests", "--enable-log-requests", "--max-log-len"),
                    "kvload serve logs no line per request; each request's admission and end are audit records "
                    "(GET /v1/kvload/audit, --audit-log FILE), and --uvicorn-log-level info logs each HTTP request"),
    "--enable-prompt-tokens-details": "kvload always returns usage.prompt_tokens_details (cached_tokens)",
    "--disable-fastapi-docs": "kvload serve has no /docs, /redoc or /openapi.json to disable",
    "--disable-frontend-multiprocessing": "kvload serve runs its HTTP front end and its engine loop in one process",
    "--enable-server-load-tracking": "kvload serve always tracks it: GET /load answers the requests in the server at "
                                     "any time, and GET /metrics the running and waiting ones",
    "--guided-decoding-backend": "kvload's structured outputs always run on xgrammar",
    "--enable-log-outputs": "kvload serve logs no line per request or output; each request's end is an audit record "
                            "(request_finished: its tokens and finish reason; GET /v1/kvload/audit, --audit-log FILE)",
    "--log-error-stack": "kvload serve answers a failed request with one error line and records the failure "
                         "(engine_step_failed) in its log and audit; a traceback is printed only with --debug",
}


#: ``vllm serve`` flags kvload serve cannot honour → why, and what to do instead: refused, one line, before the load
REFUSED_SERVE_FLAGS: dict[str, str] = {
    "--middleware": "kvload serve imports no code named on its command line into its app; put a proxy in front for "
                    "what a middleware would do",
}


def _refuse_unserved_flags(ns: argparse.Namespace) -> None:
    """``ConfigError`` (one line, exit 2) for a vLLM front-end flag kvload serve cannot honour; ``--api-server-count
    1`` (one front end, vLLM's default) is taken."""
    from pipeline.errors import ConfigError

    if ns.api_server_count is not None and ns.api_server_count != 1:
        raise ConfigError(f"--api-server-count: kvload serve runs one HTTP front end in its process (start one kvload "
                          f"serve per replica behind a load balancer); accepted: 1, got {ns.api_server_count}")
    for flag, why in REFUSED_SERVE_FLAGS.items():
        if getattr(ns, flag[2:].replace("-", "_")) is not None:
            raise ConfigError(f"{flag}: {why}")


def _report_ignored_serve_flags(ns: argparse.Namespace, emit: Any) -> None:
    """One ``setting_ignored`` per vLLM serve flag given that kvload takes without acting on."""
    from kvload.cli.flags import _underscored
    from pipeline.events import SettingIgnored

    for flag, why in IGNORED_SERVE_FLAGS.items():
        value = getattr(ns, _underscored(flag)[2:], None)  # argparse's dest for the flag
        if value is not None and value is not False:
            emit(SettingIgnored(field=flag, value=value, reason=why))


def _report_ignored_listen_flags(ns: argparse.Namespace, emit: Any) -> None:
    """With ``--uds``, one ``setting_ignored`` for each of --host and --port the command line set (vLLM ignores
    them too): the server listens on the socket only."""
    if ns.uds is None:
        return
    from pipeline.events import SettingIgnored

    for flag, value in getattr(ns, "listen_given", {}).items():
        emit(SettingIgnored(field=flag, value=value, reason=f"--uds {ns.uds}: the server listens on that Unix socket "
                                                            "only, not on TCP (as vLLM's --uds)"))


def _start_publishing(result: Any, config: Any, publisher: Any) -> None:
    """Hand the manager's events to ``publisher``; a publisher named but switched off says it is ignored."""
    if publisher is not None:
        publisher.attach(result.kv_manager.layout)
        result.kv_manager.kv_events.publisher = publisher
    elif config is not None and config.publisher == "zmq" and not config.enable_kv_cache_events \
            and result.bus is not None:
        from pipeline.events import SettingIgnored

        result.bus.emitter("serve")(SettingIgnored(
            field="--kv-events-config publisher", value="zmq",
            reason="enable_kv_cache_events is false, so no KV cache events are recorded to publish (vLLM's rule)"))


def _warn_when_the_audit_log_fails(state: Any, sink: Any) -> None:
    """An ``audit_log_failed`` warning (the server's log and in-memory audit) as soon as ``--audit-log`` cannot be
    written, not only the error line at the server's stop; requests go on."""
    if sink is None:
        return
    from pipeline.events import AuditLogFailed

    def failed(exc: OSError) -> None:  # on whichever thread emitted the record: queued for the loop to emit
        state.engine.notify(AuditLogFailed(
            field="--audit-log", path=str(sink.path), error=str(exc),
            reason="the file will not be published (kvload serve exits 1 when it stops); the records from here on "
                   "are kept only in memory (GET /v1/kvload/audit); requests go on"))

    sink.watch(failed)


def _follow(ns: argparse.Namespace, result: Any) -> int:
    """A rank > 0 under torchrun: no HTTP server; step with rank 0's serving loop until it stops (exit 0) or the
    ranks part (the error, exit 1). Its audit log records the load and every request it stepped."""
    from engine.serving import ServingEngine

    result.audit.keep_tail(ns.audit_keep)  # as rank 0's: the load's records, the newest request-time ones in memory
    engine = ServingEngine.from_result(result)
    if getattr(ns, "held_log", None) is not None:  # loaded: the load's warnings now, as rank 0 passes its own
        ns.held_log.pass_through()
    engine.follow()
    return 0


def _announce_auth(emit: Any, host: str, address: str | None, source: str | None, unused: list[str]) -> None:
    """The warnings about the API key, in the server's log and audit: a key source set but not used (another wins),
    and a server reachable from other machines with no key at all (``address`` None: a Unix socket, only this
    machine's users reach it). The keys themselves are never shown."""
    from kvload.serve.auth import is_loopback
    from pipeline.events import ServeWithoutApiKey, SettingIgnored

    for name in unused:
        emit(SettingIgnored(field=name, value="(set; not shown)",
                            reason=f"the API key comes from {source}, which wins (--api-key, then KVLOAD_API_KEY, "
                                   f"then VLLM_API_KEY); requests with {name}'s key get HTTP 401 unless it is the "
                                   "same"))
    # vLLM says nothing here; kvload does, once: such a server answers anyone who can reach the port, its audit
    # (/v1/kvload/audit: prompts, settings) included
    if source is None and address is not None and not is_loopback(address):
        emit(ServeWithoutApiKey(host=host, address=address,
                                reason=f"--host {host} listens beyond this machine and no API key is set: anyone who "
                                       "can reach the port can generate and read /v1/kvload/audit; set "
                                       "KVLOAD_API_KEY (or --api-key), or serve on 127.0.0.1 behind a proxy"))


__all__ = ["DEFAULT_MAX_TOKENS", "REASONING_PARSERS", "RESPONSES_STORE_MAX_DEFAULT", "TOOL_CALL_PARSERS",
           "add_serve_command", "cmd_serve", "serve_max_tokens"]
