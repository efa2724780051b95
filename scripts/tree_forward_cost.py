"""What a tree verify forward costs against a chain forward of the same width (issue 18's
pricing): the engine prices a tree of n nodes at the chain curve's V(n + 1), so a tree forward
(4D mask, position ids, every row's logits, then ``keep_path``'s gather) that costs more than a
chain forward (causal, ``logits_to_keep``, crop) of the same width is under-priced. Times both,
interleaved, on the target at a given cache length: the median of ``--reps`` each, their ratio
per width. Not a test: the numbers depend on the machine and its load. On the 2-core EPYC
(2026-11-28, quiet, 21 reps) a tree forward cost 0.97-1.015x the chain's at widths 2-16 on
200- and 600-token caches: the chain grid prices trees right.

    python scripts/tree_forward_cost.py                      # SmolLM2, 200 cached tokens
    python scripts/tree_forward_cost.py --context 600 --widths 2,4,8,16 --reps 21
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from adaspec.models import load_model
from adaspec.trees import DraftTree


def bushy(n: int) -> DraftTree:
    """A tree of ``n`` nodes shaped like the engine's best-first trees: a main chain with two
    alternatives at the root and one at each of the next levels."""
    tokens, parents = [], []
    main = -1
    for i in range(n):
        if i % 3 == 2 and main >= 0:  # a sibling of the last main-chain node
            parents.append(parents[main])
        else:
            parents.append(main)
            main = i
        tokens.append(100 + i)
    return DraftTree(tokens, parents)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--widths", default="2,4,6,8,12,16", help="forward widths (tree: width - 1 nodes)")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    target = load_model(args.model)
    widths = [int(w) for w in args.widths.split(",")]
    ids = [(7 * i) % 5000 + 200 for i in range(args.context)]
    state = target.new_state()
    target.forward(state, ids[:-1])

    def chain(w: int) -> float:
        t = time.perf_counter()
        target.forward(state, [ids[-1], *range(100, 100 + w - 1)], keep=w)
        target.truncate(state, args.context - 1)
        return time.perf_counter() - t

    def tree(w: int) -> float:
        tr = bushy(w - 1)
        t = time.perf_counter()
        target.forward_tree(state, ids[-1], tr)
        # root, node 0 and its sibling node 2 (a gather), or root and node 0 in a smaller tree
        target.keep_path(state, args.context - 1, [0, 1, 3] if len(tr) >= 3 else [0, 1])
        elapsed = time.perf_counter() - t
        target.truncate(state, args.context - 1)
        return elapsed

    print(f"{args.model}, {args.context} cached tokens, {torch.get_num_threads()} threads, median of {args.reps}")
    print("width  chain ms  tree ms  tree/chain")
    for w in widths:
        for f in (chain, tree):  # warm-up
            f(w)
        c, t = [], []
        for _ in range(args.reps):
            c.append(chain(w))
            t.append(tree(w))
        mc, mt = statistics.median(c), statistics.median(t)
        print(f"{w:5d}  {1e3 * mc:8.2f}  {1e3 * mt:7.2f}  {mt / mc:9.3f}")


if __name__ == "__main__":
    main()
