"""The llama.cpp backend: GGUF targets (and GGUF draft models) on llama.cpp's CPU kernels.

Runs through llama-cpp-python's C API (``pip install 'adaspec[llamacpp]'``, built from source).
One llama.cpp context per model holds up to ``n_seq_max`` sequences in a unified KV cache; a
KV state is a sequence id. A forward puts the new tokens in one ``llama_batch`` (chunked by
``n_batch`` for long prompts) and asks for logits at the last ``keep`` positions only;
``truncate`` removes the rejected tail with ``llama_memory_seq_rm`` (the accepted prefix is
kept, never recomputed). The tokenizer is the Hugging Face one read from the same GGUF file
(chat templates and token ids as on the transformers backend).

Exactness: quantized kernels need not give a batched forward of k tokens bit-identical logits
to k one-token forwards. Measured on SmolLM2 Q4_1 with 2 threads: with flash attention
(``flash_attn=True``) they are bit-identical for k = 2..16 while the KV cache holds at most 256
cells; past 256, one query takes flash attention's split-KV path and a verify block does not:
the margin between the two best tokens moves by up to 1.2 nats (p99 0.42) over the built-in
prompts. Without it (the CPU default: ggml's flash attention is slower on CPUs) they differ at
every length, by up to 0.75 nats of margin (p99 0.45; 1.8% of argmaxes flip, all at such
near-ties). Other quantizations take other matrix kernels: on
Qwen2.5-Coder's Q4_K_M files a block differs from one-token forwards at every length, so the
short-sequence bound is probed per model (``short_blocks_invariant``; still bit-identical on
SmolLM2's Q4_1 with llama.cpp's AMX kernels, whose blocks take the tile path and one token the
VNNI path). Builds whose AMX kernels crash are detected first (``amx_kernels_run``).
The prompt is fed in one batch as llama.cpp feeds it (``prefill``). Greedy speculative output
therefore equals llama.cpp's own greedy decoding except where its margin between the two best
tokens is within that noise (``near_tie_nats``; docs/llamacpp.md has the measurement):
``tests/test_llamacpp_exactness.py`` checks every position of it against llama-cpp-python's own
decoding, and that a wrong token accepted lies beyond the bound.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, ModelLoadError
from ..exactness import NEAR_TIE_NATS, NEAR_TIE_NATS_LLAMACPP
from ..kernels import release_own_openmp_threads
from .base import SequentialRows, TargetBackend, shared_prefix

log = logging.getLogger(__name__)

#: the most sequences a llama.cpp context holds (its ``LLAMA_MAX_SEQ``)
MAX_SEQUENCES = 256

INSTALL_HINT = ("the llama.cpp backend needs llama-cpp-python: pip install 'adaspec[llamacpp]' "
                "(it builds llama.cpp from source: cmake and a C++ compiler must be installed)")


def import_llama_cpp() -> Any:
    """The ``llama_cpp`` module with its logging quiet (errors only), or a clear error."""
    try:
        import llama_cpp
        from llama_cpp import _logger
    except ImportError as exc:
        raise ConfigError(f"{INSTALL_HINT} ({exc})") from None
    _logger.set_verbose(False)
    return llama_cpp


def amx_build(L: Any) -> bool:
    """Whether this llama.cpp build has its AMX kernels (built natively on a CPU with AMX)."""
    return b"AMX_INT8 = 1" in L.llama_print_system_info()


#: the child process of ``amx_kernels_run``: loads the model with llama.cpp's defaults (its
#: weights repacked for the AMX matmul) and runs one forward over 4 tokens, the first batched
#: shape that takes the AMX tile kernels (one token takes their AVX512-VNNI path)
_AMX_PROBE = """
import os, sys
import llama_cpp as L
L.llama_backend_init()
model = L.llama_model_load_from_file(sys.argv[1].encode(), L.llama_model_default_params())
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 64, 8, 8, 1, 1
ctx = L.llama_init_from_model(model, cp) if model else None
if not ctx:
    os._exit(3)
batch = L.llama_batch_init(4, 0, 1)
batch.n_tokens = 4
for i in range(4):
    batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = i + 1, i, 1, True
    batch.seq_id[i][0] = 0
if L.llama_decode(ctx, batch) != 0:
    os._exit(4)
