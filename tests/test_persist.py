"""Policy state as data (``adaspec.persist``): every registered selector and length policy
round-trips through ``state_dict`` / JSON / ``load_state_dict`` into a policy built from the
same spec and then decides as the original does; the server's version-2 pickle files (written
by the code before the change: tests/data/serve-state-v2.json) still load, once, as data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_tiny_model

from adaspec import SpeculativeEngine
from adaspec.costs import VerifyCostSurface
from adaspec.errors import ConfigError
from adaspec.length.base import LengthPolicy, StaticLength
from adaspec.persist import load_state, state_of
from adaspec.registry import REGISTRY
from adaspec.serve.state import PICKLE_VERSION, STATE_VERSION, LearntState

DATA = Path(__file__).parent / "data"
DRAFTERS = ["prompt-lookup", "suffix", "none"]
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 7, 9, 8, 7, 9]]
#: specs that need a file or a required value to build (router, specdecpp: trained files)
NEEDS_FILES = {"router", "specdecpp"}
SPEC: dict[str, str] = {}
SURFACE = VerifyCostSurface(contexts=[16, 256], ks=[1, 2, 4, 8, 16],
                            seconds=[[1.0, 1.05, 1.1, 1.3, 1.8], [1.1, 1.16, 1.22, 1.45, 2.0]])


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=0, vocab=32)


@pytest.fixture(autouse=True)
def fixed_costs(monkeypatch):
    """Every engine prices on one fixed surface: no timing, the same decisions every run."""
    monkeypatch.setattr("adaspec.engine.load_or_measure", lambda *a, **k: SURFACE)


def _configs() -> list[tuple[str, str | None]]:
    out = [(e.name, None) for e in REGISTRY.entries("selector") if e.name not in NEEDS_FILES]
    out += [("static", SPEC.get(e.name, e.name)) for e in REGISTRY.entries("length")
            if e.name not in NEEDS_FILES]
    return out


def _engine(model, selector, length):
    engine = SpeculativeEngine(model, DRAFTERS, selector=selector, length=length, k=4)
    engine.cost_model.live = None  # priced as given: a live run's verify times do not move it
    return engine


def _rounds(engine, prompt):
    return [(r.drafter, r.k_cap, r.drafted, r.accepted) for r in engine.generate(prompt, max_new_tokens=10).stats.rounds]


@pytest.mark.parametrize("selector,length", _configs())
def test_every_policy_round_trips_as_data_and_decides_the_same(model, selector, length):
    engine = _engine(model, selector, length)
    for p in PROMPTS[:2]:
        engine.generate(p, max_new_tokens=10)
    data = json.loads(json.dumps(state_of([engine.selector, engine.length]), allow_nan=False))  # plain JSON
    fresh = _engine(model, selector, length)
    load_state([fresh.selector, fresh.length], data)
    assert state_of([fresh.selector, fresh.length]) == data
    fresh.cost_model = engine.cost_model  # the costs it learnt are the engine's, not the policies'
    for p in (fresh.selector, fresh.length):
        if p.caps.prices_rounds:
            p.costs = engine.cost_model
    if not (engine.selector.caps.reads_time or engine.length.caps.reads_time):  # measured seconds differ
        assert _rounds(fresh, PROMPTS[2]) == _rounds(engine, PROMPTS[2])
    one = engine.selector.state_dict()
    json.dumps(one, allow_nan=False)
    again = _engine(model, selector, length).selector
    again.load_state_dict(one)
    assert again.state_dict() == one


def test_paired_policies_share_what_they_shared_after_loading(model):
    engine = _engine(model, "auto", None)
    engine.generate(PROMPTS[0], max_new_tokens=10)
    fresh = _engine(model, "auto", None)
    load_state([fresh.selector, fresh.length], state_of([engine.selector, engine.length]))
    ctl = fresh.selector.controller
    assert fresh.length.controller is ctl
    assert all(c.clock is ctl.global_clock for c in ctl.global_counts)
    assert [c.t for c in ctl.global_counts] == [c.t for c in engine.selector.controller.global_counts]


class _Opaque:
    """Not a registered state type."""


class _Holds(StaticLength):
    name = "holds-opaque"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.thing = _Opaque()


def test_unregistered_types_and_unknown_tags_are_refused():
    # negative controls: the encoder refuses what it cannot store as data, the decoder what it
    # was not told to build
    with pytest.raises(TypeError, match="register its class with adaspec.persist.state_type"):
        _Holds().state_dict()
    state = StaticLength(k=3).state_dict()
    bad = json.loads(json.dumps(state).replace('"StaticLength"', '"Popen"'))
    with pytest.raises(ConfigError, match="cannot be loaded into a StaticLength"):
        StaticLength(k=3).load_state_dict(bad)
    bad = dict(state, attrs={**state["attrs"], "rng": {"$": "obj", "type": "Popen", "id": 99, "attrs": {}}})
    with pytest.raises(ConfigError, match="not a registered state type"):
        StaticLength(k=3).load_state_dict(bad)
    assert isinstance(StaticLength(), LengthPolicy)


def _build(engine, key):
    _, selector, length, k = key

    def build():
        view = engine.with_policies([0, 1, 2], selector=None if selector == "None" else selector,
                                    length=None if length == "None" else length, k=k)
        return view.selector, view.length
    return build


def test_a_version_2_pickle_file_is_migrated_to_data(model, tmp_path):
    """tests/data/serve-state-v2.json was written by the server of ff09be7 (the pickle of three
    configurations' learners: auto, ucbspec:scope=global, hedgespec with tapout, after three
    requests on this tiny model): it loads, its learners become data loaded into learners built
    afresh, and the next save writes the JSON version."""
    src = DATA / "serve-state-v2.json"
    assert json.loads(src.read_text())["version"] == PICKLE_VERSION
    engine = SpeculativeEngine(model, DRAFTERS)
    state = LearntState(shared=engine.cost_model, fingerprint={"model": "tiny-0", "drafters": engine.drafter_names})
    assert state.load(src) and state.summary()["requests"] == 3 and state.summary()["configurations"] == 3
    keys = list(state._learners)
    learners = {key[1]: state.checkout(key, _build(engine, key)) for key in keys}
    sel, length = learners["auto"]
    assert length.controller is sel.controller and sel.controller.costs is not None  # the engine's
    assert sel.controller.global_counts[0].t[1] > 0 and sel.controller.global_ctx[0]  # what it learnt
    assert sel.caps.looks == 3  # the configuration's own record, not the pickled object's
    ucb, _ = learners["ucbspec:scope=global"]
    assert (ucb.t, ucb.counts) == (28, [10, 10, 8])
    path = tmp_path / "state.json"
    state.save(path)
    saved = json.loads(path.read_text())
    assert saved["version"] == STATE_VERSION and isinstance(saved["learners"], list)
    again = LearntState(shared=engine.cost_model, fingerprint=state.fingerprint)
    assert again.load(path)
    for key in keys:
        a = again.checkout(key, _build(engine, key))
        b = state.checkout(key, _build(engine, key))
        assert state_of(list(a)) == state_of(list(b))
