"""megatron-core call sites that cannot run as written without CUDA or without TE.

Each entry names the site, why it fails, and what we do instead. ``install()`` is
called by ``moerl.compat.activate()`` (CPU only); ``fix_missing_te()`` is also
called on GPU machines that lack transformer-engine.
"""

from __future__ import annotations

from typing import Any

_originals: list[tuple[Any, str, Any]] = []


def _patch(owner: Any, name: str, value: Any) -> None:
    _originals.append((owner, name, getattr(owner, name, None)))
    setattr(owner, name, value)


def fix_missing_te() -> None:
    """Bugs of megatron-core 0.16 on installs without transformer-engine.

    ``moe_utils.RouterGatingLinearFunction`` tests
    ``te_general_gemm is not None`` but the name is only bound when the TE import
    succeeds, so every router forward without TE raises NameError. Bind it to None."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    # megatron-core 0.16: multi_latent_attention sets HAVE_TE=True whenever
    # megatron.core.extensions.transformer_engine imports -- which it does without TE,
    # leaving TELinear None -- so MLASelfAttention calls isinstance(x, None).
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


def fix_expert_bias_padding_mask() -> None:
    """megatron-core 0.16 bug on every machine: ``TopKRouter._apply_expert_bias`` masks the
    [tokens, experts] routing map with the flattened [tokens] padding mask without a
    trailing axis, which fails to broadcast (the aux-loss paths unsqueeze it). The
    trainer passes a padding mask so padding stays out of expert-bias load counts; we
    give the mask its expert axis before the original runs."""
    from megatron.core.transformer.moe.router import TopKRouter

    original = TopKRouter._apply_expert_bias
    if getattr(original, "_moerl_fixed", False):
        return

    def _apply_expert_bias(self: Any, routing_map: Any, padding_mask: Any = None) -> Any:
        if padding_mask is not None and padding_mask.dim() == routing_map.dim() - 1:
            padding_mask = padding_mask.unsqueeze(-1)
        return original(self, routing_map, padding_mask=padding_mask)

    _apply_expert_bias._moerl_fixed = True  # type: ignore[attr-defined]
    TopKRouter._apply_expert_bias = _apply_expert_bias


def _move_tensor_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """CPU twin of ``moe_utils.maybe_move_tensor_to_cpu``.

    The alltoall dispatcher relies on it to turn its split sizes into numpy arrays
    before ``all_to_all_single``; the original only converts CUDA tensors, so on
    CPU the splits stay tensors and ``all_to_all_single`` rejects them."""
    import torch

    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _uneven_collectives() -> tuple[Any, Any]:
    """Gather / reduce-scatter with per-rank split sizes over gloo.

    The allgather and alltoall dispatchers with expert-tensor parallelism gather and
    reduce-scatter tokens with uneven per-rank sizes, passing lists of differently
    sized tensors to ``all_gather`` / ``reduce_scatter``. NCCL accepts that; gloo
    rejects uneven all-gathers and has no list reduce-scatter. The replacements pad
    to the largest split and use the even collectives (gather), or all-reduce and
    keep this rank's rows (reduce-scatter). Equal splits keep the original path.
    """
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    orig_gather = mappings._gather_along_first_dim
    orig_reduce_scatter = mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return orig_gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        width = max(sizes)
        padded = input_.new_zeros((width, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        gathered = input_.new_empty((width * len(sizes), *input_.shape[1:]))
        dist.all_gather_into_tensor(gathered, padded.contiguous(), group=group)
        pieces = [gathered[r * width : r * width + n] for r, n in enumerate(sizes)]
        return torch.cat(pieces, dim=0)

    def reduce_scatter_along_first_dim(
        input_, group, input_split_sizes=None, use_global_buffer=False
    ):
        if input_split_sizes is None or group.size() == 1:
            return orig_reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(s) for s in input_split_sizes]
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(sizes[: group.rank()])
        return total[start : start + sizes[group.rank()]].contiguous()

    return gather_along_first_dim, reduce_scatter_along_first_dim


def _inside(context: str, fn: Any) -> Any:
    """``fn`` run inside ``device_mode.<context>()`` ('suspended' or 'resumed')."""
    import functools

    from moerl.compat import device_mode

    enter = getattr(device_mode, context)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with enter():
            return fn(*args, **kwargs)

    return run


def compute_without_mode() -> None:
    """Site: every torch op of the model's forward and backward passes through
    ``moerl.compat.device_mode``'s Python ``__torch_function__`` (a tenth of a tiny
    model's step). The schedules' ``forward_step`` (the model and the loss) and
    ``backward_step`` name no CUDA device, so they run without the mode; the helpers
    they may reach that do (the causal masks of megatron-core's unfused attention) get
    it back."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import utils

    for name in ("forward_step", "backward_step"):
        _patch(schedules, name, _inside("suspended", getattr(schedules, name)))
    for owner in (utils, fused_softmax):
        for name in ("get_default_causal_mask", "get_sliding_window_causal_mask"):
            if hasattr(owner, name):
                _patch(owner, name, _inside("resumed", getattr(owner, name)))


def optimizer_without_mode() -> None:
    """Site: megatron-core's optimizers step torch's ``Adam``/``AdamW``/``SGD``, which on
    CPU update one parameter at a time, each op through the mode's ``__torch_function__``
    (15% of a tiny model's step). torch's optimizers name no CUDA device for CPU
    parameters, so their ``step`` runs without the mode; megatron's gradient clipping and
    loss-scale code around it, which may, keep it."""
    import torch

    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        if "step" in vars(cls):  # AdamW may inherit Adam's: patch the owner only
            _patch(cls, "step", _inside("suspended", vars(cls)["step"]))


def optimizer_grads_without_mode() -> None:
    """Site: every step megatron-core's optimizers clear each parameter's ``grad``
    (``_zero_grad_group_helper``), and the fp32 one points it at its ``main_grad``
    (``FP32Optimizer.prepare_grads``) and lists the gradients its norm counts
    (``get_main_grads_for_grad_norm``): loops over the parameters whose every ``.grad``
    read and write went through the mode's Python ``__torch_function__`` (300 calls, about
    1 ms of a tiny model's step). None names a CUDA device, so they run without the mode;
    the mixed-precision optimizers' ``prepare_grads``, which does (its inf check), keeps
    it."""
    from megatron.core.optimizer import distrib_optimizer, optimizer

    fp32, base = optimizer.FP32Optimizer, optimizer.MegatronOptimizer
    _patch(fp32, "prepare_grads", _inside("suspended", vars(fp32)["prepare_grads"]))
    name = "get_main_grads_for_grad_norm"
    _patch(base, name, _inside("suspended", vars(base)[name]))
    clear = _inside("suspended", optimizer._zero_grad_group_helper)
    for owner in (optimizer, distrib_optimizer):  # the second imported it by name
        _patch(owner, "_zero_grad_group_helper", clear)


def _foreach_l2_norm(
    chunk_size: int, noop_flag: Any, tensor_lists: Any, per_tensor: bool, *args: Any
) -> tuple[Any, None]:
    """``megatron.core.utils.local_multi_tensor_l2_norm`` in one ``_foreach_norm``: the
    L2 norm of every tensor's L2 norm, as a 1-element fp32 tensor."""
    import torch

    tensors = [t for tensors in tensor_lists for t in tensors]
    if not tensors:
        return torch.zeros(1, dtype=torch.float), None
    norms = list(torch._foreach_norm(tensors))
    if len({n.dtype for n in norms}) > 1:  # the original's torch.tensor(list) makes fp32
        norms = [n.float() for n in norms]  # of mixed dtypes, and keeps one dtype
    total = torch.linalg.vector_norm(torch.stack(norms))
    return total.reshape(1).float(), None


def _foreach_scale(chunk_size: int, noop_flag: Any, tensor_lists: Any, scale: Any) -> None:
    """``megatron.core.utils.local_multi_tensor_scale`` (dst = src * scale for each pair)
    in one ``_foreach_mul_``, or a ``_foreach_mul`` and a ``_foreach_copy_``."""
    import torch

    sources, targets = list(tensor_lists[0]), list(tensor_lists[1])
    if not sources:
        return
    if all(s is t for s, t in zip(sources, targets)):
        torch._foreach_mul_(targets, scale)
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))


