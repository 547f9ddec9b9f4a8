"""The rollout record: one `Trajectory` per sampled completion (docs/architecture.md,
"The Trajectory record").

# P prompt tokens, R response tokens, L hidden layers (all of them, dense ones included),
# K experts per token (top-k), N kept tokens over all response positions (mask nnz)

Arrays are numpy so a trajectory crosses process boundaries and jsonl dumps without torch.
Routed-expert rows follow SGLang's convention: row t holds the experts that routed token t,
for t in [0, P + R - 1); the last sampled token was never fed back, so it has no row.

An episode (docs/architecture.md, "Episodes") is one Trajectory per role: the response is
everything after the role's first observation, the policy's actions and the observations
spliced between them, told apart by `loss_mask` and described by `segments`.
"""

from __future__ import annotations

import base64
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_ROUTED_DTYPES = (np.dtype(np.int16), np.dtype(np.int32))

SOURCES = ("policy", "env", "tool", "agent")
"""Where a segment's tokens came from: sampled by the policy for this role (trained), or
spliced in from the environment, a tool's result or another agent (not trained)."""


@dataclass
class Segment:
    """A run of response positions [start, end) of one episode turn, from one source."""

    start: int
    end: int
    source: str
    """One of SOURCES; 'policy' segments are the trained ones (loss_mask 1)."""
    turn: int
    """0-based index of the episode's action this segment belongs to: an action's own
    tokens, or the observation that answered it (-1: before the role's first action)."""
    reward: float | None = None
    """Reward the environment gave this action ('policy' segments)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "end": self.end,
            "source": self.source,
            "turn": self.turn,
            "reward": self.reward,
        }


def _int32_1d(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.int32).reshape(-1)


def _float32_1d(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).reshape(-1)


@dataclass
class Trajectory:
    """One sampled completion with everything the trainer needs to replay its sampling."""

    prompt_ids: np.ndarray
    """int32 [P]: the prompt tokens sent to the engine."""
    response_ids: np.ndarray
    """int32 [R]: the sampled tokens (EOS / stop token included when it was sampled)."""
    response_logprobs: np.ndarray
    """float32 [R]: engine logprob of each sampled token over the full vocabulary at the
    sampling temperature (SGLang: log_softmax(logits / T), before top-k/top-p)."""
    versions: np.ndarray
    """int32 [R]: policy version that sampled each token; several when a partial rollout
    spans a weight update."""
    sampling_logprobs: np.ndarray | None = None
    """float32 [R]: logprob renormalised over the kept set; present with a sampling mask."""
    routed_experts: np.ndarray | None = None
    """int32 (or int16) [P+R-1, L, K]: logical expert ids per token and layer, in the
    engine's top-k order (compare as sets); dense layers' columns are zeros."""
    mask_ids: np.ndarray | None = None
    """int32 [N]: kept token ids of all response positions, row after row (CSR values)."""
    mask_offsets: np.ndarray | None = None
    """int32 [R+1]: row t of the mask is mask_ids[mask_offsets[t]:mask_offsets[t+1]]."""
    temperature: float = 1.0
    """Sampling temperature the engine applied (greedy requests report 1.0, as SGLang)."""
    finish_reason: str | None = None
    """'stop' | 'length' | 'abort' (partial rollout), None if unknown."""
    reward: float | None = None
    """Scalar reward, filled in after generation."""
    group_id: int | str | None = None
    """Prompt group this completion belongs to (GRPO-style groups share it)."""
    index: int | None = None
    """Position of this completion within its group."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON-safe extras: rid, engine url, weight_versions spans, token counts."""
    loss_mask: np.ndarray | None = None
    """uint8 [R]: 1 where the response token was sampled by the policy for this
    trajectory and is trained, 0 where it was spliced in (an episode's observations);
    None = every response token is trained (a single-turn completion). Spliced positions
    carry logprob 0, the version of the request that prefilled them and a mask row
    holding only their own token."""
    segments: list[Segment] = field(default_factory=list)
    """An episode's turns, in order, covering [0, R); empty for a single completion."""
    role: str | None = None
    """The agent this episode trajectory belongs to (None: a single completion)."""

    def __post_init__(self) -> None:
        self.prompt_ids = _int32_1d(self.prompt_ids)
        self.response_ids = _int32_1d(self.response_ids)
        self.response_logprobs = _float32_1d(self.response_logprobs)
        self.versions = _int32_1d(self.versions)
        if self.sampling_logprobs is not None:
            self.sampling_logprobs = _float32_1d(self.sampling_logprobs)
        if self.routed_experts is not None:
            routed = np.asarray(self.routed_experts)
            if routed.dtype not in _ROUTED_DTYPES:
                routed = routed.astype(np.int32)
            self.routed_experts = routed
        if self.mask_ids is not None:
            self.mask_ids = _int32_1d(self.mask_ids)
        if self.mask_offsets is not None:
            self.mask_offsets = _int32_1d(self.mask_offsets)
        self.temperature = float(self.temperature)
        if self.loss_mask is not None:
            self.loss_mask = np.asarray(self.loss_mask, dtype=np.uint8).reshape(-1)
        self.segments = [s if isinstance(s, Segment) else Segment(**s) for s in self.segments]

    # ---- shape helpers -------------------------------------------------------------------

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def response_len(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def trained(self) -> np.ndarray:
        """bool [R]: the response positions the trainer trains on."""
        if self.loss_mask is None:
            return np.ones(self.response_len, dtype=bool)
        return self.loss_mask.astype(bool)

    @property
    def actions(self) -> list[Segment]:
        """An episode's actions: its 'policy' segments, in order ([] for a completion)."""
        return [s for s in self.segments if s.source == "policy"]

    @property
    def num_trained(self) -> int:
        return self.response_len if self.loss_mask is None else int(self.loss_mask.sum())

    @property
    def has_sampling_mask(self) -> bool:
        return self.mask_ids is not None

    def mask_row(self, t: int) -> np.ndarray:
        """Kept token ids at response position t."""
        if self.mask_ids is None or self.mask_offsets is None:
            raise ValueError(f"{self.name()} has no sampling mask")
        return self.mask_ids[self.mask_offsets[t] : self.mask_offsets[t + 1]]

    def name(self) -> str:
        """How errors refer to this trajectory."""
        rid = self.meta.get("rid")
        extra = f", rid={rid}" if rid is not None else ""
        return f"trajectory(group_id={self.group_id!r}, index={self.index!r}{extra})"

    # ---- validation ----------------------------------------------------------------------

    def validate(
        self,
        num_layers: int | None = None,
        topk: int | None = None,
        num_experts: int | None = None,
    ) -> Trajectory:
        """Check shapes and ranges; raise ValueError naming the trajectory and the problem.

        num_layers / topk / num_experts are the model's num_hidden_layers, experts per token
        and routed experts; each check runs only when its number is given. Returns self.
        """
        problems = self._problems(num_layers, topk, num_experts)
        if problems:
            raise ValueError(f"{self.name()} is invalid: " + "; ".join(problems))
        return self

    def _problems(
        self, num_layers: int | None, topk: int | None, num_experts: int | None
    ) -> list[str]:
        P, R = self.prompt_len, self.response_len
        problems: list[str] = []
        if P == 0:
            problems.append("prompt_ids is empty")
        for fname in ("response_logprobs", "versions", "sampling_logprobs"):
            arr = getattr(self, fname)
            if arr is not None and arr.shape[0] != R:
                problems.append(
                    f"{fname} has {arr.shape[0]} entries but response_ids has {R} tokens"
                )
        if np.isnan(self.response_logprobs).any():
            problems.append("response_logprobs contains NaN")
        if not math.isfinite(self.temperature) or self.temperature <= 0:
            problems.append(f"temperature={self.temperature} must be a positive number")
        problems += self._routing_problems(P, R, num_layers, topk, num_experts)
        problems += self._mask_problems(R)
        problems += self._episode_problems(R)
        return problems

    def _episode_problems(self, R: int) -> list[str]:
        problems = []
        mask = self.loss_mask
        if mask is not None:
            if mask.shape[0] != R:
                problems.append(f"loss_mask has {mask.shape[0]} entries but response_ids has {R}")
            elif (mask > 1).any():
                problems.append("loss_mask must hold only 0 and 1")
        if not self.segments:
            return problems
        edge = 0
        for seg in self.segments:
            if seg.source not in SOURCES:
                problems.append(f"segment source {seg.source!r} is not one of {SOURCES}")
            if seg.start != edge or seg.end <= seg.start:
                problems.append(
                    f"segments must tile the response in order; got [{seg.start}, {seg.end}) "
                    f"after position {edge}"
                )
                return problems
            edge = seg.end
        if edge != R:
            problems.append(f"segments end at {edge} but the response has {R} tokens")
        elif mask is not None and mask.shape[0] == R:
            for seg in self.segments:
                trained = seg.source == "policy"
                if (mask[seg.start : seg.end] != int(trained)).any():
                    problems.append(
                        f"loss_mask disagrees with the {seg.source} segment "
                        f"[{seg.start}, {seg.end}) (policy tokens are 1, the rest 0)"
                    )
                    break
        return problems

    def _routing_problems(
        self,
        P: int,
        R: int,
        num_layers: int | None,
        topk: int | None,
        num_experts: int | None,
    ) -> list[str]:
        routes_TLK = self.routed_experts
        if routes_TLK is None:
            return []
        if routes_TLK.ndim != 3:
            return [f"routed_experts must be 3-D [P+R-1, L, K], got shape {routes_TLK.shape}"]
        problems = []
        rows, layers, k = routes_TLK.shape
        if rows != max(P + R - 1, 0):
            problems.append(
                f"routed_experts has {rows} rows but prompt ({P}) + response ({R}) - 1 = "
                f"{P + R - 1} tokens were routed"
            )
        if num_layers is not None and layers != num_layers:
            problems.append(
                f"routed_experts has {layers} layers but the model has num_layers={num_layers}"
            )
        if topk is not None and k != topk:
            problems.append(f"routed_experts has top-k {k} but the model routes topk={topk}")
        if routes_TLK.size:
            lo, hi = int(routes_TLK.min()), int(routes_TLK.max())
            if lo < 0:
                problems.append(f"routed_experts holds a negative expert id ({lo})")
            if num_experts is not None and hi >= num_experts:
                problems.append(
                    f"routed_experts holds expert id {hi}, out of range for "
                    f"num_experts={num_experts}"
                )
        return problems

    def _mask_problems(self, R: int) -> list[str]:
        ids, offsets = self.mask_ids, self.mask_offsets
        if ids is None and offsets is None:
            if self.sampling_logprobs is not None:
                return ["sampling_logprobs is set without a sampling mask"]
            return []
        if ids is None or offsets is None:
            return ["mask_ids and mask_offsets must be set together"]
        if offsets.shape[0] != R + 1:
            return [
                f"mask_offsets has {offsets.shape[0]} entries, expected response length + 1 = {R + 1}"
            ]
        if offsets[0] != 0 or offsets[-1] != ids.shape[0] or (np.diff(offsets) < 0).any():
            return [
                f"mask_offsets must rise from 0 to len(mask_ids)={ids.shape[0]}, "
                f"got first={int(offsets[0])} last={int(offsets[-1])}"
            ]
        if R == 0:
            return []
        row_of_N = np.repeat(np.arange(R), np.diff(offsets))
        hit_N = ids == self.response_ids[row_of_N]
        sampled_kept_R = np.bincount(row_of_N[hit_N], minlength=R) > 0
        if not sampled_kept_R.all():
            t = int(np.flatnonzero(~sampled_kept_R)[0])
            return [
                f"sampled token {int(self.response_ids[t])} at response position {t} is not "
                f"in its sampling mask row"
            ]
        return []

    # ---- serialization -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict. Token arrays become lists; routed_experts (large) becomes
        {"dtype", "shape", "b64"} with base64 of the C-order little-endian bytes."""
        d: dict[str, Any] = {
            "prompt_ids": self.prompt_ids.tolist(),
            "response_ids": self.response_ids.tolist(),
            "response_logprobs": self.response_logprobs.tolist(),
            "versions": self.versions.tolist(),
            "sampling_logprobs": _opt_list(self.sampling_logprobs),
            "routed_experts": None,
            "mask_ids": _opt_list(self.mask_ids),
            "mask_offsets": _opt_list(self.mask_offsets),
            "temperature": self.temperature,
            "finish_reason": self.finish_reason,
            "reward": None if self.reward is None else float(self.reward),
            "group_id": self.group_id,
            "index": self.index,
            "meta": self.meta,
        }
        if self.loss_mask is not None:
            d["loss_mask"] = self.loss_mask.tolist()
        if self.segments:
            d["segments"] = [seg.to_dict() for seg in self.segments]
        if self.role is not None:
            d["role"] = self.role
        if self.routed_experts is not None:
            routes = np.ascontiguousarray(self.routed_experts)
            little = routes.astype(routes.dtype.newbyteorder("<"), copy=False)
            d["routed_experts"] = {
                "dtype": routes.dtype.name,
                "shape": list(routes.shape),
                "b64": base64.b64encode(little.tobytes()).decode("ascii"),
            }
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        """Inverse of to_dict."""
        routed = d.get("routed_experts")
        routes = None
        if routed is not None:
            dtype = np.dtype(routed["dtype"]).newbyteorder("<")
            raw = np.frombuffer(base64.b64decode(routed["b64"]), dtype=dtype)
            routes = raw.reshape(routed["shape"]).astype(dtype.newbyteorder("="))
        return cls(
            prompt_ids=d["prompt_ids"],
            response_ids=d["response_ids"],
            response_logprobs=d["response_logprobs"],
            versions=d["versions"],
            sampling_logprobs=d.get("sampling_logprobs"),
            routed_experts=routes,
            mask_ids=d.get("mask_ids"),
            mask_offsets=d.get("mask_offsets"),
            temperature=d.get("temperature", 1.0),
            finish_reason=d.get("finish_reason"),
            reward=d.get("reward"),
            group_id=d.get("group_id"),
            index=d.get("index"),
            meta=dict(d.get("meta") or {}),
            loss_mask=d.get("loss_mask"),
            segments=[Segment(**seg) for seg in d.get("segments") or []],
            role=d.get("role"),
        )


def _opt_list(arr: np.ndarray | None) -> list | None:
    return None if arr is None else arr.tolist()


def save_jsonl(
    path: str | os.PathLike[str], trajectories: Iterable[Trajectory], append: bool = False
) -> int:
    """Write one trajectory per line; returns how many were written."""
    count = 0
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for traj in trajectories:
            f.write(json.dumps(traj.to_dict(), separators=(",", ":")))
            f.write("\n")
            count += 1
    return count


def load_jsonl(path: str | os.PathLike[str]) -> list[Trajectory]:
    """Read a file written by save_jsonl (blank lines are skipped)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                out.append(Trajectory.from_dict(json.loads(line)))
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a trajectory record ({e})") from e
    return out
