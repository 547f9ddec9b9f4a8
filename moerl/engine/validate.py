"""Typed, finite checks of every request body, run before anything reaches the scheduler.

The scheduler thread serves every request of the engine, so a body it cannot handle must be
refused at the door: a number that is not finite (Python's json reads ``NaN``), a value of
the wrong type (``"top_k": 2.5``, ``"temperature": "0.8"``, ``"stop_token_ids": [[1]]``),
a single request given a list where SGLang takes one value, an impossible shape or group.
Each failure is a ``RequestError`` (HTTP 400) whose message starts with the field's path.

Types follow SGLang 0.5.23 (``GenerateReqInput`` and ``SamplingParams``): ``null`` means
"the default" for every sampling parameter, a batch (``input_ids`` as a list of lists,
``text`` as a list) takes a value or a per-item list for per-request fields. Ranges of the
sampling parameters are checked where they are defined (``moerl.engine.core.sampling``); this
module checks only what the engine needs to stay up, plus these bounds of its own:

- ``n`` (parallel samples of one request) is at most ``MAX_N``;
- ``update_weights_from_distributed`` shapes are lists of non-negative integers;
- ``init_weights_update_group`` needs ``0 <= rank_offset < world_size`` and a TCP port.

Tensors (pushed weights, LoRA adapters) must be finite too: ``nonfinite_tensor`` names the
first one that is not, so nothing is applied.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

MAX_N = 1024
"""Bound on ``sampling_params.n``: every sample is a request in the engine's queue."""

_SHOW = 80  # characters of a bad value quoted back in an error message


class RequestError(ValueError):
    """A request body the engine refuses (HTTP 400); ``field`` is its path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def show(value: Any) -> str:
    """``repr(value)``, cut to a length fit for an error message."""
    text = repr(value)
    return text if len(text) <= _SHOW else text[: _SHOW - 3] + "..."


# -- kinds of JSON values ----------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """A JSON value type: ``test`` accepts a value, ``words`` describe it to the user."""

    test: Callable[[Any], bool]
    words: str

    def __or__(self, other: Kind) -> Kind:
        return Kind(lambda v: self.test(v) or other.test(v), f"{self.words} or {other.words}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


INT = Kind(_is_int, "an integer")
NUMBER = Kind(lambda v: _is_int(v) or isinstance(v, float), "a number")
BOOL = Kind(lambda v: isinstance(v, bool), "true or false")
STR = Kind(lambda v: isinstance(v, str), "a string")
OBJECT = Kind(lambda v: isinstance(v, dict), "an object")
NULL = Kind(lambda v: v is None, "null")
ANY = Kind(lambda v: True, "anything")


def list_of(kind: Kind, plural: str) -> Kind:
    return Kind(lambda v: isinstance(v, list) and all(kind.test(x) for x in v), plural)


INTS = list_of(INT, "a list of integers")
STRS = list_of(STR, "a list of strings")
STR_TO_NUMBER = Kind(
    lambda v: isinstance(v, dict) and all(NUMBER.test(x) for x in v.values()),
    "an object of numbers",
)

# SGLang 0.5.23's API sampling parameters (sglang/srt/sampling/sampling_params.py). Which of
# them the engine serves is decided in moerl.engine.core.sampling; here only their types.
SAMPLING: dict[str, Kind] = {
    "max_new_tokens": INT,
    "stop": STR | STRS,
    "stop_token_ids": INTS,
    "stop_regex": STR | STRS,
    "temperature": NUMBER,
    "top_p": NUMBER,
    "top_k": INT,
    "min_p": NUMBER,
    "frequency_penalty": NUMBER,
    "presence_penalty": NUMBER,
    "repetition_penalty": NUMBER,
    "min_new_tokens": INT,
    "n": INT,
    "beam_width": INT,
    "json_schema": STR,
    "regex": STR,
    "ebnf": STR,
    "structural_tag": STR,
    "ignore_eos": BOOL,
    "skip_special_tokens": BOOL,
    "spaces_between_special_tokens": BOOL,
    "no_stop_trim": BOOL,
    "stream_interval": INT,
    "logit_bias": STR_TO_NUMBER,
    "sampling_seed": INT,
    "custom_params": OBJECT,
    "watermark": OBJECT,
}

# /generate fields that hold one value per request: a batch may give a per-item list.
PER_REQUEST: dict[str, Kind] = {
    "sampling_params": OBJECT,
    "rid": STR,
    "return_logprob": BOOL,
    "logprob_start_len": INT,
    "top_logprobs_num": INT,
    "token_ids_logprob": INTS,
    "lora_path": STR,
    "return_sampling_mask": BOOL,
    "sampling_logprobs_mode": STR,
}
# /generate fields that hold one value for the whole call.
PER_CALL: dict[str, Kind] = {
    "stream": BOOL,
    "return_text_in_logprobs": BOOL,
    "return_routed_experts": BOOL,
    "routed_experts_start_len": INT,
}

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""SGLang's memory regions for /release_memory_occupation and /resume_memory_occupation."""
SELECTORS = ("target", "draft", "all")
"""/begin_weight_update's runners (SGLang's; this engine has no draft model)."""

