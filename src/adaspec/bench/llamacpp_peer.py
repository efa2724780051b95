"""llama.cpp's own decoding as peers in ``adaspec bench``: what a CPU user runs without adaspec.

* ``llama.cpp[:flash_attn=0|1]``: plain greedy ``Llama.generate`` of llama-cpp-python;
* ``llama.cpp-pld[:k=10,max_ngram=2,flash_attn=0|1]``: the same with its prompt lookup decoding
  (``LlamaPromptLookupDecoding(num_pred_tokens=k, max_ngram_size=max_ngram)``, its defaults).

Both load the target's GGUF file with the target's thread count and, unless ``flash_attn`` is
given, the target's flash attention setting (the llama.cpp backend's: off on a CPU, as
llama-cpp-python's own default; off against a transformers target): the same kernels, so the
greedy outputs can be compared token for token. Counting follows the HF
peers: ``rounds`` are the target evaluations that emit tokens (the first is the prompt's). A
run that raises inside llama-cpp-python (its prompt lookup has failed on long prompts) is
recorded as failed, with the error, instead of stopping the bench.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..backends.llamacpp import import_llama_cpp, llama_thread, on_thread, safe_model_params, uses_amx
from ..drafters import parse_params
from ..errors import AdaspecError, ConfigError, PromptError
from ..exactness import NEAR_TIE_NATS_LLAMACPP
from ..models import locate_model
from .peer_run import EmissionClock, PeerRun

LLAMACPP_PEER_NAMES = ("llama.cpp[:flash_attn=0|1]", "llama.cpp-pld[:k=10,max_ngram=2,flash_attn=0|1]")
_PLD_K, _PLD_NGRAM = 10, 2  # LlamaPromptLookupDecoding's defaults
PEER_CTX = 4096  # the peer's window: llama-cpp-python keeps n_ctx x vocab floats of scores for PLD


def is_llamacpp_peer(text: str) -> bool:
    return isinstance(text, str) and text.strip().lower().partition(":")[0] in ("llama.cpp", "llama.cpp-pld")


@dataclass(frozen=True)
class LlamaCppPeerSpec:
    spec: str
    pld: bool
    k: int | None = None
    max_ngram: int | None = None
    flash_attn: bool | None = None  # None: the target's setting (``LlamaCppPeer``)

    def settings(self) -> dict[str, Any]:
        pld = {"num_pred_tokens": self.k, "max_ngram_size": self.max_ngram} if self.pld else {}
        return pld | ({} if self.flash_attn is None else {"flash_attn": self.flash_attn})


def parse_llamacpp_peer(text: str) -> LlamaCppPeerSpec:
    name, _, rest = text.strip().partition(":")
    name = name.strip().lower()
    try:
        params = parse_params(rest, f"peer {text!r}")
    except AdaspecError as exc:
        raise ConfigError(str(exc)) from None
    flash = params.pop("flash_attn", None)
    flash = None if flash is None else flash.strip().lower()
    if flash not in (None, "0", "1", "true", "false"):
        raise ConfigError(f"peer {text!r}: flash_attn must be 0 or 1, got {flash!r}")
    flash_attn = None if flash is None else flash in ("1", "true")
    if name == "llama.cpp":
        if params:
            raise ConfigError(f"unknown parameter(s) {sorted(params)} for peer {text!r}: allowed: flash_attn")
        return LlamaCppPeerSpec(text.strip(), pld=False, flash_attn=flash_attn)
    values = {}
    for key, default in (("k", _PLD_K), ("max_ngram", _PLD_NGRAM)):
        raw = params.pop(key, None)
        try:
            values[key] = default if raw is None else int(raw)
        except ValueError:
            raise ConfigError(f"peer {text!r}: {key}={raw!r} is not an integer") from None
        if values[key] < 1:
            raise ConfigError(f"peer {text!r}: {key} must be >= 1")
    if params:
        raise ConfigError(f"unknown parameter(s) {sorted(params)} for peer {text!r}: allowed: k, "
                          "max_ngram, flash_attn")
    return LlamaCppPeerSpec(text.strip(), pld=True, flash_attn=flash_attn, **values)


def target_gguf(target: Any) -> Path:
    """The GGUF file of the target: the llama.cpp backend's own, or the file a transformers
    target was de-quantised from."""
    path = getattr(target, "path", None)
    if path is None:
        path = locate_model(target.name)
    if path is None:
        raise ConfigError(f"llama.cpp peers run the target's GGUF file, and {target.name!r} was not "
                          "loaded from one: bench a .gguf model (e.g. smollm2), or drop the llama.cpp peers")
    return Path(path)


class LlamaCppPeer:
    """One llama.cpp peer on the target's GGUF file (see the module docstring)."""

    def __init__(self, target: Any, spec: str | LlamaCppPeerSpec, threads: int | None = None):
        import torch

        self.spec = parse_llamacpp_peer(spec) if isinstance(spec, str) else spec
        L = import_llama_cpp()
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = (LlamaPromptLookupDecoding(max_ngram_size=self.spec.max_ngram, num_pred_tokens=self.spec.k)
                 if self.spec.pld else None)
        n = int(threads or getattr(target, "threads", None) or torch.get_num_threads())
        path = target_gguf(target)
        flash = self.spec.flash_attn
        if flash is None:  # the target's own, so that both run the same kernels
            flash = bool(getattr(target, "flash_attn", False))
        self.flash_attn = flash
        self.tie_nats = NEAR_TIE_NATS_LLAMACPP  # llama.cpp's kernels (``Peer``)
        # built and run on the target's llama.cpp thread, if it has one (``LlamaThread``)
        self._decoder = llama_thread(uses_amx(L, path))
        with safe_model_params(L, path):  # the same weights' layout as the target backend's
            self.llm = on_thread(self._decoder, lambda: L.Llama(
                model_path=str(path), n_ctx=PEER_CTX, n_batch=512, n_threads=n, n_threads_batch=n,
                draft_model=draft, flash_attn=flash, verbose=False))
        self.widths: list[int] = []
        evaluate = self.llm.eval

        def counted(tokens: Any) -> None:  # generate() calls self.eval once per target evaluation
            self.widths.append(len(tokens))
            on_thread(self._decoder, evaluate, tokens)

        self.llm.eval = counted  # type: ignore[method-assign]

    @property
    def name(self) -> str:
        return self.spec.spec

    def settings(self) -> dict[str, Any]:
        return self.spec.settings() | {"flash_attn": self.flash_attn}

    def new_pass(self) -> None:
        """Nothing to forget: prompt lookup drafts from the request's own context."""

    def close(self) -> None:
        """Nothing to free before the bench ends (the model goes with the process)."""

    def run(self, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> PeerRun:
        """Greedy generation (temperature 0), stopped like adaspec's engine: after
        ``max_new_tokens`` or at the first token in ``eos_ids`` (kept)."""
        prompt_ids = list(prompt_ids)
        if len(prompt_ids) + max_new_tokens > PEER_CTX:
            raise PromptError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                              f"the llama.cpp peers' window ({PEER_CTX})")
        if self._decoder is not None:
            self._decoder.free_caller()
        self.llm.reset()  # no prefix reuse between runs: every run prefills its prompt
        self.widths = []
        out: list[int] = []
        error = None
        t0 = time.perf_counter()
        clock = EmissionClock()  # llama-cpp-python hands out tokens one at a time
        try:
            for tok in self.llm.generate(prompt_ids, temp=0.0, reset=True):
                clock.tick()
                out.append(int(tok))
                if tok in eos_ids or len(out) >= max_new_tokens:
                    break
        except Exception as exc:  # noqa: BLE001 -- a peer's own failure is a result, not a bench error
            error = f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - t0
        widths = self.widths
        drafted = sum(w - 1 for w in widths[1:])
        first_s, decode_tokens, decode_s = clock.split()
        return PeerRun(token_ids=out, seconds=seconds, target_forwards=len(widths), rounds=len(widths),
                       prefill_tokens=widths[0] if widths else 0, drafted=drafted,
                       verify_widths=dict(Counter(widths[1:])), error=error,
                       first_s=first_s, decode_s=decode_s, decode_tokens=decode_tokens)
