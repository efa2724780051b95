"""The transformers backend: a Hugging Face causal LM (PyTorch) as the engine's target.

KV states are ``DynamicCache`` objects. Rows that decode together share one padded batch cache
(``PaddedRows``): its columns are per-row slots; a round appends W = max row width columns to
every row, a row's padding and rejected columns become *holes* that a per-row ``valid`` vector
masks out of later rounds (a 4D mask), and positions come from each row's true length, so holes
cost attention width but never a copy. Trailing columns that are holes in every row are cropped
after each round; the cache is compacted (valid columns gathered per row, left-padded) when holes
grow past ``compact_fraction`` of the longest row. A joining request's batch-1 cache is merged
left-padded with holes (the requests joining before a forward in one copy); a row that leaves is
dropped by ``index_select``. Per-request caches stacked into a batch every round would copy
every cache every round (the alternative measured: docs/architecture.md, "Continuous batching").
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError
from ..kernels import GQA_ATTENTION, linear_mode, release_own_openmp_threads, small_rows_mode
from ..quant import (FIXED_ORDER_ATTENTION, KV_GROWTH, FusedStack, extension, is_spare_capacity, prefill_scope,
                     quantized_of, spare_capacity_cache, weights_mode)
from ..trees import DraftTree, tree_attention_mask
from .base import RowStates, TargetBackend, shared_prefix

#: compact the batch cache when its hole columns exceed this fraction of the longest row
DEFAULT_COMPACT_FRACTION = 0.25
#: the prefix cache's size in tokens (``LoadedModel.prefix_cache_tokens``): SmolLM2-135M keeps
#: 46 KB of float32 KV a token (190 MB for 4096), Qwen2.5-1.5B 57 KB
DEFAULT_PREFIX_CACHE_TOKENS = 4096


class PrefixStore:
    """Prompts' KV kept for later prompts that start the same way (a chat's next turn, a shared
    system prompt): entries of (tokens, per-layer keys and values ``[1, heads, n, dim]``), least
    recently used first. A prompt that an entry already holds only makes that entry the most
    recent (``touch``); ``keep`` adds another prompt's KV as the most recent entry, drops the
    entries it extends, then the least recently used while the entries hold more than ``limit``
    tokens together (the newest is always kept). The rule of the llama.cpp backend's kept
    prefixes."""

    def __init__(self) -> None:
        self._entries: list[tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]] = []

    @property
    def prompts(self) -> list[list[int]]:
        """The kept prompts' tokens, least recently used first."""
        return [list(t) for t, _ in self._entries]

    def longest(self, prompt: Sequence[int], limit: int) -> tuple[int, int]:
        """(tokens shared with the entry sharing the most with ``prompt``, at most ``limit``;
        that entry's index), (0, -1) where none shares a token."""
        best, at = 0, -1
        for i, (tokens, _) in enumerate(self._entries):
            n = shared_prefix(tokens, prompt, limit)
            if n > best:
                best, at = n, i
        return best, at

    def take(self, at: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first ``n`` tokens' KV of entry ``at``, which becomes the most recent."""
        entry = self._entries.pop(at)
        self._entries.append(entry)
        return [(k[..., :n, :], v[..., :n, :]) for k, v in entry[1]]

    def touch(self, tokens: Sequence[int]) -> bool:
        """Whether an entry holds all of ``tokens``; that entry becomes the most recent."""
        tokens = list(tokens)
        for i, (held, _) in enumerate(self._entries):
            if len(held) >= len(tokens) and held[:len(tokens)] == tokens:
                self._entries.append(self._entries.pop(i))
                return True
        return False

    def keep(self, tokens: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]], limit: int) -> None:
        """Add ``tokens`` (which no entry holds: ``touch`` first) with their KV."""
        self._entries = [e for e in self._entries if not (len(e[0]) <= len(tokens) and tokens[:len(e[0])] == e[0])]
        self._entries.append((list(tokens), kv))
        total = sum(len(t) for t, _ in self._entries)
        while len(self._entries) > 1 and total > limit:
            total -= len(self._entries.pop(0)[0])

    def clear(self) -> None:
        self._entries = []


