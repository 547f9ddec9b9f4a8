"""Replay policies defined outside moerl, selected by ``_target_`` in
tests/dist/test_replay.py (no moerl edits: the extension point as a user has it)."""

from __future__ import annotations

import torch

from moerl.algo.replay import ReplayInput, ReplayOutput


def recorded(inp: ReplayInput) -> ReplayOutput:
    """The engine's routes for every token: must route as the built-in 'all'."""
    return ReplayOutput(inp.recorded_TK.clone())


def own_router(inp: ReplayInput) -> ReplayOutput:
    """The live router's own choice: must route as 'none' (the plain router)."""
    return ReplayOutput(inp.fresh_TK.clone())


def small_margin(inp: ReplayInput, threshold: float) -> ReplayOutput:
    """Replay where the live router is unsure (its k-th and (k+1)-th scores closer than
    ``threshold``), route freshly elsewhere (the module docstring's example in
    moerl/algo/replay.py)."""
    k = inp.recorded_TK.shape[1]
    top_TK1 = inp.scores_TE.topk(k + 1, dim=-1).values
    close_T = (top_TK1[:, k - 1] - top_TK1[:, k]) < threshold
    routes = torch.where(close_T[:, None], inp.recorded_TK, inp.fresh_TK)
    # its own numbers, logged as replay/<key> (averaged over the step's calls)
    return ReplayOutput(routes, metrics={"replayed_frac": close_T.float().mean().item(),
                                         "layer": float(inp.layer)})  # fmt: skip
