"""Offline evaluation of a checkpoint: `python -m moerl.eval model.path=/ckpt [...]`.

Takes the training job's config and overrides (the same schema, recipes included), starts
one embedded engine on the Hugging Face checkpoint ``model.path`` (a run's init_hf, a
trainer's HF export from ``tools/convert_checkpoint.py mcore2hf``), or uses running
SGLang servers (``engine=sglang 'engine.urls=[...]'``, serving that checkpoint), and
evaluates the held-out sets of the `eval` group exactly as during training
(moerl.rollout.evaluation): the same sampling, pass@k estimator and metric names. Prints
the numbers as JSON and writes them to ``eval.json`` in Hydra's run directory.

    python -m moerl.eval +recipe=deepseek_moe model.path=outputs/run/init_hf \\
        eval.num_prompts=64 eval.n=8 'eval.k=[1,8]'

``eval.every`` is not read: the sets are evaluated once. Without ``eval.sets`` the set is
the training task at ``eval.seed``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from moerl.config.schema import MoerlConfig
from moerl.config.threads import usable_cores
from moerl.launch import engine_flags, prefix_cache_on, preflight
from moerl.validate import check_eval_sets


def evaluate_checkpoint(cfg: MoerlConfig, log_dir: Path) -> dict[str, float]:
    """The eval metrics of the checkpoint ``cfg.model.path`` (engine log in ``log_dir``)."""
    from moerl.engine.process import EngineProcess

    path = Path(cfg.model.path or "")
    if cfg.engine.kind == "sglang":
        return _evaluate(cfg, path, list(cfg.engine.urls), api_key=None)
    flags = ["--dtype", cfg.engine.dtype]
    flags += engine_flags(cfg.engine, prefix_cache_on(cfg))
    print(f"moerl: starting an embedded engine on {path}", file=sys.stderr, flush=True)
    with EngineProcess(
        path, *flags, threads=cfg.engine.threads or usable_cores(),
        log_path=log_dir / "engine0.log",
        startup_timeout_s=cfg.engine.startup_timeout_s,
    ) as engine:  # fmt: skip
        return _evaluate(cfg, path, [engine.url], api_key=engine.api_key)


def _evaluate(cfg: MoerlConfig, path: Path, urls: list[str], api_key: str | None) -> Any:
    from moerl.models.tokenizer import load_tokenizer
    from moerl.rollout.evaluation import EvalRunner
    from moerl.rollout.faults import make_client
    from moerl.tasks import build_task

    tokenizer = load_tokenizer(path)
    made = exported_from(path)
    specs = cfg.eval.resolve_sets(cfg.task)
    sets = {name: build_task(spec, tokenizer) for name, spec in specs.items()}

    async def run() -> dict[str, float]:
        client = make_client(urls, cfg.rollout, api_key=api_key)
        try:
            await client.wait_until_healthy(cfg.engine.startup_timeout_s)
            runner = EvalRunner(
                client, sets, cfg.eval, cfg.rollout.sampling_params(),
                reward_workers=cfg.rollout.reward_workers,
                reward_inline_s=cfg.rollout.reward_inline_us * 1e-6, version=made.get("version", 0),
            )  # fmt: skip
            try:
                return await runner.evaluate(step=made.get("step", 0))
            finally:
                await runner.stop()
        finally:
            await client.aclose()

    return asyncio.run(run())


def exported_from(path: Path) -> dict[str, Any]:
    """What an mcore2hf export was made from (its ``moerl_export.json``: source, step,
    policy version), so the metrics carry the trained step; {} for any other checkpoint
    (a run's init_hf is step 0, version 0)."""
    from moerl.convert.mcore_ckpt import EXPORT_JSON

    file = Path(path) / EXPORT_JSON
    if not file.is_file():
        return {}
    try:
        made = json.loads(file.read_text())
    except ValueError as err:
        raise ValueError(f"{file} is not JSON ({err}): export the checkpoint again") from None
    return {k: int(made[k]) for k in ("step", "version") if isinstance(made.get(k), int)}


@hydra.main(config_path="pkg://moerl.conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    import logging

    from hydra.core.hydra_config import HydraConfig

    for name in ("httpx", "httpcore"):  # no per-request lines between the JSON and the user
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        typed = preflight(cfg, list(HydraConfig.get().overrides.task))
        if not typed.model.path:
            raise ValueError("model.path is empty; set it to the HF checkpoint to evaluate")
        check_eval_sets(typed)
    except ValueError as err:
        print(f"moerl: invalid config: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except ImportError as err:  # an optional extra the config needs
        print(f"moerl: missing package: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    metrics = evaluate_checkpoint(typed, run_dir)
    report = {"checkpoint": str(typed.model.path), "metrics": metrics}
    (run_dir / "eval.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(json.dumps(report, indent=2, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
