"""Shared test fixtures and helpers for the adaspec test-suite.

* ``make_tiny_model(...)`` (plain function, importable with ``from conftest import
  make_tiny_model``) and the ``tiny_model_factory`` fixture build tiny randomly initialised
  ``LlamaForCausalLM`` models that run in about a millisecond per forward on a CPU.
* ``chisquare_gof(...)`` is a chi-square goodness-of-fit test that merges sparse cells.
* ``--run-slow``: tests marked ``@pytest.mark.slow`` are skipped unless ``--run-slow`` is
  given or a ``-m`` expression that mentions ``slow`` (e.g. ``-m slow``) selects them.
* With ``$ADASPEC_SKIPS_FILE`` set (``.ci/run`` sets it), the node ids of the tests and modules
  that skipped are written to that file, for CI to compare with ``tests/expected_skips.txt``
  (``tests/skips.py``).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence

import pytest
import torch


# -- tiny models ------------------------------------------------------------------------------
def make_tiny_model(
    seed: int = 0,
    vocab: int = 32,
    *,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 64,
    max_positions: int = 512,
    lm_head_scale: float = 1.0,
    init_std: float = 0.02,
    dtype: torch.dtype = torch.float32,
):
    """A tiny randomly initialised ``LlamaForCausalLM`` in eval mode.

    The weights depend only on ``seed`` (the global torch RNG is left untouched).
    ``lm_head_scale`` multiplies the output-projection weights: with the default
    initialisation (std 0.02) the next-token distributions are close to uniform, and a
    factor of about 10-20 makes them peaky. ``init_std`` is the initialisation standard
    deviation of all weights (HF default 0.02, with which attention is nearly uniform and the
    next-token distribution depends only weakly on the context; 0.2-0.3 makes the model
    context-sensitive, which tests of KV-cache handling need, and then an ``lm_head_scale``
    of 1-3 is enough). No EOS token is configured, so generation only stops on the token
    budget; ``pad_token_id`` is 0.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
        initializer_range=init_std,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    if lm_head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(lm_head_scale)
    model = model.to(dtype)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


#: initialisation std of the tiny models of the greedy exactness matrices: HF's default (attention
#: nearly uniform, weakly context-sensitive) and 0.3 (sharp attention: a wrong position id or a
#: stale KV entry changes the argmax, so rollback and catch-up bugs show up)
INIT_STDS = {"std0.02": 0.02, "std0.3": 0.3}


@pytest.fixture(scope="module", params=list(INIT_STDS.values()), ids=list(INIT_STDS))
def init_std(request) -> float:
    """Runs a module's tests that use it on weakly and on strongly context-sensitive models."""
    return request.param


@pytest.fixture
def tiny_model_factory():
    """The ``make_tiny_model`` factory: ``tiny_model_factory(seed=1, vocab=12, lm_head_scale=10)``."""
    return make_tiny_model


@pytest.fixture
def tiny_model():
    """A default tiny model (seed 0, vocabulary 32)."""
    return make_tiny_model()


@pytest.fixture(scope="session", autouse=True)
def _private_cost_cache(tmp_path_factory):
    """The suite measures and caches cost grids and kernel plans in a cache of its own: tiny
    models' grids (and grids or plans timed under test conditions, one thread a worker) never
    land in the user's ``$ADASPEC_CACHE/costs`` or ``kernels``, where a later run would find
    them. The user's grids and plans are copied in (read, never written:
    measuring SmolLM2's and llama.cpp's grids again would add ~3 min of the suite's time, and
    exactness does not depend on a grid's values); everything else in the user's cache
    (converted models, fetched GGUF files, trained pools) stays visible through links, so
    real-model tests do not convert again. Tests that set ``ADASPEC_CACHE`` themselves still
    win (monkeypatch)."""
    from adaspec.artifacts import cache_dir

    user, private = cache_dir(), tmp_path_factory.mktemp("adaspec-cache")
    if user.is_dir():
        for entry in user.iterdir():
            if entry.name in ("costs", "kernels") and entry.is_dir():
                shutil.copytree(entry, private / entry.name)
            else:
                (private / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    before = os.environ.get("ADASPEC_CACHE")
    os.environ["ADASPEC_CACHE"] = str(private)
    # the quantized kernels (adaspec.quant) are compiled once per machine into a folder the suite
    # keeps across sessions (about a minute on two cores), never into the user's cache
    kernels_before = os.environ.get("ADASPEC_KERNELS_BUILD")
    os.environ.setdefault("ADASPEC_KERNELS_BUILD", str(quant_kernels_dir()))
    yield private
    for name, value in (("ADASPEC_CACHE", before), ("ADASPEC_KERNELS_BUILD", kernels_before)):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def quant_kernels_dir():
    """Where the suite's compiled quantized kernels live: one folder per machine and user, kept
    across sessions (the kernel's key names the source, compiler, torch and CPU)."""
    import tempfile
    from pathlib import Path

    return Path(tempfile.gettempdir()) / f"adaspec-test-kernels-{os.getuid() if hasattr(os, 'getuid') else 0}"


@pytest.fixture(autouse=True)
def _no_cached_pool(request, monkeypatch):
    """Tests see no trained pool in the adaspec cache unless marked ``cached_pool``: a pool
    built on this machine (``adaspec build-pool``) would change the engine's default drafters."""
    if request.node.get_closest_marker("cached_pool") is None:
        monkeypatch.setattr("adaspec.pools.find_pool", lambda target: None)


#: torch's own thread count (one per physical core), read before any test changes it
_TORCH_DEFAULT_THREADS = torch.get_num_threads()


def real_model_threads() -> int:
    """Threads for a real-model test: torch's default (every core), shared out among
    pytest-xdist workers (``-n N``), since OpenMP pools that together ask for more threads
    than cores spin against each other and run several times slower."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, _TORCH_DEFAULT_THREADS // workers)


@pytest.fixture(scope="module", autouse=True)
def _one_thread_for_fast_tests(request):
    """Fast-suite modules run torch on one thread (tiny models are per-op-overhead bound);
    modules marked slow (real models) get ``real_model_threads()``."""
    marks = getattr(request.module, "pytestmark", [])
    marks = marks if isinstance(marks, list) else [marks]
    before = torch.get_num_threads()
    torch.set_num_threads(real_model_threads() if any(m.name == "slow" for m in marks) else 1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def stock_smollm2():
    """SmolLM2 on stock modules, the reference of the slow exactness tests: PyTorch's own
    ``nn.Linear`` (``linear="stock"``: none of adaspec's packed or small-batch kernels, no kernel
    plan) and transformers' own SDPA attention (the grouped attention ``load_model`` installs,
    ``kernels.GQA_ATTENTION``, switched back); every module is a torch or transformers class.
    Session-scoped: one copy per worker, whatever module asks."""
    from adaspec.models import load_model

    loaded = load_model("smollm2", weights="dense", linear="stock")
    loaded.model.set_attn_implementation("sdpa")
    kinds = {type(m) for m in loaded.model.modules()}
    assert all(k.__module__.split(".")[0] in ("torch", "transformers") for k in kinds), kinds
    assert loaded.model.config._attn_implementation == "sdpa"
    return loaded


@pytest.fixture(scope="session")
def stock_greedy(stock_smollm2):
    """``stock_greedy(prompt_ids, n, eos_ids)``: Hugging Face ``generate``'s greedy continuation
    on ``stock_smollm2`` (``exactness.greedy_reference``), decoded once per session and argument."""
    from adaspec.exactness import greedy_reference

    done: dict[tuple, list[int]] = {}

    def get(prompt_ids: Sequence[int], n: int, eos_ids=None) -> list[int]:
        key = (tuple(prompt_ids), n, tuple(sorted(eos_ids or ())))
        if key not in done:
            done[key] = greedy_reference(stock_smollm2.model, prompt_ids, n,
                                         eos_token_id=sorted(eos_ids) if eos_ids else None)
        return list(done[key])

    return get


def flat_cost_curve(seconds: Sequence[float]):
    """A verify-cost curve from seconds per width 1, 2, ... (no cache-length term): tests price
    rounds on it instead of this machine's measured surface."""
    from adaspec.costs import VerifyCostCurve

    return VerifyCostCurve(ks=list(range(1, len(seconds) + 1)), seconds=list(seconds), context=0)


