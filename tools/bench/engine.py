"""Embedded-engine throughput and weight-update stall, measured side by side.

    python tools/bench/engine.py [--family deepseek_moe] [--new-tokens 64] [--quick]
                                 [--device cpu|cuda|cuda:N] [--cuda-graph off|on|both]

Prints generated tokens/s at 1, 8 and 32 concurrent requests, the ratio of
continuous batching (32 concurrent) to the same 32 requests one at a time
(target >= 4x on 2 CPU cores), and the decode stall caused by an in-flight weight
update: the largest gap between streamed tokens of a running request while the
whole model is swapped, in units of the median decode step (target < 2). Then the
cost of one multi-turn episode turn (~16 observation tokens appended to a context of a
few hundred, ~16 tokens generated) with the prefix cache reusing the previous turn and
with --disable-radix-cache, two engines alternating turn by turn:
``turn_prefix_reuse_speedup`` = median turn time without reuse / with reuse. Then a
request's decode rate while a long prompt (``--interleave-prompt``, 8192 tokens) prefills
in ``--interleave-chunk`` chunks, over its rate on the same tokens alone
(``interleave_decode_rate_ratio``, target >= 0.5).

Then the engine against transformers' own ``model.generate`` on the same weights, the
same prompts and the same sampling (temperature 1, EOS ignored), alternating
repetitions in one run (the engine in its process, ``generate`` in this one, never at
once, each with ``--threads`` threads): ``lengths=fixed`` gives every request the same
number of new tokens; ``lengths=longtail`` draws each request's length from a lognormal
(p90 about 6x the median), as RL rollouts have them: the engine finishes each request at
its own length, while ``generate``'s static batch runs until its longest row and only the
rows' own tokens count. Each prints

    engine lengths=fixed|longtail engine_tok_s=… hf_tok_s=… ratio=…

(medians over the repetitions) and, for a GRPO group of 8 samples of one prompt, how
many prompt tokens the engine prefilled (``group_prefill_tokens``, the prompt once).
Then a group of 8 on a 512-token prompt with the samples reading one copy of the prompt's
KV and with a copy each (``--shared-prompt-min-tokens -1``), two engines alternating: the
most KV each held over the prompt once + 8 responses (``shared_prompt_kv_ratio``, target
<= 1.3) and the group's time (``shared_prompt_speed_ratio``: copied over shared).

``--device`` (default cpu) runs every engine and ``generate`` there; weight updates still
travel over gloo (a CPU bucket the engine copies into its model). ``--cuda-graph on``
starts the engine of the ``generate`` comparison with ``--enable-cuda-graph`` (decode
steps replayed as CUDA graphs; CUDA only), ``both`` runs the comparison once eager and
once with graphs, each beside its own ``generate``, and tags each line
``cuda_graph=off|on``. The targets above were set on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx


def _body(new_tokens: int, i: int) -> dict:
    return {
        "input_ids": [5 + i % 50, 6, 7, 8],
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True},
    }


async def _concurrent(url: str, n: int, new_tokens: int) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        outs = await asyncio.gather(
            *[client.post(f"{url}/generate", json=_body(new_tokens, i)) for i in range(n)]
        )
        wall = time.perf_counter() - start
    tokens = sum(o.json()["meta_info"]["completion_tokens"] for o in outs)
    return tokens / wall


async def _sequential(url: str, n: int, new_tokens: int) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        tokens = 0
        for i in range(n):
            out = await client.post(f"{url}/generate", json=_body(new_tokens, i))
            tokens += out.json()["meta_info"]["completion_tokens"]
    return tokens / (time.perf_counter() - start)


def _stall(url: str, model_dir: Path, new_tokens: int) -> tuple[float, float, float]:
    """In decode steps: the swap's blocking time, the longest step interval while the
    update was in flight (includes the transfer's CPU contention), and the largest gap a
    streaming client saw; plus the median step (ms) and the update's wall time (s)."""
    from safetensors import safe_open

    from moerl.engine.weights.bucket import dtype_name, flatten
    from moerl.engine.weights.group import broadcast, init_custom_process_group
    from moerl.parallel.spawn import free_port

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    port = free_port()
    box: dict = {}
    joiner = threading.Thread(
        target=lambda: box.setdefault(
            "g", init_custom_process_group("gloo", "127.0.0.1", port, 0, 2)
        )
    )
    joiner.start()
    httpx.post(
        f"{url}/init_weights_update_group",
        json={
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "bench",
            "backend": "gloo",
        },
        timeout=60,
    )
    joiner.join()
    stamps: list[float] = []
    background = [
        threading.Thread(
            target=lambda i=i: httpx.post(
                f"{url}/generate", json=_body(new_tokens * 2, i), timeout=600
            )
        )
        for i in range(7)
    ]
    for t in background:
        t.start()

    def stream() -> None:
        body = {**_body(new_tokens * 2, 99), "stream": True}
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.perf_counter())

    streamer = threading.Thread(target=stream)
    streamer.start()
    bucket = flatten(list(tensors.values()))  # prepared before the timed window
    body = {
        "names": list(tensors), "dtypes": [dtype_name(t.dtype) for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()], "group_name": "bench",
        "weight_version": "1", "load_format": "flattened_bucket", "flush_cache": False,
    }  # fmt: skip
    while len(stamps) < new_tokens // 2:
        time.sleep(0.005)
    start, wall_start = time.perf_counter(), time.time()
    done: dict = {}
    httpx.post(f"{url}/begin_weight_update", json={}, timeout=60).raise_for_status()  # SGLang's
    poster = threading.Thread(
        target=lambda: done.setdefault(
            "r", httpx.post(f"{url}/update_weights_from_distributed", json=body, timeout=600)
        )
    )
    poster.start()
    broadcast(box["g"], bucket)
    poster.join()
    update_s = time.perf_counter() - start
    httpx.post(f"{url}/end_weight_update", json={}, timeout=60).raise_for_status()
    wall_end = time.time()
    streamer.join()
    for t in background:
        t.join()
    assert done["r"].json()["success"], done["r"].text
    # Engine side: the longest interval between two decode-step starts while the update
    # ran, in units of the median interval (what a running request waits).
    steps = httpx.get(f"{url}/server_info", timeout=30).json()["recent_steps"]
    starts = [st for st, _, _ in steps]
    pairs = list(zip(starts, starts[1:]))
    median = statistics.median(b - a for a, b in pairs)
    # intervals that overlap the update (from the trainer's first byte to the reply)
    during = [b - a for a, b in pairs if b >= wall_start and a <= wall_end]
    gaps = during or [median]
    client_gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    client = max(client_gaps) / statistics.median(client_gaps)
    blocking = done["r"].json()["apply_s"] / median
    return blocking, max(gaps) / median, median * 1000, update_s, client


