"""Command line: ``adaspec generate`` and ``adaspec bench`` (and ``adaspec costs``)."""

from __future__ import annotations

import json
import logging
import sys

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .errors import AdaspecError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="adaspec: adaptive, lossless speculative decoding.")
err = Console(stderr=True)

MODEL_HELP = "target: 'smollm2' (embedded), a Hugging Face id, a local directory or a .gguf file"
DRAFTER_HELP = ("drafter spec, repeatable: none, prompt-lookup[:max_ngram=3,min_ngram=1], "
                "suffix[:min_match=2,datastore=FILE,corpus=FILE,learn=true], self, model:REF")


def _fail(exc: Exception) -> None:
    err.print(f"[bold red]error:[/] {exc}")
    raise typer.Exit(2)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="the prompt (the chat template is applied)"),
    model: str = typer.Option("smollm2", "--model", "-m", help=MODEL_HELP),
    drafter: list[str] = typer.Option(["prompt-lookup"], "--drafter", "-d", help=DRAFTER_HELP),
    k: int = typer.Option(5, "--k", "-k", help="tokens drafted per round (static length policy)"),
    selector: str | None = typer.Option(None, help="drafter policy (default: static, first drafter)"),
    length: str | None = typer.Option(None, help="length policy (default: static K)"),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy"),
    top_p: float = typer.Option(1.0, help="nucleus sampling mass in (0, 1]"),
    top_k: int = typer.Option(0, help="0 = off"),
    seed: int | None = typer.Option(None, help="RNG seed for sampling"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n"),
    stop: list[str] = typer.Option([], help="stop string, repeatable"),
    no_chat_template: bool = typer.Option(False, help="feed the prompt as raw text"),
    device: str = typer.Option("cpu", help="torch device, e.g. cpu or cuda"),
    dtype: str = typer.Option("float32", help="float32 (exact) or bfloat16 (faster, not batch-invariant)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object: text, token_ids, stats"),
    rounds: bool = typer.Option(False, help="with --json: include per-round records"),
) -> None:
    """Generate an answer, streaming it as tokens are accepted."""
    from .config import GenerationConfig, SamplingConfig
    from .engine import SpeculativeEngine

    try:
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, stop=tuple(stop),
                               chat_template=not no_chat_template,
                               sampling=SamplingConfig(temperature, top_k, top_p, seed))
        engine = SpeculativeEngine.from_pretrained(model, drafter, device=device, dtype=dtype,
                                                   selector=selector, length=length, k=k)
        if as_json:
            result = engine.generate(prompt, cfg)
            print(json.dumps(result.to_dict(rounds=rounds), ensure_ascii=False))
            return
        for piece in engine.stream(prompt, cfg):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        err.print(f"[dim]{engine.last_stats.summary()}[/]")
    except AdaspecError as exc:
        _fail(exc)


