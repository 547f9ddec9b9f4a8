"""Build the engine (model, scheduler, app) from parsed flags."""

from __future__ import annotations

import argparse
import importlib
import os
from typing import Any


def decode_graphs(runner: Any, args: argparse.Namespace) -> Any:
    """CUDA graphs for the runner's decode steps (``moerl.engine.core.decode_graphs``)."""
    from moerl.device import graphed
    from moerl.engine.core.decode_graphs import DEFAULT_MAX_BS, DecodeGraphs

    max_bs = min(args.cuda_graph_max_bs or DEFAULT_MAX_BS, args.max_running_requests)
    return DecodeGraphs(runner, max_bs, lambda fn: graphed(fn, runner.device))


PRELOADED = (
    "uvicorn",
    "moerl.engine.app",
    "moerl.engine.core.eos",
    "moerl.engine.core.model_runner",
    "moerl.engine.core.prefix_cache",
    "moerl.engine.core.scheduler",
    "moerl.engine.core.state",
    "moerl.models.tokenizer",
    # what every family's transformers model imports when the runner loads it
    "transformers.modeling_utils",
    "transformers.generation.utils",
    "transformers.masking_utils",
    "transformers.activations",
    "transformers.integrations.moe",
)
"""The modules ``build_state`` and the server import: torch, transformers' model stack
and the app's: on a laptop all of an engine's start but the 0.5–0.7 s its model and
server take."""


def preload() -> None:
    """Import ``PRELOADED``, for a process that knows it will be an engine before it
    knows its flags (``--await-start``: moerl/engine/__main__.py)."""
    for name in PRELOADED:
        importlib.import_module(name)


def build_state(args: argparse.Namespace) -> Any:
    from moerl.engine import API_KEY_ENV
    from moerl.engine.app import create_app
    from moerl.engine.core.eos import eos_token_ids
    from moerl.engine.core.model_runner import ModelRunner
    from moerl.engine.core.prefix_cache import PrefixCache
    from moerl.engine.core.scheduler import Scheduler
    from moerl.engine.core.state import EngineState

    runner = ModelRunner(
        args.model_path,
        dtype=args.dtype,
        seed=args.random_seed,
        device=args.device,
        deterministic=args.enable_deterministic_inference,
    )
    if args.enable_lora:
        from moerl.engine.lora.adapters import LoraManager

        runner.lora = LoraManager(
            runner.model,
            max_rank=args.max_lora_rank,
            target_modules=args.lora_target_modules,
            max_loras=args.max_loras_per_batch,
        )
    graphs = args.enable_cuda_graph and not args.disable_cuda_graph
    if graphs and runner.device.type == "cuda" and runner.lora is None and not runner.deterministic:
        runner.graphs = decode_graphs(runner, args)
    tokenizer = None
    try:
        from moerl.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.model_path)
    except (FileNotFoundError, OSError, ValueError):
        tokenizer = None  # input_ids only; "text" stays empty
    prefix_cache = None if args.disable_radix_cache else PrefixCache(args.prefix_cache_max_tokens)
    scheduler = Scheduler(
        runner,
        max_running_requests=args.max_running_requests,
        max_queued_requests=args.max_queued_requests or None,
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        eos_token_ids=eos_token_ids(args.model_path, runner.config, tokenizer),
        tokenizer=tokenizer,
        weight_version=args.weight_version,
        enable_routed_experts=args.enable_return_routed_experts,
        prefix_cache=prefix_cache,
        stop_regex_timeout_s=args.stop_regex_timeout_ms / 1e3,
        admission_wait_s=args.admission_wait_ms / 1e3,
        admission_quiet_s=args.admission_quiet_ms / 1e3,
        decode_share=args.decode_share,
        threads=args.num_threads,
        shared_prompt_min_tokens=(
            None if args.shared_prompt_min_tokens == -1 else args.shared_prompt_min_tokens
        ),
    )
    state = EngineState(
        runner=runner,
        scheduler=scheduler,
        model_path=str(args.model_path),
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        tokenizer=tokenizer,
        stream_interval=args.stream_interval,
        incremental_stream=args.incremental_streaming_output,
        tool_call_parser=args.tool_call_parser,
    )
    app = create_app(state)

    @app.on_event("startup")
    async def _start() -> None:
        scheduler.start()

    @app.on_event("shutdown")
    async def _stop() -> None:
        scheduler.shutdown()

    app.state.engine = state
    return app