@dataclass
class LoadedModel(TargetBackend):
    """A Hugging Face causal LM with its tokenizer and the name it was loaded from: the
    ``transformers`` backend (KV states are ``DynamicCache`` objects).

    ``prefix_cache`` (off unless set; ``adaspec serve`` turns it on): ``prefill`` keeps each
    prompt's KV (``PrefixStore``, at most ``prefix_cache_tokens`` tokens, least recently used
    dropped first) and starts a later prompt from the longest prefix it shares with a kept one,
    feeding only the rest. On the quantized target (``quant.PREFILL_GEMM = "kernel"``, the
    default) a prompt's KV does not depend on how it is fed, so the reused KV is the bits a fresh
    prefill computes; on dense weights the rest is computed in other shapes than a fresh prefill
    of the whole prompt, so outputs may differ from a fresh run's at numeric near-ties
    (benchmarks and exactness checks leave it off). Models whose cache has sliding-window or
    other non-full-attention layers do not support it (``supports_prefix_cache``)."""

    model: Any
    tokenizer: Any | None
    name: str
    #: most tokens the prefix cache keeps (``PrefixStore``)
    prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS
    #: the keyword ``model.forward`` takes the KV cache under (``cache_arg``)
    cache_kw: str = field(init=False, repr=False, default="past_key_values")
    #: the quantized model's decoder stack without transformers' wrappers (``quant.FusedStack``)
    stack: FusedStack | None = field(init=False, repr=False, default=None)

    backend = "transformers"
    has_hidden_states = True
    supports_trees = True

    def __post_init__(self) -> None:
        self._prefixes = PrefixStore()
        if self.model is not None:
            self.cache_kw = cache_arg(self.model)
            self.stack = FusedStack.of(self.model)
            self.supports_prefix_cache = _full_attention(self.model.config)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        """Width of the model's logits."""
        head = self.model.get_output_embeddings()
        return int(head.out_features if hasattr(head, "out_features") else head.weight.shape[0])

    @property
    def context_window(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def model_eos_ids(self) -> set[int]:
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            return set()
        return {eos} if isinstance(eos, int) else set(eos)

    def new_state(self) -> Any:
        from transformers import DynamicCache

        if quantized_of(self.model) is not None:  # written in place (quant.spare_capacity_cache)
            return spare_capacity_cache(self.model.config)
        return DynamicCache(config=self.model.config)

    @contextmanager
    def request_scope(self) -> Iterator[None]:
        """After each request on a CPU, the thread's OpenMP workers are freed
        (``kernels.release_own_openmp_threads``): whichever thread generates next then
        computes at full speed, not at about half beside this thread's idle pool."""
        try:
            yield
        finally:
            if self.device.type == "cpu":
                release_own_openmp_threads()

    @torch.inference_mode()
    def forward(self, state: Any, ids: Sequence[int], keep: int = 1,
                hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.stack is not None and not hidden:
            logits = self.stack(state, ids, keep)
            if logits is not None:
                return logits, None
        x = torch.tensor([list(ids)], device=self.device)
        out = self.model(input_ids=x, **{self.cache_kw: state}, use_cache=True, logits_to_keep=keep,
                         output_hidden_states=hidden)
        return out.logits[0], (out.hidden_states[-1][0, -keep:] if hidden else None)

    @torch.inference_mode()
    def forward_tree(self, state: Any, last: int, tree: DraftTree,
                     hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tree verification through the public 4D-mask input of transformers: a custom
        ``[1, 1, q, kv]`` float mask is used as is by eager and SDPA attention, and
        ``position_ids`` set the rotary positions (cache length + depth)."""
        impl = getattr(self.model.config, "_attn_implementation", None)
        if impl not in TREE_ATTENTION:
            raise ConfigError(f"draft trees need an attention implementation that takes a custom 4D mask "
                              f"({', '.join(TREE_ATTENTION)}), and this model uses {impl!r}: load it with "
                              "attn_implementation='sdpa', or drop --tree")
        _check_tree_cache(state)
        cached = int(state.get_seq_length())
        device = self.device
        ids = torch.tensor([[last, *tree.tokens]], device=device)
        pos = torch.tensor([tree.position_offsets()], device=device) + cached
        mask = tree_attention_mask(tree, cached, self.dtype, device)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, **{self.cache_kw: state},
                         use_cache=True, output_hidden_states=hidden)
        return out.logits[0], (out.hidden_states[-1][0] if hidden else None)

    @torch.inference_mode()
    def keep_path(self, state: Any, start: int, rows: Sequence[int]) -> None:
        """Gather the accepted rows' keys and values into place in every layer, then crop."""
        rows = list(rows)
        if rows != list(range(len(rows))):  # rows[i] >= i: gather forward, a copy (no aliasing)
            src = torch.tensor(rows, device=self.device) + start
            for layer in state.layers:
                if layer.get_seq_length() == 0:
                    continue
                for kv in (layer.keys, layer.values):
                    kv[..., start:start + len(rows), :] = kv.index_select(-2, src)
        self.truncate(state, start + len(rows))

    def truncate(self, state: Any, length: int) -> None:
        drop = int(state.get_seq_length()) - length
        if drop > 0:
            state.crop(-drop)  # this transformers accepts only a negative count

    def state_length(self, state: Any) -> int:
        return int(state.get_seq_length())

    def prefill(self, state: Any, prompt: Sequence[int]) -> int:
        """A prompt's prefill; on a quantized target in ``quant.prefill_scope`` (with
        ``quant.PREFILL_GEMM = "gemm"`` long prompts take a dense GEMM). With ``prefix_cache`` an
        empty state first takes the longest kept prefix the prompt shares (all but its last
        token at most), and the prompt's KV is kept afterwards. Returns the tokens reused."""
        todo = list(prompt)[:-1]
        if not self.prefix_cache:  # turned off: nothing kept is used again
            self._prefixes.clear()
        reused, at = (self._prefixes.longest(todo, len(todo)) if self.prefix_cache and self.state_length(state) == 0
                      else (0, -1))
        if reused:
            for layer, (k, v) in zip(state.layers, self._prefixes.take(at, reused)):
                if is_spare_capacity(layer):  # read in place until the next forward copies it
                    layer.lend(k, v)
                else:
                    layer.update(k, v)
        if len(todo) > reused:
            with prefill_scope():
                self.forward(state, todo[reused:], keep=1)
        self.keep_prompt(state, todo)
        return reused

    def keep_prompt(self, state: Any, tokens: Sequence[int]) -> None:
        if self.prefix_cache and tokens and not self._prefixes.touch(tokens):  # held: no copy
            n = len(tokens)
            self._prefixes.keep(list(tokens), [(layer.keys[..., :n, :].clone(), layer.values[..., :n, :].clone())
                                               for layer in state.layers], self.prefix_cache_tokens)

    def cached_prefix(self, prompt: Sequence[int]) -> int:
        if not self.prefix_cache or len(prompt) < 2:
            return 0
        return self._prefixes.longest(list(prompt[:-1]), len(prompt) - 1)[0]

    @property
    def prefixes(self) -> list[list[int]]:
        """The kept prefixes' tokens, least recently used first (``prefix_cache``)."""
        return self._prefixes.prompts

    def prefill_piece(self, state: Any, ids: Sequence[int]) -> None:
        """A piece of a long prompt in ``quant.prefill_scope``, as ``prefill`` computes a prompt."""
        with prefill_scope():
            super().prefill_piece(state, ids)

    def new_rows(self, compact_fraction: float = DEFAULT_COMPACT_FRACTION) -> RowStates:
        """One padded batch cache for the rows (``PaddedRows``) where the attention takes a
        custom 4D mask, else rows one at a time."""
        if self.batching_problem() is None:
            return PaddedRows(self, compact_fraction)
        return super().new_rows()

    def batching_problem(self) -> str | None:
        impl = getattr(self.model.config, "_attn_implementation", None)
        if impl not in TREE_ATTENTION:
            return (f"batched rounds need an attention implementation that takes a custom 4D mask "
                    f"({', '.join(TREE_ATTENTION)}), and this model uses {impl!r}: load it with "
                    "attn_implementation='sdpa'")
        return None

    def identity(self) -> str:
        n_params = sum(p.numel() for p in self.model.parameters())
        return (f"transformers|{self.name}|{type(self.model).__name__}|{n_params}|{self.device}|{self.dtype}|"
                f"threads={torch.get_num_threads()}|torch={torch.__version__}|linear={linear_mode(self.model)}"
                f"|small_rows={small_rows_mode(self.model)}|attention={getattr(self.model.config, '_attn_implementation', None)}"
                + self._weights_key())

    def _weights_key(self) -> str:
        """The quantized target's weight format and kernel ISA (``quant.weights_mode``) and the
        loaded kernel build's key (the name of ``quant.extension()``, keyed by its source among the
        rest: a grid measured on an earlier kernel is measured again); nothing for a dense model,
        whose cached grids keep their keys."""
        if quantized_of(self.model) is None:
            return ""
        return f"|weights={weights_mode(self.model)}|kernel={extension().__name__.removeprefix('adaspec_quant_')}"


#: attention implementations that add a custom 4D float mask to the scores (draft trees)
TREE_ATTENTION = ("sdpa", GQA_ATTENTION, FIXED_ORDER_ATTENTION, "eager")


def cache_arg(module: Any) -> str:
    """The keyword under which ``module.forward`` takes its KV cache: ``cache`` in transformers
    5.24 and later (which deprecate ``past_key_values`` and drop it in 5.40), else
    ``past_key_values``. A wrapper whose forward takes ``**kwargs`` is read through its class's
    bases. Read once per module, not per forward (a signature costs ~20 us)."""
    for cls in type(module).__mro__:
        fwd = cls.__dict__.get("forward")
        if fwd is None:
            continue
        try:
            params = inspect.signature(fwd).parameters
        except (TypeError, ValueError):
            continue
        for name in ("cache", "past_key_values"):
            if name in params:
                return name
    return "past_key_values"


def _full_attention(config: Any) -> bool:
    """Whether every layer of a fresh cache for ``config`` is a full-attention dynamic layer (its
    keys and values can be copied into another state: the prefix cache)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    layers = getattr(DynamicCache(config=config), "layers", None)
    return bool(layers) and all(isinstance(layer, DynamicLayer) and not getattr(layer, "is_sliding", False)
                                for layer in layers)


def _check_tree_cache(state: Any) -> None:
    """Trees gather KV entries in place, which needs full-length dynamic layers."""
    from transformers.cache_utils import DynamicLayer

    bad = [type(layer).__name__ for layer in state.layers
           if not isinstance(layer, DynamicLayer) or getattr(layer, "is_sliding", False)]
    if bad:
        raise ConfigError(f"draft trees need a cache of full-attention dynamic layers, and this model's has "
                          f"{bad[0]} layers (sliding-window or linear attention): drop --tree for this model")


class PaddedRows(RowStates):
    """The rows' KV in one padded ``DynamicCache`` with masked holes (see the module docstring):
    ``valid[r, c]`` says whether column c of row r holds one of the row's tokens."""

    batched = True

    def __init__(self, target: LoadedModel, compact_fraction: float = DEFAULT_COMPACT_FRACTION, pad: int = 0):
        super().__init__(target)
        self.compact_fraction, self.pad = compact_fraction, pad
        self._cache: Any = None
        self._valid = torch.zeros(0, 0, dtype=torch.bool)
        self._before = 0  # columns before the round's forward
        self._kept = 0  # the most columns a row kept of it
        self._lent = False  # the lone row's cache was handed out (``state``): ``valid`` follows it
        self._pending: list[tuple[Any, int]] = []  # joined rows not merged yet (``_merge``)
        self.compactions = 0

    def __len__(self) -> int:
        return int(self._valid.shape[0]) + len(self._pending)

    @property
    def valid(self) -> torch.Tensor:
        self._sync()
        return self._valid

    @property
    def columns(self) -> int:
        self._sync()
        return int(self._valid.shape[1])

    def state(self, r: int) -> Any:
        """The cache of the only row, without holes (compacted first if it has any): the
        caller runs the backend's per-sequence operations on it (draft trees, features)."""
        if len(self) != 1:
            raise RuntimeError(f"PaddedRows.state: {len(self)} rows share one cache; only a lone row has its own")
        self._merge()
        if not self._lent and not bool(self._valid.all()):
            self.compact()
        self._lent = True
        return self._cache

    def _sync(self) -> None:
        """Before the cache is read: the lone row's own cache followed, the joined rows merged."""
        self._sync_lent()
        self._merge()

    def _sync_lent(self) -> None:
        """After the lone row ran on its own cache: every column it holds is valid."""
        if self._lent:
            self._valid = torch.ones(1, int(self._cache.get_seq_length()), dtype=torch.bool)
            self._lent = False

    def join(self, state: Any, length: int) -> None:
        """Append a batch-1 cache of ``length`` tokens as a new row (left-padded with holes). The
        rows that join before the next forward are merged in one copy (``_merge``): sixteen
        requests joining one by one would otherwise copy the batch cache sixteen times."""
        self._sync_lent()
        self._pending.append((state, length))

    def _merge(self) -> None:
        """Merge the joined rows' caches into the batch cache, left-padded to one width."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        if not len(self._valid):
            state, length = pending.pop(0)
            self._cache, self._valid = state, torch.ones(1, length, dtype=torch.bool)
            if not pending:
                return
        b, t = int(self._valid.shape[0]), int(self._valid.shape[1])
        width = max([t] + [length for _, length in pending])
        for i, mine in enumerate(self._cache.layers):
            theirs = [state.layers[i] for state, _ in pending]
            filled = [layer for layer in (mine, *theirs) if layer.get_seq_length()]
            if not filled:
                continue
            ref = filled[0]
            parts = [_kv(mine, b, t, ref)] + [_kv(layer, 1, length, ref) for layer, (_, length) in zip(theirs, pending)]
            if not mine.is_initialized:
                mine.lazy_initialization(ref.keys, ref.values)
            if is_spare_capacity(mine):  # stacked into buffers with room: the next forward writes in place
                cap = width + max(KV_GROWTH, width // 2)
                mine.hold(_stack_left_padded([k for k, _ in parts], width, cap),
                          _stack_left_padded([v for _, v in parts], width, cap), width)
            else:
                mine.keys = _stack_left_padded([k for k, _ in parts], width)
                mine.values = _stack_left_padded([v for _, v in parts], width)
        rows = [_left_pad(self._valid, width)]
        for _, length in pending:
            row_valid = torch.zeros(1, width, dtype=torch.bool)
            row_valid[0, width - length:] = True
            rows.append(row_valid)
        self._valid = torch.cat(rows, 0)
        for state, _ in pending:
            self.target.release(state)

    def leave(self, rows: Sequence[int]) -> None:
        self._sync()
        drop = set(rows)
        keep = [i for i in range(len(self)) if i not in drop]
        if not keep:
            self._cache, self._valid = None, torch.zeros(0, 0, dtype=torch.bool)
            return
        idx = torch.tensor(keep)
        self._cache.batch_select_indices(idx.to(self.target.device))
        self._valid = self._valid[idx]
        self._maybe_compact()

    def forward(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """One padded forward over every row's inputs: logits [rows, W, vocab]."""
        self._sync()
        self._before = self._valid.shape[1]
        self._kept = 0
        logits = forward_rows(self.target, self._cache, self._valid, inputs, self.pad)
        self._valid = torch.cat([self._valid, torch.zeros(len(inputs), logits.shape[1], dtype=torch.bool)], 1)
        return logits

    def keep(self, r: int, kept: int) -> None:
        self._valid[r, self._before: self._before + kept] = True
        self._kept = max(self._kept, kept)

    def end_round(self, leaving: Sequence[int] = ()) -> None:
        if self._lent:  # the lone row ran on its own cache
            if leaving:
                self.leave(leaving)
            return
        columns = self._before + self._kept
        drop = self._valid.shape[1] - columns
        if drop > 0 and self._cache is not None:
            self._cache.crop(-drop)
            self._valid = self._valid[:, :columns]
        if leaving:
            self.leave(leaving)
        else:
            self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Gather each row's valid columns (left-padded) when holes are worth a copy."""
        lengths = self._valid.sum(1)
        longest = int(lengths.max()) if len(lengths) else 0
        t = self._valid.shape[1]
        if t - longest <= max(8, self.compact_fraction * longest):
            return
        self.compact()

    @torch.inference_mode()
    def compact(self) -> None:
        """Move every row's valid columns to the right end of ``max length`` columns."""
        self._sync()
        if not len(self):
            return
        lengths = self._valid.sum(1)
        width = int(lengths.max())
        # per row: the sorted indices of its valid columns, right-aligned; holes gather column 0
        order = torch.sort((~self._valid).to(torch.int8), dim=1, stable=True).indices  # valid first
        idx = torch.zeros(len(lengths), width, dtype=torch.long)
        new_valid = torch.zeros(len(lengths), width, dtype=torch.bool)
        for r, n in enumerate(lengths.tolist()):
            idx[r, width - n:] = order[r, :n]
            new_valid[r, width - n:] = True
        dev_idx = idx.to(self.target.device)
        for layer in self._cache.layers:
            if layer.get_seq_length() == 0:
                continue
            g = dev_idx[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, g)
            layer.values = layer.values.gather(2, g)
        self._valid = new_valid
        self.compactions += 1

    def row_kv(self, r: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The valid keys and values of row ``r``, per layer ([heads, tokens, dim]): what a
        batch-1 cache of its tokens would hold (tests, debugging)."""
        self._sync()
        cols = self._valid[r].nonzero().flatten().to(self.target.device)
        return [(layer.keys[r].index_select(1, cols), layer.values[r].index_select(1, cols))
                for layer in self._cache.layers]


def batch_attention_mask(valid: torch.Tensor, widths: Sequence[int], width: int, dtype: torch.dtype,
                         device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive float mask [rows, 1, W, T + W] for a forward of ``width`` new columns per row on
    a cache of ``T`` columns: query j < widths[r] sees the row's valid columns and new columns
    0..j; a padding query (j >= widths[r]) sees only itself (a row with nothing to attend to
    would give NaN under SDPA)."""
    rows, t = valid.shape
    j = torch.arange(width)
    real = j[None, :] < torch.tensor(list(widths))[:, None]  # [rows, W]
    allowed = torch.zeros(rows, width, t + width, dtype=torch.bool)
    allowed[:, :, :t] = valid[:, None, :] & real[:, :, None]
    causal = j[None, :] <= j[:, None]  # [W, W]: key i <= query j
    allowed[:, :, t:] = (causal[None] & real[:, :, None]) | (torch.eye(width, dtype=torch.bool)[None] & ~real[:, :, None])
    mask = torch.zeros(rows, width, t + width, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.to(device)[:, None]


@torch.inference_mode()
def forward_rows(target: LoadedModel, cache: Any, valid: torch.Tensor, inputs: Sequence[Sequence[int]],
                 pad: int = 0) -> torch.Tensor:
    """One forward of every row's ``inputs`` (padded to the widest) on the padded batch cache:
    positions continue each row's true length (its valid columns); logits [rows, W, vocab]. A
    lone row without holes (concurrency 1) takes the backend's own forward, mask-free."""
    if len(inputs) == 1 and bool(valid.all()):  # one row without holes: the batch-1 forward
        return target.forward(cache, inputs[0], keep=len(inputs[0]))[0][None].float()
    device = target.device
    widths = [len(x) for x in inputs]
    width = max(widths)
    ids = torch.full((len(inputs), width), pad, dtype=torch.long)
    for r, x in enumerate(inputs):
        ids[r, : len(x)] = torch.tensor(list(x), dtype=torch.long)
    pos = valid.sum(1, keepdim=True) + torch.arange(width)[None, :]
    mask = batch_attention_mask(valid, widths, width, target.dtype, device)
    out = target.model(input_ids=ids.to(device), attention_mask=mask, position_ids=pos.to(device),
                       **{target.cache_kw: cache}, use_cache=True)
    return out.logits.float()


def _kv(layer: Any, rows: int, length: int, ref: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's keys and values, or empty ones shaped like ``ref``'s (an unused cache)."""
    if layer.get_seq_length() > 0:
        return layer.keys, layer.values
    shape = (rows, ref.keys.shape[1], length, ref.keys.shape[-1])
    z = torch.zeros(shape, dtype=ref.keys.dtype, device=ref.keys.device)
    return z, z.clone()


def _stack_left_padded(parts: Sequence[torch.Tensor], width: int, capacity: int | None = None) -> torch.Tensor:
    """KV parts [rows_i, heads, L_i, D] stacked along rows, each left-padded with zeros to
    ``width`` columns, in one allocation (of ``capacity`` columns, ``width`` by default, those past
    ``width`` left as they are) and one copy of each part."""
    first = parts[0]
    out = first.new_empty((sum(p.shape[0] for p in parts), first.shape[1], capacity or width, first.shape[3]))
    r = 0
    for part in parts:
        n, length = part.shape[0], part.shape[2]
        if length < width:
            out[r:r + n, :, :width - length].zero_()
        out[r:r + n, :, width - length:width].copy_(part)
        r += n
    return out


def _left_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """Pad a valid mask's column axis (dim 1) on the left to ``width`` (KV: ``_stack_left_padded``)."""
    missing = width - x.shape[1]
    if missing <= 0:
        return x
    return torch.cat([torch.zeros(x.shape[0], missing, dtype=x.dtype, device=x.device), x], 1)
