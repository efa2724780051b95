"""Engine behaviour: input validation, stopping, streaming, statistics and verify costs."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

import adaspec.costs
from rounds import draft_chain
from conftest import make_tiny_model, word_tokenizer

from adaspec import GenerationConfig, SpeculativeEngine
from adaspec.costs import VerifyCostCurve, VerifyCostSurface, load_or_measure, measure_verify_costs
from adaspec.drafters import PromptLookupDrafter
from adaspec.errors import ConfigError, PromptError, UnknownNameError
from adaspec.models import as_loaded

VOCAB = 32
WORDS = [f"w{i:02d}" for i in range(VOCAB)]  # fixed width: a stop string cannot match mid-word
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
PROMPT2 = [7, 3, 9, 22, 14, 5, 30, 2, 11, 8]


def _word_tokenizer(**special) -> PreTrainedTokenizerFast:
    return word_tokenizer(WORDS, **special)


def _hf_greedy(model, prompt, n, **kw) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, **kw)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def model(init_std) -> LlamaForCausalLM:
    return make_tiny_model(0, VOCAB, init_std=init_std)


@pytest.fixture(scope="module")
def small_window() -> LlamaForCausalLM:
    return make_tiny_model(0, VOCAB, max_positions=64)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return _word_tokenizer()


@pytest.fixture(scope="module")
def ar(model) -> list[int]:
    """Plain greedy continuation of PROMPT (40 tokens)."""
    return _hf_greedy(model, PROMPT, 40)


# -- bad input ----------------------------------------------------------------------------------
def test_empty_prompts(model, tok):
    engine = SpeculativeEngine(model, ["prompt-lookup"], tokenizer=tok)
    for prompt in ("", "   \n"):
        with pytest.raises(PromptError, match=r"empty: pass some text"):
            engine.generate(prompt, max_new_tokens=4)
    with pytest.raises(PromptError, match=r"empty: pass some text, messages or token ids"):
        engine.generate([], max_new_tokens=4)
    with pytest.raises(PromptError, match=r"empty"):
        engine.generate(torch.tensor([], dtype=torch.long), max_new_tokens=4)


def test_string_prompt_without_tokenizer(model):
    engine = SpeculativeEngine(model, ["prompt-lookup"])
    with pytest.raises(PromptError, match=r"no tokenizer: pass the prompt as a list of token ids"):
        engine.generate("hello", max_new_tokens=4)


@pytest.mark.parametrize("prompt", [[3, 40], [-1, 2], [VOCAB]])
def test_token_ids_outside_vocabulary(model, prompt):
    engine = SpeculativeEngine(model, ["prompt-lookup"])
    with pytest.raises(PromptError, match=r"outside the vocabulary \[0, 32\)"):
        engine.generate(prompt, max_new_tokens=4)


@pytest.mark.parametrize("prompt", [[1, 2.0], [1, "2"], [True, 2]])
def test_token_ids_must_be_ints(model, prompt):
    engine = SpeculativeEngine(model, ["prompt-lookup"])
    with pytest.raises(PromptError, match=r"list of ints"):
        engine.generate(prompt, max_new_tokens=4)


def test_prompt_longer_than_context_window(small_window):
    engine = SpeculativeEngine(small_window, ["prompt-lookup"])
    for n in (64, 80):
        with pytest.raises(PromptError, match=rf"{n} tokens.*context window is 64: shorten the prompt"):
            engine.generate([1] * n, max_new_tokens=1)


def test_prompt_plus_max_new_tokens_over_context_window(small_window):
    engine = SpeculativeEngine(small_window, ["self"], k=4)
    with pytest.raises(PromptError, match=r"exceeds the context window \(64\): lower "
                                          r"max_new_tokens to 34 or shorten the prompt"):
        engine.generate([1] * 30, max_new_tokens=35)
    # exactly filling the window is fine and exact
    prompt = list(range(1, 31))
    result = engine.generate(prompt, max_new_tokens=34)
    assert result.token_ids == _hf_greedy(small_window, prompt, 34)


@pytest.mark.parametrize("k", [0, -1, True, 2.5])
def test_bad_k(model, k):
    with pytest.raises(ConfigError, match=r"k must be an integer >= 1.*use k=1"):
        SpeculativeEngine(model, ["prompt-lookup"], k=k)


@pytest.mark.parametrize("option,match", [
    ({"temperature": -0.5}, r"temperature must be >= 0.*use 0 for greedy"),
    ({"temperature": float("nan")}, r"temperature must be a number"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\].*use 1.0 to disable"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\].*use 1.0 to disable"),
    ({"top_k": -1}, r"top_k must be >= 0.*use 0 to disable"),
    ({"max_new_tokens": 0}, r"max_new_tokens must be a positive integer"),
    ({"max_new_tokens": -3}, r"max_new_tokens must be a positive integer"),
    ({"max_new_tokens": 2.5}, r"max_new_tokens must be a positive integer"),
    ({"stop": ["ok", ""]}, r"remove the empty string"),
    ({"max_tokens": 10}, r"unknown generation option.*max_tokens.*allowed are.*max_new_tokens"),
    ({"do_sample": True}, r"unknown generation option.*do_sample.*allowed are"),
])
def test_bad_generation_options(model, option, match):
    engine = SpeculativeEngine(model, ["prompt-lookup"])
    with pytest.raises(ConfigError, match=match):
        engine.generate(PROMPT, **option)


def test_bad_selector_and_length_names(model):
    with pytest.raises(UnknownNameError, match=r"unknown selector 'bandit9'.*static"):
        SpeculativeEngine(model, ["prompt-lookup"], selector="bandit9")
    with pytest.raises(UnknownNameError, match=r"unknown length policy 'magic'.*static"):
        SpeculativeEngine(model, ["prompt-lookup"], length="magic")
    with pytest.raises(ConfigError, match=r"only 1 drafter"):
        SpeculativeEngine(model, ["prompt-lookup"], selector="static:arm=1").generate(PROMPT)


# -- stopping -----------------------------------------------------------------------------------
def _pick_eos(ar: list[int]) -> tuple[int, int]:
    """A token whose first occurrence in ``ar`` is as late as possible (but not the first 3)."""
    first: dict[int, int] = {}
    for i, t in enumerate(ar):
        first.setdefault(t, i)
    cands = [(i, t) for t, i in first.items() if 3 <= i <= 30 and t != 0]
    assert cands, ar
    i, t = max(cands)
    return t, i


@pytest.mark.parametrize("drafter", ["prompt-lookup", "self", "none"])
@pytest.mark.parametrize("k", [1, 4])
def test_stops_at_eos_like_hf(ar, init_std, drafter, k):
    eos, at = _pick_eos(ar)
    model = make_tiny_model(0, VOCAB, init_std=init_std)  # own copy: its generation config is changed
    model.generation_config.eos_token_id = eos
    ref = _hf_greedy(model, PROMPT, 40)
    assert ref == ar[: at + 1] and ref[-1] == eos
    engine = SpeculativeEngine(model, [drafter], k=k)
    result = engine.generate(PROMPT, max_new_tokens=40)
    assert result.token_ids == ref
    assert result.stats.stop_reason == "eos"
    assert result.stats.new_tokens == len(ref)
    # stop_on_eos=False runs to the token budget
    result = engine.generate(PROMPT, max_new_tokens=40, config=GenerationConfig(stop_on_eos=False))
    assert result.token_ids == ar
    assert result.stats.stop_reason == "max_new_tokens"


def test_stops_at_tokenizer_eos(model, ar):
    eos, at = _pick_eos(ar)
    tok = _word_tokenizer(eos_token=WORDS[eos])
    assert tok.eos_token_id == eos
    engine = SpeculativeEngine(model, ["self"], k=7, tokenizer=tok)
    result = engine.generate(PROMPT, max_new_tokens=40)
    assert result.token_ids == ar[: at + 1]
    assert result.stats.stop_reason == "eos"
    assert WORDS[eos] not in result.text  # special tokens are skipped in the text


@pytest.mark.parametrize("drafter", ["self", "prompt-lookup", "suffix"])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_max_new_tokens_exactly_respected(model, ar, drafter, k):
    engine = SpeculativeEngine(model, [drafter], k=k)
    for n in (1, 2, 3, 5, 8, 13):
        result = engine.generate(PROMPT, max_new_tokens=n)
        assert result.token_ids == ar[:n]
        assert result.stats.new_tokens == n
        assert result.stats.stop_reason == "max_new_tokens"
        assert all(r.k_cap <= min(k, n - 1) for r in result.stats.rounds)


def _first_stop(ar: list[int], stops: list[str], tok) -> int:
    """Number of tokens plain decoding emits before (and including) the first stop-string hit."""
    for j in range(len(ar)):
        text = tok.decode(ar[: j + 1])
        if any(s in text for s in stops):
            return j + 1
    return len(ar)


@pytest.mark.parametrize("drafter", ["self", "prompt-lookup", "suffix"])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_stop_strings(model, tok, ar, drafter, k):
    engine = SpeculativeEngine(model, [drafter], k=k, tokenizer=tok)
    text_prompt = tok.decode(PROMPT)
    assert engine.encode_prompt(text_prompt) == PROMPT
    checked = 0
    for pos in (5, 11, 20):
        stop = tok.decode(ar[pos: pos + 2])  # two tokens, occurring at pos (or earlier)
        n = _first_stop(ar, [stop], tok)
        assert 2 <= n <= pos + 2
        result = engine.generate(text_prompt, max_new_tokens=40, stop=[stop])
        assert result.token_ids == ar[:n]
        assert result.stats.stop_reason == "stop_string"
        assert stop in result.text and result.text.endswith(stop)
        assert stop not in tok.decode(ar[: n - 1])
        checked += 1
    # several stop strings: the earliest wins; a stop string given as a plain str works too
    stops = [tok.decode(ar[25:27]), tok.decode(ar[8:9])]
    n = _first_stop(ar, stops, tok)
    assert engine.generate(text_prompt, max_new_tokens=40, stop=stops).token_ids == ar[:n]
    assert engine.generate(text_prompt, max_new_tokens=40, stop=stops[1]).token_ids == \
        ar[: _first_stop(ar, [stops[1]], tok)]
    # a stop string that never occurs
    result = engine.generate(text_prompt, max_new_tokens=40, stop=["zzz"])
    assert result.token_ids == ar and result.stats.stop_reason == "max_new_tokens"
    assert checked == 3


# -- streaming ----------------------------------------------------------------------------------
@pytest.mark.parametrize("drafter", ["self", "prompt-lookup", "none"])
def test_on_tokens_chunks_concatenate(model, ar, drafter):
    engine = SpeculativeEngine(model, [drafter], k=4)
    chunks: list[list[int]] = []
    result = engine.generate(PROMPT, max_new_tokens=40, on_tokens=lambda c: chunks.append(list(c)))
    assert [t for c in chunks for t in c] == result.token_ids == ar
    assert len(chunks) == result.stats.n_rounds
    assert [len(c) for c in chunks] == [r.emitted for r in result.stats.rounds]
    assert all(chunks)
    if drafter == "self":
        assert max(map(len, chunks)) == 5


@pytest.mark.parametrize("drafter", ["self", "prompt-lookup"])
def test_stream_text_pieces_concatenate(model, tok, drafter):
    engine = SpeculativeEngine(model, [drafter], k=4, tokenizer=tok)
    text_prompt = tok.decode(PROMPT2)
    result = engine.generate(text_prompt, max_new_tokens=30)
    pieces = list(engine.stream(text_prompt, max_new_tokens=30))
    assert len(pieces) > 1
    assert "".join(pieces) == result.text == tok.decode(result.token_ids)
    assert engine.last_stats is not None
    assert engine.last_stats.new_tokens == 30
    # stream honours stop strings too
    stop = tok.decode(result.token_ids[10:12])
    stopped = engine.generate(text_prompt, max_new_tokens=30, stop=[stop])
    assert "".join(engine.stream(text_prompt, max_new_tokens=30, stop=[stop])) == stopped.text
    assert engine.last_stats.stop_reason == "stop_string"


# -- statistics ---------------------------------------------------------------------------------
@pytest.mark.parametrize("drafter,prompt", [("prompt-lookup", PROMPT), ("suffix", PROMPT2),
                                            ("self", PROMPT2)])
def test_stats_formulas(model, drafter, prompt):
    engine = SpeculativeEngine(model, [drafter], k=4)
    result = engine.generate(prompt, max_new_tokens=40)
    s = result.stats
    assert s.prompt_tokens == len(prompt)
    assert s.new_tokens == 40 == len(result.token_ids)
    assert s.n_rounds == len(s.rounds) > 0
    assert s.mat == pytest.approx(s.new_tokens / s.n_rounds)
    assert s.verification_rate * s.new_tokens == pytest.approx(s.n_rounds)
    assert s.drafted == sum(r.drafted for r in s.rounds)
    assert s.accepted == sum(r.accepted for r in s.rounds) <= s.drafted
    assert s.discard_rate == pytest.approx((s.drafted - s.accepted) / s.new_tokens)
    assert s.acceptance_rate == pytest.approx(s.accepted / s.drafted if s.drafted else 0.0)
    assert sum(r.emitted for r in s.rounds) == s.new_tokens
    for r in s.rounds[:-1]:
        assert r.emitted == r.accepted + 1
        assert r.accepted <= r.drafted <= r.k_cap <= 4
    assert s.seed is None  # greedy
    assert s.tokens_per_s > 0
    if drafter == "self":
        assert s.acceptance_rate == 1.0 and s.discard_rate == 0.0

    split = s.time_split
    assert set(split) == {"prefill", "drafter_prefill", "target_forward", "drafting", "catch_up",
                          "policy", "evaluation", "overhead", "other"}
    assert all(v >= 0 for v in split.values())
    assert split["target_forward"] > 0 and split["prefill"] > 0
    assert sum(split.values()) == pytest.approx(s.total_s, rel=0.02, abs=1e-3)
    for r in s.rounds:
        parts = (r.draft_s + r.verify_s + r.catch_up_s + r.policy_s + r.eval_s + r.overhead_s
                 + r.drafter_prefill_s)
        assert parts == pytest.approx(r.total_s, rel=1e-6, abs=1e-9)

    d = result.to_dict(rounds=True)
    text = json.dumps(d)
    back = json.loads(text)
    assert back["token_ids"] == result.token_ids
    st = back["stats"]
    assert st["rounds"] == s.n_rounds and st["new_tokens"] == 40
    assert st["mat"] == pytest.approx(s.mat)
    assert len(st["per_round"]) == s.n_rounds
    assert st["drafter_usage"] == {engine.drafter_names[0]: s.n_rounds}
    json.dumps(s.to_dict())
    assert isinstance(s.summary(), str) and "MAT" in s.summary()


class TickClock:
    """A fake ``time`` module for the engine: every ``perf_counter()`` call advances by one tick,
    and ``advance(n)`` stands for n ticks of work. Timings become exact tick counts, so the
    time attribution is checked without measuring wall-clock time."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now

    def advance(self, ticks: float) -> None:
        self.now += ticks


