"""Text the user sees: streaming through a byte-level tokenizer, stop strings made of byte
tokens, stop strings that occur only in the prompt, and the reported seed of ``seed=None``.

A byte-level BPE tokenizer with no merges has one token per byte (like the byte-fallback tokens
of SentencePiece vocabularies), so every multi-byte character spans several tokens. To make the
output a chosen text, ``scripted`` replaces the engine's greedy verifier with one that emits the
next byte of a script (drafter 'none': one token per round, so every multi-byte character is
split across rounds). The rest of the engine (rounds, stops, streaming, decoding) runs as is.
"""

from __future__ import annotations

import pytest

from conftest import make_tiny_model

from adaspec import SpeculativeEngine
from adaspec.sampling import Verdict

TEXT = "héllo 😀 日本語 €!"


@pytest.fixture(scope="module")
def byte_tokenizer():
    """Byte-level BPE with the 256 byte tokens only: token id = byte value."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    tk = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, clean_up_tokenization_spaces=False)
    assert tok("é€")["input_ids"] == list("é€".encode())
    return tok


@pytest.fixture(scope="module")
def engine(byte_tokenizer):
    return SpeculativeEngine(make_tiny_model(0, 256), ["none"], tokenizer=byte_tokenizer)


def scripted(monkeypatch, text: str) -> list[int]:
    """Make every greedy request emit the UTF-8 bytes of ``text`` (then spaces)."""
    script = list(text.encode())
    state = {"i": 0}

    def verify(logits, drafts):
        assert not drafts  # drafter 'none'
        i = state["i"]
        state["i"] += 1
        return Verdict(0, script[i] if i < len(script) else 32)

    monkeypatch.setattr("adaspec.round.verify_greedy", verify)
    monkeypatch.setattr(SpeculativeEngine, "eos_ids", lambda self: set())
    return script


PROMPT = list(b"say: ")


def test_stream_holds_back_incomplete_utf8(engine, monkeypatch):
    script = scripted(monkeypatch, TEXT)
    pieces = list(engine.stream(PROMPT, max_new_tokens=len(script)))
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)  # a split character is never shown half
    # one piece per character: each multi-byte character appears once all its bytes are in
    assert pieces == list(TEXT)
    assert engine.last_stats.new_tokens == len(script) and engine.last_stats.n_rounds == len(script)


def test_stream_ending_inside_a_character_matches_generate(engine, monkeypatch):
    n = len("héllo ".encode()) + 2  # stops after 2 of the emoji's 4 bytes
    scripted(monkeypatch, TEXT)
    text = engine.generate(PROMPT, max_new_tokens=n).text
    scripted(monkeypatch, TEXT)
    pieces = list(engine.stream(PROMPT, max_new_tokens=n))
    assert "".join(pieces) == text
    assert text.startswith("héllo ") and text.endswith("\ufffd")  # what decode makes of the half emoji


def test_stop_string_made_of_byte_tokens(engine, monkeypatch):
    """A stop string of 3 emoji is 12 byte tokens: generation stops right after it."""
    text = "ab😀😀😀cd"
    for stop in ("😀😀😀", "b😀", "😀c"):
        scripted(monkeypatch, text)
        res = engine.generate(PROMPT, max_new_tokens=30, stop=[stop])
        end = text.index(stop) + len(stop)
        assert res.stats.stop_reason == "stop_string", stop
        assert res.token_ids == list(text[:end].encode()), stop
        assert res.text == text[:end]
        scripted(monkeypatch, text)
        assert "".join(engine.stream(PROMPT, max_new_tokens=30, stop=[stop])) == text[:end]


def test_stop_string_only_in_the_prompt_does_not_stop(engine, monkeypatch):
    script = scripted(monkeypatch, "fine, no stop here")
    prompt = list("STOP 😀 now: ".encode())
    res = engine.generate(prompt, max_new_tokens=len(script), stop=["STOP", "😀"])
    assert res.stats.stop_reason == "max_new_tokens"
    assert res.text == "fine, no stop here"


def test_stream_of_random_bytes_equals_generate(byte_tokenizer):
    """Sampled random bytes (invalid UTF-8, truncated and complete multi-byte sequences mixed)
    with a real drafter: the streamed pieces always concatenate to generate()'s text."""
    engine = SpeculativeEngine(make_tiny_model(0, 256, init_std=0.3), ["prompt-lookup"], k=3,
                               tokenizer=byte_tokenizer)
    prompt = list("é€é€é€😀é€".encode())
    texts = []
    for seed in range(4):
        res = engine.generate(prompt, max_new_tokens=30, temperature=1.0, seed=seed)
        assert "".join(engine.stream(prompt, max_new_tokens=30, temperature=1.0, seed=seed)) == res.text
        texts.append(res.text)
    assert any("\ufffd" in t for t in texts)  # invalid bytes were really produced
    assert any(ord(c) > 127 and c != "\ufffd" for t in texts for c in t)  # and valid multi-byte ones


@pytest.mark.parametrize("drafter", ["prompt-lookup", "self"])
def test_reported_seed_reproduces_a_sampled_output(drafter):
    """seed=None draws a fresh seed and reports it; passing it back gives the same output."""
    engine = SpeculativeEngine(make_tiny_model(0, 32, init_std=0.3), [drafter], k=3)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    first = engine.generate(prompt, max_new_tokens=24, temperature=1.0)
    again = engine.generate(prompt, max_new_tokens=24, temperature=1.0)
    assert first.stats.seed is not None and first.stats.seed != again.stats.seed
    for res in (first, again):
        same = engine.generate(prompt, max_new_tokens=24, temperature=1.0, seed=res.stats.seed)
        assert same.token_ids == res.token_ids and same.stats.seed == res.stats.seed
    assert first.to_dict()["stats"]["seed"] == first.stats.seed
