"""The trainer's matching numerics (``trainer.numerics=batch_invariant``, issue 30).

With it, megatron-core's forward computes the bits the embedded engine computes with
``--enable-deterministic-inference`` (``moerl/engine/core/invariant.py``): the same
``kernels/batch_invariant.py`` ops, applied in transformers' op order where
megatron-core's differs. Together with Keep Routing (the trainer's top-k sets, and their
order, are the engine's) and a synchronous step, the trainer's logprob of every
response token is the engine's, exactly, so the importance ratio is 1 and the
decomposition's numerics term 0.

What ``enable`` does to the model chunks:

- the modules whose torch ops are not batch-invariant take the batch-invariant ops, as
  the engine's do: the column- and row-parallel linears' products (``bi.linear``; inside
  ``BatchInvariant``, which reroutes megatron-core's ``torch.matmul``, where its own
  function also all-reduces gradients or gathers a sequence-parallel input),
  ``torch.nn.RMSNorm``, SiLU (the MLPs' ``activation_func``), core attention
  (``LocalCoreAttention.sdpa``) and the routers' logits and scores (their ``gating`` and
  routing function inside the mode); the embedding, rotary
  tables, residual adds and the dispatcher's permutations are exact as they are and run
  as they are (a mode around the whole forward cost a dispatch on each of its ops);
- a softmax router that renormalises its top-k (Qwen3-MoE's ``norm_topk_prob``) takes
  transformers' order: softmax over all experts, top-k, divide by their sum (megatron-core
  takes the softmax of the top-k logits: equal in exact arithmetic, not in bits);
  sigmoid routers (DeepSeek-V3) already follow transformers' formula;
- routed experts apply the routing weight after the down projection, as transformers
  does (megatron-core scales the activations before it), one expert after another;
- the token logprobs (``token_logprobs``, for outputs a matching chunk produced) use the
  engine sampler's formulas in the batch-invariant ops;
- a row-parallel linear sums ``bi.K_SPLITS`` chunks of its input as the engine's does:
  with TP=2 each rank computes one, and the all-reduce adds the two (a + b); an expert's
  down projection under expert TP is added across the group before the routing weight
  scales it (``_experts_forward``); vocabulary-parallel logits are gathered whole.

The backward pass is autograd's through these ops. Pipeline stages pass
activations unchanged, expert parallelism moves a token's rows to their experts and
back through the same fixed-shape products, data parallelism splits sequences: every
layout with tensor sizes dividing ``K_SPLITS`` gives the single layout's bits. In bf16
the routers compute in the dtype transformers uses for the family (``ROUTER_DTYPE``).
fp32 or bf16 and the torch logprob path only; the preflight refuses the rest (``check``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from moerl.kernels import batch_invariant as bi

NUMERICS = ("default", "batch_invariant")

MARK = "_moerl_batch_invariant"
"""Set on a chunk's output by its matching forward (``matched`` reads it)."""


def matched(output: torch.Tensor) -> bool:
    """Whether a matching chunk produced this output (its logprobs take ``token_logprobs``)."""
    return bool(getattr(output, MARK, False))


