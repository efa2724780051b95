"""scripts/look_ceiling.py: the in-sample ceiling of policies over the looks' keys (issue 20)."""
import importlib.util
from pathlib import Path

from adaspec.costs import VerifyCostSurface

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "look_ceiling.py"
spec = importlib.util.spec_from_file_location("look_ceiling", SCRIPT)
ceiling = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ceiling)


def surface(k2: float, switch: float = 0.0) -> VerifyCostSurface:
    """One step 1 s; a block of k tokens verified costs k2 + 0.1 (k - 1) s (k >= 2)."""
    ks = [1, 2, 4, 8, 16, 17]
    row = [1.0] + [k2 + 0.1 * (k - 2) for k in ks[1:]]
    return VerifyCostSurface([0, 4096], ks, [row, row], [1.0, 1.0], switch_s=switch)


def test_matched_counts_the_leading_agreement():
    assert ceiling.matched([1, 2, 3], [1, 2, 4]) == 2
    assert ceiling.matched([5], [1]) == 0


def test_copying_pays_where_blocks_are_cheap_and_nothing_does_without_repeats():
    pattern = list(range(100, 120))
    prompt, out = pattern, pattern * 3  # the answer repeats the prompt: every look copies it
    rows = ceiling.positions(prompt, out, surface(1.2))
    speed, policy = ceiling.fit([rows])
    assert speed > 3.0 and policy  # blocks of 16 accepted whole for ~2.6 s against 17 steps
    assert ceiling.walk([rows], {}) == 1.0  # plain decoding is the unit
    fresh = ceiling.positions(list(range(10)), list(range(1000, 1060)), surface(1.2))
    assert ceiling.fit([fresh]) == (1.0, {})  # no look proposes: only plain steps


def test_a_steep_curve_and_graph_rebuilds_price_blocks_out():
    """The same looks pay less on a steeper curve, and a policy never does worse than plain
    decoding (its empty policy): "7 a 7 a 7 b 7 b ..." copies right at every second "7"."""
    prompt = [7, 1, 7, 2]
    out = [t for x in range(50, 70) for t in (7, x, 7, x)]
    flat = ceiling.fit([ceiling.positions(prompt, out, surface(1.0))])[0]
    steep = ceiling.fit([ceiling.positions(prompt, out, surface(1.9, switch=0.5))])[0]
    assert flat > 1.2 and 1.0 <= steep < flat
