"""``--selector auto``: the drafter of ``auto``'s plan (``length.auto``: the controller that
picks the drafter and the draft length from the time per token each choice would cost, its
estimator, its looks and its paired length policy ``AutoLength``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..errors import ConfigError
from ..feedback import RoundContext, RoundFeedback
from ..length.auto import (DEFAULT_PRIOR, EVAL_SHARE, LOOK_SHARE, MATCH_BUCKETS, MAX_EVAL_BACKOFF,  # noqa: F401
                           MAX_LOOK_SKIP, MAX_PLAN_REST, MODEL_WARMUP, NONE_NAMES, AutoController, AutoLength,
                           ChainCounts, DecayClock, Plan, SharedCosts, chain_counts, check_confidence_stop,
                           check_share, expected_tokens, lower_bound, match_bucket, peek_chain, peek_context,
                           verify_floor)
from .base import DrafterPolicy, SelectorCaps


class AutoSelector(SharedCosts, DrafterPolicy):
    """``--selector auto``: the drafter of the controller's best (drafter, cap) plan; paired
    with ``AutoLength`` (the same controller) unless a length policy is given."""

    name = "auto"
    caps = SelectorCaps(scores_subset=True, prices_rounds=True, plans_jointly=True, forks_sharing=True)

    def __init__(self, max_k: int = 16, prior_weight: float = 8.0, request_decay: float = 0.98,
                 global_decay: float = 0.999, model_eval_every: int = 4, scope: str = "global",
                 peek: int | bool = 1, objective: str = "time", feedback: str = "full", seed: int | None = 0,
                 shrink: float = 1.0, peek_depth: int = 3, confidence_stop: int | bool = 1,
                 look_share: float = LOOK_SHARE, eval_share: float = EVAL_SHARE):
        super().__init__(seed=seed, scope=scope)
        check_share("eval_share", eval_share, "eval_share=0.005 (scoring model drafters costs at most that "
                     "share of the wall time), 1 for no budget")
        check_share("look_share", look_share, "look_share=0.005 (looks cost at most that share of a plain "
                     "round), 0 (default) to look every round")
        if peek not in (0, 1, True, False):
            raise ConfigError(f"peek must be 0 or 1, got {peek!r}: pass peek=1 to look at model-free "
                              "drafters' proposals before choosing, peek=0 not to")
        if isinstance(peek_depth, bool) or not isinstance(peek_depth, int) or not 1 <= peek_depth <= max_k:
            raise ConfigError(f"peek_depth must be an integer in 1..max_k ({max_k}), got {peek_depth!r}: "
                              "pass e.g. peek_depth=3")
        if feedback not in ("full", "bandit"):
            raise ConfigError(f"feedback must be 'full' or 'bandit', got {feedback!r}: 'bandit' learns from "
                              "the chosen drafter's rounds only (for ablations)")
        self.controller = AutoController(max_k, prior_weight, request_decay, global_decay,
                                         model_eval_every, scope, objective,
                                         shrink if feedback == "full" else 0.0)
        self.controller.learn_from_peeks = feedback == "full"
        self.controller.model_warmup = MODEL_WARMUP if feedback == "full" else 0
        self.controller.peek_depth = peek_depth
        self.controller.look_share = float(look_share)
        self.controller.eval_share = float(eval_share)
        self._full = feedback == "full"
        #: > 0: the engine shows this many tokens of every model-free drafter's proposal first
        self.peek_tokens = peek_depth if peek else 0
        self._is_model: list[bool] | None = None
        #: the paired length stops a model drafter's block on its confidence (``AutoLength``)
        self.confidence_stop = check_confidence_stop(confidence_stop)
        # looks skipped only with look_share > 0 (``AutoController.looks``): else the round
        # neither asks each round nor times the looks
        self.caps = replace(type(self).caps, looks=self.peek_tokens, skips_looks=look_share > 0,
                            forks_sharing=scope == "global", full_information=self._scores_others())

    def _scores_others(self) -> bool:
        """Ask the engine to score the other drafters? Not when it told which drafters run a
        model (``bind_drafters``) and none does: an engine that binds shows every block
        (``peek_tokens``), scored for free (``peek_chain``), and its scoring costs 0.3-0.5 ms a
        round, 3-5% of a llama.cpp forward of SmolLM2. Unbound (a caller that may not look):
        yes."""
        bound_model_free = self._is_model is not None and not any(self._is_model)
        return self._full and not (self.peek_tokens and bound_model_free)

    def bind(self, drafters: Sequence[Any], trees: Sequence[bool]) -> None:
        self.bind_drafters([d.runs_model for d in drafters])
        self.bind_families([d.family for d in drafters])

    def bind_drafters(self, is_model: Sequence[bool]) -> None:
        """Which drafters run a network (the engine tells; evaluated less often, never looked at)."""
        self._is_model = list(is_model)
        self.caps = replace(self.caps, full_information=self._scores_others())

    def looks(self) -> bool:
        return self.controller.looks()

    def shared_state(self) -> list[Any]:
        return self.controller.shared_state()

    def bind_families(self, families: Sequence[str]) -> None:
        """Each drafter's family (``drafters.drafter_family``; the engine and replay tell):
        agreement between looked-at blocks counts only across families (``peek_context``)."""
        self.controller.families = list(families)

    def begin_request(self, drafter_names: Sequence[str]) -> None:
        self.n_arms, self.arm_names = len(drafter_names), list(drafter_names)
        self.controller.begin_request(drafter_names, self._is_model)

    def paired_length(self) -> AutoLength:
        return AutoLength(controller=self.controller, confidence_stop=self.confidence_stop)

    def observe_proposals(self, blocks: dict[int, Any]) -> None:
        self.controller.observe_proposals(blocks)

    def select(self, ctx: RoundContext | None = None) -> int:
        return self.controller.choose(ctx).drafter

    def block_curve(self) -> list[tuple[float, int, int]] | None:
        """Expected tokens per cap for a batch's joint width (``AutoController.block_curve``)."""
        return self.controller.block_curve()

    def commit(self, k: int) -> None:
        """Play cap ``k`` this round (the batch's joint width less one)."""
        self.controller.commit(k)

    def evaluate(self, drafter: int) -> bool:
        return self.controller.evaluate(drafter)

    def to_score(self, chosen: int, score_chosen: bool = False) -> list[int]:
        return self.controller.to_score(chosen, score_chosen)

    def update(self, feedback: RoundFeedback) -> None:
        self.controller.observe(feedback)
