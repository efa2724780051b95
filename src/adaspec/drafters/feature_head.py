"""Feature-level drafter head in the EAGLE style (Li et al. 2024, EAGLE-1) with a reduced draft vocabulary.

The head drafts from the *target's* final hidden states: at input position j it takes
FC(concat(emb(x_{j+1}), h_j)) through one decoder layer of the target's own architecture (built
from the target's config with one layer, using the target's rotary embedding) and predicts
h_{j+1}; token logits are the target's LM head applied to that prediction. The features h are
the target's post-norm last hidden states (the input of its LM head), so the prediction is
normalised the same way (a copy of the target's final norm, trained) before the LM head.

Output vocabulary (FR-Spec style): only the V' most frequent tokens of the training data are
scored, so the LM head costs V'/V of the target's. q is a proper distribution over that subset
(zero elsewhere) and proposals always lie in it, so exact speculative sampling is unaffected.

The head file stores only the head's own weights, the subset and the target's fingerprint; the
embedding, LM head and rotary tables are taken from the target when the file is loaded.

Feature plumbing: ``TargetFeatureForward`` runs the target once for logits *and* hidden
states; the engine keeps a ``FeatureBuffer`` per request (row j = h at input position j,
covering every token but the newest) and hands it to the drafter via ``bind_features``.
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import SamplingConfig
from ..errors import AdaspecError, ModelLoadError
from ..kernels import (PackedLinear, follow_plan, linear, linear_mode, packed_linear, small_plan_of,
                       use_small_batch_linear)
from ..models import LoadedModel, cache_arg, check_fingerprint, target_fingerprint
from ..sampling import process_logits, sample
from ..trees import DraftTree, PrefixCut, TreeBudget, TreeNode, TreeSlots, dynamic_tree
from .base import Decision, Draft, Drafter, DrafterCaps, DraftStep, Proposals, StepDecider

FORMAT = "adaspec.feature-head/1"
DEFAULT_DRAFT_VOCAB = 8192


# -- target features ---------------------------------------------------------------------------
def _base_model(model: Any) -> Any:
    base = getattr(model, "base_model", None)
    if base is None or base is model:
        base = getattr(model, "model", None)
    return base


class TargetFeatureForward:
    """One target forward that returns its logits and its final hidden states.

    Runs ``base_model`` + ``lm_head`` (the same operations as the model's own forward, so the
    logits are bitwise identical; checked once at construction). Models whose forward does
    more than ``lm_head(h)`` (logit scaling, soft-capping) fail the check and fall back to
    ``output_hidden_states=True``, which gives the same hidden states at a small extra cost.
    """

    def __init__(self, model: Any):
        self.model = model
        self.base = _base_model(model)
        self.head = model.get_output_embeddings()
        self._kw = cache_arg(model)
        self._base_kw = cache_arg(self.base)
        self.split = self.base is not None and self.head is not None and self._split_is_exact()

    @torch.inference_mode()
    def _split_is_exact(self) -> bool:
        vocab = int(self.head.weight.shape[0])
        device = self.head.weight.device
        ids = torch.tensor([[(7 * i + 3) % vocab for i in range(6)]], device=device)
        try:
            ref = self.model(input_ids=ids, use_cache=False, logits_to_keep=2).logits
            h = self.base(input_ids=ids, use_cache=False).last_hidden_state
            got = self.head(h[:, -2:])
        except (TypeError, AttributeError, RuntimeError, ValueError):
            return False
        return got.shape == ref.shape and torch.equal(got, ref)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, cache: Any = None,
                 keep: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` [B, T] -> (logits [B, keep, V] (all T if keep == 0), hidden [B, T, H])."""
        use_cache = cache is not None
        if self.split:
            h = self.base(input_ids=input_ids, **{self._base_kw: cache}, use_cache=use_cache).last_hidden_state
            return self.head(h[:, -keep:] if keep else h), h
        out = self.model(input_ids=input_ids, **{self._kw: cache}, use_cache=use_cache,
                         logits_to_keep=keep, output_hidden_states=True)
        return out.logits, out.hidden_states[-1]


