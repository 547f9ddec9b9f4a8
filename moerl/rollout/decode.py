"""Decode SGLang-native `/generate` responses into `Trajectory` fields.

# P prompt tokens, R response tokens, L hidden layers, K experts per token, N mask nnz

Formats (SGLang 0.5.23, see docs/architecture.md, "The engine protocol"):
- meta_info.output_token_logprobs: [[logprob, token_id, text-or-null], ...], one per output id.
- meta_info.routed_experts: base64 of the C-order little-endian int32 bytes of
  [rows, num_hidden_layers, topk]; rows cover tokens [routed_experts_start_len, P + R - 1).
- meta_info.weight_versions: [{"version": str, "start": int, "end": int}], positions are
  output-token indices, end exclusive, contiguous from 0 to R. Absent on engines that only
  report meta_info.weight_version, which then applies to every token.
- meta_info.output_token_sampling_mask: one list of kept token ids per output token;
  meta_info.output_token_sampling_logprobs: one float per token ("selected" mode).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np

from moerl.common.trajectory import Trajectory
from moerl.rollout.errors import EngineError, RoutedExpertsMissing, SamplingMaskMissing

# SGLang treats temperatures below this as greedy: top_k=1 and temperature 1.0.
_GREEDY_EPS = 1e-6

ROUTED_EXPERTS_FIX = (
    "start every SGLang server with --enable-return-routed-experts (the moerl engine "
    "captures routing by default), or turn routing replay off"
)


def parse_version(version: Any) -> int:
    """Policy versions travel as strings ("3"); moerl versions are integers."""
    try:
        return int(str(version).strip())
    except ValueError:
        raise EngineError(
            f"engine reported weight_version {version!r}, which is not an integer; moerl "
            f"publishes integer versions: start SGLang with --weight-version 0 or call "
            f"update_weight_version() before generating"
        ) from None


def versions_from_spans(
    spans: Sequence[Mapping[str, Any]] | None, num_tokens: int, fallback: Any = None
) -> np.ndarray:
    """Per-token int32 [R] versions from weight_versions spans (end exclusive).

    Without spans every token gets `fallback` (meta_info.weight_version).
    """
    if not spans:
        if fallback is None:
            raise EngineError("response has neither weight_versions nor weight_version")
        return np.full(num_tokens, parse_version(fallback), dtype=np.int32)
    versions_R = np.full(num_tokens, -1, dtype=np.int64)
    for span in spans:
        start, end = int(span["start"]), int(span["end"])
        if not 0 <= start <= end <= num_tokens:
            raise EngineError(
                f"weight_versions span {dict(span)} lies outside the {num_tokens} output tokens"
            )
        versions_R[start:end] = parse_version(span["version"])
    if (versions_R < 0).any():
        t = int(np.flatnonzero(versions_R < 0)[0])
        raise EngineError(
            f"weight_versions spans {list(spans)} leave output token {t} without a version"
        )
    return versions_R.astype(np.int32)


def decode_routed_experts(
    b64: str,
    *,
    rows: int,
    num_layers: int | None = None,
    topk: int | None = None,
) -> np.ndarray:
    """int32 [rows, L, K] from SGLang's base64 string. Given one of num_layers / topk, the
    other is inferred from the byte count; ids keep the engine's (unsorted) order."""
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as e:
        raise EngineError(f"meta_info.routed_experts is not valid base64: {e}") from None
    flat = np.frombuffer(raw, dtype="<i4")
    if num_layers is None and topk is None:
        raise ValueError(
            "decoding routed experts needs num_layers (num_hidden_layers) and/or topk "
            "(num_experts_per_tok)"
        )
    if num_layers is None or topk is None:
        known = num_layers if num_layers is not None else topk
        assert known is not None
        if rows == 0 or flat.size % (rows * known):
            raise EngineError(
                f"cannot split {flat.size} routed-expert ids into {rows} rows with "
                f"{'num_layers' if num_layers is not None else 'topk'}={known}; pass both "
                f"num_layers and topk"
            )
        other = flat.size // (rows * known)
        num_layers, topk = (known, other) if num_layers is not None else (other, known)
    if flat.size != rows * num_layers * topk:
        raise EngineError(
            f"meta_info.routed_experts holds {flat.size} ids, expected rows ({rows}) x "
            f"num_layers ({num_layers}) x topk ({topk}) = {rows * num_layers * topk}"
        )
    return flat.astype(np.int32).reshape(rows, num_layers, topk)


