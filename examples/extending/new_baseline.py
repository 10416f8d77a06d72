"""A new baseline: advantages A_i = R_i - median_j R_j, registered under a name and trained with.

A baseline is any callable `(rewards [B], *, group_ids=None) -> advantages [B]`
(`flashrl.algorithms.flash_reinforce.components.Baseline`). Register a class (or a zero-argument
factory) with `@BASELINES.register("name")` to select it by name, or pass an object
(`baseline=MedianBaseline()`) or a path (`baseline="my_package.baselines:MedianBaseline"`). The
learner actors receive it by value: this script's module need not import there. The importance
sampling, the trust region, the aggregation and the token mask are plugged in the same way
(IMPORTANCE_SAMPLINGS, TRUST_REGIONS, AGGREGATIONS, TOKEN_MASKS).

    python examples/extending/new_baseline.py [--model smollm2-135m-instruct] [--iterations 2]
"""

from __future__ import annotations

from flashrl.algorithms.flash_reinforce.components import BASELINES


@BASELINES.register("median")
class MedianBaseline:
    """A_i = R_i - median(R): robust to a few outlier rewards (a batch of mostly 0 stays near 0)."""

    def __call__(self, rewards, *, group_ids=None):
        return rewards - rewards.median()


def main(argv=None):
    from common import run

    results = run(lambda config: config.environment("flashrl/Math-v0", env_config={"preset": "easy_sums"})
                  .training(baseline="median"), argv)
    print("advantage mean per iteration:", [round(r["learners/advantage_mean"], 3) for r in results])
    return results


if __name__ == "__main__":
    main()