class _SlowPrefillLookup(PromptLookupDrafter):
    """Prompt lookup whose first catch-up in a request (the drafter prefill) costs 1000 ticks."""

    def __init__(self, clock: TickClock, name: str | None = None):
        super().__init__(name=name)
        self.clock = clock

    def begin_request(self, prompt_ids):
        super().begin_request(prompt_ids)
        self._first = True

    def catch_up(self, context):
        if self._first:
            self._first = False
            self.clock.advance(1000.0)
        super().catch_up(context)


def test_drafter_prefill_is_not_counted_twice(model, monkeypatch):
    clock = TickClock()
    monkeypatch.setattr("adaspec.round.time", clock)  # the engine's only clock
    engine = SpeculativeEngine(model, [_SlowPrefillLookup(clock)], k=4)
    s = engine.generate(PROMPT, max_new_tokens=10).stats
    assert s.drafter_prefill_s >= 1000.0
    # the prefill is neither policy time nor catch-up, and is counted once in the total
    assert s.rounds[0].policy_s < 100.0 and s.rounds[0].catch_up_s < 100.0
    assert sum(s.time_split.values()) == pytest.approx(s.total_s)
    assert 1000.0 <= s.total_s < 2000.0


class _SlowPrefillScored(_SlowPrefillLookup):
    """As ``_SlowPrefillLookup``, but never looked at: the engine scores it (full information)."""

    is_model = True


