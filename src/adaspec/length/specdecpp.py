"""SpecDec++: a trained acceptance head on the drafter's hidden state decides when to stop.

The head f (a (D+1)-layer residual MLP with SiLU, SpecDec++ 5.1) maps the drafter's final
hidden state e_i at drafted token y_i to a logit; sigmoid(f(e_i)) predicts the probability
that y_i is accepted given that y_1..y_{i-1} were (eq. 4.1). Drafting stops once the
predicted probability that at least one candidate is rejected, 1 - prod_i sigmoid(f(e_i)),
exceeds the threshold h (Algorithm 1, motivated by Theorem 4.3). Heads are trained by
``adaspec.headtrain`` (SpecDec++ 4.4) and stored as one ``torch.save`` file.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..drafters.base import Decision, DraftStep
from ..errors import AdaspecError, ConfigError
from .base import LengthCaps, LengthPolicy

log = logging.getLogger(__name__)

HEAD_FORMAT = "adaspec-acceptance-head"
HEAD_VERSION = 1


class _ResBlock(nn.Module):
    """x + SiLU(W x + b): one residual layer of the head (SpecDec++ 5.1)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class AcceptanceHead(nn.Module):
    """SpecDec++ acceptance prediction head (5.1, eq. 4.1): D residual SiLU layers and a final
    linear layer (D + 1 linear layers in all; D = 0 is a linear probe) -> one logit whose
    sigmoid is the predicted acceptance probability of the drafted token.

    Inputs are standardised per dimension with ``in_mean`` / ``in_std`` (buffers set from the
    training features; identity by default) so that hidden states of any scale train well.
    Unlike the reference code, each residual block has its own weights.
    """

    def __init__(self, hidden_size: int, depth: int = 3):
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size < 1:
            raise ConfigError(f"hidden_size must be a positive integer, got {hidden_size!r}")
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise ConfigError(f"depth D must be an integer >= 0 (paper default 3), got {depth!r}")
        self.hidden_size, self.depth = hidden_size, depth
        self.register_buffer("in_mean", torch.zeros(hidden_size))
        self.register_buffer("in_std", torch.ones(hidden_size))
        self.blocks = nn.ModuleList(_ResBlock(hidden_size) for _ in range(depth))
        self.out = nn.Linear(hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of acceptance, shape ``hidden.shape[:-1]``."""
        x = (hidden.to(self.in_mean.dtype) - self.in_mean) / self.in_std
        for block in self.blocks:
            x = block(x)
        return self.out(x).squeeze(-1)

    def set_input_stats(self, features: torch.Tensor) -> None:
        """Standardise inputs with the mean / std of ``features`` [n, hidden]."""
        with torch.no_grad():
            self.in_mean.copy_(features.mean(0))
            self.in_std.copy_(features.std(0, unbiased=False).clamp_min(1e-5))

    @torch.inference_mode()
    def predict(self, hidden: torch.Tensor) -> float:
        """Predicted acceptance probability for one hidden state [hidden_size]."""
        return float(torch.sigmoid(self(hidden)))


@dataclass
class HeadFile:
    """A trained head and what it was trained for (the contents of a head file)."""

    head: AcceptanceHead
    drafter: dict[str, Any] = field(default_factory=dict)  # name, hidden_size, vocab_size
    training: dict[str, Any] = field(default_factory=dict)  # settings and held-out metrics

    @property
    def hidden_size(self) -> int:
        return self.head.hidden_size


def drafter_info(drafter: Any) -> dict[str, Any]:
    """Metadata identifying a drafter (a ``LoadedModel``): name, hidden size, vocabulary size."""
    return {"name": str(drafter.name), "hidden_size": hidden_size_of(drafter.model),
            "vocab_size": int(drafter.vocab_size)}


def hidden_size_of(model: Any) -> int:
    """Width of a causal LM's final hidden state."""
    size = getattr(model.config, "hidden_size", None)
    if size is None:
        size = model.get_input_embeddings().weight.shape[-1]
    return int(size)


def save_head(path: str | Path, head: AcceptanceHead, drafter: dict[str, Any],
              training: dict[str, Any] | None = None) -> Path:
    """Write a head file: state_dict, config (hidden size, D) and the drafter's metadata."""
    path = Path(path).expanduser()
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().clone() for k, v in head.state_dict().items()}
    torch.save({"format": HEAD_FORMAT, "version": HEAD_VERSION, "state_dict": state,
                "config": {"hidden_size": head.hidden_size, "depth": head.depth},
                "drafter": dict(drafter), "training": dict(training or {})}, path)
    return path


