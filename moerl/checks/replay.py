"""Rollouts from the embedded engine, scored by the megatron-core trainer with Keep
Routing and the sampling mask switched on and off (``tools/check_replay.py``, tests).

For each setting it reports the router flip rate (trainer routes vs rollout routes,
MoE layers only), the k3 KL estimate between rollout and trainer logprobs and the mean
|Δ logprob|. With the mask on, the trainer's logprob over the kept set is compared with
the engine's ``output_token_sampling_logprobs``; with it off, full-vocabulary logprobs
with ``output_token_logprobs``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moerl.common.trajectory import Trajectory, load_jsonl, save_jsonl
from moerl.config.model import ModelConfig
from moerl.parallel.layout import parse_layout
from moerl.parallel.spawn import spawn

# (replay, mask[, trainer_logprobs kwargs])
SETTINGS: list[tuple[Any, ...]] = [("on", "on"), ("on", "off"), ("off", "on"), ("off", "off")]


@dataclass
class SettingResult:
    replay: str
    mask: str
    flip_rate: float
    flip_rate_per_layer: list[float]
    mismatch_k3: float
    mean_abs_dlogp: float
    max_abs_log_ratio: float

    def line(self) -> str:
        return (
            f"replay={self.replay} mask={self.mask} flip_rate={self.flip_rate:.4f} "
            f"mismatch_k3={self.mismatch_k3:.3e} mean_abs_dlogp={self.mean_abs_dlogp:.3e}"
        )


def collect_rollouts(
    hf_dir: str | Path,
    out: str | Path,
    *,
    num_prompts: int = 8,
    max_new_tokens: int = 24,
    dtype: str = "float32",
    seed: int = 0,
    sampling: dict | None = None,
    flags: tuple[str, ...] = (),
) -> list[Trajectory]:
    """Generate trajectories with routes and masks from a fresh embedded engine
    (``flags``: more engine flags)."""
    from moerl.engine.process import EngineProcess
    from moerl.rollout import EngineClient

    params = {
        "max_new_tokens": max_new_tokens,
        "temperature": 1.0,
        "top_p": 0.95,
        "top_k": 40,
        **(sampling or {}),
    }
    rng = np.random.default_rng(seed)
    prompts = [
        rng.integers(4, 100, size=int(rng.integers(3, 12))).tolist() for _ in range(num_prompts)
    ]

    async def go(url: str) -> list[Trajectory]:
        async with EngineClient([url]) as client:
            info = (await client.model_info())[url]
            return list(
                await asyncio.gather(*[
                    client.generate_trajectory(
                        p, params, routed_experts=True, sampling_mask=True,
                        num_layers=info["num_hidden_layers"], topk=info["num_experts_per_tok"],
                        group_id=i, index=0,
                    )
                    for i, p in enumerate(prompts)
                ])
            )  # fmt: skip

    with EngineProcess(
        hf_dir, "--enable-return-routed-experts", "--dtype", dtype, "--random-seed", str(seed),
        *flags,
    ) as engine:  # fmt: skip
        trajs = asyncio.run(go(engine.url))
    save_jsonl(out, trajs)
    return trajs


class _SplicedTokens:
    """A multi-turn environment for the check: every answer is a few random token ids
    spliced into the stream (observations of any id, as a tool's output may be)."""

    def __init__(self, seed: int, turns: int) -> None:
        self.rng, self.turns, self.done = np.random.default_rng(seed), turns, 0

    def _tokens(self) -> Any:
        from moerl.envs.base import Observation

        n = int(self.rng.integers(2, 7))
        return Observation(token_ids=self.rng.integers(4, 100, size=n).tolist())

    async def reset(self) -> Any:
        return self._tokens()

    async def step(self, action: Any) -> Any:
        from moerl.envs.base import Step

        self.done += 1
        return Step(self._tokens(), reward=0.0, done=self.done >= self.turns)


def collect_episodes(
    hf_dir: str | Path,
    out: str | Path,
    *,
    num_episodes: int = 6,
    turns: int = 3,
    max_new_tokens: int = 8,
    dtype: str = "float32",
    seed: int = 0,
    flags: tuple[str, ...] = (),
) -> list[Trajectory]:
    """Multi-turn episodes (moerl.rollout.episode) from a fresh embedded engine: each turn
    splices random observation tokens after the policy's action, so later requests
    re-send (or reuse from the prefix cache) every earlier token. ``flags``: more engine
    flags."""
    from moerl.engine.process import EngineProcess
    from moerl.models.tokenizer import load_tokenizer
    from moerl.rollout import EngineClient
    from moerl.rollout.episode import EpisodeRunner, EpisodeSettings
    from moerl.rollout.render import Renderer

    params = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "top_p": 0.95, "top_k": 40}

    async def go(url: str) -> list[Trajectory]:
        async with EngineClient([url]) as client:
            info = (await client.model_info())[url]
            settings = EpisodeSettings(
                params, max_turns=turns, max_tokens=int(info.get("context_length") or 10**6),
                num_layers=info["num_hidden_layers"], topk=info["num_experts_per_tok"],
            )  # fmt: skip
            runner = EpisodeRunner(
                client,
                lambda prompt: _SplicedTokens(seed * 1000 + prompt, turns),
                Renderer(load_tokenizer(hf_dir)),
                settings,
            )
            runs = await asyncio.gather(
                *[runner.run(i, group_id=i, index=0) for i in range(num_episodes)]
            )
            return [t for trajs, _ in runs for t in trajs]

    with EngineProcess(
        hf_dir, "--enable-return-routed-experts", "--dtype", dtype, "--random-seed", str(seed),
        *flags,
    ) as engine:  # fmt: skip
        trajs = asyncio.run(go(engine.url))
    save_jsonl(out, trajs)
    return trajs


