"""Load a checkpoint's weights and tokenizer through transformers, on a device and dtype.

* preset: deterministic random weights — ``from_config`` under a fixed seed, initialised on the CPU
  (so every device gets the same values) and then moved;
* directory: ``from_pretrained`` over its safetensors (or ``pytorch_model*.bin``);
* GGUF (a directory's ``.gguf`` file or a packaged model): converted once to safetensors
  (``models.gguf_cache``), then loaded like a directory.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from models.checkpoint import Checkpoint, read_config_json, read_json_object
from pipeline.errors import KvRuntimeError, ModelError, cannot_read, first_line
from pipeline.limits import short

#: Model dtypes transformers can load weights in (float8 is a KV cache dtype only).
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")


@attrs.define
class LoadedWeights:
    """A model with weights, its tokenizer (None when the checkpoint has none), and where they came from."""

    model: Any
    tokenizer: Any
    source: str  # "random" | "safetensors" | "gguf"
    path: str
    converted: bool = False  # a GGUF converted by this call (the cache did not hold it yet)
    duration_ms: float = 0.0

    @property
    def nbytes(self) -> int:
        """Bytes of parameters and buffers."""
        return model_nbytes(self.model)

    @property
    def num_parameters(self) -> int:
        """Parameters, tied ones counted once."""
        return sum(p.numel() for p in self.model.parameters())


def model_nbytes(model: Any) -> int:
    """Bytes of a module's parameters and buffers (tied ones counted once)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            local = t.to_local() if hasattr(t, "to_local") else t  # a tensor-parallel shard: this rank's bytes
            total += local.numel() * local.element_size()
    return total


def torch_dtype(name: str) -> Any:
    """The torch dtype for a resolved model dtype name; ``ModelError`` for one weights cannot take."""
    import torch

    if name not in WEIGHT_DTYPES:
        raise ModelError(f"dtype {name!r}: weights load in {', '.join(WEIGHT_DTYPES)} only; "
                         "set dtype to one of those (the KV cache dtype may still be float8)")
    return getattr(torch, name)


def random_model(hf_config: Any, *, device: str, dtype: str, seed: int = 0) -> Any:
    """A model with deterministic random weights: same seed, same values, on every device."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.config_view import transformers_config

    tdtype = torch_dtype(dtype)
    # a preset's plan read its config without transformers; building a model needs the real object.
    # from_config writes attention settings into the config it gets, hence the copy.
    cfg = copy.deepcopy(transformers_config(hf_config))
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream untouched
        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=tdtype)
        except Exception as exc:
            raise _activation_error(cfg, exc) or _load_error(
                f"transformers cannot build a causal LM from {type(cfg).__name__}", exc) from exc
    return model.to(device).eval()


def _weight_files(path: Path) -> list[Path]:
    return sorted([*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin")])


def check_weight_files(path: Path) -> None:
    """``ModelError`` naming the first of ``path``'s weight files that is not a regular file one can open: a FIFO
    (safetensors and torch would wait for a writer forever: ``generate`` hung), a device, a directory, a symbolic
    link to nothing or in a loop."""
    for file in _weight_files(path):
        check_regular_file(file, "a weights file (safetensors or a torch .bin)", "the weights")


def check_quantization(path: Path) -> None:
    """``ModelError`` naming ``config.json``'s ``quantization_config`` when transformers would skip it: not an
    object, or a ``quant_method`` it has no quantizer for. transformers then loads the weights as if unquantized,
    saying so only in a warning kvload's quiet load keeps off stderr: the setting was dropped without a word."""
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    file = path / "config.json"
    quant = read_config_json(path).get("quantization_config")
    if quant is None:
        return
    if not isinstance(quant, dict):  # refused when the config was read (models.config_check); here for other callers
        raise ModelError(f"{file}: quantization_config: expected an object with a quant_method, got {short(quant)}")
    if quant.get("load_in_8bit") is True or quant.get("load_in_4bit") is True:  # bitsandbytes' older spelling
        return
    method = quant.get("quant_method")
    if method not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        raise ModelError(f"{file}: quantization_config.quant_method: {short(method)} is not a quantization "
                         f"transformers has; accepted: {', '.join(sorted(AUTO_QUANTIZATION_CONFIG_MAPPING))}")


