"""Async client for the engine protocol (SGLang native API subset; docs/architecture.md,
"The engine protocol").

One `EngineClient` talks to any number of engines (SGLang servers or `moerl.engine`).
`generate*` go to the least-loaded engine with failover; control calls go to every engine
concurrently and return `{url: parsed body}` (retry and error rules: moerl/rollout/transport.py).

Response bodies are SGLang's: most control calls answer `{"success", "message"}`, pause and
continue `{"message", "status"}`, LoRA calls `{"success", "error_message", ...}`, abort and
health an empty body (returned as `{}`), flush_cache plain text (returned as `{"message"}`).
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from moerl.common.checks import one_of
from moerl.common.trajectory import Trajectory
from moerl.rollout.decode import trajectory_from_response
from moerl.rollout.errors import EngineError
from moerl.rollout.transport import DEAD_ENGINE_FIX, EngineTransport

if TYPE_CHECKING:
    import torch

ENGINE_URL_KEY = "_engine_url"
"""generate() adds the base URL of the engine that served the request under this key."""

PAUSE_MODES = ("abort", "retract", "in_place")
DEFAULT_GROUP = "weight_update_group"
SAMPLING_LOGPROBS_MODES = ("selected", "support")


def build_generate_body(
    input_ids: Any,
    sampling_params: Mapping[str, Any],
    *,
    return_logprob: bool = True,
    return_routed_experts: bool = False,
    routed_experts_start_len: int | None = None,
    return_sampling_mask: bool = False,
    sampling_logprobs_mode: str | None = None,
    logprob_start_len: int | None = None,
    rid: str | None = None,
    lora_path: str | None = None,
) -> dict[str, Any]:
    """The JSON body of one /generate request. Optional fields are left out when unset, so
    the server's defaults apply (SGLang rejects null for routed_experts_start_len and rejects
    sampling_logprobs_mode without return_sampling_mask)."""
    ids = np.asarray(input_ids)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"input_ids must be a non-empty 1-D token list, got shape {ids.shape}")
    if sampling_logprobs_mode is not None:
        if not return_sampling_mask:
            raise ValueError("sampling_logprobs_mode needs return_sampling_mask=True")
        one_of("sampling_logprobs_mode", sampling_logprobs_mode, SAMPLING_LOGPROBS_MODES)
    body: dict[str, Any] = {
        "input_ids": ids.astype(np.int64).tolist(),
        "sampling_params": dict(sampling_params),
        "return_logprob": bool(return_logprob),
        "stream": False,
    }
    if logprob_start_len is not None:
        body["logprob_start_len"] = int(logprob_start_len)
    if return_routed_experts:
        body["return_routed_experts"] = True
        if routed_experts_start_len is not None:
            body["routed_experts_start_len"] = int(routed_experts_start_len)
    if return_sampling_mask:
        body["return_sampling_mask"] = True
        if sampling_logprobs_mode is not None:
            body["sampling_logprobs_mode"] = sampling_logprobs_mode
    if rid is not None:
        body["rid"] = str(rid)
    if lora_path is not None:
        body["lora_path"] = lora_path
    return body


class EngineClient(EngineTransport):
    """Async client for one or more engines speaking the SGLang native API subset.

    Constructor: see EngineTransport (urls, api_key, timeout_s, max_retries,
    retry_backoff_s, control_timeout_s, connect_timeout_s, cooldown_s, max_connections,
    transport, mounts).
    """

    # ---- /generate -----------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Any,
        sampling_params: Mapping[str, Any],
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        routed_experts_start_len: int | None = None,
        return_sampling_mask: bool = False,
        sampling_logprobs_mode: str | None = None,
        logprob_start_len: int | None = None,
        rid: str | None = None,
        lora_path: str | None = None,
    ) -> Any:
        """POST one /generate to the least-loaded engine and return the raw response JSON: a
        dict ({"text", "output_ids", "meta_info"}), or a list of them when
        sampling_params["n"] > 1. Each dict gets the serving engine's base URL under
        ENGINE_URL_KEY ("_engine_url")."""
        body = build_generate_body(
            input_ids,
            sampling_params,
            return_logprob=return_logprob,
            return_routed_experts=return_routed_experts,
            routed_experts_start_len=routed_experts_start_len,
            return_sampling_mask=return_sampling_mask,
            sampling_logprobs_mode=sampling_logprobs_mode,
            logprob_start_len=logprob_start_len,
            rid=rid,
            lora_path=lora_path,
        )
        url, result = await self._post_balanced("/generate", body, rid=rid)
        for item in result if isinstance(result, list) else [result]:
            if isinstance(item, dict):
                item[ENGINE_URL_KEY] = url
        return result

    async def _sample(
        self,
        prompt_ids: Any,
        sampling_params: Mapping[str, Any],
        routed_experts: bool,
        sampling_mask: bool,
        num_layers: int | None,
        topk: int | None,
        rid: str | None,
        lora_path: str | None,
    ) -> Any:
        """The /generate a trajectory is decoded from: logprobs, the whole sequence's routes
        and the kept sets with the renormalised sampled logprob, as asked."""
        if routed_experts and num_layers is None and topk is None:
            raise ValueError("routed_experts=True needs num_layers and/or topk to decode them")
        return await self.generate(
            prompt_ids,
            sampling_params,
            return_logprob=True,
            return_routed_experts=routed_experts,
            routed_experts_start_len=0 if routed_experts else None,
            return_sampling_mask=sampling_mask,
            sampling_logprobs_mode="selected" if sampling_mask else None,
            rid=rid,
            lora_path=lora_path,
        )

    async def generate_trajectory(
        self,
        prompt_ids: Any,
        sampling_params: Mapping[str, Any],
        *,
        routed_experts: bool = False,
        sampling_mask: bool = False,
        num_layers: int | None = None,
        topk: int | None = None,
        group_id: int | str | None = None,
        index: int | None = None,
        rid: str | None = None,
        lora_path: str | None = None,
    ) -> Trajectory:
        """Sample one completion and decode it into a validated Trajectory.

        routed_experts asks for the whole sequence's routing (routed_experts_start_len=0) and
        needs num_layers (num_hidden_layers) and/or topk to shape it; a response without it
        raises RoutedExpertsMissing. sampling_mask asks for the kept sets and the
        renormalised logprob of the sampled token (sampling_logprobs_mode="selected").
        An aborted request (pause mode "abort", abort_request) comes back as a partial
        trajectory with finish_reason "abort".
        """
        if int(sampling_params.get("n") or 1) != 1:
            raise ValueError("generate_trajectory samples one completion; use generate_group")
        response = await self._sample(
            prompt_ids, sampling_params, routed_experts, sampling_mask, num_layers, topk, rid,
            lora_path,
        )  # fmt: skip
        if isinstance(response, list):
            raise EngineError("engine answered a single /generate with a list")
        traj = trajectory_from_response(
            response,
            prompt_ids,
            sampling_params,
            routed_experts=routed_experts,
            sampling_mask=sampling_mask,
            num_layers=num_layers,
            topk=topk,
            group_id=group_id,
            index=index,
            url=response.get(ENGINE_URL_KEY),
        )
        if lora_path is not None:
            traj.meta["lora_path"] = lora_path
        return traj.validate(num_layers=num_layers, topk=topk)

    async def generate_group(
        self,
        prompt_ids: Any,
        sampling_params: Mapping[str, Any],
        n: int,
        *,
        group_id: int | str | None = None,
        rid: str | None = None,
        one_request: bool = True,
        routed_experts: bool = False,
        sampling_mask: bool = False,
        num_layers: int | None = None,
        topk: int | None = None,
        lora_path: str | None = None,
    ) -> list[Trajectory]:
        """n completions of one prompt, index 0..n-1, decoded and validated as
        generate_trajectory's. one_request: a single /generate with sampling_params.n = n
        (SGLang's parallel sampling; the engine names the samples f"{rid}_{i}"); otherwise n
        concurrent requests, each load-balanced, with rids f"{rid}-{i}"."""
        kwargs: dict[str, Any] = {
            "routed_experts": routed_experts,
            "sampling_mask": sampling_mask,
            "num_layers": num_layers,
            "topk": topk,
        }
        if not one_request or n == 1:
            return list(
                await asyncio.gather(
                    *(
                        self.generate_trajectory(
                            prompt_ids,
                            sampling_params,
                            group_id=group_id,
                            index=i,
                            rid=None if rid is None else f"{rid}-{i}",
                            lora_path=lora_path,
                            **kwargs,
                        )  # fmt: skip
                        for i in range(n)
                    )
                )
            )
        params = {**sampling_params, "n": int(n)}
        responses = await self._sample(
            prompt_ids, params, routed_experts, sampling_mask, num_layers, topk, rid, lora_path
        )
        if not isinstance(responses, list) or len(responses) != n:
            got = f"{len(responses)} answers" if isinstance(responses, list) else "one answer"
            raise EngineError(f"engine answered a /generate with n={n} with {got}")
        one = {k: v for k, v in sampling_params.items() if k != "n"}
        trajs = []
        for i, response in enumerate(responses):
            traj = trajectory_from_response(
                response, prompt_ids, one, group_id=group_id, index=i,
                url=response.get(ENGINE_URL_KEY), **kwargs,
            )  # fmt: skip
            if lora_path is not None:
                traj.meta["lora_path"] = lora_path
            trajs.append(traj.validate(num_layers=num_layers, topk=topk))
        return trajs

    # ---- control calls -------------------------------------------------------------------

    async def pause_generation(self, mode: str, *, urls: Sequence[str] | None = None) -> dict:
        """mode "abort": in-flight requests return now with finish_reason abort; "retract":
        they go back to the queue and are re-prefilled after continue; "in_place": they stay
        with their KV cache (then update weights with flush_cache=False)."""
        one_of("pause mode", mode, PAUSE_MODES)
        return await self._broadcast("POST", "/pause_generation", {"mode": mode}, urls=urls)

    async def continue_generation(self, *, urls: Sequence[str] | None = None) -> dict:
        return await self._broadcast("POST", "/continue_generation", {}, urls=urls)

    async def abort_request(
        self,
        rid: str | None = None,
        abort_all: bool = False,
        *,
        urls: Sequence[str] | None = None,
    ) -> dict:
        """Abort one request (sent to the engine serving it when this client sent it, else to
        all) or every request. SGLang matches rid as a prefix (n>1 sub-requests included)."""
        if not rid and not abort_all:
            raise ValueError("abort_request needs a rid or abort_all=True")
        if urls is None and rid and rid in self._rid_url and not abort_all:
            urls = [self._rid_url[rid]]
        body = {"rid": rid or "", "abort_all": bool(abort_all)}
        return await self._broadcast("POST", "/abort_request", body, urls=urls)

    async def flush_cache(self, *, urls: Sequence[str] | None = None) -> dict:
        return await self._broadcast("POST", "/flush_cache", None, urls=urls)

    async def freeze_gc(self, *, urls: Sequence[str] | None = None) -> dict[str, Any]:
        """SGLang's /freeze_gc on every target engine: the objects it holds now leave its
        garbage collector's scans (moerl/common/gc_freeze.py). A server without the
        route (HTTP 404) is left as it is."""
        return await self._optional_call("/freeze_gc", None, urls)

    async def update_weight_version(
        self,
        version: int | str,
        *,
        abort_all_requests: bool = False,
        urls: Sequence[str] | None = None,
    ) -> dict:
        """Set the version later tokens are stamped with. SGLang's field is `new_version` and
        its abort_all_requests defaults to true; this client sends false unless asked."""
        body = {"new_version": str(version), "abort_all_requests": bool(abort_all_requests)}
        return await self._broadcast("POST", "/update_weight_version", body, urls=urls)

    async def release_memory_occupation(
        self, tags: Sequence[str] | None = None, *, urls: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """SGLang's colocation call: the engines free ``tags`` ("weights", "kv_cache",
        "cuda_graph"; None = all) until resume_memory_occupation; only on idle engines
        (pause_generation first). Released weights come back as zeros: push after resume."""
        body = {} if tags is None else {"tags": list(tags)}
        return await self._broadcast("POST", "/release_memory_occupation", body, urls=urls)

    async def resume_memory_occupation(
        self, tags: Sequence[str] | None = None, *, urls: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """Give back what release_memory_occupation freed (None = every released tag)."""
        body = {} if tags is None else {"tags": list(tags)}
        return await self._broadcast("POST", "/resume_memory_occupation", body, urls=urls)

    async def begin_weight_update(
        self, selector: str = "all", *, urls: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """Open SGLang's weight-update session on every target engine: from SGLang 0.5.23 on,
        update_weights_from_distributed and _from_tensor are refused outside one. A server
        without sessions (older SGLang: HTTP 404) needs none and counts as opened."""
        return await self._optional_call("/begin_weight_update", {"selector": selector}, urls)

    async def end_weight_update(self, *, urls: Sequence[str] | None = None) -> dict[str, Any]:
        """Close the session begin_weight_update opened (also after a failed load)."""
        return await self._optional_call("/end_weight_update", {}, urls)

    async def _optional_call(
        self, path: str, body: dict[str, Any] | None, urls: Sequence[str] | None
    ) -> dict[str, Any]:
        """POST ``path`` to every target; a server that has no such route (an older
        SGLang: HTTP 404) counts as done (it needs no session, or keeps its collector)."""

        async def one(url: str) -> Any:
            try:  # not re-sent: a second begin would be refused as already open
                return await self._control_one(url, "POST", path, body, idempotent=False)
            except EngineError as err:
                if err.status_code != 404:
                    raise
                return {"success": True, "message": f"{url} has no {path}"}

        targets = self._targets(urls)
        return dict(zip(targets, await asyncio.gather(*(one(u) for u in targets))))

    async def update_weights_from_tensor(
        self,
        serialize: Callable[[], str],
        *,
        tp_sizes: Mapping[str, int] | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
        urls: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """SGLang's same-host weight path: ``serialize()`` (e.g. a partial of
        moerl.engine.weights.tensor_payload's serialize_named_tensors: handles to tensors this process
        keeps alive until every engine answered) is called once per tensor-parallel rank of
        each engine (``tp_sizes`` by URL, default 1): torch counts a shared CPU tensor's
        readers per dump, so a dump may be read once. Needs an open weight-update session."""
        targets = self._targets(urls)
        bodies = {}
        for url in targets:
            ranks = int((tp_sizes or {}).get(url, 1))
            body: dict[str, Any] = {
                "serialized_named_tensors": [serialize() for _ in range(ranks)],
                "load_format": load_format,
                "flush_cache": bool(flush_cache),
                "abort_all_requests": bool(abort_all_requests),
            }
            if weight_version is not None:
                body["weight_version"] = str(weight_version)
            bodies[url] = body
        return await self._broadcast(
            "POST", "/update_weights_from_tensor", None, urls=targets, idempotent=False,
            bodies=bodies,
        )  # fmt: skip

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int | Sequence[int] | Mapping[str, int],
        world_size: int,
        group_name: str = DEFAULT_GROUP,
        backend: str = "nccl",
        *,
        urls: Sequence[str] | None = None,
    ) -> dict:
        """Join every target engine to the trainer's broadcast group (trainer = rank 0).
        Engine ranks are rank_offset + tp_rank, so with several engines rank_offset must be
        one per engine: a sequence in URL order or {url: offset}. Returns when all joined;
        run it concurrently with the trainer's own init_process_group."""
        targets = self._targets(urls)
        offsets = _per_url(rank_offset, targets, "rank_offset")
        bodies = {
            url: {
                "master_address": master_address,
                "master_port": int(master_port),
                "rank_offset": offsets[url],
                "world_size": int(world_size),
                "group_name": group_name,
                "backend": backend,
            }
            for url in targets
        }
        return await self._broadcast(
            "POST",
            "/init_weights_update_group",
            None,
            urls=targets,
            idempotent=False,
            bodies=bodies,
        )

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int]],
        group_name: str = DEFAULT_GROUP,
        flush_cache: bool = True,
        weight_version: int | str | None = None,
        load_format: str | None = None,
        *,
        abort_all_requests: bool = False,
        urls: Sequence[str] | None = None,
    ) -> dict:
        """Receive one broadcast (per tensor, or one "flattened_bucket": the tensors' C-order
        bytes concatenated in `names` order, each offset a multiple of its dtype size) and
        load it. dtypes are torch dtypes or their names ("bfloat16"). Returns when loaded;
        run it concurrently with the trainer's broadcast. An engine that is not paused first
        waits for its in-flight requests to finish."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) "
                f"must have equal lengths"
            )
        body = {
            "names": list(names),
            "dtypes": [_dtype_name(d) for d in dtypes],
            "shapes": [[int(s) for s in shape] for shape in shapes],
            "group_name": group_name,
            "flush_cache": bool(flush_cache),
            "abort_all_requests": bool(abort_all_requests),
            "weight_version": None if weight_version is None else str(weight_version),
            "load_format": load_format,
        }
        return await self._broadcast(
            "POST", "/update_weights_from_distributed", body, urls=urls, idempotent=False
        )

    async def destroy_weights_update_group(
        self, group_name: str = DEFAULT_GROUP, *, urls: Sequence[str] | None = None
    ) -> dict:
        return await self._broadcast(
            "POST",
            "/destroy_weights_update_group",
            {"group_name": group_name},
            urls=urls,
            idempotent=False,
        )

    async def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str,
        *,
        pinned: bool = False,
        urls: Sequence[str] | None = None,
    ) -> dict:
        """Load a PEFT adapter directory the engines can read (shared storage)."""
        body = {"lora_name": lora_name, "lora_path": lora_path, "pinned": bool(pinned)}
        return await self._broadcast(
            "POST", "/load_lora_adapter", body, urls=urls, idempotent=False
        )

    async def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        tensors: Mapping[str, torch.Tensor],
        config: Mapping[str, Any],
        *,
        pinned: bool = False,
        urls: Sequence[str] | None = None,
    ) -> dict:
        """Load an adapter from in-memory tensors, as bytes in the body (moerl's extension,
        which reaches an engine on any host; SGLang's own field, serialized_named_tensors,
        carries same-host tensor handles, and moerl's engine reads both):

            POST /load_lora_adapter_from_tensors
            {
              "lora_name": str,
              "config_dict": {...},     # PEFT adapter_config.json contents (r, lora_alpha,
                                        # target_modules, ...), as in SGLang
              "safetensors_b64": str,   # base64 (standard alphabet, padded) of a safetensors
                                        # file with every adapter tensor under its PEFT name,
                                        # e.g. ...mlp.experts.{i}.gate_proj.lora_A.weight
              "pinned": bool
            }

        The response is SGLang's LoRA shape: {"success", "error_message", "loaded_adapters"}.
        """
        from safetensors.torch import save as safetensors_save

        cpu: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        for name, tensor in tensors.items():
            t = tensor.detach().to("cpu").contiguous()
            ptr = t.untyped_storage().data_ptr()
            # safetensors refuses tensors sharing memory (tied weights): give them their own.
            cpu[name] = t.clone() if ptr in storages else t
            storages.add(ptr)
        payload = {
            "lora_name": lora_name,
            "config_dict": dict(config),
            "safetensors_b64": base64.b64encode(safetensors_save(cpu)).decode("ascii"),
            "pinned": bool(pinned),
        }
        return await self._broadcast(
            "POST", "/load_lora_adapter_from_tensors", payload, urls=urls, idempotent=False
        )

    async def unload_lora_adapter(
        self, lora_name: str, *, urls: Sequence[str] | None = None
    ) -> dict:
        return await self._broadcast(
            "POST", "/unload_lora_adapter", {"lora_name": lora_name}, urls=urls, idempotent=False
        )

    async def health(self, *, urls: Sequence[str] | None = None) -> dict:
        """{url: {}} when every engine answers 200; EngineError naming the others."""
        return await self._broadcast("GET", "/health", None, urls=urls, idempotent=True)

    async def health_generate(self, *, urls: Sequence[str] | None = None) -> dict:
        """Like health, but the engine proves it can generate one token."""
        return await self._broadcast("GET", "/health_generate", None, urls=urls, idempotent=True)

    async def model_info(self, *, urls: Sequence[str] | None = None) -> dict:
        return await self._broadcast("GET", "/model_info", None, urls=urls, idempotent=True)

    async def server_info(self, *, urls: Sequence[str] | None = None) -> dict:
        return await self._broadcast("GET", "/server_info", None, urls=urls, idempotent=True)

    async def wait_until_healthy(
        self, timeout_s: float = 600.0, poll_s: float = 1.0, *, urls: Sequence[str] | None = None
    ) -> None:
        """Poll /health until every engine answers 200 (engines take minutes to load)."""
        pending = self._targets(urls)
        deadline = time.monotonic() + timeout_s
        last: dict[str, str] = {}
        while pending:
            results = await asyncio.gather(
                *(self._control_one(u, "GET", "/health", None, True, attempts=1) for u in pending),
                return_exceptions=True,
            )
            for url, result in zip(pending, results):
                if isinstance(result, BaseException) and not isinstance(result, EngineError):
                    raise result
                if isinstance(result, EngineError):
                    last[url] = str(result)
            pending = [u for u, r in zip(pending, results) if isinstance(r, BaseException)]
            if pending and time.monotonic() >= deadline:
                detail = "; ".join(last[u] for u in pending)
                raise EngineError(
                    f"engines not healthy after {timeout_s:.0f}s: {', '.join(pending)} "
                    f"({detail}). {DEAD_ENGINE_FIX}",
                    urls=pending,
                )
            if pending:
                await asyncio.sleep(poll_s)


def _per_url(value: Any, targets: list[str], what: str) -> dict[str, int]:
    if isinstance(value, Mapping):
        missing = [u for u in targets if u.rstrip("/") not in {k.rstrip("/") for k in value}]
        if missing:
            raise ValueError(f"{what} has no entry for {missing}")
        return {k.rstrip("/"): int(v) for k, v in value.items()}
    if isinstance(value, (int, np.integer)):
        if len(targets) > 1:
            raise ValueError(
                f"{what}={value} is a single number but {len(targets)} engines join the "
                f"group; pass one per engine (a list in URL order or {{url: {what}}})"
            )
        return {targets[0]: int(value)}
    values = list(value)
    if len(values) != len(targets):
        raise ValueError(f"{what} has {len(values)} entries for {len(targets)} engines")
    return {u: int(v) for u, v in zip(targets, values)}


def _dtype_name(dtype: Any) -> str:
    """torch.bfloat16 / "torch.bfloat16" / "bfloat16" -> "bfloat16" (a torch attribute)."""
    return str(dtype).removeprefix("torch.")
