"""llama.cpp's ``llama-server`` as peers in ``adaspec bench``: what a CPU user who wants speed runs.

* ``llama-server``: plain greedy decoding;
* ``llama-server:spec=TYPES[,draft=FILE,n_max=N]``: with its own speculators, ``TYPES`` joined
  with ``+`` (commas separate the spec's options): ``ngram-simple``, ``ngram-map-k``,
  ``ngram-map-k4v``, ``ngram-mod``, ``ngram-cache``, ``draft-simple`` (a draft model, ``draft=``
  a GGUF file or a fetched model's name, ``-md``), ... as ``--spec-type A,B``, or
  ``spec=default`` for ``--spec-default`` (``ngram-mod`` with n_match 24, n_min 48, n_max 64).
  With several types llama-server asks them in its own fixed order (``common_speculative_init``:
  the n-gram types ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache, then the
  draft models), whatever the order written, and drafts with the first that proposes a draft.
  ``n_max=N`` caps the draft length: ``--spec-draft-n-max`` for the draft model types,
  ``--spec-ngram-mod-n-max`` (and ``--spec-ngram-mod-n-min`` when it was above N) for
  ``ngram-mod``, ``--spec-ngram-*-size-m`` for ``ngram-simple`` / ``ngram-map-k*``
  (``ngram-cache`` drafts 8 and has no option);
* every spec also takes ``bin=FILE`` (the binary; default ``find_llama_server``),
  ``flash_attn=0|1`` and ``repack=0|1`` (llama.cpp's weight repacking, ``--no-repack`` when 0);
  both default to the target's settings, as for the ``llama.cpp`` peers, so that the server
  runs the target's kernels (where adaspec's llama.cpp backend runs without llama.cpp's AMX
  kernels, which crash in GCC 12.2 builds, the server runs without them too).

One server per peer, started once per bench (``bench.llama_server.LlamaServer``) with the
target's GGUF file and thread count, one slot whose context is the target's window (a prompt
that fits the target fits the peer; a longer one is refused, never truncated) and no prompt
cache in RAM (``--cache-ram 0``). Each request is the exact prompt token ids adaspec decodes,
sent to ``/completion`` as a token array with ``cache_prompt: false`` (every pass pays its
prefill), greedy (one sampler, ``top_k`` = 1), ``n_predict`` = max new tokens and
``return_tokens``; the output is cut at adaspec's first EOS like adaspec's engine (kept), so the
token ids compare with AR's.

Times: ``seconds`` is the client's wall time of the request (HTTP included); the prefill and
decode split come from the server's ``timings``: ``prompt_ms`` runs from the slot's start to the
first token, sampled from the prompt's logits, and ``predicted_ms`` from that token to the last
(``server_slot_stats`` in ``tools/server/server-common.h``), so decode tokens/s is
``(predicted_n - 1) / predicted_ms``, the server's own ``predicted_per_second``. ``rounds`` are
the target evaluations that emit tokens: the prompt's, one per decode step, the accepted
drafts counted off (``predicted_n - draft_n_accepted``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..drafters import parse_params
from ..errors import AdaspecError, ConfigError, PromptError
from ..exactness import NEAR_TIE_NATS_LLAMACPP
from ..models import locate_model
from .llama_server import LlamaServer, LlamaServerError, ServerOptions, find_llama_server, server_version
from .peer_run import PeerRun

LLAMA_SERVER_PEER_NAMES = ("llama-server[:spec=TYPE+TYPE|default,draft=FILE,n_max=N,bin=FILE,flash_attn=0|1,"
                           "repack=0|1]",)
#: the speculators ``--spec-type`` accepts (llama.cpp's ``common_speculative_type`` names)
SPEC_TYPES = ("draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark", "ngram-simple",
              "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
#: the types that run a draft model (``draft=FILE``, ``-md``)
DRAFT_MODEL_TYPES = ("draft-simple", "draft-eagle3", "draft-dflash", "draft-dspark")
#: --spec-ngram-mod-n-min's default (a draft shorter than n_min is not proposed)
_NGRAM_MOD_N_MIN = 48
PEER_CTX = 4096  # the slot's context when the target states no window


def is_llama_server_peer(text: str) -> bool:
    return isinstance(text, str) and text.strip().lower().partition(":")[0] == "llama-server"


@dataclass(frozen=True)
class LlamaServerPeerSpec:
    """A parsed ``llama-server`` peer spec (see the module docstring)."""

    spec: str
    types: tuple[str, ...] = ()  # empty: plain decoding
    default: bool = False  # --spec-default
    draft: Path | None = None
    n_max: int | None = None
    binary: Path | None = None
    flash_attn: bool | None = None  # None: the target's setting
    repack: bool | None = None  # None: the target's setting

    def server_args(self) -> list[str]:
        """llama-server's speculative options for this spec."""
        args: list[str] = ["--spec-default"] if self.default else []
        if self.types:
            args += ["--spec-type", ",".join(self.types)]
        if self.draft is not None:
            args += ["-md", str(self.draft)]
        n = self.n_max
        if n is not None:
            if self.default or any(t in DRAFT_MODEL_TYPES for t in self.types):
                args += ["--spec-draft-n-max", str(n)]
            if self.default or "ngram-mod" in self.types:
                args += ["--spec-ngram-mod-n-max", str(n), "--spec-ngram-mod-n-min", str(min(n, _NGRAM_MOD_N_MIN))]
            for t in ("ngram-simple", "ngram-map-k", "ngram-map-k4v"):
                if t in self.types:
                    args += [f"--spec-{t}-size-m", str(n)]
        return args


