"""The pre-registered comparison's statistics (docs/benchmarks.md, "Pre-registered: ..."): pure functions.

- `area_to_budget`: the primary metric, mean held-out accuracy over [0, budget] generated rollouts.
- `paired_difference`: mean of per-seed differences, its 95% t-interval and the exact sign-flip
  permutation p-value.
- `holm`: Holm's step-down adjustment of several p-values.
- `time_to_reach`: when a curve first reaches a target, interpolated (evidence-3's time to 0.6).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any


def area_to_budget(curve: Sequence[Mapping[str, Any]], budget: float, *, x: str = "generated") -> float:
    """Mean accuracy over [0, budget] of the x axis: trapezoids between evaluations, divided by budget.

    The curve starts at x = 0 (the untrained evaluation). Where the last evaluation lies past the
    budget, the curve is cut at the budget by linear interpolation; a curve that ends before the
    budget is an error (the run did not spend it).
    """
    points = [(float(p[x]), float(p["accuracy"])) for p in curve]
    if not points or points[0][0] != 0.0:
        raise ValueError(f"expected a curve starting at {x} = 0, got {points[:1]}")
    if points[-1][0] < budget:
        raise ValueError(f"expected a curve reaching {x} = {budget}, it ends at {points[-1][0]}")
    area = 0.0
    for (x0, y0), (x1, y1) in pairwise(points):
        if x0 >= budget:
            break
        if x1 > budget:
            y1 = y0 + (y1 - y0) * (budget - x0) / (x1 - x0)
            x1 = budget
        area += (x1 - x0) * (y0 + y1) / 2
    return area / budget


def accuracy_at(curve: Sequence[Mapping[str, Any]], budget: float, *, x: str = "generated") -> float:
    """Held-out accuracy at `budget` on the x axis, linearly interpolated between evaluations."""
    points = [(float(p[x]), float(p["accuracy"])) for p in curve]
    for (x0, y0), (x1, y1) in pairwise(points):
        if x0 <= budget <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (budget - x0) / (x1 - x0)
    raise ValueError(f"{x} = {budget} lies outside the curve ({points[0][0]}..{points[-1][0]})")


def first_reaching(curve: Sequence[Mapping[str, Any]], target: float, *, x: str = "generated") -> float | None:
    """The x of the first evaluation with accuracy >= target; None if none reached it."""
    return next((float(p[x]) for p in curve if p["accuracy"] >= target), None)


def time_to_reach(curve: Sequence[Mapping[str, Any]], target: float, *, x: str = "t") -> float | None:
    """The x at which accuracy first reaches `target`, linearly interpolated between evaluations; None if never.

    An evaluation at or above the target right at the start gives its own x (the curve starts there).
    """
    points = [(float(p[x]), float(p["accuracy"])) for p in curve]
    if points and points[0][1] >= target:
        return points[0][0]
    for (x0, y0), (x1, y1) in pairwise(points):
        if y0 < target <= y1:
            return x0 + (x1 - x0) * (target - y0) / (y1 - y0)
    return None


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (Lentz's method)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: int) -> float:
    """Student's t distribution's CDF with `df` degrees of freedom."""
    tail = 0.5 * _incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: int) -> float:
    """The `p` quantile of Student's t with `df` degrees of freedom (bisection on `t_cdf`)."""
    if not 0.0 < p < 1.0 or df < 1:
        raise ValueError(f"expected 0 < p < 1 and df >= 1, got p={p}, df={df}")
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def sign_flip_p_value(differences: Sequence[float]) -> float:
    """Exact two-sided p-value of the paired sign-flip permutation test of mean difference 0.

    Under the null each seed's difference is as likely to have either sign: all 2^n sign patterns
    are enumerated and the p-value is the fraction whose |mean| is at least the observed |mean|.
    """
    n = len(differences)
    if n == 0 or n > 20:
        raise ValueError(f"expected 1 to 20 paired differences, got {n}")
    observed = abs(sum(differences))
    tolerance = 1e-12 * max(1.0, observed)
    extreme = sum(
        abs(sum(s * d for s, d in zip(signs, differences, strict=True))) >= observed - tolerance
        for signs in itertools.product((1, -1), repeat=n)
    )
    return extreme / 2**n


def paired_difference(differences: Sequence[float], *, level: float = 0.95) -> dict[str, Any]:
    """Mean per-seed difference with its t-interval (n - 1 degrees of freedom) and permutation p-value."""
    n = len(differences)
    mean = sum(differences) / n if n else math.nan
    if n < 2:
        return {"n": n, "mean": mean, "std_error": None, "interval": None, "p_value": None}
    variance = sum((d - mean) ** 2 for d in differences) / (n - 1)
    std_error = math.sqrt(variance / n)
    half = t_quantile(0.5 + level / 2, n - 1) * std_error
    return {
        "n": n,
        "mean": mean,
        "std_error": std_error,
        "interval": [mean - half, mean + half],
        "level": level,
        "p_value": sign_flip_p_value(differences),
    }


def holm(p_values: Mapping[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values (monotone, capped at 1)."""
    ordered = sorted(p_values.items(), key=lambda kv: kv[1])
    m = len(ordered)
    adjusted: dict[str, float] = {}
    running = 0.0
    for i, (name, p) in enumerate(ordered):
        running = max(running, min(1.0, (m - i) * p))
        adjusted[name] = running
    return adjusted
