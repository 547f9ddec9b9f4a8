"""moerl/trainer/numerics.py: what the matching numerics refuse, and its token logprobs
against the engine's sampler (moerl/engine/core/sampling.py) run in the engine's
batch-invariant mode: the same bits for the full-vocabulary logprob and the kept-set
one, on both of the sampler's paths (one row at a time and batched)."""

from __future__ import annotations

import pytest
import torch

from moerl.engine.core.sampling import SamplingParams, sample, sample_batch
from moerl.kernels import batch_invariant as bi
from moerl.trainer import numerics


def test_check_names_the_key_and_the_fix():
    numerics.check("default", tp=4, etp=4, dtype="bf16", cp=2)  # anything goes
    numerics.check("batch_invariant", tp=1, etp=1, dtype="fp32")
    numerics.check("batch_invariant", tp=2, etp=2, dtype="fp32")
    with pytest.raises(ValueError, match=r"parallel\.tp=4, parallel\.etp=4.*must divide 2"):
        numerics.check("batch_invariant", tp=4, etp=4, dtype="fp32")
    with pytest.raises(ValueError, match=r"parallel\.cp=2.*parallel\.cp=1"):
        numerics.check("batch_invariant", tp=1, etp=1, dtype="fp32", cp=2)
    numerics.check("batch_invariant", tp=1, etp=1, dtype="bf16", family="qwen3_moe")
    with pytest.raises(ValueError, match=r"trainer\.dtype='fp16'.*fp32 or bf16"):
        numerics.check("batch_invariant", tp=1, etp=1, dtype="fp16")
    with pytest.raises(ValueError, match=r"model\.family='mylab'.*ROUTER_DTYPE"):
        numerics.check("batch_invariant", tp=1, etp=1, dtype="bf16", family="mylab")
    with pytest.raises(ValueError, match=r"trainer\.numerics='exact'.*'batch_invariant'"):
        numerics.check("exact", tp=1, etp=1, dtype="fp32")


@pytest.mark.parametrize("batched", [True, False])
def test_token_logprobs_are_the_engine_samplers(batched):
    g = torch.Generator().manual_seed(0)
    logits_BV = torch.randn(6, 300, generator=g) * 3
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=1)
    if batched:  # as the engine's scheduler draws a batch: the invariant softmaxes directly
        drawn = sample_batch(logits_BV, params, torch.Generator().manual_seed(1), [True] * 6,
                             invariant=True)  # fmt: skip
        with bi.BatchInvariant():  # the same bits as through the mode's rerouting
            moded = sample_batch(logits_BV, params, torch.Generator().manual_seed(1), [True] * 6)
        assert [(d.token, d.logprob, d.sampling_logprob, d.mask) for d in drawn] == [
            (d.token, d.logprob, d.sampling_logprob, d.mask) for d in moded
        ]
    else:
        with bi.BatchInvariant():  # a request sampled alone runs in the mode
            drawn = [sample(row, params, torch.Generator().manual_seed(1)) for row in logits_BV]
    tokens = torch.tensor([d.token for d in drawn])
    pos = torch.cat([torch.full((len(d.mask),), b) for b, d in enumerate(drawn)])
    ids = torch.cat([torch.tensor(d.mask) for d in drawn])
    assert len(ids) < 6 * 300  # top-p dropped ids
    logits = logits_BV.clone().requires_grad_()
    full = numerics.token_logprobs(logits, tokens, 0.7)
    kept = numerics.token_logprobs(logits, tokens, 0.7, mask_pos_N=pos, mask_ids_N=ids)
    assert full.tolist() == [d.logprob for d in drawn]
    assert kept.tolist() == [d.sampling_logprob for d in drawn]
    kept.sum().backward()  # differentiable, and finite where rows have no kept set
    assert logits.grad is not None and bool(torch.isfinite(logits.grad).all())
    # a token without a kept set reads its full-vocabulary logprob
    some = numerics.token_logprobs(logits, tokens, 0.7, mask_pos_N=pos[pos != 2],
                                   mask_ids_N=ids[pos != 2])  # fmt: skip
    assert some[2].item() == full[2].item() and some[0].item() == kept[0].item()
    assert full.tolist() != kept.tolist()


def test_a_matched_routing_call_is_seen_on_its_own_thread_only():
    """``_routing`` computes in the mode inside a matched router's ``routing`` call: the
    mark is the calling thread's (another thread's default routers are not affected) and
    is gone after the call, also after one that raised."""
    import threading

    seen: dict[str, int] = {}

    def routing() -> None:
        seen["inside"] = numerics._MATCHED_ROUTING.depth
        other = threading.Thread(target=lambda: seen.update(other=numerics._MATCHED_ROUTING.depth))
        other.start()
        other.join()
        raise RuntimeError("a failed routing")

    with pytest.raises(RuntimeError, match="a failed routing"):
        numerics._matched(routing)()
    assert seen == {"inside": 1, "other": 0}
    assert numerics._MATCHED_ROUTING.depth == 0
