"""Per-round overhead of the drafter-selection policies: select() + update() for 8 arms.

Times each round with time.perf_counter over many rounds (feedback objects are built before
timing, so only the policy is measured) and prints the median and 99th percentile in
microseconds. Not a test: numbers depend on the machine and its load.

    python scripts/policy_overhead.py [--rounds 20000] [--arms 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from adaspec.config import SamplingConfig
from adaspec.drafters.base import Draft, Peek
from adaspec.feedback import RoundFeedback
from adaspec.costs import CostModel, VerifyCostCurve
from adaspec.selection import SELECTORS, build_selector

#: every registered selector, plus the MetaSD block-efficiency variant
POLICIES = sorted(SELECTORS) + ["metasd-ucb:reward=be", "auto:peek=0"]


def feedback_pool(n_arms: int, per_arm: int, L: int = 5, seed: int = 0) -> list[list[RoundFeedback]]:
    """Pre-built feedback for every arm: geometric accepted lengths, arm-dependent times."""
    rng = np.random.default_rng(seed)
    sampling = SamplingConfig(temperature=1.0)
    pool = []
    for arm in range(n_arms):
        alpha = 0.3 + 0.6 * arm / max(1, n_arms - 1)
        rows = []
        for r in range(per_arm):
            u = rng.random(L)
            n = int(np.argmax(u >= alpha)) if np.any(u >= alpha) else L
            fb = RoundFeedback(
                round=r, drafter=arm, draft=Draft(tokens=[0] * L), n_accepted=n,
                emitted=[0] * (n + 1), k_cap=L, target_logits=None, sampling=sampling,
                draft_s=0.001 * arm * L, verify_s=0.02 + 0.002 * rng.random(), gammas=[alpha] * L)
            # full information: every arm's gamma at each emitted position
            fb.counterfactual = {j: [0.3 + 0.6 * j / max(1, n_arms - 1)] * (n + 1)
                                 for j in range(n_arms) if j != arm}
            fb.counterfactual[arm] = fb.chosen_gammas()
            rows.append(fb)
        pool.append(rows)
    return pool


def measure(spec: str, n_arms: int, rounds: int, pool: list[list[RoundFeedback]]) -> list[float]:
    policy = build_selector(spec)
    if getattr(policy, "wants_costs", False):
        curve = VerifyCostCurve(ks=[1, 2, 4, 8], seconds=[0.02, 0.03, 0.028, 0.03], context=200)
        policy.costs = CostModel(curve)
    policy.begin_request([f"d{i}" for i in range(n_arms)])
    per_arm = len(pool[0])
    times = []
    clock = time.perf_counter
    # a selector that looks first (auto) sees every arm's block each round, as in the engine
    looks = int(getattr(policy, "peek_tokens", 0) or 0)
    blocks = {j: Peek(list(range(j, j + looks)), 1 + 3 * j) for j in range(n_arms)} if looks else None
    for r in range(rounds):
        t0 = clock()
        if blocks is not None:
            policy.observe_proposals(blocks)
        i = policy.select()
        policy.update(pool[i][r % per_arm])
        times.append(clock() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20000)
    ap.add_argument("--arms", type=int, default=8)
    ap.add_argument("--policy", action="append", help="only these policy specs (repeatable)")
    args = ap.parse_args()
    pool = feedback_pool(args.arms, 512)
    print(f"select()+update() per round, {args.arms} arms, {args.rounds} rounds")
    print(f"{'policy':<22} {'median us':>10} {'p99 us':>10}")
    for spec in args.policy or POLICIES:
        times = measure(spec, args.arms, args.rounds, pool)
        p99 = float(np.quantile(times, 0.99))
        print(f"{spec:<22} {statistics.median(times) * 1e6:10.2f} {p99 * 1e6:10.2f}")


if __name__ == "__main__":
    main()
