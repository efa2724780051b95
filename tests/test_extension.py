"""A drafter, a selector and a length policy written here, in a test file, each one class plus
one registration, run unchanged through every path that decodes: ``generate``,
``generate_batch``, replay (the drafter rebuilt live from its spec through the registry), the
serving proposer (``BatchSim``, as vLLM keeps its batch) and ``adaspec serve``. Greedy outputs
are the target's in each."""

from __future__ import annotations

from collections.abc import Sequence

import httpx
import openai
import pytest
from conftest import make_tiny_model
from serving import save_tiny_chat_model, serve_in_thread
from test_integration_batch import BatchSim, periodic

from adaspec import SpeculativeEngine
from adaspec.bench.replay import replay
from adaspec.bench.trace import record_trace
from adaspec.config import GenerationConfig
from adaspec.drafters import Draft, Drafter, DrafterCaps, Proposals, parse_drafter, register_drafter
from adaspec.drafters.base import Peek, apply_decisions
from adaspec.errors import AdaspecError, ConfigError
from adaspec.integrations.batch import BatchProposer, BatchProposerConfig
from adaspec.length import LengthCaps, LengthPolicy, register_length
from adaspec.models import load_model
from adaspec.registry import REGISTRY
from adaspec.selection import DrafterPolicy, SelectorCaps, register_selector
from adaspec.serve import ServeConfig, create_app

V = 48
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7, 8, 9, 7, 8, 9, 7, 8], [5, 6, 5, 6, 5, 6, 5]]
N = 24


class EchoDrafter(Drafter):
    """Proposes the token ``period`` positions back, again and again: what a periodic text
    continues with. Its block is a function of the context, so it can be looked at for free
    (``peek``) and has no per-request state to fork."""

    name = "echo"
    caps = DrafterCaps(family="echo")
    built = 0  # drafters built, across the instances (replay rebuilds it from its spec)

    def __init__(self, period: int = 2):
        if period < 1:
            raise ConfigError(f"echo needs period >= 1, got {period}: e.g. echo:period=2")
        self.period = period
        EchoDrafter.built += 1

    def _chain(self, context: Sequence[int], n: int) -> list[int]:
        seq, out = list(context), []
        while len(out) < n and len(seq) >= self.period:
            out.append(seq[-self.period])
            seq.append(out[-1])
        return out

    def begin_request(self, prompt_ids: Sequence[int]) -> None:
        pass

    def catch_up(self, context: Sequence[int]) -> None:
        pass

    def draft(self, context, max_tokens, sampling, generator, decide, want_hidden=False) -> Draft:
        return Draft(tokens=apply_decisions(self._chain(context, max_tokens), decide))

    def peek(self, context: Sequence[int], max_tokens: int) -> Peek:
        return Peek(self._chain(context, max_tokens))

    def score(self, context, verified, sampling) -> Proposals:
        seq, tokens = list(context), []
        for v in verified:
            tokens.append(seq[-self.period] if len(seq) >= self.period else -1)
            seq.append(v)
        return Proposals(tokens=tokens)

    def fork(self) -> EchoDrafter:
        return EchoDrafter(self.period)