class FeatureBuffer:
    """The target's final hidden states of one request, aligned with its tokens.

    Row j is the state at input position j (it predicts token j+1). The engine appends the
    prefill rows and, after each verification, the rows of the accepted inputs only, so the
    buffer always covers every token of the sequence but the newest.
    """

    def __init__(self, hidden_size: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, capacity: int = 256):
        self._data = torch.empty(max(1, capacity), hidden_size, device=device, dtype=dtype)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    @property
    def hidden_size(self) -> int:
        return int(self._data.shape[1])

    def clear(self) -> None:
        self._n = 0

    def append(self, rows: torch.Tensor) -> None:
        """Append rows [n, H] (positions len(self) .. len(self)+n-1)."""
        rows = rows.reshape(-1, self.hidden_size)
        need = self._n + rows.shape[0]
        if need > self._data.shape[0]:
            grown = self._data.new_empty(max(need, 2 * self._data.shape[0]), self.hidden_size)
            grown[: self._n] = self._data[: self._n]
            self._data = grown
        self._data[self._n: need] = rows
        self._n = need

    def rows(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows [start, end) as a view (end defaults to all rows)."""
        end = self._n if end is None else end
        if not 0 <= start <= end <= self._n:
            raise AdaspecError(f"feature rows [{start}, {end}) requested but the buffer holds {self._n}: "
                               "the engine did not supply the target's features for this context")
        return self._data[start:end]


# -- the head network ---------------------------------------------------------------------------
@dataclass
class TargetParts:
    """What the head borrows from the target (never stored in the head file)."""

    embed: nn.Module
    rotary: nn.Module
    lm_weight: torch.Tensor  # [V, H]
    lm_bias: torch.Tensor | None
    layer_cls: type
    layer_config: Any
    final_norm: nn.Module


def target_parts(target: LoadedModel) -> TargetParts:
    """The target's embedding, rotary embedding, LM head, decoder-layer class and final norm."""
    model = target.model
    base = _base_model(model)
    layers = getattr(base, "layers", None)
    rotary = getattr(base, "rotary_emb", None)
    norm = getattr(base, "norm", None)
    if base is None or not layers or rotary is None or norm is None:
        raise AdaspecError(
            f"the feature-head drafter needs a rotary decoder target with model.layers, rotary_emb "
            f"and norm (Llama/Qwen/Mistral style); {type(model).__name__} is not one: use a "
            "tiny-lm or model drafter instead")
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:1]
    head = model.get_output_embeddings()
    return TargetParts(embed=model.get_input_embeddings(), rotary=rotary, lm_weight=head.weight,
                       lm_bias=getattr(head, "bias", None), layer_cls=type(layers[0]), layer_config=cfg,
                       final_norm=norm)


def causal_mask(q_len: int, past: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Additive mask [1, 1, q, past + q]: query i sees keys 0..past+i (None for one query)."""
    if q_len == 1:
        return None
    keys = torch.arange(past + q_len, device=device)
    allowed = keys[None, :] <= (past + torch.arange(q_len, device=device))[:, None]
    mask = torch.zeros(q_len, past + q_len, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


class FeatureHeadNet(nn.Module):
    """FC(concat(emb(x_{j+1}), h_j)) -> one decoder layer -> final norm = predicted h_{j+1} (EAGLE eq. 1-2)."""

    def __init__(self, parts: TargetParts):
        super().__init__()
        hidden = int(parts.layer_config.hidden_size)
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layer = parts.layer_cls(parts.layer_config, 0)
        self._cache_kw = cache_arg(self.layer)
        self.norm = copy.deepcopy(parts.final_norm)

    def forward(self, feats: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                rotary: nn.Module, mask: torch.Tensor | None, cache: Any = None) -> torch.Tensor:
        """feats, embeds [B, T, H]; position_ids [B, T] -> predicted next features [B, T, H]."""
        x = self.fc(torch.cat([embeds, feats], dim=-1))
        pos_emb = rotary(x, position_ids)
        out = self.layer(x, attention_mask=mask, position_ids=position_ids, **{self._cache_kw: cache},
                         use_cache=cache is not None, position_embeddings=pos_emb)
        if isinstance(out, tuple):
            out = out[0]
        return self.norm(out)


def check_head_file(path: str | Path) -> Path:
    """A feature-head file (``~`` expanded) that exists; a clear error otherwise, nothing read."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"feature head file not found: {path}: train one with "
                             "`adaspec train-drafter --kind feature-head --data DIR --out FILE`")
    return path


