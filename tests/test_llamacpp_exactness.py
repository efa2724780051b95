"""Exactness on llama.cpp against llama-cpp-python's own decoding (``llama_cpp.Llama``: a path
adaspec did not write), on SmolLM2's GGUF file with the CPU defaults (flash attention off).

* Greedy: every prompt of the default ``mixed`` suite (16, first turns), 128 tokens, speculative
  output against ``Llama.generate(temp=0)``. llama.cpp's CPU kernels are not batch-invariant (a
  verify block's rows are not the one-token rows), so the output may part from plain decoding
  where plain decoding's two best tokens were nearly tied: every position of the output is
  judged (``exactness.tie_check``) on the rows plain decoding computes along the output itself
  (the prompt in one batch, then one token at a time, as ``generate`` feeds them), and every
  divergence is printed with its margin (shown with ``-rP``) and must lie within the backend's
  near-tie bound (``near_tie_nats_at``; ``exactness.NEAR_TIE_NATS_LLAMACPP``). Negative control:
  a verifier that accepts a wrong token (``adaspec.round.verify_greedy`` patched) is reported
  beyond the bound.
* Sampling: the joint distribution of the first two sampled tokens (top-k 4, T=1) against the
  one computed from llama-cpp-python's logits, chi-square at ALPHA = 0.001; negative control: the
  correction token after a rejection drawn from p instead of norm((p - q)+) must be rejected.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from conftest import chisquare_gof, real_model_threads

from adaspec import SpeculativeEngine
from adaspec.bench.workloads import default_per_category, load_workload
from adaspec.exactness import NEAR_TIE_NATS_LLAMACPP, tie_check
from adaspec.models import embedded_gguf

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                 reason="llama-cpp-python is not installed")]

N_NEW = 128
ALPHA = 0.001
#: a deterministic configuration (no measured costs) that verifies blocks of every width from 1
#: to 13: the kernels a block takes, and how far they move the margins, depend on its width
DRAFTERS, SELECTOR, LENGTH = ["prompt-lookup", "suffix"], "round-robin", "hf-heuristic:scope=request,max_len=12"


class LlamaReference:
    """llama-cpp-python's plain decoding of the target's GGUF file (same threads, flash
    attention off, the prompt in one batch of up to 512 tokens, as the backend's prefill): its
    greedy ``generate`` and the logits rows its ``eval`` computes. Built and run on the
    backend's llama.cpp thread where the AMX kernels need one (``llamacpp.llama_thread``), with
    the backend's weight layout (``safe_model_params``)."""

    def __init__(self, target):
        from adaspec.backends.llamacpp import import_llama_cpp, llama_thread, on_thread, safe_model_params, uses_amx

        self._L, self._on_thread = import_llama_cpp(), on_thread
        self._thread = llama_thread(uses_amx(self._L, target.path))
        with safe_model_params(self._L, target.path):
            self.llm = on_thread(self._thread, lambda: self._L.Llama(
                model_path=str(target.path), n_ctx=2048, n_batch=512, n_threads=target.threads,
                n_threads_batch=target.threads, flash_attn=False, verbose=False))
        self.vocab = self.llm.n_vocab()

    def _row(self) -> torch.Tensor:
        """The logits of the last token ``eval`` fed (what ``generate``'s sampler reads)."""
        ptr = self._L.llama_get_logits_ith(self.llm.ctx, -1)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.vocab,)).copy())

    def greedy(self, prompt: list[int], n: int, eos: set[int]) -> tuple[list[int], list[torch.Tensor]]:
        """``Llama.generate(temp=0)`` from a fresh context: its tokens (stopped after ``n`` or at
        an EOS, kept) and the rows it chose them from."""
        def run():
            rows, real = [], self.llm.eval
            self.llm.eval = lambda tokens: (real(tokens), rows.append(self._row()))
            try:
                self.llm.reset()
                out = []
                for tok in self.llm.generate(prompt, temp=0.0, reset=True):
                    out.append(int(tok))
                    if tok in eos or len(out) >= n:
                        break
            finally:
                del self.llm.eval
            return out, rows[:len(out)]

        return self._on_thread(self._thread, run)

    def rows_along(self, prompt: list[int], output: list[int], start: int = 0,
                   rows: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Plain decoding's rows before each token of ``output`` (row j: after the prompt and
        ``output[:j]``), teacher-forced one token at a time. ``rows``: the rows of a ``greedy``
        run that shared ``output[:start]``, whose KV the context still holds: they are reused up
        to ``start`` and decoding goes on from there."""
        def run():
            got = list(rows[:start + 1]) if rows is not None else []
            if rows is None:
                self.llm.reset()
                self.llm.eval(prompt)
                got.append(self._row())
            else:
                self.llm.n_tokens = len(prompt) + start  # ``eval`` drops the KV past it
            for tok in output[len(got) - 1:len(output) - 1]:
                self.llm.eval([tok])
                got.append(self._row())
            return torch.stack(got[:len(output)])

        return self._on_thread(self._thread, run)


@pytest.fixture(scope="module")
def target():
    from adaspec.backends.llamacpp import LlamaCppTarget, gguf_tokenizer

    return LlamaCppTarget(embedded_gguf(), name="smollm2", tokenizer=gguf_tokenizer(embedded_gguf()),
                          threads=real_model_threads(), n_ctx=2048, n_seq_max=2)


@pytest.fixture(scope="module")
def reference(target) -> LlamaReference:
    return LlamaReference(target)


def _judge(target, reference, prompt, out, ref, ref_rows):
    """``tie_check`` of ``out`` on plain decoding's rows along it, each position against the
    backend's bound at its length."""
    at = next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
    if at < len(out) and at < len(ref):
        rows = reference.rows_along(prompt, out, at, ref_rows)
    elif at < len(out):  # the reference stopped (EOS) where the output goes on: judge the rest
        rows = reference.rows_along(prompt, out)
    else:
        rows = torch.stack(ref_rows[:len(out)])
    bounds = [target.near_tie_nats_at(len(prompt) + j) for j in range(len(out))]
    return at, tie_check(rows, out, bounds)