def _grad_norm_fp32(original: Any) -> Any:
    """``clip_grads.get_grad_norm_fp32`` for the L2 norm of plain CPU tensors: one foreach
    norm, the same all-reduce and ``item``, no op through the mode. Any other case (an
    inf or p norm, DTensors of megatron FSDP) goes to ``original``."""
    import functools

    import torch

    from moerl.compat import device_mode

    @functools.wraps(original)
    def get_grad_norm_fp32(
        grads_for_norm: Any, norm_type: Any = 2, grad_stats_parallel_group: Any = None
    ) -> float:
        grads = [grads_for_norm] if isinstance(grads_for_norm, torch.Tensor) else grads_for_norm
        with device_mode.suspended():
            plain = all(type(g) is torch.Tensor and g.device.type == "cpu" for g in grads)
        if float(norm_type) != 2.0 or not plain:
            return original(grads_for_norm, norm_type, grad_stats_parallel_group)
        with device_mode.suspended():
            grad_norm, _ = _foreach_l2_norm(0, None, [list(grads)], False)
            total_norm = grad_norm**2.0  # summed over the group as the original does
            torch.distributed.all_reduce(
                total_norm, op=torch.distributed.ReduceOp.SUM, group=grad_stats_parallel_group
            )
            return total_norm.item() ** (1.0 / 2.0)

    return get_grad_norm_fp32


