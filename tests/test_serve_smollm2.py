"""adaspec serve on SmolLM2-135M-Instruct with the default configuration (slow: --run-slow)."""

from __future__ import annotations

import openai
import pytest

from serving import serve_in_thread

from adaspec.config import GenerationConfig
from adaspec.engine import SpeculativeEngine
from adaspec.models import load_model
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


def test_chat_greedy_stream_and_not_equal_generate(served):
    client, reference = served
    want = reference.generate(MESSAGES, GenerationConfig(max_new_tokens=80))
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