# The control endpoints' fields (unknown fields are ignored, as SGLang ignores them).
CONTROL: dict[str, dict[str, Kind]] = {
    "/pause_generation": {"mode": STR},
    "/abort_request": {"rid": STR, "abort_all": BOOL},
    "/update_weight_version": {"new_version": STR | INT, "abort_all_requests": BOOL},
    "/init_weights_update_group": {
        "master_address": STR,
        "master_port": INT,
        "rank_offset": INT,
        "world_size": INT,
        "group_name": STR,
        "backend": STR,
    },
    "/destroy_weights_update_group": {"group_name": STR},
    "/begin_weight_update": {"selector": STR},
    "/update_weights_from_distributed": {
        "names": STRS,
        "dtypes": STRS,
        "shapes": list_of(INTS, "a list of shapes (lists of integers)"),
        "group_name": STR,
        "load_format": STR,
        "weight_version": STR,
        "abort_all_requests": BOOL,
        "flush_cache": BOOL,
    },
    "/update_weights_from_tensor": {
        "serialized_named_tensors": STRS,
        "load_format": STR,
        "flush_cache": BOOL,
        "abort_all_requests": BOOL,
        "weight_version": STR,
        "selector": STR,
        "torch_empty_cache": BOOL,
    },
    "/release_memory_occupation": {"tags": STRS},
    "/resume_memory_occupation": {"tags": STRS},
    "/load_lora_adapter": {"lora_name": STR, "lora_path": STR, "pinned": BOOL},
    "/load_lora_adapter_from_tensors": {
        "lora_name": STR,
        "config_dict": OBJECT,
        "serialized_named_tensors": STRS,  # SGLang's: handles, one dump per TP rank
        "load_format": STR,
        "safetensors_b64": STR,  # moerl's extension: the bytes, from any host
        "pinned": BOOL,
    },
    "/unload_lora_adapter": {"lora_name": STR},
}

# PEFT adapter_config.json keys the engine reads (moerl.engine.lora.adapters).
PEFT_CONFIG: dict[str, Kind] = {
    "r": INT,
    "lora_alpha": NUMBER,
    "target_modules": STR | STRS,
    "layers_to_transform": INT | INTS,
    "use_rslora": BOOL,
    "use_dora": BOOL,
    "rank_pattern": OBJECT,
    "alpha_pattern": OBJECT,
}


# -- checks ------------------------------------------------------------------------------------


