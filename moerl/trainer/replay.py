"""Keep Routing: feed megatron-core's RouterReplay with the engine's recorded routes.

For each MoE layer built in this process (dense layers have no router), the router's
``RouterReplay`` gets a ``[local_tokens, K]`` int64 target per micro-batch, taken from
the SGLang rows: the micro-batch's [B, S, L, K] routes are put in the router's token
order (sequence-major, [S, B]), cut to this rank's sequence-parallel slice, and the
layer's column is picked by global layer number − 1. Each target must be consumed by
exactly one router forward; ``finish()`` checks that and clears everything. Under
activation recompute (``trainer.recompute``), the router runs again inside backward;
there it replays the routes its micro-batch's forward used (megatron's REPLAY_BACKWARD
case, detected as a forward running inside an autograd graph task).

Which routes a token uses is a replay policy's choice (``moerl.algo.replay``: ``all``,
``recent``, ``none`` built in, a user's own by ``_target_``); it sees the recorded
routes, per-token versions and the live router's scores and top-k. ``none`` is the
plain router: no targets are set at all.
"""

# B sequences, S padded length, L layers, K top-k, T local router tokens

from __future__ import annotations

from typing import Any

import torch

from moerl.algo.replay import ReplayInput, build_replay_policy, is_all, is_none
from moerl.kernels.replay_gather import replay_gather


