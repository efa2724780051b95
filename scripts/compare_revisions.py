"""The engine at two git revisions, side by side in one process: did a change make decoding slower?

Exports ``src/adaspec`` of ``--base`` (``git archive``) into a temporary folder as the package
``adaspec_base`` (the package imports itself relatively, so both versions load in one
interpreter), loads the target once per version, and runs every configuration on every prompt
with the two versions alternating (base, head, base, head, ...) so that the machine's drift hits
both alike. Every repeat is a pass over the prompts with fresh engines (as ``adaspec bench``'s
passes: recycle's table and ``auto``'s estimates outlive a request, so a reused engine would
replay earlier answers). Prints tokens/s per version and configuration, the head/base ratio of
the totals and the median of the per-prompt ratios, and checks that both versions emit the same
tokens. Not a test: numbers depend on the machine and its load. The set-up has a bias of its
own: each version loads its own copy of the model, and with the same code on both sides
(``--base HEAD`` and a clean tree) `auto` +tree ran 0.986x (median per prompt 0.990x) on the
2-core EPYC (2026-11-28), so run that A/A next to an A/B and read the ratio of the two.
``--share-model`` gives both versions the working tree's loaded model (one copy of the weights;
a change to loading itself is then not compared). It does not remove that bias: its A/A (AR and
suffix k=5, 8 prompts x 64 tokens, 2 repeats) gave 0.977x and 0.975x on the totals and 0.996x
and 0.999x as medians per prompt, so read the medians, and an A/A beside every A/B.

    python scripts/compare_revisions.py --base 49fcfd7 [--per-category 1] [-n 64] [--repeats 3]
    python scripts/compare_revisions.py --base HEAD --config auto --config "auto +tree" --per-category 2 -n 128
    python scripts/compare_revisions.py --base HEAD --share-model --config "auto +tree"   # the A/A with one model
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

from rich.console import Console

import adaspec
from adaspec.bench.workloads import load_workload
from adaspec.cli.progress import StageProgress

ROOT = Path(__file__).resolve().parents[1]
#: name -> ``SpeculativeEngine`` keyword arguments
CONFIGS = {"AR": {"drafters": [], "k": 5}, "suffix k=5": {"drafters": ["suffix"], "k": 5},
           "prompt-lookup k=5": {"drafters": ["prompt-lookup"], "k": 5},
           "suffix k=5 +tree": {"drafters": ["suffix"], "k": 5, "tree": True},
           "auto": {"pool": False}, "auto +tree": {"tree": True, "pool": False}}


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
    ap.add_argument("--share-model", action="store_true",
                    help="one loaded model (the working tree's) for both versions")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="adaspec-base-"))
    export_base(args.base, tmp)
    sys.path.insert(0, str(tmp))
    versions = {"base": importlib.import_module("adaspec_base"), "head": adaspec}
    if args.share_model:  # base wraps the working tree's HF model in its own backend class
        head = adaspec.models.load_model(args.model)
        base_loaded = importlib.import_module("adaspec_base.models").LoadedModel
        targets = {"head": head, "base": base_loaded(model=head.model, tokenizer=head.tokenizer, name=head.name)}
    else:
        targets = {tag: importlib.import_module(f"{pkg.__name__}.models").load_model(args.model)
                   for tag, pkg in versions.items()}

    def engine(tag: str, name: str):  # a fresh engine: nothing learnt in an earlier pass
        return versions[tag].SpeculativeEngine(targets[tag], **CONFIGS[name])

    names = [n for n in CONFIGS if not args.config or n in args.config]
    work = load_workload(args.suite, per_category=args.per_category)
    prompts = [engine("head", "AR").encode_prompt(p.text) for p in work]
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens, {args.repeats} alternating repeats, "
          f"base {args.base} vs the working tree", flush=True)
    for name in names:
        runs: dict[str, list[list[float]]] = {"base": [[] for _ in prompts], "head": [[] for _ in prompts]}
        outs: dict[str, list[list[int]]] = {"base": [], "head": []}
        total, done = args.repeats * len(prompts) * 2, 0
        with StageProgress(Console(stderr=True)) as progress:  # a line every few seconds in a log
            for rep in range(args.repeats):
                engines = {tag: engine(tag, name) for tag in versions}
                order = ("base", "head") if rep % 2 == 0 else ("head", "base")
                for i, ids in enumerate(prompts):
                    for tag in order:
                        t0 = time.perf_counter()
                        r = engines[tag].generate(ids, max_new_tokens=args.max_new_tokens)
                        runs[tag][i].append(time.perf_counter() - t0)
                        if rep == 0:
                            outs[tag].append(r.token_ids)
                        done += 1
                        progress(name, done, total, f"repeat {rep + 1}, prompt {i + 1}, {tag}")
        for i, (b, h) in enumerate(zip(outs["base"], outs["head"])):
            if b != h:
                print(f"  {name}: prompt {i} differs between the versions", flush=True)
        tokens = sum(len(o) for o in outs["head"])
        secs = {tag: [statistics.median(r) for r in runs[tag]] for tag in runs}
        ratios = [b / h for b, h in zip(secs["base"], secs["head"])]
        tps = {tag: tokens / sum(secs[tag]) for tag in secs}
        print(f"{name:20s} base {tps['base']:6.2f} tok/s  head {tps['head']:6.2f} tok/s  head/base "
              f"{tps['head'] / tps['base']:.3f} (median per prompt {statistics.median(ratios):.3f})", flush=True)


if __name__ == "__main__":
    main()
