"""The engine's model: transformers' own implementation, with routing capture.

An inference implementation independent of the megatron-core trainer, as SGLang is.
Forward hooks on each MoE router record the top-k expert ids the forward actually
used, so Keep Routing replays exactly what produced each token. Requests keep their
own KV caches; a decode step stacks them left-padded into one batch, runs one
forward, and appends each row's new key/value back to its request.
"""

# B batch, S tokens, H kv heads, D head dim, L layers, K top-k, V vocab

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import DynamicCache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class KVCache:
    """One request's keys and values per layer, grown in place (amortised doubling)."""

    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [H, cap, Dk]
    values: list[torch.Tensor] = field(default_factory=list)  # per layer [H, cap, Dv]
    length: int = 0

    def append(self, new_keys: list[torch.Tensor], new_values: list[torch.Tensor]) -> None:
        """Append [H, n, D] per layer."""
        n = new_keys[0].shape[1]
        if not self.keys:
            cap = max(16, 2 * n)
            for k, v in zip(new_keys, new_values):
                self.keys.append(k.new_empty(k.shape[0], cap, k.shape[2]))
                self.values.append(v.new_empty(v.shape[0], cap, v.shape[2]))
        if self.length + n > self.keys[0].shape[1]:
            cap = max(2 * self.keys[0].shape[1], self.length + n)
            for i in range(len(self.keys)):
                k, v = self.keys[i], self.values[i]
                self.keys[i] = torch.cat(
                    [k, k.new_empty(k.shape[0], cap - k.shape[1], k.shape[2])], 1
                )
                self.values[i] = torch.cat(
                    [v, v.new_empty(v.shape[0], cap - v.shape[1], v.shape[2])], 1
                )
        for i, (k, v) in enumerate(zip(new_keys, new_values)):
            self.keys[i][:, self.length : self.length + n] = k
            self.values[i][:, self.length : self.length + n] = v
        self.length += n


def _router_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """layer index → router module (transformers' ``mlp.gate`` of MoE layers)."""
    routers = {}
    for name, module in model.named_modules():
        match = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.gate", name)
        if match and "router" in type(module).__name__.lower():
            routers[int(match.group(1))] = module
    return routers


