"""Rollout engines: where generation runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ENGINE_KINDS = ("embedded", "sglang")
ENGINE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class EngineConfig:
    """The inference engines the orchestrator sends /generate requests to."""

    kind: str = "embedded"
    """'embedded' starts moerl.engine processes (CPU or any device); 'sglang' uses SGLang
    servers, started elsewhere and listed in urls."""
    urls: list[str] = field(default_factory=list)
    """Base URLs of running servers (e.g. 'http://node7:30000'); required for 'sglang',
    empty for 'embedded' (moerl starts those and knows their addresses)."""
    num_engines: int | None = None
    """Engines to use: for 'embedded', processes to start (None = 1); for 'sglang', None =
    every server in urls, a number must equal len(urls)."""

    device: str = "auto"
    """Embedded engines' device (SGLang's --device): 'auto' (a GPU when torch sees one,
    else the CPU), 'cpu', 'cuda' or 'cuda:N'. SGLang servers choose their own."""
    dtype: str = "float32"
    """Embedded engines' weight and compute dtype: 'float32', 'bfloat16' or 'float16'."""
    threads: int | None = None
    """CPU threads of each embedded engine process (of a colocated engine's scheduler
    thread); None = by the core split of moerl/config/threads.py (all cores but one when
    generation and training alternate, half when they overlap, one colocated)."""
    max_running_requests: int = 64
    """Requests an embedded engine decodes together (continuous batching)."""
    cuda_graph: bool = False
    """Embedded engines on CUDA replay their decode steps as CUDA graphs (SGLang's
    default; one graph per batch size, up to cuda_graph_max_bs; not with LoRA). Off until
    a GPU run has checked the replay (moerl/engine/core/decode_graphs.py). SGLang servers
    choose their own (--disable-cuda-graph)."""
    cuda_graph_max_bs: int | None = None
    """The largest decode batch captured as a graph (None: max_running_requests, at most
    256; SGLang's --cuda-graph-max-bs)."""
    max_prefill_tokens: int = 16384
    """Input tokens an embedded engine prefills together in one scheduler step (at least
    one request), as SGLang's --max-prefill-tokens."""
    chunked_prefill_size: int = 8192
    """Tokens per prefill forward of an embedded engine: a longer input runs in chunks of
    this size, which bounds the attention scores' memory (-1: no chunking; SGLang's
    --chunked-prefill-size)."""
    decode_share: float = 0.6
    """While an embedded engine prefills a prompt longer than chunked_prefill_size chunk by
    chunk, its running requests decode for at least this share of the time, and the long
    prompt's prefill takes up to 1 / (1 - share) times longer. Their decode rate keeps a
    little less than the share (the steps right after a chunk run slower: it evicted the
    caches); 0.6 keeps about 0.55 on CPU (tools/bench/engine.py). 0: one decode step
    between two chunks, as SGLang alternates them."""
    admission_wait_ms: float = 4.0
    """An idle embedded engine that gets a request waits at most this long for the
    requests sent with it (until none arrived for admission_quiet_ms), so a step's groups
    prefill in one forward and decode in step; 0 admits at once. SGLang servers admit at
    once."""
    admission_quiet_ms: float = 1.0
    """That wait ends once no request arrived for this long, or once as many requests
    wait as the engine's last busy spell admitted (a synchronous step sends as many as
    the last)."""
    prefix_cache: Any = "auto"
    """Keep finished sequences' KV and routes so a request extending one (the next turn of
    an episode) prefills only its new tokens, with the cached tokens' routes (SGLang's radix
    cache). auto (the default): on for multi-turn episodes (an ``env``), off for single-turn
    rollouts, where every weight push flushes the cache before a request could extend what
    it holds, and keeping each finished sequence costs a copy of its KV (the deepseek_moe
    recipe's sync generation took ~8% less time without it). A group's samples admitted
    together prefill their prompt once either way. false starts embedded engines with
    --disable-radix-cache; SGLang servers are started elsewhere: give them
    --disable-radix-cache yourself (tools/slurm/moerl.sbatch does with PREFIX_CACHE=false)."""
    prefix_cache_max_tokens: int = 65536
    """Tokens of finished sequences an embedded engine's prefix cache keeps (least recently
    used dropped first). A token holds its keys and values in every layer: kilobytes for
    the tiny test models, ~0.3 MB for DeepSeek-V2-Lite in bf16, so lower it for big
    models on small hosts."""
    shared_prompt_min_tokens: int = 256
    """An embedded engine's samples of one prompt (a GRPO group, admitted together) read one
    copy of its KV when the prompt has at least this many tokens, so a group's KV grows
    with n × response rather than n × (prompt + response), as SGLang's shared pages give;
    shorter prompts are copied to each sample, whose decode reads its own slot in place
    (a little faster: tools/bench/engine.py's shared_prompt case). -1: always copy."""
    deterministic_inference: bool = False
    """Batch-invariant engines (SGLang's --enable-deterministic-inference): a request's
    logprobs and routes are the same whatever it is batched with, prefill or decode,
    chunked or not, its prompt cached, shared or not (moerl/engine/core/invariant.py).
    Costs engine speed (tools/bench/true_on_policy.py); not with LoRA yet. Embedded
    engines get the flag; give it to SGLang servers yourself."""
    startup_timeout_s: float = 300.0
    """How long an engine may take to become healthy before the run fails."""

    health_interval_s: float = 2.0
    """Seconds between health checks of every engine."""
    max_health_failures: int = 3
    """Failed health checks in a row after which an embedded engine is restarted (a
    SGLang server is reported)."""
    max_restarts: int = 5
    """Engine restarts a run may spend before it stops with an error."""

    def count(self) -> int:
        """Engines this config asks for."""
        if self.num_engines is not None:
            return self.num_engines
        return len(self.urls) if self.kind == "sglang" else 1
