"""Per-sequence reductions on flat token tensors, and the loss aggregation modes.

# T tokens in the batch, S sequences (or groups: any segmentation given by ids 0..S-1)

Every function works on a packed batch: `seq_ids_T` says which sequence each token belongs
to and `mask_T` which tokens count. Masked-out values are replaced, not multiplied, so an
inf or nan in a token that does not count never reaches a sum.
"""

from __future__ import annotations

import torch

from moerl.algo.config import AGG_MODES
from moerl.common.checks import choice_error


def segment_sum(values_T: torch.Tensor, seq_ids_T: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Sum of `values_T` per sequence: [S]."""
    out_S = torch.zeros(num_seqs, dtype=values_T.dtype, device=values_T.device)
    return out_S.index_add(0, seq_ids_T, values_T)


def segment_count(mask_T: torch.Tensor, seq_ids_T: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Number of counted tokens per sequence, as float: [S]."""
    return segment_sum(mask_T.to(torch.float32), seq_ids_T, num_seqs)


def segment_mean(
    values_T: torch.Tensor, mask_T: torch.Tensor, seq_ids_T: torch.Tensor, num_seqs: int
) -> torch.Tensor:
    """Mean of the counted values per sequence: [S]; 0 for a sequence with none counted."""
    sums_S = segment_sum(masked(values_T, mask_T), seq_ids_T, num_seqs)
    counts_S = segment_count(mask_T, seq_ids_T, num_seqs).to(sums_S.dtype)
    return sums_S / counts_S.clamp(min=1)


def masked(values_T: torch.Tensor, mask_T: torch.Tensor) -> torch.Tensor:
    """`values_T` with the tokens that do not count set to 0."""
    return torch.where(mask_T, values_T, torch.zeros_like(values_T))


def masked_mean(values_T: torch.Tensor, mask_T: torch.Tensor) -> torch.Tensor:
    """Mean over the counted tokens; 0 when none counts."""
    total = masked(values_T, mask_T).sum()
    return total / mask_T.sum().clamp(min=1).to(total.dtype)


def masked_max(values_T: torch.Tensor, mask_T: torch.Tensor) -> torch.Tensor:
    """Max over the counted tokens; 0 when none counts."""
    if values_T.numel() == 0:
        return values_T.new_zeros(())
    low = torch.finfo(values_T.dtype).min
    top = torch.where(mask_T, values_T, torch.full_like(values_T, low)).max()
    return torch.where(mask_T.any(), top, torch.zeros_like(top))


def aggregate(
    values_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    seq_ids_T: torch.Tensor,
    num_seqs: int,
    mode: str,
    *,
    norm_length: int | None = None,
) -> torch.Tensor:
    """Reduce per-token losses to one scalar.

    token_mean               sum over counted tokens / number of counted tokens (DAPO)
    seq_mean_token_mean      each sequence's mean over its counted tokens, averaged over
                             num_seqs sequences (GRPO, GSPO)
    seq_mean_token_sum       each sequence's sum, averaged over num_seqs sequences
    seq_mean_token_sum_norm  sum over counted tokens / (num_seqs · norm_length): Dr. GRPO's
                             constant normaliser (Liu et al. 2025, arXiv 2503.20783),
                             norm_length = L_max the generation budget; verl's
                             'seq-mean-token-sum-norm' with loss_scale_factor = L_max, here
                             also divided by num_seqs

    The sequence modes divide by `num_seqs`, counting sequences with no counted token
    (e.g. dropped by a sequence-level correction) as 0, so the scale of the update does
    not depend on how many sequences a correction dropped. They are linear in the
    sequences: aggregate over a micro-batch times its num_seqs, summed over micro-batches,
    divided by the step's sequences, is the aggregate over the step.
    """
    if mode == "token_mean":
        return masked_mean(values_T, loss_mask_T)
    if mode == "seq_mean_token_mean":
        return segment_mean(values_T, loss_mask_T, seq_ids_T, num_seqs).sum() / max(num_seqs, 1)
    if mode == "seq_mean_token_sum":
        sums_S = segment_sum(masked(values_T, loss_mask_T), seq_ids_T, num_seqs)
        return sums_S.sum() / max(num_seqs, 1)
    if mode == "seq_mean_token_sum_norm":
        if norm_length is None or norm_length <= 0:
            raise ValueError(
                f"aggregation mode {mode!r} needs norm_length > 0 (L_max), got {norm_length!r}"
            )
        return masked(values_T, loss_mask_T).sum() / (max(num_seqs, 1) * norm_length)
    raise choice_error("aggregation mode", mode, AGG_MODES)


def to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """Scalar tensors → python floats with one device sync for the whole dict."""
    if not metrics:
        return {}
    values = torch.stack([m.detach().reshape(()).to(torch.float64) for m in metrics.values()])
    return dict(zip(metrics, values.cpu().tolist()))


def check_tokens(where: str, num_seqs: int, **tensors: torch.Tensor | None) -> None:
    """Every given tensor is 1-D with the same length; ValueError naming the odd one out."""
    if num_seqs < 0:
        raise ValueError(f"{where}: num_seqs={num_seqs} must be >= 0")
    length = None
    for name, t in tensors.items():
        if t is None:
            continue
        if t.dim() != 1:
            raise ValueError(f"{where}: {name} must be 1-D [T], got shape {tuple(t.shape)}")
        if length is None:
            length = (name, t.shape[0])
        elif t.shape[0] != length[1]:
            raise ValueError(
                f"{where}: {name} has {t.shape[0]} tokens but {length[0]} has {length[1]}"
            )
