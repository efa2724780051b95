"""adaspec serve on SmolLM2-135M-Instruct with the default configuration (slow: --run-slow)."""

from __future__ import annotations

import importlib.util

import httpx
import openai
import pytest

from serving import serve_in_thread

from adaspec.config import GenerationConfig
from adaspec.engine import SpeculativeEngine
from adaspec.models import load_model
from conftest import real_model_threads

from adaspec.serve import DEFAULT_DRAFTERS, DEFAULT_LENGTH, DEFAULT_SELECTOR, ServeConfig, create_app

pytestmark = pytest.mark.slow

#: a prompt whose answer copies from it, so that auto drafts from its first request (on a prompt
#: with nothing to copy, auto may rightly decode plainly and MAT stays 1)
MESSAGES = [{"role": "user", "content": "Repeat this list exactly, one item per line: apples, pears, "
                                        "plums, apples, pears, figs."}]


@pytest.fixture(scope="module")
def served():
    engine = SpeculativeEngine(load_model("smollm2"), DEFAULT_DRAFTERS, selector=DEFAULT_SELECTOR,
                               length=DEFAULT_LENGTH)
    reference = SpeculativeEngine(load_model("smollm2"), [])
    with serve_in_thread(create_app(engine, ServeConfig(model_id="smollm2"))) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=600), reference


def test_chat_greedy_stream_and_not_equal_generate(served, stock_greedy):
    client, reference = served
    want = reference.generate(MESSAGES, GenerationConfig(max_new_tokens=80))
    assert want.token_ids == stock_greedy(want.prompt_ids, 80, reference.eos_ids())  # stock modules' greedy
    resp = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=80, temperature=0)
    assert resp.choices[0].message.content == want.text
    assert resp.usage.prompt_tokens == len(want.prompt_ids)
    assert resp.usage.completion_tokens == len(want.token_ids)
    assert resp.model_extra["adaspec"]["mat"] > 1.0  # the drafters were used
    chunks = list(client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=80,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text


def test_completions_greedy_equal_generate(served):
    client, reference = served
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    want = reference.generate(prompt, GenerationConfig(max_new_tokens=48, chat_template=False))
    resp = client.completions.create(model="smollm2", prompt=prompt, max_tokens=48, temperature=0)
    assert resp.choices[0].text == want.text and resp.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.completions.create(model="smollm2", prompt=prompt, max_tokens=48, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llamacpp_server_starts_a_chats_next_turn_from_the_prefix_cache():
    """On llama.cpp the server keeps the last request's KV: a chat's second turn reuses at least
    the first turn's prompt, reported as OpenAI's ``cached_tokens`` and in /metrics;
    ``prefix_cache=False`` computes every prompt afresh."""
    engine = SpeculativeEngine(load_model("smollm2", backend="llama.cpp", threads=real_model_threads()),
                               DEFAULT_DRAFTERS, selector=DEFAULT_SELECTOR, length=DEFAULT_LENGTH)
    with serve_in_thread(create_app(engine, ServeConfig(model_id="smollm2"))) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=600)
        first = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=24,
                                               temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        chat = MESSAGES + [{"role": "assistant", "content": first.choices[0].message.content},
                           {"role": "user", "content": "Now the same list in reverse order."}]
        second = client.chat.completions.create(model="smollm2", messages=chat, max_tokens=24, temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
        assert second.model_extra["adaspec"]["cached_prompt_tokens"] == cached
        assert f"adaspec_cached_prompt_tokens_total {float(cached)}" in httpx.get(f"{base}/metrics").text
    with serve_in_thread(create_app(engine, ServeConfig(model_id="smollm2", prefix_cache=False))) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=600)
        again = client.chat.completions.create(model="smollm2", messages=chat, max_tokens=24, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == 0 and not engine.target.prefix_cache