def test_greedy_equals_llama_cpp_python_up_to_near_ties_on_the_mixed_suite(target, reference):
    engine = SpeculativeEngine(target, DRAFTERS, selector=SELECTOR, length=LENGTH)
    eos = engine.eos_ids()
    prompts = load_workload("mixed", default_per_category("mixed"))
    assert len(prompts) == 16
    report, failures, accepting = [], [], 0
    for p in prompts:
        ids = engine.encode_prompt(p.text)
        ref, ref_rows = reference.greedy(ids, N_NEW, eos)
        assert [int(r.argmax()) for r in ref_rows] == ref  # the rows are the ones generate chose from
        res = engine.generate(ids, max_new_tokens=N_NEW)
        out = res.token_ids
        at, check = _judge(target, reference, ids, out, ref, ref_rows)
        assert out[:at] == ref[:at] and check.n_exact >= at
        assert res.stats.drafted > 0, f"{p.id}: nothing was drafted"
        accepting += res.stats.accepted > 0
        margins = ", ".join(f"token {j}: {g:.3f}" for j, g in check.divergences) or "none"
        report.append(f"{p.id:18} {len(ids):4} prompt tokens, {len(out):3} new ({len(ref)} plain), first "
                      f"difference {at if at < len(out) else '-'}, divergences (margin in nats): {margins}")
        if not check.ok:
            failures.append(f"{p.id}: beyond the bound: {check.violations}")
    print("\n" + "\n".join(report))
    assert not failures, failures
    # prompts that give the drafters nothing to copy (a conversation) may see every draft rejected
    assert accepting >= 12, f"drafts were accepted on only {accepting} of 16 prompts"