def _layer_kv(kv: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) [B, H, S, D] of every layer of a DynamicCache a forward filled."""
    from transformers.cache_utils import CacheLayerMixin

    out = []
    for layer in kv.layers:
        if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
            raise RuntimeError(f"KV cache layer {type(layer).__name__} holds no keys/values")
        out.append((layer.keys, layer.values))
    return out


_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


class ModelRunner:
    """Loads an HF checkpoint and runs prefill / batched decode with routing capture."""

    def __init__(self, model_path: str | Path, dtype: str = "float32", seed: int = 0) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} has no config.json: --model-path must be a local HF checkpoint"
            )
        if dtype not in DTYPES:
            raise ValueError(f"--dtype {dtype}: choose one of {sorted(DTYPES)}")
        self.path = path
        self.config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=DTYPES[dtype], local_files_only=True
        ).eval()
        self.dtype = DTYPES[dtype]
        self.num_layers = self.config.num_hidden_layers
        self.vocab_size = self.config.vocab_size
        self.context_len = self.config.max_position_embeddings
        self.routers = _router_modules(self.model)
        self.topk = int(getattr(self.config, "num_experts_per_tok", 0) or 0) if self.routers else 0
        self._captured: dict[int, torch.Tensor] = {}
        for layer, module in self.routers.items():
            module.register_forward_hook(self._capture_hook(layer))
        self.params = dict(self.model.named_parameters())
        self.buffers = dict(self.model.named_buffers())
        self.generator = torch.Generator().manual_seed(seed)
        self.lora: Any = None  # a LoraManager when the engine runs with --enable-lora

    def _set_adapters(self, adapters: list[str | None] | None) -> None:
        if self.lora is not None:
            self.lora.set_rows(adapters or [])

    # -- routing capture ---------------------------------------------------------------
    def _capture_hook(self, layer: int):  # type: ignore[no-untyped-def]
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            self._captured[layer] = output[-1].detach()  # (logits, weights, indices)

        return hook

    def _routes(self, batch: int, seq: int) -> np.ndarray:
        """The captured top-k ids as int32 [B, S, L, K] (dense layers: zeros)."""
        out = np.zeros((batch, seq, self.num_layers, max(self.topk, 1)), dtype=np.int32)
        for layer, ids in self._captured.items():
            out[:, :, layer, :] = ids.view(batch, seq, -1).to(torch.int32).numpy()
        self._captured.clear()
        return out if self.topk else out[..., :0]

    # -- forward -----------------------------------------------------------------------
    @torch.no_grad()
    def prefill(
        self,
        input_ids: list[int],
        cache: KVCache,
        adapter: str | None = None,
        logits_from: int | None = None,
    ) -> tuple[torch.Tensor, np.ndarray]:
        """Run the prompt (or a continuation) of one request; returns the last logits [V]
        (or, with ``logits_from``, those of positions ``logits_from..S-1`` [S', V]) and the
        routes of its tokens [S, L, K]."""
        from transformers import DynamicCache

        start = cache.length
        kv = DynamicCache()
        if start:
            for i in range(self.num_layers):
                kv.update(cache.keys[i][None, :, :start], cache.values[i][None, :, :start], i)
        ids = torch.tensor([input_ids], dtype=torch.long)
        positions = torch.arange(start, start + len(input_ids)).unsqueeze(0)
        self._set_adapters([adapter])
        try:
            out = self.model(
                input_ids=ids, position_ids=positions, past_key_values=kv, use_cache=True
            )
        finally:
            self._set_adapters(None)
        layer_kv = _layer_kv(kv)
        cache.append([k[0, :, start:] for k, _ in layer_kv], [v[0, :, start:] for _, v in layer_kv])
        logits = out.logits[0, -1] if logits_from is None else out.logits[0, logits_from:]
        return logits.float(), self._routes(1, len(input_ids))[0]

    @torch.no_grad()
    def decode(
        self, tokens: list[int], caches: list[KVCache], adapters: list[str | None] | None = None
    ) -> tuple[torch.Tensor, np.ndarray]:
        """One token for each of B requests in one forward; returns logits [B, V] and
        routes [B, L, K]."""
        from transformers import DynamicCache

        batch = len(tokens)
        longest = max(c.length for c in caches)
        kv = DynamicCache()
        mask = torch.zeros(batch, longest + 1, dtype=torch.long)
        for i in range(self.num_layers):
            k0, v0 = caches[0].keys[i], caches[0].values[i]
            keys = k0.new_zeros(batch, k0.shape[0], longest, k0.shape[2])
            values = v0.new_zeros(batch, v0.shape[0], longest, v0.shape[2])
            for b, c in enumerate(caches):  # right-align: left padding
                keys[b, :, longest - c.length :] = c.keys[i][:, : c.length]
                values[b, :, longest - c.length :] = c.values[i][:, : c.length]
            kv.update(keys, values, i)
        for b, c in enumerate(caches):
            mask[b, longest - c.length :] = 1
        ids = torch.tensor(tokens, dtype=torch.long).unsqueeze(1)
        positions = torch.tensor([c.length for c in caches]).unsqueeze(1)
        self._set_adapters(adapters)
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=kv,
                use_cache=True,
            )
        finally:
            self._set_adapters(None)
        layer_kv = _layer_kv(kv)
        for b, c in enumerate(caches):
            c.append([k[b, :, -1:] for k, _ in layer_kv], [v[b, :, -1:] for _, v in layer_kv])
        return out.logits[:, -1].float(), self._routes(batch, 1)[:, 0]

    # -- weights -----------------------------------------------------------------------
    def _target(self, name: str) -> tuple[torch.Tensor, tuple[Any, ...]]:
        """Where an HF checkpoint tensor lives in this model: (tensor, index)."""
        if name in self.params:
            return self.params[name].data, ()
        if name in self.buffers:
            return self.buffers[name], ()
        match = _EXPERT.match(name)
        if match:  # transformers fuses experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]
            prefix, expert, which = match.group(1), int(match.group(2)), match.group(3)
            if which == "down":
                return self.params[f"{prefix}.down_proj"].data, (expert,)
            fused = self.params[f"{prefix}.gate_up_proj"].data
            half = fused.shape[1] // 2
            rows = slice(0, half) if which == "gate" else slice(half, 2 * half)
            return fused, (expert, rows)
        raise KeyError(f"the engine's model has no tensor for {name!r}")

    def check_weights(self, names: Iterable[str], shapes: Iterable[Iterable[int]]) -> None:
        """Raise ValueError naming the first unknown name or wrong shape (before any write)."""
        for name, shape in zip(names, shapes):
            try:
                tensor, index = self._target(name)
            except KeyError as err:
                raise ValueError(str(err)) from None
            want = tuple(tensor[index].shape) if index else tuple(tensor.shape)
            if tuple(shape) != want:
                raise ValueError(f"{name}: got shape {tuple(shape)}, the model has {want}")

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        count = 0
        for name, value in named:
            tensor, index = self._target(name)
            if index:
                tensor[index].copy_(value)
            else:
                tensor.copy_(value)
            count += 1
        return count
