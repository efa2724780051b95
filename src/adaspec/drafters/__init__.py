"""Drafters: one class each behind the ``Drafter`` interface, built from a spec string.

Spec syntax: ``NAME[:key=value,key=value]``, and ``model:REF`` for a model drafter, where REF
is anything ``load_model`` accepts (Hugging Face id, local directory, .gguf file).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..backends.base import TargetBackend
from ..errors import AdaspecError, ConfigError, UnknownNameError
from ..kernels import linear_mode
from ..models import LoadedModel, load_model
from .base import Decision, Draft, Drafter, DraftStep, Proposals
from .feature_head import FeatureHeadDrafter
from .lookup import PromptLookupDrafter
from .model import ModelDrafter, check_same_vocabulary, early_exit_model
from .none import NoDrafter
from .recycle import RecycleDrafter
from .suffix import SuffixDatastore, SuffixDrafter
from .tiny_lm import TinyLMDrafter

__all__ = [
    "DRAFTER_NAMES",
    "Decision",
    "Draft",
    "DraftStep",
    "Drafter",
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
    "drafter_family",
    "drafts_trees",
    "parse_params",
]

#: drafters that propose draft trees (``Drafter.supports_tree``); the others draft chains
TREE_DRAFTERS = ("prompt-lookup", "pld", "suffix", "recycle", "self", "early-exit", "model", "feature-head", "tiny-lm")


def drafts_trees(spec: str | Drafter) -> bool:
    """Whether the drafter a spec (or instance) names proposes draft trees."""
    if isinstance(spec, Drafter):
        return spec.supports_tree
    return str(spec).strip().partition(":")[0].strip().lower() in TREE_DRAFTERS


def drafter_family(spec: str | Drafter) -> str:
    """The kind of drafter a spec or instance is, whatever its name: ``suffix`` for every suffix
    drafter, with or without a datastore (``prompt-lookup`` for ``pld``, ``model`` for
    ``model:REF``). Drafters of one family draw on the same evidence, so ``auto`` does not
    count their agreement (``selection.auto.peek_context``)."""
    if isinstance(spec, Drafter):
        return spec.family
    kind = str(spec).strip().partition(":")[0].strip().lower()
    return _FAMILY_OF_KIND.get(kind, kind)


def parse_params(text: str, what: str) -> dict[str, str]:
    """Parse ``key=value,key=value`` (empty string -> {})."""
    params: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise AdaspecError(f"bad parameter {part!r} in {what}: write key=value")
        key, value = part.split("=", 1)
        params[key.strip().replace("-", "_")] = value.strip()
    return params


def _take(params: dict[str, str], key: str, conv: Callable[[str], Any], default: Any) -> Any:
    if key not in params:
        return default
    raw = params.pop(key)
    try:
        return conv(raw)
    except ValueError:
        raise AdaspecError(f"parameter {key}={raw!r} is not a valid {conv.__name__}") from None


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _no_leftovers(params: dict[str, str], name: str, allowed: str) -> None:
    if params:
        raise AdaspecError(f"unknown parameter(s) {sorted(params)} for drafter {name!r}: allowed: {allowed}")


def _prompt_lookup(params: dict[str, str], target: LoadedModel, **_: Any) -> Drafter:
    d = PromptLookupDrafter(max_ngram=_take(params, "max_ngram", int, 3),
                            min_ngram=_take(params, "min_ngram", int, 1))
    _no_leftovers(params, "prompt-lookup", "max_ngram, min_ngram")
    return d


def _suffix(params: dict[str, str], target: LoadedModel, **_: Any) -> Drafter:
    min_match = _take(params, "min_match", int, None)  # None: from the datastore file, else 2
    max_tokens = _take(params, "max_tokens", int, None)
    store = None
    if "datastore" in params and "corpus" in params:
        raise AdaspecError("suffix drafter: give either datastore= or corpus=, not both")
    if "datastore" in params:
        path = params.pop("datastore")
        store = SuffixDatastore.load(path, max_tokens=max_tokens, min_match=min_match)
    elif "corpus" in params:
        path = params.pop("corpus")
        store = SuffixDatastore.from_text(path, target.tokenizer, max_tokens=max_tokens or 1_000_000,
                                          min_match=min_match or 2)
    # named after its data: a pool's six datastores are suffix:code, suffix:math, ...
    name = f"suffix:{Path(path).stem}" if store is not None else None
    learn = _take(params, "learn", _bool, False)
    if learn and store is None:
        store = SuffixDatastore(min_match=min_match or 2, max_tokens=max_tokens or 1_000_000)
    d = SuffixDrafter(min_match=store.min_match if store is not None else (min_match or 2),
                      max_match=_take(params, "max_match", int, 24),
                      max_candidates=_take(params, "max_candidates", int, 64),
                      datastore=store, learn=learn, name=name)
    _no_leftovers(params, "suffix", "min_match, max_match, max_candidates, datastore, corpus, "
                  "max_tokens, learn")
    return d


def _recycle(params: dict[str, str], target: LoadedModel, **_: Any) -> Drafter:
    d = RecycleDrafter(top=_take(params, "top", int, 1))
    _no_leftovers(params, "recycle", "top")
    return d


def _self(params: dict[str, str], target: LoadedModel, **_: Any) -> Drafter:
    _no_leftovers(params, "self", "(none)")
    return ModelDrafter(target, target.vocab_size, name="self")


def _need_torch_target(target: TargetBackend, kind: str) -> None:
    """Drafters built from the target's own PyTorch weights need the transformers backend."""
    if isinstance(target, TargetBackend) and target.backend != "transformers":
        raise ConfigError(f"{kind} drafters are built from the target's PyTorch weights, which the "
                          f"{target.backend} backend does not have: use --backend transformers, or "
                          "model:FILE.gguf, prompt-lookup or suffix on this backend")


