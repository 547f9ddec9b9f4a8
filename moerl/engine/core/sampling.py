"""SGLang 0.5.23's sampling parameters and the sampler that records its kept set.

For each output token the sampler transforms the model's logits in SGLang's order
(``sglang/srt/sampling/sampling_batch_info.py``, ``penaltylib``):

1. penalties: ``repetition_penalty`` divides the positive and multiplies the negative
   logits of tokens already generated, ``frequency_penalty`` subtracts
   ``count × penalty``, ``presence_penalty`` subtracts the penalty once per generated
   token, and until ``min_new_tokens`` tokens exist every stop id and EOS is -inf;
2. the grammar (``regex``, ``json_schema``, ``ebnf``): tokens it forbids are -inf;
3. ``logit_bias`` is added;

then applies temperature, keeps the top-k, top-p and min-p tokens among those still
possible (finite logits), samples from the renormalised kept set, and reports

- ``logprob``: the sampled token's log-probability over the whole vocabulary of the
  transformed logits at the sampling temperature (greedy reports temperature 1), as
  SGLang's ``output_token_logprobs``;
- ``mask``: the kept token ids ordered by probability, highest first (SGLang's order):
  the sampling support, with the grammar's and min_new_tokens' exclusions folded in;
- ``sampling_logprob``: the sampled token's log-probability renormalised over the kept
  set (0 for greedy, whose kept set is the one chosen token).

What this means for Keep Routing and importance sampling: the trainer renormalises its
own policy over the recorded kept set, so whatever only *removes* tokens (top-k, top-p,
min-p, a grammar, min_new_tokens) is replayed exactly. Penalties and ``logit_bias``
*reweight* the kept tokens: ``sampling_logprob`` is then the probability the token was
really sampled with, which differs from the model's, and the importance ratio corrects
for it as for any other off-policy sample.
"""

# V vocabulary

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import regex
import torch

from moerl.kernels import batch_invariant as bi

GREEDY_EPS = 1e-5  # SGLang's _SAMPLING_EPS is 1e-6; below either, sampling is greedy
MAX_STOP_COUNT = 32  # SGLang's bounds on stop strings and stop_regex patterns
MAX_STOP_REGEX_LEN = 256  # bytes
GRAMMARS = ("json_schema", "regex", "ebnf")


class UnknownFieldError(ValueError):
    """An unknown key: SGLang's contract gate answers these with ``{"error": "..."}``."""


class Matcher(Protocol):
    """A request's grammar state (``moerl.engine.core.grammar``)."""

    def allowed(self) -> torch.Tensor: ...  # bool [V]

    def accept(self, token: int) -> None: ...

    @property
    def done(self) -> bool: ...