def test_first_use_prompt_ingestion_is_not_per_round_overhead(model, monkeypatch):
    """A drafter's prompt ingestion at its first use in a request, looked at (auto's peeks) or
    scored (full information), is paid once: it is recorded as drafter prefill, and the
    per-round overhead the plans price stays the rounds' own work (a 0.5B draft model's prompt
    prefill there once made every plain step look ~10x dearer on llama.cpp, so auto drafted
    with it where it did not pay)."""
    clock = TickClock()
    monkeypatch.setattr("adaspec.round.time", clock)
    engine = SpeculativeEngine(model, [_SlowPrefillLookup(clock, "looked"), _SlowPrefillScored(clock, "scored"),
                                       "none"], selector="auto")
    s = engine.generate(PROMPT, max_new_tokens=10).stats
    assert s.drafter_prefill_s >= 2000.0  # both drafters' first uses, each once
    assert engine.cost_model.round_overhead_s < 100.0
    assert all(r.policy_s < 100.0 and r.eval_s < 100.0 for r in s.rounds)
    assert sum(s.time_split.values()) == pytest.approx(s.total_s)


# -- verify costs -------------------------------------------------------------------------------
def test_measure_verify_costs(model):
    curve = measure_verify_costs(as_loaded(model), ks=(1, 2, 4), context=16, repeats=2)
    assert curve.ks == [1, 2, 4] and curve.context == 16
    assert len(curve.seconds) == 3 and all(s > 0 for s in curve.seconds)
    assert curve.ratio(1) == 1.0


