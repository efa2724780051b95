"""``router``: the offline baseline of MetaSD 4.3 / Not-a-Bandit 4.5 -- a per-prompt classifier,
trained on recorded traces, that picks one drafter and one K for the whole request.

It sees only the prompt (no online feedback), so it is what an adaptive controller must beat
to justify learning online. Features are cheap functions of the prompt's token ids (how much
of it repeats, i.e. how much an answer could copy from it, and its length); the classifier is
a multinomial logistic regression (softmax, L2) whose classes are (drafter name, K) pairs,
with K = 0 for plain decoding. Training (``adaspec.training.router``) labels each recorded
prompt with its fastest static configuration, as predicted by replay.

A router must be scored on prompts it was not trained on: the model keeps a hash of every
training prompt, and the policy refuses to route one of them.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..drafters.base import Decision, DraftStep
from ..errors import AdaspecError, ConfigError
from ..length.base import LengthPolicy
from ..persist import state_type
from .base import DrafterPolicy, SelectorCaps

FORMAT = "adaspec.router/1"
FEATURES = ("log_prompt_tokens", "distinct_token_ratio", "repeated_bigram_rate", "repeated_4gram_rate",
            "log_longest_repeat")


def prompt_hash(ids: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def _repeated_rate(ids: Sequence[int], n: int) -> float:
    """Share of the prompt's n-grams that occurred earlier in it (what prompt lookup could copy)."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for i in range(len(ids) - n + 1):
        g = tuple(ids[i: i + n])
        total += 1
        hits += g in seen
        seen.add(g)
    return hits / total if total else 0.0


def _longest_repeat(ids: Sequence[int], cap: int = 64) -> int:
    """Length of the longest run of tokens that repeats an earlier run (capped; O(n cap))."""
    first: dict[int, list[int]] = {}
    best = 0
    for i, t in enumerate(ids):
        for j in first.get(t, [])[-8:]:  # the last few earlier occurrences of this token
            n = 0
            while i + n < len(ids) and n < cap and ids[j + n] == ids[i + n] and j + n < i:
                n += 1
            best = max(best, n)
        first.setdefault(t, []).append(i)
    return best


def prompt_features(ids: Sequence[int]) -> list[float]:
    """The router's features of a prompt (``FEATURES``), from token ids only."""
    n = len(ids)
    return [math.log1p(n), len(set(ids)) / n if n else 0.0, _repeated_rate(ids, 2), _repeated_rate(ids, 4),
            math.log1p(_longest_repeat(ids))]


@dataclass
@state_type
class RouterModel:
    """Softmax regression over (drafter name, K) classes on standardised prompt features."""

    classes: list[tuple[str, int]]
    mean: list[float]
    std: list[float]
    weights: list[list[float]]  # [class][feature + bias]
    trained_on: list[str]  # prompt hashes
    meta: dict[str, Any]

    def scores(self, ids: Sequence[int]) -> list[float]:
        x = [(v - m) / s for v, m, s in zip(prompt_features(ids), self.mean, self.std)] + [1.0]
        return [sum(w * xi for w, xi in zip(row, x)) for row in self.weights]

    def predict(self, ids: Sequence[int]) -> tuple[str, int]:
        s = self.scores(ids)
        return self.classes[max(range(len(s)), key=s.__getitem__)]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        data = {"format": FORMAT, "features": list(FEATURES), **asdict(self)}
        path.write_text(json.dumps(data, indent=1), encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> RouterModel:
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise AdaspecError(f"router file {path} not found: train one with `adaspec train-router TRACE -o {path}`") from None
        except ValueError as exc:
            raise AdaspecError(f"{path} is not a router file ({exc}): train one with `adaspec train-router`") from None
        if data.get("format") != FORMAT or data.get("features") != list(FEATURES):
            raise AdaspecError(f"{path}: format {data.get('format')!r}, expected {FORMAT!r} with features "
                               f"{list(FEATURES)}: train it again with this adaspec")
        return cls([tuple(c) for c in data["classes"]], data["mean"], data["std"], data["weights"],
                   data["trained_on"], data.get("meta", {}))


class RouterPolicy(DrafterPolicy):
    """``--selector router:path=FILE``: one drafter for the whole request, chosen from the prompt;
    paired with ``RouterLength`` (the chosen K; K = 0 is plain decoding)."""

    name = "router"
    caps = SelectorCaps(reads_prompt=True)
    #: the trained router is loaded from the spec, not learnt: never stored (``persist``)
    state_skip = ("model", "_trained")

    def __init__(self, path: str = "", **kwargs: Any):
        super().__init__(**kwargs)
        if not path:
            raise ConfigError("router needs path=FILE: a file written by `adaspec train-router`")
        self.model = RouterModel.load(path)
        self._trained = set(self.model.trained_on)
        self.choice: tuple[int, int] = (0, 0)

    def paired_length(self) -> RouterLength:
        return RouterLength(self)

    def observe_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Called by the engine with the request's prompt, after ``begin_request``."""
        if prompt_hash(prompt_ids) in self._trained:
            raise ConfigError("the router was trained on this prompt: score it on prompts it has not seen "
                              "(another suite, or a different --seed / --per-category selection)")
        name, k = self.model.predict(prompt_ids)
        if k == 0:
            self.choice = (self._none_or_first(), 0)
            return
        if name not in self.arm_names:
            raise ConfigError(f"the router picks drafter {name!r}, which is not loaded ({self.arm_names}): "
                              f"pass the drafters it was trained with ({sorted({c[0] for c in self.model.classes})})")
        self.choice = (self.arm_names.index(name), k)

    def _none_or_first(self) -> int:
        return self.arm_names.index("none") if "none" in self.arm_names else 0

    def select(self) -> int:
        return self.choice[0]


class RouterLength(LengthPolicy):
    """The router's K for the request (0: plain decoding)."""

    name = "router"

    def __init__(self, router: RouterPolicy):
        super().__init__()
        self.router = router

    def begin_round(self, drafter: int) -> int:
        return self.router.choice[1]

    def decide(self, step: DraftStep) -> Decision:
        return Decision.CONTINUE