def _turn_reuse(
    family: str,
    tmp: Path,
    threads: int,
    context: int,
    turns: int,
    step: int,
    episodes: int,
    device: str = "cpu",
) -> dict:
    """Median seconds of an episode turn after the first, with and without prefix reuse:
    each turn sends the whole stream so far (context, then each turn's output and ``step``
    observation tokens) and generates ``step`` tokens; the two engines alternate turns."""
    import numpy as np

    from moerl.engine.process import EngineProcess
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    positions = context + (turns + 1) * 2 * step
    cfg = dataclasses.replace(tiny_config(family), max_position_embeddings=max(positions, 128))
    model_dir = save_tiny_checkpoint(cfg, tmp / "hf-long")
    rng = np.random.default_rng(0)
    sampling = {"max_new_tokens": step, "temperature": 0, "ignore_eos": True}
    times: dict[str, list[float]] = {"reuse": [], "full": []}
    cached: list[int] = []
    with (
        EngineProcess(model_dir, "--device", device, threads=threads) as reuse,
        EngineProcess(
            model_dir, "--device", device, "--disable-radix-cache", threads=threads
        ) as full,
    ):
        urls = {"reuse": reuse.url, "full": full.url}
        for url in urls.values():  # lazy initialisation is not timed
            httpx.post(f"{url}/generate", json={"input_ids": [5, 6], "sampling_params": sampling})
        for _ in range(episodes):
            prompt = rng.integers(3, cfg.vocab_size, context).tolist()
            streams = {name: list(prompt) for name in urls}
            for turn in range(turns):
                observation = rng.integers(3, cfg.vocab_size, step).tolist()
                for name, url in urls.items():
                    body = {"input_ids": streams[name], "sampling_params": sampling}
                    start = time.perf_counter()
                    out = httpx.post(f"{url}/generate", json=body, timeout=600).json()
                    if turn:  # the first turn has nothing to reuse
                        times[name].append(time.perf_counter() - start)
                        if name == "reuse":
                            cached.append(out["meta_info"]["cached_tokens"])
                    streams[name] = streams[name] + out["output_ids"] + observation
    assert all(cached), f"a later turn reused nothing: cached_tokens {cached}"
    reuse_s, full_s = statistics.median(times["reuse"]), statistics.median(times["full"])
    return {
        "turn_ms_prefix_reuse": reuse_s * 1000,
        "turn_ms_full_prefill": full_s * 1000,
        "turn_prefix_reuse_speedup": full_s / reuse_s,
        "turn_cached_tokens_median": statistics.median(cached),
    }


