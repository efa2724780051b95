"""Train the ``router`` baseline (selection/router.py) from a recorded trace (``adaspec train-router``).

Every static configuration (each recorded model-free or model drafter at each K, and plain
decoding) is replayed on every recorded prompt; a prompt's label is the configuration replay
predicts fastest on it. A softmax regression on the prompt's features is then fitted by
full-batch gradient descent with L2 (deterministic: zero start, fixed steps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from ..errors import AdaspecError, ConfigError
from ..selection.router import FEATURES, RouterModel, prompt_features, prompt_hash

DEFAULT_KS = (2, 3, 4, 5, 6, 8)


def label_prompts(trace, ks: Sequence[int] = DEFAULT_KS,
                  progress: Callable[[str, int, int], None] | None = None) -> tuple[list[tuple[str, int]], list[int]]:
    """(classes, label per prompt): the fastest static (drafter name, K) of each recorded prompt
    by replay's predicted seconds, plain decoding as (``"none"``, 0)."""
    from ..bench.replay import replay

    classes: list[tuple[str, int]] = [("none", 0)]
    seconds: list[list[float]] = []
    specs = [s for s in trace.specs if s != "none"]
    total = len(specs) * len(ks)
    done = 0
    ar = None
    for spec, name in zip(trace.specs, trace.names):
        if spec == "none":
            continue
        for k in ks:
            res = replay(trace, None, None, k=k, drafters=[spec])
            if ar is None:
                ar = [p.ar_seconds for p in res.prompts]
            classes.append((name, k))
            seconds.append([p.seconds for p in res.prompts])
            done += 1
            if progress:
                progress("replaying static configurations", done, total)
    if ar is None:
        raise ConfigError("the trace records no drafter: record one with -d prompt-lookup -d suffix ...")
    table = np.array([ar, *seconds])  # [class, prompt]
    return classes, [int(i) for i in table.argmin(axis=0)]


def fit_softmax(x: np.ndarray, y: Sequence[int], n_classes: int, l2: float = 1e-2,
                steps: int = 2000, lr: float = 0.5) -> np.ndarray:
    """Multinomial logistic regression weights [class, feature + bias] (x standardised)."""
    n = x.shape[0]
    xb = np.hstack([x, np.ones((n, 1))])
    w = np.zeros((n_classes, xb.shape[1]))
    onehot = np.zeros((n, n_classes))
    onehot[np.arange(n), list(y)] = 1.0
    for _ in range(steps):
        z = xb @ w.T
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        grad = (p - onehot).T @ xb / n + l2 * np.hstack([w[:, :-1], np.zeros((n_classes, 1))])
        w -= lr * grad
    return w


def train_router(trace, ks: Sequence[int] = DEFAULT_KS, l2: float = 1e-2,
                 progress: Callable[[str, int, int], None] | None = None) -> RouterModel:
    """A router trained on every prompt of ``trace``."""
    if len(trace.prompts) < 2:
        raise ConfigError(f"the trace has {len(trace.prompts)} prompt(s): a router needs several "
                          "(record a suite with --per-category 4 or more)")
    classes, labels = label_prompts(trace, ks, progress)
    x = np.array([prompt_features(p.prompt) for p in trace.prompts])
    mean, std = x.mean(axis=0), x.std(axis=0)
    std[std < 1e-9] = 1.0
    w = fit_softmax((x - mean) / std, labels, len(classes), l2=l2)
    counts = {f"{n}:k={k}": labels.count(i) for i, (n, k) in enumerate(classes) if labels.count(i)}
    return RouterModel(classes=classes, mean=mean.tolist(), std=std.tolist(), weights=w.tolist(),
                       trained_on=[prompt_hash(p.prompt) for p in trace.prompts],
                       meta={"trace_prompts": len(trace.prompts), "labels": counts, "ks": list(ks),
                             "features": list(FEATURES), "l2": l2})


def train_router_command(
    trace_path: Annotated[str, typer.Argument(help="a trace recorded by adaspec bench --record")],
    out: Annotated[str, typer.Option("--out", "-o", help="router file to write (.json)")],
    ks: Annotated[str, typer.Option("--ks", help="comma-separated K values to consider")] = "2,3,4,5,6,8",
    l2: Annotated[float, typer.Option(help="L2 weight of the softmax regression")] = 1e-2,
) -> None:
    """Train the per-prompt router baseline (MetaSD 4.3) on a recorded trace; use it with
    -s router:path=OUT on prompts it was not trained on."""
    from rich.console import Console

    from ..bench.trace import Trace
    from ..options import fail
    from ..progress import StageProgress

    err = Console(stderr=True)
    try:
        try:
            k_list = [int(x) for x in ks.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--ks must be comma-separated integers, got {ks!r}: pass e.g. --ks 3,5,8") from None
        if not k_list or any(k < 1 for k in k_list):
            raise ConfigError(f"--ks needs integers >= 1, got {ks!r}")
        if l2 < 0:
            raise ConfigError(f"--l2 must be >= 0, got {l2}")
        if not Path(out).parent.exists():
            raise ConfigError(f"--out {out}: the folder {Path(out).parent} does not exist")
        trace = Trace.load(trace_path)
        with StageProgress(err) as bar:
            model = train_router(trace, k_list, l2, progress=bar)
        model.save(out)
    except AdaspecError as exc:
        fail(exc)
    print(f"{out}: router over {len(model.classes)} classes trained on {len(trace.prompts)} prompts; "
          f"labels {model.meta['labels']}; use it with -s router:path={out}")