def test_cost_curve_interpolation_ratio_and_cliffs():
    curve = VerifyCostCurve(ks=[1, 2, 3, 5], seconds=[1.0, 1.8, 1.85, 1.2], context=10)
    assert curve.cliffs() == [2, 3]
    assert curve.cost(0) == 0.0 and curve.cost(-2) == 0.0
    assert curve.cost(2) == 1.8
    assert curve.cost(4) == pytest.approx(1.525)  # halfway between 1.85 and 1.2
    assert curve.cost(9) == pytest.approx(1.2)  # decreasing tail: extrapolated flat
    assert curve.ratio(2) == pytest.approx(1.8)
    assert curve.ratio(5) == pytest.approx(1.2)
    d = curve.to_dict()
    assert d["cliffs"] == [2, 3] and d["ratios"] == [1.0, 1.8, 1.85, 1.2]
    assert "cliff" in curve.table()

    rising = VerifyCostCurve(ks=[2, 4, 8], seconds=[2.0, 3.0, 5.0], context=10)
    assert rising.cliffs() == []
    assert rising.cost(1) == 2.0  # below the first k: the first measurement
    assert rising.cost(6) == pytest.approx(4.0)
    assert rising.cost(10) == pytest.approx(6.0)  # slope of the last segment (0.5 per token)
    assert rising.ratio(8) == pytest.approx(5.0 / 2.0)


