"""The engine's model: transformers' own implementation, with routing capture.

An inference implementation independent of the megatron-core trainer, as SGLang is.
Forward hooks on each MoE router record the top-k expert ids the forward actually
used, so Keep Routing replays exactly what produced each token. Keys and values live
in a ``KVPool`` (``moerl.engine.core.kv_pool``), one slot per request: a forward writes its
new tokens into the rows' slots and attention reads them in place. ``extend`` runs the
new tokens of several requests in one forward (batched prefill, rows left-padded),
``decode`` one token for each running request.

Everything runs on one device (``--device``): the weights, the KV pool, the masks and
positions, and the logits the scheduler samples from; the routes leave it as numpy.
On CUDA, decode steps replay captured graphs where they can (``graphs``, set by the
engine's launch; ``moerl.engine.core.decode_graphs``).
"""

# B batch, S tokens, H hidden, L layers, K top-k, V vocab

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moerl.device import resolve
from moerl.engine.core import invariant, mla
from moerl.engine.core.kv_pool import KVPool, Plan, SlotCache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _router_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """layer index → router module (transformers' ``mlp.gate`` of MoE layers)."""
    routers = {}
    for name, module in model.named_modules():
        match = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.gate", name)
        if match and "router" in type(module).__name__.lower():
            routers[int(match.group(1))] = module
    return routers


MAX_TARGETS = 64
"""Bucket layouts whose load targets a runner keeps (a push of a model sends a few)."""
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


