"""The speculative decoding engine: a target, its drafters and policies, and the front end.

``SpeculativeEngine`` loads or wraps a target (``backends``), builds its drafters and its
drafter and length policies, encodes prompts (chat template, stop strings) and decodes a
request as a batch of one (``batch.BatchEngine.solo``) with the one round (``round.Round``):
the drafter policy picks a drafter, which catches up and drafts while the length policy says go
on; one target forward verifies ``[last token] + drafts``; exact speculative sampling (or
greedy matching) accepts a prefix and adds one token; the target's state is cut to the accepted
prefix and the policies learn from the round. ``generate_batch`` decodes several requests in
continuous batches. The output is the target's (greedy: token for token; sampling: in
distribution).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .backends import DEFAULT_BACKEND, TargetBackend
from .batch import BatchEngine
from .config import GenerationConfig
from .costs import CostModel, VerifyCostSurface, load_or_measure
from .drafters import Drafter, NoDrafter, build_drafter, default_drafters
from .drafters.feature_head import FeatureBuffer, TargetFeatureForward
from .drafters.indexed import share_indexes
from .errors import ConfigError, PromptError
from .kernels import release_own_openmp_threads
from .length import LengthPolicy, StaticLength
from .length.cost_rule import ConfidenceCalibration
from .metrics import RequestStats
from .models import DEFAULT_MODEL, as_loaded, load_model
from .pools import pool_drafters
from .round import Clock, GenerationResult, RowParts, bind_policies, cut_at_stops

__all__ = ["DEFAULT_DRAFTERS", "GenerationResult", "SpeculativeEngine", "cut_at_stops", "default_drafters"]
from .selection import DrafterPolicy, build_policies

log = logging.getLogger(__name__)

Prompt = str | Sequence[int] | Sequence[dict]

#: what ``SpeculativeEngine`` drafts with on the transformers backend when no drafters are
#: given (``default_drafters``: the drafters registered as defaults, plus a pool found in the
#: cache: ``pools.pool_drafters``): the model-free drafters and plain decoding, chosen among
#: (with the draft length) by ``auto`` (``DEFAULT_SELECTOR``)
DEFAULT_DRAFTERS = default_drafters(DEFAULT_BACKEND)


class SpeculativeEngine:
    """Lossless speculative decoding over a Hugging Face causal LM with pluggable drafters.

    Args:
        target: a ``TargetBackend`` (``LoadedModel`` for Hugging Face models, ``LlamaCppTarget``
            for llama.cpp) or a ``PreTrainedModel`` (then pass ``tokenizer``).
        drafters: drafter specs (``"prompt-lookup"``, ``"suffix"``, ``"model:REF"``, ``"none"``)
            or ``Drafter`` instances; None (default): ``default_drafters`` of the target's
            backend plus the drafters of the pool built for this target (``pool``). Empty means
            plain autoregressive decoding.
        selector: drafter policy (name or instance); default: ``auto`` (drafter and length
            chosen online) over several drafters, the drafter itself when there is one.
        length: length policy (name, int K, or instance); default: the selector's own (``auto``)
            or static ``k``.
        k: draft length for the static length policy.
        tree: draft trees (``adaspec.trees``) from every drafter that proposes them (prompt
            lookup, suffix; model drafters, tiny LMs and feature heads on transformers: EAGLE-2
            dynamic trees); the others draft chains. The length policy's cap 0 is a plain
            step; otherwise a model drafter's tree is as deep as the cap, a model-free one's
            ``tree_nodes - 1`` (``_draft_tree``), with at most ``tree_nodes`` nodes, of which
            the engine verifies the best-first prefix worth its verify seconds on the measured
            surface against the generation's running rate (against the round's own rate when
            ``auto`` planned the round; ``trees.nodes_worth_verifying``). A drafter that offers
            a single chain drafts and verifies it exactly as without trees.
        tree_nodes: most nodes of a draft tree (default 15: a 16-token forward, the widest
            of the cost surface's grid).
        pool: trained drafters of a pool built by ``adaspec build-pool``, added after
            ``drafters``: None (default) adds the pool built for this target in the cache
            (``pools.find_pool``) when ``drafters`` is None and nothing otherwise; ``"auto"``
            that pool whatever ``drafters`` is (an error if there is none); a directory that
            pool; False none. ``auto`` learns which of them pay (issue 16).
        costs_progress: ``progress(done, total)`` while the verify-cost surface is measured, if
            this machine has none cached for the target (the commands' progress bars); without
            it the measurement is announced in the log.
    """

    def __init__(self, target: Any, drafters: Sequence[str | Drafter] | None = None, *,
                 selector: str | DrafterPolicy | None = None,
                 length: str | int | LengthPolicy | None = None, k: int = 5,
                 tokenizer: Any = None, tree: bool = False, tree_nodes: int = 15,
                 pool: str | Path | bool | None = None,
                 costs_progress: Callable[[int, int], None] | None = None):
        self.target: TargetBackend = as_loaded(target, tokenizer)
        extra = pool_drafters(self.target, pool, default=drafters is None)
        drafters = [*(default_drafters(self.target.backend) if drafters is None else drafters), *extra]
        self.drafters: list[Drafter] = [build_drafter(d, self.target) for d in drafters] or [NoDrafter()]
        share_indexes(self.drafters)  # one request index for the n-gram drafters
        #: indices of the drafters a cached pool added by default (``pool=None``), not asked for
        self.default_pool = list(range(len(drafters) - len(extra), len(drafters))) if pool is None else []
        self.tree, self.tree_nodes = bool(tree), int(tree_nodes)
        if self.tree:
            self._check_trees()
        self._set_policies(selector, length, k)
        self._timer = Clock(self.target.device)
        self._costs: VerifyCostSurface | None = None
        self._feature_forward: TargetFeatureForward | None = None  # built when a drafter wants features
        #: running cost estimates; policies that price rounds (``caps.prices_rounds``) get it as ``.costs``
        self.cost_model = CostModel()
        #: model drafters' tree-node probabilities, calibrated on the nodes the target saw
        #: (``trees.calibrated_scores``; kept across requests, like the costs), keyed by the
        #: drafter instance (``id``), which views (``with_policies``) share whatever its index
        self.tree_calibration = ConfidenceCalibration()
        self._attach_costs(costs_progress)
        if self.target.device.type == "cpu":  # loading computed here: whichever thread generates
            release_own_openmp_threads()    # first must not share the CPUs with this one's pool

    def _set_policies(self, selector: Any, length: Any, k: int) -> None:
        """Build the drafter and length policies (paired when the selector sets the length too)
        and tell a selector that asks which drafters run a network."""
        self.selector, self.length = build_policies(selector, length, k, n_drafters=len(self.drafters))
        bind_policies(self.selector, self.length, self.drafters, self.tree)

    def _check_trees(self) -> None:
        if isinstance(self.tree_nodes, bool) or self.tree_nodes < 1:
            raise ConfigError(f"tree_nodes must be an integer >= 1, got {self.tree_nodes!r}")
        if not self.target.supports_trees:
            raise self.target.no_trees_error()
        if not any(d.caps.drafts_trees for d in self.drafters):
            log.info("tree=True, but none of %s drafts trees (prompt-lookup, suffix and model "
                     "drafters on transformers do): they draft chains", self.drafter_names)

    def _attach_costs(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Give cost-aware policies (and the tree budget) the cost model, priced on the measured
        surface with its timing noise pooled (``VerifyCostSurface.denoised``: a dip of a few
        percent between widths is not a cliff to stop in)."""
        wanting = [p for p in (self.selector, self.length) if p.caps.prices_rounds]
        if wanting or (self.tree and self.cost_model.surface is None):  # the node budget prices widths
            surface = VerifyCostSurface.of(self.verify_costs(progress=progress))
            self.cost_model.surface = None if surface is None else surface.denoised()
        for policy in wanting:
            policy.costs = self.cost_model

    def with_policies(self, drafters: Sequence[int] | None = None, *,
                      selector: str | DrafterPolicy | None = None,
                      length: str | int | LengthPolicy | None = None, k: int = 5) -> SpeculativeEngine:
        """A view that shares this engine's target, drafter instances and cost model but drafts
        with the drafters at indices ``drafters`` (default: all) and its own policies (None: as
        in the constructor): per-request configurations in a server. The view reads and feeds
        the cost model through ``CostModel.for_drafters``, so a drafter's seconds are its own
        whatever its index in the view."""
        view = copy.copy(self)
        if drafters is not None:
            if not drafters or any(not 0 <= i < len(self.drafters) for i in drafters):
                raise ConfigError(f"drafter indices {list(drafters)} do not select from the "
                                  f"{len(self.drafters)} loaded drafter(s)")
            view.drafters = [self.drafters[i] for i in drafters]
            view.cost_model = self.cost_model.for_drafters(drafters)  # each drafter's own seconds
        view._set_policies(selector, length, k)
        view._attach_costs()
        return view

    @classmethod
    def from_pretrained(cls, model: str = DEFAULT_MODEL,
                        drafters: Sequence[str | Drafter] | None = None, *,
                        device: str = "cpu", dtype: str | torch.dtype | None = None,
                        backend: str = DEFAULT_BACKEND, threads: int | None = None,
                        linear: str = "auto", flash_attn: bool | None = None,
                        **kwargs: Any) -> SpeculativeEngine:
        """Load ``model`` (``"smollm2"``, a HF id, a directory or a .gguf file) and build the
        engine; ``backend="llama.cpp"`` runs a GGUF target on llama.cpp (``threads``: its
        thread count; ``flash_attn``: its flash attention, off on a CPU by default);
        ``linear="stock"`` keeps PyTorch's own linear kernels (``load_model``)."""
        return cls(load_model(model, device=device, dtype=dtype, backend=backend, threads=threads,
                              linear=linear, flash_attn=flash_attn), drafters, **kwargs)

    # -- properties -----------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.target.tokenizer

    @property
    def prices_rounds(self) -> bool:
        """Whether the selector or the length policy prices rounds on the cost model
        (``caps.prices_rounds``): only then are verify-cost grids read or measured for them."""
        return self.selector.caps.prices_rounds or self.length.caps.prices_rounds

    @property
    def drafter_names(self) -> list[str]:
        return [d.name for d in self.drafters]

    def verify_costs(self, refresh: bool = False,
                     progress: Callable[[int, int], None] | None = None) -> VerifyCostSurface:
        """The target's measured verify-cost surface V(k, L) (measured once, cached on disk;
        ``progress(done, total)`` while it is measured)."""
        if self._costs is None or refresh:
            self._costs = load_or_measure(self.target, refresh=refresh, progress=progress)
            if isinstance(self.length, StaticLength):
                width = self.length.k + 1
                hit = [c for c, ks in self._costs.cliffs_by_context().items() if width in ks]
                if hit:
                    log.warning("static k=%d verifies %d tokens per forward, which is in a cost cliff of "
                                "this machine at cache lengths %s: a longer block costs less there",
                                self.length.k, width, hit)
        return self._costs

    def eos_ids(self) -> set[int]:
        """End-of-sequence ids: the model's (generation config) and the tokenizer's EOS."""
        return self.target.eos_ids()

    # -- prompts ------------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt, chat_template: bool = True) -> list[int]:
        """Token ids for a string (chat template applied if the tokenizer has one), a list of
        chat messages, or a list of token ids (used as is)."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise PromptError("the prompt is empty: pass some text (or token ids)")
            tok = self._need_tokenizer()
            if chat_template and getattr(tok, "chat_template", None):
                prompt = [{"role": "user", "content": prompt}]
            else:
                return list(tok(prompt, add_special_tokens=True)["input_ids"])
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.flatten().tolist()
        prompt = list(prompt)
        if not prompt:
            raise PromptError("the prompt is empty: pass some text, messages or token ids")
        if isinstance(prompt[0], dict):
            tok = self._need_tokenizer()
            if not getattr(tok, "chat_template", None):
                raise PromptError("chat messages need a tokenizer with a chat template: pass a string")
            text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            return list(tok(text, add_special_tokens=False)["input_ids"])
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise PromptError("a token-id prompt must be a list of ints")
        vocab = self.target.vocab_size  # once: a backend may look it up on the model
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise PromptError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return prompt

    def _need_tokenizer(self) -> Any:
        if self.target.tokenizer is None:
            raise PromptError("this model has no tokenizer: pass the prompt as a list of token ids")
        return self.target.tokenizer

    def decode(self, ids: Sequence[int]) -> str:
        tok = self.target.tokenizer
        return tok.decode(list(ids), skip_special_tokens=True) if tok is not None else ""

    # -- public generation API ----------------------------------------------------------------
    def generate(self, prompt: Prompt, config: GenerationConfig | None = None, *,
                 on_tokens: Callable[[list[int]], None] | None = None, **overrides: Any) -> GenerationResult:
        """Generate a completion. ``overrides`` may set GenerationConfig or SamplingConfig fields
        (``max_new_tokens=64, temperature=0.7, seed=1, stop=["\\n\\n"]``). ``on_tokens`` is called
        with every chunk of accepted tokens as soon as it is verified."""
        config = self._config(config, overrides)
        prompt_ids = self.encode_prompt(prompt, config.chat_template)
        run = self._run(prompt_ids, config)
        out: list[int] = []
        while True:
            try:
                chunk = next(run)
            except StopIteration as stop:
                stats = stop.value
                break
            out.extend(chunk)
            if on_tokens is not None:
                on_tokens(chunk)
        return GenerationResult(self.decode(out), out, prompt_ids, stats)

    def generate_batch(self, prompts: Sequence[Prompt], config: GenerationConfig | None = None, *,
                       max_batch: int | None = None, **overrides: Any) -> list[GenerationResult]:
        """Generate completions of several prompts together (continuous batching, ``adaspec.batch``:
        one target forward per round verifies every row's drafts; each request keeps its own
        drafters, policies and generator). ``max_batch``: rows at once (default: all prompts, at
        most 32; the rest wait for a free row). Results in the order of ``prompts``."""
        engine = self
        unbatched = [i for i, d in enumerate(self.drafters) if d.caps.reads_target_features]
        if unbatched and set(unbatched) <= set(self.default_pool):  # the default's pool heads: batch without them
            log.info("generate_batch: the pool's feature heads are not batched; the batch drafts with %s",
                     [d.name for i, d in enumerate(self.drafters) if i not in unbatched])
            engine = self.with_policies([i for i in range(len(self.drafters)) if i not in unbatched])
        batch = BatchEngine(engine, max_batch=max_batch or min(max(1, len(prompts)), 32))
        ids = [batch.add(p, config, **overrides) for p in prompts]
        results = batch.run()
        return [results[i] for i in ids]

    def stream(self, prompt: Prompt, config: GenerationConfig | None = None,
               **overrides: Any) -> Iterator[str]:
        """Yield text pieces as tokens are accepted (incomplete UTF-8 is held back)."""
        config = self._config(config, overrides)
        prompt_ids = self.encode_prompt(prompt, config.chat_template)
        out: list[int] = []
        shown = ""
        run = self._run(prompt_ids, config)
        self.last_stats: RequestStats | None = None
        while True:
            try:
                out.extend(next(run))
            except StopIteration as stop:
                self.last_stats = stop.value
                break
            text = self.decode(out)
            if text.endswith("\ufffd"):
                continue
            if text.startswith(shown):
                delta, shown = text[len(shown):], text
                if delta:
                    yield delta
        text = self.decode(out)
        if text.startswith(shown) and len(text) > len(shown):
            yield text[len(shown):]

    @staticmethod
    def _config(config: GenerationConfig | None, overrides: dict[str, Any]) -> GenerationConfig:
        config = config or GenerationConfig()
        sampling_keys = {"temperature", "top_k", "top_p", "seed"}
        s_over = {k: overrides.pop(k) for k in list(overrides) if k in sampling_keys}
        if s_over:
            config = replace(config, sampling=replace(config.sampling, **s_over))
        if overrides:
            try:
                config = replace(config, **overrides)
            except TypeError:
                raise ConfigError(f"unknown generation option(s) {sorted(overrides)}: allowed are "
                                  "max_new_tokens, stop, chat_template, stop_on_eos, temperature, "
                                  "top_k, top_p, seed") from None
        return config

    # -- the loop --------------------------------------------------------------------------------
    def _check_fits(self, n_prompt: int, max_new: int) -> None:
        window = self.target.context_window
        if window is None:
            return
        if n_prompt >= window:
            raise PromptError(
                f"the prompt has {n_prompt} tokens but the model's context window is {window}: "
                "shorten the prompt")
        if n_prompt + max_new > window:
            raise PromptError(
                f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new}) exceeds the context "
                f"window ({window}): lower max_new_tokens to {window - n_prompt} or shorten the prompt")


    def _features_for(self, drafters: Sequence[Drafter]) -> FeatureBuffer | None:
        """A fresh per-request buffer of target features, bound to every drafter that drafts from
        them (EAGLE-style heads); None (no extra work) when no drafter wants features."""
        users = [d for d in drafters if d.caps.reads_target_features]
        if not users:
            return None
        self.target.require_hidden_states(f"drafter {users[0].name!r}")
        if self._feature_forward is None:
            self._feature_forward = TargetFeatureForward(self.target.model)
        cfg = self.target.model.config
        buffer = FeatureBuffer(int(cfg.hidden_size), self.target.device, self.target.dtype)
        for d in users:
            d.bind_features(buffer)
        return buffer

    def _forward(self, cache: Any, ids: Sequence[int], keep: int,
                 features: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target logits of the last ``keep`` inputs; with ``features`` also the final hidden
        state of every input (same logits, one pass; transformers backend only), for drafters
        that draft from them. The backends run their own forwards without autograd."""
        if features:
            with torch.inference_mode():
                x = torch.tensor([list(ids)], device=self.target.device)
                logits, hidden = self._feature_forward(x, cache, keep)
            return logits[0], hidden[0]
        return self.target.forward(cache, ids, keep)

    def parts(self) -> RowParts:
        """What drafts for a request of this engine: its own drafters, policies, cost model and
        tree settings (what they learn is the engine's)."""
        return RowParts(self.drafters, self.selector, self.length, self.cost_model, self.tree, self.tree_nodes,
                        self.tree_calibration)

    def _run(self, prompt_ids: list[int], cfg: GenerationConfig) -> Generator[list[int], None, RequestStats]:
        """Generator over accepted-token chunks; its return value is the request's statistics:
        the request is a batch of one (``BatchEngine.solo``), decoded by the one round."""
        self._check_fits(len(prompt_ids), cfg.max_new_tokens)
        solo = BatchEngine.solo(self)
        rid = solo.admit(prompt_ids, cfg, self.parts())
        try:
            with self.target.request_scope():
                while True:
                    for event in solo.step():
                        if event.tokens:
                            yield event.tokens
                        if event.finished:
                            return event.result.stats
        finally:
            solo.cancel(rid)  # a request abandoned early (an exception, a closed stream) frees its state