def parse_llama_server_peer(text: str) -> LlamaServerPeerSpec:
    """Parse ``llama-server[:spec=...,draft=...,n_max=...,bin=...,flash_attn=...]``."""
    name, _, rest = text.strip().partition(":")
    if name.strip().lower() != "llama-server":
        raise ConfigError(f"{text!r} is not a llama-server peer: use {LLAMA_SERVER_PEER_NAMES[0]}")
    try:
        params = parse_params(rest, f"peer {text!r}")
    except AdaspecError as exc:
        raise ConfigError(str(exc)) from None
    types: list[str] = []
    default = False
    for t in filter(None, (x.strip().lower() for x in params.pop("spec", "").split("+"))):
        if t == "default":
            default = True
        elif t in SPEC_TYPES:
            if t in types:
                raise ConfigError(f"peer {text!r}: speculator {t} is listed twice")
            types.append(t)
        else:
            raise ConfigError(f"peer {text!r}: unknown speculator {t!r}: use {', '.join(SPEC_TYPES)} or default, "
                              "several joined with '+' (e.g. spec=ngram-mod+ngram-map-k)")
    draft = None
    raw_draft = params.pop("draft", None)
    if raw_draft:
        try:
            draft = locate_model(raw_draft)
        except AdaspecError as exc:
            raise ConfigError(f"peer {text!r}: draft={raw_draft}: {exc}") from None
        if draft is None:
            raise ConfigError(f"peer {text!r}: draft={raw_draft} is not a GGUF file: llama-server's -md loads GGUF "
                              "(a .gguf path or a fetched model's name)")
        if not any(t in DRAFT_MODEL_TYPES for t in types):
            types.append("draft-simple")
    elif any(t in DRAFT_MODEL_TYPES for t in types):
        raise ConfigError(f"peer {text!r}: speculator {[t for t in types if t in DRAFT_MODEL_TYPES][0]} needs a "
                          "draft model: add draft=FILE (a .gguf file or a fetched model's name)")
    n_max = None
    raw = params.pop("n_max", None)
    if raw is not None:
        try:
            n_max = int(raw)
        except ValueError:
            raise ConfigError(f"peer {text!r}: n_max={raw!r} is not an integer") from None
        if n_max < 1:
            raise ConfigError(f"peer {text!r}: n_max must be >= 1, got {n_max}")
        if not types and not default:
            raise ConfigError(f"peer {text!r}: n_max caps the speculators' drafts: add spec=TYPES")
    binary = params.pop("bin", None)
    switches = {}
    for key in ("flash_attn", "repack"):
        raw = params.pop(key, None)
        raw = None if raw is None else raw.strip().lower()
        if raw not in (None, "0", "1", "true", "false"):
            raise ConfigError(f"peer {text!r}: {key} must be 0 or 1, got {raw!r}")
        switches[key] = None if raw is None else raw in ("1", "true")
    if params:
        raise ConfigError(f"unknown parameter(s) {sorted(params)} for peer {text!r}: allowed: spec, draft, n_max, "
                          "bin, flash_attn, repack")
    return LlamaServerPeerSpec(text.strip(), tuple(types), default, draft, n_max,
                               Path(binary).expanduser() if binary else None, **switches)