def test_load_or_measure_caches_on_disk(model, tmp_path, monkeypatch):
    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    loaded = as_loaded(model)
    first = load_or_measure(loaded, ks=(1, 2, 3), contexts=(8, 24), repeats=2)
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1 and files[0].stem == first.key
    assert json.loads(files[0].read_text())["seconds"] == first.seconds
    assert first.contexts == [8, 24] and len(first.prefill_seconds) == 2

    def boom(*args, **kwargs):
        raise AssertionError("should have been read from the cache")

    monkeypatch.setattr(adaspec.costs, "measure_verify_surface", boom)
    again = load_or_measure(loaded, ks=(1, 2, 3), contexts=(8, 24), repeats=2)
    assert (again.ks, again.seconds, again.contexts, again.key) == \
        (first.ks, first.seconds, first.contexts, first.key)
    with pytest.raises(AssertionError, match="cache"):  # other ks: another key, measured again
        load_or_measure(loaded, ks=(1, 2), contexts=(8, 24), repeats=2)
    with pytest.raises(AssertionError, match="cache"):  # other contexts: another key
        load_or_measure(loaded, ks=(1, 2, 3), contexts=(8,), repeats=2)
    with pytest.raises(AssertionError, match="cache"):  # refresh forces a measurement
        load_or_measure(loaded, ks=(1, 2, 3), contexts=(8, 24), repeats=2, refresh=True)


def test_load_or_measure_ignores_corrupt_cache(model, tmp_path, monkeypatch):
    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    loaded = as_loaded(model)
    first = load_or_measure(loaded, ks=(1, 2), contexts=(8,), repeats=1)
    path = tmp_path / "costs" / f"{first.key}.json"
    path.write_text("{not json")
    fake = VerifyCostSurface([8], [1, 2], [[0.5, 0.75]])
    monkeypatch.setattr(adaspec.costs, "measure_verify_surface", lambda *a, **k: fake)
    surface = load_or_measure(loaded, ks=(1, 2), contexts=(8,), repeats=1)
    assert surface.seconds == [[0.5, 0.75]]
    assert json.loads(path.read_text())["seconds"] == [[0.5, 0.75]]  # rewritten


