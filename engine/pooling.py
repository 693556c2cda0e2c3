"""Embeddings of a decoder model (vLLM's ``LLM.embed`` and ``/v1/embeddings`` for a generative model it converts).

vLLM runs a ``*ForCausalLM`` checkpoint as an embedding model by pooling its last hidden states: the final norm's
output at the prompt's last token (``PoolingType.LAST``), L2-normalized (its ``embed`` task's default). kvload takes
the same vector from the forward that prefills the prompt: the input of the model's output projection (``lm_head``)
at the prompt's last token, which is that norm's output (:class:`PooledRows` captures it).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch

from pipeline.errors import GenerationError, close_names, did_you_mean
from pipeline.limits import MAX_INT, plain_flag, plain_scalar, short


def _check_dimensions(_: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:  # vLLM refuses it too for a model not trained for truncated (Matryoshka) embeddings
        raise GenerationError(f"PoolingParams: dimensions {short(value)}: the models kvload serves give their full "
                              "hidden size only (no Matryoshka embeddings); leave dimensions unset")


def _check_truncate(_: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < -1 or value == 0):
        raise GenerationError(f"PoolingParams: truncate_prompt_tokens: expected a positive integer (keep the "
                              f"prompt's last N tokens) or -1 (the model's length), got {short(value)}")
    if value is not None and value > MAX_INT:  # past int64: the tokenizer's cut raised a bare "int too big to convert"
        raise GenerationError(f"PoolingParams: truncate_prompt_tokens: expected at most 2**63 - 1, got "
                              f"{short(value)}")


def _check_activation(_: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise GenerationError(f"PoolingParams: {attribute.name}: expected true, false or None, got {short(value)}")


#: the refusal of ``normalize`` (and of a misspelling of it), which vLLM's ``PoolingParams`` no longer has
_NORMALIZE_REMOVED = ("normalize was removed, as vLLM removed it; use use_activation (False: an embedding's hidden "
                      "state as computed, not L2-normalized)")


class PoolingParamsError(GenerationError, TypeError):
    """A keyword :class:`PoolingParams` does not take: a ``TypeError`` as vLLM's (a ``msgspec.Struct``: "Unexpected
    keyword argument"), and a ``GenerationError`` as kvload's other refusals."""


@attrs.frozen(kw_only=True, init=False)
class PoolingParams:
    """vLLM's ``PoolingParams`` for ``LLM.embed``, ``LLM.classify``, ``LLM.score`` and ``LLM.encode``:
    ``use_activation`` (every task's switch, as vLLM's: an embedding's L2 norm, a classifier's softmax or sigmoid;
    None: on, vLLM's default), ``truncate_prompt_tokens`` (keep the prompt's last N tokens; -1: the model's length) and
    ``dimensions`` (None only: no model kvload serves is a Matryoshka one). ``normalize`` is refused, as vLLM removed it
    for ``use_activation``."""

    use_activation: bool | None = attrs.field(default=None, validator=_check_activation)
    truncate_prompt_tokens: int | None = attrs.field(default=None, validator=_check_truncate)
    dimensions: int | None = attrs.field(default=None, validator=_check_dimensions)

    def __init__(self, *, use_activation: bool | None = None, truncate_prompt_tokens: int | None = None,
                 dimensions: int | None = None, **unknown: Any) -> None:
        """Keywords only; one that is not a field is named, with the field it is close to (``use_activaton``);
        ``normalize``, which vLLM's ``PoolingParams`` no longer has, points to ``use_activation``."""
        if "normalize" in unknown:  # vLLM's PoolingParams dropped it: use_activation is every task's switch
            raise PoolingParamsError(f"PoolingParams: {_NORMALIZE_REMOVED}")
        if unknown:  # Python's TypeError ("unexpected keyword argument 'normalise'") suggested nothing
            name = next(iter(unknown))
            listed = f"PoolingParams: unknown field {name[:80]!r}; fields are {', '.join(POOLING_FIELDS)}"
            if close_names(name, (*POOLING_FIELDS, "normalize")) == ["normalize"]:
                # a misspelt normalize ('normalise') meant the removed switch: name use_activation, not nothing
                raise PoolingParamsError(f"{listed}; did you mean 'normalize'? {_NORMALIZE_REMOVED}")
            raise PoolingParamsError(f"{listed}{did_you_mean(name, POOLING_FIELDS)}")
        # a numpy integer or 0-d torch tensor (a length taken from an array) as Python's int, as SamplingParams'
        # truncate_prompt_tokens takes it: the same value was refused here and taken by generate; numpy's bool (a 0-d
        # bool tensor) as Python's, as SamplingParams' flags take it
        self.__attrs_init__(use_activation=plain_flag(use_activation),
                            truncate_prompt_tokens=plain_scalar(truncate_prompt_tokens), dimensions=dimensions)