class FeatureHead:
    """A trained (or fresh) head bound to its target: network, draft vocabulary and target parts."""

    def __init__(self, target: LoadedModel, vocab: torch.Tensor, net: FeatureHeadNet | None = None,
                 parts: TargetParts | None = None, training: dict | None = None):
        self.target = target
        self.parts = parts or target_parts(target)
        device, dtype = target.device, target.dtype
        self.net = (net or FeatureHeadNet(self.parts)).to(device=device, dtype=dtype)
        self.vocab = _check_vocab(vocab, target.vocab_size).to(device)
        self.full_vocab = self.vocab.numel() == target.vocab_size and bool(
            torch.equal(self.vocab, torch.arange(target.vocab_size, device=device)))
        w = self.parts.lm_weight
        self.lm_weight = w.detach() if self.full_vocab else w.detach()[self.vocab].contiguous()
        b = self.parts.lm_bias
        self.lm_bias = None if b is None else (b.detach() if self.full_vocab else b.detach()[self.vocab])
        self.training = dict(training or {})
        #: the target's linear kernels, for the head's drafting steps too (``kernels.py``): its
        #: timed small-row plan where the target is packed (on a Xeon with AMX the transposed
        #: product took 14.4 ms for one row of SmolLM2's output matrix, F.linear 7.3)
        target_model = getattr(target, "model", None)
        self.small_batch = linear_mode(target_model) != "stock"
        self.small_plan = small_plan_of(target_model)
        self._lm: nn.Module | None = None
        if self.small_plan is not None:  # the full vocabulary: the target's own layer and pack
            own = target_model.get_output_embeddings()
            self._lm = (own if self.full_vocab and isinstance(own, PackedLinear)
                        else packed_linear(self.lm_weight, self.lm_bias, self.small_plan))

    @property
    def hidden_size(self) -> int:
        return int(self.parts.layer_config.hidden_size)

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None, cache: Any = None) -> torch.Tensor:
        """Head step over [B, T] inputs (features h_j, next tokens x_{j+1}) -> predicted h_{j+1}."""
        with torch.no_grad():  # the target's embedding is shared, never trained
            embeds = self.parts.embed(tokens).to(feats.dtype)
        return self.net(feats, embeds, position_ids, self.parts.rotary, mask, cache)

    def subset_logits(self, pred: torch.Tensor) -> torch.Tensor:
        """LM-head logits over the draft vocabulary [..., V']."""
        if self._lm is not None:
            return self._lm(pred)
        return (linear if self.small_batch else F.linear)(pred, self.lm_weight, self.lm_bias)

    def param_count(self) -> int:
        return sum(p.numel() for p in self.net.parameters())

    # -- file format -------------------------------------------------------------------------
    def save(self, path: str | Path, training: dict | None = None) -> Path:
        """Write the head file (atomically): own weights, vocabulary subset, target fingerprint."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        blob = {
            "format": FORMAT,
            "target": target_fingerprint(self.target),
            "config": {"hidden_size": self.hidden_size, "layer_class": self.parts.layer_cls.__name__,
                       "draft_vocab_size": int(self.vocab.numel())},
            "vocab": self.vocab.cpu(),
            "state_dict": {k: v.detach().cpu().clone() for k, v in self.net.state_dict().items()},
            "training": _plain(training if training is not None else self.training),
        }
        _atomic_save(blob, path)
        return path

    @classmethod
    def load(cls, path: str | Path, target: LoadedModel) -> FeatureHead:
        """Load a head file for ``target`` (a clear error if it was trained for another model)."""
        path = check_head_file(path)
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
            raise ModelLoadError(f"{path} is not a readable feature-head file ({exc}): retrain it") from exc
        if not isinstance(blob, dict) or blob.get("format") != FORMAT:
            raise ModelLoadError(f"{path} is not a feature-head file (format "
                                 f"{blob.get('format') if isinstance(blob, dict) else None!r}, "
                                 f"expected {FORMAT!r}): pass a file written by adaspec train-drafter")
        check_fingerprint(blob["target"], target, f"feature head {path}")
        parts = target_parts(target)
        net = FeatureHeadNet(parts)
        try:
            net.load_state_dict(blob["state_dict"], strict=True)
        except RuntimeError as exc:
            raise ModelLoadError(f"feature head {path} does not fit this target's layer ({exc}): "
                                 "retrain it for this target") from exc
        head = cls(target, blob["vocab"], net=net, parts=parts, training=blob.get("training"))
        head.net.eval()
        if head.small_plan is not None:  # drafting steps are 1-8 rows, as the target's
            follow_plan(head.net, head.small_plan)
        elif head.small_batch:
            use_small_batch_linear(head.net)
        return head


def _check_vocab(vocab: Any, target_vocab: int) -> torch.Tensor:
    v = torch.as_tensor(vocab, dtype=torch.long).flatten()
    if v.numel() == 0:
        raise AdaspecError("the draft vocabulary is empty: train with at least one output token")
    if int(v.min()) < 0 or int(v.max()) >= target_vocab:
        raise ModelLoadError(f"draft vocabulary ids fall outside the target's vocabulary [0, {target_vocab}): "
                             "the drafter was trained for another target")
    if torch.unique(v).numel() != v.numel():
        raise ModelLoadError("the draft vocabulary has duplicate ids: the file is corrupt, retrain it")
    return v


def _plain(obj: Any) -> Any:
    """Only str/int/float/bool/None/list/dict survive ``torch.load(weights_only=True)``."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


