"""The drafter interface shared by every drafter.

A drafter proposes tokens one at a time; after each token the engine's length policy sees a
``DraftStep`` (the token, the drafter's distribution when it has one) and decides whether to
go on. Each drafter keeps its own state (KV cache, n-gram index) and catches up lazily on
tokens produced while it was not used (MetaSD H.1 switching cost). ``score`` is the
full-information hook (Not-a-Bandit 3.2): it prefills verified tokens and reports what the
drafter would have proposed at each of them, with no target call.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..config import SamplingConfig
from ..errors import AdaspecError
from ..trees import DraftTree, PrefixCut, TreeBudget
from ..persist import state_type
from ..registry import read_flags


@state_type
class Decision(enum.Enum):
    """What a length policy says after seeing one drafted token."""

    CONTINUE = "continue"  # keep the token and draft another
    STOP = "stop"  # keep the token and verify
    DISCARD = "discard"  # drop this token and verify the ones before it


@dataclass(frozen=True)
class StepStats:
    """Scalar statistics of the drafter's q at one drafted token: what the stopping rules of
    ``adaspec.length.rules`` read. Carried by a ``DraftStep`` that has no distribution (trace
    replay, ``adaspec.replay``); computed by ``adaspec.length.rules.stats_of``."""

    top1: float  # max_x q(x)
    top2: float  # second largest probability (0 for a one-token vocabulary)
    entropy: float  # H(q) in nats


@dataclass
class DraftStep:
    """One drafted token as a length policy sees it.

    ``probs`` is the drafter's processed distribution q (None for model-free drafters, whose
    proposals are deterministic); ``logits`` the raw logits and ``hidden`` the drafter's
    final hidden state when the drafter is a model (``hidden`` only if requested). ``stats``:
    precomputed statistics of q when neither ``probs`` nor ``logits`` is given (replay of a
    recorded model drafter); the live engine never sets it. ``support_probs`` /
    ``support_logits``: the same q on the drafter's own vocabulary when it drafts over a
    subset (a feature head's 8k of 49k tokens; q is 0 elsewhere): q's statistics are computed
    on them, the same values at a sixth of the work.
    """

    index: int  # 0-based position in the block
    token: int
    probs: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    stats: StepStats | None = None
    support_probs: torch.Tensor | None = None
    support_logits: torch.Tensor | None = None


@dataclass
class Draft:
    """A block of drafted tokens and the drafter's distributions at each of them.

    ``probs``: processed q rows [len, V] when sampling with a model drafter (used by the
    rejection sampler). ``logits``: raw logits rows under greedy decoding (for policies
    that want q). Both None for model-free drafters (one-hot proposals).
    """

    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    #: seconds of the look (``Peek.seconds``) this block was cut from: drafting done before the
    #: round's choice, recorded as the round's drafting, not as its policy time
    look_s: float = 0.0

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_rows(cls, tokens: list[int], rows: list[torch.Tensor], greedy: bool) -> Draft:
        """A model drafter's block: its per-token rows are raw logits under greedy decoding and
        processed q under sampling."""
        stacked = torch.stack(rows) if rows else None
        return cls(tokens, logits=stacked) if greedy else cls(tokens, probs=stacked)


@dataclass
class Peek:
    """A deterministic drafter's block, looked at before the round's choice (``Drafter.peek``).

    ``match``: length of the context match the first token comes from (the n-gram size of
    prompt lookup, the suffix length of suffix matching; 0 = unknown), a free signal of how
    likely the block is accepted (SuffixDecoding scores candidates by it)."""

    tokens: list[int]
    match: int = 0
    #: the look's seconds (its catch-up and proposals) and whether it stopped at the depth
    #: asked for, the drafter having more (both set by the engine that looked)
    seconds: float = 0.0
    cut: bool = False


@dataclass
class Proposals:
    """Teacher-forced proposals at each verified position (full-information feedback).

    Exactly one of ``probs`` (dense q rows [m, V]; under greedy decoding, rows of raw logits
    whose argmax is the proposal) or ``tokens`` (one token id per position, -1 = no
    proposal) is set.
    """

    probs: torch.Tensor | None = None
    tokens: list[int] | None = None


StepDecider = Callable[[DraftStep], Decision]


def apply_decisions(tokens: Sequence[int], decide: StepDecider) -> list[int]:
    """The prefix of ``tokens`` a length policy keeps when asked after each one (CONTINUE,
    STOP after it, DISCARD it): drafting a precomputed proposal exactly as it would be drafted."""
    kept: list[int] = []
    for j, tok in enumerate(tokens):
        verdict = decide(DraftStep(j, tok))
        if verdict is Decision.DISCARD:
            break
        kept.append(tok)
        if verdict is Decision.STOP:
            break
    return kept


@dataclass(frozen=True)
class DrafterCaps:
    """What a drafter can do, declared once by its class (``Drafter.caps``) and read by the round
    and its callers, which never probe a drafter for hooks.

    ``family``: what kind of drafter it is, whatever its name (``suffix`` for every suffix
    drafter, with or without a datastore): drafters of one family draw on the same evidence, so
    ``auto`` does not count their agreement (``drafters.drafter_family``). ``runs_model``: it
    runs a neural network (it exposes q, logits and hidden states; it is scored by the engine,
    never looked at). ``drafts_trees``: ``draft_tree`` proposes draft trees (``adaspec.trees``);
    the others draft chains. ``free_looks``: ``peek`` shows its block without a model call, so a
    policy that looks first sees it before the choice. ``forks``: ``fork`` gives a twin with its
    own per-request state (several requests at once: batches, the vLLM proposer).
    ``observes_target``: the round calls ``observe_target`` with every round's verified rows.
    ``reads_target_features``: it drafts from the target's hidden states (``bind_features``;
    EAGLE-style heads), which only a one-request forward computes.

    In a class's declaration ``None`` (the default) for ``drafts_trees``, ``free_looks``,
    ``forks`` and ``observes_target`` means: whether the class implements ``draft_tree``,
    ``peek`` (and runs no model), ``fork`` and ``observe_target``; ``family`` None: the class's
    ``name``. ``Drafter.__init_subclass__`` resolves them when the class is created, and a
    declaration of a hook the class does not implement is an error there: a drafter cannot
    forget a declaration and silently run slower, nor claim one it cannot keep. A drafter whose
    abilities depend on what it was built with (a model drafter's trees) sets its own resolved
    record on the instance."""

    family: str | None = None
    runs_model: bool = False
    drafts_trees: bool | None = None
    free_looks: bool | None = None
    forks: bool | None = None
    observes_target: bool | None = None
    reads_target_features: bool = False


#: the record fields whose default is "the class implements this hook"
_HOOKS = {"drafts_trees": "draft_tree", "free_looks": "peek", "forks": "fork", "observes_target": "observe_target"}
#: class attributes of earlier drafters, read into the record when a subclass sets them
_FLAGS = {"is_model": "runs_model", "supports_tree": "drafts_trees", "observes_target": "observes_target",
          "uses_target_features": "reads_target_features", "family": "family"}


class Drafter(ABC):
    """One source of draft tokens. Implementations: model, prompt lookup, suffix.

    What it can do is its ``caps`` (``DrafterCaps``): declare ``caps = DrafterCaps(...)`` in the
    class; the hooks it implements are declared by implementing them."""

    name: str = "drafter"
    caps: DrafterCaps = DrafterCaps(family="drafter", drafts_trees=False, free_looks=False, forks=False,
                                    observes_target=False)
    _declared: DrafterCaps = DrafterCaps()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared = cls.__dict__.get("caps", cls._declared)
        flags = read_flags(cls, {k: f for k, f in _FLAGS.items() if k != "family"})
        if isinstance(cls.__dict__.get("family"), str):
            flags["family"] = cls.__dict__["family"]
        if flags:
            declared = replace(declared, **flags)
        cls._declared = declared
        cls.caps = resolve_caps(cls, declared)

    # views of ``caps`` under the names earlier versions used
    @property
    def family(self) -> str:
        return self.caps.family  # type: ignore[return-value]

    @property
    def is_model(self) -> bool:
        return self.caps.runs_model

    @property
    def supports_tree(self) -> bool:
        return bool(self.caps.drafts_trees)

    @property
    def observes_target(self) -> bool:
        return bool(self.caps.observes_target)

    @property
    def uses_target_features(self) -> bool:
        return self.caps.reads_target_features

    @abstractmethod
    def begin_request(self, prompt_ids: Sequence[int]) -> None:
        """Forget per-request state; the drafter will catch up on ``prompt_ids`` lazily."""

    @abstractmethod
    def catch_up(self, context: Sequence[int]) -> None:
        """Bring internal state (KV cache, index) up to date with ``context``.

        Called right before drafting; everything but the last token may be ingested here so
        its cost is measured separately from drafting.
        """

    @abstractmethod
    def draft(
        self,
        context: Sequence[int],
        max_tokens: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        decide: StepDecider,
        want_hidden: bool = False,
    ) -> Draft:
        """Propose up to ``max_tokens`` tokens continuing ``context``, asking ``decide`` after each."""

    @abstractmethod
    def score(self, context: Sequence[int], verified: Sequence[int], sampling: SamplingConfig) -> Proposals:
        """What the drafter would propose at each of ``verified`` (teacher forcing) after ``context``."""

    def draft_tree(self, context: Sequence[int], max_depth: int, max_nodes: int,
                   sampling: SamplingConfig | None = None, level_gain: float = 0.0,
                   budget: TreeBudget | None = None, cut: PrefixCut | None = None) -> DraftTree:
        """A draft tree after ``context`` (nodes in best-first order, with scores), for drafters
        with ``caps.drafts_trees``. Children are chosen deterministically (never sampled), so the
        one-hot rule verifies any tree exactly (``adaspec.trees``); model drafters rank nodes by
        their q processed under ``sampling`` (softmax of the logits when greedy or None).
        ``level_gain``: a drafter that pays a forward per level drafts a level only while it
        may add more expected tokens than that, and expands only nodes that ``budget`` (how many
        best-first nodes of a tree would be verified) keeps (``trees.dynamic_tree``). ``cut``:
        a drafter whose nodes come best-first one at a time (model-free drafters) passes each
        node to it and, once its tree has branched, stops at the first node it refuses
        (``trees.PrefixCut``); model drafters grow by levels and use ``budget`` instead."""
        raise AdaspecError(f"drafter {self.name!r} drafts chains only (no draft trees)")

    def observe_target(self, inputs: Sequence[int], logits: torch.Tensor) -> None:
        """A round's verify inputs and the target's logits row after each (``caps.observes_target``
        drafters: ``RecycleDrafter``), once the round's scoring is done, so that a score never
        reads the round it scores."""

    def peek(self, context: Sequence[int], max_tokens: int) -> Peek | None:
        """The block this drafter would propose after ``context`` (up to ``max_tokens``), or None
        when looking costs a model call. Deterministic drafters answer; a later ``catch_up``
        undoes whatever looking changed, so the engine can reuse the answer as the draft."""
        return None

    def end_request(self, output_ids: Sequence[int]) -> None:
        """Called once per request with the generated tokens (datastores may learn from them)."""

    def fork(self) -> Drafter:
        """A drafter with the same settings and shared data (datastores) but its own per-request
        state, so one server can draft for several requests at once (the vLLM proposer)."""
        raise AdaspecError(f"drafter {self.name!r} cannot serve several requests at once: "
                           "use a model-free drafter (none, prompt-lookup, suffix, recycle)")

    def describe(self) -> str:
        return self.name


def resolve_caps(cls: type, declared: DrafterCaps) -> DrafterCaps:
    """``declared`` with its defaults filled from the hooks ``cls`` implements (``DrafterCaps``);
    raises ``TypeError`` when it declares a hook ``cls`` does not implement."""
    values: dict[str, Any] = {}
    for field_name, hook in _HOOKS.items():
        implemented = getattr(cls, hook) is not getattr(Drafter, hook)
        if field_name == "free_looks":
            implemented = implemented and not declared.runs_model
        value = getattr(declared, field_name)
        if value is None:
            value = implemented
        elif value and not implemented:
            raise TypeError(f"drafter class {cls.__name__} declares {field_name}=True but does not implement "
                            f"{hook}(): implement it or drop the declaration")
        values[field_name] = bool(value)
    return replace(declared, family=declared.family or getattr(cls, "name", "drafter"), **values)
