"""The speculative decoding engine: draft, verify, accept, roll back, repeat.

Each round (gpt-fast style, split like vLLM's proposer / scorer / rejection sampler):
1. the drafter policy picks a drafter, which catches up on tokens it has not seen;
2. the drafter proposes tokens one at a time while the length policy says go on;
3. one target forward verifies ``[last token] + drafts`` and returns k+1 distributions;
4. exact speculative sampling (or greedy matching) accepts a prefix and adds one token;
5. the target KV cache is cropped to the accepted prefix; policies get the feedback.
The output is the target's (greedy: token for token; sampling: in distribution).
"""

from __future__ import annotations

import copy
import logging
import secrets
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .config import GenerationConfig, SamplingConfig
from .costs import CostModel, VerifyCostSurface, load_or_measure
from .drafters import Decision, Draft, Drafter, DraftStep, NoDrafter, build_drafter, drafter_family
from .drafters.base import Peek, apply_decisions
from .drafters.indexed import share_indexes
from .drafters.feature_head import FeatureBuffer, TargetFeatureForward
from .errors import ConfigError, PromptError
from .feedback import RoundFeedback, alphas_from_proposals, gammas_from_proposals
from .kernels import release_own_openmp_threads
from .length import LengthPolicy, StaticLength
from .length.cost_rule import ConfidenceCalibration
from .metrics import RequestStats, RoundRecord
from .backends import DEFAULT_BACKEND, TargetBackend
from .models import DEFAULT_MODEL, as_loaded, load_model
from .pools import pool_drafters
from .sampling import process_logits, row_argmax, verify_greedy, verify_sampling
from .selection import DrafterPolicy, build_policies
from .trees import (DraftTree, PrefixCut, calibrated_scores, node_trials, nodes_worth_verifying, tree_gammas,
                    verify_tree_greedy, verify_tree_sampling)

log = logging.getLogger(__name__)

Prompt = str | Sequence[int] | Sequence[dict]

#: what ``SpeculativeEngine`` drafts with when no drafters are given (``default_drafters``, plus
#: a pool found in the cache: ``pools.pool_drafters``): the model-free drafters and plain
#: decoding, chosen among (with the draft length) by ``auto`` (``DEFAULT_SELECTOR``)
DEFAULT_DRAFTERS = ("prompt-lookup", "suffix", "recycle", "none")


def default_drafters(backend: str) -> tuple[str, ...]:
    """``DEFAULT_DRAFTERS`` for a target backend: without ``recycle`` on llama.cpp, whose verify
    block of 2 tokens costs ~1.2-1.7x a plain step (SmolLM2 GGUF), where a recycled token
    (~40% accepted) does not pay and feeding its table cost ~0.7% of the wall time; on
    PyTorch a 2-token block costs 1.03-1.06x and ``auto`` with it ran 1.045x ``auto`` without
    (docs/results.md, "Token recycling")."""
    if backend == "transformers":
        return DEFAULT_DRAFTERS
    return tuple(d for d in DEFAULT_DRAFTERS if d != "recycle")


@dataclass
class GenerationResult:
    """Output of one request."""

    text: str
    token_ids: list[int]  # generated tokens only
    prompt_ids: list[int]
    stats: RequestStats

    def to_dict(self, rounds: bool = False) -> dict:
        return {"text": self.text, "token_ids": self.token_ids,
                "stats": self.stats.to_dict(rounds=rounds)}


class _Timer:
    """perf_counter that synchronises CUDA first, so GPU work is attributed correctly."""

    def __init__(self, device: torch.device):
        self._sync = torch.cuda.synchronize if device.type == "cuda" else None

    def __call__(self) -> float:
        if self._sync is not None:
            self._sync()
        return time.perf_counter()