def _mismatch(path: Any, head_size: int, meta: dict[str, Any], drafter_desc: str,
              drafter_size: int) -> AdaspecError:
    return AdaspecError(
        f"acceptance head {str(path)!r} was trained for drafter {meta.get('name', '?')!r} with "
        f"hidden size {head_size}, but {drafter_desc} has hidden size {drafter_size}: "
        f"train a head for this drafter (`adaspec train-head --drafter ...`) or use the drafter "
        "the head was trained for")


def load_head(path: str | Path, drafter: Any = None) -> HeadFile:
    """Read a head file; with ``drafter`` (a ``LoadedModel``) check that it fits that drafter.

    A different hidden size is an error (the head cannot run); a different name or vocabulary
    size only logs a warning (the same architecture may have been renamed or re-saved).
    """
    p = Path(str(path)).expanduser()
    if not p.is_file():
        raise AdaspecError(f"acceptance head file not found: {str(path)!r}: check the path or "
                           "train one with `adaspec train-head --out PATH`")
    try:
        blob = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling errors have many types
        raise AdaspecError(f"{str(path)!r} is not a readable acceptance head file ({exc}): "
                           "train one with `adaspec train-head`") from None
    if not isinstance(blob, dict) or blob.get("format") != HEAD_FORMAT:
        raise AdaspecError(f"{str(path)!r} is not an adaspec acceptance head file: "
                           "train one with `adaspec train-head`")
    if int(blob.get("version", 0)) > HEAD_VERSION:
        raise AdaspecError(f"{str(path)!r} has head format version {blob['version']}, newer than "
                           f"this adaspec ({HEAD_VERSION}): upgrade adaspec or retrain the head")
    cfg = blob["config"]
    head = AcceptanceHead(int(cfg["hidden_size"]), int(cfg["depth"]))
    head.load_state_dict(blob["state_dict"])
    head.eval()
    out = HeadFile(head, dict(blob.get("drafter", {})), dict(blob.get("training", {})))
    if drafter is not None:
        info = drafter_info(drafter)
        if info["hidden_size"] != head.hidden_size:
            raise _mismatch(path, head.hidden_size, out.drafter, f"drafter {info['name']!r}",
                            info["hidden_size"])
        for key in ("name", "vocab_size"):
            if key in out.drafter and out.drafter[key] != info[key]:
                log.warning("acceptance head %s was trained for drafter %s=%r, used with %r",
                            path, key, out.drafter[key], info[key])
    return out


