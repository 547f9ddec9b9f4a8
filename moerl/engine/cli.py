"""The flags of ``python -m moerl.engine --model-path DIR --port P``, the embedded inference
engine.

Flags are named as SGLang's (``--model-path``, ``--port``, ``--host``,
``--max-running-requests``, ``--max-queued-requests``, ``--max-prefill-tokens``,
``--chunked-prefill-size``, ``--enable-return-routed-experts``,
``--enable-lora``, ``--disable-radix-cache``, ``--api-key``, ``--device``,
``--disable-cuda-graph``, ``--cuda-graph-max-bs``), so scripts move between the two by
changing the module. One default differs: decode CUDA graphs are off unless
``--enable-cuda-graph`` (``moerl.engine.core.decode_graphs``).
The API key can come from the ``MOERL_API_KEY`` environment variable instead, which keeps
it out of the process list.
"""

from __future__ import annotations

import argparse

from moerl.device import resolve
from moerl.engine import DEFAULT_HOST, DEFAULT_PORT
from moerl.engine.openai.tool_calls import PARSERS

DESCRIPTION = "python -m moerl.engine --model-path DIR --port P: the embedded inference engine."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moerl.engine", description=DESCRIPTION)
    p.add_argument("--model-path", required=True, help="local HF checkpoint directory")
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=4096,
        help="requests waiting to start; more are refused at once with 503 (SGLang's "
        "default is unbounded, 0 means the same here)",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens per streamed chunk unless a request sets sampling_params.stream_interval",
    )
    p.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="each streamed /generate chunk holds only what is new since the last one: "
        "text, output_ids and the per-token meta_info lists (SGLang's flag); by default a "
        "chunk repeats everything so far",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=16384,
        help="input tokens prefilled together in one scheduler step (at least one request)",
    )
    p.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=8192,
        help="tokens per prefill forward: a longer input runs in chunks of this size "
        "(-1: no chunking)",
    )
    p.add_argument(
        "--stop-regex-timeout-ms",
        type=float,
        default=50.0,
        help="longest one stop_regex search may take; a request whose pattern takes longer "
        "is aborted with a 400 (moerl's own bound: Python's re has none)",
    )
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="turn the prefix cache off: every request prefills its whole input",
    )
    p.add_argument(
        "--prefix-cache-max-tokens",
        type=int,
        default=65536,
        help="tokens of finished sequences (KV and routes) the prefix cache keeps, least "
        "recently used dropped first",
    )
    p.add_argument(
        "--shared-prompt-min-tokens",
        type=int,
        default=256,
        help="the n samples of a request (or requests admitted together with the same input) "
        "read one copy of a prompt at least this long instead of one copy each, so a group's "
        "KV grows with n x response, as SGLang's shared pages; shorter prompts are copied, "
        "which decodes a little faster (-1: always copy; moerl's own, SGLang always shares)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=PARSERS,
        help="parse /v1/chat/completions tool calls in the <tool_call>{json}</tool_call> "
        "format (Qwen 2.5/3, Hermes); without it a request with tools is refused",
    )
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--lora-target-modules", nargs="*", default=None, help="e.g. q_proj o_proj")
    p.add_argument("--api-key", default=None, help="default: $MOERL_API_KEY")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument(
        "--device",
        default="auto",
        help="the device to use: 'cuda', 'cuda:N' or 'cpu'; 'auto' (the default, SGLang's "
        "auto-detection) is cuda when torch sees a GPU, else cpu",
    )
    p.add_argument(
        "--enable-cuda-graph",
        action="store_true",
        help="on CUDA, decode steps of up to --cuda-graph-max-bs requests replay captured "
        "CUDA graphs (not with --enable-lora). SGLang's default; moerl's engine keeps it off "
        "until a GPU run has checked the replay (tools/gpu/run.py)",
    )
    p.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="every decode step runs eagerly (SGLang's flag; moerl's default, and it wins "
        "over --enable-cuda-graph)",
    )
    p.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        help="the largest decode batch captured as a CUDA graph (default: "
        "--max-running-requests, at most 256); larger batches decode eagerly",
    )
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--weight-version", default="0", help="initial weight version")
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch CPU threads (an engine built inside another process: its scheduler "
        "thread's alone)",
    )
    p.add_argument(
        "--admission-wait-ms",
        type=float,
        default=4.0,
        help="an idle engine that gets a request waits at most this long for the requests "
        "sent with it, so they prefill in one forward and decode in step (0: admit at once; "
        "moerl's own, SGLang has none)",
    )
    p.add_argument(
        "--admission-quiet-ms",
        type=float,
        default=1.0,
        help="that wait ends once no request arrived for this long, or once as many "
        "requests wait as the engine's last busy spell admitted",
    )
    p.add_argument(
        "--decode-share",
        type=float,
        default=0.6,
        help="while a prompt longer than --chunked-prefill-size prefills chunk by chunk, the "
        "running requests decode for at least this share of the time (after a chunk of c "
        "seconds, c*share/(1-share) seconds of decode steps before the next chunk); 0: one "
        "decode step per chunk, SGLang's alternation (moerl's own)",
    )
    p.add_argument(
        "--await-start",
        action="store_true",
        help="after the imports, wait for one line on stdin before loading the model: a JSON "
        "object with the log file the output goes to from then on ('log') and, optionally, "
        "environment variables to set ('env': the API key, MOERL_API_KEY, among them); an "
        "empty line or the end of input exits. The launcher starts its engines so while it checks the "
        "config (moerl/engine/process.py WarmEngine; moerl's own)",
    )
    p.add_argument(
        "--malloc-keep-mb",
        type=int,
        default=256,
        help="glibc keeps this many MiB the engine freed and serves blocks up to min(this, 32) "
        "MiB from its heap, so a decode step does not fault its tensors' pages in afresh "
        "(moerl/config/threads.py); 0: glibc's default; skipped where the environment sets "
        "MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_ or MALLOC_TOP_PAD_ (moerl's own)",
    )
    p.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="batch-invariant forward and sampling (SGLang's flag): a request's logprobs "
        "and routes do not depend on the requests batched with it, on chunked prefill or on "
        "prefix reuse (moerl/engine/core/invariant.py); slower; not with --enable-lora",
    )
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    if args.admission_wait_ms < 0 or args.admission_quiet_ms < 0:
        p.error("--admission-wait-ms and --admission-quiet-ms must be >= 0")
    if args.enable_deterministic_inference and args.enable_lora:
        p.error(
            "--enable-deterministic-inference with --enable-lora: the batch-invariant mode "
            "has no LoRA path yet; drop one of them"
        )
    if args.malloc_keep_mb < 0:
        p.error(f"--malloc-keep-mb {args.malloc_keep_mb}: must be >= 0 (0: glibc's default)")
    if args.shared_prompt_min_tokens == 0 or args.shared_prompt_min_tokens < -1:
        p.error(f"--shared-prompt-min-tokens {args.shared_prompt_min_tokens}: >= 1, or -1 (off)")
    if not 0 <= args.decode_share < 1:
        p.error(f"--decode-share {args.decode_share:g}: must be in [0, 1)")
    if args.cuda_graph_max_bs is not None and args.cuda_graph_max_bs < 1:
        p.error(f"--cuda-graph-max-bs {args.cuda_graph_max_bs}: must be at least 1")
    try:  # before loading anything: a device this machine lacks is a usage error
        resolve(args.device)
    except ValueError as err:
        p.error(str(err))
    return args