#: :class:`PoolingParams`' fields, as its unknown-field error lists them
POOLING_FIELDS = tuple(sorted(f.name for f in attrs.fields(PoolingParams)))


@attrs.frozen
class EmbeddingOutput:
    """vLLM's ``EmbeddingOutput``: one prompt's embedding, a list of floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        """The embedding's length (the model's hidden size)."""
        return len(self.embedding)


@attrs.frozen
class EmbeddingRequestOutput:
    """vLLM's ``EmbeddingRequestOutput``: ``outputs.embedding`` of one prompt, with its ids and request id."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    prompt: str | None = None
    num_cached_tokens: int = 0
    finished: bool = True


@attrs.frozen
class ClassificationOutput:
    """vLLM's ``ClassificationOutput``: one prompt's class probabilities (the head's logits through softmax, sigmoid
    for one label), a list of floats."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        """How many classes the head has."""
        return len(self.probs)


@attrs.frozen
class ClassificationRequestOutput:
    """vLLM's ``ClassificationRequestOutput``: ``outputs.probs`` of one prompt, with its ids and request id."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    prompt: str | None = None
    num_cached_tokens: int = 0
    finished: bool = True


@attrs.frozen
class ScoringOutput:
    """vLLM's ``ScoringOutput``: one pair's score."""

    score: float


@attrs.frozen
class ScoringRequestOutput:
    """vLLM's ``ScoringRequestOutput`` of an embedding model: ``outputs.score``, the cosine similarity of one pair's
    embeddings; ``prompt_token_ids`` the two prompts' ids one after the other, ``request_id`` their ids joined."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


class ScorePairsError(GenerationError):
    """Two sides of a score that cannot be paired: ``field`` names the side the message is about."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def score_pairs(n_1: int, n_2: int, name_1: str = "data_1", name_2: str = "data_2",
                noun: str = "prompts") -> list[tuple[int, int]]:
    """vLLM's pairing of a score's two sides (1:1, 1:N, N:N) as indices into one batch of the ``n_1`` first-side
    inputs then the ``n_2`` second-side ones, one pair per second-side input, in order; :class:`ScorePairsError`
    naming the side otherwise. ``LLM.score``, ``/score`` and ``/rerank`` all pair through it."""
    for n, name in ((n_1, name_1), (n_2, name_2)):
        if n < 1:
            raise ScorePairsError(f"{name}: needs at least one {noun[:-1]} to score", name)
    if n_1 != 1 and n_1 != n_2:
        raise ScorePairsError(f"{name_1} has {n_1} {noun} and {name_2} {n_2}; give one {name_1} {noun[:-1]} (scored "
                              f"against each of {name_2}) or as many as {name_2} (pairwise)", name_1)
    return [(0 if n_1 == 1 else j, n_1 + j) for j in range(n_2)]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The score of an embedding model's pair (vLLM's ``_cosine_similarity``): the cosine of the two vectors."""
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))


def pooled(hidden: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The embedding of one captured hidden row: float32, L2-normalized when asked (vLLM's F.normalize, eps 1e-12)."""
    row = hidden.float()
    return torch.nn.functional.normalize(row, p=2, dim=-1) if normalize else row


def pooled_vector(hidden: torch.Tensor, use_activation: bool | None) -> list[float]:
    """:func:`pooled` as a list of floats (vLLM's ``EmbeddingOutput.embedding``); ``use_activation`` None:
    normalized."""
    return pooled(hidden, use_activation is not False).tolist()


