"""The engine at two git revisions, side by side in one process: did a change make decoding slower?

Exports ``src/adaspec`` of ``--base`` (``git archive``) into a temporary folder as the package
``adaspec_base`` (the package imports itself relatively, so both versions load in one
interpreter), loads the target once per version, and runs every configuration on every prompt
with the two versions alternating (base, head, base, head, ...) so that the machine's drift hits
both alike. Prints tokens/s per version and configuration, the head/base ratio of the totals and
the median of the per-prompt ratios, and checks that both versions emit the same tokens.
Not a test: numbers depend on the machine and its load.

    python scripts/compare_revisions.py --base 49fcfd7 [--per-category 1] [-n 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import adaspec
from adaspec.bench.workloads import load_workload

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"AR": ([], 5), "suffix k=5": (["suffix"], 5), "prompt-lookup k=5": (["prompt-lookup"], 5)}


def export_base(rev: str, into: Path) -> None:
    """``src/adaspec`` at ``rev`` as ``into/adaspec_base``."""
    blob = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src/adaspec"],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    (into / "src" / "adaspec").rename(into / "adaspec_base")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="git revision to compare the working tree with")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--suite", default="mixed")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per prompt and version")
    ap.add_argument("--config", action="append", choices=sorted(CONFIGS), help="default: all")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="adaspec-base-"))
    export_base(args.base, tmp)
    sys.path.insert(0, str(tmp))
    versions = {"base": importlib.import_module("adaspec_base"), "head": adaspec}
    engines = {}
    for tag, pkg in versions.items():
        models = importlib.import_module(f"{pkg.__name__}.models")
        target = models.load_model(args.model)
        engines[tag] = {name: pkg.SpeculativeEngine(target, list(d), k=k)
                        for name, (d, k) in CONFIGS.items() if not args.config or name in args.config}
    work = load_workload(args.suite, per_category=args.per_category)
    encoder = next(iter(engines["head"].values()))
    prompts = [encoder.encode_prompt(p.text) for p in work]
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens, {args.repeats} alternating repeats, "
          f"base {args.base} vs the working tree", flush=True)
    for name in engines["head"]:
        secs = {"base": [], "head": []}
        tokens = 0
        for i, ids in enumerate(prompts):
            runs = {"base": [], "head": []}
            outs = {}
            for _ in range(args.repeats):
                for tag in ("base", "head"):
                    t0 = time.perf_counter()
                    r = engines[tag][name].generate(ids, max_new_tokens=args.max_new_tokens)
                    runs[tag].append(time.perf_counter() - t0)
                    outs[tag] = r.token_ids
            if outs["base"] != outs["head"]:
                print(f"  {name}: prompt {i} differs between the versions", flush=True)
            tokens += len(outs["head"])
            for tag in runs:
                secs[tag].append(statistics.median(runs[tag]))
        ratios = [b / h for b, h in zip(secs["base"], secs["head"])]
        tps = {tag: tokens / sum(secs[tag]) for tag in secs}
        print(f"{name:20s} base {tps['base']:6.2f} tok/s  head {tps['head']:6.2f} tok/s  head/base "
              f"{tps['head'] / tps['base']:.3f} (median per prompt {statistics.median(ratios):.3f})", flush=True)


if __name__ == "__main__":
    main()