os.write(1, b"forward ran")
os._exit(0)
"""


def _build_key(L: Any) -> str:
    """The llama.cpp build's identity: its shared libraries' names, sizes and times."""
    lib = Path(L.__file__).parent / "lib"
    files = sorted(lib.glob("*.so*")) if lib.is_dir() else []
    return "|".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files) or L.__version__


def amx_kernels_run(L: Any, path: Path, *, timeout: float = 600.0) -> bool:
    """Whether llama.cpp's AMX matmul survives a batched forward of the model at ``path`` in this
    build. GCC 12.2 (Debian 12's; other versions not checked) compiles ggml's tile configuration
    wrong (its ``_tile_loadconfig`` tells the compiler the instruction reads 8 bytes, so the
    stores of the tiles' shapes are dropped as dead and ``ldtilecfg`` faults): the first forward
    over 2 or more tokens dies with SIGSEGV (llama-cpp-python 0.3.36; perhaps upstream
    ggml-org/llama.cpp#20824). A crash cannot be caught in this process, so the forward is tried
    in a child process, once per build and model file (``cache_dir()/llamacpp-amx.json``); any
    crash there, whatever its cause, leaves the AMX kernels off."""
    from ..artifacts import cache_dir

    st = path.stat()
    key = hashlib.sha256(f"{_build_key(L)}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    cache = cache_dir() / "llamacpp-amx.json"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return bool(known[key])
    try:
        done = subprocess.run([sys.executable, "-c", _AMX_PROBE, str(path)], timeout=timeout,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        rc, ran = done.returncode, b"forward ran" in (done.stdout or b"")
    except subprocess.TimeoutExpired:
        rc, ran = None, False
    if not ran and (rc is None or rc >= 0):  # no verdict (no model, or a hang): not cached
        log.warning("could not try llama.cpp's AMX kernels on %s (%s): running without them", path.name,
                    "timed out" if rc is None else f"exit code {rc}")
        return False
    works = ran  # else killed by a signal in the forward
    known[key] = works
    try:  # a verdict that cannot be kept is found again at the next load
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(cache)
    except OSError as exc:
        log.debug("could not write %s: %s", cache, exc)
    if not works:
        log.warning("llama.cpp's AMX kernels crash in this llama-cpp-python build (as GCC 12.2's builds "
                    "do): %s runs without them, on the AVX-512 kernels. For AMX, rebuild it "
                    "with CMAKE_ARGS=\"-DCMAKE_C_FLAGS=-fno-dse -DCMAKE_CXX_FLAGS=-fno-dse\" "
                    "(docs/llamacpp.md, 'CPUs with AMX')", path.name)
    return works


def uses_amx(L: Any, path: Path) -> bool:
    """Whether ``path`` loads with llama.cpp's AMX weight repacking: where the build has AMX
    kernels and they run (``amx_kernels_run``)."""
    return amx_build(L) and amx_kernels_run(L, path)


def model_params(L: Any, path: Path, params: Any = None) -> Any:
    """llama.cpp's model parameters for ``path`` (``params``, or the defaults), without the extra
    buffer types (the AMX weight repacking) where the build has AMX kernels that crash
    (``amx_kernels_run``); the weights then stay as in the file and the AVX-512 kernels run."""
    params = L.llama_model_default_params() if params is None else params
    if amx_build(L) and "use_extra_bufts" in dict(type(params)._fields_) and not amx_kernels_run(L, path):
        params.use_extra_bufts = False
    return params


class LlamaThread:
    """The one thread that runs llama.cpp's compute (model loads, context set-up, decodes) for
    every llama.cpp object of the process that uses the AMX kernels: backends, GGUF draft
    models and the bench's peers alike. ``run`` calls a function there and waits for it.

    Why a thread: ggml loads its AMX tile configuration once per thread, and PyTorch's oneDNN
    releases the tiles after its own AMX kernels (bfloat16 matmuls), so a forward on a thread
    where torch ran one since died with SIGILL (seen in the test suite). Why *one*: llama.cpp
    computes with OpenMP, whose thread teams belong to the thread that starts them, and
    libgomp (one copy per process, shared with torch) cuts every team's spin-wait to ~100
    iterations once its threads outnumber the CPUs; each forward then waits for sleeping
    workers. With a thread per llama.cpp object, a bench with a llama.cpp peer ran every
    forward 1.5x slower, adaspec's and the peer's alike (SmolLM2, 2 cores: 11.8 -> 18 ms a
    token; a model loaded on another thread than its decodes: 10.4-11.9 -> 15-27 ms)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="llama-cpp", initializer=self._mark)
        self._ident: int | None = None
        self.pid = os.getpid()

    def _mark(self) -> None:
        self._ident = threading.get_ident()

    def run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the thread (inline when already on it), its result or its exception."""
        if threading.get_ident() == self._ident:
            return fn(*args)
        if os.getpid() != self.pid:  # a forked child has no copy of the thread: submit would hang
            raise ConfigError("this llama.cpp model was loaded before the process forked: load it "
                              "again in the child process")
        return self._pool.submit(fn, *args).result()

    @staticmethod
    def free_caller() -> None:
        """Before a request or a peer run: release the calling thread's idle OpenMP workers (left
        by torch's work there), which would count against this thread's team and throttle it."""
        release_own_openmp_threads()


_LLAMA_THREAD: LlamaThread | None = None
_LLAMA_THREAD_LOCK = threading.Lock()


def llama_thread(amx: bool) -> LlamaThread | None:
    """With llama.cpp's AMX kernels (``amx``), the process's ``LlamaThread`` (made at first
    use), else None: llama.cpp then runs on the caller's thread, as torch does (one OpenMP
    team). Process-wide by necessity: OpenMP's thread accounting is."""
    global _LLAMA_THREAD
    if not amx:
        return None
    with _LLAMA_THREAD_LOCK:
        if _LLAMA_THREAD is None or _LLAMA_THREAD.pid != os.getpid():
            _LLAMA_THREAD = LlamaThread()
        return _LLAMA_THREAD


def on_thread(thread: LlamaThread | None, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on ``thread``, or here when there is none."""
    return fn(*args) if thread is None else thread.run(fn, *args)


@contextlib.contextmanager
def safe_model_params(L: Any, path: Path) -> Iterator[None]:
    """``llama_cpp.Llama(model_path=path)`` inside this block loads with ``model_params`` (it
    builds its parameters from llama_cpp's defaults and takes no argument for the extra buffer
    types)."""
    module = L.llama_cpp
    default = module.llama_model_default_params
    module.llama_model_default_params = lambda: model_params(L, path, default())
    try:
        yield
    finally:
        module.llama_model_default_params = default


@dataclass(eq=False)
class LlamaSequence:
    """A KV state on a llama.cpp context: its sequence id and the tokens it holds. Its id goes
    back to the context's pool on ``release`` or, failing that, when the object is collected."""

    seq_id: int
    length: int = 0  # tokens fed by forward/prefill (the KV holds one more while ``pending``)
    released: bool = False
    finalizer: Any = field(default=None, repr=False)
    #: (token, logits row): the prompt's last token, computed by ``prefill`` in the prompt's
    #: batch, whose row answers the next forward that starts with it
    pending: tuple[int, torch.Tensor] | None = None
    #: the ids whose KV the sequence holds (``length`` of them, and the pending one): what a
    #: later request's prompt is matched against when the state is kept (``prefix_cache``)
    tokens: list[int] = field(default_factory=list, repr=False)


class RowBuffers:
    """Host buffers for the logits rows of forwards, each reused once nothing views it.

    A fresh tensor a step (196 KB on SmolLM2) came from fresh heap pages: glibc grew and
    trimmed the heap every 2-3 steps (153 ``brk`` calls in 200 plain steps), and the copy
    then faulted its pages in. Measured after ``llama_decode`` on SmolLM2 Q4_0, steps of the
    two kinds interleaved: allocation, copy and argmax cost 107-124 us a step into fresh
    tensors, 53-60 us into these buffers (about 1.5% of a 4 ms step; llama-cpp-python's own
    loop copies into one preallocated array). A buffer is handed out again only when no
    tensor or array made from it is alive (its reference count), so callers may keep rows
    as long as they like; while every buffer is held, fresh tensors are made.
    """

    def __init__(self, n_vocab: int, rows: int = 17, count: int = 4):
        self.n_vocab, self.rows, self.count = n_vocab, rows, count
        self._buffers: list[np.ndarray] = []

    def take(self, keep: int) -> torch.Tensor:
        """A [keep, n_vocab] float32 tensor that nothing else holds (contents undefined)."""
        if keep <= self.rows:
            for buf in self._buffers:
                if sys.getrefcount(buf) <= 3:  # held by the list, the loop and the call only
                    return torch.from_numpy(buf[:keep])
            if len(self._buffers) < self.count:
                buf = np.empty((self.rows, self.n_vocab), dtype=np.float32)
                self._buffers.append(buf)
                return torch.from_numpy(buf[:keep])
        return torch.empty(keep, self.n_vocab, dtype=torch.float32)


class LlamaCppTarget(TargetBackend):
    """A GGUF model on llama.cpp (see the module docstring).

    Args:
        path: the .gguf file.
        tokenizer: a Hugging Face tokenizer for the same vocabulary (None: token ids only).
        threads: llama.cpp threads (default: torch's thread count, as on the other backend).
        n_ctx: tokens of KV cache shared by all sequences (default: the model's training window).
        n_seq_max: sequences (KV states) that can be live at once (engine, model drafters that
            share the context, the cost measurement's grid).
        n_batch: most tokens per llama_decode call (longer prompts are fed in chunks).
        gpu_layers: layers to offload (0: CPU only; -1: all, on a GPU build of llama.cpp).
        flash_attn: llama.cpp's flash attention. None (default): off on the CPU, llama.cpp's
            automatic choice with layers offloaded. On this project's CPUs ggml's flash attention
            made every forward past ~128 cached tokens slower, and verify blocks most of all
            (SmolLM2 Q4_1, 2 threads, 400 cached tokens: one token 15 ms off against 23 ms on,
            8 tokens 34 ms against 109; docs/llamacpp.md, "Flash attention off"). True: on
            (then verify blocks give one-token forwards' logits bit for bit while the sequence
            holds at most 256 tokens, on SmolLM2's file); False: off.
        prefix_cache: keep the KV of released states (whole prefixes: the state's tokens), and
            let a ``prefill`` start from the longest prefix its prompt shares with any of them
            (a chat's next turn, a shared system prompt), as llama.cpp's server does with
            ``cache_prompt``, across the requests of a batch too. Off by default: the reused KV
            was computed in other batches than a fresh prefill's, so outputs may differ from a
            fresh run's at numeric near-ties (``adaspec serve`` turns it on; benchmarks and
            exactness checks leave it off).
        prefix_cache_tokens: the kept prefixes' size: least recently used ones are dropped while
            they hold more tokens together than this (default: an eighth of ``n_ctx``), the last
            released one always kept; every kept cell widens the attention span of every
            forward on the unified cache, so the size bounds that cost. A prefix also gives up
            its sequence id when ``new_state`` needs one, and one that a newer prefix extends is
            dropped.
    """

    backend = "llama.cpp"
    has_hidden_states = False
    batch_invariant = False  # past 256 cached tokens, or at any length (``short_blocks_invariant``)
    #: the kernel-noise bound (``exactness.NEAR_TIE_NATS_LLAMACPP``: what it covers and why);
    #: ``near_tie_nats_at`` gives the float-rounding bound where short blocks are invariant
    near_tie_nats = NEAR_TIE_NATS_LLAMACPP
    #: llama.cpp rebuilds its compute graph when a batch's shape (tokens, outputs) differs from
    #: the last one's: measured on SmolLM2 Q4_0, 2 threads, ~0.35 ms, and a plain step after a
    #: verify block 0.4-0.65 ms (8-12%) dearer than one after a plain step
    reuses_graphs = True
    #: up to this many tokens in a sequence, a verify block's rows equal one-token forwards bit
    #: for bit (flash attention's split-KV path for one query starts at 512 padded KV cells)
    BATCH_INVARIANT_TOKENS = 256

    #: the probe of ``short_blocks_invariant``: a prefix this long, then this many tokens
    PROBE_PREFIX, PROBE_BLOCK = 40, 4
    supports_prefix_cache = True

    def near_tie_nats_at(self, length: int) -> float:
        if length <= self.BATCH_INVARIANT_TOKENS and self.short_blocks_invariant():
            return NEAR_TIE_NATS
        return self.near_tie_nats

    def short_blocks_invariant(self) -> bool:
        """Does a verify block on a short sequence give this file's one-token logits bit for
        bit? Yes on SmolLM2's Q4_1 and Q4_0 files; no on Qwen2.5-Coder-1.5B's Q4_K_M, where a
        block of 5 moved the margin between the two best tokens at 98% of positions under 256
        tokens (max 0.45 nats, 5 argmax flips in 432). The matrix kernels a block takes depend
        on the quantization, so this is probed once per loaded model, never assumed: a
        ``PROBE_PREFIX``-token prefix, then ``PROBE_BLOCK`` tokens one at a time and as one block."""
        if self._short_invariant is None:
            if not self._free_ids:  # every sequence in use: the wider bound, probed next time
                return False
            n = self._n_vocab
            ids = [(i * 7919 + 13) % n for i in range(self.PROBE_PREFIX + self.PROBE_BLOCK)]
            prefix, tail = ids[:self.PROBE_PREFIX], ids[self.PROBE_PREFIX:]
            rows, cache = [], self.prefix_cache
            self.prefix_cache = False  # the probe's random ids are no prefix worth keeping
            try:
                for blocks in ([[t] for t in tail], [tail]):
                    state = self.new_state()
                    try:
                        self.forward(state, prefix, keep=1)
                        rows.append(torch.cat([self.forward(state, b, keep=len(b))[0] for b in blocks]))
                    finally:
                        self.release(state)
            finally:
                self.prefix_cache = cache
            self._short_invariant = bool(torch.equal(rows[0], rows[1]))
        return self._short_invariant

    def __init__(self, path: str | Path, *, name: str | None = None, tokenizer: Any = None,
                 threads: int | None = None, n_ctx: int | None = None, n_seq_max: int = 8,
                 n_batch: int = 512, gpu_layers: int = 0, prefix_cache: bool = False,
                 flash_attn: bool | None = None, prefix_cache_tokens: int | None = None):
        L = import_llama_cpp()
        self._L = L
        self.path = Path(path)
        self.name = name or str(path)
        self.tokenizer = tokenizer
        self.threads = int(threads or torch.get_num_threads())
        if self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {threads}")
        L.llama_backend_init()
        mp = model_params(L, self.path)
        self.amx = uses_amx(L, self.path)
        #: llama.cpp's weight repacking (extra buffer types) as loaded: what the peers match
        self.repack = bool(getattr(mp, "use_extra_bufts", True))
        # loads repack weights with OpenMP: on the thread the decodes run on (``LlamaThread``)
        self._decoder = llama_thread(self.amx)
        mp.n_gpu_layers = gpu_layers
        model = on_thread(self._decoder, L.llama_model_load_from_file, str(self.path).encode(), mp)
        if not model:
            raise ModelLoadError(f"llama.cpp could not load {self.path}: is it a GGUF model file "
                                 "of an architecture this llama.cpp build knows?")
        vocab = L.llama_model_get_vocab(model)
        self._n_vocab = int(L.llama_vocab_n_tokens(vocab))
        self._train_ctx = int(L.llama_model_n_ctx_train(model))
        self._eos = {int(t) for t in (L.llama_vocab_eos(vocab), L.llama_vocab_eot(vocab)) if t >= 0}
        if not 1 <= int(n_seq_max) <= min(int(n_batch), MAX_SEQUENCES):  # llama.cpp aborts on more
            L.llama_model_free(model)
            raise ConfigError(f"n_seq_max={n_seq_max}: a llama.cpp context holds 1 to {MAX_SEQUENCES} sequences, "
                              f"and at most n_batch ({n_batch}, the outputs it reserves)")
        cp = L.llama_context_default_params()
        cp.n_ctx = int(n_ctx or self._train_ctx)
        cp.n_batch = cp.n_ubatch = int(n_batch)
        cp.n_seq_max = int(n_seq_max)
        cp.kv_unified = True  # sequences share the cells: any one may use the whole window
        cp.n_threads = cp.n_threads_batch = self.threads
        if flash_attn is not None and not isinstance(flash_attn, bool):
            raise ConfigError(f"flash_attn must be True, False or None (the default), got {flash_attn!r}")
        if flash_attn is None:  # off on the CPU, where ggml's is slower (see the docstring)
            flash_attn = None if gpu_layers else False
        cp.flash_attn_type = {None: L.LLAMA_FLASH_ATTN_TYPE_AUTO, True: L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                              False: L.LLAMA_FLASH_ATTN_TYPE_DISABLED}[flash_attn]
        ctx = on_thread(self._decoder, L.llama_init_from_model, model, cp)
        if not ctx and flash_attn:  # a model or build without flash attention: llama.cpp's choice
            log.warning("llama.cpp could not create a context with flash attention for %s: using "
                        "llama.cpp's automatic choice", self.path)
            flash_attn = None
            cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_AUTO
            ctx = on_thread(self._decoder, L.llama_init_from_model, model, cp)
        if not ctx:
            L.llama_model_free(model)
            raise ModelLoadError(f"llama.cpp could not create a context of {cp.n_ctx} tokens for "
                                 f"{self.path}: pass a smaller n_ctx")
        self._n_ctx, self._n_batch, self._n_seq_max = int(cp.n_ctx), int(n_batch), int(n_seq_max)
        #: the flash attention asked of llama.cpp: True, False, or None (llama.cpp's own choice)
        self.flash_attn = flash_attn
        self._ctx, self._model = ctx, model
        self._mem = L.llama_get_memory(ctx)
        self._batch = L.llama_batch_init(self._n_batch, 0, 1)
        self._free_ids = list(range(int(n_seq_max)))[::-1]
        self._scopes, self._torch_threads = 0, torch.get_num_threads()  # see request_scope
        self._short_invariant: bool | None = None  # see short_blocks_invariant
        self._rows = RowBuffers(self._n_vocab)  # the forwards' logits rows, reused when free
        # a batched round's logits [rows, widest, vocab] (``forward_rows``): up to 128 rows, two
        # buffers (fresh tensors of ~16 MB a round came from fresh pages, faulted in each time)
        self._round_rows = RowBuffers(self._n_vocab, rows=128, count=2)
        self.prefix_cache = bool(prefix_cache)
        if prefix_cache_tokens is not None and (isinstance(prefix_cache_tokens, bool)
                                                or not isinstance(prefix_cache_tokens, int) or prefix_cache_tokens < 0):
            raise ConfigError(f"prefix_cache_tokens must be an integer >= 0, got {prefix_cache_tokens!r}")
        #: most tokens the kept prefixes hold together (the last released one is kept regardless)
        self.prefix_cache_tokens = self._n_ctx // 8 if prefix_cache_tokens is None else int(prefix_cache_tokens)
        #: sequence id -> its tokens: released states' KV kept for later prefills, least recently used first
        self._prefixes: OrderedDict[int, list[int]] = OrderedDict()
        self._finalizer = weakref.finalize(self, _free, L, model, ctx, self._batch)

    # -- TargetBackend ------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # logits are copied to host memory

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    @property
    def context_window(self) -> int | None:
        return self._n_ctx

    def model_eos_ids(self) -> set[int]:
        return set(self._eos)

    def fingerprint(self) -> dict[str, Any]:
        """The GGUF's shapes, its size and a hash of its first MiB (header, metadata and the
        first tensors): another file, or the same model quantized otherwise, differs."""
        L = self._L
        with open(self.path, "rb") as f:
            digest = hashlib.sha256(f.read(1 << 20)).hexdigest()[:16]
        return {"name": self.name, "model_type": "gguf", "vocab_size": self.vocab_size,
                "hidden_size": int(L.llama_model_n_embd(self._model)),
                "num_hidden_layers": int(L.llama_model_n_layer(self._model)),
                "weights": f"{digest}-{self.path.stat().st_size}"}

    def new_state(self) -> LlamaSequence:
        if not self._free_ids and self._prefixes:
            self._drop_prefix(next(iter(self._prefixes)))  # the least recently used gives way
        if not self._free_ids:
            raise ConfigError(f"all {self._n_seq_max} KV sequences of this llama.cpp "
                              "context are in use: release states, or load with a larger n_seq_max")
        seq = LlamaSequence(self._free_ids.pop())
        self._L.llama_memory_seq_rm(self._mem, seq.seq_id, -1, -1)
        seq.finalizer = weakref.finalize(seq, self._reclaim, seq.seq_id)
        return seq

    def _reclaim(self, seq_id: int) -> None:
        self._L.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
        self._free_ids.append(seq_id)

    def prefill(self, state: LlamaSequence, prompt: Sequence[int]) -> int:
        """The whole prompt in one batch (chunks of ``n_batch``), as llama.cpp's own decoding
        feeds it: the last token's KV and logits then carry the same numbers as there (batches of
        other sizes may not), and its row answers the first round (``pending``). With
        ``prefix_cache``, an empty state first takes the longest prefix the prompt shares with
        a kept prefix (all but its last token at most, whose row is needed) by copying its KV
        cells (``llama_memory_seq_cp``: the cells are shared, no compute), and the batch is the
        rest; that prefix becomes the most recently used. Returns the number of prompt tokens
        reused so."""
        prompt = list(prompt)
        self._check_live(state)
        reused = 0
        if self._prefixes and not self.prefix_cache:  # turned off: nothing kept is used again
            self.drop_prefixes()
        if self._prefixes and state.length == 0 and state.pending is None and len(prompt) > 1:
            reused, best_id = self._longest_prefix(prompt)
            if best_id is not None:
                self._L.llama_memory_seq_cp(self._mem, best_id, state.seq_id, 0, reused)
                state.length, state.tokens = reused, prompt[:reused]
                self._prefixes.move_to_end(best_id)
        if len(prompt) > reused:
            logits, _ = self.forward(state, prompt[reused:], keep=1)
            state.length -= 1
            state.pending = (prompt[-1], logits[-1:])
        return reused

    def cached_prefix(self, prompt: Sequence[int]) -> int:
        if not self.prefix_cache or len(prompt) < 2:
            return 0
        return self._longest_prefix(prompt)[0]

    def _longest_prefix(self, prompt: Sequence[int]) -> tuple[int, int | None]:
        """(tokens ``prompt`` shares with the kept prefix sharing the most, all but its last token
        at most; that prefix's sequence id, None where none shares a token)."""
        reused, best_id = 0, None
        for seq_id, tokens in self._prefixes.items():
            n = shared_prefix(tokens, prompt, len(prompt) - 1)
            if n > reused:
                reused, best_id = n, seq_id
        return reused, best_id

    @property
    def prefixes(self) -> list[list[int]]:
        """The kept prefixes' tokens, least recently used first (``prefix_cache``)."""
        return [list(t) for t in self._prefixes.values()]

    def drop_prefixes(self) -> None:
        """Free every kept prefix (``prefix_cache``)."""
        for seq_id in list(self._prefixes):
            self._drop_prefix(seq_id)

    def _drop_prefix(self, seq_id: int) -> None:
        """Free a kept prefix's sequence (its cells that a live state copied stay, as that
        state's)."""
        del self._prefixes[seq_id]
        self._L.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
        self._free_ids.append(seq_id)

    def _keep_prefix(self, seq_id: int, tokens: list[int]) -> None:
        """Keep a released state's KV as the most recent prefix; drop the prefixes it extends,
        then the least recently used while they hold more than ``prefix_cache_tokens``."""
        for other, held in list(self._prefixes.items()):
            if len(held) <= len(tokens) and tokens[:len(held)] == held:
                self._drop_prefix(other)
        self._prefixes[seq_id] = tokens
        total = sum(len(t) for t in self._prefixes.values())
        while len(self._prefixes) > 1 and total > self.prefix_cache_tokens:
            oldest = next(iter(self._prefixes))
            total -= len(self._prefixes[oldest])
            self._drop_prefix(oldest)

    def _resolve_pending(self, state: LlamaSequence, first: int | None) -> torch.Tensor | None:
        """Consume a pending prompt token: its logits row when ``first`` is that token (the KV is
        there already), else drop its KV."""
        tok, row = state.pending  # type: ignore[misc]
        state.pending = None
        if first == tok:
            state.length += 1
            return row
        self._L.llama_memory_seq_rm(self._mem, state.seq_id, state.length, -1)
        del state.tokens[state.length:]
        return None

    def forward(self, state: LlamaSequence, ids: Sequence[int], keep: int = 1,
                hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if hidden:
            self.require_hidden_states("forward(hidden=True)")
        self._check_live(state)
        ids = list(ids)
        if state.pending is not None and ids:
            row = self._resolve_pending(state, ids[0])
            if row is not None:
                if len(ids) == 1:
                    return row.clone(), None
                rest, _ = self.forward(state, ids[1:], keep=min(keep, len(ids) - 1))
                return (torch.cat([row, rest]) if keep == len(ids) else rest), None
        n = len(ids)
        if not 1 <= keep <= min(n, self._n_batch):
            raise ConfigError(f"keep={keep} logits of a {n}-token forward: need 1 <= keep <= "
                              f"{min(n, self._n_batch)}")
        if state.length + n > self._n_ctx:
            raise ConfigError(f"{state.length + n} tokens exceed this llama.cpp context of "
                              f"{self._n_ctx}: shorten the prompt or lower max_new_tokens")
        L, b, seq = self._L, self._batch, state.seq_id
        for start in range(0, n, self._n_batch):
            chunk = ids[start:start + self._n_batch]
            m = len(chunk)
            first_out = n - keep - start  # index within this chunk of the first kept position
            b.n_tokens = m
            pos = state.length
            for i, t in enumerate(chunk):
                b.token[i] = t
                b.pos[i] = pos + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = i >= first_out
            rc = self._decode()
            if rc != 0:
                # the failed batch may have left cells behind: drop everything past the old length
                L.llama_memory_seq_rm(self._mem, seq, state.length, -1)
                raise RuntimeError(f"llama_decode failed with code {rc} on a {m}-token batch{self._full_hint(rc)}")
            state.length += m
            state.tokens.extend(chunk)
        # one memcpy out of llama.cpp's buffer (overwritten by the next decode) into a free
        # buffer (``RowBuffers``); numpy's ctypeslib.as_array and a copy cost more
        rows = self._rows.take(keep)
        ctypes.memmove(rows.data_ptr(), L.llama_get_logits(self._ctx), rows.nbytes)
        return rows, None

    def forward_rows(self, states: Sequence[LlamaSequence], inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """Every row's ``inputs`` appended to its sequence in one ``llama_batch`` (a token per
        input, with its row's ``seq_id`` and position, logits on; ``n_batch`` tokens per
        ``llama_decode``, a row split across calls where the round holds more): logits
        [rows, widest row, vocab], a row's columns past its width zero (no padding token is
        fed). A row whose state has its prompt's last token ``pending`` takes that row from
        ``prefill``, as ``forward`` does. On a failed decode every row is cut back to where it
        was before the call."""
        if len(states) != len(inputs) or not inputs:
            raise ConfigError(f"forward_rows needs one input list per state: {len(states)} states, "
                              f"{len(inputs)} input lists")
        inputs = [list(x) for x in inputs]
        if any(not x for x in inputs):
            raise ConfigError("forward_rows: every row needs at least one input token")
        width = max(len(x) for x in inputs)
        out = self._round_rows.take(len(inputs) * width).view(len(inputs), width, self._n_vocab)
        todo: list[tuple[int, list[int], int]] = []  # (row, tokens to feed, the column of the first)
        for r, (state, ids) in enumerate(zip(states, inputs)):
            self._check_live(state)
            first = 0
            if state.pending is not None:
                row = self._resolve_pending(state, ids[0])
                if row is not None:
                    out[r, 0] = row[0]
                    first = 1
            if state.length + len(ids) - first > self._n_ctx:
                raise ConfigError(f"{state.length + len(ids) - first} tokens exceed this llama.cpp context of "
                                  f"{self._n_ctx}: shorten the prompt or lower max_new_tokens")
            out[r, len(ids):] = 0.0
            if first < len(ids):
                todo.append((r, ids[first:], first))
        start = {r: states[r].length for r, _, _ in todo}
        L, b = self._L, self._batch
        spans: list[tuple[int, int, int]] = []  # the batch's outputs in order: (row, column, count)
        n = 0
        try:
            for r, ids, col in todo:
                state, j = states[r], 0
                while j < len(ids):
                    m = min(len(ids) - j, self._n_batch - n)
                    for i, t in enumerate(ids[j:j + m]):
                        k = n + i
                        b.token[k] = t
                        b.pos[k] = state.length + i
                        b.n_seq_id[k] = 1
                        b.seq_id[k][0] = state.seq_id
                        b.logits[k] = True
                    state.length += m
                    state.tokens.extend(ids[j:j + m])
                    spans.append((r, col + j, m))
                    n, j = n + m, j + m
                    if n == self._n_batch:
                        self._decode_rows(n, spans, out)
                        spans, n = [], 0
            if n:
                self._decode_rows(n, spans, out)
        except BaseException:
            for r, length in start.items():
                L.llama_memory_seq_rm(self._mem, states[r].seq_id, length, -1)
                states[r].length = length
                del states[r].tokens[length:]
            raise
        return out

    def _decode_rows(self, n: int, spans: Sequence[tuple[int, int, int]], out: torch.Tensor) -> None:
        """``llama_decode`` of the batch's first ``n`` tokens, their logits copied into ``out``
        at ``spans`` (row, column, count; in batch order: llama.cpp stores the outputs so)."""
        L, b = self._L, self._batch
        b.n_tokens = n
        rc = self._decode()
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc} on a {n}-token batch of "
                               f"{len({r for r, _, _ in spans})} rows{self._full_hint(rc)}")
        src = ctypes.cast(L.llama_get_logits(self._ctx), ctypes.c_void_p).value
        row_bytes = self._n_vocab * 4
        for r, col, m in spans:
            ctypes.memmove(out[r, col].data_ptr(), src, m * row_bytes)
            src += m * row_bytes

    def _decode(self) -> int:
        """``llama_decode`` of the batch; where the KV cells are full (code 1: nothing was
        computed or stored), the kept prefixes give way and it is tried once more."""
        rc = on_thread(self._decoder, self._L.llama_decode, self._ctx, self._batch)
        if rc == 1 and self._prefixes:
            self.drop_prefixes()
            rc = on_thread(self._decoder, self._L.llama_decode, self._ctx, self._batch)
        return rc

    def _full_hint(self, rc: int) -> str:
        """What a failed decode's code means, where it is the full KV cache's."""
        if rc != 1:
            return ""
        return (f": the {self._n_ctx} KV cells that every sequence shares are full; decode fewer "
                "requests at once (--max-batch) or load with a larger n_ctx")

    def new_rows(self, compact_fraction: float = 0.25) -> LlamaCppRows:
        """The rows' sequences, verified together in one ``llama_batch`` (``LlamaCppRows``)."""
        return LlamaCppRows(self)

    def batching_problem(self) -> str | None:
        return None

    def truncate(self, state: LlamaSequence, length: int) -> None:
        self._check_live(state)
        if state.pending is not None:
            self._resolve_pending(state, None)
        if length < state.length:
            self._L.llama_memory_seq_rm(self._mem, state.seq_id, int(length), -1)
            state.length = int(length)
            del state.tokens[state.length:]

    def state_length(self, state: LlamaSequence) -> int:
        return state.length

    def release(self, state: LlamaSequence) -> None:
        """Free the state's sequence; with ``prefix_cache``, keep its KV as a prefix for later
        ``prefill`` calls instead (the size and eviction rule: ``prefix_cache_tokens``)."""
        if not state.released:
            state.released = True
            if self.prefix_cache and state.tokens:
                if state.pending is not None:  # the pending token's KV is there: it is kept too
                    state.pending = None
                state.finalizer.detach()  # the id now belongs to the kept prefix
                self._keep_prefix(state.seq_id, state.tokens)
                state.tokens = []
            else:
                state.finalizer()  # _reclaim, once

    @contextlib.contextmanager
    def request_scope(self) -> Iterator[None]:
        """torch on one thread while requests run: the engine's few torch ops per round (argmax,
        softmax over the vocabulary) would otherwise start torch's thread pool, whose threads
        spin after each op on the cores llama.cpp's own threads compute on (measured on 2 cores:
        AR 57 tok/s with torch on 2 threads, 73 on 1, llama.cpp's own greedy 69). Where
        llama.cpp computes on its own thread (``LlamaThread``), the caller's OpenMP workers from
        earlier torch work are released too: with them alive, libgomp throttles llama.cpp's
        team, and a SmolLM2 step after one torch matmul on the caller took 43-71 ms, not 12."""
        if self._scopes == 0:
            self._torch_threads = torch.get_num_threads()
            torch.set_num_threads(1)
            if self._decoder is not None:
                self._decoder.free_caller()
        self._scopes += 1
        try:
            yield
        finally:
            self._scopes -= 1
            if self._scopes == 0:
                torch.set_num_threads(self._torch_threads)

    def free_states(self) -> int:
        return len(self._free_ids) + len(self._prefixes)  # a kept prefix gives way to a new state

    def _check_live(self, state: Any) -> None:
        if not isinstance(state, LlamaSequence) or state.released:
            raise ConfigError("this KV state is not a live sequence of this llama.cpp target "
                              "(released, or made by another backend)")

    def identity(self) -> str:
        st = self.path.stat()
        return (f"llama.cpp|{self.path.resolve()}|{st.st_size}|{st.st_mtime_ns}|threads={self.threads}|"
                f"n_batch={self._n_batch}|llama_cpp={self._L.__version__}" + ("|amx" if self.amx else "")
                + {True: "|fa=on", False: "|fa=off", None: "|fa=auto"}[self.flash_attn])


class LlamaCppRows(SequentialRows):
    """The rows of a batch as sequences of one llama.cpp context: a round's inputs of every row
    go into one ``llama_batch`` (``LlamaCppTarget.forward_rows``), and ``end_round`` removes each
    row's rejected tail with ``llama_memory_seq_rm`` from its kept length. The layout has no
    holes (each sequence holds its own tokens only), so ``compact`` has nothing to do. A row's
    state is its ``LlamaSequence``, lent for the backend's per-sequence operations at any time.

    Exactness: llama.cpp's kernels are not batch-invariant, and a multi-sequence batch takes
    other matrix shapes (and attends over every sequence's cells, masked) than one sequence's
    forward: a row's logits may differ from its one-at-a-time logits within the backend's
    near-tie bound (``near_tie_nats``), and greedy outputs then differ only at such near-ties."""

    batched = True

    def __init__(self, target: LlamaCppTarget):
        super().__init__(target)
        self.target: LlamaCppTarget = target
        self._before: list[int] | None = None  # each row's length before the open round's forward
        self._kept: list[int] = []

    def join(self, state: LlamaSequence, length: int) -> None:
        self.target._check_live(state)
        if self._before is not None:
            raise RuntimeError("LlamaCppRows.join during a round: join before forward or after end_round")
        super().join(state, length)

    def leave(self, rows: Sequence[int]) -> None:
        if self._before is not None:
            drop = set(rows)
            self._before = [n for r, n in enumerate(self._before) if r not in drop]
            self._kept = [n for r, n in enumerate(self._kept) if r not in drop]
        super().leave(rows)

    def forward(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        if len(inputs) != len(self._states):
            raise ConfigError(f"LlamaCppRows.forward: {len(inputs)} input lists for {len(self._states)} rows")
        logits = self.target.forward_rows(self._states, inputs)
        self._before = [s.length - len(x) for s, x in zip(self._states, inputs)]
        self._kept = [0] * len(self._states)
        return logits

    def keep(self, r: int, kept: int) -> None:
        if self._before is None:
            raise RuntimeError("LlamaCppRows.keep without a forward in this round")
        self._kept[r] = int(kept)

    def end_round(self, leaving: Sequence[int] = ()) -> None:
        """Cut every row to its length before the forward plus what it kept (a row not kept
        drops its inputs), then drop the rows ``leaving`` (their tokens exact for the prefix
        cache). After a round the rows ran on their own states, only the leaving."""
        if self._before is not None:
            for s, before, kept in zip(self._states, self._before, self._kept):
                self.target.truncate(s, before + kept)
            self._before = None
        if leaving:
            self.leave(leaving)


def _free(L: Any, model: Any, ctx: Any, batch: Any) -> None:
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)


def gguf_tokenizer(path: Path) -> Any:
    """The Hugging Face tokenizer stored in a GGUF file (from the transformers backend's
    conversion cache when that model was loaded there before: much faster)."""
    from transformers import AutoTokenizer

    from ..artifacts import gguf_conversion_dir

    cached = gguf_conversion_dir(path)
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(f"could not read the tokenizer of {path}: {exc}") from exc


#: KV sequences of a context that ``load_model`` loads (``sequences``): a batch's rows, the
#: prefix cache's kept state and, while rows decode, a batch cost grid's rows (sequence ids
#: cost llama.cpp no compute: the unified cache's cells are shared, ``n_ctx`` in all)
DEFAULT_SEQUENCES = 32


def load_llamacpp(spec: str, gguf: Path | None, *, device: Any = "cpu", dtype: Any = None,
                  threads: int | None = None, flash_attn: bool | None = None,
                  sequences: int | None = None) -> LlamaCppTarget:
    """``load_model(spec, backend="llama.cpp")``: checks that the model is a GGUF file and that
    the options make sense on llama.cpp before loading; ``sequences``: the context's KV
    sequences (``n_seq_max``; default ``DEFAULT_SEQUENCES``, at most 256)."""
    if gguf is None:
        raise ConfigError(f"the llama.cpp backend runs GGUF files, and {spec!r} is not one: pass a .gguf "
                          "file (or 'smollm2', or a model fetched with `adaspec fetch`), or use "
                          "--backend transformers")
    if dtype is not None:
        raise ConfigError("dtype is not an option on the llama.cpp backend: it computes with the GGUF "
                          "file's own (quantized) weights; leave dtype unset")
    L = import_llama_cpp()
    dev = str(device)
    if dev == "cpu":
        gpu_layers = 0
    elif dev.startswith("cuda") and L.llama_supports_gpu_offload():
        gpu_layers = -1
    else:
        raise ConfigError(f"device {dev!r} on the llama.cpp backend: this llama.cpp build runs on the "
                          "CPU only: use device cpu (or a GPU build of llama-cpp-python for cuda)")
    sequences = DEFAULT_SEQUENCES if sequences is None else sequences
    if isinstance(sequences, bool) or not isinstance(sequences, int) or not 1 <= sequences <= MAX_SEQUENCES:
        raise ConfigError(f"sequences must be an integer from 1 to {MAX_SEQUENCES} (llama.cpp's limit), "
                          f"got {sequences!r}")
    return LlamaCppTarget(gguf, name=str(spec), tokenizer=gguf_tokenizer(gguf), threads=threads,
                          gpu_layers=gpu_layers, flash_attn=flash_attn, n_seq_max=sequences)