def _clip_grad_by_total_norm_fp32(original: Any) -> Any:
    """``clip_grads.clip_grad_by_total_norm_fp32`` for plain CPU fp32 gradients: the same
    coefficient, one foreach multiply, no op through the mode; DTensor gradients go to
    ``original``."""
    import functools

    import torch

    from moerl.compat import device_mode

    @functools.wraps(original)
    def clip_grad_by_total_norm_fp32(
        parameters: Any, max_norm: Any, total_norm: float, use_decoupled_grad: bool = False
    ) -> None:
        with device_mode.suspended():
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            field = "decoupled_grad" if use_decoupled_grad else "grad"
            grads = [g for g in (getattr(p, field, None) for p in params) if g is not None]
            if not all(type(g) is torch.Tensor and g.device.type == "cpu" for g in grads):
                with device_mode.resumed():
                    return original(parameters, max_norm, total_norm, use_decoupled_grad)
            allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
            wrong = [g.dtype for g in grads if g.dtype not in allowed]
            if wrong:  # the original asserts the same (a 'torch.cuda.FloatTensor' grad)
                raise AssertionError(f"gradients must be {allowed} to clip, got {wrong[0]}")
            clip_coeff = max_norm / (total_norm + 1.0e-6)
            if clip_coeff < 1.0 and grads:
                torch._foreach_mul_([g.detach() for g in grads], clip_coeff)

    return clip_grad_by_total_norm_fp32


