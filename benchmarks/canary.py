"""The canary's decisions in simulation (`make bench-canary`): per-list AUCs like the served ones (means
0.55-0.65, sd 0.22 and 0.30), looked at after every list a side, with the default settings. For each: a
version 10 % worse than its control (0.60 -> 0.54) ramped how often (the declared bound: `canary.ramp_alpha`),
an honest one (as good as its control) ramped after how many lists, an inverted one (mean 1 - control's) shown
worse after how many; beside the fixed count the canary ramped on before (20 lists a side, not shown worse).
Prints one line, `canary-sim: ...`.
"""

from __future__ import annotations

import argparse

import numpy as np

from infra.settings import load_settings
from serving.canary import first_ramp, msprt, ramp_lists


def list_aucs_like(rng: np.random.Generator, mean: float, sd: float, n: int) -> np.ndarray:
    """Per-list AUCs in [0, 1] with this mean and sd (a beta distribution): the served lists' spread."""
    total = mean * (1 - mean) / sd**2 - 1
    return rng.beta(mean * total, (1 - mean) * total, n)


def fixed_count_ramps(worse: np.ndarray, control: np.ndarray, tau: float, alpha: float, count: int = 20) -> bool:
    """The former rule: ramped at `count` lists a side unless the mSPRT had shown it worse by then."""
    return not any(d < 0 and lam >= 1 / alpha
                   for d, lam in (msprt(worse[:n], control[:n], tau) for n in range(max(2, count // 2), count + 1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=400, help="canaries per distribution")
    args = parser.parse_args()
    c = load_settings({}, config_file=None).canary
    rng = np.random.default_rng(7)
    worst, former = 0.0, 0.0
    print(f"settings: margin {c.margin}, ramp_alpha {c.ramp_alpha}, alpha {c.alpha}, mixture_sd {c.mixture_sd}, "
          f"min_requests {c.min_requests}; {args.runs} canaries per row")
    for sd in (0.22, 0.30):
        for mean in (0.55, 0.60, 0.65):
            sized = ramp_lists(sd, c)
            false, old, honest = 0, 0, []
            for _ in range(args.runs):
                control = list_aucs_like(rng, mean, sd, 6 * sized)
                worse = list_aucs_like(rng, 0.9 * mean, sd, 6 * sized)
                false += first_ramp(worse, control, c) is not None
                old += fixed_count_ramps(worse, control, c.mixture_sd, c.alpha)
                found = first_ramp(list_aucs_like(rng, mean, sd, 6 * sized), control, c)
                honest.append(np.inf if found is None else found)
            worst, former = max(worst, false / args.runs), max(former, old / args.runs)
            print(f"  list AUC {mean:.2f} sd {sd:.2f}: sizing {sized} lists a side; 10 %-worse ramped in "
                  f"{false / args.runs:.3f} (fixed 20-list rule: {old / args.runs:.3f}); honest ramped after a "
                  f"median of {np.median(honest):.0f} lists a side, 90 % within {np.percentile(honest, 90):.0f}")
    print(f"canary-sim: 10%-worse false ramps at most {worst:.3f} (declared {c.ramp_alpha}), former fixed-count "
          f"rule {former:.3f}; honest sizing {ramp_lists(0.22, c)} lists a side at sd 0.22")


if __name__ == "__main__":
    main()
