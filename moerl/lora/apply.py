"""Put LoRA adapters on a megatron-core model: find the targets, name them, freeze the base.

Every targeted linear is named by the HF modules it holds, through the family's
HF ⇄ Megatron map (its ``ModelFamily.weight_map``): a layer's global number comes from
``layer.layer_number`` (pipeline stages hold different layers), a routed expert's
from its MoE layer's ``local_expert_indices`` (expert parallel ranks hold different
experts). Those names seed the initialisation and key the export, so adapters are
the same tensors in every layout. A transformer-engine grouped linear holds every local
expert: it gives one target per expert (``moerl.lora.te_grouped``), named as above.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from moerl.config.lora import ALL_LINEAR, LoraConfig
from moerl.config.model import ModelConfig
from moerl.lora.bases import ExpertSlice, is_te_grouped
from moerl.lora.grouped import group_experts
from moerl.lora.layers import LoraAdapter, LoraAdapters, init_pair
from moerl.lora.te_grouped import hook_te_grouped
from moerl.models.maps import QKV, Concat, Copy
from moerl.models.registry import get_family

OUTPUT_TARGET = "lm_head"  # the output layer, as PEFT and SGLang name it
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])$")


@dataclass
class Target:
    """One base linear to adapt."""

    path: str  # module path inside the layer, e.g. "mlp.experts.local_experts.3.linear_fc1"
    base: torch.nn.Module | ExpertSlice
    hf_modules: list[str]  # HF module names of its parts (no ".weight")
    out_sizes: list[int]  # full output size of each part
    groups: int  # interleaved groups of the fused output (query groups for qkv)


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    return getattr(chunk, "module", chunk)


def _is_linear(module: torch.nn.Module) -> bool:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or is_te_grouped(module):
        return True
    return type(module).__name__.startswith("TE") and hasattr(module, "weight")


def _parts(converter, base: Any) -> tuple[list[int], int]:  # type: ignore[no-untyped-def]
    if isinstance(converter, Copy):
        return [base.output_size], 1
    if isinstance(converter, Concat):
        n = len(converter.names)
        return [base.output_size // n] * n, 1
    if isinstance(converter, QKV):
        per_group = converter.head_dim * converter.groups
        return [converter.heads * converter.head_dim, per_group, per_group], converter.groups
    raise NotImplementedError(f"LoRA on a layer converted by {type(converter).__name__}")


def _target(fmap, number: int, key: str, path: str, base, expert: int | None) -> Target:  # type: ignore[no-untyped-def]
    """The target of megatron key ``key`` in layer ``number`` (``expert``: global index)."""
    entry, _ = fmap.lookup(f"decoder.layers.{number}.{key}.weight")
    names = [n.removesuffix(".weight") for n in fmap.hf_names(entry, number, expert)]
    out_sizes, groups = _parts(entry.converter, base)
    return Target(path, base, names, out_sizes, groups)


def find_targets(chunk: torch.nn.Module, model: ModelConfig) -> Iterator[Target]:
    """Every adaptable linear of one model chunk (attention, MLPs, shared and routed experts)."""
    fmap = get_family(model.family).weight_map(model)
    decoder: Any = _unwrap(chunk).decoder  # megatron-core TransformerBlock (untyped)
    for layer in decoder.layers:
        number = layer.layer_number - 1
        experts = getattr(layer.mlp, "experts", None)
        if type(experts).__name__ == "GroupedMLP":  # legacy grouped GEMM: no linear modules
            raise NotImplementedError(
                f"LoRA on megatron-core's legacy GroupedMLP (layer {number}) is not "
                "implemented; use SequentialMLP (moe_grouped_gemm=False) or TEGroupedMLP"
            )
        for path, module in layer.named_modules():
            if not path.rsplit(".", 1)[-1].startswith("linear_") or not _is_linear(module):
                continue
            match = _LOCAL_EXPERT.match(path)
            if match is not None:
                expert = layer.mlp.local_expert_indices[int(match.group(1))]
                key = f"mlp.experts.experts.{match.group(2)}"
                yield _target(fmap, number, key, path, module, expert)
            elif path.startswith("mlp.experts.") and is_te_grouped(module):
                key = f"mlp.experts.experts.{path.rsplit('.', 1)[-1]}"
                tp_group = layer.mlp.experts.tp_group
                for local, expert in enumerate(layer.mlp.local_expert_indices):
                    base = ExpertSlice(module, local, tp_group)
                    yield _target(fmap, number, key, f"{path}.{local}", base, expert)
            elif path.startswith("mlp.experts."):
                raise NotImplementedError(
                    f"LoRA on grouped experts ({path}, {type(module).__name__}) is not "
                    "implemented; build the model with SequentialMLP local experts or "
                    "transformer-engine's TEGroupedMLP"
                )
            else:
                yield _target(fmap, number, path, path, module, None)
    top = _unwrap(chunk)
    output = getattr(top, "output_layer", None) if getattr(top, "post_process", False) else None
    if output is not None:
        if top.share_embeddings_and_output_weights:
            raise NotImplementedError(
                f"LoRA on {OUTPUT_TARGET} of a model with tied embeddings "
                "(model.tie_word_embeddings=true) is not implemented; leave lm_head out of "
                "lora.target_modules"
            )
        yield Target("output_layer", output, [OUTPUT_TARGET], [output.output_size], 1)


def family_targets(model: ModelConfig) -> list[str]:
    """The HF leaf names of the decoder's linears (what 'all-linear' means; as in PEFT,
    the output layer is not among them: name ``lm_head`` to adapt it too)."""
    fmap = get_family(model.family).weight_map(model)
    leaves: set[str] = set()
    for entry in fmap.dense_layer + fmap.moe_layer:
        key = entry.megatron[0]
        if key.endswith(".weight") and key.rsplit(".", 2)[-2].startswith("linear_"):
            leaves.update(n.removesuffix(".weight").rsplit(".", 1)[-1] for n in entry.converter.hf)
    return sorted(leaves)


def resolve_targets(cfg: LoraConfig, model: ModelConfig) -> list[str]:
    """``cfg.target_modules`` as HF leaf names, checked against the model family."""
    known = family_targets(model)
    named = set(cfg.target_modules) - {ALL_LINEAR}
    unknown = sorted(named - set(known) - {OUTPUT_TARGET})
    if unknown:
        raise ValueError(
            f"lora.target_modules={cfg.target_modules}: {unknown} are not linear modules of "
            f"a {model.family} model; choose from {[*known, OUTPUT_TARGET]} or 'all-linear'"
        )
    if OUTPUT_TARGET in named and model.tie_word_embeddings:
        raise ValueError(
            f"lora.target_modules names {OUTPUT_TARGET}, but the model ties it to the "
            "embedding (model.tie_word_embeddings=true); leave lm_head out"
        )
    return sorted(named | (set(known) if ALL_LINEAR in cfg.target_modules else set()))


def _key(hf_module: str) -> str:
    return hf_module.replace(".", "-")


def apply_lora(
    chunks: list[torch.nn.Module], cfg: LoraConfig, model: ModelConfig, *, b_std: float = 0.0
) -> int:
    """Freeze every base parameter and add adapters to the targeted linears of ``chunks``
    (before DDP wrapping). Returns the number of adapted linears on this rank.

    A is initialised from a generator seeded by ``cfg.seed`` and the HF module name and
    this rank takes its slice, so every layout starts from the same full adapters; B
    is zero (``b_std`` > 0 draws it from a normal instead, for tests)."""
    cfg.validate()
    targets = set(resolve_targets(cfg, model))
    count = 0
    for chunk in chunks:
        module = _unwrap(chunk)
        if hasattr(module, "lora"):
            raise ValueError("LoRA is already applied to this model")
        for param in module.parameters():
            param.requires_grad_(False)
        holder = LoraAdapters()
        adapted: dict[torch.nn.Module, LoraAdapter] = {}
        slices: dict[ExpertSlice, LoraAdapter] = {}  # experts of TE grouped linears
        for target in find_targets(module, model):
            active = [t.rsplit(".", 1)[-1] in targets for t in target.hf_modules]
            if not any(active):
                continue
            adapter = LoraAdapter(
                target.base, target.hf_modules, target.out_sizes, cfg.rank, cfg.scaling,
                dropout=cfg.dropout, groups=target.groups, active=active,
            )  # fmt: skip
            for part, name in adapter.active_parts():
                a, b = init_pair(
                    name, cfg.rank, adapter.in_size, target.out_sizes[part], cfg.seed, b_std
                )
                adapter.set_full(part, a, b)
            holder.adapters[_key(target.hf_modules[0])] = adapter
            if isinstance(target.base, ExpertSlice):
                slices[target.base] = adapter
            else:
                adapted[target.base] = adapter
            count += 1
        # routed experts may share one grouped matmul per linear instead of their own hooks;
        # a transformer-engine grouped linear always does (no module per expert to hook)
        holder.handles, grouped = group_experts(module, adapted, cfg.grouped_experts)
        holder.handles += hook_te_grouped(slices)
        embedding = getattr(module, "embedding", None) if module.pre_process else None
        if embedding is not None:
            holder.handles.append(embedding.register_forward_hook(_input_requires_grad))
        for base, adapter in adapted.items():
            if base not in grouped:
                holder.handles.append(base.register_forward_hook(adapter.hook, with_kwargs=True))
        module.lora = holder
    return count


def _input_requires_grad(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> Any:
    """The frozen embedding's output made to require grad: megatron-core's (reentrant)
    activation checkpoint backpropagates into a recomputed layer only when its input
    requires grad, so without this ``trainer.recompute=full`` would drop every decoder
    adapter's gradient (PEFT's ``enable_input_require_grads``, for the same reason)."""
    if torch.is_grad_enabled() and torch.is_tensor(output) and not output.requires_grad:
        return output.requires_grad_()
    return output


def adapters(chunks: list[torch.nn.Module]) -> Iterator[LoraAdapter]:
    """Every adapter of this rank, in a fixed order."""
    for chunk in chunks:
        holder = getattr(_unwrap(chunk), "lora", None)
        if holder is None:
            raise ValueError("the model has no LoRA adapters; call moerl.lora.apply_lora first")
        yield from holder.adapters.values()


def remove_lora(chunks: list[torch.nn.Module]) -> None:
    """Detach the adapters (the base model is left frozen)."""
    for chunk in chunks:
        module = _unwrap(chunk)
        holder = getattr(module, "lora", None)
        if holder is not None:
            for handle in holder.handles:
                handle.remove()
            del module.lora