#: The largest ``model.safetensors.index.json`` read (DeepSeek V3's, 91,000 tensors, is about 9 MB).
MAX_INDEX_BYTES = 64 * 1024 * 1024


def check_shard_index(path: Path) -> None:
    """``ModelError`` naming ``model.safetensors.index.json`` when transformers would read it (no single
    ``model.safetensors`` beside it) and it is not JSON with a ``weight_map`` object of tensor name to shard file:
    transformers' words named the folder only ("'list' object has no attribute 'values'", "Expecting property name
    ..."). A shard it names that is absent is left to transformers, whose line names the file."""
    index = path / "model.safetensors.index.json"
    if not os.path.lexists(index) or os.path.lexists(path / "model.safetensors"):
        return
    data = read_json_object(index, "a shard index", MAX_INDEX_BYTES)
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict):
        raise ModelError(f"{index}: weight_map: expected an object of tensor name to shard file name, got "
                         f"{short(weight_map)}")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise ModelError(f"{index}: weight_map.{name}: expected a shard file name, got {short(shard)}")


def check_regular_file(file: Path, expected: str, what: str) -> None:
    """``ModelError`` naming ``file`` when it is not a regular file one may read: a symbolic link to nothing or in a
    loop, a directory, a FIFO or device (a reader would wait for a writer forever), or one without read permission.
    ``expected`` ("a weights file ...") and ``what`` ("the weights") word the line."""
    try:
        st = file.stat()
    except FileNotFoundError:
        raise ModelError(f"{file}: is a symbolic link to nothing; expected {expected}") from None
    except OSError as exc:  # a symbolic link loop, a name too long, ...
        raise ModelError(f"{file}: {cannot_read(exc)}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelError(f"{file}: is a directory, expected {expected}")
    if not stat.S_ISREG(st.st_mode):
        raise ModelError(f"{file}: not a regular file (a FIFO or device?), expected {expected}")
    if not os.access(file, os.R_OK):
        raise ModelError(f"{file}: cannot read {what} (permission denied)")


def tensor_parallel_options(hf_config: Any, tp_size: int) -> dict[str, Any]:
    """``from_pretrained`` keywords that shard a model over ``tp_size`` ranks with transformers' own TP plan.

    ``ModelError`` when the architecture has no plan in this transformers (kvload does not write plans).
    """
    from models.config_view import transformers_config
    from models.geometry import text_config

    hf_config = transformers_config(hf_config)  # the TP plan is a class attribute of transformers' config
    plan = getattr(text_config(hf_config), "base_model_tp_plan", None) or getattr(hf_config, "base_model_tp_plan", None)
    if not plan:
        arch = (getattr(hf_config, "architectures", None) or [type(hf_config).__name__])[0]
        raise ModelError(f"tensor_parallel_size={tp_size}: transformers has no tensor-parallel plan for {arch}; "
                         "run it with tensor_parallel_size=1")
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # transformers before DistributedConfig: the plan is named directly
        return {"tp_plan": "auto", "tp_size": tp_size}
    return {"distributed_config": DistributedConfig(tp_size=tp_size)}


def plan_kv_heads_per_rank(hf_config: Any, tp_size: int) -> int | None:
    """KV heads per rank under transformers' own TP plan for this config; None when that plan cannot split them.

    The plan shards K/V heads when it splits ``k_proj`` by columns (``colwise``); otherwise every rank
    computes every KV head. kvload's pools must hold exactly what the model computes.
    """
    from models.config_view import transformers_config
    from models.geometry import kv_heads, text_config

    hf_config = transformers_config(hf_config)  # the TP plan is a class attribute of transformers' config
    cfg = text_config(hf_config)
    plan = getattr(cfg, "base_model_tp_plan", None) or getattr(hf_config, "base_model_tp_plan", None) or {}
    n = kv_heads(cfg)
    if not any(key.rsplit(".", 1)[-1] in ("k_proj", "qkv_proj") and style.startswith("colwise")
               for key, style in plan.items()):
        return n
    return n // tp_size if n % tp_size == 0 else None


def save_random_model(hf_config: Any, path: Path, *, dtype: str, seed: int = 0) -> Path:
    """Write a preset's deterministic random weights as safetensors (how ranks share weights ``from_config`` makes)."""
    model = random_model(hf_config, device="cpu", dtype=dtype, seed=seed)
    with _quiet_progress():
        model.save_pretrained(str(path))
    return path


def pretrained_model(path: Path, *, device: str, dtype: str, tp_size: int = 1, classifier: bool | str = False,
                     config: Any = None) -> Any:
    """Load a directory's weights with ``from_pretrained`` (never ``trust_remote_code``).

    ``config``: the transformers config to build the model from in place of the directory's ``config.json`` (one
    vLLM's ``hf_overrides`` changed: ``models.hf_overrides``).

    ``classifier``: a ``*ForSequenceClassification`` checkpoint (True or ``"sequence"``), loaded with
    ``AutoModelForSequenceClassification``, or a ``*ForTokenClassification`` one (``"token"``), loaded with
    ``AutoModelForTokenClassification``, returned as its family's causal-LM class over the same weights
    (``models.classifier.as_causal_shell``).

    With ``tp_size > 1`` (every rank calling it under torch.distributed) transformers shards the model by
    its own tensor-parallel plan and places each rank's shard on the rank's device.
    """
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    if classifier and tp_size > 1:
        what = "token" if classifier == "token" else "sequence"
        raise ModelError(f"tensor_parallel_size={tp_size}: {path} is a {what}-classification checkpoint, which "
                         "kvload runs on one rank; run it with tensor_parallel_size=1")
    auto = AutoModelForCausalLM
    if classifier:
        auto = AutoModelForTokenClassification if classifier == "token" else AutoModelForSequenceClassification
    tdtype = torch_dtype(dtype)
    if not _weight_files(path):
        raise ModelError(f"{path}: no weights (*.safetensors or pytorch_model*.bin) in the checkpoint directory")
    check_weight_files(path)  # before anything opens them: a FIFO blocks the open
    check_shard_index(path)
    check_quantization(path)
    check_shapes_unloaded(path, config)
    placement: dict[str, Any] = {"device_map": device}
    if tp_size > 1:
        cfg = config if config is not None else AutoConfig.from_pretrained(str(path), trust_remote_code=False,
                                                                           local_files_only=True)
        placement = tensor_parallel_options(cfg, tp_size)
    if config is not None:  # from_pretrained writes attention settings into the config it gets, hence the copy
        placement["config"] = copy.deepcopy(config)
    try:
        # the weights_loaded event reports the load and check_loading_info below refuses what is wrong in one
        # line, so transformers' progress bar and multi-line LOAD REPORT stay off stderr. Mismatched shapes
        # are reinitialised instead of raised so the report names them; the model is then refused anyway.
        with _quiet_progress(), _quiet_load_report():
            model, info = auto.from_pretrained(
                str(path), dtype=tdtype, trust_remote_code=False, local_files_only=True,
                output_loading_info=True, ignore_mismatched_sizes=True, **placement)
    except Exception as exc:  # loaders raise their own types (SafetensorError, struct.error, ...)
        unreadable = _unreadable_weight_file(path)
        if unreadable is not None:  # safetensors reports a file it may not open as "No such file or directory"
            raise ModelError(f"{unreadable}: cannot read the weights (permission denied)") from exc
        corrupt = _corrupt_safetensors(path)
        if corrupt is not None:  # safetensors' "Error while deserializing header" names no file: one of many shards
            raise ModelError(f"{corrupt[0]}: transformers cannot load the weights: {corrupt[1]}") from exc
        raise _activation_error(path, exc) or _load_error(f"{path}: transformers cannot load the weights",
                                                          exc) from exc
    try:
        check_loading_info(path, info)
        check_finite(path, model, dtype)
    except BaseException:
        del model
        raise
    if classifier:
        from models.classifier import as_causal_shell

        return as_causal_shell(model.eval())
    return model.eval()


def check_finite(path: Path, model: Any, dtype: str) -> None:
    """``ModelError`` naming the first parameter holding NaN or an infinity, as loaded in ``dtype``.

    Such a weight makes every logit NaN, and sampling then drew token 0 over and over with exit 0; it comes from a
    damaged file, or from values past the range of the dtype they were cast to (a bfloat16 model loaded in float16).
    A sum per tensor (a NaN or an infinity makes it non-finite; 14 ms for SmolLM2's 135M weights on one CPU thread,
    isfinite 0.66 s); only a tensor whose sum is not finite, which finite values can overflow to, is looked at whole.
    """
    import torch

    def finite(p: Any) -> bool:
        return bool(torch.isfinite(p.sum())) or bool(torch.isfinite(p).all())

    bad = [name for name, p in model.named_parameters() if p.is_floating_point() and not finite(p)]
    if not bad:
        return
    files = ", ".join(p.name for p in _weight_files(path))
    more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
    cause = (f"values past {dtype}'s range (try --dtype float32 or bfloat16) or a damaged file" if dtype == "float16"
             else "a damaged file")
    raise ModelError(f"{path}: tensor {bad[0]} in {files} holds NaN or infinite values in {dtype}{more}; {cause}: "
                     "every logit would be NaN")


#: safetensors' floating-point element types (their header's ``dtype`` names)
_FLOAT_STORAGE = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"})


def check_shapes_unloaded(path: Path, config: Any = None) -> None:
    """Refuse, before a byte is allocated, safetensors whose tensors hold another number of values than the model
    ``config.json`` (or ``config``, the transformers config it is built from) describes (the same one line
    :func:`check_loading_info` gives after a load).

    ``from_pretrained`` builds the model at the config's sizes and only then compares them with the checkpoint's:
    an ``intermediate_size`` of 10**9 over a 64-wide checkpoint asked for 128 GB (a MemoryError where the
    allocator refuses, minutes of swapping where it does not), 10**6 took 768 MB, before the mismatch was named.
    Here the model is built on the meta device (no memory) and each tensor's shape read from the files' headers.
    Only a tensor of the same name and another number of values counts (a layout that transformers permutes on
    load keeps its count); a quantized checkpoint (``quantization_config``), ``.bin`` files, whose shapes need a load,
    and anything that fails here are left to ``from_pretrained``, which reports them as before."""
    import warnings

    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        # quiet: from_pretrained reads the config again and says what it has to say (transformers' warnings) once
        with _quiet_load_report(), torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's "zero-element tensors" for a size 0: the one line below says it
            cfg = copy.deepcopy(config) if config is not None else AutoConfig.from_pretrained(
                str(path), trust_remote_code=False, local_files_only=True)
            if getattr(cfg, "quantization_config", None):  # packed weights under the same names (bitsandbytes'):
                return  # how they unpack is transformers' to say
            state = AutoModelForCausalLM.from_config(cfg).state_dict()
            expected = {name: tuple(t.shape) for name, t in state.items()}
            floating = {name for name, t in state.items() if t.dtype.is_floating_point}
        found, stored = {}, {}
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118
                    found[key] = tuple(f.get_slice(key).get_shape())
                    stored[key] = (file.name, f.get_slice(key).get_dtype())
    except Exception:  # a config transformers cannot build, a corrupt header: from_pretrained says
        return
    mismatched = [(key, shape, expected[key]) for key, shape in found.items()
                  if key in expected and math.prod(shape) != math.prod(expected[key])]
    check_loading_info(path, {"mismatched_keys": mismatched})
    # from_pretrained casts an integer tensor to the model's dtype: a float weight whose header says I32 loaded its bits
    # as integers (values near 1e9), and generate printed garbage with exit 0
    integers = sorted(key for key in found if key in floating and stored[key][1] not in _FLOAT_STORAGE)
    if integers:
        file, kind = stored[integers[0]]
        more = f" (and {len(integers) - 1} more)" if len(integers) > 1 else ""
        raise ModelError(f"{path}: tensor {integers[0]} in {file} is stored as {kind}{more}, the model expects "
                         f"floating-point weights ({', '.join(sorted(_FLOAT_STORAGE))}); integers or booleans there "
                         "are a quantized checkpoint without its quantization_config, or a damaged file")


def _activation_error(where: Any, exc: Exception) -> ModelError | None:
    """A ``KeyError`` of one of transformers' tables keyed by a config.json value, as one line naming the field and
    what is accepted: the activations (``ACT2FN[config.hidden_act]``) and the RoPE types
    (``ROPE_INIT_FUNCTIONS[rope_type]``, whose error was the bare name: "cannot load the weights: 'banana'"); None
    for any other failure. ``where``: the checkpoint directory (its config.json is read) or the config object."""
    if not isinstance(exc, KeyError) or len(exc.args) != 1 or not isinstance(exc.args[0], str):
        return None
    from transformers.activations import ACT2FN
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from models.config_check import ROPE_FIELDS

    name = exc.args[0]
    if isinstance(where, Path):
        file = where / "config.json"
        try:  # read as the checkpoint's resolution read it (and accepted it) before the load got here
            config = read_config_json(where)
        except ModelError:
            return None
    else:
        file, config = "config", where.to_dict() if hasattr(where, "to_dict") else {}
    for prefix, fields in (("", config), ("text_config.", config.get("text_config") or {})):
        for field, value in fields.items() if isinstance(fields, dict) else ():
            if value == name and "act" in field and name not in ACT2FN:
                return ModelError(f"{file}: {prefix}{field}: {name!r} is not an activation transformers has; "
                                  f"accepted: {', '.join(sorted(ACT2FN))}")
            if field in ROPE_FIELDS and isinstance(value, dict) and name not in ROPE_INIT_FUNCTIONS:
                nested = [(f".{k}", v) for k, v in value.items() if isinstance(v, dict)] or [("", value)]
                for below, rope in nested:
                    key = "rope_type" if "rope_type" in rope else "type"
                    if rope.get(key) == name:
                        accepted = ", ".join(["default", *sorted(ROPE_INIT_FUNCTIONS)])
                        return ModelError(f"{file}: {prefix}{field}{below}.{key}: {name!r} is not a RoPE type "
                                          f"transformers has; accepted: {accepted}")
    return None


def _unreadable_weight_file(path: Path) -> Path | None:
    """The first weight file in ``path`` the user may not open (asked after a failed load only)."""
    for file in _weight_files(path):
        try:
            with open(file, "rb"):
                pass
        except PermissionError:
            return file
        except OSError:
            continue
    return None


def _corrupt_safetensors(path: Path) -> tuple[Path, str] | None:
    """The first ``.safetensors`` file in ``path`` whose header does not parse (truncated, garbage), with
    safetensors' reason; None when every header parses (asked after a failed load only)."""
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        except Exception as exc:  # SafetensorError, OSError: whatever stops the header being read
            return file, first_line(exc)
    return None


def check_loading_info(path: Path, info: dict[str, Any]) -> None:
    """``ModelError`` when the checkpoint left parameters uninitialised: missing or of the wrong shape.

    A serving engine refuses a checkpoint that does not cover the model (vLLM raises on uninitialised
    weights); transformers fills them with random values and only logs it. Keys transformers ties or
    derives (a tied ``lm_head.weight``, non-persistent buffers) never reach ``missing_keys``. Unexpected
    keys are ignored, as transformers does (a checkpoint may carry heads or buffers this class does not use).
    """
    files = ", ".join(p.name for p in _weight_files(path))
    mismatched = sorted(info.get("mismatched_keys") or [])
    if mismatched:
        key, found, expected = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise ModelError(f"{path}: tensor {key} in {files} has shape {_shape(found)}, the model expects "
                         f"{_shape(expected)}{more}; the checkpoint does not match its config.json")
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:3])
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelError(f"{path}: {files} lacks {len(missing)} of the model's tensors ({shown}{more}); "
                         "kvload does not run uninitialised weights")


