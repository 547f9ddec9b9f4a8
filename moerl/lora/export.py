"""Adapters out of and back into any TP/PP/EP layout, under PEFT/SGLang names.

``gather_adapters`` is a collective over the whole world: each rank sends only the
adapter slices it owns (data-parallel rank 0 of its group; for a TP-replicated
tensor, TP rank 0 of the base layer's group), and rank 0 writes them into full
tensors named ``base_model.model.<HF module>.lora_{A,B}.weight``, routed experts by
their global index (``…mlp.experts.{i}.gate_proj…``). Adapters are small (rank × the
layer widths), so one gather of the pieces is cheaper than a per-tensor schedule.
``load_adapters_into`` is the inverse: every rank takes its slices of full tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moerl.config.model import ModelConfig
from moerl.lora.apply import adapters
from moerl.lora.layers import LoraAdapter

PEFT_PREFIX = "base_model.model."


def peft_name(hf_module: str, which: str) -> str:
    """The PEFT tensor name of a module's A or B."""
    return f"{PEFT_PREFIX}{hf_module}.lora_{which}.weight"


def _dp_rank(expert: bool) -> int:
    if not dist.is_initialized():
        return 0
    from megatron.core import parallel_state

    if expert:
        return parallel_state.get_expert_data_parallel_rank()
    return parallel_state.get_data_parallel_rank()


def _value(param: torch.nn.Parameter, grads: bool) -> torch.Tensor:
    if not grads:
        return param.detach()
    grad = getattr(param, "main_grad", None)
    if grad is None:
        grad = param.grad
    return torch.zeros_like(param) if grad is None else grad.detach().view_as(param)


def _pieces(chunks: list[torch.nn.Module], grads: bool) -> list[tuple]:
    """(name, full shape, split dim, tp rank, tp size, cpu data) this rank owns."""
    out = []
    for adapter in adapters(chunks):
        expert = not getattr(adapter.lora_A[0], "allreduce", True)
        if _dp_rank(expert) != 0:
            continue
        for part, hf_module in adapter.active_parts():
            a, b = adapter.pair(part)
            full_shapes = {
                "A": (adapter.rank, adapter.in_size),
                "B": (adapter.out_sizes[part], adapter.rank),
            }
            for which, param in (("A", a), ("B", b)):
                dim = adapter.split_dim(which) if adapter.tp > 1 else None
                if dim is None and adapter.tp_rank != 0:
                    continue  # replicated over TP: rank 0 of the group sends it
                data = _value(param, grads).cpu().clone()
                name = peft_name(hf_module, which)
                out.append((name, full_shapes[which], dim, adapter.tp_rank, adapter.tp, data))
    return out


def _check_experts(names: list[str], model: ModelConfig) -> None:
    seen: dict[str, set[int]] = {}
    for name in names:
        head, sep, tail = name.partition(".mlp.experts.")
        if sep:  # a routed expert (shared experts are "mlp.shared_experts.")
            index, rest = tail.split(".", 1)
            seen.setdefault(head + "|" + rest, set()).add(int(index))
    for key, experts in sorted(seen.items()):
        if len(experts) != model.num_experts:
            missing = sorted(set(range(model.num_experts or 0)) - experts)
            raise RuntimeError(f"adapter {key.replace('|', ' … ')} lacks experts {missing}")


def gather_adapters(
    chunks: list[torch.nn.Module], model: ModelConfig, *, grads: bool = False, dst: int = 0
) -> dict[str, torch.Tensor]:
    """Full adapters (or their gradients, ``grads=True``) under PEFT names on rank
    ``dst``; an empty dict on the other ranks. Every rank must call it."""
    pieces = _pieces(chunks, grads)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        everything: list | None = [None] * world if dist.get_rank() == dst else None
        dist.gather_object(pieces, everything, dst=dst)
        if dist.get_rank() != dst:
            return {}
        pieces = [p for rank_pieces in everything for p in rank_pieces]  # type: ignore[union-attr]
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, set[int]] = {}
    sizes: dict[str, int] = {}
    for name, shape, dim, tp_rank, tp, data in pieces:
        if name not in full:
            full[name] = torch.zeros(shape, dtype=data.dtype)
            sizes[name] = 1 if dim is None else tp
        if dim is None:
            full[name].copy_(data)
        else:
            torch.chunk(full[name], tp, dim=dim)[tp_rank].copy_(data)
        covered.setdefault(name, set()).add(0 if dim is None else tp_rank)
    partial = sorted(n for n in full if len(covered[n]) != sizes[n])
    if partial:
        raise RuntimeError(f"adapter slices missing from the gather: {partial[:5]}")
    _check_experts(list(full), model)
    return dict(sorted(full.items()))


def _plan(adapter: LoraAdapter, part: int, hf_module: str, tensors: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    a_name, b_name = peft_name(hf_module, "A"), peft_name(hf_module, "B")
    missing = [n for n in (a_name, b_name) if n not in tensors]
    if missing:
        return missing, None
    a, b = tensors[a_name], tensors[b_name]
    want_a = (adapter.rank, adapter.in_size)
    want_b = (adapter.out_sizes[part], adapter.rank)
    if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
        return [
            f"{hf_module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the "
            f"model's adapter (A {want_a}, B {want_b}); was it trained with another rank?"
        ], None
    return [], (adapter, part, a, b)


def _anywhere(flag: bool) -> bool:
    """Whether any rank raised ``flag`` (every rank must call)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def load_adapters_into(chunks: list[torch.nn.Module], tensors: dict[str, torch.Tensor]) -> int:
    """Write this rank's slices of full PEFT-named adapters into the model (every rank
    passes the full dict; a collective). Everything is checked on every rank before
    anything is written: a tensor missing or misshapen for any rank raises KeyError /
    ValueError on all ranks and leaves the adapters as they were. Returns the number
    of (A, B) pairs set on this rank."""
    plans, missing, misshapen = [], [], []
    for adapter in adapters(chunks):
        for part, hf_module in adapter.active_parts():
            problems, plan = _plan(adapter, part, hf_module, tensors)
            if plan is not None:
                plans.append(plan)
            elif problems[0].startswith(PEFT_PREFIX):
                missing += problems
            else:
                misshapen += problems
    bad_here = bool(missing or misshapen)
    if _anywhere(bad_here):
        if misshapen:
            raise ValueError("; ".join(misshapen[:3]))
        if missing:
            raise KeyError(
                f"the adapter lacks {len(missing)} tensors the model needs: {missing[:5]}"
            )
        raise KeyError("the adapter lacks tensors that another rank's part of the model needs")
    for adapter, part, a, b in plans:
        adapter.set_full(part, a, b)
    return len(plans)
