"""Generation and sampling settings (dataclasses) with validation that names the fix."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ConfigError


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. ``temperature == 0`` means greedy decoding.

    Temperature, top-k and top-p are applied identically to the target's p and to every
    drafter's q, so speculative sampling reproduces exactly the target's *processed*
    distribution (the distribution plain sampling with these settings would use).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature != self.temperature:
            raise ConfigError(f"temperature must be a number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ConfigError(
                f"temperature must be >= 0, got {self.temperature}: use 0 for greedy decoding "
                "or a positive value (e.g. 0.7) for sampling"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(
                f"top_p must be in (0, 1], got {self.top_p}: use 1.0 to disable nucleus sampling"
            )
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}: use 0 to disable top-k")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class GenerationConfig:
    """Per-request settings: length, stopping and sampling."""

    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    chat_template: bool = True
    stop_on_eos: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(
                f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}"
            )
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty: remove the empty string from stop")


def validate_k(k: int) -> int:
    """Check a fixed draft length."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(
            f"draft length k must be an integer >= 1, got {k!r}: use k=1..16 "
            "(plain decoding without drafts is drafter 'none')"
        )
    return k


def validate_scope(scope: str) -> str:
    """Check a learner's state scope: 'request' (reset per request) or 'global' (warm start)."""
    if scope not in ("request", "global"):
        raise ConfigError(f"scope must be 'request' or 'global', got {scope!r}")
    return scope
