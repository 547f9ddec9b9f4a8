"""The engine's batch-invariant mode (``--enable-deterministic-inference``, SGLang's flag).

With it, a request's logits, logprobs and routes do not depend on the requests batched
with it, on prefill vs decode, on a chunked prefill or on a prompt read from the prefix
cache or shared by a group: a row's result is a function of its own tokens. The ops are
``kernels.batch_invariant``'s (its docstring says how each is made so); ``enable`` puts
them into transformers' model where its own are not invariant:

- every ``nn.Linear`` (projections, MLPs, the output layer), RMSNorm and SiLU module runs
  the batch-invariant op;
- attention runs as the attention function registered here (transformers'
  ``AttentionInterface``), the routed experts as the experts function registered here
  (``ExpertsInterface``: each expert's tokens through fixed-shape products, a token's
  experts summed in ascending expert id);
- each MoE router's forward runs inside the ``BatchInvariant`` mode, which reroutes its
  linear, softmax/sigmoid and sums; DeepSeek-V3's and Qwen3-MoE's routers run a twin
  here instead that calls those ops directly (``_ROUTER_TWINS``; the mode's per-op
  dispatch doubled their time), used only where it gives the mode's bits on a probe;
- DeepSeek-V3's multi-head latent attention caches each token's expanded keys and
  values rather than its latent (``_mla_forward``, where its bits equal transformers'
  forward on a probe): a step expands its new tokens only, where transformers' forward
  expands every cached token again (the trainer's order, so not the engine's absorbed
  decode); the KV pool then holds heads × (key + value dims) per token and layer instead
  of the latent's rank + rotary dims (10× on the mid shape, some 70× on DeepSeek-V3);
- everything else the forward does is exact as torch runs it (embedding lookups,
  residual adds, the rotary tables' products, views) and runs as it is.

The sampler's softmaxes run inside the mode too (``numerics``). Patching modules rather
than running the whole forward inside the mode keeps torch's per-op Python dispatch off
the hundreds of other ops a forward makes (on the tiny model that dispatch alone cost
40% of a decode step).

Which token a sampled (not greedy) request draws depends on the engine's random
generator unless the request sets ``sampling_seed`` (then it draws from its own, as
without the mode); the probabilities it draws from and the logprob it reports do not.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any, cast

import torch

from moerl.engine.core import mla
from moerl.kernels import batch_invariant as bi

NAME = "moerl_batch_invariant"
"""The attention and experts functions' name in transformers' interfaces."""

ROW_PARALLEL = (".o_proj", ".down_proj")
"""transformers' names of the linears megatron-core splits along their input (row-parallel:
attention's output projection, the dense and shared MLPs' down projections): their
products sum ``bi.K_SPLITS`` chunks, as a tensor-parallel trainer's ranks do."""


def _is_silu(act: Any) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _act(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The batch-invariant twin of an experts module's activation (SiLU only)."""
    act = getattr(module, "act_fn", None)
    if _is_silu(act):
        return bi.silu
    raise NotImplementedError(
        f"--enable-deterministic-inference: the experts' activation {type(act).__name__} "
        "has no batch-invariant version (SiLU has)"
    )


def experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' experts interface: (hidden [T, H], ids [T, K], weights [T, K])."""
    return bi.experts(
        hidden_states,
        top_k_index,
        top_k_weights,
        cast(torch.Tensor, self.gate_up_proj),
        cast(torch.Tensor, self.down_proj),
        _act(self),
    )


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: q/k/v [B, heads, S, D] → ([B, S, heads, Dv], None)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = bi.attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        is_causal=bool(causal) and attention_mask is None and query.shape[2] > 1,
        scale=scaling,
    )
    return out.transpose(1, 2).contiguous(), None


EXPANDED_MLA = frozenset({"DeepseekV3Attention"})
"""transformers' MLA attention classes whose keys and values the mode caches expanded
(their forward's op order checked on a probe at load, ``_mla_twin``)."""