def test_a_wrong_token_acceptance_is_caught_beyond_the_bound(target, reference, monkeypatch):
    """Negative control: the same check on the output of a verifier that accepts every round's
    first draft finds tokens farther below plain decoding's argmax than the near-tie bound."""
    from test_exactness import _accept_first_draft

    monkeypatch.setattr("adaspec.round.verify_greedy", _accept_first_draft)
    engine = SpeculativeEngine(target, DRAFTERS, selector=SELECTOR, length=LENGTH)
    eos = engine.eos_ids()
    caught = 0
    for p in load_workload("mixed", default_per_category("mixed"))[:3]:
        ids = engine.encode_prompt(p.text)
        res = engine.generate(ids, max_new_tokens=32)
        ref, ref_rows = reference.greedy(ids, 32, eos)
        _, check = _judge(target, reference, ids, res.token_ids, ref, ref_rows)
        gaps = sorted(g for _, g in check.violations)
        print(f"{p.id}: {len(gaps)} of 32 tokens beyond the bound, margins {gaps[0] if gaps else 0:.2f}-"
              f"{gaps[-1] if gaps else 0:.2f} nats")
        caught += bool(gaps) and gaps[-1] > NEAR_TIE_NATS_LLAMACPP
    assert caught == 3


# -- sampling ---------------------------------------------------------------------------------------
#: prompt lookup proposes " blue" after it, one of the target's top tokens there
SAMPLING_PROMPT = "red green blue red green blue red green"
TOP_K, N_SAMPLES = 4, 300


def _top_k_probs(logits: torch.Tensor, k: int) -> torch.Tensor:
    """softmax over the ``k`` largest logits (T=1), zero elsewhere: written here, not adaspec's."""
    top = torch.topk(logits.double(), k)
    probs = torch.zeros(logits.shape[-1], dtype=torch.float64)
    probs[top.indices] = torch.softmax(top.values, -1)
    return probs


@pytest.mark.parametrize("bug", [None, "residual-from-p"])
def test_sampling_follows_llama_cpp_python_over_two_tokens(target, reference, bug, monkeypatch):
    """The first two tokens sampled with prompt lookup (top-k 4, T=1, 300 fixed seeds; the first
    round verifies one draft: accepted, the second token is the bonus from the block's row;
    rejected, it comes from a second round after the rollback) follow the joint distribution
    computed from llama-cpp-python's rows (the prompt in one batch, then the first token):
    chi-square at ALPHA = 0.001 over the 16 pairs. Two tokens keep every row the engine samples
    from bit-identical to those (the prompt's row from the same batch, then one-token forwards).
    The negative control (``test_distribution._residual_from_p``) must be rejected at ALPHA."""
    from test_distribution import _residual_from_p

    engine = SpeculativeEngine(target, ["prompt-lookup"], k=3)
    ids = engine.encode_prompt(SAMPLING_PROMPT, chat_template=False)
    rows = reference.rows_along(ids, [0])
    p0 = _top_k_probs(rows[0], TOP_K)
    firsts = torch.nonzero(p0).flatten().tolist()
    joint = {(a, b): float(p0[a] * p1[b]) for a in firsts
             for p1 in [_top_k_probs(reference.rows_along(ids, [a, 0])[1], TOP_K)]
             for b in torch.nonzero(p1).flatten().tolist()}
    if bug:
        monkeypatch.setattr("adaspec.round.verify_sampling", _residual_from_p)
    cells = {pair: i for i, pair in enumerate(sorted(joint))}
    counts = np.zeros(len(cells) + 1)  # the last cell: pairs outside the support
    drafted = accepted = 0
    for seed in range(N_SAMPLES):
        res = engine.generate(ids, max_new_tokens=2, temperature=1.0, top_k=TOP_K, seed=seed)
        counts[cells.get(tuple(res.token_ids), len(cells))] += 1
        drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
    stat, pvalue, n_cells = chisquare_gof(counts, [*[joint[c] for c in sorted(joint)], 0.0])
    print(f"{bug or 'exact'}: chi-square {stat:.1f} over {n_cells} cells, p = {pvalue:.3g}; "
          f"{accepted} of {drafted} drafts accepted")
    if bug:
        assert pvalue < ALPHA, f"negative control {bug!r} not detected: chi-square {stat:.1f}, p = {pvalue:.3g}"
        return
    assert 0 < accepted < drafted, (accepted, drafted)  # both branches of the rule ran
    assert counts[-1] == 0, "a pair outside the target's top-k support was sampled"
    assert pvalue > ALPHA, f"chi-square {stat:.1f} over {n_cells} cells, p = {pvalue:.2e}"
