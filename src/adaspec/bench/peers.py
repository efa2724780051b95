"""Hugging Face's own decoding as *peers* in ``adaspec bench``, on the same loaded target.

A peer runs ``model.generate`` of transformers (greedy) with one of its built-in speculative
strategies, so adaspec's configurations can be compared with what a user gets from HF alone:

* ``hf-greedy``: plain greedy ``generate`` (a sanity reference for adaspec's AR baseline);
* ``hf-pld[:k=10,max_ngram=2]``: prompt lookup decoding (``prompt_lookup_num_tokens``,
  ``max_matching_ngram_size``);
* ``hf-assisted:model=REF[,k=20,schedule=constant,confidence=0.4]``: assisted generation with a
  small model sharing the target's vocabulary (``num_assistant_tokens``,
  ``num_assistant_tokens_schedule``, ``assistant_confidence_threshold``).

Unset parameters take transformers 5.x's defaults. Counting is comparable with adaspec's:
``rounds`` is the number of target forwards that emit tokens. HF's first forward runs the whole
prompt (plus the first drafts) and emits the first token, while adaspec prefills all but the
last prompt token in a separate forward that is not a round; so HF greedy has rounds == new
tokens (MAT 1.0), like adaspec's AR.

Each run starts from the spec's settings: the assistant's draft length restarts at ``k`` on every
request (HF's ``heuristic`` schedule would otherwise carry it over from the previous call), and
the confidence threshold stays fixed unless scikit-learn is installed (HF then tunes it within
a call).

Peers run with PyTorch's own linear kernels and transformers' own attention
(``kernels.stock_kernels``), as transformers does out of the box, while adaspec's configurations use the kernels that ``load_model``
installs on CPU: ``hf-greedy`` against adaspec's AR shows what the kernels alone are worth. On a
quantized target (``adaspec.quant``: a GGUF file's own blocks) the peers run its dense twin, the
file de-quantized as transformers loads it (``dense_twin``), and so does an ``hf-assisted``
assistant: what a Hugging Face user has.
"""

from __future__ import annotations

import logging
import time
import weakref
from contextlib import ExitStack
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from ..drafters import check_same_vocabulary, parse_params
from ..errors import AdaspecError, ConfigError, PromptError
from ..exactness import NEAR_TIE_NATS, NEAR_TIE_NATS_LLAMACPP
from ..kernels import stock_kernels
from ..models import LoadedModel, load_model
from ..quant import weights_mode
from .peer_run import EmissionClock, Peer, PeerRun

PEER_NAMES = ("hf-greedy", "hf-pld[:k=10,max_ngram=2]",
              "hf-assisted:model=REF[,k=20,schedule=constant,confidence=0.4]")
SCHEDULES = ("constant", "heuristic", "heuristic_transient")
# transformers 5.x defaults (GenerationConfig._get_default_generation_params and
# PromptLookupCandidateGenerator); set explicitly so a model's generation_config cannot change them
_PLD_K, _PLD_NGRAM = 10, 2
_ASSIST_K, _ASSIST_SCHEDULE, _ASSIST_CONFIDENCE = 20, "constant", 0.4


def is_peer_spec(text: str) -> bool:
    """Is ``text`` a peer spec (``hf-...``) rather than an adaspec drafter spec?"""
    return isinstance(text, str) and text.strip().lower().startswith("hf-")


