"""The target backend interface (see the package docstring)."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError
from ..exactness import NEAR_TIE_NATS
from ..registry import REGISTRY, Entry, Params, Spec

if TYPE_CHECKING:
    from ..trees import DraftTree

DEFAULT_BACKEND = "transformers"


@dataclass(frozen=True)
class BackendParams(Params):
    """A backend's spec has no parameters: its options are ``load_model``'s (``threads``, ...)."""


def register_backend(name: str, load: Callable[..., TargetBackend] | None, **options: Any) -> Entry:
    """Register a target backend (``registry.Registry.register`` for kind ``backend``; the
    built-in ones in ``backends/__init__.py``): ``load(spec, model=SPEC, gguf=PATH_OR_NONE,
    device=, dtype=, threads=, flash_attn=)`` loads a model on it (``models.load_model`` calls
    it); None: ``load_model``'s own transformers path."""
    return REGISTRY.register("backend", name, load or _in_models, params=BackendParams, **options)


def _in_models(spec: Spec, **_: Any) -> TargetBackend:
    raise ConfigError(f"backend {spec.name!r} is loaded by models.load_model itself")


def check_backend(name: str) -> str:
    """The canonical backend name for ``name`` (its aliases, ``llamacpp`` and ``hf``, too)."""
    found = REGISTRY.find("backend", str(name))
    if found is None:
        raise ConfigError(f"unknown backend {name!r}: use one of "
                          f"{', '.join(e.name for e in REGISTRY.entries('backend'))}")
    return found.name


def backend_loader(name: str) -> Callable[..., TargetBackend] | None:
    """How ``models.load_model`` loads a model on backend ``name``: the registered loader
    (called with the model spec, the GGUF file or None and the load options), or None for the
    transformers path of ``load_model`` itself."""
    entry = REGISTRY.entry("backend", check_backend(name))
    if entry.build is _in_models:
        return None
    return lambda model, gguf, **options: entry.build(REGISTRY.parse("backend", entry.name), model=model,
                                                      gguf=gguf, **options)


