"""Decode steps of multi-head latent attention (MLA) in absorbed form, as SGLang runs them.

transformers' ``DeepseekV3Attention`` caches each token's compressed latent (``kv_lora_rank``
values after ``kv_a_layernorm``, plus the shared rotary key) and, at every forward,
expands the whole cached latent of every row into per-head keys and values through
``kv_b_proj`` before attention: a decode step recomputes ``B x S x heads x (nope + v)``
values to attend with one query per row. SGLang's MLA decode instead folds ``kv_b_proj``
into the query and the output ("weight absorption"): with ``W_UK`` and ``W_UV`` the key
and value halves of ``kv_b_proj`` for head h,

    q_nope_h . (W_UK_h c_s)  =  (W_UK_h^T q_nope_h) . c_s
    sum_s p_s W_UV_h c_s     =  W_UV_h (sum_s p_s c_s)

so each head attends over the latents ``c`` themselves (scores ``q_abs . c + q_rot .
k_rot``, values ``c``), one key/value head shared by all query heads, and only the
attended latent is projected to the head's values; the softmax runs in float32, as
transformers' eager attention's does. The cache, the mask and every other op are
transformers' own; the result equals transformers' path up to float rounding (tested
against it).

Only decode steps (one new token per row) take this path, as in SGLang: at prefill the
expanded form costs less. It is not taken

- in the batch-invariant mode (``--enable-deterministic-inference``), whose attention
  follows the trainer's op order (``moerl.engine.core.invariant``);
- with LoRA (``--enable-lora``: an adapter on ``kv_b_proj`` changes the weight it folds;
  ``ModelRunner`` passes ``enabled``);
- for attention classes other than ``ABSORBED`` or a layout without a latent cache
  (transformers before 5 cached the expanded keys and values).
"""

# B batch, H heads, S keys, R kv_lora_rank, P rotary dims, N nope dims, D v dims

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

ABSORBED = frozenset({"DeepseekV3Attention"})
"""transformers' attention classes whose decode steps run absorbed (their forward and
cache layout checked in tests/unit/test_engine_mla.py)."""


def absorbable(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an MLA attention this module can run absorbed."""
    kv_b = getattr(module, "kv_b_proj", None)
    return (
        type(module).__name__ in ABSORBED
        and callable(getattr(module, "expand_kv", None))  # the latent-cache layout
        and isinstance(kv_b, torch.nn.Linear)
        and kv_b.bias is None
        and getattr(module.config, "_attn_implementation", "sdpa") in ("sdpa", "eager")
    )


def install(model: torch.nn.Module, enabled: Callable[[], bool]) -> int:
    """Route the decode steps of ``model``'s absorbable attention modules through the
    absorbed form while ``enabled()``; returns how many modules were routed."""
    count = 0
    for module in model.modules():
        if absorbable(module):
            module.forward = functools.partial(  # type: ignore[method-assign]
                _forward, module, module.forward, enabled, rotary_function(module)
            )
            count += 1
    return count


def rotary_function(module: torch.nn.Module) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The rotary function of ``module``'s own modeling file, as its forward picks it
    (interleaved or not, by ``config.rope_interleave``)."""
    modeling = sys.modules[type(module).__module__]
    interleave = getattr(module.config, "rope_interleave", False)
    rotate: Callable[..., tuple[torch.Tensor, torch.Tensor]] = getattr(
        modeling, "apply_rotary_pos_emb_interleave" if interleave else "apply_rotary_pos_emb"
    )
    return rotate


def _forward(
    module: torch.nn.Module,
    original: Callable[..., Any],
    enabled: Callable[[], bool],
    rotate: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if (
        args
        or hidden_states.shape[1] != 1
        or cache is None
        or position_embeddings is None
        or module.training
        or not enabled()
    ):
        return original(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    return decode(module, rotate, hidden_states, position_embeddings, attention_mask, cache)


def decode(
    module: Any,
    rotate: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    hidden_BxH: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    cache: Any,
) -> tuple[torch.Tensor, None]:
    """One decode step of ``module`` (a ``DeepseekV3Attention``) in absorbed form: the
    new latents go into ``cache`` as transformers' forward writes them; returns the
    attention output [B, 1, hidden] as that forward does (and no weights); ``rotate``:
    the rotary function that forward applies."""
    batch = hidden_BxH.shape[0]
    heads, nope, rope = module.num_heads, module.qk_nope_head_dim, module.qk_rope_head_dim
    rank, v_dim = module.kv_lora_rank, module.v_head_dim
    if module.q_lora_rank is None:
        q = module.q_proj(hidden_BxH)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_BxH)))
    q_BHxQ = q.view(batch, 1, heads, nope + rope).transpose(1, 2)
    q_nope, q_rot = torch.split(q_BHxQ, [nope, rope], dim=-1)
    latent = module.kv_a_proj_with_mqa(hidden_BxH)
    kv_nope, k_rot = torch.split(latent, [rank, rope], dim=-1)
    kv_nope = module.kv_a_layernorm(kv_nope).view(batch, 1, 1, rank)
    k_rot = k_rot.view(batch, 1, 1, rope)
    cos, sin = position_embeddings
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
    c_B1SR, k_rot_B1SP = cache.update(kv_nope, k_rot, module.layer_idx)
    c_BSR, k_rot_BSP = c_B1SR.squeeze(1), k_rot_B1SP.squeeze(1)
    # kv_b_proj's weight [H * (N + D), R] as each head's key and value halves
    w_HxR = module.kv_b_proj.weight.view(heads, nope + v_dim, rank)
    w_uk_HNR, w_uv_HDR = w_HxR[:, :nope], w_HxR[:, nope:]
    q_abs_HBR = torch.bmm(q_nope.squeeze(2).transpose(0, 1), w_uk_HNR)
    # scale * (q_abs . c + q_rot . k_rot): every head against the one latent key head
    scores_BHS = torch.baddbmm(
        torch.bmm(q_rot.squeeze(2), k_rot_BSP.transpose(1, 2)),
        q_abs_HBR.transpose(0, 1),
        c_BSR.transpose(1, 2),
        beta=module.scaling,
        alpha=module.scaling,
    )
    if mask is not None:  # [B, 1, 1, >= S]: boolean (sdpa) or additive (eager)
        mask_B1S = mask[:, 0, :, : scores_BHS.shape[-1]]
        if mask_B1S.dtype == torch.bool:
            scores_BHS = scores_BHS.masked_fill(mask_B1S.logical_not(), float("-inf"))
        else:
            scores_BHS = scores_BHS + mask_B1S
    probs_BHS = torch.softmax(scores_BHS, dim=-1, dtype=torch.float32).to(c_BSR.dtype)
    out_BHR = torch.bmm(probs_BHS, c_BSR)
    out_HBD = torch.bmm(out_BHR.transpose(0, 1), w_uv_HDR.transpose(1, 2))
    out = out_HBD.transpose(0, 1).reshape(batch, 1, heads * v_dim)
    return module.o_proj(out), None