class SpecDecPPPolicy(LengthPolicy):
    """SpecDec++ stopping rule (Algorithm 1, Theorem 4.3): stop drafting when the predicted
    probability that some candidate is rejected, 1 - prod_i sigmoid(f(e_i)), exceeds ``h``;
    at most ``max_len`` candidates per round (5.1). Defaults h = 0.7, max_len = 20 (5.3, D.3).

    Timing, as in Algorithm 1: the hidden state the engine passes with drafted token y_i
    (``DraftStep.hidden``) is e_{i-1}, the drafter's final state *at* y_{i-1}, computed by the
    forward pass that produced q_i. So at step i the product gains the factor for y_{i-1}
    (the first step has no factor: its hidden state belongs to the verified context), and
    when the threshold is crossed Algorithm 1 breaks *after* sampling y_i: both y_{i-1} (the
    token whose predicted acceptance crossed h) and y_i are kept (``Decision.STOP``). Hence
    a round has at least two candidates (the reference code's bound (2, 20)).

    Model-free drafters (prompt lookup, suffix; ``hidden`` is None) have no hidden state to
    run the head on: for them the policy is static K = ``fallback_k`` (capped by
    ``max_len``); they may still stop earlier when they run out of proposals.

    Params: ``head`` (path of a head file from ``adaspec train-head``; an ``AcceptanceHead``
    or ``HeadFile`` object also works), ``h`` in [0, 1], ``max_len`` >= 1, ``fallback_k`` >= 1.
    """

    name = "specdecpp"
    caps = LengthCaps(needs_hidden=True)
    #: the trained head is loaded from the spec, not learnt: never stored (``persist``)
    state_skip = ("head_file", "head")

    def __init__(self, head: Any = None, h: float = 0.7, max_len: int = 20, fallback_k: int = 5,
                 **kwargs: Any):
        super().__init__(**kwargs)
        if head is None or (isinstance(head, str) and not head.strip()):
            raise ConfigError("specdecpp needs a trained acceptance head: pass head=PATH "
                              "(train one with `adaspec train-head --out PATH`)")
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0.0 <= h <= 1.0:
            raise ConfigError(f"specdecpp threshold h must be a number in [0, 1], got {h!r}: "
                              "use the paper's 0.7 (higher drafts longer)")
        for key, value in (("max_len", max_len), ("fallback_k", fallback_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"specdecpp {key} must be an integer >= 1, got {value!r}: "
                                  f"use e.g. {key}={20 if key == 'max_len' else 5}")
        if isinstance(head, HeadFile):
            self.head_file = head
        elif isinstance(head, AcceptanceHead):
            self.head_file = HeadFile(head)
        else:
            self.head_file = load_head(head)
        self.head = self.head_file.head.eval()
        self.head_path = None if isinstance(head, (HeadFile, AcceptanceHead)) else str(head)
        self.h, self.max_len = float(h), max_len
        self.fallback_k = min(fallback_k, max_len)
        self._trained_greedy = self._trained_mode()
        self._warned_mode = False
        self._p_all = 1.0  # predicted probability that every candidate so far is accepted

    def _trained_mode(self) -> bool | None:
        temp = self.head_file.training.get("temperature")
        return None if temp is None else float(temp) == 0.0

    def begin_round(self, drafter: int) -> int:
        self._p_all = 1.0
        return self.max_len

    @property
    def predicted_rejection(self) -> float:
        """1 - prod_i sigmoid(f(e_i)) over the candidates scored so far this round."""
        return 1.0 - self._p_all

    def decide(self, step: DraftStep) -> Decision:
        if step.hidden is None:  # model-free drafter: static fallback_k
            return Decision.STOP if step.index + 1 >= self.fallback_k else Decision.CONTINUE
        if step.index == 0:  # e_0 is the last verified token: nothing to score yet (Alg. 1)
            return Decision.CONTINUE
        hidden = step.hidden
        if hidden.shape[-1] != self.head.hidden_size:
            raise _mismatch(self.head_path or "<head>", self.head.hidden_size, self.head_file.drafter,
                            "the drafter in use", int(hidden.shape[-1]))
        self._check_mode(step)
        with torch.inference_mode():
            logit = float(self.head(hidden.reshape(-1)))
        self._p_all *= 1.0 / (1.0 + math.exp(-logit)) if logit > -700 else 0.0
        return Decision.STOP if 1.0 - self._p_all > self.h else Decision.CONTINUE

    def _check_mode(self, step: DraftStep) -> None:
        if self._warned_mode or self._trained_greedy is None:
            return
        greedy = step.probs is None
        if greedy != self._trained_greedy:
            self._warned_mode = True
            log.warning("acceptance head was trained for %s decoding but is used with %s decoding: "
                        "its acceptance predictions may be miscalibrated (retrain with "
                        "`adaspec train-head --temperature ...`)",
                        "greedy" if self._trained_greedy else "sampled",
                        "greedy" if greedy else "sampled")


__all__ = ["AcceptanceHead", "HeadFile", "SpecDecPPPolicy", "save_head", "load_head",
           "drafter_info", "hidden_size_of", "HEAD_FORMAT"]
