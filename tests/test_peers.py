"""Hugging Face peers (hf-greedy, hf-pld, hf-assisted): spec parsing, exactness against adaspec's
plain decoding, round counting, EOS handling and vocabulary checks, on tiny random models."""

from __future__ import annotations

import logging

import pytest
from conftest import make_tiny_model

from adaspec import SpeculativeEngine
from adaspec.errors import ConfigError, PromptError, VocabularyMismatchError
from adaspec.models import as_loaded
from adaspec.bench.peers import HFPeer, PeerSpec, build_peers, is_peer_spec, parse_peer

VOCAB = 64
PROMPTS = [
    [5, 9, 12, 5, 9, 12, 7, 3, 5, 9],
    [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5],
    [40, 41, 17, 40, 41, 17, 40, 41, 17, 40, 41],
]


def tiny(seed: int = 1, vocab: int = VOCAB):
    return as_loaded(make_tiny_model(seed, vocab, init_std=0.3, lm_head_scale=2), name=f"tiny{seed}")


@pytest.fixture(scope="module")
def target():
    return tiny(1)


def greedy(target, prompt, n=30):
    return SpeculativeEngine(target, [], k=1).generate(prompt, max_new_tokens=n).token_ids


# -- spec parsing -----------------------------------------------------------------------------
def test_parse_defaults_are_transformers_defaults():
    assert parse_peer("hf-greedy") == PeerSpec("greedy", "hf-greedy")
    pld = parse_peer(" hf-pld ")
    assert (pld.kind, pld.spec, pld.k, pld.max_ngram) == ("pld", "hf-pld", 10, 2)
    a = parse_peer("hf-assisted:model=some/dir")
    assert (a.model, a.k, a.schedule, a.confidence) == ("some/dir", 20, "constant", 0.4)