def response_routes(
    response: Mapping[str, Any],
    *,
    rows: int,
    num_layers: int | None,
    topk: int | None,
    url: str | None = None,
) -> np.ndarray:
    """int32 [rows, L, K]: a /generate response's routed experts (``rows`` of them: the
    request's routed_experts_start_len on); RoutedExpertsMissing when it has none."""
    b64 = response["meta_info"].get("routed_experts")
    if b64 is None:
        raise RoutedExpertsMissing(
            f"routed experts were requested but the response (engine {url}) has none: "
            f"{ROUTED_EXPERTS_FIX}",
            urls=[url] if url else None,
        )
    return decode_routed_experts(b64, rows=rows, num_layers=num_layers, topk=topk)


def sampling_mask_to_csr(masks: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(mask_ids int32 [N], mask_offsets int32 [R+1]) from one id list per output token."""
    lengths_R = np.fromiter((len(m) for m in masks), dtype=np.int64, count=len(masks))
    offsets = np.zeros(len(masks) + 1, dtype=np.int64)
    np.cumsum(lengths_R, out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise EngineError(f"sampling mask has {int(offsets[-1])} entries, too many for int32")
    ids_N = np.fromiter(chain.from_iterable(masks), dtype=np.int32, count=int(offsets[-1]))
    return ids_N, offsets.astype(np.int32)


def output_logprobs(entries: Sequence[Sequence[Any]], output_ids: np.ndarray) -> np.ndarray:
    """float32 [R] from [[logprob, token_id, text], ...]; token ids must match output_ids."""
    if len(entries) != output_ids.shape[0]:
        raise EngineError(
            f"output_token_logprobs has {len(entries)} entries for {output_ids.shape[0]} output ids"
        )
    logprobs_R = np.empty(len(entries), dtype=np.float32)
    for t, entry in enumerate(entries):
        logprob, token_id = entry[0], entry[1]
        if logprob is None:
            raise EngineError(f"output_token_logprobs[{t}] has no logprob")
        if int(token_id) != int(output_ids[t]):
            raise EngineError(
                f"output_token_logprobs[{t}] is for token {token_id} but output_ids[{t}] is "
                f"{int(output_ids[t])}"
            )
        logprobs_R[t] = logprob
    return logprobs_R


def effective_temperature(sampling_params: Mapping[str, Any]) -> float:
    """The temperature SGLang samples with: missing/None -> 1.0, greedy (< 1e-6) -> 1.0."""
    temperature = sampling_params.get("temperature")
    if temperature is None:
        return 1.0
    temperature = float(temperature)
    return 1.0 if 0 <= temperature < _GREEDY_EPS else temperature


def finish_type(finish_reason: Any) -> str | None:
    if finish_reason is None:
        return None
    if isinstance(finish_reason, Mapping):
        kind = finish_reason.get("type")
        return None if kind is None else str(kind)
    return str(finish_reason)


def response_from_openai_choice(choice: Mapping[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """One ``/v1/chat/completions`` choice as a /generate response and its prompt ids,
    the inputs of ``trajectory_from_response``: an agent's OpenAI calls made with SGLang's
    ``return_meta_info`` and ``return_token_ids`` (plus ``logprobs``, and
    ``return_routed_experts`` / ``return_sampling_mask`` for replay) carry everything a
    Trajectory needs, from SGLang or the embedded engine alike."""
    meta = choice.get("meta_info")
    output_ids = choice.get("response_token_ids")
    prompt_ids = choice.get("prompt_token_ids")
    if not isinstance(meta, Mapping) or output_ids is None or prompt_ids is None:
        raise EngineError(
            "the chat completion choice has no meta_info / response_token_ids / "
            "prompt_token_ids: send return_meta_info=true and return_token_ids=true "
            "(in the openai client's extra_body)"
        )
    text = (choice.get("message") or {}).get("content") or ""
    return {"text": text, "output_ids": list(output_ids), "meta_info": dict(meta)}, list(prompt_ids)


def trajectory_from_response(
    response: Mapping[str, Any],
    prompt_ids: Any,
    sampling_params: Mapping[str, Any],
    *,
    routed_experts: bool = False,
    sampling_mask: bool = False,
    num_layers: int | None = None,
    topk: int | None = None,
    group_id: int | str | None = None,
    index: int | None = None,
    url: str | None = None,
) -> Trajectory:
    """Build a Trajectory from one /generate response requested with return_logprob and
    routed_experts_start_len=0. Raises RoutedExpertsMissing / SamplingMaskMissing when a
    requested field is absent, EngineError when the response is inconsistent."""
    if not isinstance(response, Mapping) or "meta_info" not in response:
        raise EngineError(f"not a /generate response: {str(response)[:200]}")
    meta = response["meta_info"]
    where = f" (engine {url})" if url else ""
    prompt_P = np.asarray(prompt_ids, dtype=np.int32).reshape(-1)
    output_R = np.asarray(response.get("output_ids") or [], dtype=np.int32).reshape(-1)
    R = output_R.shape[0]

    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise EngineError(f"response has no output_token_logprobs{where}; send return_logprob")
    logprobs_R = output_logprobs(entries, output_R)
    versions_R = versions_from_spans(meta.get("weight_versions"), R, meta.get("weight_version"))

    routes_TLK = None
    finish = finish_type(meta.get("finish_reason"))
    # aborted before its first token (SGLang: "Abort in waiting queue"): no forward ran,
    # so there are no routes to give; the partial-rollout path starts it again
    not_started = R == 0 and finish == "abort"
    if routed_experts and not not_started:
        b64 = meta.get("routed_experts")
        if b64 is None:
            raise RoutedExpertsMissing(
                f"routed experts were requested but the response{where} has none: "
                f"{ROUTED_EXPERTS_FIX}",
                urls=[url] if url else None,
            )
        rows = max(prompt_P.shape[0] + R - 1, 0)
        routes_TLK = decode_routed_experts(b64, rows=rows, num_layers=num_layers, topk=topk)

    mask_ids = mask_offsets = sampling_logprobs = None
    if sampling_mask:
        masks = meta.get("output_token_sampling_mask")
        if masks is None:
            raise SamplingMaskMissing(
                f"a sampling mask was requested but the response{where} has none; the engine "
                f"must support return_sampling_mask (SGLang >= 0.5.23 or moerl.engine)",
                urls=[url] if url else None,
            )
        if len(masks) != R:
            raise EngineError(f"output_token_sampling_mask has {len(masks)} rows for {R} tokens")
        mask_ids, mask_offsets = sampling_mask_to_csr(masks)
        selected = meta.get("output_token_sampling_logprobs")
        if selected is not None:
            if any(isinstance(v, list) for v in selected):
                raise EngineError(
                    "output_token_sampling_logprobs holds per-support lists; request "
                    "sampling_logprobs_mode='selected'"
                )
            sampling_logprobs = np.asarray(selected, dtype=np.float32)

    info = {
        "rid": meta.get("id"),
        "engine_url": url,
        "finish_reason": meta.get("finish_reason"),
        "weight_versions": meta.get("weight_versions"),
        "prompt_tokens": meta.get("prompt_tokens"),
        "completion_tokens": meta.get("completion_tokens"),
        "cached_tokens": meta.get("cached_tokens"),
    }
    return Trajectory(
        prompt_ids=prompt_P,
        response_ids=output_R,
        response_logprobs=logprobs_R,
        versions=versions_R,
        sampling_logprobs=sampling_logprobs,
        routed_experts=routes_TLK,
        mask_ids=mask_ids,
        mask_offsets=mask_offsets,
        temperature=effective_temperature(sampling_params),
        finish_reason=finish,
        group_id=group_id,
        index=index,
        meta={k: v for k, v in info.items() if v is not None},
    )