def _shared_prompt(
    family: str, tmp: Path, threads: int, prompt_tokens: int, new: int, reps: int, device: str
) -> dict:
    """A GRPO group (one /generate, n=8) on a ``prompt_tokens`` prompt, ``new`` tokens each,
    on an engine whose samples read one copy of the prompt (the default) and on one that
    copies it to each (--shared-prompt-min-tokens -1), alternating, a fresh prompt each
    time: the most KV each held (``kv_cache_peak_bytes``, in tokens) over the ideal, the
    prompt once and 8 responses (issue 29's target: <= 1.3), and the group's time."""
    from moerl.engine.process import EngineProcess
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    cfg = dataclasses.replace(tiny_config(family), max_position_embeddings=prompt_tokens + new + 64)
    model_dir = save_tiny_checkpoint(cfg, tmp / f"hf-shared-{prompt_tokens}")
    sampling = {"max_new_tokens": new, "temperature": 1.0, "ignore_eos": True, "n": 8}
    times: dict[str, list[float]] = {"shared": [], "copied": []}
    peaks: dict[str, float] = {}
    flags = ["--device", device]
    with (
        EngineProcess(model_dir, *flags, threads=threads) as shared,
        EngineProcess(
            model_dir, *flags, "--shared-prompt-min-tokens", "-1", threads=threads
        ) as copied,
    ):
        urls = {"shared": shared.url, "copied": copied.url}
        token = 3
        for rep in range(reps + 1):  # the first is a warm-up, not timed
            for name, url in urls.items():
                token += 1  # a prompt no engine has seen: nothing comes from the cache
                body = {"input_ids": [token] + [3 + i % 90 for i in range(prompt_tokens - 1)],
                        "sampling_params": sampling}  # fmt: skip
                start = time.perf_counter()
                out = httpx.post(f"{url}/generate", json=body, timeout=600).json()
                if rep:
                    times[name].append(time.perf_counter() - start)
                assert len(out) == 8 and all(len(o["output_ids"]) == new for o in out), out
        for name, url in urls.items():
            info = httpx.get(f"{url}/server_info", timeout=60).json()
            peaks[name] = info["kv_cache_peak_bytes"] / info["kv_cache_token_bytes"]
    ideal = prompt_tokens + 8 * (new - 1)  # tokens run: the prompt, each sample's but last
    shared_s, copied_s = statistics.median(times["shared"]), statistics.median(times["copied"])
    return {
        "shared_prompt_tokens": prompt_tokens,
        "shared_prompt_new_tokens": new,
        "shared_prompt_kv_ratio": peaks["shared"] / ideal,
        "copied_prompt_kv_ratio": peaks["copied"] / ideal,
        "shared_prompt_group_s": shared_s,
        "copied_prompt_group_s": copied_s,
        "shared_prompt_speed_ratio": copied_s / shared_s,
    }


