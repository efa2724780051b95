"""Target backends: what runs the target (and model drafters) under the engine.

A backend owns a model's weights and per-sequence KV states and offers the few operations the
engine needs: a forward over new tokens returning the logits of the last ``keep`` positions,
truncation of a state to a length, the vocabulary, the context window, the tokenizer and EOS.
Hugging Face / PyTorch (``transformers``, ``models.LoadedModel``) is the default; llama.cpp
(``llama.cpp``, ``backends.llamacpp.LlamaCppTarget``) runs GGUF files on llama.cpp's kernels.
Drafters and policies do not know which backend runs. Each backend is registered here in
``registry.REGISTRY`` (kind ``backend``) with the loader ``models.load_model`` calls.
"""

from __future__ import annotations


from typing import Any

from ..registry import REGISTRY, Spec
from .base import DEFAULT_BACKEND, TargetBackend, check_backend, register_backend


def _load_llamacpp(spec: Spec, *, model: str, gguf: Any, **options: Any) -> TargetBackend:
    from .llamacpp import load_llamacpp  # llama-cpp-python is imported only to load a model

    return load_llamacpp(model, gguf, **options)


register_backend("transformers", None, aliases=("hf", "torch", "pytorch"))
register_backend("llama.cpp", _load_llamacpp, aliases=("llamacpp", "llama-cpp", "llama_cpp"))

#: backend names accepted by ``load_model(..., backend=)`` and ``--backend`` (the built-in ones;
#: ``REGISTRY.entries("backend")`` lists every registered one)
BACKENDS = tuple(e.name for e in REGISTRY.entries("backend"))

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "TargetBackend", "check_backend", "register_backend"]
