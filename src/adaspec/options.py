"""Checks of command-line options, run by every command before it loads a model or starts work
(the CLI's and the tool packages' commands alike: ``adaspec.cli.options`` re-exports them).

A bad option must cost milliseconds, not a model load or a benchmark run that fails at its
end. Each check raises ``AdaspecError`` naming the option, the problem and the fix; the
commands call them first and print the message (exit code 2). Checks here never load weights:
model specs are only located (``models.locate_model``) and component specs are parsed against
their registered parameters (``registry.Registry.parse``), which builds nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from .errors import AdaspecError


def fail(exc: Exception) -> NoReturn:
    """Print a user error on stderr and exit with code 2. Markup-escaped (brackets in a message
    print as they are) and not hard-wrapped, so a path in it stays one piece to copy."""
    import typer
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
    raise typer.Exit(2) from None


def check_target(model: str, device: str = "cpu", dtype: str | None = None,
                 backend: str = "transformers", linear: str = "auto", flash_attn: bool | None = None,
                 weights: str = "auto") -> None:
    """``--model``, ``--device``, ``--dtype``, ``--backend``, ``--linear``, ``--flash-attn`` and
    ``--weights`` of a command that loads a target."""
    import importlib.util

    from .backends.base import check_backend
    from .models import check_device, check_linear, locate_model, resolve_dtype
    from .quant import check_weights

    backend = check_backend(backend)
    check_linear(linear, backend)
    if flash_attn is not None and not isinstance(flash_attn, bool):
        raise AdaspecError(f"flash_attn must be true or false, got {flash_attn!r}")
    gguf = locate_model(model)
    if backend == "llama.cpp":
        from .backends.llamacpp import INSTALL_HINT

        if gguf is None:
            raise AdaspecError(f"--backend llama.cpp runs GGUF files, and --model {model!r} is not one: "
                               "pass a .gguf file, 'smollm2' or a fetched model, or use --backend transformers")
        if dtype is not None:
            raise AdaspecError("--dtype is not an option with --backend llama.cpp (it computes with the "
                               "GGUF file's own weights): drop --dtype")
        if str(device) != "cpu":
            check_device(device, "--device")
        check_weights(weights, gguf=True, device=check_device("cpu"), dtype=None, linear=linear, backend=backend)
        if importlib.util.find_spec("llama_cpp") is None:
            raise AdaspecError(f"--backend llama.cpp: {INSTALL_HINT}")
        return
    if flash_attn is not None:
        raise AdaspecError("--flash-attn/--no-flash-attn is for --backend llama.cpp (transformers runs "
                           "PyTorch's attention): drop it, or add --backend llama.cpp")
    dev = check_device(device, "--device")
    torch_dtype = resolve_dtype(dtype)
    check_weights(weights, gguf=gguf is not None, device=dev, dtype=None if dtype is None else torch_dtype,
                  linear=linear, backend=backend)


def check_drafters(specs: Iterable[str], option: str = "--drafter") -> None:
    """Every drafter spec names a registered drafter with valid parameters and existing files
    (``registry.Registry.parse``: nothing is built, no model is loaded)."""
    from .drafters import parse_drafter

    for spec in specs:
        try:
            parse_drafter(spec)
        except AdaspecError as exc:
            raise AdaspecError(f"{option} {spec!r}: {exc}") from None


def check_policies(selectors: Iterable[str | None] = (), lengths: Iterable[str | None] = (),
                   ks: Iterable[int] = (5,)) -> None:
    """Selector and length-policy specs, and draft lengths K. A spec is parsed against its
    policy's parameters (``registry.Registry.parse``); a policy's constructor is the check of
    its values (pure, no model: e.g. ``auto:peek=3``), so the policy is also built, then dropped."""
    from .config import validate_k
    from .length import build_length
    from .selection import build_selector

    for k in ks:
        validate_k(k)
    for spec in selectors:
        build_selector(spec)
    for spec in lengths:
        build_length(spec)


def check_tree(tree: bool, backend: str = "transformers", nodes: int | None = None) -> None:
    """``--tree`` (draft trees run on the transformers backend) and ``--tree-nodes``."""
    from .backends.base import check_backend

    if not tree:
        return
    if check_backend(backend) != "transformers":
        raise AdaspecError(f"--tree: draft trees are verified on the transformers backend, not {backend} "
                           "(not implemented there yet): drop --tree or use --backend transformers")
    check_number("--tree-nodes", nodes, low=1, integer=True)


def check_number(option: str, value: Any, *, low: float | None = None, high: float | None = None,
                 integer: bool = False, low_open: bool = False) -> None:
    """``value`` is a (finite) number in [low, high] (``low_open``: (low, high]); None passes."""
    if value is None:
        return
    kind = "an integer" if integer else "a number"
    ok = (isinstance(value, int) if integer else isinstance(value, (int, float))) and not isinstance(value, bool)
    ok = ok and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        bounds = []
        if low is not None:
            bounds.append(f"{'>' if low_open else '>='} {low:g}")
        if high is not None:
            bounds.append(f"<= {high:g}")
        raise AdaspecError(f"{option} {value!r}: must be {kind}" + (f" {' and '.join(bounds)}" if bounds else ""))


def check_sampling(temperature: float | Sequence[float] | None, top_p: float = 1.0, top_k: int = 0) -> None:
    """Temperature(s) >= 0, top-p in (0, 1], top-k >= 0."""
    temps = temperature if isinstance(temperature, (list, tuple)) else [temperature]
    for t in temps:
        check_number("--temperature", t, low=0.0)
    check_number("--top-p", top_p, low=0.0, high=1.0, low_open=True)
    check_number("--top-k", top_k, low=0, integer=True)


def check_path(option: str, path: str | Path | None, kind: str = "file", hint: str = "") -> None:
    """``path`` exists and is a file (``kind="file"``) or a directory (``kind="dir"``)."""
    if path is None:
        return
    p = Path(path).expanduser()
    ok = p.is_file() if kind == "file" else p.is_dir()
    if not ok:
        what = "file" if kind == "file" else "directory"
        raise AdaspecError(f"{option} {str(path)!r}: no such {what}" + (f": {hint}" if hint else ""))


__all__ = ["check_drafters", "check_number", "check_path", "check_policies",
           "check_sampling", "check_target", "check_tree"]
