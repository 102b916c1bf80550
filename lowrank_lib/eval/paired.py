"""Paired comparisons: may a sentence call method A better than method B on these windows?

Two methods measured on the SAME windows (prompts, seeds, repeats) give one difference per window. A claim
"A is better" is allowed only when the bootstrap interval of the mean difference excludes zero; otherwise the
comparison is "within noise". The sign count (windows A wins / loses / ties) is reported beside it, so a
reader sees both the size and the consistency of a gap.

    >>> c = compare(kl["attsvd"], kl["h2o"], names=("attsvd", "h2o"), scale="log")
    >>> c.verdict, c.sentence()
    ('within noise', 'attsvd vs h2o: 0.86x (mean ratio; 95 % CI 0.62x to 1.19x), attsvd lower on 5/8 windows: within noise')

``scale="log"`` compares log values (for positive, ratio-like quantities: perplexity, KL, ms/token) and
reports the geometric-mean ratio A / B; ``scale="linear"`` compares plain differences A - B.

The interval is the percentile bootstrap of the mean paired difference (windows resampled with replacement,
a fixed seed: the same data give the same sentence). With fewer than two windows nothing can be decided.
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Sequence

VERDICTS = ("a better", "b better", "within noise")


@dataclass(frozen=True)
class Paired:
    """One paired comparison of A against B over n windows (``diff`` = A - B, or log A - log B)."""

    names: tuple[str, str]
    n: int
    a_lower: int               # windows where A's value is lower than B's
    b_lower: int
    ties: int
    scale: str                 # "linear" or "log"
    mean_diff: float           # mean of A - B (log scale: of log A - log B)
    ci: tuple[float, float]    # bootstrap interval of mean_diff
    level: float
    lower_is_better: bool
    verdict: str               # one of VERDICTS

    @property
    def better(self) -> str | None:
        """The better method's name, or None when the interval includes zero."""
        return {"a better": self.names[0], "b better": self.names[1]}.get(self.verdict)

    def _fmt(self, x: float) -> str:
        return f"{math.exp(x):.3g}x" if self.scale == "log" else f"{x:+.3g}"

    def sentence(self) -> str:
        a, b = self.names
        what = "ratio" if self.scale == "log" else "difference"
        lo, hi = self.ci
        verdict = {"a better": f"{a} better", "b better": f"{b} better"}.get(self.verdict, "within noise")
        if self.n < 2:
            return f"{a} vs {b}: one window only ({what} {self._fmt(self.mean_diff)}): cannot be decided"
        return (f"{a} vs {b}: {self._fmt(self.mean_diff)} (mean {what}; {round(self.level * 100)} % CI "
                f"{self._fmt(lo)} to {self._fmt(hi)}), {a} lower on {self.a_lower}/{self.n} windows: {verdict}")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ci"] = list(self.ci)
        d["sentence"] = self.sentence()
        return d


def _values(x: Sequence[float], what: str, log: bool) -> list[float]:
    vals = [float(v) for v in x]
    for i, v in enumerate(vals):
        if not math.isfinite(v):
            raise ValueError(f"{what}[{i}] is {v}: a paired comparison needs finite values")
        if log and v <= 0:
            raise ValueError(f"{what}[{i}] is {v}: scale='log' needs positive values (use scale='linear')")
    return vals


def compare(a: Sequence[float], b: Sequence[float], names: tuple[str, str] = ("a", "b"), *,
            lower_is_better: bool = True, scale: str = "linear", level: float = 0.95, n_boot: int = 10000,
            seed: int = 0) -> Paired:
    """Compare A and B measured on the same windows (``a[i]`` and ``b[i]`` from window i).

    ``lower_is_better``: perplexity, KL, ms/token (True) or accuracy, tokens/s (False). Raises ``ValueError``
    on different lengths, no windows, non-finite values, or non-positive values with ``scale="log"``."""
    if scale not in ("linear", "log"):
        raise ValueError(f"scale={scale!r}: use 'linear' or 'log'")
    if not 0 < level < 1:
        raise ValueError(f"level={level}: a probability in (0, 1)")
    log = scale == "log"
    xa, xb = _values(a, names[0], log), _values(b, names[1], log)
    if len(xa) != len(xb):
        raise ValueError(f"{names[0]} has {len(xa)} windows and {names[1]} {len(xb)}: a paired comparison "
                         "needs the same windows")
    if not xa:
        raise ValueError("no windows to compare")
    d = [(math.log(p) - math.log(q)) if log else (p - q) for p, q in zip(xa, xb)]
    n = len(d)
    mean = sum(d) / n
    a_lower = sum(x < 0 for x in d)
    b_lower = sum(x > 0 for x in d)
    if n < 2:
        ci = (-math.inf, math.inf)
    else:
        rng = random.Random(seed)
        means = sorted(sum(rng.choices(d, k=n)) / n for _ in range(n_boot))
        tail = (1 - level) / 2
        ci = (means[int(math.floor(tail * (n_boot - 1)))], means[int(math.ceil((1 - tail) * (n_boot - 1)))])
    if ci[1] < 0:
        verdict = "a better" if lower_is_better else "b better"
    elif ci[0] > 0:
        verdict = "b better" if lower_is_better else "a better"
    else:
        verdict = "within noise"
    return Paired(tuple(names), n, a_lower, b_lower, n - a_lower - b_lower, scale, mean, ci, level,
                  lower_is_better, verdict)


def pairwise(results: dict[str, Sequence[float]], reference: str, **kw) -> dict[str, Paired]:
    """Every method of ``results`` (name -> per-window values) compared with ``reference``:
    ``{name: compare(results[name], results[reference], (name, reference), **kw)}``."""
    if reference not in results:
        raise KeyError(f"reference {reference!r} is not among {sorted(results)}")
    return {k: compare(v, results[reference], (k, reference), **kw) for k, v in results.items() if k != reference}
