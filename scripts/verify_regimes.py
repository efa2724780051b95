"""Does one verify width cost the same from minute to minute? Streaks vs mixed widths, one cache.

    python scripts/verify_regimes.py --context 180 --width 6 --blocks 4

Prefills one cache of ``--context`` random tokens, then in ``--blocks`` blocks times 30
forwards of ``--width`` tokens in a row (a streak, as a static k=5 run verifies) and 30 that
each follow a forward of another width (as the calibration and the surface measure), the
cache cropped back after every forward. Prints every timed forward in order (s: streak, c:
after another width) and the medians. Seen here (SmolLM2 fp32, 2 threads): width 6 at 77 ms
for tens of forwards, then at 95 ms for tens more, in streaks and mixed alike, while width 1
stayed at 55 ms: the wide forwards' speed has regimes of seconds to minutes on this machine,
which is what replay's per-width prices cannot know (docs/results.md, 2026-11-25 night).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from adaspec.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=180)
    ap.add_argument("--width", type=int, default=6)
    ap.add_argument("--blocks", type=int, default=4)
    args = ap.parse_args()
    m = load_model(args.model)
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    state = m.new_state()
    m.forward(state, torch.randint(0, m.vocab_size, (args.context,), generator=gen).tolist(), 1)

    def timed(k: int) -> float:
        ids = torch.randint(0, m.vocab_size, (k,), generator=gen).tolist()
        t0 = time.perf_counter()
        m.forward(state, ids, k)
        dt = time.perf_counter() - t0
        m.truncate(state, args.context)
        return dt

    others = [w for w in (1, 2, 3, 4, 5, 8, 10, 12, 16) if w != args.width]
    seq: list[tuple[str, float]] = []
    for _ in range(args.blocks):
        seq += [("s", timed(args.width)) for _ in range(30)]
        for _ in range(30):
            timed(rng.choice(others))
            seq.append(("c", timed(args.width)))
    print(" ".join(f"{kind}{t * 1e3:.0f}" for kind, t in seq))
    for kind, label in (("s", "streak"), ("c", "after other widths")):
        v = [t for k, t in seq if k == kind]
        print(f"width {args.width} {label}: median {statistics.median(v) * 1e3:.1f} ms, "
              f"min {min(v) * 1e3:.1f}, max {max(v) * 1e3:.1f}")
    w1 = [timed(1) for _ in range(30)]
    print(f"width 1: median {statistics.median(w1) * 1e3:.1f} ms, min {min(w1) * 1e3:.1f}, max {max(w1) * 1e3:.1f}")


if __name__ == "__main__":
    main()
