"""Model drafter: any causal LM that shares the target's vocabulary."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config import SamplingConfig
from ..errors import AdaspecError, VocabularyMismatchError
from ..backends.base import TargetBackend
from ..backends.transformers import TREE_ATTENTION, LoadedModel, _check_tree_cache, cache_arg
from ..sampling import process_logits, sample
from ..trees import DraftTree, PrefixCut, TreeBudget, TreeNode, TreeSlots, dynamic_tree
from .base import Decision, Draft, Drafter, DrafterCaps, DraftStep, Proposals, StepDecider

#: EAGLE-2 tree shape of model drafters: children offered per expanded node, nodes expanded per level
TREE_BRANCH, TREE_WIDTH = 4, 4


def check_same_vocabulary(target: TargetBackend, drafter: TargetBackend) -> None:
    """Raise a clear error unless both models map the same strings to the same ids."""
    tt, dt = target.tokenizer, drafter.tokenizer
    if tt is not None and dt is not None:
        tv, dv = tt.get_vocab(), dt.get_vocab()
        if tv != dv:
            diff = sum(1 for tok, i in dv.items() if tv.get(tok) != i)
            raise VocabularyMismatchError(
                f"drafter {drafter.name!r} does not share the target's vocabulary "
                f"({len(dv)} vs {len(tv)} tokens, {diff} differ): use a drafter from the same "
                "model family/tokenizer as the target, or a model-free drafter (prompt-lookup, suffix, recycle)"
            )
        return
    if drafter.vocab_size != target.vocab_size:
        raise VocabularyMismatchError(
            f"drafter {drafter.name!r} has {drafter.vocab_size} output tokens but the target has "
            f"{target.vocab_size}: use a drafter with the target's tokenizer"
        )


def early_exit_model(target: LoadedModel, layers: int) -> LoadedModel:
    """The target's first ``layers`` decoder layers with its final norm and LM head, sharing
    the target's weights (no copy): a cheap model drafter that needs no training (a weak one:
    early layers rarely agree with the full model)."""

    from torch import nn

    outer = target.model
    inner = getattr(outer, "model", None)
    n_layers = len(getattr(inner, "layers", []))
    if not n_layers:
        raise AdaspecError(
            f"early-exit needs a decoder with model.layers (Llama/Qwen/Mistral style); "
            f"{type(outer).__name__} has none: use a model drafter instead")
    if not 1 <= layers < n_layers:
        raise AdaspecError(
            f"early-exit:layers must be in 1..{n_layers - 1} for this {n_layers}-layer target")
    config = copy.deepcopy(outer.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    new_inner = copy.copy(inner)
    new_inner._modules = dict(inner._modules)
    new_inner.layers = nn.ModuleList(list(inner.layers)[:layers])
    new_inner.config = config
    new_outer = copy.copy(outer)
    new_outer._modules = dict(outer._modules)
    new_outer.model = new_inner
    new_outer.config = config
    return LoadedModel(new_outer, target.tokenizer, f"{target.name}[:{layers} layers]")


def _common_prefix(a: Sequence[int], b: Sequence[int], start: int) -> int:
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


def tree_q(logits: torch.Tensor, sampling: SamplingConfig | None) -> torch.Tensor:
    """The q that ranks a model drafter's tree nodes: the chain path's processed q under
    sampling, the softmax of the raw logits under greedy decoding (EAGLE-2's confidence)."""
    if sampling is None or sampling.greedy:
        return torch.softmax(logits.float(), dim=-1)
    return process_logits(logits, sampling)


@dataclass
class _TreeKV:
    """Drafter cache entries of the last draft tree, after ``base`` context entries: (parent
    node id, token) -> (node id, slot after ``base``), for gathering the accepted path."""

    base: int
    slots: dict[tuple[int, int], tuple[int, int]]


class ModelDrafter(Drafter):
    """Drafts with a small causal LM, keeping its own KV cache in sync with the context.

    Tokens in the cache beyond the verified context (its rejected drafts) are cropped at the
    next use; tokens produced while it was not used are prefilled in ``catch_up``.
    """

    caps = DrafterCaps(family="model", runs_model=True)
    #: EAGLE-2 tree shape: children offered per expanded node, nodes expanded per level
    tree_branch, tree_width = TREE_BRANCH, TREE_WIDTH

    def __init__(self, drafter: TargetBackend, target_vocab_size: int, name: str | None = None):
        self.lm = drafter  # runs on any backend: a GGUF drafter of a llama.cpp target on llama.cpp
        self.model = getattr(drafter, "model", None)
        self._cache_kw = cache_arg(self.model)  # transformers drafters only (trees)
        self.name = name or f"model:{drafter.name}"
        self._vocab = target_vocab_size
        self._device = drafter.device
        self._cache: Any = None
        self._fed: list[int] = []  # tokens whose KV is in the cache
        self._trusted = 0  # _fed[:_trusted] is known to equal the verified context
        self._unfed: tuple[int, int] | None = None  # (position, token): own last draft, not fed
        self._tree_kv: _TreeKV | None = None  # tree nodes in the cache beyond _fed (draft_tree)
        # trees need a transformers drafter whose attention takes a custom 4D mask
        cfg = getattr(self.model, "config", None)
        trees = (bool(getattr(self.lm, "supports_trees", False)) and cfg is not None
                 and getattr(cfg, "_attn_implementation", None) in TREE_ATTENTION)
        self.caps = replace(type(self).caps, drafts_trees=trees)

    # -- state --------------------------------------------------------------------------
    def begin_request(self, prompt_ids: Sequence[int]) -> None:
        if self._cache is not None:
            self.lm.release(self._cache)
        self._cache = self.lm.new_state()
        self._fed, self._trusted, self._unfed, self._tree_kv = [], 0, None, None

    def end_request(self, output_ids: Sequence[int]) -> None:
        if self._cache is not None:  # a llama.cpp sequence goes back to its context's pool
            self.lm.release(self._cache)
            self._cache = None
        self._tree_kv = None

    def fork(self) -> ModelDrafter:
        """The same draft model (its weights shared) with a KV state of its own, so several
        requests in a batch each draft with it (its forwards run one request at a time)."""
        twin = copy.copy(self)
        twin._cache, twin._fed, twin._trusted, twin._unfed, twin._tree_kv = None, [], 0, None, None
        return twin

    def _settle_tree(self, context: Sequence[int]) -> None:
        """After ``draft_tree``: keep the cached tree nodes on ``context``'s path (gathered into
        place, as the target's ``keep_path``) and drop the other nodes."""
        kv, self._tree_kv = self._tree_kv, None
        rows: list[int] = []
        if _common_prefix(self._fed, context, self._trusted) == kv.base == len(self._fed):
            node = -1
            for tok in context[kv.base:]:
                hit = kv.slots.get((node, tok))
                if hit is None:
                    break
                node, slot = hit
                rows.append(slot)
        self.lm.keep_path(self._cache, kv.base, rows)
        self._fed.extend(context[kv.base: kv.base + len(rows)])

    def _sync(self, context: Sequence[int]) -> None:
        """Crop cached tokens that are not a prefix of ``context`` (rejected drafts)."""
        if self._tree_kv is not None:
            self._settle_tree(context)
        c = _common_prefix(self._fed, context, self._trusted)
        if c < len(self._fed):
            self.lm.truncate(self._cache, c)
            del self._fed[c:]
        self._trusted = c

    def _sync_for_logits(self, context: Sequence[int]) -> None:
        """Sync to ``context`` keeping its last token unfed, so the next forward yields the
        logits that follow ``context`` (re-feeds that token if it was already cached)."""
        self._sync(context)
        if len(self._fed) == len(context):
            self._fed.pop()
            self.lm.truncate(self._cache, len(self._fed))
        self._trusted = min(self._trusted, len(self._fed))

    def _align(self, logits: torch.Tensor) -> torch.Tensor:
        """Make drafter logits as wide as the target's (extra ids dropped, missing ids -inf)."""
        width = logits.shape[-1]
        if width == self._vocab:
            return logits
        if width > self._vocab:
            return logits[..., : self._vocab]
        pad = logits.new_full((*logits.shape[:-1], self._vocab - width), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    @torch.inference_mode()
    def _forward(self, tokens: Sequence[int], keep: int = 1, hidden: bool = False):
        logits, h = self.lm.forward(self._cache, tokens, keep, hidden=hidden)
        self._fed.extend(tokens)
        return self._align(logits.float()), h

    def catch_up(self, context: Sequence[int]) -> None:
        self._sync(context)
        start, end = len(self._fed), len(context) - 1
        if end <= start:
            return
        # the drafter's own unfed last draft followed by one new token is ordinary drafting
        if end == start + 1 and self._unfed == (start, context[start]):
            return
        self._forward(context[start:end])

    # -- drafting -----------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, context, max_tokens, sampling, generator, decide: StepDecider,
              want_hidden: bool = False) -> Draft:
        self._sync_for_logits(context)
        logits, hidden = self._forward(context[len(self._fed):], hidden=want_hidden)
        self._unfed = None
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for j in range(max_tokens):
            row = logits[-1]
            if sampling.greedy:
                probs = None
                tok = int(row.argmax())
            else:
                probs = process_logits(row, sampling)
                tok = sample(probs, generator)
            verdict = decide(DraftStep(j, tok, probs=probs, logits=row,
                                       hidden=hidden[-1] if hidden is not None else None))
            if verdict is Decision.DISCARD:
                break
            tokens.append(tok)
            rows.append(probs if probs is not None else row)
            if verdict is Decision.STOP or j == max_tokens - 1:
                self._unfed = (len(self._fed), tok)
                break
            logits, hidden = self._forward([tok], hidden=want_hidden)
        return Draft.from_rows(tokens, rows, sampling.greedy)

    # -- draft trees (EAGLE-2) -----------------------------------------------------------------
    @torch.inference_mode()
    def _forward_level(self, tokens: Sequence[int], positions: Sequence[int],
                       mask: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] of tree nodes fed with a tree mask and depth positions (their cache
        entries are tracked by ``_tree_kv``, not ``_fed``)."""
        dev = self._device
        out = self.model(input_ids=torch.tensor([list(tokens)], device=dev), attention_mask=mask,
                         position_ids=torch.tensor([list(positions)], device=dev),
                         **{self._cache_kw: self._cache}, use_cache=True)
        return self._align(out.logits[0].float())

    @torch.inference_mode()
    def draft_tree(self, context: Sequence[int], max_depth: int, max_nodes: int,
                   sampling: SamplingConfig | None = None, level_gain: float = 0.0,
                   budget: TreeBudget | None = None, cut: PrefixCut | None = None) -> DraftTree:
        """EAGLE-2 dynamic tree (``trees.dynamic_tree``): the children of a node are the top
        ``tree_branch`` tokens of its q (deterministic, so the one-hot rule verifies them
        exactly), one drafter forward per depth over that level's frontier with a tree mask;
        the next ``catch_up`` keeps the accepted path's drafter KV (gathered, not recomputed)."""
        if not self.supports_tree:
            raise AdaspecError(f"drafter {self.name!r} cannot draft trees on its backend: drop --tree")
        self._sync_for_logits(context)
        logits, _ = self._forward(context[len(self._fed):])
        _check_tree_cache(self._cache)
        self._unfed = None
        base = len(self._fed)
        slots: dict[tuple[int, int], tuple[int, int]] = {}
        fed = TreeSlots(base)

        def step(frontier: Sequence[int], nodes: Sequence[TreeNode]) -> torch.Tensor:
            mask = fed.feed(frontier, nodes, self.lm.dtype, self._device)
            rows = self._forward_level([nodes[i].token for i in frontier],
                                       [base - 1 + nodes[i].depth for i in frontier], mask)
            for i in frontier:
                slots[(nodes[i].parent, nodes[i].token)] = (i, fed.slot_of[i])
            return tree_q(rows, sampling)

        self._tree_kv = _TreeKV(base, slots)
        return dynamic_tree(tree_q(logits[-1], sampling), step, max_depth, max_nodes,
                            self.tree_branch, self.tree_width, level_gain, budget)

    @torch.inference_mode()
    def score(self, context, verified, sampling: SamplingConfig) -> Proposals:
        m = len(verified)
        if m == 0:
            return Proposals(probs=torch.empty(0, self._vocab))
        self._sync_for_logits(context)
        feed = list(context[len(self._fed):]) + list(verified[:-1])
        logits, _ = self._forward(feed, keep=m)
        self._trusted = len(self._fed)
        self._unfed = None
        if sampling.greedy:
            return Proposals(probs=logits)
        return Proposals(probs=process_logits(logits, sampling))
