"""HF checkpoint ⇄ megatron-core distributed checkpoint (``dist_checkpointing``).

A Megatron checkpoint directory holds megatron-core's own sharded format plus
``moerl_model.json`` (the ``ModelConfig``) and the HF ``config.json`` and
tokenizer files, so it can be loaded into any layout and converted back. A trainer
checkpoint (``trainer.checkpoint_dir/step_N``, or the directory itself: its ``latest``) holds
the same files beside its model state (``write_model_files``), so ``mcore_to_hf`` exports it
from the directory alone.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from moerl.common.files import readable
from moerl.config.model import ModelConfig
from moerl.convert.exporter import export_hf
from moerl.convert.hf_io import INDEX, HFCheckpoint
from moerl.convert.loader import load_hf
from moerl.models.registry import family_for_model_type, get_family
from moerl.parallel.layout import parse_layout

MODEL_JSON = "moerl_model.json"
TRAINER_PROGRESS = "progress.json"  # moerl.trainer.checkpoint_files.PROGRESS
TRAINER_LATEST = "latest"  # moerl.trainer.checkpoint_files.LATEST
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    # transformers >= 4.43 writes the chat template beside tokenizer_config.json
    "chat_template.jinja",
    "chat_template.json",
)
EXPORT_JSON = "moerl_export.json"  # what an mcore2hf export was made from


def _setup(model: ModelConfig, layout: str) -> list[torch.nn.Module]:
    from moerl.models.gpt import build_model
    from moerl.parallel.state import initialize_for_model

    pcfg, _ = parse_layout(layout)
    initialize_for_model(pcfg, model)
    return build_model(model, pcfg)


def _sharded_state_dict(chunks: list[Any]) -> dict:  # megatron-core modules (untyped)
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def _copy_side_files(src: Path, dst: Path) -> None:
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)


def write_model_files(dst: Path, model: ModelConfig, hf_dir: str | Path | None) -> None:
    """What an export needs beside the weights: the ``ModelConfig`` (its family included)
    and the HF config and tokenizer files of ``hf_dir`` (the checkpoint the model started
    from); without one, the family's config.json for ``model``."""
    (dst / MODEL_JSON).write_text(json.dumps(asdict(model), indent=2))
    if hf_dir is not None:
        _copy_side_files(Path(hf_dir), dst)
    if not (dst / "config.json").is_file():
        try:
            config = get_family(model.family).to_hf(model)
        except (KeyError, ValueError):  # a family without a Hugging Face format
            return
        (dst / "config.json").write_text(json.dumps(config, indent=2))


def _checkpoint_dir(path: str) -> Path:
    """``path``, or the newest checkpoint a trainer's checkpoint directory points to."""
    src = Path(path)
    if (src / TRAINER_LATEST).is_file():
        src = src / (src / TRAINER_LATEST).read_text().strip()
    return src


def hf_to_mcore(hf_dir: str, out: str, layout: str, family: str | None) -> None:
    """Body of every rank: load HF, save megatron-core's distributed checkpoint."""
    from megatron.core import dist_checkpointing

    ckpt = HFCheckpoint(hf_dir)
    config = ckpt.config()
    spec = get_family(family) if family else family_for_model_type(config.get("model_type"))
    model = spec.from_hf(config)
    chunks = _setup(model, layout)
    report = load_hf(chunks, hf_dir, model)
    out_dir = Path(out)
    if dist.get_rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(chunks), str(out_dir))
    if dist.get_rank() == 0:
        (out_dir / MODEL_JSON).write_text(json.dumps(asdict(model), indent=2))
        _copy_side_files(Path(hf_dir), out_dir)
        print(
            f"saved megatron-core checkpoint to {out_dir} ({report.tensors_loaded} shards on rank 0)"
        )


def mcore_to_hf(mcore_dir: str, out: str, layout: str, shard_mb: float) -> None:
    """Body of every rank: load the distributed checkpoint, stream the HF export to
    safetensors shards of at most ``shard_mb`` (one file set per pipeline stage)."""
    from megatron.core import dist_checkpointing, parallel_state
    from tqdm import tqdm

    src = _checkpoint_dir(mcore_dir)
    if not (src / MODEL_JSON).is_file():
        raise FileNotFoundError(f"{src / MODEL_JSON} is missing: not a moerl Megatron checkpoint")
    model = ModelConfig(**json.loads((src / MODEL_JSON).read_text()))
    chunks = _setup(model, layout)
    sharded = _sharded_state_dict(chunks)
    if (src / TRAINER_PROGRESS).is_file():  # a trainer checkpoint keeps the model under "model"
        state = dist_checkpointing.load({"model": sharded}, str(src))["model"]
    else:
        state = dist_checkpointing.load(sharded, str(src))
    if len(chunks) == 1:
        chunks[0].load_state_dict(state, strict=False)
    else:
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(state[f"model{i}"], strict=False)
    out_dir = Path(out)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    writer = (
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
        and parallel_state.get_expert_model_parallel_rank() == 0
    )
    if writer:
        out_dir.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    files = 0

    def flush() -> None:
        nonlocal bucket, size, files
        if bucket and writer:
            name = f"model-pp{stage}-{files:05d}.safetensors"
            save_file(bucket, str(out_dir / name), metadata={"format": "pt"})
            readable(out_dir / name)
            weight_map.update({k: name for k in bucket})
        files += 1 if bucket else 0
        bucket, size = {}, 0

    stream = export_hf(chunks, model)
    for name, tensor in tqdm(
        stream, desc=f"export stage {stage}", disable=not writer, unit="tensor"
    ):
        bucket[name] = tensor.clone()  # the export may yield a parameter itself (a view)
        size += tensor.numel() * tensor.element_size()
        if size >= shard_mb * 2**20:
            flush()
    flush()
    maps: list = [None] * dist.get_world_size()
    dist.all_gather_object(maps, weight_map)
    if dist.get_rank() == 0:
        merged = {k: v for m in maps for k, v in m.items()}
        index = {"metadata": {"total_size": 0}, "weight_map": dict(sorted(merged.items()))}
        (out_dir / INDEX).write_text(json.dumps(index, indent=2))
        _copy_side_files(src, out_dir)
        made = {"source": str(src)}
        if (src / TRAINER_PROGRESS).is_file():  # the trainer's step and policy version
            progress = json.loads((src / TRAINER_PROGRESS).read_text())
            made.update({k: progress[k] for k in ("step", "version") if k in progress})
        (out_dir / EXPORT_JSON).write_text(json.dumps(made, indent=2))
        taken = f" (step {made['step']})" if "step" in made else ""
        print(f"wrote {len(merged)} HF tensors from {src}{taken} to {out_dir}")