def completion_request(prompt_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    """The ``/completion`` body of one greedy request on exact prompt token ids, prompt cache off."""
    return {"prompt": [int(t) for t in prompt_ids], "n_predict": int(max_new_tokens), "temperature": 0.0,
            "top_k": 1, "samplers": ["top_k"], "cache_prompt": False, "return_tokens": True, "stream": False}


def parse_completion(answer: dict[str, Any], prompt_len: int, max_new_tokens: int, eos_ids: set[int],
                     seconds: float) -> PeerRun:
    """A ``PeerRun`` from a ``/completion`` answer (see the module docstring for the counts)."""
    timings = answer.get("timings")
    tokens = answer.get("tokens")
    if not isinstance(timings, dict) or not isinstance(tokens, list):
        raise LlamaServerError("llama-server's /completion answer has no 'timings' or 'tokens': a llama-server "
                               "without return_tokens? use the one `adaspec fetch llama-server` builds")
    if answer.get("truncated"):
        raise PromptError(f"llama-server truncated the request (prompt {prompt_len} tokens + {max_new_tokens} new): "
                          "its slot is too small")
    prompt_n, cache_n = int(timings.get("prompt_n", 0)), int(timings.get("cache_n", 0))
    if prompt_n + cache_n != prompt_len:
        raise LlamaServerError(f"llama-server evaluated {prompt_n} + {cache_n} cached prompt tokens for a prompt of "
                               f"{prompt_len}: it did not take the token ids as given")
    out: list[int] = []
    for tok in tokens:  # stopped like adaspec's engine: at the first EOS (kept) or the budget
        out.append(int(tok))
        if out[-1] in eos_ids or len(out) >= max_new_tokens:
            break
    n = int(timings.get("predicted_n", len(tokens)))
    accepted = int(timings.get("draft_n_accepted", 0))
    rounds = max(1, n - accepted) if n else 0
    return PeerRun(token_ids=out, seconds=seconds, target_forwards=rounds, rounds=rounds, prefill_tokens=prompt_n,
                   drafted=int(timings.get("draft_n", 0)),
                   first_s=float(timings.get("prompt_ms", 0.0)) / 1e3,
                   decode_s=float(timings.get("predicted_ms", 0.0)) / 1e3 if n > 1 else 0.0,
                   decode_tokens=max(0, n - 1))


class LlamaServerPeer:
    """One ``llama-server`` peer on the target's GGUF file (see the module docstring)."""

    def __init__(self, target: Any, spec: str | LlamaServerPeerSpec, threads: int | None = None):
        import torch

        from .llamacpp_peer import target_gguf

        self.spec = parse_llama_server_peer(spec) if isinstance(spec, str) else spec
        n = int(threads or getattr(target, "threads", None) or torch.get_num_threads())
        flash = self.spec.flash_attn
        if flash is None:  # the target's own, so that both run the same kernels
            flash = bool(getattr(target, "flash_attn", False))
        repack = self.spec.repack
        if repack is None:  # the target's weight layout (None: a target that is not llama.cpp's)
            repack = getattr(target, "repack", None)
        self.ctx = int(target.context_window or PEER_CTX)
        binary = find_llama_server(self.spec.binary)
        options = ServerOptions(model=target_gguf(target), threads=n, flash_attn=flash, ctx_per_slot=self.ctx,
                                parallel=1, repack=repack, extra=("--cache-ram", "0", *self.spec.server_args()),
                                binary=binary)
        self.server = LlamaServer(options).start()
        self.version = server_version(binary)
        self._warm_ids: list[int] | None = None
        self.tie_nats = NEAR_TIE_NATS_LLAMACPP  # llama.cpp's kernels (``Peer``)

    @property
    def speculates(self) -> bool:
        """Whether the server runs a speculator (which may keep state across requests)."""
        return bool(self.spec.types or self.spec.default or self.spec.draft is not None)

    def new_pass(self) -> None:
        """A speculating server is started afresh (its n-gram pools, ``ngram-mod``'s above all,
        outlive requests and would draft a repeated prompt from its earlier answer), then warmed
        with the first request's opening tokens (the chat template's header, shared by every
        prompt) and two new tokens; a plain server keeps nothing and runs on."""
        if not self.speculates:
            return
        options = self.server.options
        self.server.close()
        self.server = LlamaServer(options).start()
        if self._warm_ids:
            self.server.post("/completion", completion_request(self._warm_ids[:8], 2))

    @property
    def name(self) -> str:
        return self.spec.spec

    def settings(self) -> dict[str, Any]:
        opts = self.server.options
        return {"binary": str(self.server.binary), "version": self.version,
                "argv": opts.argv(self.server.binary, self.server.port)[1:], "slot_ctx": self.server.slot_ctx}

    def run(self, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> PeerRun:
        """One greedy request (see the module docstring); stopped like adaspec's engine."""
        prompt_ids = list(prompt_ids)
        if self._warm_ids is None:
            self._warm_ids = prompt_ids
        window = self.server.slot_ctx or self.ctx
        if len(prompt_ids) + max_new_tokens > window:
            raise PromptError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                              f"the llama-server peer's context ({window}, the target's window)")
        t0 = time.perf_counter()
        try:
            answer = self.server.post("/completion", completion_request(prompt_ids, max_new_tokens))
            seconds = time.perf_counter() - t0
            return parse_completion(answer, len(prompt_ids), max_new_tokens, eos_ids, seconds)
        except LlamaServerError as exc:  # the server's own failure is a result, not a bench error
            return PeerRun(token_ids=[], seconds=time.perf_counter() - t0, target_forwards=0, rounds=0,
                           prefill_tokens=0, drafted=0, error=str(exc))

    def close(self) -> None:
        self.server.close()
