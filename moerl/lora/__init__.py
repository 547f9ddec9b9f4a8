"""LoRA for megatron-core MoE models: adapters on attention, dense MLPs, shared experts
and every routed expert, in any TP/PP/EP layout; export in PEFT/SGLang naming.

    apply_lora(chunks, cfg, model)            # freeze the base, add adapters
    gather_adapters(chunks, model)            # full PEFT-named adapters on rank 0
    save_peft(dir, tensors, peft_config(cfg, model)) / load_peft(dir)
    load_adapters_into(chunks, tensors)       # any layout, e.g. to resume
    merged_hf_state(hf_dir, tensors, config)  # W + scaling · B A, the reference
"""

from moerl.lora.apply import (
    adapters,
    apply_lora,
    family_targets,
    find_targets,
    remove_lora,
    resolve_targets,
)
from moerl.lora.export import PEFT_PREFIX, gather_adapters, load_adapters_into, peft_name
from moerl.lora.layers import LoraAdapter
from moerl.lora.peft import (
    adapter_pairs,
    load_peft,
    merged_hf_state,
    peft_config,
    save_peft,
    scaling_of,
)

__all__ = [
    "PEFT_PREFIX",
    "LoraAdapter",
    "adapter_pairs",
    "adapters",
    "apply_lora",
    "family_targets",
    "find_targets",
    "gather_adapters",
    "load_adapters_into",
    "load_peft",
    "merged_hf_state",
    "peft_config",
    "peft_name",
    "remove_lora",
    "resolve_targets",
    "save_peft",
    "scaling_of",
]