class ModelRunner:
    """Loads an HF checkpoint and runs prefill / batched decode with routing capture."""

    def __init__(
        self,
        model_path: str | Path,
        dtype: str = "float32",
        seed: int = 0,
        device: str | torch.device = "cpu",
        deterministic: bool = False,
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} has no config.json: --model-path must be a local HF checkpoint"
            )
        if dtype not in DTYPES:
            raise ValueError(f"--dtype {dtype}: choose one of {sorted(DTYPES)}")
        self.device = device if isinstance(device, torch.device) else resolve(device)
        self.path = path
        self.config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=DTYPES[dtype], local_files_only=True
        ).eval()
        self.model.to(self.device)
        self.dtype = DTYPES[dtype]
        self.num_layers = self.config.num_hidden_layers
        self.vocab_size = self.config.vocab_size
        self.context_len = self.config.max_position_embeddings
        # transformers 5.x renames past_key_values to cache
        forward = inspect.signature(self.model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in forward else "past_key_values"
        self.routers = _router_modules(self.model)
        # --enable-deterministic-inference: batch-invariant forward and sampling
        self.deterministic = deterministic
        if deterministic:
            invariant.enable(self.model, self.routers)
        # MLA decode steps absorbed as SGLang runs them (not in the batch-invariant mode,
        # whose attention follows the trainer's order, nor with LoRA adapters)
        self.absorb_mla = not deterministic
        self.absorbed = mla.install(self.model, self._absorb) if self.absorb_mla else 0
        # boolean masks for sdpa and the batch-invariant attention, additive for eager
        self.sdpa = getattr(self.model.config, "_attn_implementation", "sdpa") in (
            "sdpa",
            invariant.NAME,
        )
        self.topk = int(getattr(self.config, "num_experts_per_tok", 0) or 0) if self.routers else 0
        self._captured: dict[int, torch.Tensor] = {}
        for layer, module in self.routers.items():
            module.register_forward_hook(self._capture_hook(layer))
        self.params = dict(self.model.named_parameters())
        self.buffers = dict(self.model.named_buffers())
        # a push's (names, shapes) -> where its tensors go, checked (see load_targets)
        self._targets: dict[tuple[tuple[str, ...], tuple[tuple[int, ...], ...]], list[Any]] = {}
        # the draws happen where the logits are (a CUDA generator for CUDA logits)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.lora: Any = None  # a LoraManager when the engine runs with --enable-lora
        self.graphs: Any = None  # DecodeGraphs when decode steps replay CUDA graphs

    def _absorb(self) -> bool:
        """Whether MLA decode steps run absorbed now (``moerl.engine.core.mla``): unless
        ``absorb_mla`` was turned off or the engine runs with LoRA."""
        return self.absorb_mla and self.lora is None

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
        layers = sorted(self._captured)
        if layers:  # one copy off the device for every layer
            ids_LBSK = torch.stack([self._captured[i].view(batch, seq, -1) for i in layers])
            out[:, :, layers, :] = ids_LBSK.to(torch.int32).cpu().numpy().transpose(1, 2, 0, 3)
        self._captured.clear()
        return out if self.topk else out[..., :0]

    @contextlib.contextmanager
    def experts_as(self, name: str | None) -> Iterator[None]:
        """Inside the block the MoE experts run transformers' ``name`` implementation
        ('grouped_mm', 'batched_mm'); a no-op for None or a model without the choice."""
        current = getattr(self.model.config, "_experts_implementation", None)
        settable = hasattr(self.model, "set_experts_implementation")
        if name is None or current is None or current == name or not settable:
            yield
            return
        self.model.set_experts_implementation(name)
        try:
            yield
        finally:
            self.model.set_experts_implementation(current)

    def release_weights(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Free every parameter's memory (SGLang's release of the 'weights' tag); returns
        their shapes and dtypes for ``resume_weights``. Buffers (rotary tables) stay."""
        if self.graphs is not None:
            self.graphs.clear()  # they read the parameters' old memory
        self._targets.clear()  # views of the memory freed here
        shapes = {}
        for name, param in self.params.items():
            shapes[name] = (param.shape, param.dtype)
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        return shapes

    def resume_weights(self, shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
        """Parameters back at their shapes, as zeros: the values come with the next push."""
        if self.graphs is not None:
            self.graphs.clear()
        self._targets.clear()
        for name, (shape, dtype) in shapes.items():
            param = self.params[name]
            param.data = torch.zeros(shape, dtype=dtype, device=param.device)

    # -- forward -----------------------------------------------------------------------
    def new_pool(self, max_slots: int, slots: int = 4, tokens: int = 16) -> KVPool:
        """A KV pool for up to ``max_slots`` requests of up to the model's context, first
        allocated for ``slots`` of ``tokens`` (both grow as ``KVPool.reserve`` says). The
        batch-invariant mode reads keys in whole tiles (``Plan.read_whole_tiles``): its
        pools start at whole tiles, so a prefill's pool, sized to its prompts, does not
        grow (a copy of every layer's keys and values) at its own forward."""
        if self.deterministic:
            tile = invariant.bi.ATTENTION_KEYS
            tokens = min(-(-tokens // tile) * tile, self.context_len)
        return KVPool(
            self.num_layers,
            self.dtype,
            max_slots,
            self.context_len,
            slots=slots,
            tokens=tokens,
            device=self.device,
        )

    def _forward(
        self,
        pool: KVPool,
        plan: Plan,
        rows: list[list[int]],
        adapters: list[str | None] | None,
        all_logits: bool,
    ) -> torch.Tensor:
        """Logits [B, 1, V] (the last column), or [B, S, V] with ``all_logits``, of one
        forward over pool slots (transformers' own model and head, hooks included)."""
        padded = [[0] * (plan.width - len(tokens)) + list(tokens) for tokens in rows]
        ids = torch.tensor(padded, dtype=torch.long, device=self.device)  # one copy in
        if self.deterministic:  # keys read in place by the batch-invariant attention
            plan.read_whole_tiles(invariant.bi.ATTENTION_KEYS, pool.max_tokens)
        pool.reserve(pool.used, plan.keys_read)
        self._set_adapters(adapters)
        try:
            return self.run_model(pool, plan, ids, 0 if all_logits else 1)
        finally:
            self._set_adapters(None)

    def run_model(
        self, pool: KVPool, plan: Plan, ids: torch.Tensor, logits_to_keep: int
    ) -> torch.Tensor:
        """transformers' forward of ``ids`` [B, S] over pool slots as ``plan`` places them
        (its mask and positions), with ``logits_to_keep`` as transformers takes it."""
        out = self.model(
            input_ids=ids,
            attention_mask=plan.attention_mask(self.dtype, boolean=self.sdpa),
            position_ids=plan.positions(),
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **{self.cache_kwarg: SlotCache(pool, plan)},
        )
        return out.logits

    def numerics(self) -> contextlib.AbstractContextManager[Any]:
        """Where a sampling step runs: batch-invariant with ``deterministic``
        (``moerl.engine.core.invariant``; the model's forward is made so once, by
        ``invariant.enable``), else as it is."""
        return invariant.numerics(self.deterministic)

    @torch.no_grad()
    def extend(
        self,
        pool: KVPool,
        slots: list[int],
        rows: list[list[int]],
        adapters: list[str | None] | None = None,
        logits_from: list[int | None] | None = None,
    ) -> tuple[list[torch.Tensor], list[np.ndarray]]:
        """Run each row's new tokens after those its slot holds, all rows in one forward.
        Per row: the logits [V] of its last token (with ``logits_from[b]``, those of its
        positions logits_from.. [S', V]) and the routes of its tokens [S, L, K]. The
        slots' lengths grow only if the forward succeeds."""
        starts = [pool.length(s) for s in slots]
        counts = [len(r) for r in rows]
        plan = Plan(slots, starts, counts, self.device, pool.prefixes_of(slots))
        froms = logits_from or [None] * len(rows)
        logits = self._forward(pool, plan, rows, adapters, any(f is not None for f in froms))
        routes = self._routes(len(rows), plan.width)
        width, out = plan.width, []
        for b, first in enumerate(froms):
            if first is None:
                out.append(logits[b, -1].float())
            else:
                out.append(logits[b, width - counts[b] + first :].float())
        for slot, start, count in zip(slots, starts, counts):
            pool.set_length(slot, start + count)
        return out, [routes[b, width - count :] for b, count in enumerate(counts)]

    @torch.no_grad()
    def decode(
        self,
        pool: KVPool,
        slots: list[int],
        tokens: list[int],
        adapters: list[str | None] | None = None,
    ) -> tuple[torch.Tensor, np.ndarray]:
        """One token for each of B requests in one forward; returns logits [B, V] and
        routes [B, L, K]. The slots' lengths grow only if the forward succeeds."""
        starts = [pool.length(s) for s in slots]
        graphed = None
        if self.graphs is not None and self.graphs.usable(pool, slots, adapters):
            graphed = self.graphs.decode(pool, starts, tokens)  # None: the capture failed
        if graphed is not None:
            logits_BV, routes = graphed
        else:
            plan = Plan(slots, starts, [1] * len(slots), self.device, pool.prefixes_of(slots))
            logits = self._forward(pool, plan, [[t] for t in tokens], adapters, False)
            logits_BV, routes = logits[:, -1].float(), self._routes(len(tokens), 1)[:, 0]
        for slot, start in zip(slots, starts):
            pool.set_length(slot, start + 1)
        return logits_BV, routes

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

    def load_targets(
        self, names: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        """The model's tensors (views) that a bucket of ``names`` and ``shapes`` is copied
        into, checked as ``check_weights`` does (ValueError before any write). Every push
        of a model sends the same buckets, so they are looked up and checked once and
        kept until the weights' memory changes (``release_weights``, ``resume_weights``).
        Call it on the thread that runs those (the scheduler's)."""
        key = (tuple(names), tuple(tuple(int(n) for n in shape) for shape in shapes))
        targets = self._targets.get(key)
        if targets is None:
            if len(names) != len(shapes):
                raise ValueError(f"{len(names)} names for {len(shapes)} shapes")
            self.check_weights(*key)
            targets = []
            for name in key[0]:
                tensor, index = self._target(name)
                targets.append(tensor[index] if index else tensor)
            if len(self._targets) >= MAX_TARGETS:  # pushes of changing buckets: start over
                self._targets.clear()
            self._targets[key] = targets
        return targets

    def load_bucket(
        self, names: Sequence[str], shapes: Sequence[Sequence[int]], tensors: Sequence[torch.Tensor]
    ) -> int:
        """Copy a bucket's ``tensors`` into the model, checked first as ``load_targets``
        says (a refused bucket changes nothing). Returns the count."""
        return self.copy_into(self.load_targets(names, shapes), tensors)

    @staticmethod
    @torch.no_grad()
    def copy_into(targets: list[torch.Tensor], tensors: Sequence[torch.Tensor]) -> int:
        """``tensors`` into ``load_targets``' ``targets`` in one ``_foreach_copy_`` (a value
        in another dtype is converted by the copy; one on another device, a gloo bucket
        into a GPU model, is copied one tensor at a time). Returns the count."""
        if len(tensors) != len(targets):
            raise ValueError(f"{len(tensors)} tensors for {len(targets)} names")
        if all(t.device == d.device for t, d in zip(tensors, targets)):
            torch._foreach_copy_(targets, list(tensors))
        else:
            for target, tensor in zip(targets, tensors):
                target.copy_(tensor)
        return len(targets)