def test_engine_verify_costs_uses_cache(model, tmp_path, monkeypatch):
    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    engine = SpeculativeEngine(model, ["prompt-lookup"], k=2)
    fake = VerifyCostSurface([32, 256], [1, 2, 3, 4], [[1.0, 1.0, 1.1, 1.0], [1.0, 1.0, 2.0, 1.0]])
    monkeypatch.setattr(adaspec.costs, "measure_verify_surface", lambda *a, **k: fake)
    monkeypatch.setattr("adaspec.engine.load_or_measure", adaspec.costs.load_or_measure)
    surface = engine.verify_costs()
    assert surface.seconds == fake.seconds and surface.cliffs_by_context() == {32: [], 256: [3]}
    assert engine.verify_costs() is surface  # memoised on the engine
    assert list((tmp_path / "costs").glob("*.json"))


@pytest.mark.parametrize("cap", [1, 3, 5, 9])
def test_a_look_is_the_draft_and_a_cut_look_is_continued(model, cap):
    """``Round.draft_chain`` from a look equals a fresh draft of the same cap (the same tokens, the
    length policy asked at the same positions): a look cut at its depth is looked at again,
    deeper, from the verified context (never drafted from the context + the look, which the
    drafter would take as verified); the look's seconds are the draft's."""
    from adaspec.config import SamplingConfig
    from adaspec.drafters import Decision
    ctx = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4]
    engine = SpeculativeEngine(model, [PromptLookupDrafter()], k=3)

    def asking(log: list) -> object:
        def decide(step):
            log.append((step.index, step.token))
            return Decision.STOP if step.index == 6 else Decision.CONTINUE
        return decide

    fresh_log: list = []
    fresh = PromptLookupDrafter().draft(ctx, cap, SamplingConfig(), None, asking(fresh_log)).tokens
    d = engine.drafters[0]
    d.begin_request(ctx)
    look = d.peek(ctx, 3)
    look.seconds, look.cut = 0.25, True
    calls: list = []
    draft = d.draft
    d.draft = lambda *a, **k: calls.append(a[0]) or draft(*a, **k)
    log: list = []
    got = draft_chain(engine, 0, ctx, cap, {0: look}, SamplingConfig(), None, asking(log))
    assert got.tokens == fresh and log == fresh_log and got.look_s == 0.25
    assert len(fresh) == min(cap, 7)
    assert calls == []  # never a draft: past the look, a deeper look from ``ctx``
    # the whole block rejected: the next catch-up leaves the index holding the new context,
    # never a look token the continuation took as context (it was, before the fix)
    bonus = next(t for t in range(20) if t != fresh[0])
    d.catch_up(ctx + [bonus])
    assert d._index.tokens == ctx + [bonus]
    assert d.peek(ctx + [bonus], 4).tokens == PromptLookupDrafter().peek(ctx + [bonus], 4).tokens


def test_a_continued_look_does_not_settle_the_rounds_tree_against_drafts(model):
    """A tree the drafter offered earlier in the round (``auto``'s plan kept the chain) is
    settled against the emitted tokens at the next catch-up, never against the chain's
    unverified tokens when the look is continued past its depth."""
    from adaspec.config import SamplingConfig
    from adaspec.drafters import Decision
    ctx = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4]
    engine = SpeculativeEngine(model, [PromptLookupDrafter()], k=3)
    d = engine.drafters[0]
    d.begin_request(ctx)
    d.draft_tree(ctx, 4, 8)  # offered: settled at the next catch-up past ctx
    look = d.peek(ctx, 3)
    look.cut = True
    draft_chain(engine, 0, ctx, 7, {0: look}, SamplingConfig(), None, lambda step: Decision.CONTINUE)
    assert d.request_calibration.trials == {}  # nothing settled on drafted tokens
    d.catch_up(ctx + [19])
    assert sum(d.request_calibration.trials.values()) > 0 and sum(d.request_calibration.hits.values()) == 0