@dataclass
class SamplingParams:
    """SGLang 0.5.23's ``sampling_params`` (``sglang/srt/sampling/sampling_params.py``),
    same names and defaults. ``max_new_tokens=None`` means up to the context length.
    Served in full but for beam search, ``structural_tag`` and watermarks, which are
    refused when set (400) rather than ignored."""

    max_new_tokens: int | None = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    beam_width: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    custom_params: dict[str, Any] | None = None
    watermark: dict[str, Any] | None = None
    # normalised forms, filled by from_request (not API fields)
    stop_strs: list[str] = field(default_factory=list, repr=False)
    stop_regexes: list[Any] = field(default_factory=list, repr=False)  # regex.Pattern

    @classmethod
    def api_fields(cls) -> set[str]:
        return {f.name for f in fields(cls) if f.name not in ("stop_strs", "stop_regexes")}

    @classmethod
    def from_request(cls, raw: dict | None, vocab_size: int | None = None) -> SamplingParams:
        """Parse a request's ``sampling_params`` (nulls mean the default, but for
        ``max_new_tokens`` whose null means no limit); ValueError names a bad key."""
        raw = dict(raw or {})
        known = cls.api_fields()
        unknown = sorted(set(raw) - known)
        if unknown:
            raise UnknownFieldError(
                f"unknown field `{unknown[0]}` in sampling_params, expected one of "
                + ", ".join(f"`{k}`" for k in sorted(known))
            )
        params = cls(**{k: v for k, v in raw.items() if v is not None or k == "max_new_tokens"})
        params.validate(vocab_size)
        return params

    def validate(self, vocab_size: int | None = None) -> None:
        """SGLang's ``verify`` and ``normalize`` checks, plus the fields refused here."""
        mnt = self.max_new_tokens
        if mnt is not None and (not isinstance(mnt, int) or mnt < 0):
            raise ValueError(f"max_new_tokens={mnt!r} must be an integer >= 0 (or null)")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (all) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(
                f"repetition_penalty={self.repetition_penalty} must be in (0, 2] (1 = none)"
            )
        if self.min_new_tokens < 0 or (mnt is not None and self.min_new_tokens > mnt):
            raise ValueError(
                f"min_new_tokens={self.min_new_tokens} must be in [0, max_new_tokens={mnt}]"
            )
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be an integer >= 1")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ValueError(f"stream_interval={self.stream_interval} must be >= 1")
        if self.sampling_seed is not None and not -(2**63) <= self.sampling_seed < 2**63:
            raise ValueError(f"sampling_seed={self.sampling_seed} must fit in 64 bits")
        self._check_refused()
        self._check_logit_bias(vocab_size)
        if sum(getattr(self, g) is not None for g in GRAMMARS) > 1:
            raise ValueError("only one of json_schema, regex and ebnf can be set")
        self.stop_strs = [s for s in _as_list(self.stop) if s]
        if len(self.stop_strs) > MAX_STOP_COUNT:
            raise ValueError(f"stop: at most {MAX_STOP_COUNT} strings, got {len(self.stop_strs)}")
        self.stop_regexes = [_compile_stop_regex(p) for p in _as_list(self.stop_regex)]
        if len(self.stop_regexes) > MAX_STOP_COUNT:
            raise ValueError(f"stop_regex: at most {MAX_STOP_COUNT} patterns")

    def _check_refused(self) -> None:
        if self.beam_width is not None and self.beam_width > 1:
            raise ValueError(
                f"beam_width={self.beam_width}: beam search is not served by the embedded "
                "engine (use SGLang, or n for independent samples)"
            )
        if self.beam_width is not None and self.beam_width < 1:
            raise ValueError(f"beam_width={self.beam_width} must be >= 1")
        if self.structural_tag is not None:
            raise ValueError(
                "structural_tag is not served by the embedded engine; use regex, "
                "json_schema or ebnf"
            )
        if self.watermark is not None:
            raise ValueError("watermark is not served by the embedded engine; use SGLang")

    def _check_logit_bias(self, vocab_size: int | None) -> None:
        for key in self.logit_bias or {}:
            try:
                token = int(key)
            except ValueError:
                raise ValueError(f"logit_bias: key {key!r} is not a token id") from None
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ValueError(f"logit_bias: token id {token} is outside [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, source) of the request's grammar, if any."""
        for kind in GRAMMARS:
            source = getattr(self, kind)
            if source:
                return kind, source
        return None

    @property
    def penalised(self) -> bool:
        return bool(
            self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
        )


def _as_list(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _compile_stop_regex(pattern: str) -> Any:
    """Compiled with the ``regex`` package (``re``'s syntax, its version 0), whose searches
    take a timeout: the scheduler bounds each one (``--stop-regex-timeout-ms``), so a
    pattern that backtracks catastrophically ends its own request, not the engine."""
    if len(pattern.encode()) > MAX_STOP_REGEX_LEN:
        raise ValueError(f"stop_regex: {pattern[:40]!r}... is over {MAX_STOP_REGEX_LEN} bytes")
    try:
        return regex.compile(pattern)
    except (regex.error, RecursionError) as err:
        raise ValueError(
            f"stop_regex: {pattern!r} is not a valid regular expression: {err}"
        ) from None


@dataclass
class Sampled:
    token: int
    logprob: float
    mask: list[int]
    sampling_logprob: float
    support_logprobs: list[float]
    top: list[tuple[float, int]] = field(default_factory=list)  # top_logprobs_num
    chosen: list[float] = field(default_factory=list)  # logprobs of token_ids_logprob


def kept_set(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Boolean [V] mask of the tokens the sampler may choose (the sampling support):
    the finite logits that pass top-k, top-p and min-p."""
    possible = torch.isfinite(logits_V)
    if params.greedy:
        keep = torch.zeros_like(logits_V, dtype=torch.bool)
        keep[int(torch.argmax(logits_V))] = True
        return keep
    probs = torch.softmax(logits_V.float() / params.temperature, dim=-1)
    keep = possible.clone()
    if params.top_k > 0 and params.top_k < probs.numel():
        kth = torch.topk(probs, params.top_k).values[-1]
        keep &= probs >= kth
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=0) - sorted_p  # mass strictly above each token
        keep_sorted = before < params.top_p
        keep_sorted[0] = True
        nucleus = torch.zeros_like(keep)
        nucleus[order[keep_sorted]] = True
        keep &= nucleus
    if params.min_p > 0.0:
        keep &= probs >= params.min_p * probs.max()
    return keep


class Sampler:
    """One sequence's sampling state: generated-token counts for the penalties, the
    grammar matcher and the random generator (its own when ``sampling_seed`` is set).
    Its tensors live on ``generator.device``, where the logits it samples from are.

    ``stop_ids`` are the ids min_new_tokens holds back: the request's stop_token_ids and
    every EOS id of the engine."""

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        generator: torch.Generator,
        stop_ids: Iterable[int] = (),
        matcher: Matcher | None = None,
    ) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.matcher = matcher
        self.generator = generator
        self.device = generator.device
        if params.sampling_seed is not None:
            seeded = torch.Generator(device=self.device)
            self.generator = seeded.manual_seed(params.sampling_seed % 2**63)
        self.stop_ids = sorted({t for t in stop_ids if 0 <= t < vocab_size})
        self.generated = 0
        self.counts: torch.Tensor | None = None  # fp32 [V], only when penalised
        self.bias: torch.Tensor | None = None
        if params.logit_bias:
            bias = torch.zeros(vocab_size)
            for key, value in params.logit_bias.items():
                bias[int(key)] = float(value)
            self.bias = bias.to(self.device)

    def transform(self, logits_V: torch.Tensor) -> torch.Tensor:
        """Steps 1-3 of the module docstring on a copy of fp32 logits [V]."""
        p = self.params
        logits_V = logits_V.float().clone()
        if self.counts is not None:
            seen = self.counts > 0
            if p.repetition_penalty != 1.0:
                scaled = torch.where(
                    logits_V < 0,
                    logits_V * p.repetition_penalty,
                    logits_V / p.repetition_penalty,
                )
                logits_V = torch.where(seen, scaled, logits_V)
            logits_V -= p.frequency_penalty * self.counts + p.presence_penalty * seen.float()
        if self.generated < p.min_new_tokens and self.stop_ids:
            logits_V[self.stop_ids] = -math.inf
        if self.matcher is not None:
            allowed = self.matcher.allowed().to(logits_V.device)
            logits_V = logits_V.masked_fill(~allowed[: logits_V.numel()], -math.inf)
        if self.bias is not None:
            logits_V += self.bias
        return logits_V

    def sample(
        self,
        logits_V: torch.Tensor,
        top_logprobs_num: int = 0,
        token_ids_logprob: list[int] | None = None,
    ) -> Sampled:
        """Sample the next token from the model's logits [V] (see the module docstring)
        and advance the state; ValueError when no token is possible."""
        logits_V = self.transform(logits_V)
        if not bool(torch.isfinite(logits_V).any()):
            raise ValueError(
                "no token is possible at this position (the grammar, min_new_tokens and "
                "logit_bias exclude the whole vocabulary)"
            )
        s = sample(logits_V, self.params, self.generator)
        if top_logprobs_num > 0 or token_ids_logprob:
            logprobs_V = _logprobs(logits_V, self.params)
            k = min(top_logprobs_num, logprobs_V.numel())
            if k > 0:
                values, ids = torch.topk(logprobs_V, k)
                s.top = list(zip(values.tolist(), ids.tolist()))
            if token_ids_logprob:
                s.chosen = logprobs_V[token_ids_logprob].tolist()
        self.accept(s.token)
        return s

    def batchable(
        self, top_logprobs_num: int = 0, token_ids_logprob: list[int] | None = None
    ) -> bool:
        """Whether this step's token can be drawn by ``sample_batch``: nothing transforms
        the logits (no penalty, grammar, logit_bias or pending min_new_tokens), the
        engine's generator is used and no top/chosen logprobs are asked for."""
        p = self.params
        return (
            self.counts is None
            and not p.penalised
            and self.matcher is None
            and self.bias is None
            and p.sampling_seed is None
            and not (self.generated < p.min_new_tokens and self.stop_ids)
            and top_logprobs_num <= 0
            and not token_ids_logprob
        )

    def accept(self, token: int) -> None:
        self.generated += 1
        if self.params.penalised:
            if self.counts is None:
                self.counts = torch.zeros(self.vocab_size, device=self.device)
            self.counts[token] += 1
        if self.matcher is not None:
            self.matcher.accept(token)


def _temperature(params: SamplingParams) -> float:
    """The temperature logprobs are reported at (greedy: 1, as SGLang)."""
    return 1.0 if params.greedy and params.temperature < GREEDY_EPS else params.temperature


def _logprobs(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logprobs = torch.log_softmax(logits_V.float() / max(_temperature(params), GREEDY_EPS), -1)
    return logprobs.clamp(min=torch.finfo(torch.float32).min)  # -inf → finite, as SGLang


def prompt_logprobs(logits_SV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logprobs [S, V] of the model's logits at the request's temperature (input-token
    logprobs: no penalty or grammar applies to the prompt)."""
    return _logprobs(logits_SV, params)


def sample(logits_V: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> Sampled:
    """Sample one token from fp32 logits [V] (already transformed) and record logprob,
    kept set and the renormalised logprob (see the module docstring)."""
    logits_V = logits_V.float()
    logprobs_V = torch.log_softmax(logits_V / max(_temperature(params), GREEDY_EPS), dim=-1)
    keep = kept_set(logits_V, params)
    kept_ids = torch.nonzero(keep).flatten()
    kept_ids = kept_ids[torch.argsort(logprobs_V[kept_ids], descending=True, stable=True)]
    # renormalised over the full vocabulary with the dropped ids at -inf, as sample_batch
    # does, so both paths (and a matching trainer) give the same bits
    kept_V = torch.log_softmax(logprobs_V.masked_fill(~keep, -math.inf), dim=-1)
    kept_logprobs = kept_V[kept_ids]
    if kept_ids.numel() == 1:
        choice = 0
    else:
        choice = int(torch.multinomial(kept_logprobs.exp(), 1, generator=generator))
    token = int(kept_ids[choice])
    return Sampled(
        token=token,
        logprob=float(logprobs_V[token]),
        mask=kept_ids.tolist(),
        sampling_logprob=float(kept_logprobs[choice]),
        support_logprobs=kept_logprobs.tolist(),
    )


_TORCH_SOFTMAXES = (torch.log_softmax, torch.softmax)


def sample_batch(
    logits_BV: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    details: list[bool],
    invariant: bool = False,
) -> list[Sampled]:
    """``sample`` for B rows sharing ``params`` in batched tensor ops: the same
    distribution, logprob, kept set and renormalised logprob per row (the random draws
    differ from B calls of ``sample``). Rows whose ``details`` is false skip the kept
    set's id list and support logprobs (``mask`` and ``support_logprobs`` left empty).
    ``invariant``: the softmaxes are ``kernels.batch_invariant``'s (what the
    ``BatchInvariant`` mode would reroute them to; the draw's other ops are exact or
    row-wise), called directly rather than through the mode's per-op dispatch."""
    log_softmax, softmax = (bi.log_softmax, bi.softmax) if invariant else _TORCH_SOFTMAXES
    logits_BV = logits_BV.float()
    logprobs_BV = log_softmax(logits_BV / max(_temperature(params), GREEDY_EPS), dim=-1)
    if params.greedy:
        keep_BV = torch.zeros_like(logits_BV, dtype=torch.bool)
        keep_BV.scatter_(1, torch.argmax(logits_BV, dim=-1, keepdim=True), True)
    else:
        probs_BV = softmax(logits_BV / params.temperature, dim=-1)
        keep_BV = torch.isfinite(logits_BV)
        if 0 < params.top_k < probs_BV.shape[-1]:
            kth = torch.topk(probs_BV, params.top_k, dim=-1).values[:, -1:]
            keep_BV &= probs_BV >= kth
        if params.top_p < 1.0:
            sorted_p, order = torch.sort(probs_BV, dim=-1, descending=True)
            before = torch.cumsum(sorted_p, dim=-1) - sorted_p
            keep_sorted = before < params.top_p
            keep_sorted[:, 0] = True
            keep_BV &= torch.zeros_like(keep_BV).scatter_(1, order, keep_sorted)
        if params.min_p > 0.0:
            keep_BV &= probs_BV >= params.min_p * probs_BV.max(dim=-1, keepdim=True).values
    kept_BV = log_softmax(logprobs_BV.masked_fill(~keep_BV, -math.inf), dim=-1)
    if params.greedy:
        tokens_B = torch.argmax(keep_BV.float(), dim=-1)
    else:  # inverse CDF: one cumsum (torch.multinomial over [B, V] is ~10x slower on CPU)
        cdf_BV = torch.cumsum(kept_BV.exp(), dim=-1)
        u_B1 = torch.rand(
            len(cdf_BV), 1, generator=generator, dtype=cdf_BV.dtype, device=cdf_BV.device
        )
        # the first token whose CDF exceeds u x total: never one of probability 0
        tokens_B = torch.searchsorted(cdf_BV, u_B1 * cdf_BV[:, -1:], right=True)[:, 0]
        tokens_B = torch.minimum(
            tokens_B, keep_BV.shape[-1] - 1 - keep_BV.flip(-1).int().argmax(-1)
        )
    token_list = tokens_B.tolist()
    logprob_list = logprobs_BV.gather(1, tokens_B[:, None])[:, 0].tolist()
    kept_list = kept_BV.gather(1, tokens_B[:, None])[:, 0].tolist()
    out = [
        Sampled(token=t, logprob=lp, mask=[], sampling_logprob=0.0 if params.greedy else k,
                support_logprobs=[])
        for t, lp, k in zip(token_list, logprob_list, kept_list)
    ]  # fmt: skip
    rows = [b for b, want in enumerate(details) if want]
    if rows:  # kept ids by logprob, highest first (stable), as ``sample``
        index = torch.tensor(rows, device=logits_BV.device)
        order = torch.argsort(logprobs_BV[index], dim=-1, descending=True, stable=True)
        kept_sorted = keep_BV[index].gather(1, order)
        support = kept_BV[index].gather(1, order)
        for i, b in enumerate(rows):
            out[b].mask = order[i][kept_sorted[i]].tolist()
            out[b].support_logprobs = support[i][kept_sorted[i]].tolist()
    return out