def _early_exit(params: dict[str, str], target: LoadedModel, **_: Any) -> Drafter:
    layers = _take(params, "layers", int, None)
    _no_leftovers(params, "early-exit", "layers")
    if layers is None:
        raise AdaspecError("early-exit needs the number of layers: early-exit:layers=8")
    _need_torch_target(target, "early-exit")
    return ModelDrafter(early_exit_model(target, layers), target.vocab_size,
                        name=f"early-exit:{layers}")


def _trained(kind: str, cls: Any, what: str) -> Callable[..., Drafter]:
    """Factory for a trained drafter file/directory: ``KIND:path=PATH[,name=NAME]``."""
    def factory(params: dict[str, str], target: LoadedModel, **_: Any) -> Drafter:
        path = params.pop("path", None)
        name = params.pop("name", None)
        _no_leftovers(params, kind, "path, name")
        if not path:
            raise AdaspecError(f"{kind} needs the trained {what}: write {kind}:path={what.upper()} "
                               f"(train one with `adaspec train-drafter --kind {kind}`)")
        _need_torch_target(target, kind)
        return cls.load(path, target, name=name)
    return factory


def _none(params: dict[str, str], target: LoadedModel, **_: Any) -> Drafter:
    _no_leftovers(params, "none", "(none)")
    return NoDrafter()


_FACTORIES: dict[str, Callable[..., Drafter]] = {
    "none": _none,
    "prompt-lookup": _prompt_lookup,
    "pld": _prompt_lookup,
    "suffix": _suffix,
    "recycle": _recycle,
    "self": _self,
    "early-exit": _early_exit,
    "feature-head": _trained("feature-head", FeatureHeadDrafter, "file"),
    "tiny-lm": _trained("tiny-lm", TinyLMDrafter, "dir"),
}
#: spec kinds whose drafter class has another family name
_FAMILY_OF_KIND = {"pld": "prompt-lookup", "self": "model", "early-exit": "model"}
DRAFTER_NAMES = ("none", "prompt-lookup", "pld", "suffix", "recycle", "self", "early-exit:layers=N", "model:REF",
                 "feature-head:path=FILE", "tiny-lm:path=DIR")


def build_drafter(spec: str | Drafter, target: LoadedModel, *, device: Any = None,
                  dtype: Any = None) -> Drafter:
    """Build a drafter from a spec string (or pass a Drafter instance through)."""
    if isinstance(spec, Drafter):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise UnknownNameError(f"empty drafter spec: use one of {', '.join(DRAFTER_NAMES)}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    if name == "model":
        if not rest:
            raise AdaspecError("model drafter needs a model: write model:HF_ID, model:DIR or model:FILE.gguf")
        on_torch = target.backend == "transformers"  # a GGUF drafter of a llama.cpp target: llama.cpp
        linear = linear_mode(getattr(target, "model", None)) if on_torch else "auto"  # the target's kernels
        loaded = load_model(rest, device=device or target.device, linear=linear,
                            dtype=dtype or (target.dtype if on_torch else None), backend=target.backend,
                            threads=None if on_torch else getattr(target, "threads", None))
        check_same_vocabulary(target, loaded)
        return ModelDrafter(loaded, target.vocab_size)
    factory = _FACTORIES.get(name)
    if factory is None:
        raise UnknownNameError(
            f"unknown drafter {spec!r}: use one of {', '.join(DRAFTER_NAMES)} "
            "(e.g. prompt-lookup:max_ngram=3, suffix:min_match=2, model:path/to/model)")
    return factory(parse_params(rest, f"drafter {spec!r}"), target)