class PooledRows:
    """Which requests want their prompt's hidden states, and the rows captured for them.

    ``want(req_id)`` marks one for its prompt's last row (embed, classify), ``want(req_id, every_token=True)`` for
    every prompt token's row (vLLM's per-token pooling, ``LLM.reward``); the executor's forward calls
    :meth:`capture` around a step, which records the ``lm_head`` input rows it is given; ``take(req_id)`` hands them
    over (the last row, or a ``(tokens, hidden)`` tensor; None if none came) and forgets the request."""

    def __init__(self) -> None:
        self._rows: dict[str, torch.Tensor | None] = {}
        #: per-token requests: the rows captured so far, one (its first token's position, its rows) per computed chunk
        #: of the prompt
        self._parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
        #: :meth:`take` (a server's handler, on its event loop) against :meth:`capture`'s writes (the engine's thread)
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._rows)

    def want(self, req_id: str, every_token: bool = False) -> None:
        """Capture this request's row when its prompt's last token is computed (``every_token``: every prompt
        token's row, as each chunk of the prompt is computed)."""
        self._rows[req_id] = None
        if every_token:
            self._parts[req_id] = []

    def wanted(self, req_id: str) -> bool:
        """Whether this request still waits for its row."""
        return req_id in self._rows and self._rows[req_id] is None

    def every_token(self, req_id: str) -> bool:
        """Whether this request wants every prompt token's row (its prompt is then computed whole: no cached
        prefix, whose rows no forward gives)."""
        return req_id in self._parts

    def take(self, req_id: str) -> torch.Tensor | None:
        """The captured row (None: none came), the request forgotten."""
        with self._lock:
            self._parts.pop(req_id, None)
            return self._rows.pop(req_id, None)

    @contextlib.contextmanager
    def capture(self, model: Any, rows: Sequence[tuple[str, int, int, int, bool]],
                select: Sequence[int] | None = None) -> Iterator[None]:
        """Around one forward: ``rows`` (request id, the position in its prompt of the step's first token of it, first
        and past-the-last index of its rows among the output projection's input rows, whether its prompt ends in this
        step) get the output projection's input at those rows: the last one of a last-row request, every one of a
        per-token request (kept until its prompt ends; a chunk computed again, as a preempted request's prompt is from
        token 0, replaces the rows it had); nothing is hooked when ``rows`` is empty and ``select`` None.

        ``select``: the indices of the rows (among those the head is given) whose logits the step reads; the head then
        projects only those. A per-token request's rows are its hidden states, not its logits: projecting them too
        made ``chunk x vocab`` logits no one read (8,192 tokens x 152k vocab, 2.5 GB in bf16, for a causal LM's
        ``token_embed``); a classifier's per-token labels come from its head over the captured rows afterwards
        (``models.classifier.head_logits``)."""
        if not rows and select is None:
            yield
            return
        seen: list[torch.Tensor] = []
        head = model.get_output_embeddings()
        # the forward's own call only: a served classifier's answers run the same head on other threads meanwhile
        # (head_logits over the rows of requests already done), and those calls were counted here: concurrent
        # /classify or /pooling requests failed with "ran 2 times in one forward", a 500
        me = threading.get_ident()

        def pre_hook(_module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            if threading.get_ident() != me:
                return None
            seen.append(args[0])
            if select is None:
                return None
            index = torch.tensor(select, dtype=torch.long, device=args[0].device)
            return (args[0].index_select(-2, index), *args[1:])  # the head's input: only the rows read

        hook = head.register_forward_pre_hook(pre_hook)
        try:
            yield
        finally:
            hook.remove()
        if len(seen) != 1:  # one projection per forward: anything else would pair rows with the wrong requests
            raise GenerationError(f"embed: the model's output projection ran {len(seen)} times in one forward; "
                                  "its pooled hidden states cannot be told apart")
        hidden = seen[0].reshape(-1, seen[0].shape[-1])
        with self._lock:
            for req_id, start, first, stop, ends in rows:
                if req_id not in self._rows:  # taken during the forward (its client left, the request aborted): a
                    continue  # row kept now would be no one's, for the server's life
                parts = self._parts.get(req_id)
                if parts is None:
                    self._rows[req_id] = hidden[stop - 1].detach().to("cpu", copy=True)
                    continue
                # rows of positions from start on were computed before the request was preempted: this chunk's
                # replace them
                kept = [(at, part[:start - at]) for at, part in parts if at < start]
                kept.append((start, hidden[first:stop].detach().to("cpu", copy=True)))
                self._parts[req_id] = kept
                if ends:
                    self._rows[req_id] = torch.cat([part for _, part in kept])


@attrs.frozen
class PoolingOutput:
    """vLLM's ``PoolingOutput``: one prompt's pooled data, a tensor (per token for ``LLM.reward``: one row per prompt
    token)."""

    data: torch.Tensor


@attrs.frozen
class PoolingRequestOutput:
    """vLLM's ``PoolingRequestOutput``: ``outputs.data`` of one prompt, with its ids and request id."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    prompt: str | None = None
    num_cached_tokens: int = 0
    finished: bool = True


__all__ = ["ClassificationOutput", "ClassificationRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
           "PooledRows", "PoolingOutput", "PoolingParams", "PoolingRequestOutput", "ScorePairsError",
           "ScoringOutput", "ScoringRequestOutput", "cosine", "pooled", "pooled_vector", "score_pairs"]