def foreach_grad_norm_and_scale() -> None:
    """Site: without transformer-engine or apex, megatron-core's gradient norm and clipping
    (``optimizer/clip_grads.py``) and its main/model copies (``optimizer/optimizer.py``)
    use ``megatron.core.utils``' local fallbacks: a ``torch.norm`` and a ``float()`` per
    gradient, or a multiply and a copy per tensor, every op through the mode's Python
    ``__torch_function__`` (the tiny model's gradient norm and clipping took 2.6 ms of a
    4 ms optimizer step). The same arithmetic in one foreach call each, and the norm and
    the clipping that call them without the mode; the results are bit for bit the
    originals' (tests/unit/test_compat_foreach_grads.py)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    for module in (clip_grads, optimizer):
        if getattr(module, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale:
            _patch(module, "multi_tensor_scale_impl", _foreach_scale)
    if getattr(clip_grads, "l2_norm_impl", None) is utils.local_multi_tensor_l2_norm:
        _patch(clip_grads, "l2_norm_impl", _foreach_l2_norm)
    # what calls them, per gradient and through the mode, is replaced too (CPU tensors
    # only; anything else goes to the original)
    _patch(optimizer, "get_grad_norm_fp32", _grad_norm_fp32(clip_grads.get_grad_norm_fp32))
    _patch(
        optimizer,
        "clip_grad_by_total_norm_fp32",
        _clip_grad_by_total_norm_fp32(clip_grads.clip_grad_by_total_norm_fp32),
    )


def _sort_chunks_skipping_identity(original: Any) -> Any:
    import functools

    import torch

    @functools.wraps(original)
    def sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=None, fused=False):  # type: ignore[no-untyped-def]
        idxs = sorted_idxs.tolist() if torch.is_tensor(sorted_idxs) else list(sorted_idxs)
        if idxs == list(range(len(idxs))):  # chunks already in order: the cat is a copy
            return input, probs
        return original(input, split_sizes, sorted_idxs, probs=probs, fused=fused)

    return sort_chunks_by_idxs


def skip_identity_sorts() -> None:
    """Site: the alltoall dispatcher reorders the received tokens by local expert with
    ``sort_chunks_by_idxs`` (a split and a cat of every chunk) also when there is one
    expert-parallel and one expert-TP rank, where the order is the identity; at a tiny
    model's sizes that was 7% of a training step. The same tensors come back, unsorted
    and uncopied, when the indices are in order."""
    from megatron.core.transformer.moe import token_dispatcher

    _patch(
        token_dispatcher,
        "sort_chunks_by_idxs",
        _sort_chunks_skipping_identity(token_dispatcher.sort_chunks_by_idxs),
    )


def _plain_linear(original: Any) -> Any:
    import functools

    import torch.nn.functional as F

    @functools.wraps(original)
    def linear(
        input: Any,  # noqa: A002 (megatron-core's names, passed as keywords)
        weight: Any,
        bias: Any,
        gradient_accumulation_fusion: bool,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
        grad_output_buffer: Any = None,
        wgrad_deferral_limit: Any = 0,
        async_grad_allreduce: Any = None,
        tp_group: Any = None,
    ) -> Any:
        plain = bias is None and grad_output_buffer is None
        if plain and not (gradient_accumulation_fusion or allreduce_dgrad or sequence_parallel):
            return F.linear(input, weight)
        return original(
            input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
            sequence_parallel, grad_output_buffer, wgrad_deferral_limit,
            async_grad_allreduce, tp_group,
        )  # fmt: skip

    return linear


def plain_linears() -> None:
    """Site: ``ColumnParallelLinear`` and ``RowParallelLinear`` compute their local
    product through ``linear_with_grad_accumulation_and_async_allreduce``, a Python
    autograd function (forward ~25 µs, backward ~60 µs of Python per linear at a tiny
    model's sizes, 29 linears a step) also where it does nothing but the product: no
    bias, no gradient all-reduce, no sequence parallelism, no fused weight-gradient
    accumulation, no deferred weight gradients. There torch's own ``F.linear`` (a
    ``matmul`` by the transposed weight, as the function's) runs instead, its backward
    in C++; outputs and gradients are bit for bit the function's
    (tests/dist/test_plain_linears.py). Anything else goes to the original."""
    from megatron.core.tensor_parallel import layers

    name = "linear_with_grad_accumulation_and_async_allreduce"
    _patch(layers, name, _plain_linear(getattr(layers, name)))


def _alone(group: Any) -> bool:
    return group is not None and group.size() == 1


def _skipped_when_alone(original: Any) -> Any:
    import functools

    @functools.wraps(original)
    def mapping(input_: Any, group: Any = None) -> Any:
        return input_ if _alone(group) else original(input_, group)

    return mapping


def _all_to_all_skipped_when_alone(original: Any) -> Any:
    import functools

    @functools.wraps(original)
    def all_to_all(
        group: Any, input_: Any, output_split_sizes_: Any = None, input_split_sizes: Any = None
    ) -> Any:
        if _alone(group):
            return input_
        return original(group, input_, output_split_sizes_, input_split_sizes)

    return all_to_all


def single_rank_mappings() -> None:
    """Site: the linears, the shared experts and the alltoall dispatcher call megatron-
    core's tensor-parallel mappings (copy to / reduce from the region, ``all_to_all``)
    through Python autograd functions also for a group of one rank, where each returns
    its input and its gradient unchanged (``_CopyToModelParallelRegion``,
    ``_ReduceFromModelParallelRegion``, ``_AllToAll``: 27 calls a step on the tiny
    model). With an explicit group of size 1 the input comes back as it is, without the
    function; a larger group, or none given (megatron then looks up its default), goes
    to the original."""
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.moe import shared_experts, token_dispatcher

    for site in (layers, shared_experts):
        for name in (
            "copy_to_tensor_model_parallel_region",
            "reduce_from_tensor_model_parallel_region",
        ):
            if hasattr(site, name):
                _patch(site, name, _skipped_when_alone(getattr(site, name)))
    if hasattr(token_dispatcher, "all_to_all"):
        _patch(
            token_dispatcher,
            "all_to_all",
            _all_to_all_skipped_when_alone(token_dispatcher.all_to_all),
        )


def _group_of_one(group: Any) -> bool:
    """Whether ``group`` (None: torch.distributed's default group, as its collectives
    read it) has one rank, this one. ``_alone`` is the mappings' test, where None means
    megatron-core's own default and goes to the original."""
    import torch.distributed as dist

    return dist.get_world_size(group) == 1


def collectives_alone(all_reduce: Any, broadcast: Any) -> tuple[Any, Any]:
    """``all_reduce`` and ``broadcast`` (torch.distributed's) that return at once, leaving
    the tensor as it is (what the collective gives), when called blocking on a group of
    one rank (``collectives_skipped_when_alone``); every other call goes to them."""
    import functools

    import torch.distributed as dist

    scales = getattr(dist.ReduceOp, "PREMUL_SUM", None)

    @functools.wraps(all_reduce)
    def all_reduce_alone(
        tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
    ) -> Any:
        if not async_op and op != scales and _group_of_one(group):
            return None
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    @functools.wraps(broadcast)
    def broadcast_alone(
        tensor: Any, src: Any = None, group: Any = None, async_op: bool = False, **kwargs: Any
    ) -> Any:
        if not async_op and _group_of_one(group):
            return None
        return broadcast(tensor, src=src, group=group, async_op=async_op, **kwargs)

    return all_reduce_alone, broadcast_alone


def collectives_skipped_when_alone() -> None:
    """Site: ``torch.distributed.all_reduce`` and ``broadcast`` on groups of one rank.
    megatron-core calls them whatever the layout: DDP's gradient all-reduce (over the
    data-parallel group), ``finalize_model_grads``' token count (a broadcast over the
    pipeline group, an all-reduce over data parallelism), the expert-bias update's token
    counts and the gradient norm. On one rank each is the identity, but gloo still hands
    the call to its worker thread and waits for it: ~0.18 ms each, five a step of the
    single-process layout (``finalize_model_grads`` took 1.9 ms of the tiny model's
    ~25 ms train step, 0.97 ms without them). A blocking call on a group of one returns
    at once; an asynchronous one (the caller waits on its handle), any larger group, and
    an all-reduce that scales (``PREMUL_SUM``) go to torch. Inside a coalescing manager
    a skipped call is not recorded, so the manager's end has nothing to run."""
    import torch.distributed as dist

    all_reduce, broadcast = collectives_alone(dist.all_reduce, dist.broadcast)
    _patch(dist, "all_reduce", all_reduce)
    _patch(dist, "broadcast", broadcast)


_ROUTER_ATTRS = ("expert_bias", "reset_global_aux_loss_tracker")


def _router_modules() -> Any:
    """``having(model_chunk, attr)``: the chunk's modules (as megatron-core walks them,
    inside its wrappers) that have ``attr``, in ``modules()`` order; found again whenever
    the chunk's walk is (``moerl.common.module_walk``: its module tree changed)."""
    from megatron.core.utils import get_attr_wrapped_model

    from moerl.common.module_walk import derived

    def find(modules: list[Any]) -> dict[str, list[Any]]:
        return {a: [m for m in modules if hasattr(m, a)] for a in _ROUTER_ATTRS}

    def having(model_chunk: Any, attr: str) -> list[Any]:
        root = get_attr_wrapped_model(model_chunk, "modules").__self__
        return derived(root, "routers", find)[attr]

    return having


def cached_router_walks() -> None:
    """Site: after every backward pass ``finalize_model_grads`` walks all of each chunk's
    modules twice asking ``hasattr(module, 'expert_bias')`` (and the aux-loss tracker's
    reset): a missing attribute goes through ``nn.Module.__getattr__``'s exception, 1.3
    ms of a tiny model's 44 ms step for the few routers among 170 modules. The two
    functions run as megatron-core 0.16 writes them, over the routers found once per
    chunk walk (kept while the chunk's module tree is unchanged, moerl/common/module_walk.py;
    the walk itself was 2.5 ms a step)."""
    import importlib

    import torch

    # the module (the package's name for it is the function it defines)
    site = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    names = ("reset_model_temporary_tensors", "_update_router_expert_bias")
    if not all(hasattr(site, n) for n in names):
        return  # another megatron-core: its own walks run
    having = _router_modules()

    def reset_model_temporary_tensors(config: Any, model: list[Any]) -> None:
        kind = config.moe_router_load_balancing_type
        global_aux = kind == "global_aux_loss" or "global_aux_loss" in kind
        for model_chunk in model:
            if config.moe_router_enable_expert_bias:
                for module in having(model_chunk, "expert_bias"):
                    module.local_tokens_per_expert.zero_()
            if global_aux:
                for module in having(model_chunk, "reset_global_aux_loss_tracker"):
                    module.reset_global_aux_loss_tracker()

    def _update_router_expert_bias(model: list[Any], config: Any) -> None:
        routers = [m for chunk in model for m in having(chunk, "expert_bias")]
        if not routers:
            return
        expert_bias_list = [m.expert_bias for m in routers]
        updated = site.get_updated_expert_bias(
            torch.stack([m.local_tokens_per_expert for m in routers], dim=0),
            torch.stack(expert_bias_list, dim=0),
            config.moe_router_bias_update_rate,
        )
        for expert_bias, new in zip(expert_bias_list, updated):
            expert_bias.copy_(new)

    # neither names a CUDA device: both run without the CPU mode's per-op Python
    _patch(
        site, "reset_model_temporary_tensors", _inside("suspended", reset_model_temporary_tensors)
    )
    _patch(site, "_update_router_expert_bias", _inside("suspended", _update_router_expert_bias))


def install() -> None:
    if _originals:
        return
    fix_missing_te()
    compute_without_mode()
    optimizer_without_mode()
    optimizer_grads_without_mode()
    foreach_grad_norm_and_scale()
    skip_identity_sorts()
    cached_router_walks()
    plain_linears()
    single_rank_mappings()
    collectives_skipped_when_alone()
    from megatron.core.transformer.moe import token_dispatcher

    _patch(token_dispatcher, "maybe_move_tensor_to_cpu", _move_tensor_to_host)
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = _uneven_collectives()
    _patch(mappings, "_gather_along_first_dim", gather)
    _patch(mappings, "_reduce_scatter_along_first_dim", reduce_scatter)


def uninstall() -> None:
    while _originals:
        owner, name, value = _originals.pop()
        setattr(owner, name, value)
