"""Test helpers: one row of an engine's round (``adaspec.round``), for tests that exercise a
single step of the round (a chain from a look, a tree's cut) without decoding a request."""

from __future__ import annotations

from collections.abc import Sequence

from adaspec.config import GenerationConfig, SamplingConfig
from adaspec.drafters import Decision, Draft
from adaspec.round import PhaseTimes, Round, Row, RowPlan


def row_of(engine, tokens: Sequence[int], max_new_tokens: int = 64,
           sampling: SamplingConfig | None = None) -> tuple[Round, Row]:
    """The engine's round and a row of its own parts at context ``tokens`` (its policies begun)."""
    rnd = Round(engine.decode, engine.eos_ids(), clock=engine._timer)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling or SamplingConfig())
    row = Row.new(0, engine.parts(), list(tokens), cfg, engine.target.device, 0.0)
    row.seen = [len(tokens)] * len(row.parts.drafters)
    row.started = True
    return rnd, row


def draft_chain(engine, i: int, tokens, cap: int, peeked: dict, sampling=None, generator=None, decide=None) -> Draft:
    """Drafter ``i``'s chain of at most ``cap`` tokens as the round drafts it (``Round.draft_chain``)."""
    rnd, row = row_of(engine, tokens, sampling=sampling)
    row.generator = generator
    plan = RowPlan(i, cap, cap, Draft(), None, 0, PhaseTimes.at(0.0), bool(peeked), dict(peeked))
    return rnd.draft_chain(row, plan, decide or (lambda step: Decision.CONTINUE))


def draft_tree(engine, i: int, tokens, cap: int, room: int, sampling=None):
    """Drafter ``i``'s tree as the round cuts it (``Round.draft_tree``; None: a chain)."""
    rnd, row = row_of(engine, tokens, max_new_tokens=room + 1, sampling=sampling)
    return rnd.draft_tree(row, i, cap, room)