def _interleave(
    family: str, tmp: Path, threads: int, prompt_tokens: int, chunk: int, device: str,
    reps: int = 3,
) -> dict:  # fmt: skip
    """A request's decode rate while a ``prompt_tokens`` prompt prefills in chunks of
    ``chunk`` (decode steps between chunks, --decode-share of the time), against its rate
    over the same tokens alone: the same request runs once more with nothing beside it,
    and the ratio is the time that run took from the token the window began at to the
    one it ended at, over the window. (A request decodes more slowly as it grows; the
    same tokens, not its first ones, are the fair reference.) The median of ``reps``
    such windows: single windows on 2 shared cores read anywhere in 0.47-0.80."""
    from moerl.engine.process import EngineProcess
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    cfg = dataclasses.replace(tiny_config(family), max_position_embeddings=prompt_tokens + 512)
    model_dir = save_tiny_checkpoint(cfg, tmp / f"hf-interleave-{prompt_tokens}")
    flags = ["--device", device, "--chunked-prefill-size", str(chunk), "--disable-radix-cache"]
    ratios: list[float] = []
    windows: list[float] = []
    tokens: list[tuple[int, int]] = []
    with EngineProcess(model_dir, *flags, threads=threads) as engine:
        warm = {"input_ids": [5] * prompt_tokens, "sampling_params": {"max_new_tokens": 1}}
        httpx.post(f"{engine.url}/generate", json=warm, timeout=600)  # first-touch of the pool
        for rep in range(reps):
            started = threading.Event()
            runner_tokens = min(3000, prompt_tokens + 500)  # within the model's context
            stamps = _StreamStamps(engine.url, runner_tokens, started, after=40)
            runner = threading.Thread(target=stamps.run)
            runner.start()
            started.wait(600)
            long = {"input_ids": [3 + (i + rep) % 90 for i in range(prompt_tokens)],
                    "sampling_params": {"max_new_tokens": 1}}  # fmt: skip
            start = time.perf_counter()
            httpx.post(f"{engine.url}/generate", json=long, timeout=600)
            end = time.perf_counter()
            # the runner outlives the prefill (it would end on its own at runner_tokens)
            httpx.post(f"{engine.url}/abort_request", json={"rid": stamps.rid}, timeout=60)
            runner.join()
            first, last = stamps.tokens_at(start), stamps.tokens_at(end)
            alone = _StreamStamps(engine.url, last, threading.Event())
            alone.run()
            ratios.append((alone.time_at(last) - alone.time_at(first)) / (end - start))
            windows.append(end - start)
            tokens.append((first, last))
    middle = sorted(range(reps), key=ratios.__getitem__)[reps // 2]
    return {
        "interleave_prompt_tokens": prompt_tokens,
        "interleave_chunk": chunk,
        "interleave_prefill_s": windows[middle],
        "interleave_tokens": tokens[middle],
        "interleave_decode_rate_ratio": ratios[middle],
        "interleave_decode_rate_ratios": ratios,
    }


class _StreamStamps:
    """One streamed request of ``new`` tokens after a 4-token prompt: when each of its
    tokens arrived (a stream chunk may bring several)."""

    def __init__(self, url: str, new: int, started: threading.Event, after: int = 0) -> None:
        self.url, self.new, self.started, self.after = url, new, started, after
        self.rid = f"interleave-{new}-{after}"
        self.stamps: list[tuple[float, int]] = []  # (arrival, tokens so far)

    def run(self) -> None:
        body = {"input_ids": [5, 6, 7, 8], "stream": True, "rid": self.rid,
                "sampling_params": {"max_new_tokens": self.new, "ignore_eos": True}}  # fmt: skip
        with httpx.stream("POST", f"{self.url}/generate", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    tokens = json.loads(line[6:])["meta_info"]["completion_tokens"]
                    self.stamps.append((time.perf_counter(), tokens))
                    if tokens >= self.after:
                        self.started.set()

    def tokens_at(self, when: float) -> int:
        return max((n for t, n in self.stamps if t <= when), default=0)

    def time_at(self, tokens: int) -> float:
        return min(t for t, n in self.stamps if n >= tokens)


def _longtail_lengths(rng, n: int, median: int, cap: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Output lengths as RL rollouts have them: lognormal (sigma 1.4: p90 ~ 6x median)."""
    raw = rng.lognormal(mean=math.log(median), sigma=1.4, size=n)
    return [int(min(cap, max(1, round(x)))) for x in raw]


# ~40M parameters: a decode step of 32 rows is dominated by its matmuls, as on a real
# model, rather than by per-step Python (the tiny model's forward costs about the same
# for 1 row as for 32, which hides what batching saves)
MID_SHAPE = {
    "num_layers": 6, "hidden_size": 512, "num_attention_heads": 8, "num_query_groups": 4,
    "kv_channels": 64, "ffn_hidden_size": 1024, "vocab_size": 8192, "num_experts": 16,
    "moe_ffn_hidden_size": 256, "moe_shared_expert_intermediate_size": 256, "q_lora_rank": 128, "kv_lora_rank": 64, "qk_head_dim": 64,
    "qk_pos_emb_head_dim": 32, "v_head_dim": 64,
}  # fmt: skip


def _vs_generate(
    family: str,
    tmp: Path,
    threads: int,
    prompts: int,
    new_tokens: int,
    reps: int,
    shape: str,
    device: str = "cpu",
    cuda_graph: bool = False,
) -> dict:
    """Engine vs ``model.generate`` tokens/s at fixed and long-tailed lengths (medians of
    ``reps`` alternating repetitions), and the prompt tokens a group of 8 prefills. The
    engine is reached through moerl's EngineClient, as the rollout reaches it."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from moerl.device import resolve, synchronize_device
    from moerl.engine.process import EngineProcess
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    dev = resolve(device)
    rng = np.random.default_rng(0)
    cap = 8 * new_tokens
    cfg = dataclasses.replace(tiny_config(family), max_position_embeddings=64 + cap)
    if shape == "mid":  # big enough that a decode step's cost grows with its batch
        cfg = dataclasses.replace(cfg, **MID_SHAPE)
    model_dir = save_tiny_checkpoint(cfg, tmp / "hf-generate")
    batch = [
        rng.integers(3, cfg.vocab_size, int(rng.integers(16, 48))).tolist() for _ in range(prompts)
    ]
    lengths = {
        "fixed": [new_tokens] * prompts,
        "longtail": _longtail_lengths(rng, prompts, max(2, new_tokens // 4), cap),
    }
    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True).eval()
    hf.to(dev)
    pad = hf.generation_config.pad_token_id or 0
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=dev)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=dev)

    def run_hf(lens: list[int]) -> float:
        longest = max(lens)
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                top_k=0, top_p=1.0, max_new_tokens=longest, min_new_tokens=longest,
            )  # fmt: skip
        synchronize_device(dev)
        wall = time.perf_counter() - start
        assert out.shape[1] == width + longest, out.shape
        return sum(lens) / wall  # a row's tokens after its own length are waste

    # moerl's own client, on an event loop of its own that lives across the batches: the
    # rollout reaches the engine this way, its connections open once
    from moerl.rollout.aio import EventLoopThread
    from moerl.rollout.client import EngineClient

    aio = EventLoopThread("bench-client")
    client: EngineClient | None = None

    async def run_engine(url: str, lens: list[int]) -> float:
        nonlocal client
        if client is None:
            client = EngineClient([url], timeout_s=600)
        start = time.perf_counter()
        outs = await asyncio.gather(*[
            client.generate(
                p, {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True},
                return_logprob=False,
            )
            for p, n in zip(batch, lens)
        ])  # fmt: skip
        wall = time.perf_counter() - start
        got = [o["meta_info"]["completion_tokens"] for o in outs]
        assert got == lens, (got, lens)
        return sum(lens) / wall

    results: dict = {}
    with EngineProcess(
        model_dir,
        "--device",
        device,
        "--max-running-requests",
        str(max(64, prompts)),
        *(["--enable-cuda-graph"] if cuda_graph else []),
        threads=threads,
    ) as engine:
        aio.run(run_engine(engine.url, [4] * prompts))  # warm-up, both sides
        run_hf([4] * prompts)
        for kind, lens in lengths.items():
            eng, ref = [], []
            for _ in range(reps):
                eng.append(aio.run(run_engine(engine.url, lens)))
                ref.append(run_hf(lens))
            e, h = statistics.median(eng), statistics.median(ref)
            results[f"{kind}_engine_tok_s"], results[f"{kind}_hf_tok_s"] = e, h
            results[f"{kind}_ratio"] = e / h
            results[f"{kind}_tokens"] = sum(lens)
            print(
                f"engine lengths={kind} shape={shape} cuda_graph={'on' if cuda_graph else 'off'} "
                f"engine_tok_s={e:.1f} hf_tok_s={h:.1f} "
                f"ratio={e / h:.2f} (prompts={prompts} tokens={sum(lens)} "
                f"longest={max(lens)} reps={reps}; target >= "
                f"{'1' if kind == 'fixed' else '2'}x)",
                flush=True,
            )
        info = httpx.get(f"{engine.url}/server_info", timeout=60).json()
        results["cuda_graph_captures"] = info.get("cuda_graph_captures")
        if cuda_graph:  # what the engine did with the flag
            print(
                f"engine cuda_graph captures={info.get('cuda_graph_captures')} "
                f"experts={info.get('cuda_graph_experts')} "
                f"off_because={info.get('cuda_graph_disabled_reason')}",
                flush=True,
            )
        # a GRPO group: one prompt, n=8 samples, on a flushed prefix cache
        httpx.post(f"{engine.url}/flush_cache", timeout=60)
        prompt = rng.integers(3, cfg.vocab_size, 48).tolist()
        outs = httpx.post(f"{engine.url}/generate", json={
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "n": 8},
        }, timeout=600).json()  # fmt: skip
        cached = [o["meta_info"]["cached_tokens"] for o in outs]
        prefilled = sum(len(prompt) - c for c in cached)
        results["group_prefill_tokens"] = prefilled
        results["group_prompt_tokens"] = len(prompt)
        print(
            f"engine group n=8 prompt_tokens={len(prompt)} group_prefill_tokens={prefilled} "
            f"(target: the prompt once, {len(prompt)})",
            flush=True,
        )
    if client is not None:
        aio.run(client.aclose())
    aio.stop()
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="deepseek_moe")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in the engine")
    parser.add_argument("--quick", action="store_true", help="fewer tokens (for tests)")
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the engines and model.generate run: cpu, cuda or cuda:N",
    )
    parser.add_argument("--turn-context", type=int, default=384, help="episode prompt tokens")
    parser.add_argument("--prompts", type=int, default=32, help="requests vs model.generate")
    parser.add_argument("--reps", type=int, default=5, help="repetitions vs model.generate")
    parser.add_argument(
        "--only-generate", action="store_true", help="only the comparison with model.generate"
    )
    parser.add_argument(
        "--generate-shape",
        choices=("tiny", "mid"),
        default=None,
        help="model vs model.generate (default: mid, then tiny for fixed and long-tailed "
        "lengths alone; tiny is quicker but overhead-bound)",
    )
    parser.add_argument(
        "--cuda-graph",
        choices=("off", "on", "both"),
        default="off",
        help="the generate comparison's engine with decode CUDA graphs (CUDA only); both: "
        "eager, then graphs",
    )
    parser.add_argument(
        "--interleave-prompt", type=int, default=8192,
        help="prompt tokens prefilled while a request decodes (the interleaving measure)",
    )  # fmt: skip
    parser.add_argument(
        "--interleave-chunk", type=int, default=256, help="--chunked-prefill-size for it"
    )
    parser.add_argument(
        "--interleave-reps", type=int, default=3, help="prefill windows measured (the median)"
    )
    args = parser.parse_args(argv)
    new_tokens = 16 if args.quick else args.new_tokens
    if args.cuda_graph != "off" and args.device == "cpu":
        parser.error("--cuda-graph on/both needs a CUDA --device (the CPU has no graphs)")

    from moerl.engine.process import EngineProcess
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    with tempfile.TemporaryDirectory() as tmp:
        results: dict = {}
        for graphs in {"off": [False], "on": [True], "both": [False, True]}[args.cuda_graph]:
            got = _vs_generate(
                args.family,
                Path(tmp),
                args.threads,
                8 if args.quick else args.prompts,
                new_tokens,
                1 if args.quick else args.reps,
                args.generate_shape or "mid",
                args.device,
                graphs,
            )
            tag = "cuda_graph_" if graphs and args.cuda_graph == "both" else ""
            results.update({f"{tag}{k}": v for k, v in got.items()})
        if args.generate_shape is None and not args.quick:  # issue 29: the tiny shape too
            got = _vs_generate(
                args.family, Path(tmp), args.threads, args.prompts, new_tokens, args.reps,
                "tiny", args.device,
            )  # fmt: skip
            results.update({f"tiny_{k}": got[k] for k in ("fixed_ratio", "longtail_ratio")})
        results["device"] = args.device
        results["cuda_graph"] = args.cuda_graph
        if args.only_generate:
            print(json.dumps(results))
            return results
        model_dir = save_tiny_checkpoint(tiny_config(args.family), Path(tmp) / "hf")
        engine = EngineProcess(
            model_dir, "--device", args.device, "--max-running-requests", "64", threads=args.threads
        )
        try:
            # one warm-up so lazy initialisation is not timed
            asyncio.run(_concurrent(engine.url, 2, 4))
            results.update(family=args.family, new_tokens=new_tokens)
            for n in (1, 8, 32):
                results[f"tokens_per_s_c{n}"] = asyncio.run(_concurrent(engine.url, n, new_tokens))
                print(
                    f"concurrent={n:<3d} tokens_per_s={results[f'tokens_per_s_c{n}']:.1f}",
                    flush=True,
                )
            seq = asyncio.run(_sequential(engine.url, 32, new_tokens))
            results["tokens_per_s_sequential32"] = seq
            results["batching_speedup"] = results["tokens_per_s_c32"] / seq
            print(
                f"one_at_a_time_32 tokens_per_s={seq:.1f} batching_speedup={results['batching_speedup']:.2f}x (target >= 4x)",
                flush=True,
            )
            stall, gap, step_ms, update_s, client = _stall(engine.url, model_dir, new_tokens)
            results.update(
                stall_decode_steps=stall,
                max_step_gap_steps=gap,
                decode_step_ms=step_ms,
                update_s=update_s,
                client_token_gap_steps=client,
            )
            print(
                f"weight_update_s={update_s:.3f} decode_step_ms={step_ms:.1f} "
                f"stall_decode_steps={stall:.2f} (target < 2: decoding blocked by the swap) "
                f"max_step_gap_steps={gap:.2f} (while the transfer shares the 2 cores) "
                f"client_token_gap_steps={client:.2f} (as a streaming client sees it)",
                flush=True,
            )
        finally:
            engine.close()
        prompt = 1024 if args.quick else args.interleave_prompt
        results.update(
            _interleave(
                args.family,
                Path(tmp),
                args.threads,
                prompt,
                args.interleave_chunk,
                args.device,
                1 if args.quick else args.interleave_reps,
            )  # fmt: skip
        )
        print(
            f"engine interleave prompt_tokens={prompt} chunk={args.interleave_chunk} "
            f"prefill_s={results['interleave_prefill_s']:.2f} decode_rate_ratio="
            f"{results['interleave_decode_rate_ratio']:.2f} (a running request's tokens/s "
            "while the prompt prefills, over alone, the median of "
            f"{' '.join(f'{r:.2f}' for r in results['interleave_decode_rate_ratios'])}; "
            "target >= 0.5)",
            flush=True,
        )
        results.update(
            _shared_prompt(
                args.family, Path(tmp), args.threads, 512, 16 if args.quick else 64,
                1 if args.quick else 3, args.device,
            )
        )  # fmt: skip
        print(
            f"engine shared_prompt group=8 prompt_tokens=512 new_tokens="
            f"{results['shared_prompt_new_tokens']} kv_ratio="
            f"{results['shared_prompt_kv_ratio']:.2f} (KV held over the prompt once + 8 "
            f"responses; target <= 1.3) copied_kv_ratio={results['copied_prompt_kv_ratio']:.2f}"
            f" group_s shared={results['shared_prompt_group_s']:.2f} copied="
            f"{results['copied_prompt_group_s']:.2f} speed_ratio="
            f"{results['shared_prompt_speed_ratio']:.2f}x",
            flush=True,
        )
        context = 96 if args.quick else args.turn_context
        turns = 3 if args.quick else 4
        results.update(
            _turn_reuse(args.family, Path(tmp), args.threads, context, turns, 16, 3, args.device)
        )
        print(
            f"episode_turn context={context}+ turn_ms_full_prefill="
            f"{results['turn_ms_full_prefill']:.1f} turn_ms_prefix_reuse="
            f"{results['turn_ms_prefix_reuse']:.1f} turn_prefix_reuse_speedup="
            f"{results['turn_prefix_reuse_speedup']:.2f}x (cached_tokens median "
            f"{results['turn_cached_tokens_median']:.0f})",
            flush=True,
        )
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
