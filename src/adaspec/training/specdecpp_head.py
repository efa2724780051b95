"""Training the SpecDec++ acceptance head on CPU (SpecDec++ 4.4, D.1).

Pipeline, for any pair of Hugging Face causal LMs that share a vocabulary:

1. the target writes a response X_1..X_N to every prompt (greedy, or sampled with the same
   temperature / top-k / top-p the head is trained for), batched with left padding;
2. along [prompt + X] (teacher forcing) the target gives p_i and the drafter q_i at every
   response position; a candidate Y_i ~ q_i is drawn (argmax under greedy decoding) and its
   acceptance probability is P_i = min(1, p_i(Y_i) / q_i(Y_i)), computed on the *processed*
   distributions the engine verifies with (greedy: P_i = 1[Y_i = argmax p_i]);
3. token mixing: Z_i = X_i with probability r (target tokens, r = 15%) and Y_i otherwise;
   one drafter pass over [prompt + Z] gives the final hidden state e_i at every Z_i, and
   the positions where Z_i came from Y_i are the training examples (e_i, P_i);
4. the head is trained with the weighted BCE of 4.4 (w_acc = 1, w_rej), Adam and a cosine
   learning-rate schedule (D.1), on a prompt-level train / held-out split; per epoch we
   report the training loss and the held-out loss, unweighted BCE and "eval KL", the mean
   Bernoulli KL(P || P_hat) of D.3;
5. the head is saved with the drafter's metadata (``adaspec.length.specdecpp.save_head``).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

import torch

from ..config import SamplingConfig
from ..errors import ConfigError
from ..length.specdecpp import AcceptanceHead, drafter_info, save_head
from ..models import LoadedModel
from ..sampling import process_logits

Progress = Callable[[str, int, int], None]


@dataclass
class HeadTrainConfig:
    """Settings of the head-training pipeline (defaults: SpecDec++ 5.1 / D.1 where they apply).

    ``temperature`` / ``top_k`` / ``top_p``: the decoding mode the head is trained for (0 =
    greedy, as ``adaspec generate`` by default; the paper used T = 1 with top-k 50). Responses
    are generated in the same mode. ``lr`` is higher than the paper's 5e-5 because CPU runs
    see thousands, not millions, of examples.
    """

    prompts: Sequence[Any] = ()  # strings (chat template applied), chat messages or token ids
    max_new_tokens: int = 128
    epochs: int = 20
    lr: float = 1e-3
    batch_size: int = 32
    w_rej: float = 6.0
    w_acc: float = 1.0
    depth: int = 3
    mix_ratio: float = 0.15  # r: fraction of response tokens taken from the target
    seed: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    eval_fraction: float = 0.2  # share of prompts held out (at least one)
    gen_batch_size: int = 4
    chat_template: bool = True

    def __post_init__(self) -> None:
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"head training: {msg}")

        for key in ("max_new_tokens", "epochs", "batch_size", "gen_batch_size"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(f"{key} must be an integer >= 1, got {v!r}")
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 0:
            raise bad(f"depth D must be an integer >= 0 (paper default 3), got {self.depth!r}")
        if not self.lr > 0:
            raise bad(f"lr must be > 0, got {self.lr!r}: use e.g. 1e-3")
        if not (self.w_rej > 0 and self.w_acc > 0):
            raise bad(f"w_rej and w_acc must be > 0, got {self.w_rej!r}, {self.w_acc!r}: the "
                      "paper uses w_acc = 1 and w_rej in {1, 3, 6, 12}")
        if not 0.0 <= self.mix_ratio < 1.0:
            raise bad(f"mix_ratio r must be in [0, 1), got {self.mix_ratio!r}: the paper uses 0.15")
        if not 0.0 < self.eval_fraction < 1.0:
            raise bad(f"eval_fraction must be in (0, 1), got {self.eval_fraction!r}")
        _ = self.sampling  # validates temperature / top_k / top_p

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)


@dataclass
class EpochStats:
    """Losses after one epoch (epoch 0: before training)."""

    epoch: int
    train_loss: float  # weighted BCE over the whole training set
    eval_loss: float  # weighted BCE on held-out positions
    eval_bce: float  # unweighted BCE on held-out positions
    eval_kl: float  # mean Bernoulli KL(P || P_hat) on held-out positions (SpecDec++ D.3)
    eval_pred_mean: float  # mean predicted acceptance on held-out positions
    lr: float


@dataclass
class HeadDataset:
    """Training examples: drafter hidden states and the acceptance probability P_i of the
    drafted token, with the index of the prompt each example comes from."""

    features: torch.Tensor  # [n, hidden]
    targets: torch.Tensor  # [n]
    prompt_index: torch.Tensor  # [n]
    n_response_tokens: int = 0
    n_target_tokens: int = 0  # mixed-in target tokens (no loss)

    def __len__(self) -> int:
        return int(self.targets.numel())


@dataclass
class HeadTrainResult:
    head: AcceptanceHead
    history: list[EpochStats]
    n_train: int
    n_eval: int
    n_prompts: int
    mean_acceptance: float  # mean P_i over all examples
    eval_kl_constant: float  # eval KL of the best constant predictor (train mean): a baseline
    generate_s: float
    collect_s: float
    train_s: float
    path: Path | None = None
    responses: list[list[int]] = field(default_factory=list)

    @property
    def final(self) -> EpochStats:
        return self.history[-1]

    def summary(self) -> dict[str, Any]:
        f = self.final
        return {"train_examples": self.n_train, "eval_examples": self.n_eval,
                "prompts": self.n_prompts, "mean_acceptance": self.mean_acceptance,
                "train_loss": f.train_loss, "eval_loss": f.eval_loss, "eval_bce": f.eval_bce,
                "eval_kl": f.eval_kl, "eval_kl_constant": self.eval_kl_constant,
                "generate_s": self.generate_s, "collect_s": self.collect_s,
                "train_s": self.train_s}


# -- losses and metrics ------------------------------------------------------------------------
def weighted_bce(logits: torch.Tensor, targets: torch.Tensor, w_rej: float = 6.0,
                 w_acc: float = 1.0) -> torch.Tensor:
    """SpecDec++ 4.4 weighted BCE with soft targets P_i, normalised by the total weight:

    sum_i [w_acc P_i (-log P_hat_i) + w_rej (1 - P_i)(-log(1 - P_hat_i))]
        / sum_i [w_acc P_i + w_rej (1 - P_i)],      P_hat_i = sigmoid(logit_i)

    (the normalisation of the reference implementation; it only rescales the gradient).
    """
    targets = targets.to(logits.dtype)
    pos = w_acc * targets
    neg = w_rej * (1.0 - targets)
    logsig = torch.nn.functional.logsigmoid
    loss = pos * -logsig(logits) + neg * -logsig(-logits)
    return loss.sum() / (pos + neg).sum().clamp_min(1e-12)


def bernoulli_kl(targets: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-example KL(Bern(P) || Bern(sigmoid(logit))) with 0 log 0 = 0 (SpecDec++ D.3)."""
    p = targets.to(logits.dtype)
    neg_entropy = torch.xlogy(p, p) + torch.xlogy(1 - p, 1 - p)
    logsig = torch.nn.functional.logsigmoid
    cross = -(p * logsig(logits) + (1 - p) * logsig(-logits))
    return (cross + neg_entropy).clamp_min(0.0)


