"""Drafters: one class each behind the ``Drafter`` interface, built from a spec string.

Spec syntax: ``NAME[:key=value,key=value]``, and ``model:REF`` for a model drafter, where REF
is anything ``load_model`` accepts (Hugging Face id, local directory, .gguf file). Every
drafter is registered here in ``registry.REGISTRY`` (kind ``drafter``) with its parameter
dataclass; a new one is one class plus one ``register_drafter`` call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..backends.base import TargetBackend
from ..errors import ConfigError
from ..kernels import linear_mode
from ..models import LoadedModel, load_model, locate_model
from ..registry import REGISTRY, Entry, Params, Spec, parse_params
from .base import Decision, Draft, Drafter, DrafterCaps, DraftStep, Proposals
from .feature_head import FeatureHeadDrafter, check_head_file
from .lookup import PromptLookupDrafter, check_ngrams
from .model import ModelDrafter, check_same_vocabulary, early_exit_model
from .none import NoDrafter
from .recycle import RecycleDrafter, check_top
from .suffix import SuffixDatastore, SuffixDrafter, check_matches
from .tiny_lm import TinyLMDrafter, check_tiny_lm_dir

__all__ = [
    "DRAFTER_NAMES",
    "Decision",
    "Draft",
    "DraftStep",
    "Drafter",
    "DrafterCaps",
    "FeatureHeadDrafter",
    "ModelDrafter",
    "NoDrafter",
    "PromptLookupDrafter",
    "Proposals",
    "RecycleDrafter",
    "SuffixDatastore",
    "SuffixDrafter",
    "TinyLMDrafter",
    "build_drafter",
    "check_same_vocabulary",
    "default_drafters",
    "drafter_family",
    "drafts_trees",
    "parse_drafter",
    "parse_params",
    "register_drafter",
]

def drafts_trees(spec: str | Drafter) -> bool:
    """Whether the drafter a spec (or instance) names proposes draft trees (its class's
    ``caps.drafts_trees``; a model drafter's trees also need a transformers drafter)."""
    if isinstance(spec, Drafter):
        return spec.caps.drafts_trees
    entry = REGISTRY.find("drafter", str(spec).strip().partition(":")[0])
    return entry is not None and bool(entry.caps.drafts_trees)


def drafter_family(spec: str | Drafter) -> str:
    """The kind of drafter a spec or instance is, whatever its name: ``suffix`` for every suffix
    drafter, with or without a datastore (``prompt-lookup`` for ``pld``, ``model`` for
    ``model:REF``). Drafters of one family draw on the same evidence, so ``auto`` does not
    count their agreement (``selection.auto.peek_context``)."""
    if isinstance(spec, Drafter):
        return spec.family
    kind = str(spec).strip().partition(":")[0].strip().lower()
    entry = REGISTRY.find("drafter", kind)
    return entry.caps.family if entry is not None else kind


# -- parameters of the built-in drafters (validated without building anything) -------------------
@dataclass(frozen=True)
class NoParams(Params):
    """A drafter without parameters."""


@dataclass(frozen=True)
class PromptLookupParams(Params):
    max_ngram: int = 3
    min_ngram: int = 1

    def check(self) -> None:
        check_ngrams(self.min_ngram, self.max_ngram)


@dataclass(frozen=True)
class SuffixParams(Params):
    """``datastore``: a saved datastore file; ``corpus``: a text file tokenized with the
    target's tokenizer (so the drafter is built with the target); ``min_match`` None: the
    datastore file's, else 2."""

    min_match: int | None = None
    max_match: int = 24
    max_candidates: int = 64
    datastore: str | None = None
    corpus: str | None = None
    max_tokens: int | None = None
    learn: bool = False

    def check(self) -> None:
        if self.datastore is not None and self.corpus is not None:
            raise ConfigError("suffix drafter: give either datastore= or corpus=, not both")
        for what, path in (("datastore", self.datastore), ("corpus", self.corpus)):
            if path is not None and not Path(path).expanduser().is_file():
                raise ConfigError(f"{what} file not found: {Path(path).expanduser()}")
        if self.min_match is not None:
            check_matches(self.min_match, self.max_match)

    @property
    def needs_target(self) -> bool:
        return self.corpus is not None


@dataclass(frozen=True)
class RecycleParams(Params):
    top: int = 1

    def check(self) -> None:
        check_top(self.top)


@dataclass(frozen=True)
class SelfParams(Params):
    """The target drafts for itself (its own forward, its weights)."""

    @property
    def needs_target(self) -> bool:
        return True


@dataclass(frozen=True)
class EarlyExitParams(Params):
    layers: int | None = None

    def check(self) -> None:
        if self.layers is None:
            raise ConfigError("early-exit needs the number of layers: early-exit:layers=8")

    @property
    def needs_target(self) -> bool:
        return True


@dataclass(frozen=True)
class TrainedParams(Params):
    """A trained drafter file or directory: ``KIND:path=PATH[,name=NAME]``."""

    KIND: ClassVar[str] = ""
    WHAT: ClassVar[str] = ""
    path: str | None = None
    name: str | None = None

    def check(self) -> None:
        if not self.path:
            raise ConfigError(f"{self.KIND} needs the trained {self.WHAT}: write {self.KIND}:path={self.WHAT.upper()} "
                              f"(train one with `adaspec train-drafter --kind {self.KIND}`)")
        self.locate(self.path)

    def locate(self, path: str) -> None:
        """Raise a clear error when ``path`` is not there."""

    @property
    def needs_target(self) -> bool:
        return True


@dataclass(frozen=True)
class FeatureHeadParams(TrainedParams):
    KIND: ClassVar[str] = "feature-head"
    WHAT: ClassVar[str] = "file"

    def locate(self, path: str) -> None:
        check_head_file(path)


@dataclass(frozen=True)
class TinyLMParams(TrainedParams):
    KIND: ClassVar[str] = "tiny-lm"
    WHAT: ClassVar[str] = "dir"

    def locate(self, path: str) -> None:
        check_tiny_lm_dir(path)


@dataclass(frozen=True)
class ModelParams(Params):
    """``model:REF``: REF is anything ``load_model`` accepts (Hugging Face id, local directory,
    .gguf file), located here (a missing file is an error) and loaded when built."""

    ref: str = ""

    def check(self) -> None:
        if not self.ref:
            raise ConfigError("model drafter needs a model: write model:HF_ID, model:DIR or model:FILE.gguf")
        locate_model(self.ref)

    @property
    def needs_target(self) -> bool:
        return True


# -- factories: a parsed spec and the target -> the drafter ---------------------------------------
def _prompt_lookup(spec: Spec, **_: Any) -> Drafter:
    return PromptLookupDrafter(max_ngram=spec.params.max_ngram, min_ngram=spec.params.min_ngram)


def _suffix(spec: Spec, target: LoadedModel | None = None, **_: Any) -> Drafter:
    p: SuffixParams = spec.params
    min_match, max_tokens = p.min_match, p.max_tokens  # min_match None: from the datastore file, else 2
    store, path = None, p.datastore or p.corpus
    if p.datastore is not None:
        store = SuffixDatastore.load(p.datastore, max_tokens=max_tokens, min_match=min_match)
    elif p.corpus is not None:
        store = SuffixDatastore.from_text(p.corpus, target.tokenizer if target is not None else None,
                                          max_tokens=max_tokens or 1_000_000, min_match=min_match or 2)
    # named after its data: a pool's six datastores are suffix:code, suffix:math, ...
    name = f"suffix:{Path(path).stem}" if store is not None else None
    if p.learn and store is None:
        store = SuffixDatastore(min_match=min_match or 2, max_tokens=max_tokens or 1_000_000)
    return SuffixDrafter(min_match=store.min_match if store is not None else (min_match or 2),
                         max_match=p.max_match, max_candidates=p.max_candidates, datastore=store, learn=p.learn,
                         name=name)


def _recycle(spec: Spec, **_: Any) -> Drafter:
    return RecycleDrafter(top=spec.params.top)


def _self(spec: Spec, target: LoadedModel, **_: Any) -> Drafter:
    return ModelDrafter(target, target.vocab_size, name="self")


def _need_torch_target(target: TargetBackend, kind: str) -> None:
    """Drafters built from the target's own PyTorch weights need the transformers backend."""
    if isinstance(target, TargetBackend) and target.backend != "transformers":
        raise ConfigError(f"{kind} drafters are built from the target's PyTorch weights, which the "
                          f"{target.backend} backend does not have: use --backend transformers, or "
                          "model:FILE.gguf, prompt-lookup or suffix on this backend")


def _early_exit(spec: Spec, target: LoadedModel, **_: Any) -> Drafter:
    layers = spec.params.layers
    _need_torch_target(target, "early-exit")
    return ModelDrafter(early_exit_model(target, layers), target.vocab_size, name=f"early-exit:{layers}")


def _trained(cls: Any) -> Callable[..., Drafter]:
    """Factory for a trained drafter file/directory (``TrainedParams``)."""
    def factory(spec: Spec, target: LoadedModel, **_: Any) -> Drafter:
        _need_torch_target(target, spec.params.KIND)
        return cls.load(spec.params.path, target, name=spec.params.name)
    return factory


def _model(spec: Spec, target: LoadedModel, device: Any = None, dtype: Any = None, **_: Any) -> Drafter:
    on_torch = target.backend == "transformers"  # a GGUF drafter of a llama.cpp target: llama.cpp
    linear = linear_mode(getattr(target, "model", None)) if on_torch else "auto"  # the target's kernels
    loaded = load_model(spec.params.ref, device=device or target.device, linear=linear,
                        dtype=dtype or (target.dtype if on_torch else None), backend=target.backend,
                        threads=None if on_torch else getattr(target, "threads", None))
    check_same_vocabulary(target, loaded)
    return ModelDrafter(loaded, target.vocab_size)


def _none(spec: Spec, **_: Any) -> Drafter:
    return NoDrafter()


def register_drafter(name: str, component: Any, **options: Any) -> Entry:
    """Register a drafter (``registry.Registry.register`` for kind ``drafter``): a ``Drafter``
    class (built with its spec's parameters) or a factory ``f(spec, target=..., device=...,
    dtype=...)`` with its ``params``."""
    return REGISTRY.register("drafter", name, component, **options)


REGISTRY.hints["drafter"] = " (e.g. prompt-lookup:max_ngram=3, suffix:min_match=2, model:path/to/model)"
register_drafter("prompt-lookup", _prompt_lookup, params=PromptLookupParams, aliases=("pld",),
                 caps=PromptLookupDrafter.caps, default=True)
register_drafter("suffix", _suffix, params=SuffixParams, caps=SuffixDrafter.caps, default=True)
# a default on PyTorch only: on llama.cpp a 2-token verify block costs much more than a plain
# step, and a recycled token does not pay there (docs/results.md, "Token recycling")
register_drafter("recycle", _recycle, params=RecycleParams, caps=RecycleDrafter.caps, default=("transformers",))
register_drafter("none", _none, params=NoParams, caps=NoDrafter.caps, default=True)
register_drafter("self", _self, params=SelfParams, caps=ModelDrafter.caps)
register_drafter("early-exit", _early_exit, params=EarlyExitParams, caps=ModelDrafter.caps,
                 usage="early-exit:layers=N")
register_drafter("model", _model, params=ModelParams, caps=ModelDrafter.caps, positional="ref", usage="model:REF")
register_drafter("feature-head", _trained(FeatureHeadDrafter), params=FeatureHeadParams,
                 caps=FeatureHeadDrafter.caps, usage="feature-head:path=FILE")
register_drafter("tiny-lm", _trained(TinyLMDrafter), params=TinyLMParams, caps=TinyLMDrafter.caps,
                 usage="tiny-lm:path=DIR")

#: how the built-in drafters' specs are written (``REGISTRY.entries("drafter")`` lists every one)
DRAFTER_NAMES = tuple(e.usage for e in REGISTRY.entries("drafter"))


def default_drafters(backend: str) -> tuple[str, ...]:
    """The drafters ``SpeculativeEngine`` drafts with on ``backend`` when none are given: the
    registered defaults (``Entry.default``), in registration order."""
    return tuple(e.name for e in REGISTRY.entries("drafter") if e.is_default(backend))


def parse_drafter(spec: str) -> Spec:
    """A drafter spec parsed and checked (names, values, files), nothing built."""
    return REGISTRY.parse("drafter", spec)


def build_drafter(spec: str | Drafter, target: LoadedModel | None, *, device: Any = None,
                  dtype: Any = None) -> Drafter:
    """Build a drafter from a spec string (or pass a Drafter instance through)."""
    if isinstance(spec, Drafter):
        return spec
    return REGISTRY.build("drafter", parse_drafter(spec), target=target, device=device, dtype=dtype)