def token_logprobs(
    logits_TV: torch.Tensor,
    labels_T: torch.Tensor,
    temperature_T: torch.Tensor | float = 1.0,
    *,
    mask_pos_N: torch.Tensor | None = None,
    mask_ids_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """log p(label) [T] as the engine's sampler computes it (moerl/engine/core/sampling.py),
    in batch-invariant ops: log_softmax(logits / T) over the vocabulary; a token with a
    kept set (``mask_pos_N``/``mask_ids_N`` pairs) renormalised as
    log_softmax(that, with the dropped ids at -inf). Differentiable; vocabulary-parallel
    logits are gathered whole first."""
    from moerl.kernels.logprob_torch import temperatures
    from moerl.trainer.logprobs import _tp

    group, _, size = _tp()
    if size > 1:  # the whole vocabulary on every rank: the sums run as the engine's
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        logits_TV = gather_from_tensor_model_parallel_region(logits_TV, group=group)
    tokens = logits_TV.shape[0]
    temp_T = temperatures(temperature_T, tokens, logits_TV.device)
    lp_TV = bi.log_softmax(logits_TV.float() / temp_T[:, None], -1)
    labels_T1 = labels_T.long()[:, None]
    out_T = lp_TV.gather(1, labels_T1)[:, 0]
    if mask_pos_N is None or mask_ids_N is None or not mask_pos_N.numel():
        return out_T
    keep_TV = torch.zeros_like(lp_TV, dtype=torch.bool)
    keep_TV[mask_pos_N.long(), mask_ids_N.long()] = True
    masked_T = keep_TV.any(dim=-1)
    keep_TV |= ~masked_T[:, None]  # rows without a kept set: finite, and not read
    kept_TV = bi.log_softmax(lp_TV.masked_fill(~keep_TV, -math.inf), -1)
    return torch.where(masked_T, kept_TV.gather(1, labels_T1)[:, 0], out_T)


ROUTER_DTYPE = {"deepseek_moe": "fp32", "qwen3_moe": None}
"""The dtype transformers computes each family's router logits in (megatron-core's
``moe_router_dtype``; None: the model's): DeepSeek's gate upcasts to fp32, Qwen3-MoE's
runs in the model dtype."""


def check(
    numerics: str, *, tp: int, etp: int, dtype: str, cp: int = 1, family: str | None = None
) -> None:
    """Raise ValueError (naming the key and the fix) for a setting the mode cannot hold."""
    if numerics not in NUMERICS:
        raise ValueError(f"trainer.numerics={numerics!r}: choose one of {list(NUMERICS)}")
    if numerics == "default":
        return
    if cp != 1:
        raise ValueError(
            f"trainer.numerics=batch_invariant with parallel.cp={cp}: context parallelism "
            "splits attention's sums; use parallel.cp=1 or trainer.numerics=default"
        )
    split = {"tp": tp, "etp": etp}
    bad = {k: v for k, v in split.items() if bi.K_SPLITS % v}
    if bad:
        shown = ", ".join(f"parallel.{k}={v}" for k, v in bad.items())
        raise ValueError(
            f"trainer.numerics=batch_invariant with {shown}: a row-parallel product sums "
            f"{bi.K_SPLITS} chunks of its input (kernels/batch_invariant.py K_SPLITS), so "
            f"tensor-parallel sizes must divide {bi.K_SPLITS}; use parallel.tp / "
            "parallel.etp of 1 or 2, or trainer.numerics=default"
        )
    if dtype not in ("fp32", "bf16"):
        raise ValueError(
            f"trainer.numerics=batch_invariant with trainer.dtype={dtype!r}: fp32 and bf16 "
            "are matched to the engine; use trainer.dtype=fp32 or bf16"
        )
    if dtype != "fp32" and family is not None and family not in ROUTER_DTYPE:
        raise ValueError(
            f"trainer.numerics=batch_invariant with trainer.dtype={dtype!r} and "
            f"model.family={family!r}: the dtype transformers computes this family's router "
            f"in is not known to moerl/trainer/numerics.py ROUTER_DTYPE (known: "
            f"{sorted(ROUTER_DTYPE)}); add it there, or use trainer.dtype=fp32"
        )


def enable(chunks: list[Any], family: str | None = None) -> None:
    """Put the matching numerics into these (unwrapped or DDP-wrapped) model chunks and
    this process's megatron-core router (see the module docstring); ``family``: the
    model family, whose router dtype (``ROUTER_DTYPE``) the routers take."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.router import TopKRouter

    from moerl.models.local_attention import LocalCoreAttention

    _patch_router()
    for chunk in chunks:
        model = chunk
        while hasattr(model, "module"):  # DDP around Float16Module around the model
            model = model.module
        if family in ROUTER_DTYPE:
            model.config.moe_router_dtype = ROUTER_DTYPE[family]
        for module in model.modules():
            config = getattr(module, "config", None)
            if getattr(config, "activation_func", None) is F.silu:  # MLPs read it per call
                config.activation_func = bi.silu  # type: ignore[union-attr]
            if isinstance(module, SequentialMLP):
                module.forward = functools.partial(_experts_forward, module)  # type: ignore[method-assign]
            elif isinstance(module, RowParallelLinear):
                splits = bi.K_SPLITS // _size(module.tp_group)
                impl = functools.partial(_split_impl, module._forward_impl, splits)
                module._forward_impl = functools.partial(_linear_impl, impl, splits)
            elif isinstance(module, ColumnParallelLinear):
                module._forward_impl = functools.partial(_linear_impl, module._forward_impl, 1)
            elif isinstance(module, torch.nn.RMSNorm):
                module.forward = functools.partial(_rms_norm, module)  # type: ignore[method-assign]
            elif isinstance(module, LocalCoreAttention):
                module.sdpa = bi.attention
            elif isinstance(module, TopKRouter):
                # the logits' product and the scores' formula in the mode; the rest of the
                # forward (aux losses, the expert bias's token counts) does not touch the
                # routing's bits and runs as it is (the mode's per-op dispatch over the
                # whole forward doubled the router's time)
                module.gating = bi.invariant(module.gating)
                module.routing = _matched(module.routing)
            elif isinstance(module, torch.nn.LayerNorm):
                raise NotImplementedError(
                    "trainer.numerics=batch_invariant: LayerNorm models are not matched "
                    "(RMSNorm only)"
                )
        # the outermost forward: its output (Float16Module's fp32 logits) carries the mark
        chunk.forward = _marked(chunk.forward)


def _size(group: Any) -> int:
    return 1 if group is None else int(group.size())


def _rms_norm(self: torch.nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``torch.nn.RMSNorm.forward`` by ``bi.rms_norm`` (torch's default eps: the dtype's)."""
    eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
    return bi.rms_norm(x, self.weight, eps)


def _linear_impl(
    impl: Callable[..., torch.Tensor],
    splits: int,
    *,
    input: torch.Tensor,  # noqa: A002 (megatron-core's keyword)
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    **kwargs: Any,
) -> torch.Tensor:
    """A local linear's product by ``bi.linear`` (K-split ``splits`` ways); where
    megatron-core's own function does more than the product (tensor-parallel gradient
    all-reduce, sequence parallelism, fused weight-gradient accumulation) that function
    runs, its product rerouted by ``BatchInvariant``."""
    plain = not any(kwargs.get(k) for k in ("allreduce_dgrad", "sequence_parallel"))
    plain = plain and not kwargs.get("gradient_accumulation_fusion")
    if plain and kwargs.get("grad_output_buffer") is None:
        return bi.linear(input, weight, bias, splits)
    with bi.BatchInvariant():
        return impl(input=input, weight=weight, bias=bias, **kwargs)


def _split_impl(
    impl: Callable[..., torch.Tensor],
    splits: int,
    *,
    input: torch.Tensor,  # noqa: A002 (megatron-core's keyword)
    weight: torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:
    """A row-parallel linear's local product as the sum of its ``splits`` K-chunks (the
    chunks of ``bi.K_SPLITS`` this rank holds), added pairwise: the ranks' sums then add
    as the engine's ``bi.linear(..., splits=K_SPLITS)`` adds its chunks."""
    return bi.split_k(lambda x, w: impl(input=x, weight=w, **kwargs), input, weight, splits)


def _marked(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` with its tensor output carrying ``MARK``."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            setattr(out, MARK, True)
        return out

    return run


def _experts_forward(
    self: Any,
    hidden_SH: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    probs_S: torch.Tensor,
) -> tuple[torch.Tensor, None]:
    """``SequentialMLP.forward`` in transformers' order: down(act(gate) · up), then × the
    routing weight, each local expert's tokens through its own fixed-shape tiles
    (``bi.grouped_tiles``; a gated linear unit, no bias).
    The down projection sums ``bi.K_SPLITS`` chunks of its input; with expert tensor
    parallelism each rank computes its chunks, the ranks' sums are added before the
    routing weight scales them (as without it), and rank 0 of the expert-TP group returns
    the result, the others zeros, so the dispatcher's sum over that group is exact."""
    cfg = self.config
    silu = cfg.activation_func in (F.silu, bi.silu)
    if not silu or not cfg.gated_linear_unit or cfg.add_bias_linear:
        raise NotImplementedError(
            "trainer.numerics=batch_invariant: experts other than a SiLU gated linear unit "
            "without biases are not matched"
        )
    group = self.tp_group
    etp = _size(group)
    counts = [int(n) for n in torch.as_tensor(tokens_per_expert).tolist()]
    sizes, dest = bi.tile_groups(counts, hidden_SH.device)
    x = hidden_SH.new_zeros(sum(sizes), hidden_SH.shape[-1]).index_copy(0, dest, hidden_SH)
    experts = list(self.local_experts)
    gate, up = bi.grouped_tiles(x, sizes, [e.linear_fc1.weight for e in experts]).chunk(2, -1)
    h = bi.silu(gate) * up
    splits = bi.K_SPLITS // etp
    y = bi.grouped_tiles(h, sizes, [e.linear_fc2.weight for e in experts], splits)[dest]
    if etp > 1:  # all-reduced forward and backward: every rank's partial feeds rank 0's
        y = _SumAcross.apply(y, group)
    out = (y * probs_S.unsqueeze(-1)).to(y.dtype)
    if etp > 1 and group.rank() != 0:
        out = out * 0.0  # still in the graph: its backward's collective runs on every rank
    return out, None


class _SumAcross(torch.autograd.Function):
    """Σ over a process group, forward and backward (each rank's partial feeds the sum,
    whose gradient only the rank using it holds). torch's own
    ``torch.distributed.nn.functional.all_reduce`` does the same but is deprecated (a
    FutureWarning per call), and its suggested successor has no backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Matched(threading.local):
    depth = 0
    """How many matched routers' ``routing`` calls this thread is inside (``_matched``):
    its call of megatron-core's routing function then computes in the mode
    (``_routing``); another thread's routers are not affected."""


_MATCHED_ROUTING = _Matched()


def _matched(routing: Callable[..., Any]) -> Callable[..., Any]:
    """A matched router's ``routing`` method: ``_routing`` knows it is called from it."""

    @functools.wraps(routing)
    def run(*args: Any, **kwargs: Any) -> Any:
        _MATCHED_ROUTING.depth += 1
        try:
            return routing(*args, **kwargs)
        finally:
            _MATCHED_ROUTING.depth -= 1

    return run


def _patch_router() -> None:
    """megatron-core's router takes ``_routing`` (once per process)."""
    import megatron.core.transformer.moe.router as router

    if getattr(router.topk_routing_with_score_function, "_moerl_numerics", False):
        return
    routing = functools.partial(_routing, router.topk_routing_with_score_function)
    routing._moerl_numerics = True  # type: ignore[attr-defined]
    router.topk_routing_with_score_function = routing


def _routing(
    original: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    logits_TE: torch.Tensor,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    score_function: str = "softmax",
    expert_bias: torch.Tensor | None = None,
    fused: bool = False,
    router_replay: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's ``topk_routing_with_score_function``; inside a matching forward, a
    softmax router that renormalises its top-k computes transformers' way (module
    docstring)."""
    args = (
        logits_TE, topk, use_pre_softmax, num_groups, group_topk, scaling_factor,
        score_function, expert_bias, fused, router_replay,
    )  # fmt: skip
    if not (_MATCHED_ROUTING.depth or bi.in_mode()):
        return original(*args)
    with contextlib.nullcontext() if bi.in_mode() else bi.BatchInvariant():
        if score_function != "softmax" or use_pre_softmax or num_groups or fused:
            return original(*args)
        return _softmax_topk(logits_TE, topk, scaling_factor, router_replay)


def _softmax_topk(
    logits_TE: torch.Tensor, topk: int, scaling_factor: float | None, router_replay: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' renormalised softmax top-k (inside the mode: its softmax and sum
    are the batch-invariant ones)."""
    scores_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    if router_replay is None:
        probs_TK, top_TK = torch.topk(scores_TE, k=topk, dim=1)
    else:
        probs_TK, top_TK = router_replay.get_replay_topk(scores_TE, topk, None, None, None)
    probs_TK = (probs_TK / probs_TK.sum(dim=-1, keepdim=True)).type_as(logits_TE)
    if scaling_factor:
        probs_TK = probs_TK * scaling_factor
    routing_probs = torch.zeros_like(logits_TE).scatter(1, top_TK, probs_TK)
    routing_map = torch.zeros_like(logits_TE, dtype=torch.int32).scatter(1, top_TK, 1).bool()
    return routing_probs, routing_map