def check_finite(value: Any, root: str = "") -> None:
    """Refuse NaN and ±inf anywhere in a parsed JSON value (iteratively: any depth). The
    values are looked at first without their paths (a weight push names every tensor);
    only a refusal walks again to name where the bad number is."""
    stack: list[Any] = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float):
            if not math.isfinite(v):
                _refuse_nonfinite(value, root)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def _refuse_nonfinite(value: Any, root: str) -> None:
    """``check_finite``'s refusal: the path of the first NaN or ±inf, in its walk's order."""
    stack: list[tuple[str, Any]] = [(root, value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            raise RequestError(path or "body", f"must be a finite number, got {v}")
        if isinstance(v, dict):
            stack.extend((f"{path}.{k}" if path else str(k), x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v))


def check_fields(body: Mapping[str, Any], kinds: Mapping[str, Kind], prefix: str = "") -> None:
    """Each known field is null or of its kind."""
    for name, kind in kinds.items():
        value = body.get(name)
        if value is not None and not kind.test(value):
            raise RequestError(f"{prefix}{name}", f"must be {kind.words}, got {show(value)}")


def check_sampling(raw: Any, path: str) -> dict[str, Any] | None:
    """One ``sampling_params`` object: typed, ``n`` bounded; ``null`` values dropped (SGLang
    reads them as the default), except ``max_new_tokens`` whose null means 'no limit'."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RequestError(path, f"must be an object, got {show(raw)}")
    check_fields(raw, SAMPLING, f"{path}.")
    n = raw.get("n")
    if n is not None and not 1 <= n <= MAX_N:
        raise RequestError(f"{path}.n", f"must be in 1..{MAX_N} (parallel samples), got {n}")
    return {k: v for k, v in raw.items() if v is not None or k == "max_new_tokens"}


def is_batch(body: Mapping[str, Any]) -> bool:
    """SGLang's batch form: ``input_ids`` a list of lists, or ``text`` a list (when both
    are given, both in batch form: a request is never half batch)."""
    ids, text = body.get("input_ids"), body.get("text")
    text_batch = isinstance(text, list)
    ids_batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    if text is not None and ids is not None:
        return text_batch and ids_batch
    return text_batch or ids_batch


def split_batch(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One body per prompt, as SGLang's ``GenerateReqInput.__getitem__`` splits a batch:
    a per-request field given as a list is taken item by item (one value per prompt),
    any other value is shared, and a string ``rid`` becomes ``rid_i``."""
    if not is_batch(body):
        return [dict(body)]
    size = len(body["input_ids"] if body.get("input_ids") is not None else body["text"])
    items = [dict(body) for _ in range(size)]
    for name in ("input_ids", "text", *PER_REQUEST):
        value = body.get(name)
        per_item = isinstance(value, list) and (
            name != "token_ids_logprob" or all(isinstance(x, list) or x is None for x in value)
        )
        if value == [] and name == "token_ids_logprob":
            per_item = False
        if not per_item or not isinstance(value, list):  # per_item: a list
            continue
        if len(value) != size:
            raise RequestError(name, f"has {len(value)} values for a batch of {size} prompts")
        for item, v in zip(items, value):
            item[name] = v
    if isinstance(body.get("rid"), str):
        for i, item in enumerate(items):
            item["rid"] = f"{body['rid']}_{i}"
    return items


def check_generate(body: Mapping[str, Any]) -> dict[str, Any]:
    """A /generate body, checked; returns it with its sampling parameters normalised.
    Types first, then NaN and inf anywhere: a value of the wrong type is named as that
    (``"return_logprob": -Infinity`` must be true or false), a NaN number as not finite."""
    batch = is_batch(body)
    check_fields(
        body,
        {
            "text": STRS if batch else STR,
            "input_ids": list_of(INTS, "a list of lists of token ids") if batch else INTS,
        },
    )
    if batch and body.get("text") == []:
        raise RequestError("text", "a batch needs at least one prompt, got []")
    check_fields(body, PER_CALL)
    for name, kind in PER_REQUEST.items():
        per_item = list_of(kind | NULL, f"a list of {name} values, one per request")
        check_fields(body, {name: kind | per_item if batch else kind})
    out = dict(body)
    params = body.get("sampling_params")
    if isinstance(params, list):
        out["sampling_params"] = [
            check_sampling(p, f"sampling_params[{i}]") for i, p in enumerate(params)
        ]
    else:
        out["sampling_params"] = check_sampling(params, "sampling_params")
    check_finite(body)
    return out


def check_control(path: str, body: Mapping[str, Any]) -> None:
    """A control endpoint's body: typed, finite, and the values no group or load can use."""
    check_fields(body, CONTROL.get(path, {}))
    check_finite(body)
    if path == "/init_weights_update_group":
        rank, world, port = body.get("rank_offset"), body.get("world_size"), body.get("master_port")
        if world is not None and world < 1:
            raise RequestError("world_size", f"must be >= 1, got {world}")
        if rank is not None and not 0 <= rank < (world if world is not None else rank + 1):
            raise RequestError("rank_offset", f"must be in [0, world_size={world}), got {rank}")
        if port is not None and not 1 <= port <= 65535:
            raise RequestError("master_port", f"must be a TCP port in 1..65535, got {port}")
    elif path == "/update_weights_from_distributed":
        for i, shape in enumerate(body.get("shapes") or []):
            if any(d < 0 for d in shape):
                raise RequestError(f"shapes[{i}]", f"dimensions must be >= 0, got {show(shape)}")
    elif path in ("/release_memory_occupation", "/resume_memory_occupation"):
        bad = [t for t in body.get("tags") or [] if t not in MEMORY_TAGS]
        if bad:
            raise RequestError("tags", f"{show(bad)} unknown; choose from {list(MEMORY_TAGS)}")
    elif path == "/begin_weight_update" and body.get("selector") not in (None, *SELECTORS):
        raise RequestError(
            "selector", f"must be one of {list(SELECTORS)}, got {show(body['selector'])}"
        )
    elif path == "/load_lora_adapter_from_tensors" and isinstance(body.get("config_dict"), dict):
        check_peft_config(body["config_dict"], "config_dict")


def check_peft_config(config: Mapping[str, Any], path: str = "adapter_config") -> None:
    """The PEFT adapter config keys the engine reads: finite, typed, ``r >= 1``."""
    check_fields(config, PEFT_CONFIG, f"{path}.")
    check_finite(config, path)
    rank = config.get("r")
    if rank is not None and rank < 1:
        raise RequestError(f"{path}.r", f"must be >= 1, got {rank}")


def nonfinite_tensor(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating-point tensor holding NaN or ±inf, else None."""
    for name, tensor in named:
        if tensor.is_floating_point() and tensor.numel() and not _finite(tensor):
            return name
    return None


def _chunks_finite(values: np.ndarray) -> bool:
    """numpy's isfinite, a cache-sized chunk at a time."""
    mask = np.empty(min(_CHUNK, values.size), dtype=bool)
    for start in range(0, values.size, _CHUNK):
        chunk = values[start : start + _CHUNK]
        out = mask[: chunk.size]
        np.isfinite(chunk, out=out)
        if not out.all():
            return False
    return True


def _chunks_exponent_finite(ints: np.ndarray, exponent: int) -> bool:
    """No value with every exponent bit set (NaN, ±inf), a cache-sized chunk at a time
    (bfloat16, which numpy has no float type for)."""
    bits = np.empty(min(_CHUNK, ints.size), dtype=ints.dtype)
    hits = np.empty(bits.size, dtype=bool)
    for start in range(0, ints.size, _CHUNK):
        chunk = ints[start : start + _CHUNK]
        n = chunk.size
        np.bitwise_and(chunk, exponent, out=bits[:n])
        np.equal(bits[:n], exponent, out=hits[:n])
        if hits[:n].any():
            return False
    return True


# IEEE floats: NaN and ±inf are exactly the values whose exponent bits are all ones
_EXPONENT_BITS = {
    torch.float64: (torch.int64, 0x7FF0000000000000),
    torch.float32: (torch.int32, 0x7F800000),
    torch.float16: (torch.int16, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7F80),
}


_NUMPY_FLOATS = (torch.float64, torch.float32, torch.float16)
_CHUNK = 1 << 16
"""Elements a CPU check looks at in one go: its temporary stays in the core's cache (a
whole-tensor temporary made the 176 MB check of tools/bench/weight_sync.py's mid model
two to three times slower)."""


def _finite(tensor: torch.Tensor) -> bool:
    bits = _EXPONENT_BITS.get(tensor.dtype)
    if bits is not None and tensor.device.type == "cpu" and tensor.is_contiguous():
        # in numpy, on this thread alone: the engine checks pushed weights off its
        # scheduler thread, and a torch reduction there would start a second OpenMP
        # team beside the scheduler's (the two then fight for the cores; decode steps of
        # the tiny model took twice as long after every push)
        flat = tensor.reshape(-1)
        if tensor.dtype in _NUMPY_FLOATS:
            return _chunks_finite(flat.numpy())
        return _chunks_exponent_finite(flat.view(bits[0]).numpy(), bits[1])
    # min and max in one pass, without isfinite's mask: NaN spreads to both, ±inf is one
    try:
        low, high = torch.aminmax(tensor)
    except RuntimeError:  # a dtype without aminmax (float8)
        return bool(torch.isfinite(tensor).all())
    return math.isfinite(low.item()) and math.isfinite(high.item())
