"""LoRA adapters in the engine: loaded by name, applied per request in the forward.

An adapter is a PEFT adapter (``adapter_config.json`` + safetensors with names like
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``). Forward hooks on
the targeted ``nn.Linear`` modules add ``scaling · B(A x)`` to the rows of the batch
whose request named that adapter (``lora_path``), so requests with different
adapters, or none, share one batched forward. Loading validates everything first and
registers atomically: a bad adapter is never half-applied. Per-expert adapters on
routed experts (``…mlp.experts.{i}.{gate,up,down}_proj``) are applied inside the fused
experts forward, see ``moerl.engine.lora.experts`` (which also states the coverage rule).

Versioned names: loading ``policy-v3`` leaves requests running on ``policy-v2`` as they
are (adapters are immutable once loaded); unloading an adapter that running, retracted
or waiting requests use is refused (see ``moerl.engine.lora.routes``), so none finishes on
another.
"""

# N rows of the batch, r rank

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moerl.engine.lora.experts import (
    EXPERT_MODULE,
    ExpertWeights,
    fused_experts,
    stack_expert_weights,
    wrap_experts,
)

PEFT_PREFIX = "base_model.model."


@dataclass
class Adapter:
    name: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module → (A [r, in], B [out, r])
    experts: ExpertWeights = field(default_factory=dict)  # routed experts, stacked per layer


