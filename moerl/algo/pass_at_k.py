"""The unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models
Trained on Code", eq. 1).

With n samples of a problem of which c pass, the chance that k samples drawn without
replacement include a passing one is

    pass@k = 1 - C(n - c, k) / C(n, k)

The binomials overflow floats for realistic n; the ratio telescopes into a product of
k factors, computed here as

    C(n - c, k) / C(n, k) = prod_{i = n - c + 1}^{n} (1 - k / i)

(each factor is (i - k) / i, a number in [0, 1), so the product never overflows). When
fewer than k samples fail (n - c < k) every k-subset holds a pass: pass@k = 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` passing among ``n`` samples."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: c={c} passing samples must be in 0..n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k: k={k} must be in 1..n={n}; draw at least k samples")
    if n - c < k:
        return 1.0
    i = np.arange(n - c + 1, n + 1, dtype=np.float64)
    return float(1.0 - np.prod(1.0 - k / i))


def mean_pass_at_k(n: Sequence[int] | int, c: Sequence[int], k: int) -> float:
    """pass@k averaged over problems; ``n`` per problem or one n for all."""
    ns = [n] * len(c) if isinstance(n, int) else list(n)
    if len(ns) != len(c):
        raise ValueError(f"pass@k: {len(ns)} sample counts for {len(c)} problems")
    if not c:
        raise ValueError("pass@k of no problems")
    return float(np.mean([pass_at_k(int(a), int(b), k) for a, b in zip(ns, c)]))