def shared_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit`` (the prefix caches)."""
    n, limit = 0, min(limit, len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class TargetBackend(ABC):
    """A causal LM the engine can run: forwards over new tokens on a per-sequence KV state.

    ``new_state()`` makes an empty state (a KV cache) for one sequence; ``forward`` appends
    tokens to it and returns float logits ``[keep, vocab]`` of the last ``keep`` inputs (and,
    with ``hidden``, the final hidden states of the same positions where the backend has them);
    ``truncate`` keeps the first ``length`` tokens of a state (rejected drafts are removed, the
    accepted prefix is not recomputed).
    """

    #: the backend's name (a registered backend); implementations also have ``name`` (what
    #: the model was loaded from) and ``tokenizer`` (Hugging Face style, or None)
    backend: str = ""
    #: whether ``forward(..., hidden=True)`` and feature drafters work on this backend
    has_hidden_states: bool = False
    #: whether a forward over k tokens gives the logits of k one-token forwards (up to float
    #: rounding); where not, greedy speculative output can differ from plain decoding at near-ties
    batch_invariant: bool = True
    #: the near-tie bound: a greedy difference from plain decoding where the two tokens'
    #: log-probabilities were this close (nats) is a numeric near-tie of this backend's kernels,
    #: not a verification error (the bench reports it as a near-tie, not a MISMATCH; the tests'
    #: ``exactness.tie_check`` passes it). It must stay below the margin of a wrongly accepted
    #: token, which the exactness tests' negative controls check; ``exactness.NEAR_TIE_NATS``
    #: (float rounding) unless a backend's kernels move margins more (llama.cpp)
    near_tie_nats: float = NEAR_TIE_NATS
    #: whether the backend can keep a prompt's KV for the next prompt that shares its prefix
    #: (``prefix_cache``, off unless set: llama.cpp, transformers; ``adaspec serve`` turns it on)
    supports_prefix_cache: bool = False
    prefix_cache: bool = False
    #: most tokens the kept prefixes hold together (least recently used dropped first)
    prefix_cache_tokens: int = 0

    def near_tie_nats_at(self, length: int) -> float:
        """``near_tie_nats`` for a position whose logits were computed on ``length`` tokens."""
        return self.near_tie_nats
    #: whether ``forward_tree`` / ``keep_path`` (draft trees) work on this backend
    supports_trees: bool = False
    #: whether a forward of the same shape as the one before it (tokens, logits rows) reuses
    #: the backend's compute graph and one of another shape rebuilds it (llama.cpp): the cost
    #: measurement then times steady forwards and the switch apart (``VerifyCostSurface.switch_s``)
    reuses_graphs: bool = False

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where logits live."""

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """The dtype of the computation (a quantized backend reports its logits' dtype)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Width of the logits."""

    @property
    @abstractmethod
    def context_window(self) -> int | None:
        """Most tokens a sequence may hold (None: unlimited)."""

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the model, so that a file learnt or trained on one (a server's state,
        a trained drafter) is refused by another: ``models.target_fingerprint``'s keys."""
        return {"name": getattr(self, "name", None), "model_type": self.backend, "vocab_size": self.vocab_size,
                "hidden_size": None, "num_hidden_layers": None, "weights": None}

    @abstractmethod
    def model_eos_ids(self) -> set[int]:
        """End-of-sequence ids the model itself declares (besides the tokenizer's)."""

    def eos_ids(self) -> set[int]:
        """End-of-sequence ids: the model's and the tokenizer's EOS."""
        ids = set(self.model_eos_ids())
        tok = self.tokenizer
        if tok is not None and getattr(tok, "eos_token_id", None) is not None:
            ids.add(int(tok.eos_token_id))
        return ids

    @abstractmethod
    def new_state(self) -> Any:
        """An empty KV state for one sequence."""

    @abstractmethod
    def forward(self, state: Any, ids: Sequence[int], keep: int = 1,
                hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``ids`` to ``state``; logits of the last ``keep`` of them (and hidden states),
        computed without autograd (the engine does not wrap the call), owned by the caller."""

    def prefill(self, state: Any, prompt: Sequence[int]) -> int:
        """Feed a prompt into an empty ``state``: every token but the last, which the first round
        feeds with its drafts (``forward(state, [prompt[-1], *drafts])``). A backend may compute
        the last token here too, as its own plain decoding does, and answer that first row from
        it (llama.cpp: the same batches as its greedy, hence the same numbers). Returns how many
        prompt tokens' KV came from an earlier request (``prefix_cache``) instead of a forward."""
        if len(prompt) > 1:
            self.forward(state, prompt[:-1], keep=1)
        return 0

    def cached_prefix(self, prompt: Sequence[int]) -> int:
        """How many of ``prompt``'s tokens a ``prefill`` into an empty state would take from an
        earlier request's kept KV (``prefix_cache``) instead of a forward; nothing changes."""
        return 0

    def keep_prompt(self, state: Any, tokens: Sequence[int]) -> None:
        """With ``prefix_cache``: keep the KV of ``tokens`` (all ``state`` holds: a prompt fed in
        ``prefill_piece`` pieces) for later prompts (``prefill`` keeps its own prompt; a backend
        that keeps a state's KV when it is released does nothing here)."""

    def prefill_piece(self, state: Any, ids: Sequence[int]) -> None:
        """Feed one piece of a long prompt into ``state``, which holds the pieces before it (the
        batch engine's chunked prefill), with the kernels ``prefill`` uses for a prompt's tokens:
        a prompt fed in the same pieces gets the same KV whatever else runs beside it."""
        self.forward(state, ids, keep=1)

    def forward_tree(self, state: Any, last: int, tree: DraftTree,
                     hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over ``[last] + tree.tokens`` with a tree attention mask and tree
        positions (``adaspec.trees``): logits ``[1 + len(tree), vocab]`` (row 0: after ``last``,
        row i + 1: after node i's path), and the hidden states of the same rows with ``hidden``.
        The state then holds all the rows; ``keep_path`` keeps the accepted ones."""
        raise self.no_trees_error()

    def keep_path(self, state: Any, start: int, rows: Sequence[int]) -> None:
        """After ``forward_tree`` on a state of ``start`` tokens: keep the entries of ``rows``
        (increasing, row 0 first) at positions ``start, start + 1, ...`` and drop the rest
        (the accepted path's KV is moved into place, not recomputed)."""
        raise self.no_trees_error()

    def no_trees_error(self) -> ConfigError:
        """The error of a backend without draft trees."""
        return ConfigError(f"draft trees are not implemented on the {self.backend} backend yet "
                           "(llama.cpp could verify them with one sequence id per branch, later): "
                           "drop --tree (tree=False), or use --backend transformers")

    @abstractmethod
    def truncate(self, state: Any, length: int) -> None:
        """Keep the first ``length`` tokens of ``state`` (drop the rest of its KV)."""

    @abstractmethod
    def state_length(self, state: Any) -> int:
        """Tokens held by ``state``."""

    def release(self, state: Any) -> None:
        """Free what ``state`` holds (a no-op where memory is garbage collected)."""

    def request_scope(self) -> contextlib.AbstractContextManager[None]:
        """Held around each request's prefill and rounds (a backend may set up the process for
        them, e.g. llama.cpp keeps torch's own threads off its cores)."""
        return contextlib.nullcontext()

    def free_states(self) -> int | None:
        """How many more states ``new_state`` can make now (None: no fixed limit, and states do
        not share a pool: what one holds does not slow another's forwards)."""
        return None

    @abstractmethod
    def identity(self) -> str:
        """What distinguishes this model and runtime for cached measurements (cost surfaces)."""

    def require_hidden_states(self, what: str) -> None:
        """A clear error when ``what`` needs hidden states this backend does not expose."""
        if not self.has_hidden_states:
            raise ConfigError(f"{what} needs the target's hidden states, which the {self.backend} "
                              "backend does not expose: use --backend transformers")

    def new_rows(self, compact_fraction: float = 0.25) -> RowStates:
        """The states of rows that decode together (``round.Round``'s rows in a batch): a
        backend with batched state operations returns its own (one forward verifies every row;
        ``compact_fraction``: the share of hole columns past which a padded layout compacts);
        by default the rows run one at a time on their own states (``SequentialRows``)."""
        return SequentialRows(self)

    def batching_problem(self) -> str | None:
        """Why rows of this target cannot share one forward (a message naming the fix), or
        None. Without batched states, rows are decoded one at a time (still exact)."""
        return None


class RowStates(ABC):
    r"""The KV states of the rows decoding together, in row order.

    A request's state is prefilled on its own (``TargetBackend.new_state``) and ``join``\ s as
    the last row; ``leave`` drops rows. ``batched`` says whether ``forward`` verifies every row's
    inputs in one target forward; then each row's accepted inputs are marked with ``keep`` and
    ``end_round`` drops the rest (and compacts, where the layout has holes). Without it the
    caller runs each row on ``state(r)`` with the backend's own per-sequence operations
    (``forward``, ``forward_tree``, ``keep_path``, ``truncate``), as it does for a batch of one."""

    #: one ``forward`` for all rows (else: per-row states, one forward each)
    batched: bool = False
    #: compactions done (layouts with holes)
    compactions: int = 0

    def __init__(self, target: TargetBackend):
        self.target = target

    @abstractmethod
    def __len__(self) -> int:
        """Rows held."""

    @abstractmethod
    def join(self, state: Any, length: int) -> None:
        """A prefilled state of ``length`` tokens becomes the last row (owned from now on)."""

    @abstractmethod
    def leave(self, rows: Sequence[int]) -> None:
        """Drop (and release) the states of ``rows``."""

    @abstractmethod
    def state(self, r: int) -> Any:
        """Row ``r``'s state for the backend's per-sequence operations: always with
        ``batched`` False, and for the only row of a batched layout."""

    def forward(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits [rows, max width, vocab] of every row's ``inputs`` appended to its state in
        one forward (``batched`` layouts only)."""
        raise NotImplementedError(f"{type(self).__name__} runs its rows one at a time")

    def keep(self, r: int, kept: int) -> None:
        """After ``forward``: row ``r`` keeps the first ``kept`` of its inputs."""
        raise NotImplementedError(f"{type(self).__name__} runs its rows one at a time")

    def end_round(self, leaving: Sequence[int] = ()) -> None:
        """After the round: drop what no row kept (``batched`` layouts) and the rows ``leaving``."""
        if leaving:
            self.leave(leaving)

    @property
    def columns(self) -> int:
        """The widest row's KV length (what a batched forward attends over)."""
        return max((self.target.state_length(self.state(r)) for r in range(len(self))), default=0)

    def compact(self) -> None:
        """Remove holes from the layout now (a no-op for layouts without holes)."""

    def release(self) -> None:
        """Free every row's state."""
        self.leave(list(range(len(self))))


class SequentialRows(RowStates):
    """Rows on their own states, decoded one at a time: any backend's batch."""

    def __init__(self, target: TargetBackend):
        super().__init__(target)
        self._states: list[Any] = []

    def __len__(self) -> int:
        return len(self._states)

    def join(self, state: Any, length: int) -> None:
        self._states.append(state)

    def leave(self, rows: Sequence[int]) -> None:
        drop = set(rows)
        for r in sorted(drop):
            self.target.release(self._states[r])
        self._states = [s for r, s in enumerate(self._states) if r not in drop]

    def state(self, r: int) -> Any:
        return self._states[r]