def mismatch(trainer: np.ndarray, rollout: np.ndarray) -> tuple[float, float, float]:
    """(k3 KL estimate, mean |Δ|, max |Δ|) between per-token logprobs."""
    log_ratio = trainer - rollout
    k3 = np.expm1(log_ratio.astype(np.float64)) - log_ratio  # exp(x) − 1 − x without cancellation
    return float(k3.mean()), float(np.abs(log_ratio).mean()), float(np.abs(log_ratio).max())


def checkpoint_model(hf_dir: str | Path) -> ModelConfig:
    """The architecture of an HF checkpoint, its family found by config.json's model_type."""
    from moerl.convert import HFCheckpoint
    from moerl.models.registry import family_for_model_type

    config = HFCheckpoint(hf_dir).config()
    return family_for_model_type(config.get("model_type")).from_hf(config)


def _worker(
    layout: str,
    hf_dir: str,
    rollouts: str,
    out: str,
    dtype: str,
    settings: list | None = None,
    numerics: str = "default",
) -> None:
    import torch.distributed as dist

    from moerl.parallel.state import initialize_for_model
    from moerl.trainer.forward import trainer_logprobs

    model = checkpoint_model(hf_dir)
    pcfg, _ = parse_layout(layout)
    initialize_for_model(pcfg, model)
    chunks = _chunks(model, pcfg, hf_dir, dtype, numerics)
    trajs = load_jsonl(rollouts)
    moe_layers = [i for i in range(model.num_layers) if i >= model.first_k_dense_replace]
    results = []
    scored: dict[tuple[str, str], np.ndarray] = {}
    payload_logprobs: dict[str, list[float]] = {}
    seconds: dict[str, float] = {}
    for setting in settings or SETTINGS:
        replay, mask = setting[0], setting[1]
        extra = setting[2] if len(setting) > 2 else {}
        # 'on' / 'off' / a built-in's name, or a replay-policy spec (a mapping)
        policy = (
            {"on": "all", "off": "none"}.get(replay, replay) if isinstance(replay, str) else replay
        )
        if not isinstance(replay, str):
            replay = str(replay.get("_target_") or replay.get("name"))
        start = time.perf_counter()
        res = trainer_logprobs(
            chunks, trajs, replay=policy, use_mask=mask == "on",
            num_layers=model.num_layers, topk=model.moe_router_topk, num_experts=model.num_experts,
            **extra,
        )  # fmt: skip
        seconds[f"{replay}/{mask}"] = time.perf_counter() - start
        if dist.get_rank() != 0:
            continue
        # an episode's spliced observation tokens are not sampled: only trained ones count
        trained = np.concatenate([t.trained for t in trajs])
        trainer = np.concatenate([res.logprobs[i] for i in range(len(trajs))])[trained]
        ref = np.concatenate([
            (t.sampling_logprobs if mask == "on" else t.response_logprobs) for t in trajs
        ])[trained]  # fmt: skip
        scored[(replay, mask)] = trainer
        payload_logprobs[f"{replay}/{mask}"] = trainer.tolist()
        k3, mad, mx = mismatch(trainer, ref)
        rates = res.flip_rate()
        results.append(
            SettingResult(
                replay=replay,
                mask=mask,
                flip_rate=float(rates[moe_layers].mean()),
                flip_rate_per_layer=rates.tolist(),
                mismatch_k3=k3,
                mean_abs_dlogp=mad,
                max_abs_log_ratio=mx,
            )  # fmt: skip
        )
    if dist.get_rank() == 0:
        payload: dict = {
            "settings": [asdict(r) for r in results],
            "logprobs": payload_logprobs,
            "seconds": seconds,
        }
        if all(k in scored for k in SETTINGS):
            from moerl.telemetry.mismatch import decompose

            versions = np.concatenate([t.versions for t in trajs])[trained]
            payload["decomposition"] = asdict(
                decompose(
                    replay_mask_T=scored[("on", "on")],
                    fresh_route_mask_T=scored[("off", "on")],
                    replay_full_vocab_T=scored[("on", "off")],
                    fresh_route_full_vocab_T=scored[("off", "off")],
                    rollout_sampling_T=np.concatenate([t.sampling_logprobs for t in trajs])[
                        trained
                    ],
                    rollout_full_T=np.concatenate([t.response_logprobs for t in trajs])[trained],
                    stale_T=versions < versions.max(),
                )
            )
        Path(out).write_text(json.dumps(payload))


