"""Which KV layout for continuous batching? Times one verify round of B rows x W tokens on a
cache of about L tokens per row, three ways (medians; writes JSON with --out):

* ``holes``: the padded batch cache of ``adaspec.batch`` with a fraction of hole columns
  (rejected drafts, padding) masked out: the forward attends over them, nothing is copied;
* ``gather``: per-request caches stacked (left-padded) into a batch every round and split
  back after it: no holes, one more copy of every cache per round;
* ``sequential``: B batch-1 forwards (no batching), for reference;
plus the cost of one compaction of the holes layout (gathering valid columns).

    PYTHONPATH=src python scripts/batch_cache_layout.py --model smollm2 --rows 4,16 --context 256
"""

from __future__ import annotations

import argparse
import json
import time
from statistics import median

import torch

from adaspec.batch import BatchEngine, forward_rows
from adaspec.models import load_model


def prefilled(target, rows: int, length: int, gen: torch.Generator):
    cache = target.new_state()
    ids = torch.randint(0, target.vocab_size, (rows, length), generator=gen).tolist()
    forward_rows(target, cache, torch.zeros(rows, 0, dtype=torch.bool), ids)
    return cache


@torch.inference_mode()
def measure(target, rows: int, context: int, width: int, holes: float, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    vocab = target.vocab_size
    drafts = [torch.randint(0, vocab, (width,), generator=gen).tolist() for _ in range(rows)]
    # holes: T columns of which a fraction are holes in every row
    t = int(round(context / (1 - holes)))
    cache = prefilled(target, rows, t, gen)
    valid = torch.rand(rows, t, generator=gen) >= holes

    def holes_round() -> None:
        forward_rows(target, cache, valid, drafts)
        cache.crop(-width)

    # gather: per-row caches (rows of different lengths) stacked and split every round
    lengths = [context - (r % 8) for r in range(rows)]
    singles = []
    for n in lengths:
        c = target.new_state()
        target.forward(c, torch.randint(0, vocab, (n,), generator=gen).tolist(), keep=1)
        singles.append([(layer.keys, layer.values) for layer in c.layers])
    top = max(lengths)

    def gather_round() -> None:
        batch = target.new_state()
        for i, layer in enumerate(batch.layers):
            ks = [torch.nn.functional.pad(s[i][0], (0, 0, top - s[i][0].shape[2], 0)) for s in singles]
            vs = [torch.nn.functional.pad(s[i][1], (0, 0, top - s[i][1].shape[2], 0)) for s in singles]
            layer.lazy_initialization(ks[0], vs[0])
            layer.keys, layer.values = torch.cat(ks), torch.cat(vs)
        mask = torch.zeros(rows, top, dtype=torch.bool)
        for r, n in enumerate(lengths):
            mask[r, top - n:] = True
        forward_rows(target, batch, mask, drafts)
        for r, n in enumerate(lengths):  # split back (views), accepted columns kept
            _ = [(layer.keys[r:r + 1, :, top - n: top + 1], layer.values[r:r + 1, :, top - n: top + 1])
                 for layer in batch.layers]

    seq_caches = []
    for _ in range(rows):
        c = target.new_state()
        target.forward(c, torch.randint(0, vocab, (context,), generator=gen).tolist(), keep=1)
        seq_caches.append(c)

    def sequential_round() -> None:
        for c, d in zip(seq_caches, drafts):
            target.forward(c, d, keep=width)
            target.truncate(c, context)

    # one compaction of the holes layout (BatchEngine.compact), on copies of the holes cache
    eng = BatchEngine.__new__(BatchEngine)
    eng.target, eng.compactions = target, 0
    compaction_s = []
    for _ in range(2):
        eng._cache, eng._valid = target.new_state(), valid.clone()
        for mine, src in zip(eng._cache.layers, cache.layers):
            mine.lazy_initialization(src.keys, src.values)
            mine.keys, mine.values = src.keys.clone(), src.values.clone()
        t0 = time.perf_counter()
        eng.compact()
        compaction_s.append(time.perf_counter() - t0)

    # interleaved repeats, so that the machine's noise hits the three ways alike
    fns = {"holes_s": holes_round, "gather_s": gather_round, "sequential_s": sequential_round}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(repeats + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if rep:  # the first pass is a warm-up
                times[name].append(time.perf_counter() - t0)
    return {"rows": rows, "context": context, "width": width, "holes": holes, "columns": t,
            **{name: median(ts) for name, ts in times.items()}, "compaction_s": min(compaction_s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", default="4,16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--holes", default="0,0.25")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model(args.model)
    results = []
    for rows in (int(x) for x in args.rows.split(",")):
        for holes in (float(x) for x in args.holes.split(",")):
            r = measure(target, rows, args.context, args.width, holes, args.repeats)
            results.append(r)
            print(f"rows={rows:>3} L={args.context} W={args.width} holes={holes:.0%}: "
                  f"holes {r['holes_s'] * 1e3:7.1f} ms  gather {r['gather_s'] * 1e3:7.1f} ms  "
                  f"sequential {r['sequential_s'] * 1e3:7.1f} ms  compaction {r['compaction_s'] * 1e3:6.1f} ms",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "threads": torch.get_num_threads(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