def read_peft_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config, tensors) of a PEFT adapter directory."""
    from safetensors.torch import load_file

    path = Path(path)
    config_path = path / "adapter_config.json"
    weights_path = path / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise ValueError(
            f"{path} is not a PEFT adapter directory (needs adapter_config.json and adapter_model.safetensors)"
        )
    return json.loads(config_path.read_text()), load_file(str(weights_path))


class LoraManager:
    """Adapters by name, and the hooks that apply them (see module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_rank: int = 64,
        target_modules: list[str] | None = None,
        max_loras: int = 8,
    ) -> None:
        self.model = model
        self.max_rank = max_rank
        self.targets = set(target_modules) if target_modules else None
        self.max_loras = max_loras
        self.adapters: dict[str, Adapter] = {}
        self.modules = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.hooked: set[str] = set()
        self.experts = fused_experts(model)  # name → fused routed-experts module
        self.wrapped: set[str] = set()
        self.active: dict[str, torch.Tensor] = {}  # adapter name → row indices of this forward
        self.rows = 0  # N, rows of this forward's batch
        # the model's device: adapters and row indices are moved there when set
        self.device = next(model.parameters()).device

    # -- loading ------------------------------------------------------------------------
    def load(self, name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        if not name:
            raise ValueError("lora_name must be non-empty")
        if name in self.adapters:
            raise ValueError(
                f"an adapter named {name!r} is loaded already; unload it or use a new (versioned) name"
            )
        if len(self.adapters) >= self.max_loras:
            raise ValueError(
                f"{len(self.adapters)} adapters are loaded (--max-loras-per-batch {self.max_loras}); unload one first"
            )
        rank = int(config.get("r", 0))
        if not 0 < rank <= self.max_rank:
            raise ValueError(
                f"adapter rank r={rank} must be in 1..{self.max_rank} (--max-lora-rank)"
            )
        for key in ("rank_pattern", "alpha_pattern"):
            if config.get(key):
                raise ValueError(f"adapter {name!r}: PEFT {key} is not supported by the engine")
        if config.get("use_dora"):
            raise ValueError(f"adapter {name!r}: DoRA (use_dora) is not supported by the engine")
        alpha = float(config.get("lora_alpha", rank))
        scaling = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
        targets = config.get("target_modules") or []
        if isinstance(targets, str):
            targets = [targets]
        if self.targets is not None:
            extra = sorted(set(targets) - self.targets)
            if extra:
                raise ValueError(
                    f"adapter targets {extra}, the engine was started for {sorted(self.targets)} (--lora-target-modules)"
                )
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            module, kind = _split(key)
            pairs.setdefault(module, {})[kind] = tensor
        weights, expert_pairs = {}, {}
        for module, pair in sorted(pairs.items()):
            if EXPERT_MODULE.match(module):
                self._check_target(name, module, targets)
                expert_pairs[module] = pair
                continue
            if set(pair) != {"A", "B"}:
                raise ValueError(f"adapter {name!r}: {module} needs both lora_A and lora_B")
            linear = self.modules.get(module)
            if linear is None:
                raise ValueError(
                    f"adapter {name!r}: the engine's model has no linear layer {module!r}"
                )
            a, b = pair["A"], pair["B"]
            if tuple(a.shape) != (rank, linear.in_features) or tuple(b.shape) != (
                linear.out_features,
                rank,
            ):
                raise ValueError(
                    f"adapter {name!r}: {module} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                    f"a {linear.in_features}→{linear.out_features} layer at rank {rank}"
                )
            self._check_target(name, module, targets)
            # the layer's dtype and device
            weights[module] = (a.to(linear.weight), b.to(linear.weight))
        layers = config.get("layers_to_transform")
        if isinstance(layers, int):
            layers = [layers]
        experts = (
            stack_expert_weights(name, expert_pairs, self.experts, rank, layers)
            if expert_pairs
            else {}
        )
        if not weights and not experts:
            raise ValueError(f"adapter {name!r} has no tensors")
        for module in weights:  # all checks passed: register
            if module not in self.hooked:
                self.modules[module].register_forward_hook(self._hook(module))
                self.hooked.add(module)
        for module in experts:
            if module not in self.wrapped:
                wrap_experts(self.experts[module], self._expert_groups(module))
                self.wrapped.add(module)
        self.adapters[name] = Adapter(name, rank, scaling, weights, experts)

    def _check_target(self, name: str, module: str, targets: list[str]) -> None:
        leaf = module.rsplit(".", 1)[-1]
        if targets and leaf not in targets:
            raise ValueError(
                f"adapter {name!r}: {module} is not among its target_modules {targets}"
            )
        if self.targets is not None and leaf not in self.targets:
            raise ValueError(
                f"adapter {name!r}: {module} is not among the engine's targets "
                f"{sorted(self.targets)} (--lora-target-modules)"
            )

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(f"no adapter named {name!r} is loaded")
        del self.adapters[name]

    # -- applying -----------------------------------------------------------------------
    def set_rows(self, assignment: list[str | None]) -> None:
        """Which adapter each row of the next forward uses (None: the base model)."""
        self.active = {}
        self.rows = len(assignment)
        for name in set(a for a in assignment if a is not None):
            rows = [i for i, a in enumerate(assignment) if a == name]
            self.active[name] = torch.tensor(rows, device=self.device)

    def _hook(self, module: str):  # type: ignore[no-untyped-def]
        def hook(mod: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            if not self.active:
                return output
            x = args[0]
            for name, rows in self.active.items():
                adapter = self.adapters[name]
                pair = adapter.weights.get(module)
                if pair is None:
                    continue
                a, b = pair
                delta = (x[rows] @ a.T) @ b.T
                output = output.index_add(0, rows, delta * adapter.scaling)
            return output

        return hook

    def _expert_groups(self, module: str):  # type: ignore[no-untyped-def]
        """For ``wrap_experts``: each active adapter's tokens of this forward's [T, H]
        (T = N rows × S positions, row-major) and its LoRA on ``module``."""

        def groups(tokens: int) -> list[tuple[torch.Tensor, dict[str, Any], float]]:
            out = []
            for name, rows in self.active.items():
                adapter = self.adapters[name]
                lora = adapter.experts.get(module)
                if lora is None:
                    continue
                assert tokens % self.rows == 0, (tokens, self.rows)
                seq = tokens // self.rows
                tok = (rows[:, None] * seq + torch.arange(seq, device=rows.device)).reshape(-1)
                out.append((tok, lora, adapter.scaling))
            return out

        return groups


def _split(key: str) -> tuple[str, str]:
    """PEFT tensor name → (module name in the model, 'A' | 'B')."""
    name = key.removeprefix(PEFT_PREFIX)
    for kind in ("A", "B"):
        for suffix in (f".lora_{kind}.weight", f".lora_{kind}.default.weight"):
            if name.endswith(suffix):
                return name[: -len(suffix)], kind
    raise ValueError(f"{key!r} is not a PEFT LoRA tensor name (…lora_A.weight / …lora_B.weight)")