@dataclass(frozen=True)
class PeerSpec:
    """A parsed peer spec with every setting resolved (HF's defaults where unset)."""

    kind: str  # "greedy", "pld" or "assisted"
    spec: str  # the spec as written (stripped): the peer's display name
    k: int | None = None  # prompt_lookup_num_tokens / num_assistant_tokens
    max_ngram: int | None = None  # max_matching_ngram_size (pld)
    model: str | None = None  # assistant model reference (assisted)
    schedule: str | None = None  # num_assistant_tokens_schedule (assisted)
    confidence: float | None = None  # assistant_confidence_threshold, 0 = off (assisted)

    def settings(self) -> dict[str, Any]:
        """The HF generation options this peer sets (for reports)."""
        if self.kind == "pld":
            return {"prompt_lookup_num_tokens": self.k, "max_matching_ngram_size": self.max_ngram}
        if self.kind == "assisted":
            return {"assistant_model": self.model, "num_assistant_tokens": self.k,
                    "num_assistant_tokens_schedule": self.schedule,
                    "assistant_confidence_threshold": self.confidence}
        return {}


def _int(params: dict[str, str], key: str, default: int, spec: str, low: int = 1) -> int:
    raw = params.pop(key, None)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"peer {spec!r}: {key}={raw!r} is not an integer") from None
    if value < low:
        raise ConfigError(f"peer {spec!r}: {key} must be >= {low}, got {value}")
    return value


def _leftovers(params: dict[str, str], spec: str, allowed: str) -> None:
    if params:
        raise ConfigError(f"unknown parameter(s) {sorted(params)} for peer {spec!r}: allowed: {allowed}")


