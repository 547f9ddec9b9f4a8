"""Load an HF safetensors checkpoint into megatron-core model chunks of any layout.

Every rank reads only what it owns: whole tensors are never read for plain
renames (a slice is read straight from the file), experts are read only on the
EP rank that holds them, and fused tensors (QKV, gate/up) are built per layer
from their parts and then sliced. Names and shapes are checked for the whole
rank before any weight is written, so a bad checkpoint never half-loads.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moerl.config.model import ModelConfig
from moerl.convert.hf_io import CheckpointError, HFCheckpoint
from moerl.models.maps import Copy
from moerl.models.registry import get_family
from moerl.parallel.full_state import Shard, local_shards

# Fields that must agree between the checkpoint's config.json and the model config.
MATCHED_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "vocab_size",
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "first_k_dense_replace",
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "tie_word_embeddings",
)


@dataclass
class LoadReport:
    tensors_loaded: int
    ignored: list[str] = field(default_factory=list)


def check_config(model: ModelConfig, hf_config: dict) -> None:
    """Raise ValueError naming each field where the checkpoint and the model disagree."""
    from_ckpt = get_family(model.family).from_hf(hf_config)
    diffs = [
        f"{name}: checkpoint {getattr(from_ckpt, name)!r} vs model {getattr(model, name)!r}"
        for name in MATCHED_FIELDS
        if getattr(from_ckpt, name) != getattr(model, name)
    ]
    if diffs:
        raise ValueError(
            "checkpoint config.json does not match model config ("
            + "; ".join(diffs)
            + "); build the model with moerl.models.get_family(...).from_hf(config)"
        )


def _plan(shard: Shard, fmap, ckpt: HFCheckpoint):  # type: ignore[no-untyped-def]
    entry, layer = fmap.lookup(shard.key)
    expert = shard.offset[0] if entry.expert else None
    if entry.expert and shard.prepend != 1:
        raise CheckpointError(f"{shard.key}: expected a stacked expert tensor")
    names = fmap.hf_names(entry, layer, expert)
    return entry, names


def load_hf(
    chunks: list[torch.nn.Module],
    hf_dir: str | Path,
    model: ModelConfig,
    *,
    ignore: tuple[str, ...] = (),
) -> LoadReport:
    """Load ``hf_dir`` into this rank's ``chunks`` (built from ``model``).

    Checkpoint tensors the model has no place for raise, unless they match one of
    the ``ignore`` glob patterns (e.g. DeepSeek-V3's multi-token-prediction layer).
    """
    ckpt = HFCheckpoint(hf_dir)
    check_config(model, ckpt.config())
    fmap = get_family(model.family).weight_map(model)
    expected = fmap.all_hf_names(model.num_experts)
    present = ckpt.names()
    if model.tie_word_embeddings:
        present = present - {"lm_head.weight"}
    missing = sorted(expected - present)
    if missing:
        raise CheckpointError(
            f"{ckpt.dir} lacks {len(missing)} tensors the model needs, e.g. {missing[:5]}"
        )
    unknown = sorted(present - expected)
    ignored = [n for n in unknown if any(fnmatch.fnmatch(n, pat) for pat in ignore)]
    unknown = [n for n in unknown if n not in ignored]
    if unknown:
        raise CheckpointError(
            f"{ckpt.dir} has {len(unknown)} tensors with no place in the model, e.g. "
            f"{unknown[:5]}; check the family/config or pass ignore=(...) patterns"
        )

    shards = local_shards(chunks)
    plans = []
    for shard in shards:  # validate everything before writing anything
        entry, names = _plan(shard, fmap, ckpt)
        shapes = [ckpt.shape(n) for n in names]
        want = shard.global_shape[shard.prepend :]
        meta = [torch.empty(s, device="meta") for s in shapes]
        got = tuple(entry.converter.to_megatron(meta).shape)
        if got != tuple(want):
            raise CheckpointError(
                f"{names[0]} in {ckpt.files[names[0]].name}: shapes {shapes} give Megatron "
                f"{shard.key} shape {got}, the model expects {tuple(want)}"
            )
        plans.append((shard, entry, names))

    with torch.no_grad():
        for shard, entry, names in plans:
            index = shard.index()[shard.prepend :]
            if isinstance(entry.converter, Copy):
                piece = ckpt.get_slice(names[0], index)  # type: ignore[arg-type]
            else:
                full = entry.converter.to_megatron([ckpt.get(n) for n in names])
                piece = full[index]
            shard.data.copy_(piece)
    return LoadReport(tensors_loaded=len(plans), ignored=ignored)