class Alternate(DrafterPolicy):
    """Drafter 0, then 1, ..., in turn, one round each (every ``every`` rounds a step)."""

    name = "alternate"
    caps = SelectorCaps(shares_interleaved=True)  # its update reads the feedback only

    def __init__(self, every: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.every, self.t = every, 0

    def select(self) -> int:
        return (self.t // self.every) % max(1, self.n_arms)

    def update(self, feedback) -> None:
        self.t += 1


class Fixed(LengthPolicy):
    """Draft ``k`` tokens, every round."""

    name = "fixed"
    caps = LengthCaps(shares_interleaved=True)

    def __init__(self, k: int = 3, **kwargs):
        super().__init__(**kwargs)
        self.k = k

    def begin_round(self, drafter: int) -> int:
        return self.k


@pytest.fixture(autouse=True)
def registered():
    register_drafter("echo", EchoDrafter)
    register_selector("alternate", Alternate)
    register_length("fixed", Fixed)
    yield
    REGISTRY.unregister("drafter", "echo")
    REGISTRY.unregister("selector", "alternate")
    REGISTRY.unregister("length", "fixed")


@pytest.fixture(scope="module")
def target():
    return make_tiny_model(seed=0, vocab=V, init_std=0.3, lm_head_scale=2.0)


def _engine(model):
    return SpeculativeEngine(model, ["echo:period=4", "none"], selector="alternate:every=2", length="fixed:k=3")


def _rounds(result):
    return [(r.drafter, r.k_cap, r.drafted, r.accepted, r.emitted) for r in result.stats.rounds]


def test_its_spec_is_parsed_and_checked_from_its_signature():
    spec = parse_drafter("echo:period=3")
    assert spec.params.period == 3 and spec.entry.caps.free_looks and spec.entry.caps.forks
    with pytest.raises(AdaspecError, match=r"period='x' is not a valid int"):
        parse_drafter("echo:period=x")
    with pytest.raises(AdaspecError, match=r"unknown parameter\(s\) \['peroid'\] for drafter 'echo': allowed: period"):
        parse_drafter("echo:peroid=3")
    assert "echo" in str(pytest.raises(AdaspecError, parse_drafter, "ech").value)  # listed once registered


def test_generate_and_generate_batch(target):
    plain = SpeculativeEngine(target, [])
    engine = _engine(target)
    outs = [engine.generate(p, max_new_tokens=N) for p in PROMPTS]
    for p, out in zip(PROMPTS, outs):
        assert out.token_ids == plain.generate(p, max_new_tokens=N).token_ids
    rounds = [r for out in outs for r in out.stats.rounds]
    assert any(r.drafter == "echo" and r.drafted == 3 for r in rounds)
    assert {r.drafter for r in rounds} == {"echo", "none"}  # alternated
    batched = _engine(target).generate_batch(PROMPTS, max_new_tokens=N, max_batch=3)
    assert [b.token_ids for b in batched] == [o.token_ids for o in outs]
    assert any(r.drafter == "echo" and r.drafted > 0 for b in batched for r in b.stats.rounds)


def test_replay_rebuilds_it_from_its_spec_and_equals_the_live_run(target, tmp_path, monkeypatch):
    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    trace = record_trace(target, ["echo:period=4"], PROMPTS, N, max_draft=8, calibrate=False)
    live = _engine(target)
    want = [_rounds(live.generate(p, max_new_tokens=N)) for p in PROMPTS]
    before = EchoDrafter.built
    got = replay(trace, "alternate:every=2", "fixed:k=3", k=3, drafters=["echo:period=4", "none"])
    assert EchoDrafter.built > before  # live: rebuilt from "echo:period=4" through the registry
    assert got.exact and got.tokens == len(PROMPTS) * N
    for i in range(len(PROMPTS)):
        assert got.keys(i) == want[i], f"prompt {i}"


def test_the_serving_proposer_runs_it():
    sim = BatchSim(width=3)
    targets = {}
    for j in range(5):
        prompt = [3 + j, 9, 4 + j, 11, 3 + j, 9]
        targets[f"r{j}"] = (prompt, periodic(4))
        sim.submit(f"r{j}", prompt, periodic(4), max_new=20)
    cfg = BatchProposerConfig(drafters=("echo:period=4", "none"), selector="alternate", length="fixed:k=3", k=3)
    prop = BatchProposer(cfg)
    sim.run(prop)
    for rid, (prompt, rule) in targets.items():
        ctx = list(prompt)
        for _ in range(20):
            ctx.append(rule(ctx))
        assert sim.outputs[rid] == ctx[len(prompt):]
    echo = prop.stats.drafters["echo:period=4"]
    assert echo.drafted > 0 and echo.accepted == echo.drafted  # a period-4 text: every echo is right


def test_adaspec_serve_runs_it(tmp_path):
    model_dir = save_tiny_chat_model(tmp_path / "tiny-chat")
    engine = SpeculativeEngine(load_model(model_dir), ["echo:period=2", "none"], selector="alternate",
                               length="fixed:k=3")
    reference = SpeculativeEngine(load_model(model_dir), [])
    chat = [{"role": "user", "content": "w01 w02 w01 w02 w01 w02 w01"}]
    want = reference.generate(chat, GenerationConfig(max_new_tokens=16)).text
    app = create_app(engine, ServeConfig(model_id="tiny", selector="alternate", length="fixed:k=3", k=3))
    with serve_in_thread(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        resp = client.chat.completions.create(model="tiny", messages=chat, max_tokens=16, temperature=0)
        assert resp.choices[0].message.content == want
        learnt = httpx.get(f"{base}/health").json()["learnt"]
    assert learnt["drafters"]["echo"]["rounds"] > 0 and learnt["drafters"]["echo"]["drafted"] > 0