def cut_at_stops(emitted: list[int], remaining: int, eos: set[int],
                 hits_stop: Callable[[list[int]], bool] | None = None) -> tuple[list[int], str]:
    """Cut a round's tokens at EOS, a stop string (``hits_stop(prefix)``) or the token budget,
    exactly where plain decoding would have stopped; returns the kept tokens and the reason."""
    for j, t in enumerate(emitted):
        if t in eos:
            return emitted[: j + 1], "eos"
        if hits_stop is not None and hits_stop(emitted[: j + 1]):
            return emitted[: j + 1], "stop_string"
        if j + 1 >= remaining:
            return emitted[: j + 1], "max_new_tokens"
    return emitted, ""


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
        self._timer = _Timer(self.target.device)
        self._costs: VerifyCostSurface | None = None
        self._feature_forward: TargetFeatureForward | None = None  # built when a drafter wants features
        #: running cost estimates; policies with ``wants_costs = True`` get it as ``.costs``
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
        for policy in (self.selector, self.length):
            if hasattr(policy, "bind_drafters"):
                policy.bind_drafters([d.is_model for d in self.drafters])
            if hasattr(policy, "bind_families"):  # agreement counts across families (auto)
                policy.bind_families([drafter_family(d) for d in self.drafters])
            if hasattr(policy, "bind_trees"):  # which drafters draft trees (no decide; the node budget prices them)
                policy.bind_trees([self.tree and d.supports_tree for d in self.drafters])

    def _check_trees(self) -> None:
        if isinstance(self.tree_nodes, bool) or self.tree_nodes < 1:
            raise ConfigError(f"tree_nodes must be an integer >= 1, got {self.tree_nodes!r}")
        if not self.target.supports_trees:
            raise self.target.no_trees_error()
        if not any(d.supports_tree for d in self.drafters):
            log.info("tree=True, but none of %s drafts trees (prompt-lookup, suffix and model "
                     "drafters on transformers do): they draft chains", self.drafter_names)

    def _attach_costs(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Give cost-aware policies (and the tree budget) the cost model, priced on the measured
        surface with its timing noise pooled (``VerifyCostSurface.denoised``: a dip of a few
        percent between widths is not a cliff to stop in)."""
        wanting = [p for p in (self.selector, self.length) if getattr(p, "wants_costs", False)]
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
        (``wants_costs``): only then are verify-cost grids read or measured for them."""
        return any(getattr(p, "wants_costs", False) for p in (self.selector, self.length))

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
        bad = [t for t in prompt if not 0 <= t < self.target.vocab_size]
        if bad:
            raise PromptError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.target.vocab_size})")
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
        from .batch import BatchEngine

        engine = self
        unbatched = [i for i, d in enumerate(self.drafters) if getattr(d, "uses_target_features", False)]
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
        users = [d for d in drafters if getattr(d, "uses_target_features", False)]
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

    def _run(self, prompt_ids: list[int], cfg: GenerationConfig) -> Generator[list[int], None, RequestStats]:
        """Generator over accepted-token chunks; its return value is the request's statistics."""
        self._check_fits(len(prompt_ids), cfg.max_new_tokens)
        sampling = cfg.sampling
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(62)
        generator = None
        if not sampling.greedy:
            generator = torch.Generator(device=self.target.device).manual_seed(seed)
        stats = RequestStats(prompt_tokens=len(prompt_ids), seed=None if sampling.greedy else seed)
        t_start = self._timer()
        tokens = list(prompt_ids)
        cache = self.target.new_state()
        try:
            with self.target.request_scope():
                return (yield from self._rounds(cache, tokens, cfg, stats, generator, t_start))
        finally:
            self.target.release(cache)

    def _rounds(self, cache: Any, tokens: list[int], cfg: GenerationConfig, stats: RequestStats,
                generator: torch.Generator | None,
                t_start: float) -> Generator[list[int], None, RequestStats]:
        """The request's prefill and rounds on ``cache`` (see the module docstring)."""
        prompt_ids = list(tokens)
        now, sampling, eos = self._timer, cfg.sampling, self.eos_ids()
        drafters, selector, length = self.drafters, self.selector, self.length
        # features[j] = the target's final hidden state at position j, for every token but the newest
        features = self._features_for(drafters)
        if features is not None:  # the last prompt token is fed with the first round's drafts
            if len(tokens) > 1:
                features.append(self._forward(cache, tokens[:-1], keep=1, features=True)[1])
        else:
            stats.cached_prompt_tokens = self.target.prefill(cache, tokens) or 0
        stats.prefill_s = now() - t_start

        self._begin_request(prompt_ids)
        seen = [0] * len(drafters)  # context length each drafter has been brought up to
        n_prompt, remaining = len(prompt_ids), cfg.max_new_tokens
        # tokens a stop string can span: at most its UTF-8 bytes (byte-fallback tokens are 1 byte)
        stop_max = max((len(s.encode("utf-8")) for s in cfg.stop), default=0)
        policy_in_draft = 0.0

        def decide(step: DraftStep) -> Decision:
            nonlocal policy_in_draft
            t = time.perf_counter()
            verdict = length.decide(step)
            policy_in_draft += time.perf_counter() - t
            return verdict

        cost_model = self.cost_model
        cost_model.last_width = 0  # the prefill's shape came last (``CostModel.switch_cost``)
        # a selector that looks before it chooses gets every cheap drafter's proposal first
        peek_k = int(getattr(selector, "peek_tokens", 0) or 0)
        looks = getattr(selector, "looks", None)  # auto:look_share>0 skips looks that do not pay
        peeked: dict[int, Peek] = {}
        trees = [self.tree and d.supports_tree for d in drafters]
        # auto's plain steps may become the first model-free tree drafter's tree (``_plain_tree``)
        plain_tree = next((j for j, d in enumerate(drafters) if trees[j] and not d.is_model), None) \
            if length.plans_round_rate else None
        # drafters that learn from the target's verified rows (``RecycleDrafter``)
        observers = [d for d in drafters if d.observes_target]
        while True:
            t0 = now()
            cost_model.context = len(tokens) - 1  # cache length: policies price this round at it
            looked = bool(peek_k) and (looks is None or looks())
            look_ingest = 0.0  # prompt ingestion by drafters looked at for the first time this request
            if looked:
                peeked, look_ingest = self._peek(tokens, min(peek_k, remaining - 1), seen, n_prompt)
                selector.observe_proposals(peeked)
            elif peeked:
                peeked = {}
            i = selector.select()
            if not 0 <= i < len(drafters):
                raise ConfigError(f"selector {selector.name!r} chose drafter #{i} of {len(drafters)}")
            wanted = length.begin_round(i)  # 0: the policy chose a plain step (not the budget)
            cap = min(wanted, remaining - 1)
            t1 = t_selected = now()
            if looked and looks is not None and stats.rounds:  # the first look also ingests the prompt
                cost_model.observe_look(t_selected - t0)
            drafter = drafters[i]
            catch_up_tokens = 0
            drafter_prefill = self._ingest_prompt(i, tokens, n_prompt, seen)
            if drafter_prefill:
                t1 = now()
            if seen[i] < len(tokens):
                catch_up_tokens = len(tokens) - seen[i]  # produced while it was not used
                drafter.catch_up(tokens)
            t2 = now()
            policy_in_draft = 0.0
            tree = None
            if cap == 0 and plain_tree is not None and plain_tree in peeked and remaining > 1:
                tree = self._plain_tree(plain_tree, tokens, remaining - 1, sampling)
                if tree is not None:  # the round is that drafter's, allowed the tree's tokens
                    i, drafter, cap = plain_tree, drafters[plain_tree], len(tree)
                    wanted = cap
            if tree is not None:
                if tree.is_chain:
                    draft, tree = Draft(tokens=list(tree.tokens)), None
            elif cap > 0 and trees[i]:
                tree = self._draft_tree(i, tokens, cap, remaining - 1, sampling)
                if tree is None:  # the drafter offered one chain: drafted as without trees
                    draft = self._draft_chain(i, tokens, cap, peeked, sampling, generator, decide)
                elif tree.is_chain:  # a chain (or a tree cut to one) is verified as one
                    draft, tree = Draft(tokens=apply_decisions(tree.tokens, decide)), None
            else:
                draft = self._draft_chain(i, tokens, cap, peeked, sampling, generator, decide)
            t3 = now()

            gammas = None
            if tree is None:
                k = len(draft.tokens)
                logits, hidden = self._forward(cache, [tokens[-1], *draft.tokens], keep=k + 1,
                                               features=features is not None)
                if sampling.greedy:
                    verdict = verify_greedy(logits, draft.tokens)
                else:
                    verdict = verify_sampling(process_logits(logits, sampling), draft.tokens,
                                              draft.probs, generator)
                n, next_token = verdict.n_accepted, verdict.next_token
                if k > n:
                    self.target.truncate(cache, len(tokens) + n)
            else:
                k = len(tree)
                draft, n, next_token, logits, hidden, gammas, path = self._verify_tree(
                    cache, tokens, tree, sampling, generator, features is not None)
            t4 = now()
            fed = [tokens[-1], *draft.tokens] if observers else None  # the inputs of the rows read

            emitted, reason = self._apply_stops([*draft.tokens[:n], next_token],
                                                tokens, n_prompt, remaining, cfg, stop_max, eos)
            context_len = len(tokens)
            tokens.extend(emitted)
            if features is not None:  # rows of [last, accepted drafts]: rejected rows are dropped
                features.append(hidden[: len(emitted)])
            remaining -= len(emitted)
            seen[i] = len(tokens)

            draft_s, verify_s, catch_up_s = t3 - t2 - policy_in_draft, t4 - t3, t2 - t1
            feedback = RoundFeedback(
                round=len(stats.rounds), drafter=i, draft=draft, n_accepted=n, emitted=emitted,
                k_cap=cap, target_logits=logits, sampling=sampling, draft_s=draft_s,
                verify_s=verify_s, catch_up_s=catch_up_s, catch_up_tokens=catch_up_tokens, gammas=gammas,
                tree_nodes=0 if tree is None else k)
            t5 = now()
            eval_ingest = 0.0
            if selector.full_information and (len(drafters) > 1 or wanted == 0):
                feedback.counterfactual, eval_ingest = self._evaluate_others(
                    i, tokens[:context_len], emitted, logits, feedback, sampling, score_chosen=wanted == 0,
                    seen=seen, n_prompt=n_prompt)
                for j in feedback.counterfactual:
                    seen[j] = len(tokens)
            t6 = now()
            for d in observers:  # after scoring: a score of this round must not read its own rows
                d.observe_target(fed, logits)
            t6o = now()
            cost_model.observe(i, k, draft_s, verify_s, catch_up_tokens, catch_up_s)
            if tree is not None and drafter.is_model and tree.scores is not None:  # its node q's learn
                self.tree_calibration.observe(id(drafter), *node_trials(tree, path))
            selector.update(feedback)
            length.update(feedback)
            t7 = now()
            # the per-round overhead the plans price is the rounds' own work (looks, planning,
            # bookkeeping): not a drafter's prompt ingestion at its first use (chosen, looked at
            # or scored), paid once per request, nor scoring (``eval_share`` budgets it; a model
            # drafter is scored every round while it warms up). Both in it made every plain step
            # of a fresh engine look up to ~10x dearer, and auto drafted where it did not pay
            cost_model.observe_overhead((t7 - t0) - draft_s - verify_s - catch_up_s - drafter_prefill
                                        - look_ingest - (t6 - t5))
            cost_model.observe_eval(t6 - t5, t7 - t0)
            if self.tree:  # the running rate prices tree nodes only (``_draft_tree``)
                cost_model.observe_round(len(emitted), k + 1,
                                         (t7 - t0) - verify_s - drafter_prefill - look_ingest - eval_ingest)
            cost_model.last_width = k + 1
            # the chosen drafter's look, when its block is the draft, was drafting (a static
            # configuration pays it too): recorded as such, not as the controller's time
            stats.rounds.append(RoundRecord(
                drafter=drafter.name, k_cap=cap, drafted=k, accepted=n, emitted=len(emitted),
                draft_s=draft_s + draft.look_s, verify_s=verify_s, catch_up_s=catch_up_s,
                catch_up_tokens=catch_up_tokens,
                policy_s=(t_selected - t0) + policy_in_draft + (t7 - t6o) - look_ingest - draft.look_s,
                eval_s=t6 - t5 - eval_ingest,
                total_s=t7 - t0, drafter_prefill_s=drafter_prefill + look_ingest + eval_ingest,
                tree_nodes=0 if tree is None else k))
            yield emitted
            if reason:
                stats.stop_reason = reason
                break

        stats.new_tokens = len(tokens) - n_prompt
        stats.total_s = now() - t_start
        for d in drafters:
            d.end_request(tokens[n_prompt:])
        return stats

    def _begin_request(self, prompt_ids: list[int]) -> None:
        """A request's drafters and policies begin (also the batch engine's, per request)."""
        for d in self.drafters:
            d.begin_request(prompt_ids)
        self.selector.begin_request(self.drafter_names)
        if hasattr(self.selector, "observe_prompt"):  # policies that decide from the prompt (router)
            self.selector.observe_prompt(prompt_ids)
        self.length.begin_request()

    def _draft_chain(self, i: int, tokens: list[int], cap: int, peeked: dict[int, Peek],
                     sampling: SamplingConfig, generator: torch.Generator | None,
                     decide: Callable[[DraftStep], Decision]) -> Draft:
        """Drafter ``i``'s chain of at most ``cap`` tokens, drafted exactly as the drafter would:
        from its looked-at block (a look is deterministic drafting), looked at again ``cap``
        deep when the cap goes past a look cut at its depth; else a fresh draft.

        Never a draft from ``tokens`` + the look: a drafter takes the context it is given as
        verified, so a rejected look token stayed in the n-gram drafters' index (their next
        catch-up checks only the tokens past what they trust), and a tree the drafter offered
        earlier in the round was settled against it (until 2026-11-27: `auto` over [prompt
        lookup, none] ran 49 tokens/s on a math prompt where prompt lookup alone ran 63)."""
        if cap <= 0:
            return Draft()
        drafter = self.drafters[i]
        look = peeked.get(i)
        if look is not None:
            kept = apply_decisions(look.tokens[:cap], decide)
            n = len(kept)
            if n < cap and n == len(look.tokens) and look.cut:  # on past the look's end
                deeper = drafter.peek(tokens, cap)  # the same first n tokens (deterministic)
                if deeper is not None:
                    def go_on(step: DraftStep) -> Decision:
                        return decide(replace(step, index=step.index + n))
                    kept += apply_decisions(deeper.tokens[n:cap], go_on)
            return Draft(tokens=kept, look_s=look.seconds)
        return drafter.draft(tokens, cap, sampling, generator, decide,
                             want_hidden=self.length.needs_hidden and drafter.is_model)

    def _plain_tree(self, index: int, tokens: list[int], room: int,
                    sampling: SamplingConfig) -> DraftTree | None:
        """With trees on, ``auto`` planned a plain step (its looks found no chain that pays):
        model-free drafter ``index``'s tree (it was looked at, so it has seen ``tokens``),
        cut where its nodes stop paying at the generation's running rate R (the m maximising
        E_m - R (o + V(m + 1)), m = 0 the plain step: ``trees.nodes_worth_verifying``). On a
        flat verify curve a few candidates after a token without a match (the request's
        frequent tokens) cost almost nothing: with trees, static suffix + cost-model ran 1.74x
        AR and `auto` 1.68x, whose plain steps (38% of its rounds) never drafted a tree. The
        first model-free tree drafter is asked (prompt lookup in the default pool; its
        candidates and suffix's come from one shared index). None: the plain step."""
        if self.length.plain_rate() is None:
            return None
        tree = self._draft_tree(index, tokens, 1, room, sampling)
        return tree if tree is not None and len(tree) else None

    def _draft_tree(self, index: int, tokens: list[int], cap: int, room: int,
                    sampling: SamplingConfig | None = None) -> DraftTree | None:
        """The drafter's tree cut to the best-first prefix worth verifying
        (``trees.nodes_worth_verifying``); None when a model-free drafter offered a single
        chain, which the engine then drafts exactly as without trees (the length policy's cap
        and ``decide``): a tree of one chain is the chain path.

        Depth: a model drafter's tree is ``cap`` deep (every level costs a drafter forward), at
        most ``tree_nodes``, and a level is drafted only while the drafter's scores say it may
        add more tokens than its forward's seconds yield at the running rate. A
        model-free drafter's is ``tree_nodes - 1`` deep, whatever the cap (at most ``room``,
        the tokens left): its nodes cost lookups, and the budget prices each by its calibrated
        score, so a cap chosen for a chain would only cut paths that pay; one less than the
        nodes, so that a tree of one chain means the drafter had no alternative (the nodes ran
        out of candidates, not the budget). Once branched it grows only while a later node
        could still be verified (``trees.PrefixCut``): a tree stopped there is cut, never
        taken for one chain.

        A model-free tree is cut at the generation's running rate R (the m maximising E_m -
        R (o + V(m + 1)), Dinkelbach's objective), also where a length policy that plans the
        round's rate (``auto``) planned a chain: its best-first nodes include the chain's, each
        priced by its calibrated score, so the cut is the best prefix-closed part of the
        candidates the chain is one of, and the tree replaces the chain whenever it branched.
        Until 2026-11-29 it replaced the chain only when E_m / (o + V(m + 1)) beat the plan's
        own rate: by replay of the v4 trace on four pricings (three machines), `auto` +tree
        ran 1.588x, 1.463x, 1.422x and 1.453x AR that way and 1.605x, 1.473x, 1.436x and 1.473x
        this way (each the best of the three rules tried: ``docs/results.md``). A model
        drafter's tree keeps auto's ratio objective."""
        drafter = self.drafters[index]
        costs = self.cost_model
        verify_cost = costs.verify_row(self.tree_nodes + 1).__getitem__  # every width at once
        scores = None
        # the opportunity cost of a second is the generation's running rate; a model drafter's
        # tree under a policy that plans the round's rate (auto) keeps that policy's objective
        rate = None if self.length.plans_round_rate and drafter.is_model else costs.running_rate()
        if drafter.is_model:
            # its q are calibrated on the tree nodes the target saw; a level is one drafter
            # forward: worth it while it may add more expected tokens than its seconds yield
            # at the running rate (the frontier's calibrated scores are about f times its raw),
            # and only for nodes the budget would verify (``trees.dynamic_tree``'s ``budget``)
            f = self.tree_calibration.factor(id(drafter))
            level_s = max(0.0, costs.draft_cost(index, 1) - costs.draft_cost(index, 0))

            def budget(part: DraftTree) -> int:
                if part.scores is None:
                    return len(part)
                return nodes_worth_verifying(calibrated_scores(part, f), verify_cost,
                                             costs.round_overhead_s, rate)

            tree = drafter.draft_tree(tokens, min(cap, self.tree_nodes), self.tree_nodes, sampling,
                                      level_gain=level_s * costs.running_rate() / max(f, 1e-6),
                                      budget=budget)
            if tree.is_chain:
                return tree
            if tree.scores is not None:
                scores = calibrated_scores(tree, f)
        else:
            # grown node by node only while a later node could still be verified, once it
            # branched (a tree refused early is a cut tree, not one chain the drafter offered)
            depth = min(max(self.tree_nodes - 1, 1), room)
            cut = PrefixCut.priced(verify_cost, costs.round_overhead_s, self.tree_nodes, rate)
            tree = drafter.draft_tree(tokens, depth, self.tree_nodes, sampling, cut=cut)
            if tree.is_chain and not cut.stopped:
                return tree if not len(tree) else None
            scores = tree.scores
        if scores is None:
            return tree
        # over the nodes drafted (for a drafter that used ``cut``, its ``best_m``; one that
        # ignores it is cut here all the same)
        return tree.prefix(nodes_worth_verifying(scores, verify_cost, costs.round_overhead_s, rate))

    def _verify_tree(self, cache: Any, tokens: list[int], tree: DraftTree, sampling: SamplingConfig,
                     generator: torch.Generator | None, features: bool
                     ) -> tuple[Draft, int, int, torch.Tensor, torch.Tensor | None, list[float], list[int]]:
        """One target forward over the tree, exact acceptance (``adaspec.trees``), the accepted
        path's KV kept. For the policies the round reads as a chain: the accepted path, then
        (if it has children) the first child of its end, which was rejected; logits (and
        hidden states) of those positions; Not-a-Bandit Theorem 2 gammas at each of them; the
        accepted nodes (``TreeVerdict.path``)."""
        logits, hidden = self.target.forward_tree(cache, tokens[-1], tree, hidden=features)
        if sampling.greedy:
            verdict = verify_tree_greedy(logits, tree)
        else:
            probs = process_logits(logits, sampling)
            verdict = verify_tree_sampling(probs, tree, generator)
        rows = verdict.rows
        self.target.keep_path(cache, len(tokens) - 1, rows)
        n = len(verdict.path)
        kids = tree.children()[rows[-1]]
        chain = rows + [kids[0] + 1] if kids else rows
        draft = Draft(tokens=[tree.tokens[r - 1] for r in chain[1:]])
        if sampling.greedy:
            gammas = [1.0] * n + [0.0] * (len(chain) - 1 - n)
        else:
            gammas = tree_gammas(probs, tree, chain[:-1])
        return (draft, n, verdict.next_token, logits[chain],
                None if hidden is None else hidden[chain], gammas, verdict.path)

    def _peek(self, tokens: list[int], max_tokens: int, seen: list[int],
              n_prompt: int) -> tuple[dict[int, Peek], float]:
        """Every drafter's proposal that costs no model call (``Drafter.peek``), by index, and
        the seconds of the prompt's ingestion by drafters looked at for the first time this
        request (once per request, not priced per round); the rest of the time counts as the
        round's policy overhead, which the cost model prices."""
        out: dict[int, Peek] = {}
        ingest = 0.0
        now = self._timer
        for j, d in enumerate(self.drafters):
            if d.is_model:
                continue
            ingest += self._ingest_prompt(j, tokens, n_prompt, seen)
            t = now()
            props = d.peek(tokens, max_tokens)
            if props is not None:
                props.seconds, props.cut = now() - t, len(props.tokens) >= max_tokens
                out[j] = props
                seen[j] = len(tokens)
        return out, ingest

    def _ingest_prompt(self, j: int, tokens: Sequence[int], n_prompt: int, seen: list[int]) -> float:
        """Drafter ``j``'s first use in a request (``seen[j]`` 0), chosen, looked at or scored:
        it reads the prompt (its prefill), once. Returns the seconds (0 if already seen): the
        engines record them as drafter prefill, never as a round's overhead."""
        if seen[j] != 0 or not n_prompt:
            return 0.0
        t = self._timer()
        self.drafters[j].catch_up(tokens[:n_prompt])
        seen[j] = n_prompt
        return self._timer() - t

    def _apply_stops(self, emitted: list[int], tokens: list[int], n_prompt: int, remaining: int,
                     cfg: GenerationConfig, stop_max: int, eos: set[int]) -> tuple[list[int], str]:
        hits = None
        if cfg.stop:
            def hits(new: list[int]) -> bool:
                return self._hits_stop(tokens, n_prompt, new, cfg.stop, stop_max)
        return cut_at_stops(emitted, remaining, eos if cfg.stop_on_eos else set(), hits)

    def _hits_stop(self, tokens: list[int], n_prompt: int, new: list[int], stops: Sequence[str],
                   stop_max: int) -> bool:
        """Does the tail of the generated text (never the prompt) contain a stop string?"""
        window = stop_max + 8
        start = max(n_prompt, len(tokens) - max(0, window - len(new)))
        tail = self.decode((tokens[start:] + new)[-window:])
        return any(s in tail for s in stops)

    def _evaluate_others(self, chosen: int, context: list[int], emitted: list[int],
                         logits: torch.Tensor, feedback: RoundFeedback,
                         sampling: SamplingConfig, score_chosen: bool = False, seen: list[int] | None = None,
                         n_prompt: int = 0) -> tuple[dict[int, list[float]], float]:
        """Full-information hook (Not-a-Bandit 3.2): prefill the verified tokens into every other
        drafter and compute its acceptance probability at each of them, without target calls.
        ``score_chosen``: the chosen drafter had a zero cap, so it is scored like the others.
        A selector may skip drafters (``selector.evaluate(j)`` False: skipped evaluation, B.5;
        ``selector.to_score`` gives the round's set in one call).
        Also returns the seconds a drafter scored for the first time this request (``seen[j]``
        0) spent ingesting the prompt's ``n_prompt`` tokens: paid once, not per round."""
        m = len(emitted)
        target_logits = logits[:m]
        # greedy scores compare argmaxes (the rows' argmax, once); the target's softmax over the
        # vocabulary only when sampling (~70 us a round on SmolLM2: half the scoring time)
        target_probs: torch.Tensor | None = None
        argmax: list[int] | None = None
        out: dict[int, list[float]] = {} if score_chosen else {chosen: feedback.chosen_gammas()}
        alphas: dict[int, list[float]] = {}
        proposed: dict[int, list[bool]] = {}
        ingest = 0.0
        to_score = getattr(self.selector, "to_score", None)  # the round's set at once (auto)
        if to_score is not None:
            scored = to_score(chosen, score_chosen)
        else:
            evaluate = getattr(self.selector, "evaluate", None)
            scored = [j for j in range(len(self.drafters)) if not (
                (j == chosen and not score_chosen) or (evaluate is not None and not evaluate(j)))]
        for j in scored:
            d = self.drafters[j]
            if seen is not None:
                ingest += self._ingest_prompt(j, context, n_prompt, seen)
            props = d.score(context, emitted, sampling)
            if sampling.greedy:
                argmax = row_argmax(target_logits) if argmax is None else argmax
            elif target_probs is None:
                target_probs = feedback.target_probs[:m]
            out[j] = gammas_from_proposals(target_logits, target_probs, props, sampling, argmax)
            alphas[j] = alphas_from_proposals(target_probs, props, emitted, sampling)
            proposed[j] = [t >= 0 for t in props.tokens] if props.tokens is not None else [True] * m
        feedback.counterfactual_alpha = alphas
        feedback.counterfactual_proposed = proposed
        return out, ingest