def word_tokenizer(words: Sequence[str], **special):
    """A whitespace-split word-level fast tokenizer: token i is ``words[i]``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, **special)


@pytest.fixture
def torch_single_thread():
    """Run the test with one intra-op torch thread (restored afterwards).

    Tiny models are dominated by per-op overhead: one thread is faster, and on a loaded
    machine multi-threaded OpenMP spinning can make them ~100x slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -- statistics -----------------------------------------------------------------------------
def chisquare_gof(observed: Sequence[float], expected_probs: Sequence[float],
                  min_expected: float = 5.0) -> tuple[float, float, int]:
    """Chi-square goodness of fit of counts ``observed`` against probabilities ``expected_probs``.

    Cells whose expected count is below ``min_expected`` are pooled into one cell (and if
    that pool is still too small, it is merged with the smallest remaining cell), so the
    chi-square approximation is valid. Cells with probability 0 are pooled too: an
    observation there shows up as a large statistic. Returns ``(statistic, p_value, n_cells)``.
    """
    import numpy as np
    from scipy import stats

    obs = np.asarray(observed, dtype=np.float64).ravel()
    probs = np.asarray(expected_probs, dtype=np.float64).ravel()
    if obs.shape != probs.shape:
        raise ValueError(f"shape mismatch: {obs.shape} vs {probs.shape}")
    n = obs.sum()
    probs = probs / probs.sum()
    exp = probs * n
    small = exp < min_expected
    big_obs, big_exp = list(obs[~small]), list(exp[~small])
    pool_obs, pool_exp = float(obs[small].sum()), float(exp[small].sum())
    if small.any():
        if pool_exp < min_expected and big_exp:
            j = int(np.argmin(big_exp))
            pool_obs += big_obs.pop(j)
            pool_exp += big_exp.pop(j)
        if pool_exp <= 0.0:
            if pool_obs > 0:  # observations where the distribution has no mass at all
                return float("inf"), 0.0, len(big_exp) + 1
        else:
            big_obs.append(pool_obs)
            big_exp.append(pool_exp)
    if len(big_exp) < 2:
        return 0.0, 1.0, len(big_exp)
    f_obs, f_exp = np.asarray(big_obs), np.asarray(big_exp)
    f_exp = f_exp * (f_obs.sum() / f_exp.sum())  # guard against rounding in the sums
    res = stats.chisquare(f_obs, f_exp)
    return float(res.statistic), float(res.pvalue), len(big_exp)


# -- the slow marker ------------------------------------------------------------------------
def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="run tests marked @pytest.mark.slow (real models, minutes)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    markexpr = config.getoption("markexpr", default="") or ""
    if re.search(r"\bslow\b", markexpr):
        # ``-m slow`` selects them (``-m "not slow"`` deselects them): let -m decide
        return
    skip = pytest.mark.skip(reason="slow test: run with --run-slow or -m slow")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


# -- the skipped-tests record of CI (tests/skips.py) ----------------------------------------------
def pytest_configure(config):
    from skips import SkipRecord

    config.pluginmanager.register(SkipRecord(), "adaspec-skip-record")