def _shape(shape: Any) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


@contextlib.contextmanager
def _quiet_load_report() -> Iterator[None]:
    """Keep transformers' warnings (its LOAD REPORT table) off stderr for the duration, restoring its verbosity."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(was)


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """Silence transformers' progress bars for the duration, restoring the caller's setting."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _load_error(what: str, exc: Exception) -> Exception:
    """Out of memory is a runtime failure (exit 1); anything else means the checkpoint cannot be used."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return KvRuntimeError(f"{what}: out of memory ({first_line(exc)})")
    return ModelError(f"{what}: {first_line(exc)}")


#: The files whose presence makes a checkpoint directory's tokenizer (any one of them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(checkpoint: Checkpoint) -> bool:
    """Whether :func:`load_weights` will give ``checkpoint`` a tokenizer (told before anything loads): a preset has
    none (random weights), a GGUF carries its own, a directory has one when it holds a tokenizer file."""
    if checkpoint.kind == "preset":
        return False
    if checkpoint.gguf_file:
        return True
    return any(os.path.lexists(checkpoint.path / f) for f in TOKENIZER_FILES)


def load_tokenizer(path: Path) -> Any:
    """The tokenizer saved in a checkpoint directory, or None when it has none."""
    from transformers import AutoTokenizer

    present = [path / f for f in TOKENIZER_FILES if os.path.lexists(path / f)]
    if not present:
        return None
    if os.path.lexists(path / "chat_template.jinja"):  # a FIFO there read as an empty template: "Can't compile
        present.append(path / "chat_template.jinja")  # non template nodes", naming neither file nor template
    for file in present:  # a FIFO, a directory or a broken link was "has no tokenizer", with the culprit right there
        check_regular_file(file, "a tokenizer file", "the tokenizer")
    if (path / "tokenizer_config.json").is_file():  # read as config.json is: transformers calls .get on what it holds,
        # so a list was an AttributeError
        config = read_json_object(path / "tokenizer_config.json", "a tokenizer config")
        name = config.get("tokenizer_class")
        if name is not None and not isinstance(name, str):  # transformers called name.removesuffix: AttributeError
            raise ModelError(f"{path / 'tokenizer_config.json'}: tokenizer_class: expected a tokenizer class name "
                             f"such as 'PreTrainedTokenizerFast', or null; got {short(name)}")
    if os.path.lexists(path / "special_tokens_map.json"):  # transformers calls .items() on it: a list was too
        read_json_object(path / "special_tokens_map.json", "a special tokens map")
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:  # a shape transformers did not expect
        raise _malformed_tokenizer_json(path) or ModelError(
            f"{path}: transformers cannot load the tokenizer: {first_line(exc)}") from exc
    except Exception as exc:
        if type(exc) is not Exception:  # MemoryError and the like stay what they are
            raise
        # the tokenizers library raises a bare Exception for a tokenizer.json that is JSON but not a tokenizer it
        # knows ("data did not match any variant of untagged enum ModelUntagged at line 1 column 2053629"); the line
        # was "load_weights: Exception: ...", naming neither the file nor the checkpoint
        file = path / "tokenizer.json" if (path / "tokenizer.json").is_file() else path
        raise ModelError(f"{file}: the tokenizers library cannot read it as a tokenizer: {first_line(exc)}") from exc


def _malformed_tokenizer_json(path: Path) -> ModelError | None:
    """``tokenizer.json`` named, with where, when it is not UTF-8 JSON holding an object (asked after a failed load
    only: the file runs to megabytes, and transformers' words named the folder: "Expecting ',' delimiter: ...")."""
    import json

    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        return ModelError(f"{file}: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); JSON files "
                          "are UTF-8 text")
    except json.JSONDecodeError as exc:
        return ModelError(f"{file}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}")
    except (OSError, RecursionError, ValueError):
        return None
    if not isinstance(data, dict):
        return ModelError(f"{file}: expected a JSON object (a tokenizers model), got {type(data).__name__}")
    if "model" not in data:  # `{}` read "<folder>: transformers cannot load the tokenizer: 'added_tokens'"
        return ModelError(f"{file}: no 'model' key: a tokenizer.json of the tokenizers library holds its model (and "
                          "version, added_tokens, ...)")
    return None


def check_fp32_kept(hf_config: Any, dtype: str) -> None:
    """``ModelError`` for DeepSeek V4 weights loaded in float16: transformers keeps its compressor projections in
    float32 there (``_keep_in_fp32_modules``, float16 only) and then feeds them float16, so every forward fails
    (``model.generate`` too) with a dtype mismatch, after the weights loaded."""
    model_type = getattr(hf_config, "model_type", None)
    if dtype == "float16" and model_type == "deepseek_v4":
        raise ModelError(f"dtype 'float16': transformers' {model_type} keeps its compressor projections in float32 "
                         "under float16 and cannot run them on float16 inputs (model.generate fails too); "
                         "set dtype to bfloat16 or float32")


def load_weights(checkpoint: Checkpoint, hf_config: Any, *, device: str, dtype: str, seed: int = 0,
                 tp_size: int = 1, random_dir: Path | None = None, tokenizer: Any = None,
                 overridden: bool = False) -> LoadedWeights:
    """Weights and tokenizer of a checkpoint on ``device`` in ``dtype`` (see the module docstring).

    ``tp_size > 1``: this rank's shard (every rank calls it); a preset's random weights are read from
    ``random_dir``, where one rank saved them (:func:`save_random_model`), since ``from_config`` cannot shard.
    ``tokenizer``: the checkpoint's, loaded already (:func:`load_tokenizer`), used rather than loaded again.
    ``overridden``: ``hf_config`` is not the directory's config.json as it is (vLLM's ``hf_overrides``): the model
    is built from it.
    """
    start = time.perf_counter()
    converted = False
    if checkpoint.kind != "preset" or tp_size > 1:  # from_pretrained: a preset's from_config casts every weight
        check_fp32_kept(hf_config, dtype)
    if checkpoint.kind == "preset" and tp_size > 1:
        if random_dir is None:
            raise ValueError("a preset sharded over several ranks loads from the directory one rank saved it to")
        model = pretrained_model(random_dir, device=device, dtype=dtype, tp_size=tp_size)
        loaded = LoadedWeights(model, None, "random", str(checkpoint.path))
    elif checkpoint.kind == "preset":
        model = random_model(hf_config, device=device, dtype=dtype, seed=seed)
        loaded = LoadedWeights(model, None, "random", str(checkpoint.path))
    else:
        path, source = checkpoint.path, "safetensors"
        if checkpoint.gguf_file:
            from models.gguf_cache import cached_conversion, convert_gguf

            converted = cached_conversion(checkpoint) is None
            path, source = convert_gguf(checkpoint, tokenizer=tokenizer), "gguf"
        from models.classifier import classifier_kind, token_head_tokens, with_token_head

        tokens = token_head_tokens(hf_config)  # vLLM's classifier from the causal LM's own head (Qwen3-Reranker)
        if tokens is not None and tp_size > 1:
            raise ModelError(f"tensor_parallel_size={tp_size}: {path} is served as a classifier built from its "
                             "lm_head (classifier_from_token), which kvload runs on one rank; run it with "
                             "tensor_parallel_size=1")
        if tokens is not None:
            tokenizer = load_tokenizer(path) if tokenizer is None else tokenizer
        model = pretrained_model(path, device=device, dtype=dtype, tp_size=tp_size,
                                 classifier=(tokens is None and classifier_kind(hf_config)) or False,
                                 config=hf_config if overridden or tokens is not None else None)
        try:
            tokenizer = load_tokenizer(path) if tokenizer is None else tokenizer
            if tokens is not None:
                model = with_token_head(model, tokenizer, tokens, path)
        except BaseException:
            del model
            raise
        loaded = LoadedWeights(model, tokenizer, source, str(path), converted)
    loaded.duration_ms = round((time.perf_counter() - start) * 1000, 3)
    return loaded


