"""Target backends: what runs the target (and model drafters) under the engine.

A backend owns a model's weights and per-sequence KV states and offers the few operations the
engine needs: a forward over new tokens returning the logits of the last ``keep`` positions,
truncation of a state to a length, the vocabulary, the context window, the tokenizer and EOS.
Hugging Face / PyTorch (``transformers``, ``models.LoadedModel``) is the default; llama.cpp
(``llama.cpp``, ``backends.llamacpp.LlamaCppTarget``) runs GGUF files on llama.cpp's kernels.
Drafters and policies do not know which backend runs.
"""

from .base import BACKENDS, DEFAULT_BACKEND, TargetBackend, check_backend

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "TargetBackend", "check_backend"]