@app.command()
def bench(
    model: str = typer.Option("smollm2", "--model", "-m", help=MODEL_HELP),
    drafter: list[str] = typer.Option(["prompt-lookup", "suffix"], "--drafter", "-d", help=DRAFTER_HELP),
    k: list[int] = typer.Option([5], "--k", "-k", help="draft length(s) to compare, repeatable"),
    selector: list[str] = typer.Option([], "--selector", "-s",
                                       help="drafter policy over all drafters, repeatable"),
    length: list[str] = typer.Option([], "--length", "-l",
                                     help="length policy, run with each drafter, repeatable"),
    no_static: bool = typer.Option(False, help="skip the static drafter x K configurations"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    prompts: int = typer.Option(0, help="use only the first N built-in prompts (0 = all)"),
    repeats: int = typer.Option(1, help="timed repeats per prompt and configuration (median)"),
    device: str = typer.Option("cpu"),
    dtype: str = typer.Option("float32"),
    costs: bool = typer.Option(True, help="measure and print the verify-cost curve"),
    json_out: str | None = typer.Option(None, "--json", help="also write the report as JSON here"),
) -> None:
    """Plain decoding vs speculative configurations on built-in prompts, in one process."""
    from rich.progress import Progress

    from .bench import default_configs, run_bench, save_report
    from .config import validate_k
    from .models import load_model
    from .prompts import BUILTIN_PROMPTS

    try:
        if repeats < 1:
            raise AdaspecError("--repeats must be >= 1")
        for kk in k:
            validate_k(kk)
        chosen = BUILTIN_PROMPTS[:prompts] if prompts > 0 else BUILTIN_PROMPTS
        err.print(f"loading {model} ...")
        target = load_model(model, device=device, dtype=dtype)
        configs = default_configs(drafter, k, selector, length, static=not no_static)
        total = len(chosen) * len(configs) * repeats
        with Progress(console=err, transient=True) as bar:
            task = bar.add_task("bench", total=total + (1 if costs else 0))

            def step(msg: str) -> None:
                bar.update(task, description=msg[:70], advance=1)

            report = run_bench(target, configs, chosen, max_new_tokens, repeats,
                               measure_costs=costs, progress=step)
    except AdaspecError as exc:
        _fail(exc)
        return
    out = Console() if sys.stdout.isatty() else Console(width=140)
    table = Table(title=f"adaspec bench: {model}, greedy, {len(chosen)} prompts x "
                        f"{max_new_tokens} new tokens, {repeats} repeat(s), median times")
    cols = ["configuration", "tokens/s", "speed-up", "MAT", "acceptance", "discard", "verify",
            "identical to AR", "overhead/round"] + (["rounds in cost cliff"] if report.verify_costs else [])
    for col in cols:
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for r in report.results:
        same = f"{r.identical}/{r.prompts}"
        table.add_row(escape(r.name), f"{r.tokens_per_s:.1f}", f"{report.speedup(r):.2f}x", f"{r.mat:.2f}",
                      f"{r.acceptance_rate:.1%}", f"{r.discard_rate:.2f}",
                      f"{r.verification_rate:.2f}", same if r.identical == r.prompts else f"[red]{same}[/]",
                      f"{r.overhead_share:.2%}",
                      *([f"{r.cliff_share:.0%}"] if report.verify_costs else []))
    out.print(table)
    for r in report.results:
        for m in r.mismatches:
            out.print(f"[red]MISMATCH[/] {escape(r.name)}: {escape(m)}")
    if report.verify_costs:
        c = report.verify_costs
        out.print(f"verify-cost curve (target forward over k new tokens, {c['context']}-token cache, "
                  "relative to k=1):")
        out.print("  " + "  ".join(f"k={kk}:{ratio:.2f}x" for kk, ratio in zip(c["ks"], c["ratios"])))
        if c["cliffs"]:
            out.print(f"  cost cliffs at k={c['cliffs']}: a longer block is cheaper to verify there")
    out.print("discard = discarded drafts per token, verify = target forwards per token "
              "(SpecDec++ eq. 5.1)")
    if json_out:
        save_report(report, json_out)
        out.print(f"report written to {json_out}")
    if any(r.mismatches for r in report.results):
        raise typer.Exit(1)


@app.command()
def costs(
    model: str = typer.Option("smollm2", "--model", "-m", help=MODEL_HELP),
    device: str = typer.Option("cpu"),
    dtype: str = typer.Option("float32"),
    refresh: bool = typer.Option(False, help="measure again instead of using the cache"),
) -> None:
    """Measure (or show the cached) verify-cost curve of a target."""
    from .costs import load_or_measure
    from .models import load_model

    try:
        curve = load_or_measure(load_model(model, device=device, dtype=dtype), refresh=refresh)
    except AdaspecError as exc:
        _fail(exc)
        return
    print(curve.table())


@app.command("train-head")
def train_head_cmd(
    model: str = typer.Option("smollm2", "--model", "-m", help=MODEL_HELP),
    drafter: str = typer.Option("self", "--drafter", "-d",
                                help="drafter the head is for: model:REF (same tokenizer as the "
                                     "target), early-exit:layers=N (the target's first N layers) "
                                     "or self (the target itself)"),
    prompts: str | None = typer.Option(None, help="text file, one prompt per line "
                                                     "(default: the built-in bench prompts)"),
    out: str = typer.Option("specdecpp-head.pt", "--out", "-o", help="where to write the head file"),
    epochs: int = typer.Option(20, help="training epochs over the collected examples"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n",
                                       help="length of each target response"),
    w_rej: float = typer.Option(6.0, "--w-rej", help="BCE weight of rejections (paper: 6)"),
    depth: int = typer.Option(3, "--depth", help="residual layers D of the head (paper: 3)"),
    mix_ratio: float = typer.Option(0.15, "--mix-ratio", help="share r of target tokens mixed in"),
    lr: float = typer.Option(1e-3, help="Adam learning rate (cosine schedule)"),
    batch_size: int = typer.Option(32, "--batch-size"),
    temperature: float = typer.Option(0.0, "--temperature", "-t",
                                      help="decoding mode to train for: 0 = greedy, else sampling"),
    top_k: int = typer.Option(0, help="top-k of the sampling mode (0 = off)"),
    top_p: float = typer.Option(1.0, help="top-p of the sampling mode"),
    seed: int = typer.Option(0, help="seed for the split, sampling, mixing and initialisation"),
    device: str = typer.Option("cpu"),
    dtype: str = typer.Option("float32"),
) -> None:
    """Train a SpecDec++ acceptance head for a drafter (use it with --length specdecpp:head=PATH)."""
    import time as _time
    from pathlib import Path

    from rich.progress import Progress

    from .headtrain import HeadTrainConfig, train_head
    from .models import load_model
    from .prompts import BUILTIN_PROMPTS

    try:
        if prompts is not None:
            path = Path(prompts).expanduser()
            if not path.is_file():
                raise AdaspecError(f"prompt file not found: {prompts}: pass a text file with one "
                                   "prompt per line")
            chosen: list = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        else:
            chosen = [p.text for p in BUILTIN_PROMPTS]
        cfg = HeadTrainConfig(prompts=chosen, max_new_tokens=max_new_tokens, epochs=epochs, lr=lr,
                              batch_size=batch_size, w_rej=w_rej, depth=depth, mix_ratio=mix_ratio,
                              seed=seed, temperature=temperature, top_k=top_k, top_p=top_p)
        spec = drafter.strip()
        kind, _, ref = spec.partition(":")
        if not (spec == "self" or (kind in ("model", "early-exit") and ref.strip())):
            raise AdaspecError(f"--drafter {drafter!r}: use model:REF (a model sharing the target's "
                               "tokenizer), early-exit:layers=N or self")
        err.print(f"loading {model} ...")
        target = load_model(model, device=device, dtype=dtype)
        if spec == "self":
            draft_model = target
            err.print("[yellow]note:[/] drafter 'self' is the target itself, so every draft is "
                      "accepted (P = 1): the head is only a smoke test of the pipeline")
        elif kind == "early-exit":
            from .drafters import early_exit_model, parse_params

            params = parse_params(ref, f"drafter {spec!r}")
            if set(params) != {"layers"} or not params["layers"].isdigit():
                raise AdaspecError(f"--drafter {spec!r}: write early-exit:layers=N")
            draft_model = early_exit_model(target, int(params["layers"]))
        else:
            from .drafters import check_same_vocabulary

            draft_model = load_model(ref.strip(), device=device, dtype=dtype)
            check_same_vocabulary(target, draft_model)
        start = _time.perf_counter()
        with Progress(console=err, transient=True) as bar:
            tasks: dict[str, int] = {}

            def progress(stage: str, done: int, total: int) -> None:
                if stage not in tasks:
                    tasks[stage] = bar.add_task(stage, total=total)
                bar.update(tasks[stage], completed=done)

            def on_epoch(s) -> None:
                err.print(f"epoch {s.epoch:3d}: train loss {s.train_loss:.4f}  held-out loss "
                          f"{s.eval_loss:.4f}  eval KL {s.eval_kl:.4f}  mean predicted "
                          f"{s.eval_pred_mean:.3f}")

            result = train_head(target, draft_model, cfg, out=out, progress=progress,
                                on_epoch=on_epoch)
        total = _time.perf_counter() - start
    except AdaspecError as exc:
        _fail(exc)
        return
    f = result.final
    print(f"{result.n_prompts} prompts, {result.n_train} training / {result.n_eval} held-out "
          f"positions, mean acceptance {result.mean_acceptance:.3f}")
    print(f"held-out: weighted BCE {f.eval_loss:.4f}, BCE "
          f"{f.eval_bce:.4f}, eval KL {f.eval_kl:.4f} (constant predictor: "
          f"{result.eval_kl_constant:.4f}), mean predicted acceptance {f.eval_pred_mean:.3f}")
    print(f"time: {total:.1f} s (responses {result.generate_s:.1f} s, examples "
          f"{result.collect_s:.1f} s, training {result.train_s:.1f} s)")
    print(f"head written to {result.path}: use it with --length specdecpp:head={result.path}")


def main() -> None:  # pragma: no cover
    logging.basicConfig(level=logging.WARNING)
    app()