def parse_peer(spec: str) -> PeerSpec:
    """Parse ``hf-greedy``, ``hf-pld[:k=..,max_ngram=..]`` or ``hf-assisted:model=REF[,...]``."""
    if not is_peer_spec(spec):
        raise ConfigError(f"{spec!r} is not a peer spec: use one of {', '.join(PEER_NAMES)}")
    text = spec.strip()
    name, _, rest = text.partition(":")
    name = name.strip().lower()
    try:
        params = parse_params(rest, f"peer {text!r}")
    except AdaspecError as exc:
        raise ConfigError(str(exc)) from None
    if name == "hf-greedy":
        _leftovers(params, text, "(none)")
        return PeerSpec("greedy", text)
    if name == "hf-pld":
        if "max_matching_ngram_size" in params:
            if "max_ngram" in params:
                raise ConfigError(f"peer {text!r}: give max_ngram or max_matching_ngram_size, not both")
            params["max_ngram"] = params.pop("max_matching_ngram_size")
        k = _int(params, "k", _PLD_K, text)
        ngram = _int(params, "max_ngram", _PLD_NGRAM, text)
        _leftovers(params, text, "k, max_ngram (alias max_matching_ngram_size)")
        return PeerSpec("pld", text, k=k, max_ngram=ngram)
    if name == "hf-assisted":
        model = params.pop("model", "")
        if not model:
            raise ConfigError(f"peer {text!r} needs an assistant model: write hf-assisted:model=REF "
                              "(REF: 'smollm2', a .gguf file, a directory or a HF id with the target's vocabulary)")
        k = _int(params, "k", _ASSIST_K, text)
        schedule = params.pop("schedule", _ASSIST_SCHEDULE).lower()
        if schedule not in SCHEDULES:
            raise ConfigError(f"peer {text!r}: schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
        raw = params.pop("confidence", None)
        confidence = _ASSIST_CONFIDENCE
        if raw is not None:
            try:
                confidence = 0.0 if raw.lower() in ("none", "off") else float(raw)
            except ValueError:
                raise ConfigError(f"peer {text!r}: confidence={raw!r} is not a number") from None
            if not 0.0 <= confidence < 1.0:
                raise ConfigError(f"peer {text!r}: confidence must be in [0, 1) (0 = off), got {confidence}")
        _leftovers(params, text, "model, k, schedule, confidence")
        return PeerSpec("assisted", text, k=k, model=model, schedule=schedule, confidence=confidence)
    raise ConfigError(f"unknown peer {text!r}: use one of {', '.join(PEER_NAMES)}")


class _ClockStreamer:
    """A transformers streamer that times emissions (``generate(streamer=...)``): the first
    ``put`` is the prompt, every later one a step's new tokens."""

    def __init__(self, clock: EmissionClock):
        self.clock = clock
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.clock.tick(int(value.numel()))

    def end(self) -> None:
        pass


class _ForwardCounter:
    """Counts a module's forward calls and the input width of each (a pre-hook, removed on exit)."""

    def __init__(self, module: Any):
        self.module = module
        self.widths: list[int] = []
        self._handle: Any = None

    def _hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        self.widths.append(int(ids.shape[1]) if ids is not None else 0)

    def __enter__(self) -> _ForwardCounter:
        self._handle = self.module.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()


class _SwappedGenerationConfigs:
    """Give models another ``generation_config`` for the duration of a call."""

    def __init__(self, pairs: list[tuple[Any, Any]]):
        self.pairs = pairs
        self.saved: list[Any] = []

    def __enter__(self) -> None:
        for model, config in self.pairs:
            self.saved.append(model.generation_config)
            model.generation_config = config

    def __exit__(self, *exc: Any) -> None:
        for (model, _), config in zip(self.pairs, self.saved):
            model.generation_config = config


class _QuietInternalDeprecation(logging.Filter):
    """Drop one transformers deprecation notice that its own assisted generation triggers
    (the candidate generator calls ``generate`` with a config and keyword options), nothing else."""

    _LOGGER = "transformers.generation.utils"

    def filter(self, record: logging.LogRecord) -> bool:
        return "Passing `generation_config` together with" not in record.getMessage()

    def __enter__(self) -> None:
        logging.getLogger(self._LOGGER).addFilter(self)

    def __exit__(self, *exc: Any) -> None:
        logging.getLogger(self._LOGGER).removeFilter(self)


class HFPeer:
    """A Hugging Face decoding strategy on an adaspec target, built once per bench.

    The assistant model (``hf-assisted``) is loaded here, once, unless one is passed in
    ``assistant`` (to share it between peers). ``run`` is one greedy request.
    """

    def __init__(self, target: LoadedModel, spec: str | PeerSpec, device: Any = None, dtype: Any = None,
                 *, assistant: LoadedModel | None = None, dense: LoadedModel | None = None):
        #: the model the peer generates with: the target, or its dense twin (``dense_twin``)
        self.target = dense if dense is not None else dense_twin(target)
        self.spec = spec if isinstance(spec, PeerSpec) else parse_peer(spec)
        self.assistant: LoadedModel | None = None
        if self.spec.kind == "assisted":
            if assistant is None:
                assistant = load_model(self.spec.model or "", device=device or target.device,
                                       dtype=dtype or target.dtype, weights="dense")
            if assistant.model is target.model:
                raise ConfigError(f"peer {self.spec.spec!r}: the assistant must be a separate model instance, "
                                  "not the target itself (forward counts would mix): load it with load_model")
            check_same_vocabulary(target, assistant)
            self.assistant = assistant
        self._timer_sync = torch.cuda.synchronize if target.device.type == "cuda" else None
        # the dense twin of an 8-bit-activation target computes the same weights without that rounding
        eight_bit = self.target is not target and weights_mode(target.model).startswith("gguf-q8")
        self.tie_nats = NEAR_TIE_NATS_LLAMACPP if eight_bit else NEAR_TIE_NATS

    @property
    def name(self) -> str:
        return self.spec.spec

    def settings(self) -> dict[str, Any]:
        return self.spec.settings()

    def _pad_id(self, eos_ids: set[int]) -> int:
        gc = getattr(self.target.model, "generation_config", None)
        pad = getattr(gc, "pad_token_id", None)
        tok = self.target.tokenizer
        if pad is None and tok is not None:
            pad = tok.pad_token_id
        if pad is None:
            pad = min(eos_ids) if eos_ids else 0
        return int(pad)

    def _generation_config(self, max_new_tokens: int, eos_ids: set[int]) -> Any:
        """The greedy config of a run; everything else takes transformers' global defaults (the
        model's own generation_config is held out during the call, see ``run``)."""
        from transformers import GenerationConfig

        opts: dict[str, Any] = dict(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                                    eos_token_id=sorted(eos_ids) or None, pad_token_id=self._pad_id(eos_ids))
        if self.spec.kind == "pld":
            opts.update(prompt_lookup_num_tokens=self.spec.k, max_matching_ngram_size=self.spec.max_ngram)
        return GenerationConfig(**opts)

    def _assistant_config(self) -> Any:
        """What the assistant's generation_config holds during a run: HF reads the draft length,
        its schedule and the confidence threshold from it (not from the generate call)."""
        from transformers import GenerationConfig

        return GenerationConfig(num_assistant_tokens=self.spec.k,
                                num_assistant_tokens_schedule=self.spec.schedule,
                                assistant_confidence_threshold=self.spec.confidence)

    def _check(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        if not prompt_ids:
            raise PromptError("the prompt is empty: pass some token ids")
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        vocab = self.target.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise PromptError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        window = self.target.context_window
        if window is not None and len(prompt_ids) + max_new_tokens > window:
            raise PromptError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"context window ({window}): lower max_new_tokens or shorten the prompt")

    def _now(self) -> float:
        if self._timer_sync is not None:
            self._timer_sync()
        return time.perf_counter()

    @torch.inference_mode()
    def run(self, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> PeerRun:
        """Greedy ``generate`` of ``prompt_ids``: stops after ``max_new_tokens`` or at the first
        token in ``eos_ids`` (kept in the output), like adaspec's engine."""
        from transformers import GenerationConfig

        prompt_ids = list(prompt_ids)
        self._check(prompt_ids, max_new_tokens)
        model = self.target.model
        device = self.target.device
        ids = torch.tensor([prompt_ids], device=device)
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                  "generation_config": self._generation_config(max_new_tokens, eos_ids)}
        # generate() fills unset options from the model's own generation_config: hold blank ones
        # during the call so only this peer's settings apply (restored afterwards)
        configs = [(model, GenerationConfig())]
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant.model
            configs.append((self.assistant.model, self._assistant_config()))  # k restarts every run
        with ExitStack() as stack:
            # a transformers user's kernels: PyTorch's own linear layers (adaspec.kernels)
            stack.enter_context(stock_kernels(model))
            if self.assistant is not None:
                stack.enter_context(stock_kernels(self.assistant.model))
            stack.enter_context(_SwappedGenerationConfigs(configs))
            stack.enter_context(_QuietInternalDeprecation())
            target_calls = stack.enter_context(_ForwardCounter(model))
            assistant_calls = (stack.enter_context(_ForwardCounter(self.assistant.model))
                               if self.assistant is not None else None)
            t0 = self._now()
            clock = EmissionClock(self._now)
            out = model.generate(**kwargs, streamer=_ClockStreamer(clock))
            seconds = self._now() - t0
        new = out[0, len(prompt_ids):].tolist()
        widths = target_calls.widths
        assistant_forwards = len(assistant_calls.widths) if assistant_calls is not None else None
        if len(new) > max_new_tokens:
            raise AdaspecError(f"{self.name} returned {len(new)} tokens for max_new_tokens={max_new_tokens}: "
                               "a transformers change? report it")
        # first forward: the prompt plus the first drafts; later ones: the last token plus drafts
        drafted = (widths[0] - len(prompt_ids) + sum(w - 1 for w in widths[1:])) if widths else 0
        first_s, decode_tokens, decode_s = clock.split()
        return PeerRun(token_ids=new, seconds=seconds, target_forwards=len(widths), rounds=len(widths),
                       prefill_tokens=widths[0] if widths else 0, drafted=drafted,
                       assistant_forwards=assistant_forwards, verify_widths=dict(Counter(widths[1:])),
                       first_s=first_s, decode_s=decode_s, decode_tokens=decode_tokens)

    def new_pass(self) -> None:
        """Nothing to forget: Hugging Face's assisted generation keeps nothing between calls."""

    def close(self) -> None:
        """Nothing to free: the peer runs on the bench's own models."""


def dense_twin(target: LoadedModel) -> LoadedModel:
    """The model a Hugging Face peer runs for ``target``: the target itself, or for a quantized
    target (``quant.quantized_of``) the same file loaded with dense weights (``weights="dense"``),
    loaded once per target."""
    from ..quant import quantized_of

    if quantized_of(target.model) is None:
        return target
    twin = _twins.get(id(target))
    if twin is None or twin[0]() is not target:
        dense = load_model(target.name, device=target.device, weights="dense")
        _twins[id(target)] = (weakref.ref(target), dense)
        return dense
    return twin[1]


#: id(quantized target) -> (weak reference to it, its dense twin)
_twins: dict[int, tuple[Any, LoadedModel]] = {}


def build_peers(target: LoadedModel, specs: list[str], device: Any = None, dtype: Any = None) -> list[HFPeer]:
    """Build the peers of a bench; each assistant model is loaded once, even if several peers use it."""
    assistants: dict[str, LoadedModel] = {}
    dense = dense_twin(target)
    peers = []
    for text in specs:
        spec = parse_peer(text)
        assistant = None
        if spec.kind == "assisted" and spec.model is not None:
            if spec.model not in assistants:
                assistants[spec.model] = load_model(spec.model, device=device or target.device,
                                                    dtype=dtype or target.dtype, weights="dense")
            assistant = assistants[spec.model]
        peers.append(HFPeer(target, spec, device, dtype, assistant=assistant, dense=dense))
    return peers


def all_peer_names() -> tuple[str, ...]:
    """Every peer spec ``adaspec bench`` accepts, with its options (for help texts and errors)."""
    from .llama_server_peer import LLAMA_SERVER_PEER_NAMES
    from .llamacpp_peer import LLAMACPP_PEER_NAMES

    return PEER_NAMES + LLAMACPP_PEER_NAMES + LLAMA_SERVER_PEER_NAMES


def check_peer(text: str) -> None:
    """A peer spec parses (HF's, llama.cpp's or llama-server's) and a llama-server peer's binary
    is found; raises an ``AdaspecError`` naming the fix, before anything loads."""
    from .llama_server import find_llama_server
    from .llama_server_peer import is_llama_server_peer, parse_llama_server_peer
    from .llamacpp_peer import is_llamacpp_peer, parse_llamacpp_peer

    if is_llamacpp_peer(text):
        parse_llamacpp_peer(text)
    elif is_llama_server_peer(text):
        find_llama_server(parse_llama_server_peer(text).binary)
    elif is_peer_spec(text):
        parse_peer(text)
    else:
        raise ConfigError(f"unknown peer {text!r}: use one of {', '.join(all_peer_names())}")


def make_peer(target: Any, text: str, device: Any = None, dtype: Any = None) -> Peer:
    """The peer a spec names, on ``target``: an ``HFPeer``, a llama.cpp peer or a llama-server peer."""
    from .llama_server_peer import LlamaServerPeer, is_llama_server_peer
    from .llamacpp_peer import LlamaCppPeer, is_llamacpp_peer

    if is_llamacpp_peer(text):
        return LlamaCppPeer(target, text)
    if is_llama_server_peer(text):
        return LlamaServerPeer(target, text)
    if target.backend != "transformers":
        raise ConfigError(f"peer {text!r} runs Hugging Face generate on a transformers model, and this target "
                          f"runs on {target.backend}: use the peers llama.cpp, llama.cpp-pld and llama-server there")
    return HFPeer(target, text, device=device, dtype=dtype)


def run_peer(peer: Peer, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> PeerRun:
    """One request of ``peer`` (what ``adaspec bench`` calls per prompt and repeat)."""
    return peer.run(prompt_ids, max_new_tokens, eos_ids)
