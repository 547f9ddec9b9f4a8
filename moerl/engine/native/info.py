"""``/server_info`` (and ``/get_server_info``): what SGLang 0.5.23's clients read from it.

SGLang answers with its resolved server arguments flattened at the top level, plus
``internal_states`` (one dict per data-parallel rank: the same arguments and the
scheduler's live state, e.g. ``effective_max_running_requests_per_dp`` and
``memory_usage``) and ``version``. Readers: ``sglang.bench_one_batch_server`` and
``bench_serving`` (``internal_states[*]``), moerl's weight sync (``tp_size``), and SGLang's
typed contract ``sglang.api.v1.GetServerInfoResponse`` (``max_context_length``,
``incremental_streaming_output``, ``disaggregation_mode``, ``version``...).

Only fields with a true value in this engine are sent, under SGLang's names. Absent on
purpose: ``max_total_num_tokens`` and ``memory_usage.token_capacity``/``kvcache`` (every
request owns a growing KV cache; there is no preallocated token pool to size), and
``last_gen_throughput`` (the scheduler's step records do not count the tokens each step
generated). moerl's own live keys (``running_requests``, ``decode_steps``...) stay beside.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any

from moerl._version import __version__

if TYPE_CHECKING:
    from moerl.engine.core.state import EngineState

SGLANG_API = "0.5.23"  # the SGLang release whose native HTTP API the engine speaks
VERSION = f"moerl {__version__} embedded engine (SGLang {SGLANG_API} native API)"


def server_args(state: EngineState, model_info: dict[str, Any]) -> dict[str, Any]:
    """The engine's settings under SGLang's server-argument names."""
    sched, runner = state.scheduler, state.runner
    lora, cache = runner.lora, sched.prefix_cache
    return {
        **model_info,
        "max_context_length": runner.context_len,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "device": runner.device.type,  # SGLang's: 'cuda' or 'cpu'; the GPU's index is
        "base_gpu_id": runner.device.index or 0,  # (one GPU per engine process)
        "skip_tokenizer_init": state.tokenizer is None,
        "max_running_requests": sched.max_running,
        "max_queued_requests": sched.max_queued,
        "stream_interval": state.stream_interval,
        # streamed chunks carry the whole text so far (SGLang's default), or the new part
        "incremental_streaming_output": state.incremental_stream,
        "enable_return_routed_experts": sched.enable_routed_experts,
        "tool_call_parser": state.tool_call_parser,
        "enable_lora": lora is not None,
        "max_lora_rank": None if lora is None else lora.max_rank,
        "max_loras_per_batch": None if lora is None else lora.max_loras,
        "lora_target_modules": None if lora is None or not lora.targets else sorted(lora.targets),
        "disable_radix_cache": sched.prefix_cache is None,
        "prefix_cache_max_tokens": None if cache is None else cache.max_tokens,
        # a group's samples read one copy of a prompt this long (None: each holds one)
        "shared_prompt_min_tokens": sched.share_min_tokens,
        # batch-invariant forward and sampling (moerl/engine/core/invariant.py)
        "enable_deterministic_inference": runner.deterministic,
        # decode steps as CUDA graphs (on CUDA, without LoRA; off on the CPU)
        **(
            runner.graphs.info()
            if runner.graphs is not None
            else {"disable_cuda_graph": True, "cuda_graph_max_bs": None}
        ),
        # one process, one model replica, no parallelism
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "ep_size": 1,
        "disaggregation_mode": "null",
    }


def weight_gb(state: EngineState) -> float:
    """GiB held by the model's parameters and buffers (SGLang's memory_usage.weight)."""
    model = state.runner.model
    tensors = itertools.chain(model.parameters(), model.buffers())
    return round(sum(t.numel() * t.element_size() for t in tensors) / (1 << 30), 3)


def server_info(state: EngineState, model_info: dict[str, Any]) -> dict[str, Any]:
    """The /server_info body: SGLang's fields, then moerl's live scheduler state."""
    sched = state.scheduler
    args = server_args(state, model_info)
    internal = {
        **args,
        "effective_max_running_requests_per_dp": sched.max_running,
        "memory_usage": {"weight": weight_gb(state), "graph": {}},  # no CUDA graphs
    }
    return {
        **args,
        "internal_states": [internal],
        "version": VERSION,
        "engine": "moerl.embedded",
        "scheduler_error": sched.dead,
        "failed_requests": sched.failed_requests,
        "running_requests": len(sched.running),
        # tokens of KV cache held by running requests (a retracted one holds none)
        "kv_cache_tokens": sched.pool.tokens,
        # bytes allocated for them: the running pool and the prompt copies its slots read
        "kv_cache_bytes": sched.pool.nbytes(),
        "kv_cache_peak_bytes": sched.pool.peak_nbytes,  # the most since the pool was made
        "kv_cache_token_bytes": sched.pool.token_nbytes(),  # one token, every layer
        # running requests reading their prompt's KV from one copy shared with others
        "kv_cache_shared_requests": sched.pool.shared,
        "waiting_requests": sched.queued(),
        # tokens and sequences the prefix cache holds
        "prefix_cache_tokens": 0 if sched.prefix_cache is None else sched.prefix_cache.tokens,
        "prefix_cache_sequences": 0 if sched.prefix_cache is None else len(sched.prefix_cache),
        "paused": sched.paused,
        # /release_memory_occupation tags in force (requests wait until all are resumed)
        "memory_released": sorted(sched.released),
        "decode_steps": sched.steps,
        "scheduler_loops": sched.loops,
        "last_step_s": sched.last_step_s,
        # (wall-clock start, seconds, running requests) of the last 256 steps
        "recent_steps": list(sched.step_times),
        "uptime_s": time.time() - state.started,
    }
