"""Where does replay's predicted time differ from a live run? Component by component.

    python scripts/replay_components.py bench results/smollm2-auto-v2 [--skip code-editing-01]
    python scripts/replay_components.py run --per-category 1 -n 64 --out /tmp/rc.pkl
    python scripts/replay_components.py analyse /tmp/rc.pkl
    python scripts/replay_components.py probes results/smollm2-long-prompts-v3 --config benchmarks/smollm2-long-prompts.toml

``bench`` reads a finished ``adaspec bench`` output directory (summary.json, rounds.csv --
the last repeat's rounds -- and trace.npz) and prints: the bench's error per configuration
(also without ``--skip`` prompts), the error per prompt (a burst of other load shows as one
prompt far off for every configuration), and the live verify step per width over the
trace's surface (mean and median) next to the ratio the trace prices with, per configuration.

``run`` records a trace of the workload (fresh verify-cost surface, calibration) and runs the
bench configurations (default: those of benchmarks/smollm2-auto-v2.toml) live on the same
prompts in the same process, interleaved as ``adaspec bench`` does (warm-up, then prompt by
prompt, configuration by configuration, ``--repeats`` times), keeping every request's
``RequestStats`` (per round: draft, verify, catch-up, policy, evaluation and drafter prefill
seconds). It pickles the live records and saves the trace next to them, so that ``analyse``
can be re-run after a change to the pricing code without measuring again.

``probes`` re-prices a bench run recorded with verify probes (``VerifyProbe``) with the
calibration's per-width ratios alone, and prints replay's error both ways.

``reprice`` re-prices a finished bench run (summary.json, verify_steps.csv, trace.npz) with
its live verify steps selected and averaged in several ways (all passes or the median passes;
trimmed mean or mean), each configuration's own steps left out as the bench does, and prints
replay's error per configuration for each: what the pricing choice is worth, without running
the workload again.

``analyse`` prints, per configuration: the bench's error (predicted / live tokens/s - 1, live
= sum over requests of the median over repeats); live seconds per component (mean over
repeats) against the same component priced by the trace's cost model on the *live* rounds
(same widths, contexts, drafters: the cost model's error alone), and replay's own total (its
rounds may differ for time-dependent policies: the rest is decision divergence); and the
verify step by width: live seconds / priced, so a width-dependent error shows.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from adaspec.bench.replay import _Pool, _RoundPricer, predict_configs
from adaspec.bench.runner import (BenchConfig, _Runner, _turn_prompt, default_configs, explicit_configs,
                                  load_bench_file)
from adaspec.bench.trace import Trace, record
from adaspec.bench.workloads import load_workload
from adaspec.config import GenerationConfig
from adaspec.drafters import build_drafter
from adaspec.models import load_model

COMPONENTS = ("request", "prefill", "drafter_prefill", "verify", "draft", "catch_up", "eval", "policy", "overhead")


def bench_configs(path: str) -> tuple[dict, list[BenchConfig]]:
    opt = load_bench_file(path)
    cfgs = default_configs(opt.get("drafters", []), opt.get("ks", [5]), opt.get("selectors", []),
                           opt.get("lengths", []), peers=[])
    return opt, cfgs + explicit_configs(opt.get("config", []))


def run(args: argparse.Namespace) -> None:
    opt, cfgs = bench_configs(args.config)
    target = load_model(opt.get("model", "smollm2"))
    work = load_workload(args.suite or opt.get("suite", "mixed"), per_category=args.per_category)
    if args.prompts:
        work = work[: args.prompts]
    drafters = opt.get("drafters", ["prompt-lookup", "suffix"])
    out = Path(args.out)
    trace_path = out.with_suffix(".npz")
    say = (lambda m: print(f"  {m}", file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    if args.trace_first:
        record(target, drafters, work, args.max_new_tokens, trace_path, progress=say)
    rec_s = time.perf_counter() - t0
    runners = [_Runner(c, target, lambda s: build_drafter(s, target), "cpu", None) for c in cfgs]
    ar = runners[0].engine
    eos = ar.eos_ids()
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    first = _turn_prompt(work[0], 0, [], ar)
    for r in runners:
        r.run(first, GenerationConfig(max_new_tokens=16), eos)
    live: dict[str, list[list]] = {c.name: [] for c in cfgs}  # config -> [request][repeat] RequestStats
    n_req = 0
    for p in work:
        answers: list[str] = []
        for turn in range(len(p.turns)):
            ids = _turn_prompt(p, turn, answers, ar)
            for c in cfgs:
                live[c.name].append([])
            ref: list[int] = []
            for _ in range(args.repeats):
                for ci, (c, r) in enumerate(zip(cfgs, runners)):
                    say(f"{p.id} turn {turn} {c.name}")
                    toks, _, st = r.run(ids, gen, eos)
                    live[c.name][n_req].append(st)
                    ref = toks if ci == 0 else ref
            answers.append(ar.decode(ref))
            n_req += 1
    if not args.trace_first:
        t0 = time.perf_counter()
        record(target, drafters, work, args.max_new_tokens, trace_path, progress=say)
        rec_s = time.perf_counter() - t0
    out.write_bytes(pickle.dumps({"configs": cfgs, "live": live, "trace": str(trace_path), "record_s": rec_s,
                                  "max_new_tokens": args.max_new_tokens}))
    print(f"written {out} and {trace_path}")


def _price_live(trace: Trace, cfg: BenchConfig, p: int, st, price: _RoundPricer, pool: _Pool) -> dict[str, float]:
    """The cost model's price of each component of a live request's own rounds."""
    pt = trace.prompts[p]
    names = {n: i for i, n in enumerate(pool.names)}
    t = pt.n_prompt
    out = dict.fromkeys(COMPONENTS, 0.0)
    out["request"] = price.over.request_s
    out["prefill"] = pt.prefill_s
    seen = [0] * len(pool.src)
    for r in st.rounds:
        i = names[r.drafter]
        if r.drafter_prefill_s > 0 or seen[i] == 0:
            out["drafter_prefill"] += price.drafter_prefill(i, pt.n_prompt) if seen[i] == 0 else 0.0
            seen[i] = pt.n_prompt
        out["verify"] += price.verify(r.drafted + 1, t)
        if r.k_cap > 0:
            out["draft"] += price.draft(i, r.drafted, t)
        out["catch_up"] += price.catch_up(i, r.catch_up_tokens, t)
        out["overhead"] += price.round_overhead()
        t += r.emitted
        seen[i] = t
    return out


def _live_parts(st) -> dict[str, float]:
    out = dict.fromkeys(COMPONENTS, 0.0)
    out["prefill"] = st.prefill_s
    out["request"] = st.total_s - st.prefill_s - sum(r.total_s for r in st.rounds)
    for r in st.rounds:
        out["drafter_prefill"] += r.drafter_prefill_s
        out["verify"] += r.verify_s
        out["draft"] += r.draft_s
        out["catch_up"] += r.catch_up_s
        out["eval"] += r.eval_s
        out["policy"] += r.policy_s
        out["overhead"] += r.overhead_s
    return out


def analyse(args: argparse.Namespace) -> None:
    data = pickle.loads(Path(args.data).read_bytes())
    trace = Trace.load(args.trace or data["trace"])
    cfgs: list[BenchConfig] = data["configs"]
    live = data["live"]
    o = trace.overheads
    print(f"trace: round_s {o.round_s * 1e3:.3f} ms, request_s {o.request_s * 1e3:.2f} ms, live verify / surface "
          + ", ".join(f"w={w} {r:.3f}" for w, r in zip(o.verify_widths, o.verify_ratios)))
    preds = predict_configs(trace, cfgs)
    # the pricing before issue 23's fix, on the same trace: the line in the width, and policies
    # deciding on the scaled surface
    import dataclasses

    line = dataclasses.replace(o, verify_widths=[], verify_ratios=[])
    before = dataclasses.replace(trace, overheads=line, cache={},
                                 policy_surface=trace.surface.scaled(o.verify_scale, o.verify_scale_per_width))
    preds_before = predict_configs(before, cfgs)
    width_live: dict[tuple[str, int], list[float]] = defaultdict(list)
    width_pred: dict[tuple[str, int], list[float]] = defaultdict(list)
    rows = []
    print(f"\n{'configuration':44s} {'live s':>7s} {'pred s':>7s} {'error':>7s}  (error = pred/live tok/s - 1)")
    for c in cfgs:
        pool = _Pool.of(trace, [d for d in c.drafters] or ["none"])
        price = _RoundPricer(trace, pool)
        medians = sum(statistics.median(s.total_s for s in reps) for reps in live[c.name])
        res = preds[c.name]
        pred_s = res.predicted_s
        lv = dict.fromkeys(COMPONENTS, 0.0)
        pr = dict.fromkeys(COMPONENTS, 0.0)
        n_rep = len(live[c.name][0])
        for p, reps in enumerate(live[c.name]):
            for st in reps:
                for k, v in _live_parts(st).items():
                    lv[k] += v / n_rep
                for k, v in _price_live(trace, c, p, st, price, pool).items():
                    pr[k] += v / n_rep
                t = trace.prompts[p].n_prompt
                for r in st.rounds:
                    w = r.drafted + 1
                    width_live[(c.name, w)].append(r.verify_s)
                    width_pred[(c.name, w)].append(price.verify(w, t))
                    t += r.emitted
        rep_rounds = sum(len(p.rounds) for p in res.prompts)
        live_rounds = sum(len(s.rounds) for reps in live[c.name] for s in reps) / n_rep
        rows.append((c.name, lv, pr, res))
        print(f"{c.name[:44]:44s} {medians:7.2f} {pred_s:7.2f} {medians / pred_s - 1:+7.1%}   (before: "
              f"{medians / preds_before[c.name].predicted_s - 1:+6.1%}, {preds_before[c.name].n_rounds} rounds)   rounds live "
              f"{live_rounds:.0f} replay {rep_rounds}, replay policy_s {res.policy_s:.3f}")
    print("\nper component, seconds summed over requests (mean of repeats): live / priced on the live rounds")
    print(f"{'configuration':30s}" + "".join(f"{k:>16s}" for k in COMPONENTS) + f"{'total':>16s}{'replay':>8s}")
    for name, lv, pr, res in rows:
        cells = "".join(f"{lv[k]:7.3f}/{pr[k]:<7.3f} " for k in COMPONENTS)
        tl, tp = sum(lv.values()), sum(pr.values())
        print(f"{name[:30]:30s}{cells}{tl:7.3f}/{tp:<7.3f} {res.seconds:7.3f}")
    print("\nper component, live - priced (s), and share of the live total")
    for name, lv, pr, res in rows:
        tl = sum(lv.values())
        print(f"{name[:30]:30s}" + "".join(f"{(lv[k] - pr[k]):+8.3f}({(lv[k] - pr[k]) / tl:+5.1%})" for k in COMPONENTS)
              + f"  eval+policy priced in replay: {res.seconds - sum(pr.values()) + pr['request'] * 0:+.3f}")
    print("\nverify step by width: live mean ms / priced mean ms (n)")
    widths = sorted({w for _, w in width_live})
    print(f"{'configuration':30s}" + "".join(f"{'w=' + str(w):>17s}" for w in widths))
    for c in cfgs:
        cells = ""
        for w in widths:
            a, b = width_live.get((c.name, w)), width_pred.get((c.name, w))
            cells += f"{statistics.fmean(a) * 1e3:6.1f}/{statistics.fmean(b) * 1e3:5.1f}({len(a):3d})" if a else " " * 17
        print(f"{c.name[:30]:30s}{cells}")


def bench(args: argparse.Namespace) -> None:
    import csv
    import json

    out = Path(args.dir)
    trace = Trace.load(args.trace or out / "trace.npz")
    summary = json.loads((out / "summary.json").read_text())
    rows = list(csv.DictReader(open(out / "rounds.csv", encoding="utf-8")))
    _, cfgs = bench_configs(args.config)
    names = [r["config"] for r in summary["overall"]]
    cfgs = [c for c in cfgs if c.name in names]
    skip = set(args.skip.split(",")) if args.skip else set()
    idx = {(p.meta.get("id"), p.meta.get("turn", 0)): i for i, p in enumerate(trace.prompts)}
    preds = predict_configs(trace, cfgs)
    live_pp = {(r["config"], r["prompt_id"]): r["seconds"] for r in summary["per_prompt"]}
    pids = list(dict.fromkeys(r["prompt_id"] for r in summary["per_prompt"]))

    def pred_of(name: str, keep) -> float:
        res = preds[name]
        n = max(1, res.n_rounds)
        return sum(p.seconds + res.policy_s * len(p.rounds) / n for p in res.prompts
                   if keep(trace.prompts[p.index].meta.get("id")))

    for label, keep in (("all prompts", lambda pid: True), (f"without {sorted(skip)}", lambda pid: pid not in skip)):
        if label != "all prompts" and not skip:
            continue
        live = {c.name: sum(live_pp[(c.name, p)] for p in pids if keep(p)) for c in cfgs}
        pred = {c.name: pred_of(c.name, keep) for c in cfgs}
        print(f"\n{label}: error = predicted / live tokens/s - 1 (rounds: live last repeat / replay)")
        for c in cfgs:
            n_live = sum(1 for r in rows if r["config"] == c.name and keep(r["prompt_id"]))
            n_rep = sum(len(p.rounds) for p in preds[c.name].prompts if keep(trace.prompts[p.index].meta.get("id")))
            print(f"  {c.name[:48]:48s} live {live[c.name]:7.2f} s  pred {pred[c.name]:7.2f} s  "
                  f"{live[c.name] / pred[c.name] - 1:+6.1%}   rounds {n_live}/{n_rep}")
        print("  same ranking:", sorted(live, key=live.get) == sorted(pred, key=pred.get))
    print("\nper prompt (live / predicted - 1):")
    for pid in pids:
        cells = " ".join(f"{live_pp[(c.name, pid)] / pred_of(c.name, lambda x: x == pid) - 1:+7.1%}" for c in cfgs)
        print(f"  {pid:20s} {cells}")
    by: dict[tuple[str, str, int], list] = defaultdict(list)
    for r in rows:
        if r["prompt_id"] not in skip:
            by[(r["config"], r["prompt_id"], int(r["turn"]))].append(r)
    ratios: dict[tuple[str, int], list[float]] = defaultdict(list)
    for (c, pid, turn), rs in by.items():
        t = trace.prompts[idx[(pid, turn)]].n_prompt
        for r in sorted(rs, key=lambda r: int(r["round"])):
            w = int(r["drafted"]) + 1
            ratios[(c, w)].append(float(r["verify_s"]) / trace.surface.cost(w, t - 1))
            ratios[("all", w)].append(ratios[(c, w)][-1])
            t += int(r["emitted"])
    o = trace.overheads
    print("\nlive verify step / surface by width: mean, median (n); priced at")
    for w in sorted({w for _, w in ratios}):
        v = ratios[("all", w)]
        if len(v) >= 5:
            per_cfg = "  ".join(f"{c[:12]} {statistics.fmean(ratios[(c, w)]):.3f}" for c in names
                                if len(ratios.get((c, w), [])) >= 5)
            print(f"  w={w:2d}: {statistics.fmean(v):.3f} {statistics.median(v):.3f} ({len(v):5d}); "
                  f"priced {o.verify_factor(w):.3f}   {per_cfg}")
    cal = trace.info.get("calibration_verify")
    if cal:  # traces since the drift-free table: what the calibration runs saw, before scaling
        print("  calibration runs' own ratios (trimmed means):",
              "  ".join(f"w={w}: {r:.3f}" for w, r in sorted((int(w), r) for w, r in cal.items())))


def probes(args: argparse.Namespace) -> None:
    import dataclasses
    import json

    out = Path(args.dir)
    trace = Trace.load(args.trace or out / "trace.npz")
    if not trace.info.get("probe_verify"):
        sys.exit(f"{out}: the trace holds no verify probes (recorded before them, or on llama.cpp)")
    summary = json.loads((out / "summary.json").read_text())
    live = {r["config"]: r["tokens_per_s"] for r in summary["overall"]}
    tokens = {c: sum(r["tokens"] for r in summary["per_prompt"] if r["config"] == c) for c in live}
    _, cfgs = bench_configs(args.config)
    cfgs = [c for c in cfgs if c.name in live]
    o = trace.overheads
    cal = {int(w): r for w, r in trace.info["calibration_verify"].items()}
    widths = [1] + [w for w in sorted(cal) if w > 1]
    ratios = [o.verify_ratios[0]] + [cal[w] / cal[1] * o.verify_ratios[0] for w in widths[1:]]
    alone = dataclasses.replace(trace, cache={}, overheads=dataclasses.replace(
        o, verify_widths=widths, verify_ratios=ratios))
    preds = {"probes": predict_configs(trace, cfgs), "calibration alone": predict_configs(alone, cfgs)}
    print(f"{'configuration':44s} {'live tok/s':>10s}" + "".join(f"{k:>20s}" for k in preds))
    for c in cfgs:
        cells = "".join(f"{tokens[c.name] / p[c.name].predicted_s / live[c.name] - 1:+20.1%}" for p in preds.values())
        print(f"{c.name[:44]:44s} {live[c.name]:10.2f}{cells}")


def reprice(args: argparse.Namespace) -> None:
    import csv
    import dataclasses
    import gzip
    import json

    from adaspec.bench.trace import live_verify_table

    out = Path(args.dir)
    trace = Trace.load(args.trace or out / "trace.npz")
    summary = json.loads((out / "summary.json").read_text())
    plain = out / "verify_steps.csv"
    with (open(plain, encoding="utf-8") if plain.exists()
          else gzip.open(out / "verify_steps.csv.gz", "rt", encoding="utf-8")) as fh:  # docs/results keep it gzipped
        steps = [(r["config"], r["median"] == "True", int(r["width"]), int(r["cached"]), float(r["seconds"]))
                 for r in csv.DictReader(fh)]
    base = trace.info.get("verify_base")
    if not base:
        sys.exit(f"{out}: the trace was not priced by live steps (no verify_base)")
    live = {r["config"]: r["tokens_per_s"] for r in summary["overall"]}
    tokens = {c: sum(r["tokens"] for r in summary["per_prompt"] if r["config"] == c) for c in live}
    _, cfgs = bench_configs(args.config)
    cfgs = [c for c in cfgs if c.name in live]
    variants = {"all passes, trimmed": (False, 0.1), "all passes, mean": (False, 0.0),
                "median passes, trimmed": (True, 0.1), "median passes, mean": (True, 0.0)}
    errs: dict[str, list[float]] = {v: [] for v in variants}
    print(f"{'configuration':44s} {'live tok/s':>10s}" + "".join(f"{v:>24s}" for v in variants))
    for c in cfgs:
        cells = ""
        for v, (median, trim) in variants.items():
            rows = [(w, ctx, sec) for name, med, w, ctx, sec in steps if name != c.name and (med or not median)]
            widths, ratios = live_verify_table(trace.surface, rows, base, trim=trim)
            own = dataclasses.replace(trace, overheads=dataclasses.replace(
                trace.overheads, verify_widths=widths, verify_ratios=ratios), cache={})
            res = predict_configs(own, [c])[c.name]
            err = tokens[c.name] / res.predicted_s / live[c.name] - 1
            errs[v].append(err)
            cells += f"{err:+24.1%}"
        print(f"{c.name[:44]:44s} {live[c.name]:10.2f}{cells}")
    print(f"{'mean error / largest':55s}" + "".join(
        f"{statistics.fmean(e):+13.1%} / {max(e, key=abs):+.1%}" for e in errs.values()))


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--config", default="benchmarks/smollm2-auto-v2.toml")
    r.add_argument("--suite", default=None)
    r.add_argument("--per-category", type=int, default=1)
    r.add_argument("-n", "--max-new-tokens", type=int, default=64)
    r.add_argument("--repeats", type=int, default=2)
    r.add_argument("--prompts", type=int, default=0)
    r.add_argument("--trace-first", action="store_true", help="record before the live runs (default: after, as the bench)")
    r.add_argument("--out", default="/tmp/replay_components.pkl")
    b = sub.add_parser("bench")
    b.add_argument("dir", help="an adaspec bench output directory with summary.json, rounds.csv, trace.npz")
    b.add_argument("--config", default="benchmarks/smollm2-auto-v2.toml", help="the bench file it ran")
    b.add_argument("--trace", default=None)
    b.add_argument("--skip", default="", help="prompt ids to leave out (comma-separated), e.g. burst-hit ones")
    rp = sub.add_parser("reprice")
    rp.add_argument("dir", help="an adaspec bench output directory with verify_steps.csv and trace.npz")
    rp.add_argument("--config", default="benchmarks/smollm2-long-prompts.toml", help="the bench file it ran")
    rp.add_argument("--trace", default=None)
    pr = sub.add_parser("probes")
    pr.add_argument("dir", help="an adaspec bench output directory recorded with verify probes")
    pr.add_argument("--config", default="benchmarks/smollm2-long-prompts.toml", help="the bench file it ran")
    pr.add_argument("--trace", default=None)
    a = sub.add_parser("analyse")
    a.add_argument("data")
    a.add_argument("--trace", default=None)
    args = ap.parse_args()
    {"run": run, "analyse": analyse, "bench": bench, "probes": probes, "reprice": reprice}[args.cmd](args)


if __name__ == "__main__":
    main()
