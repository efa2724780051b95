"""A tiny independent draft LM sharing the target's tokenizer (MetaSD's black-box drafter, F.1-F.2).

A 1-2 layer Llama with the target's hidden size, heads and rotary settings; its (tied) token
embedding is copied from the target's input embedding and its decoder layers, when the shapes
allow, from the target's first layers, then it is distilled from the target's own outputs
(``adaspec.drafter_training``). It drafts through a reduced output vocabulary (the V' most
frequent tokens of its training data, FR-Spec style): logits are the final hidden state times
the embedding rows of that subset, and q is zero outside it, which keeps sampling exact.

On disk: a Hugging Face directory (``save_pretrained``) plus ``adaspec-drafter.json`` with the
format tag, the target's fingerprint, the vocabulary subset and the training summary.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..errors import AdaspecError, ModelLoadError
from ..models import LoadedModel, cache_arg, check_fingerprint, target_fingerprint
from .feature_head import _check_vocab, scatter_full, short_name
from .model import ModelDrafter

FORMAT = "adaspec.tiny-lm/1"
META_FILE = "adaspec-drafter.json"


def tiny_lm_config(target: LoadedModel, layers: int = 2) -> Any:
    """A LlamaConfig with the target's width, heads, rotary settings and vocabulary, ``layers`` deep."""
    from transformers import LlamaConfig

    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise AdaspecError(f"tiny-lm layers must be an integer >= 1, got {layers!r}: use 1 or 2")
    t = target.model.config
    hidden = int(t.hidden_size)
    heads = int(getattr(t, "num_attention_heads", 0) or max(1, hidden // 64))
    kwargs: dict[str, Any] = dict(
        vocab_size=target.vocab_size, hidden_size=hidden,
        intermediate_size=int(getattr(t, "intermediate_size", 0) or 4 * hidden),
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(getattr(t, "num_key_value_heads", 0) or heads),
        head_dim=int(getattr(t, "head_dim", 0) or hidden // heads),
        max_position_embeddings=int(getattr(t, "max_position_embeddings", 2048) or 2048),
        rms_norm_eps=float(getattr(t, "rms_norm_eps", 1e-5) or 1e-5),
        hidden_act=getattr(t, "hidden_act", "silu"), tie_word_embeddings=True,
        bos_token_id=getattr(t, "bos_token_id", None), eos_token_id=getattr(t, "eos_token_id", None),
        pad_token_id=getattr(t, "pad_token_id", None),
    )
    rope = getattr(t, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("rope_type", "default") == "default":
        kwargs["rope_parameters"] = dict(rope)
    return LlamaConfig(**kwargs)


def init_tiny_lm(target: LoadedModel, layers: int = 2, seed: int = 0, from_target: bool = True) -> Any:
    """A fresh tiny LM: embedding from the target's input embedding; decoder layers and final norm
    copied from the target's first layers when they have the same shapes (Llama-style targets),
    otherwise randomly initialised (seeded)."""
    from transformers import LlamaForCausalLM

    cfg = tiny_lm_config(target, layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    src = target.model
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(src.get_input_embeddings().weight.float())
        base = getattr(src, "model", None)
        if from_target and base is not None and len(getattr(base, "layers", [])) >= layers:
            try:
                for i in range(layers):
                    model.model.layers[i].load_state_dict(base.layers[i].state_dict(), strict=True)
                model.model.norm.load_state_dict(base.norm.state_dict(), strict=True)
            except (RuntimeError, AttributeError):  # another architecture: keep the random layers
                model = init_tiny_lm(target, layers, seed, from_target=False)
    model.tie_weights()
    return model.to(device=target.device, dtype=target.dtype).eval()


def save_tiny_lm(model: Any, target: LoadedModel, vocab: torch.Tensor, out: str | Path,
                 training: dict | None = None) -> Path:
    """Write the HF directory plus ``adaspec-drafter.json`` (replacing ``out`` atomically)."""
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        model.save_pretrained(tmp)
        if target.tokenizer is not None:
            target.tokenizer.save_pretrained(tmp)
        meta = {"format": FORMAT, "target": target_fingerprint(target),
                "vocab": [int(v) for v in torch.as_tensor(vocab).tolist()], "training": training or {}}
        (tmp / META_FILE).write_text(json.dumps(meta), encoding="utf-8")
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_tiny_lm_dir(path: str | Path) -> Path:
    """A tiny-LM directory (``~`` expanded) with its ``adaspec-drafter.json``; clear errors for
    a wrong path, nothing loaded."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"tiny-lm directory not found: {path}: train one with "
                             "`adaspec train-drafter --kind tiny-lm --data DIR --out DIR`")
    if not (path / META_FILE).is_file():
        raise ModelLoadError(f"{path} has no {META_FILE}: it is not a tiny-lm drafter written by "
                             "adaspec train-drafter")
    return path


def read_tiny_lm_meta(path: str | Path) -> dict:
    """The ``adaspec-drafter.json`` of a tiny-LM directory (clear errors for wrong paths/files)."""
    path = check_tiny_lm_dir(path)
    meta_file = path / META_FILE
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{meta_file} is unreadable ({exc}): retrain the drafter") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ModelLoadError(f"{meta_file} has format {meta.get('format') if isinstance(meta, dict) else None!r}, "
                             f"expected {FORMAT!r}: retrain the drafter")
    return meta


class TinyLMDrafter(ModelDrafter):
    """``ModelDrafter`` over a tiny LM whose logits cover only its draft vocabulary (-inf elsewhere)."""

    caps = replace(ModelDrafter.caps, family="tiny-lm")

    def __init__(self, drafter: LoadedModel, target_vocab_size: int, vocab: torch.Tensor,
                 name: str | None = None, training: dict | None = None):
        super().__init__(drafter, target_vocab_size, name=name or f"tiny-lm:{drafter.name}")
        self.vocab = _check_vocab(vocab, target_vocab_size).to(self._device)
        self.training = dict(training or {})
        self._base = self.model.model
        self._base_kw = cache_arg(self._base)
        w = self.model.get_output_embeddings().weight.detach()
        self._w = w[self.vocab].contiguous()

    @classmethod
    def load(cls, path: str | Path, target: LoadedModel, name: str | None = None) -> TinyLMDrafter:
        """Load a tiny-LM directory for ``target`` (error if it was trained for another model)."""
        from transformers import AutoModelForCausalLM

        path = Path(path).expanduser()
        meta = read_tiny_lm_meta(path)
        check_fingerprint(meta.get("target", {}), target, f"tiny-lm drafter {path}")
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"could not load the tiny LM in {path}: {exc}: retrain it") from exc
        model = model.to(target.device).eval()
        loaded = LoadedModel(model, target.tokenizer, str(path))
        return cls(loaded, target.vocab_size, torch.tensor(meta["vocab"], dtype=torch.long),
                   name=name or f"tiny-lm:{short_name(path)}", training=meta.get("training"))

    def describe(self) -> str:
        return f"{self.name} (tiny LM, draft vocabulary {self.vocab.numel()})"

    @torch.inference_mode()
    def _forward(self, tokens: Sequence[int], keep: int = 1, hidden: bool = False):
        ids = torch.tensor([list(tokens)], device=self._device)
        out = self._base(input_ids=ids, **{self._base_kw: self._cache}, use_cache=True)
        self._fed.extend(tokens)
        h = out.last_hidden_state[0, -keep:]
        sub = (h @ self._w.T).float()
        logits = scatter_full(sub, self.vocab, self._vocab, float("-inf"))
        return logits, (h if hidden else None)

    @torch.inference_mode()
    def _forward_level(self, tokens: Sequence[int], positions: Sequence[int],
                       mask: torch.Tensor) -> torch.Tensor:
        """Tree-level forward (``ModelDrafter.draft_tree``) through the draft vocabulary."""
        dev = self._device
        out = self._base(input_ids=torch.tensor([list(tokens)], device=dev), attention_mask=mask,
                         position_ids=torch.tensor([list(positions)], device=dev),
                         **{self._base_kw: self._cache}, use_cache=True)
        sub = (out.last_hidden_state[0] @ self._w.T).float()
        return scatter_full(sub, self.vocab, self._vocab, float("-inf"))