def test_parse_parameters_and_aliases():
    assert parse_peer("hf-pld:k=4,max_ngram=3").settings() == {
        "prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 3}
    assert parse_peer("hf-pld:max_matching_ngram_size=1").max_ngram == 1
    a = parse_peer("hf-assisted:model=m.gguf,k=5,schedule=heuristic,confidence=0.2")
    assert a.settings() == {"assistant_model": "m.gguf", "num_assistant_tokens": 5,
                            "num_assistant_tokens_schedule": "heuristic",
                            "assistant_confidence_threshold": 0.2}
    assert parse_peer("hf-assisted:model=x,confidence=off").confidence == 0.0
    assert parse_peer("HF-PLD:k=3").kind == "pld"


@pytest.mark.parametrize("spec, needle", [
    ("hf-beam", "unknown peer"),
    ("hf-greedy:k=3", "unknown parameter"),
    ("hf-pld:n=3", "unknown parameter"),
    ("hf-pld:k=0", "k must be >= 1"),
    ("hf-pld:k=two", "not an integer"),
    ("hf-pld:k", "key=value"),
    ("hf-pld:max_ngram=2,max_matching_ngram_size=2", "not both"),
    ("hf-assisted", "needs an assistant model"),
    ("hf-assisted:k=3", "needs an assistant model"),
    ("hf-assisted:model=x,schedule=fast", "schedule"),
    ("hf-assisted:model=x,confidence=1.5", "confidence"),
    ("hf-assisted:model=x,confidence=high", "not a number"),
    ("prompt-lookup", "not a peer spec"),
])
def test_parse_errors_name_the_problem(spec, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_peer(spec)


def test_is_peer_spec():
    assert is_peer_spec("hf-pld") and is_peer_spec(" HF-greedy")
    assert not is_peer_spec("prompt-lookup") and not is_peer_spec("model:hf-x") and not is_peer_spec("")


# -- exactness and counting -------------------------------------------------------------------
@pytest.mark.parametrize("prompt", PROMPTS)
def test_hf_greedy_equals_adaspec_ar_with_one_round_per_token(target, prompt):
    ref = greedy(target, prompt)
    run = HFPeer(target, "hf-greedy").run(prompt, 30, set())
    assert run.token_ids == ref
    # HF's first forward runs the whole prompt and emits the first token: every forward is a round
    assert run.target_forwards == run.rounds == run.new_tokens == 30
    assert run.prefill_tokens == len(prompt)
    assert run.drafted == run.accepted == 0 and run.assistant_forwards is None
    assert run.mat == 1.0 and run.seconds > 0
    assert run.verify_widths == {1: 29}


@pytest.mark.parametrize("spec", ["hf-pld", "hf-pld:k=3,max_ngram=1", "hf-pld:k=5,max_ngram=3"])
def test_hf_pld_equals_greedy(target, spec):
    peer = HFPeer(target, spec)
    drafted = 0
    for prompt in PROMPTS:
        run = peer.run(prompt, 30, set())
        assert run.token_ids == greedy(target, prompt)
        assert 1 <= run.rounds <= run.new_tokens
        assert run.rounds + run.accepted == run.new_tokens
        assert run.accepted <= run.drafted
        drafted += run.drafted
    assert drafted > 0  # the repetitive prompts give lookup matches


def test_hf_assisted_loaded_from_a_directory_equals_greedy(target, tmp_path):
    make_tiny_model(7, VOCAB, init_std=0.3, lm_head_scale=2).save_pretrained(tmp_path / "asst")
    peer = HFPeer(target, f"hf-assisted:model={tmp_path / 'asst'},k=4")
    assert peer.assistant is not None and peer.assistant.model is not target.model
    for prompt in PROMPTS:
        run = peer.run(prompt, 30, set())
        assert run.token_ids == greedy(target, prompt)
        assert run.assistant_forwards is not None and run.assistant_forwards > 0
        assert run.rounds + run.accepted == run.new_tokens and run.accepted <= run.drafted


@pytest.mark.parametrize("spec, rounds, drafted", [
    # a perfect assistant: every round accepts k drafts plus the bonus token, 30 = 6 x (4 + 1)
    ("hf-assisted:model=copy,k=4,confidence=0", 6, 24),
    # HF's heuristic: k = 2, 4, 6, 8 (3 + 5 + 7 + 9 = 24 tokens), then capped at 30 - 24 - 1 = 5
    ("hf-assisted:model=copy,k=2,schedule=heuristic,confidence=0", 5, 25),
])
def test_rounds_counted_exactly_with_a_perfect_assistant(target, spec, rounds, drafted):
    peer = HFPeer(target, spec, assistant=tiny(1))  # same weights as the target
    prompt = PROMPTS[0]
    for _ in range(2):  # k restarts every run: the second run counts the same
        run = peer.run(prompt, 30, set())
        assert run.token_ids == greedy(target, prompt)
        assert (run.rounds, run.target_forwards, run.drafted, run.accepted) == (rounds, rounds, drafted, drafted)
        assert run.mat == 30 / rounds
        assert sum((w - 1) * c for w, c in run.verify_widths.items()) == drafted - (run.prefill_tokens - len(prompt))


def test_stops_at_eos_like_adaspec_and_keeps_it():
    model = make_tiny_model(1, VOCAB, init_std=0.3, lm_head_scale=2)
    free = greedy(as_loaded(model), PROMPTS[0])
    eos = free[7]
    model.generation_config.eos_token_id = eos
    t = as_loaded(model, name="eos")
    engine = SpeculativeEngine(t, [], k=1)
    ref = engine.generate(PROMPTS[0], max_new_tokens=30).token_ids
    assert ref[-1] == eos and len(ref) == free.index(eos) + 1
    for peer in build_peers(t, ["hf-greedy", "hf-pld:k=4"]) + [HFPeer(t, "hf-assisted:model=m", assistant=tiny(1))]:
        run = peer.run(PROMPTS[0], 30, engine.eos_ids())
        assert run.token_ids == ref, peer.name


def test_model_generation_config_cannot_change_the_output():
    model = make_tiny_model(1, VOCAB, init_std=0.3, lm_head_scale=2)
    ref = greedy(as_loaded(model), PROMPTS[1])
    gc = model.generation_config
    gc.min_length, gc.repetition_penalty, gc.max_length, gc.no_repeat_ngram_size = 200, 3.0, 5, 2
    t = as_loaded(model, name="odd-config")
    assistant = tiny(2)
    assistant.model.generation_config.num_assistant_tokens = 50
    peers = [HFPeer(t, "hf-greedy"), HFPeer(t, "hf-pld"), HFPeer(t, "hf-assisted:model=m,k=3", assistant=assistant)]
    for peer in peers:
        assert peer.run(PROMPTS[1], 30, set()).token_ids == ref, peer.name
    assert model.generation_config is gc and gc.repetition_penalty == 3.0  # restored, untouched
    assert assistant.model.generation_config.num_assistant_tokens == 50


def test_no_transformers_warnings(target):
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    once = getattr(logging.Logger, "warning_once", None)  # transformers' cached warn-once
    if hasattr(once, "cache_clear"):
        once.cache_clear()
    try:
        for peer in [HFPeer(target, "hf-greedy"), HFPeer(target, "hf-pld"),
                     HFPeer(target, "hf-assisted:model=m,k=3", assistant=tiny(3))]:
            peer.run(PROMPTS[0], 12, {7})
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == []


def test_build_peers_loads_each_assistant_once(target, tmp_path):
    make_tiny_model(4, VOCAB).save_pretrained(tmp_path / "a")
    p1, p2, p3 = build_peers(target, [f"hf-assisted:model={tmp_path / 'a'},k=2",
                                      f"hf-assisted:model={tmp_path / 'a'},k=6", "hf-greedy"])
    assert p1.assistant is p2.assistant and p3.assistant is None
    assert [p.name for p in (p1, p2, p3)][2] == "hf-greedy"


# -- errors -----------------------------------------------------------------------------------
def test_vocabulary_mismatch_is_refused(target, tmp_path):
    make_tiny_model(2, 48).save_pretrained(tmp_path / "small-vocab")
    with pytest.raises(VocabularyMismatchError, match="48 output tokens"):
        HFPeer(target, f"hf-assisted:model={tmp_path / 'small-vocab'}")


def test_target_as_its_own_assistant_instance_is_refused(target):
    with pytest.raises(ConfigError, match="separate model instance"):
        HFPeer(target, "hf-assisted:model=x", assistant=target)


def test_bad_requests(target):
    peer = HFPeer(target, "hf-pld")
    with pytest.raises(PromptError, match="empty"):
        peer.run([], 5, set())
    with pytest.raises(PromptError, match="outside the vocabulary"):
        peer.run([1, VOCAB], 5, set())
    with pytest.raises(PromptError, match="context window"):
        peer.run([1, 2, 3], 600, set())
    with pytest.raises(ConfigError, match="max_new_tokens"):
        peer.run([1, 2, 3], 0, set())
    run = peer.run([1, 2, 3], 1, set())
    assert (run.new_tokens, run.rounds) == (1, 1)


@pytest.mark.slow
def test_smollm2_peers_match_adaspec_ar():
    from adaspec import load_model

    t = load_model("smollm2", weights="dense")  # the peers' model (on a quantized target: its dense twin)
    engine = SpeculativeEngine(t, [], k=1)
    ids = engine.encode_prompt("Fix the typos: 'Teh comittee will discus the budjet tomorow.'")
    ref = engine.generate(ids, max_new_tokens=24).token_ids
    for peer in build_peers(t, ["hf-greedy", "hf-pld:k=5"]):
        run = peer.run(ids, 24, engine.eos_ids())
        assert run.token_ids == ref, peer.name
        assert run.rounds <= run.new_tokens