def mix_tokens(target_tokens: torch.Tensor, draft_tokens: torch.Tensor, r: float,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SpecDec++ 4.4 token mixing: Z_i = X_i (target) with probability r, else Y_i (draft).

    Returns ``(Z, from_target)``; the loss is taken only where ``from_target`` is False.
    (Bernoulli per position, as in the reference implementation.)
    """
    from_target = torch.rand(target_tokens.shape, generator=generator) < r
    return torch.where(from_target, target_tokens, draft_tokens), from_target


# -- data --------------------------------------------------------------------------------------
def encode_prompts(target: LoadedModel, prompts: Sequence[Any],
                   chat_template: bool = True) -> list[list[int]]:
    """Token ids of each prompt, encoded exactly as ``SpeculativeEngine.generate`` would."""
    from ..engine import SpeculativeEngine
    from ..bench.workloads import BenchPrompt

    engine = SpeculativeEngine(target, ["none"])
    return [engine.encode_prompt(p.text if isinstance(p, BenchPrompt) else p, chat_template)
            for p in prompts]


def eos_ids_of(target: LoadedModel) -> set[int]:
    from ..engine import SpeculativeEngine

    return SpeculativeEngine(target, ["none"]).eos_ids()


@torch.inference_mode()
def generate_responses(target: LoadedModel, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int,
                       sampling: SamplingConfig, *, batch_size: int = 4, seed: int = 0,
                       eos: set[int] | None = None,
                       progress: Progress | None = None) -> list[list[int]]:
    """The target's responses, greedy or sampled from the processed distribution (the same
    ``process_logits`` the engine uses), batched with left padding; each response ends after
    its first EOS, at ``max_new_tokens`` or at the context window.

    A plain KV-cached decoding loop rather than ``model.generate``, which would also apply the
    model's own generation defaults (repetition penalty, top-k, ...).
    """
    from transformers import DynamicCache

    eos = eos_ids_of(target) if eos is None else eos
    pad = getattr(target.tokenizer, "pad_token_id", None) if target.tokenizer is not None else None
    if pad is None:
        pad = min(eos) if eos else 0
    window = target.context_window
    device = target.device
    gen = torch.Generator(device=device).manual_seed(seed)
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))  # less padding
    responses: dict[int, list[int]] = {}
    for b in range(0, len(order), batch_size):
        idx = order[b: b + batch_size]
        batch = [list(prompt_ids[i]) for i in idx]
        width = max(len(p) for p in batch)
        n_new = max_new_tokens if window is None else min(max_new_tokens, window - width)
        if n_new < 1:
            raise ConfigError(f"a prompt of {width} tokens leaves no room in the context window "
                              f"({window}): shorten it")
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache(config=target.model.config)
        logits = target.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                              **{target.cache_kw: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
        rows: list[list[int]] = [[] for _ in batch]
        done = [False] * len(batch)
        last = pos[:, -1:]
        for step in range(n_new):
            if sampling.greedy:
                nxt = logits.argmax(-1)
            else:
                nxt = torch.multinomial(process_logits(logits, sampling), 1, generator=gen).squeeze(-1)
            toks = nxt.tolist()
            for r, t in enumerate(toks):
                if not done[r]:
                    rows[r].append(t)
                    done[r] = t in eos
            if all(done) or step == n_new - 1:
                break
            feed = torch.tensor([[pad if done[r] else t] for r, t in enumerate(toks)], device=device)
            mask = torch.cat([mask, mask.new_ones(len(batch), 1)], dim=-1)
            last = last + 1
            logits = target.model(input_ids=feed, attention_mask=mask, position_ids=last,
                                  **{target.cache_kw: cache}, use_cache=True).logits[:, -1]
        for r, i in enumerate(idx):
            responses[i] = rows[r]
        if progress is not None:
            progress("generating responses", min(b + batch_size, len(order)), len(order))
    return [responses[i] for i in range(len(prompt_ids))]


def _align(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Drafter logits as wide as the target's (as ``ModelDrafter`` does)."""
    width = logits.shape[-1]
    if width == vocab:
        return logits
    if width > vocab:
        return logits[..., :vocab]
    pad = logits.new_full((*logits.shape[:-1], vocab - width), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


@torch.inference_mode()
def acceptance_targets(target_logits: torch.Tensor, draft_logits: torch.Tensor,
                       sampling: SamplingConfig,
                       generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw Y_i ~ q_i (argmax under greedy) and return ``(Y, P)`` with
    P_i = min(1, p_i(Y_i) / q_i(Y_i)) on the processed distributions (SpecDec++ 4.4)."""
    rows = torch.arange(target_logits.shape[0])
    if sampling.greedy:
        y = draft_logits.argmax(-1)
        return y, (y == target_logits.argmax(-1)).float()
    p = process_logits(target_logits, sampling)
    q = process_logits(draft_logits, sampling)
    y = torch.multinomial(q, 1, generator=generator).squeeze(-1)
    ratio = p[rows, y] / q[rows, y]
    return y, ratio.clamp(max=1.0)


@torch.inference_mode()
def collect_examples(target: LoadedModel, drafter: LoadedModel, prompt_ids: Sequence[Sequence[int]],
                     responses: Sequence[Sequence[int]], sampling: SamplingConfig, mix_ratio: float,
                     *, seed: int = 0, progress: Progress | None = None) -> HeadDataset:
    """Teacher-forced target and drafter passes, candidate sampling, token mixing and the
    drafter's hidden states at the drafted positions (SpecDec++ 4.4)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    feats, targs, where = [], [], []
    n_resp = n_tgt = 0
    for k, (prompt, resp) in enumerate(zip(prompt_ids, responses)):
        n, m = len(resp), len(prompt)
        if n == 0:
            continue
        seq = torch.tensor([list(prompt) + list(resp)], device=target.device)
        # logits at positions m-1 .. m+n-2 predict X_1..X_N
        t_logits = target.model(input_ids=seq, logits_to_keep=n + 1).logits[0, :n].float().cpu()
        if drafter.model is target.model:  # self-drafting: q = p
            d_logits = t_logits
        else:
            d_seq = seq.to(drafter.device)
            d_logits = _align(drafter.model(input_ids=d_seq, logits_to_keep=n + 1).logits[0, :n]
                              .float().cpu(), vocab)
        y, p_acc = acceptance_targets(t_logits, d_logits, sampling, gen)
        x = torch.tensor(list(resp))
        z, from_target = mix_tokens(x, y, mix_ratio, gen)
        mixed = torch.cat([torch.tensor(list(prompt)), z]).unsqueeze(0).to(drafter.device)
        out = drafter.model(input_ids=mixed, output_hidden_states=True, logits_to_keep=1)
        hidden = out.hidden_states[-1][0, m:].float().cpu()  # e_i at each Z_i
        keep = ~from_target
        feats.append(hidden[keep])
        targs.append(p_acc[keep])
        where.append(torch.full((int(keep.sum()),), k, dtype=torch.long))
        n_resp += n
        n_tgt += int(from_target.sum())
        if progress is not None:
            progress("collecting examples", k + 1, len(prompt_ids))
    if not feats:
        raise ConfigError("head training: no response tokens were generated: raise max_new_tokens")
    return HeadDataset(torch.cat(feats), torch.cat(targs), torch.cat(where), n_resp, n_tgt)


# -- training ----------------------------------------------------------------------------------
def split_prompts(n_prompts: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Held-out prompt indices (at least one) and training prompt indices (at least one)."""
    if n_prompts < 2:
        raise ConfigError("head training needs at least 2 prompts (one is held out for evaluation): "
                          "add prompts")
    perm = torch.randperm(n_prompts, generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = min(n_prompts - 1, max(1, round(eval_fraction * n_prompts)))
    return sorted(perm[n_eval:]), sorted(perm[:n_eval])


@torch.no_grad()
def _evaluate(head: AcceptanceHead, x: torch.Tensor, y: torch.Tensor, w_rej: float,
              w_acc: float) -> tuple[float, float, float, float]:
    head.eval()
    if len(x) == 0:
        return math.nan, math.nan, math.nan, math.nan
    logits = torch.cat([head(x[i: i + 4096]) for i in range(0, len(x), 4096)])
    return (float(weighted_bce(logits, y, w_rej, w_acc)), float(weighted_bce(logits, y, 1.0, 1.0)),
            float(bernoulli_kl(y, logits).mean()), float(torch.sigmoid(logits).mean()))


def train_on_dataset(data: HeadDataset, train_prompts: Sequence[int], eval_prompts: Sequence[int],
                     cfg: HeadTrainConfig, *, on_epoch: Callable[[EpochStats], None] | None = None,
                     ) -> tuple[AcceptanceHead, list[EpochStats], int, int, float]:
    """Fit a head on the training prompts' examples; metrics on the held-out prompts'.

    Returns ``(head, history, n_train, n_eval, eval_kl_of_constant_predictor)``.
    """
    tr = torch.isin(data.prompt_index, torch.tensor(list(train_prompts), dtype=torch.long))
    ev = torch.isin(data.prompt_index, torch.tensor(list(eval_prompts), dtype=torch.long))
    x_tr, y_tr, x_ev, y_ev = data.features[tr], data.targets[tr], data.features[ev], data.targets[ev]
    if len(y_tr) == 0:
        raise ConfigError("head training: the training prompts gave no examples: add prompts "
                          "or raise max_new_tokens")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        head = AcceptanceHead(data.features.shape[1], cfg.depth)
    head.set_input_stats(x_tr)
    mean = float(y_tr.mean())
    # start at the constant minimising the weighted BCE: w_acc P / (w_acc P + w_rej (1 - P))
    best = cfg.w_acc * mean / (cfg.w_acc * mean + cfg.w_rej * (1 - mean))
    best = min(max(best, 1e-4), 1 - 1e-4)
    with torch.no_grad():
        head.out.bias.fill_(math.log(best / (1 - best)))
        head.out.weight.mul_(0.1)
    # baseline for eval KL: the constant predictor at the training mean of P (unweighted optimum)
    mean = min(max(mean, 1e-4), 1 - 1e-4)
    const_logit = torch.full_like(y_ev, math.log(mean / (1 - mean)))
    kl_const = float(bernoulli_kl(y_ev, const_logit).mean()) if len(y_ev) else math.nan

    opt = torch.optim.Adam(head.parameters(), lr=cfg.lr)
    steps_per_epoch = math.ceil(len(y_tr) / cfg.batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, steps_per_epoch * cfg.epochs))
    gen = torch.Generator().manual_seed(cfg.seed + 1)

    def stats(epoch: int) -> EpochStats:
        tl = _evaluate(head, x_tr, y_tr, cfg.w_rej, cfg.w_acc)[0]
        el, eb, ek, em = _evaluate(head, x_ev, y_ev, cfg.w_rej, cfg.w_acc)
        return EpochStats(epoch, tl, el, eb, ek, em, float(opt.param_groups[0]["lr"]))

    history = [stats(0)]
    if on_epoch is not None:
        on_epoch(history[0])
    for epoch in range(1, cfg.epochs + 1):
        head.train()
        perm = torch.randperm(len(y_tr), generator=gen)
        for b in range(0, len(perm), cfg.batch_size):
            idx = perm[b: b + cfg.batch_size]
            loss = weighted_bce(head(x_tr[idx]), y_tr[idx], cfg.w_rej, cfg.w_acc)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        history.append(stats(epoch))
        if on_epoch is not None:
            on_epoch(history[-1])
    head.eval()
    return head, history, int(len(y_tr)), int(len(y_ev)), kl_const


def train_head(target: LoadedModel, drafter: LoadedModel, cfg: HeadTrainConfig,
               out: str | Path | None = None, *, progress: Progress | None = None,
               on_epoch: Callable[[EpochStats], None] | None = None) -> HeadTrainResult:
    """The whole SpecDec++ 4.4 pipeline: responses, examples, training, and (with ``out``)
    the head file. ``progress(stage, done, total)`` and ``on_epoch(stats)`` report progress."""
    if not cfg.prompts:
        raise ConfigError("head training needs prompts: pass a list of prompts (e.g. "
                          "adaspec.bench.workloads.BUILTIN_PROMPTS)")
    from ..drafters.model import check_same_vocabulary

    check_same_vocabulary(target, drafter)
    prompt_ids = encode_prompts(target, cfg.prompts, cfg.chat_template)
    train_idx, eval_idx = split_prompts(len(prompt_ids), cfg.eval_fraction, cfg.seed)

    t0 = time.perf_counter()
    responses = generate_responses(target, prompt_ids, cfg.max_new_tokens, cfg.sampling,
                                   batch_size=cfg.gen_batch_size, seed=cfg.seed, progress=progress)
    t1 = time.perf_counter()
    data = collect_examples(target, drafter, prompt_ids, responses, cfg.sampling, cfg.mix_ratio,
                            seed=cfg.seed, progress=progress)
    t2 = time.perf_counter()
    head, history, n_train, n_eval, kl_const = train_on_dataset(data, train_idx, eval_idx, cfg,
                                                                 on_epoch=on_epoch)
    t3 = time.perf_counter()
    result = HeadTrainResult(head, history, n_train, n_eval, len(prompt_ids),
                             float(data.targets.mean()), kl_const, t1 - t0, t2 - t1, t3 - t2,
                             responses=responses)
    if out is not None:
        settings = {k: v for k, v in asdict(cfg).items() if k != "prompts"}
        settings.update({"target": target.name, "n_prompts": len(prompt_ids),
                         "n_response_tokens": data.n_response_tokens,
                         "n_target_tokens": data.n_target_tokens, **result.summary()})
        result.path = save_head(out, head, drafter_info(drafter), settings)
    return result


__all__ = ["HeadTrainConfig", "HeadTrainResult", "HeadDataset", "EpochStats", "weighted_bce",
           "bernoulli_kl", "mix_tokens", "acceptance_targets", "generate_responses",
           "collect_examples", "train_on_dataset", "train_head", "split_prompts", "encode_prompts"]
