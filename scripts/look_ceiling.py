"""How fast could any policy be that decides from what ``auto`` sees before a round (issue 20)?

At every position of recorded greedy outputs, the model-free drafters are looked at as ``auto``
looks at them (``Drafter.peek``, 16 tokens), and the position gets the key ``auto`` conditions
its estimates on: per drafter, whether it proposes, agrees or disagrees with the other's first
token, and its match bucket (``selection.auto.peek_context``). A policy maps each key to a
plain step or a (drafter, cap), the block cut to what the drafter proposes; its speed is
walked over the outputs on a verify-cost grid (each block charged its verify width and two
graph rebuilds, ``VerifyCostSurface.switch_s``, as an isolated block is on llama.cpp; no
policy or drafting time). The best such policy is fitted on the positions it is scored on
(Dinkelbach iterations on the rate), per prompt and per category: an in-sample, optimistic
ceiling for policies of those keys that are fixed within a prompt, with their own time left
out (``auto`` also learns within a request; fitted per prompt, the ceiling covers what it
could learn between them). The per-round oracle (``tree_replay``'s) knows each round's
outcome; this one only what the looks show.

    python scripts/tree_replay.py --record qa.json --backend llama.cpp --suite qa --per-category 8
    python scripts/look_ceiling.py qa.json --costs docs/results/smollm2-backend-preferences/llamacpp-costs.json
    python scripts/look_ceiling.py docs/results/smollm2-auto-trees-v4/trace.npz --costs GRID.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Sequence

from adaspec.bench.replay import load_surface
from adaspec.costs import VerifyCostSurface
from adaspec.drafters import PromptLookupDrafter, SuffixDrafter
from adaspec.selection.auto import peek_chain, peek_context

#: block lengths a policy may choose (cut to the block a drafter proposes)
BLOCKS = (1, 2, 3, 4, 6, 8, 12, 16)
LOOK_DEPTH = 16

#: one position: (its key, {(drafter, k): (tokens emitted, seconds)}, a plain step's seconds)
Position = tuple[tuple, dict[tuple[int, int], tuple[int, float]], float]


def matched(block: Sequence[int], truth: Sequence[int]) -> int:
    """Leading tokens of ``block`` equal to ``truth`` (greedy acceptance: ``peek_chain``'s hits)."""
    return int(sum(peek_chain(block, truth)))


def positions(prompt: Sequence[int], output: Sequence[int], surface: VerifyCostSurface) -> list[Position]:
    """Every output position's key and the outcome and price of each block it could play."""
    seq, n0 = list(prompt) + list(output), len(prompt)
    drafters = [PromptLookupDrafter(), SuffixDrafter()]
    for d in drafters:
        d.begin_request(seq[:n0])
    out: list[Position] = []
    for t in range(n0, len(seq)):
        ctx, truth = seq[:t], seq[t:]
        looks = []
        for d in drafters:
            d.catch_up(ctx)
            peek = d.peek(ctx, LOOK_DEPTH)
            looks.append((peek.tokens, peek.match) if peek is not None and peek.tokens else ([], 0))
        blocks = {j: block for j, (block, _) in enumerate(looks) if block}
        key = [peek_context(j, blocks, looks[j][1]) if j in blocks else None for j in range(len(looks))]
        row = surface.row(t, LOOK_DEPTH + 1)
        acts: dict[tuple[int, int], tuple[int, float]] = {}
        for j, (block, _) in enumerate(looks):
            for k in BLOCKS if block else ():  # a cap: the block drafted is at most what is proposed
                kk = min(k, len(block))
                acts[(j, k)] = (matched(block[:kk], truth) + 1, row[kk + 1] + 2.0 * surface.switch_s)
        out.append((tuple(key), acts, row[1]))
    return out


def walk(requests: Sequence[list[Position]], policy: dict[tuple, tuple[int, int]]) -> float:
    """Speed-up over plain decoding of ``policy`` walked over the requests' positions."""
    tokens = seconds = plain = 0.0
    for rows in requests:
        t = 0
        while t < len(rows):
            key, acts, v1 = rows[t]
            gain, cost = acts.get(policy.get(key, (-1, 0)), (1, v1))
            gain = min(gain, len(rows) - t)
            tokens, seconds, t = tokens + gain, seconds + cost, t + gain
        plain += sum(r[2] for r in rows)
    n = sum(len(rows) for rows in requests)
    return (tokens / seconds) / (n / plain) if seconds > 0 else 1.0


def fit(requests: Sequence[list[Position]], iterations: int = 8) -> tuple[float, dict[tuple, tuple[int, int]]]:
    """The best key -> block policy found for these requests (plain steps included), fitted on
    them: each key plays the block with the largest summed gain over a plain step at the
    current rate R, E - R T (Dinkelbach 1967), R then set to the walked rate."""
    rows = [r for req in requests for r in req]
    rate = len(rows) / sum(r[2] for r in rows)
    best: tuple[float, dict[tuple, tuple[int, int]]] = (walk(requests, {}), {})
    for _ in range(iterations):
        gains: dict[tuple, dict[tuple[int, int], float]] = defaultdict(lambda: defaultdict(float))
        for key, acts, v1 in rows:
            for act, (gain, cost) in acts.items():
                gains[key][act] += (gain - rate * cost) - (1.0 - rate * v1)
        policy = {key: max(g, key=g.__getitem__) for key, g in gains.items() if g and max(g.values()) > 0}
        speed = walk(requests, policy)
        if speed > best[0]:
            best = (speed, policy)
        rate = speed * len(rows) / sum(r[2] for r in rows)
    return best


def load_requests(path: str) -> list[dict]:
    """(category, prompt ids, output ids) of a bench trace (.npz) or a ``tree_replay.py
    --record`` JSON."""
    if path.endswith(".npz"):
        from adaspec.bench.trace import Trace

        return [{"category": p.meta.get("category", "?"), "prompt": list(p.prompt), "out": list(p.output)}
                for p in Trace.load(path).prompts]
    with open(path) as fh:
        return json.load(fh)["requests"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recording", help="a bench trace (.npz) or AR outputs from tree_replay.py --record")
    ap.add_argument("--costs", required=True, help="verify-cost grid JSON (adaspec costs; a bench's costs.json)")
    args = ap.parse_args()
    surface = load_surface(args.costs)
    by_cat: dict[str, list[list[Position]]] = defaultdict(list)
    for req in load_requests(args.recording):
        by_cat[req["category"]].append(positions(req["prompt"], req["out"], surface))
    print(f"ceiling of policies over the looks' keys (in-sample), x plain decoding on {args.costs}:")
    for cat in sorted(by_cat):
        reqs = by_cat[cat]
        each = ", ".join(f"{fit([r])[0]:.3f}x" for r in reqs)
        print(f"  {cat:<14} one policy {fit(reqs)[0]:.3f}x   per prompt: {each}")


if __name__ == "__main__":
    main()