def score(
    layout: str,
    hf_dir: str | Path,
    rollouts: str | Path,
    out: str | Path,
    dtype: str = "fp32",
    settings: list | None = None,
    numerics: str = "default",
) -> list[SettingResult]:
    """Score rollouts under ``settings``: (replay, mask[, trainer_logprobs kwargs]) with
    replay 'on' | 'off' | 'recent' or a replay-policy mapping (``{"_target_": ...}``,
    reported under its target); default: replay and mask each on and off. ``numerics``:
    the trainer's (``trainer.numerics``). ``out`` also keeps each setting's trainer
    logprobs of the trained tokens (``logprobs`` → "replay/mask") and the seconds each
    setting's forward took (``seconds``)."""
    _, world = parse_layout(layout)
    spawn(_worker, world, layout, str(hf_dir), str(rollouts), str(out), dtype, settings, numerics)
    return [SettingResult(**r) for r in json.loads(Path(out).read_text())["settings"]]


def decomposition(out: str | Path) -> dict | None:
    """The mismatch decomposition written by the last ``score`` into ``out``."""
    return json.loads(Path(out).read_text()).get("decomposition")


def _chunks(model: ModelConfig, pcfg: Any, hf_dir: str, dtype: str, numerics: str) -> list:
    """The checkpoint's model chunks, as the trainer builds them with ``trainer.numerics``
    (the matching numerics: local layers, its ops put in)."""
    from moerl.convert import load_hf
    from moerl.models.gpt import build_model

    matching = numerics == "batch_invariant"
    chunks = build_model(
        model, pcfg, dtype, routing_replay=True, use_te=False if matching else None
    )
    load_hf(chunks, hf_dir, model)
    if matching:
        from moerl.trainer import numerics as trainer_numerics

        trainer_numerics.enable(chunks, model.family)
    return chunks


def _timing_worker(
    hf_dir: str, rollouts: str, out: str, dtype: str, repeats: int, max_tokens: int
) -> None:
    from moerl.parallel.state import initialize_for_model
    from moerl.trainer.forward import trainer_logprobs
    from moerl.trainer.numerics import NUMERICS

    model = checkpoint_model(hf_dir)
    pcfg, _ = parse_layout("single")
    initialize_for_model(pcfg, model)
    trajs = load_jsonl(rollouts)
    models = {mode: _chunks(model, pcfg, hf_dir, dtype, mode) for mode in NUMERICS}
    seconds: dict[str, list[float]] = {mode: [] for mode in models}
    for rep in range(repeats + 1):
        for mode, chunks in models.items():
            start = time.perf_counter()
            trainer_logprobs(
                chunks, trajs, replay="all", use_mask=True, num_layers=model.num_layers,
                topk=model.moe_router_topk, num_experts=model.num_experts, max_tokens=max_tokens,
            )  # fmt: skip
            if rep:  # the first round warms both up
                seconds[mode].append(time.perf_counter() - start)
    Path(out).write_text(json.dumps(seconds))


def forward_seconds(
    hf_dir: str | Path,
    rollouts: str | Path,
    out: str | Path,
    dtype: str = "fp32",
    repeats: int = 10,
    max_tokens: int = 0,
) -> dict[str, list[float]]:
    """Seconds of the trainer's forward over all rollouts (Keep Routing, mask replay,
    ``max_tokens`` per micro-batch), single layout, with ``trainer.numerics`` 'default'
    and 'batch_invariant' built side by side in one process and timed alternately,
    ``repeats`` times each after a warm-up round: {numerics: [seconds, ...]}."""
    spawn(_timing_worker, 1, str(hf_dir), str(rollouts), str(out), dtype, repeats, max_tokens)
    return json.loads(Path(out).read_text())  # type: ignore[no-any-return]