def _mla_forward(
    module: Any,
    original: Callable[..., Any],
    rotate: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """transformers' ``DeepseekV3Attention.forward`` with the cache holding each token's
    expanded keys and values (``kv_b_proj`` of its latent, the rotary key per head)
    instead of the latent: a forward expands its new tokens only, where transformers'
    expands every cached token again at every step. ``bi.linear`` gives a row the same
    bits wherever and whenever it is computed, so the keys and values are those bits.
    No cache (or an unexpected call): transformers' own forward."""
    key = "cache" if "cache" in kwargs else "past_key_values"  # transformers 5 renamed it
    cache = kwargs.get(key)
    if args or cache is None or position_embeddings is None:
        return original(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    del kwargs[key]
    batch, length = hidden_states.shape[:-1]
    nope, rope, rank = module.qk_nope_head_dim, module.qk_rope_head_dim, module.kv_lora_rank
    if module.q_lora_rank is None:
        q = module.q_proj(hidden_states)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
    q = q.view(batch, length, -1, module.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [nope, rope], dim=-1)
    kv_nope, k_rot = torch.split(module.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
    kv_nope = module.kv_a_layernorm(kv_nope).view(batch, 1, length, rank)
    k_rot = k_rot.view(batch, 1, length, rope)
    cos, sin = position_embeddings
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
    keys, values = module.expand_kv(kv_nope, k_rot)  # the new tokens' only
    keys, values = cache.update(keys, values, module.layer_idx, kwargs=kwargs)
    query = torch.cat((q_pass, q_rot), dim=-1)
    out, _ = attention_forward(
        module, query, keys, values, attention_mask, scaling=module.scaling, **kwargs
    )
    return module.o_proj(out.reshape(batch, length, -1).contiguous()), None


def _mla_twin(module: torch.nn.Module, rotary: torch.nn.Module) -> Callable[..., Any] | None:
    """``_mla_forward`` bound to ``module`` (an ``EXPANDED_MLA`` attention; ``rotary``:
    its model's rotary embedding) if it gives the bits of the module's own forward on a
    probe (a prefill of 5 tokens, then a decode step, each with its own cache); else
    None (transformers' forward stays)."""
    from transformers.cache_utils import DynamicCache

    original = module.forward
    try:
        twin = functools.partial(_mla_forward, module, original, mla.rotary_function(module))
        weight = cast(torch.nn.Linear, module.o_proj).weight
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(2, 6, weight.shape[0], generator=gen).to(weight.device, weight.dtype)
        positions = torch.arange(6, device=weight.device)[None].expand(2, -1)
        with torch.no_grad():
            pe = rotary(hidden, positions)
            out = []
            for forward in (original, twin):
                cache = DynamicCache()
                first = forward(hidden[:, :5], tuple(t[:, :5] for t in pe), None, cache=cache)
                step = forward(hidden[:, 5:], tuple(t[:, 5:] for t in pe), None, cache=cache)
                out.append((first[0], step[0]))
    except Exception:  # attributes of another release: transformers' forward
        return None
    same = all(torch.equal(a, b) for a, b in zip(out[0], out[1], strict=True))
    return twin if same else None


def _expand_mla(model: torch.nn.Module) -> None:
    """Give each ``EXPANDED_MLA`` attention of ``model`` its ``_mla_twin`` where the probe
    passes (the model's rotary embedding looked up once)."""
    attention = [
        m for m in model.modules()
        if type(m).__name__ in EXPANDED_MLA and callable(getattr(m, "expand_kv", None))
    ]  # fmt: skip
    rotary = next((m for n, m in model.named_modules() if n.endswith("rotary_emb")), None)
    if not attention or rotary is None:
        return
    for module in attention:
        twin = _mla_twin(module, rotary)
        if twin is not None:
            module.forward = twin  # type: ignore[method-assign]


def _experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter)
        and m.gate_up_proj.dim() == 3
    ]


def _check_experts(model: torch.nn.Module) -> None:
    for name, module in _experts_modules(model):
        layout = {
            "transposed": getattr(module, "is_transposed", False),
            "bias": getattr(module, "has_bias", False),
            "not concatenated": not getattr(module, "is_concatenated", True),
            "no gate": not getattr(module, "has_gate", True),
        }
        odd = [k for k, v in layout.items() if v]
        if odd:
            raise NotImplementedError(
                f"--enable-deterministic-inference: {name} stores its experts "
                f"({', '.join(odd)}); only transformers' default fused layout is supported"
            )
        _act(module)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # boolean masks, as sdpa's
    ALL_EXPERTS_FUNCTIONS.register(NAME, experts_forward)


def _rms_norm(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' RMSNorm as ``bi.rms_norm`` (the same formula, its mean a tree)."""
    weight = cast(torch.Tensor, module.weight)
    eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
    return functools.partial(bi.rms_norm, weight=weight, eps=eps)


def enable(model: torch.nn.Module, routers: dict[int, torch.nn.Module]) -> None:
    """Make ``model`` (transformers' causal LM, MoE or dense) batch-invariant as the
    module docstring says; ``routers``: its MoE router modules. Raises
    NotImplementedError for a model this mode cannot hold to its promise."""
    _check_experts(model)
    _register()
    for name, module in model.named_modules():
        kind = type(module).__name__
        if isinstance(module, torch.nn.Linear):
            # the weights tensor parallelism splits along K (megatron-core's row-parallel)
            splits = bi.K_SPLITS if name.endswith(ROW_PARALLEL) else 1
            module.forward = functools.partial(_linear, module, splits)  # type: ignore[method-assign]
        elif kind.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor):
            module.forward = _rms_norm(module)  # type: ignore[method-assign]
        elif _is_silu(module):
            module.forward = bi.silu  # type: ignore[method-assign]
        elif "norm" in kind.lower() and "rms" not in kind.lower():
            raise NotImplementedError(
                f"--enable-deterministic-inference: {name} is a {kind}; only RMSNorm has a "
                "batch-invariant version"
            )
    for module in routers.values():
        twin = _router_twin(module)
        module.forward = twin or bi.invariant(module.forward)  # type: ignore[method-assign]
    config = model.config
    if getattr(config, "_experts_implementation", None) is not None:
        model.set_experts_implementation(NAME)  # type: ignore[operator]
    model.set_attn_implementation(NAME)  # type: ignore[operator]
    _expand_mla(model)


def _deepseek_v3_gate(
    gate: Any, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router in fp32 with batch-invariant ops: sigmoid scores; experts
    chosen by score plus the balancing bias, among the ``topk_group`` groups whose two
    best biased scores sum highest; the chosen experts' plain scores as weights,
    normalised to sum to 1 when ``norm_topk_prob``, times the scaling factor.
    Returns (logits, weights, ids), as transformers' router does."""
    experts, groups = gate.weight.shape[0], gate.num_group
    logits = bi.linear(hidden.reshape(-1, gate.hidden_dim).float(), gate.weight.float())
    scores = bi.sigmoid(logits)
    biased = scores + gate.e_score_correction_bias
    per_group = biased.view(-1, groups, experts // groups)
    best = bi.sum_(per_group.topk(2, dim=-1).values, dim=-1)  # [T, groups]
    chosen = best.topk(gate.topk_group, dim=-1, sorted=False).indices
    allowed = torch.zeros_like(best).scatter_(1, chosen, 1).bool()
    allowed = allowed[:, :, None].expand(-1, groups, experts // groups).reshape(-1, experts)
    ids = biased.masked_fill(~allowed, -math.inf).topk(gate.top_k, dim=-1, sorted=False)
    weights = scores.gather(1, ids.indices)
    if gate.norm_topk_prob:
        weights = weights / (bi.sum_(weights, dim=-1, keepdim=True) + 1e-20)
    return logits, weights * gate.routed_scaling_factor, ids.indices


def _qwen3_moe_gate(
    gate: Any, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's router with batch-invariant ops: softmax over the experts in fp32, the
    top-k probabilities (renormalised to sum to 1 when ``norm_topk_prob``) in the
    logits' dtype as weights. Returns (logits, weights, ids)."""
    logits = bi.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
    top, ids = torch.topk(bi.softmax(logits, -1, torch.float), gate.top_k, dim=-1)
    if gate.norm_topk_prob:
        top = top / bi.sum_(top, dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), ids


_ROUTER_TWINS = {"DeepseekV3TopkRouter": _deepseek_v3_gate, "Qwen3MoeTopKRouter": _qwen3_moe_gate}
"""transformers' router class → its twin with the batch-invariant ops called directly."""


def _router_twin(module: torch.nn.Module) -> Callable[..., Any] | None:
    """The twin of ``module``'s forward, bound to it, if there is one and it gives the
    bits of the forward run inside ``BatchInvariant`` on a probe (a transformers
    release whose router computes otherwise keeps the mode); else None."""
    twin = _ROUTER_TWINS.get(type(module).__name__)
    weight = getattr(module, "weight", None)
    if twin is None or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(19, weight.shape[1], generator=gen).to(weight.device, weight.dtype)
    try:
        with torch.no_grad():
            want = bi.invariant(module.forward)(probe)
            got = twin(module, probe)
    except Exception:  # attributes of another release: the mode
        return None
    same = len(want) == len(got) and all(
        torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(want, got, strict=True)
    )
    return functools.partial(twin, module) if same else None


def _linear(module: torch.nn.Linear, splits: int, x: torch.Tensor) -> torch.Tensor:
    return bi.linear(x, module.weight, module.bias, splits)


def numerics(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """The context a sampling step runs in: ``BatchInvariant`` when ``enabled``."""
    return bi.BatchInvariant() if enabled else contextlib.nullcontext()