def _atomic_save(obj: Any, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def short_name(path: str | Path) -> str:
    """``DIR/STEM`` of a drafter file or directory: unique across a pool's ``DOMAIN/KIND`` layout."""
    p = Path(path).expanduser().resolve()
    return f"{p.parent.name}/{p.stem}" if p.parent.name else p.stem


# -- the drafter --------------------------------------------------------------------------------
def scatter_full(sub: torch.Tensor, vocab: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    """Rows over the draft vocabulary [..., V'] -> full-width rows [..., V] (``fill`` elsewhere)."""
    out = sub.new_full((*sub.shape[:-1], width), fill)
    return out.index_copy_(out.dim() - 1, vocab, sub)


class FeatureHeadDrafter(Drafter):
    """EAGLE-style drafter: autoregressive over its single layer, fed by the target's features.

    KV cache: entries 0.._n_real-1 come from real target features and never change within a
    request (verified tokens and their features are final); entries added while drafting use
    the head's own predicted features and are cropped at the next use. New real rows are fed
    lazily from the engine's feature buffer (``catch_up``, then the rest in ``draft``/``score``).
    """

    caps = DrafterCaps(family="feature-head", runs_model=True, reads_target_features=True)
    #: EAGLE-2 tree shape: children offered per expanded node, nodes expanded per level
    tree_branch, tree_width = 4, 4

    def __init__(self, head: FeatureHead, name: str | None = None):
        self.head = head
        self.name = name or "feature-head"
        self._vocab_width = head.target.vocab_size
        self._features: FeatureBuffer | None = None
        self._cache: Any = None
        self._n_real = 0  # cache entries computed from real features
        self._n_cache = 0  # all cache entries (real + drafted)

    @classmethod
    def load(cls, path: str | Path, target: LoadedModel, name: str | None = None) -> FeatureHeadDrafter:
        return cls(FeatureHead.load(path, target), name=name or f"feature-head:{short_name(path)}")

    def describe(self) -> str:
        return f"{self.name} (EAGLE head, draft vocabulary {self.head.vocab.numel()})"

    # -- state ----------------------------------------------------------------------------
    def bind_features(self, buffer: FeatureBuffer) -> None:
        """The engine's per-request buffer of target features (read only)."""
        self._features = buffer

    def begin_request(self, prompt_ids: Sequence[int]) -> None:
        from transformers import DynamicCache

        self._cache = DynamicCache(config=self.head.parts.layer_config)
        self._n_real = self._n_cache = 0

    def _crop(self, n: int) -> None:
        if self._n_cache > n:
            self._cache.crop(n - self._n_cache)
            self._n_cache = n
        self._n_real = min(self._n_real, n)

    def _run(self, feats: torch.Tensor, tokens: Sequence[int], pos0: int) -> torch.Tensor:
        """Feed head inputs at indices pos0.. (appending to the cache) -> predictions [n, H]."""
        n = len(tokens)
        device = feats.device
        ids = torch.tensor([list(tokens)], device=device)
        pos = torch.arange(pos0, pos0 + n, device=device)[None]
        mask = causal_mask(n, self._n_cache, feats.dtype, device)
        pred = self.head.forward(feats[None], ids, pos, mask, self._cache)[0]
        self._n_cache += n
        return pred

    def _feed_real(self, context: Sequence[int], upto: int) -> torch.Tensor | None:
        """Feed real inputs (h_j, x_{j+1}) for j in [_n_real, upto); predictions of those inputs."""
        self._crop(self._n_real)
        start = self._n_real
        if upto <= start:
            return None
        if self._features is None:
            raise AdaspecError(f"drafter {self.name!r} drafts from the target's features: use it through "
                               "SpeculativeEngine (which supplies them), or call bind_features first")
        pred = self._run(self._features.rows(start, upto), context[start + 1: upto + 1], start)
        self._n_real = upto
        return pred

    def catch_up(self, context: Sequence[int]) -> None:
        self._feed_real(context, len(context) - 2)

    # -- drafting ---------------------------------------------------------------------------
    def _rows(self, sub: torch.Tensor, sampling: SamplingConfig
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Subset logits -> (full-width raw logits, full-width q, subset q); q is None under greedy."""
        logits = scatter_full(sub, self.head.vocab, self._vocab_width, float("-inf"))
        if sampling.greedy:
            return logits, None, None
        sub_q = process_logits(sub, sampling)
        return logits, scatter_full(sub_q, self.head.vocab, self._vocab_width, 0.0), sub_q

    @torch.inference_mode()
    def draft(self, context, max_tokens, sampling, generator, decide: StepDecider,
              want_hidden: bool = False) -> Draft:
        n = len(context)
        if max_tokens < 1 or n < 2:  # the first token has no feature to draft from
            return Draft()
        if self._n_real > n - 2:  # the last real input must be fed now to get its prediction
            self._crop(n - 2)
        pred = self._feed_real(context, n - 1)
        assert pred is not None
        last = pred[-1]
        pos = n - 1
        vocab = self.head.vocab
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for j in range(max_tokens):
            sub = self.head.subset_logits(last).float()
            logits, probs, sub_q = self._rows(sub, sampling)
            tok = int(vocab[int(sub.argmax()) if sub_q is None else sample(sub_q, generator)])
            verdict = decide(DraftStep(j, tok, probs=probs, logits=logits, hidden=last if want_hidden else None,
                                       support_probs=sub_q, support_logits=sub if sub_q is None else None))
            if verdict is Decision.DISCARD:
                break
            tokens.append(tok)
            rows.append(probs if probs is not None else logits)
            if verdict is Decision.STOP or j == max_tokens - 1:
                break
            last = self._run(last[None], [tok], pos)[-1]
            pos += 1
        return Draft.from_rows(tokens, rows, sampling.greedy)

    def _tree_q(self, sub: torch.Tensor, sampling: SamplingConfig | None) -> torch.Tensor:
        """The q that ranks tree nodes, over the draft vocabulary (column j is token
        ``head.vocab[j]``): processed q under sampling, softmax under greedy. Ranked there, not
        scattered to the target's width first (a top-k over 49,152 columns instead of 8,192
        and the scatter were ~0.2 ms of a ~1.8 ms level on SmolLM2)."""
        if sampling is None or sampling.greedy:
            return torch.softmax(sub, dim=-1)
        return process_logits(sub, sampling)

    @torch.inference_mode()
    def draft_tree(self, context: Sequence[int], max_depth: int, max_nodes: int,
                   sampling: SamplingConfig | None = None, level_gain: float = 0.0,
                   budget: TreeBudget | None = None, cut: PrefixCut | None = None) -> DraftTree:
        """EAGLE-2 dynamic tree (Li et al. 2024; ``trees.dynamic_tree``): children are the top
        tokens of each node's q (deterministic: verified by the one-hot rule), one head forward
        per depth over the level's frontier, each node fed its parent's predicted feature with
        a tree mask. The drafted entries are cropped at the next use, like a chain's."""
        n = len(context)
        if max_depth < 1 or n < 2:  # the first token has no feature to draft from
            return DraftTree([], [])
        if self._n_real > n - 2:
            self._crop(n - 2)
        pred = self._feed_real(context, n - 1)
        assert pred is not None
        base = self._n_cache
        feats: dict[int, torch.Tensor] = {-1: pred[-1]}  # node id -> its predicted feature
        fed = TreeSlots(base)

        def step(frontier: Sequence[int], nodes: Sequence[TreeNode]) -> torch.Tensor:
            x = torch.stack([feats[nodes[i].parent] for i in frontier])
            dev = x.device
            ids = torch.tensor([[nodes[i].token for i in frontier]], device=dev)
            pos = torch.tensor([[n - 2 + nodes[i].depth for i in frontier]], device=dev)
            mask = fed.feed(frontier, nodes, x.dtype, dev)
            out = self.head.forward(x[None], ids, pos, mask, self._cache)[0]
            self._n_cache += len(frontier)
            for r, i in enumerate(frontier):
                feats[i] = out[r]
            return self._tree_q(self.head.subset_logits(out).float(), sampling)

        root = self._tree_q(self.head.subset_logits(pred[-1]).float(), sampling)
        return dynamic_tree(root, step, max_depth, max_nodes, self.tree_branch, self.tree_width, level_gain,
                            budget, columns=self.head.vocab)

    @torch.inference_mode()
    def score(self, context, verified, sampling: SamplingConfig) -> Proposals:
        """Teacher-forced proposals from real features: at verified[i] the head sees h up to
        position len(context)+i-2 and the tokens before verified[i]."""
        m, n = len(verified), len(context)
        width = self._vocab_width
        if m == 0:
            return Proposals(probs=torch.empty(0, width))
        first = n - 2  # head input whose prediction proposes verified[0]
        if self._n_real > max(first, 0):
            self._crop(max(first, 0))
        full = list(context) + list(verified[:-1])
        pred = self._feed_real(full, n + m - 2)
        got = 0 if pred is None else min(pred.shape[0], m)
        sub = self.head.subset_logits(pred[-got:]).float() if got else None
        if got < m:  # positions without a feature (a one-token context): uniform over the subset
            pad = torch.zeros(m - got, self.head.vocab.numel(), device=self.head.vocab.device)
            sub = pad if sub is None else torch.cat([pad, sub])
        logits, probs, _ = self._rows(sub, sampling)
        return Proposals(probs=logits if probs is None else probs)