class RoutingReplay:
    def __init__(self, chunks: list[Any], policy: Any = "all", recent_window: int = 0) -> None:
        """policy: ``trainer.replay`` (a name, options or a ``_target_`` mapping)."""
        self.off = is_none(policy)
        # the built-in 'all' needs no live routing: it is applied without a call
        self.choose = (
            None if self.off or is_all(policy) else build_replay_policy(policy, recent_window)
        )
        self.layers: list[dict[int, Any]] = []  # per chunk: global layer number → RouterReplay
        self.topk = 0
        # the policy's ReplayOutput.metrics this step: key -> [sum, calls]
        self.policy_metrics: dict[str, list[float]] = {}
        for chunk in chunks:
            module = getattr(chunk, "module", chunk)
            found = {}
            for layer in module.decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is None:
                    continue
                if router.router_replay is None:
                    raise ValueError(
                        "routing replay needs moe_enable_routing_replay=True in the model config"
                    )
                found[layer.layer_number] = router.router_replay
                self.topk = router.topk
                self._instrument(router.router_replay)
                router.router_replay.moerl_metrics = self.policy_metrics
            self.layers.append(found)
        self.config = getattr(chunks[0], "module", chunks[0]).config
        self.modules = [getattr(c, "module", c) for c in chunks]

    @staticmethod
    def _instrument(inst: Any) -> None:
        if getattr(inst, "_moerl_wrapped", False):
            return
        original = inst.get_replay_topk

        def get_replay_topk(
            scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
        ):  # type: ignore[no-untyped-def]
            from megatron.core.transformer.moe.router_replay import RouterReplayAction

            if inst.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
                return original(scores, topk, num_groups, group_topk, default_compute_topk)
            if torch._C._current_graph_task_id() != -1:
                # a forward inside backward is activation recompute (megatron's
                # REPLAY_BACKWARD case): reuse the routes this micro-batch's forward used,
                # in forward order (megatron's schedules run backwards FIFO per chunk)
                if not inst.moerl_backward:
                    raise RuntimeError(
                        "activation recompute asked for routes that no forward recorded"
                    )
                target = inst.moerl_backward.pop(0).to(scores.device)
                inst.moerl_recomputed += 1
                return replay_gather(scores, target, normalize=False), target
            inst.moerl_consumed += 1
            target = inst.target_topk_idx.to(scores.device)
            if target.shape != (scores.shape[0], topk):
                raise ValueError(
                    f"replay target {tuple(target.shape)} does not match router tokens {(scores.shape[0], topk)}"
                )
            choose = inst.moerl_choose
            if choose is not None:  # a policy other than 'all' decides per token
                _, fresh = default_compute_topk(scores, topk, num_groups, group_topk)
                versions = inst.moerl_versions
                out = choose(
                    ReplayInput(
                        recorded_TK=target,
                        current_version=inst.moerl_current_version,
                        versions_T=None if versions is None else versions.to(scores.device),
                        scores_TE=scores,
                        fresh_TK=fresh,
                        layer=inst.moerl_layer,
                    )  # fmt: skip
                )
                target = _checked(out.routes_TK, target.shape, scores.shape[-1])
                for key, value in (getattr(out, "metrics", None) or {}).items():
                    total = inst.moerl_metrics.setdefault(str(key), [0.0, 0])
                    total[0] += float(value)
                    total[1] += 1
            inst.moerl_used = target  # what the router actually used (for flip counting)
            if inst.moerl_recompute:
                inst.moerl_backward.append(target)
            return replay_gather(scores, target, normalize=False), target

        inst.get_replay_topk = get_replay_topk
        inst.moerl_consumed = 0
        inst.moerl_expected = 0
        inst.moerl_choose = None
        inst.moerl_versions = None
        inst.moerl_current_version = 0
        inst.moerl_layer = 0
        inst.moerl_used = None
        inst.moerl_recompute = False  # this forward's activations will be recomputed
        inst.moerl_backward = []  # routes used by forwards, awaiting their recompute
        inst.moerl_recomputed = 0
        inst._moerl_wrapped = True

    def _local(self, x_BS: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] → the router's token order [S_local·B, ...] on this rank."""
        x_SB = x_BS.transpose(0, 1)
        if self.config.sequence_parallel:
            from megatron.core import parallel_state

            size = parallel_state.get_tensor_model_parallel_world_size()
            rank = parallel_state.get_tensor_model_parallel_rank()
            per = x_SB.shape[0] // size
            x_SB = x_SB[rank * per : (rank + 1) * per]
        return x_SB.reshape(-1, *x_SB.shape[2:])

    def set_microbatch(
        self,
        chunk: int,
        routes_BSLK: torch.Tensor | None,
        versions_BS: torch.Tensor | None = None,
        current_version: int = 0,
    ) -> None:
        """Targets for the next forward of model chunk ``chunk``."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        layers = self.layers[chunk]
        if self.off or not layers:
            for inst in layers.values():
                inst.clear_router_replay_action()
            return
        if routes_BSLK is None:
            raise ValueError("routing replay is on but the micro-batch has no routes")
        if routes_BSLK.shape[-1] != self.topk:
            raise ValueError(
                f"routes have top-k {routes_BSLK.shape[-1]}, the model routes to {self.topk}"
            )
        local = self._local(routes_BSLK.long())
        versions = None if versions_BS is None else self._local(versions_BS)
        # activation recompute re-runs the router in backward: it must see the same routes
        recompute = self.config.recompute_granularity is not None and self.modules[chunk].training
        for number, inst in layers.items():
            inst.set_target_indices(local[:, number - 1].contiguous())
            inst.moerl_choose, inst.moerl_layer = self.choose, number
            inst.moerl_versions, inst.moerl_current_version = versions, current_version
            inst.moerl_recompute = recompute
            inst.moerl_expected += 1
            inst.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def metrics(self) -> dict[str, float]:
        """``replay/<key>``: each of the policy's metrics averaged over its calls on every
        rank (collective over the world, once per step); cleared for the next step."""
        import torch.distributed as dist

        if self.choose is None:  # 'all' or 'none' (the same on every rank): nothing to say
            return {}
        mine = dict(self.policy_metrics)
        self.policy_metrics.clear()
        parts = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            parts = [{} for _ in range(dist.get_world_size())]
            dist.all_gather_object(parts, mine)
        total: dict[str, list[float]] = {}
        for part in parts:
            for key, (value, calls) in part.items():
                acc = total.setdefault(key, [0.0, 0])
                acc[0] += value
                acc[1] += calls
        return {f"replay/{k}": v / n for k, (v, n) in total.items() if n}

    def finish(self) -> None:
        """Check every target was consumed exactly once, then clear all replay state
        (targets, recorded indices and actions; for every policy, 'none' included)."""
        bad = []
        for chunk in self.layers:
            for number, inst in chunk.items():
                if inst.moerl_expected != inst.moerl_consumed:
                    bad.append(
                        f"layer {number}: {inst.moerl_expected} targets, {inst.moerl_consumed} uses"
                    )
                if inst.moerl_recomputed and inst.moerl_backward:
                    bad.append(
                        f"layer {number}: {len(inst.moerl_backward)} forwards never recomputed"
                    )
                inst.moerl_expected = inst.moerl_consumed = inst.moerl_recomputed = 0
                inst.moerl_backward = []
                inst.moerl_recompute = False
                inst.moerl_choose = inst.moerl_versions = None
                inst.clear_indices()
                inst.clear_router_replay_action()
        if bad:
            raise RuntimeError(
                "routing replay targets were not consumed exactly once: " + "; ".join(bad)
            )


def _checked(routes_TK: Any, shape: tuple[int, ...], num_experts: int) -> torch.Tensor:
    """A replay policy's routes, checked: [T, K] integer expert ids in range."""
    if not isinstance(routes_TK, torch.Tensor):
        raise TypeError(
            f"trainer.replay's policy returned routes of type {type(routes_TK).__name__}; "
            "return ReplayOutput(routes_TK=<int64 tensor [T, K]>)"
        )
    if tuple(routes_TK.shape) != tuple(shape) or routes_TK.dtype.is_floating_point:
        raise ValueError(
            f"trainer.replay's policy returned routes {tuple(routes_TK.shape)} "
            f"{routes_TK.dtype}; the router needs integer expert ids of shape {tuple(shape)}"
        )
    if routes_TK.numel() and (int(routes_TK.min()) < 0 or int(routes_TK.max()) >= num_experts):
        raise ValueError(f"trainer.replay's policy returned expert ids outside [0, {num_experts})")
    return routes_TK.long()
