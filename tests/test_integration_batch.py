"""The serving proposer core (adaspec.integrations): row mapping, per-row selection, settings.

``BatchSim`` replays what vLLM's model runner does to its batch between proposer calls
(``vllm/v1/worker/gpu_input_batch.py``: rows of finished requests removed and the last rows
moved into the holes by ``condense``, new requests appended, rows swapped by reordering,
chunked prefill rows with no sampled tokens, drafts cut by the scheduler) with a
deterministic target and greedy verification; the real vLLM bookkeeping is checked in
tests/test_vllm_integration.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from adaspec.errors import ConfigError
from adaspec.integrations.batch import BatchProposer, BatchProposerConfig, with_scope
from adaspec.integrations.rows import RowTracker, read_verification
from adaspec.integrations.vllm import (PROPOSER_PATH, additional_config, config_from_vllm,
                                       serve_command, speculative_config)

V = 50


def periodic(period: int):
    """A target that repeats the token ``period`` positions back: prompt lookup learns it."""
    return lambda ctx: ctx[-period]


def scrambled(ctx):
    """A target whose next token no n-gram of the context predicts reliably."""
    return (ctx[-1] * 7 + len(ctx) * 13 + 3) % V


class BatchSim:
    """A batch kept the way vLLM's InputBatch keeps it, verifying drafts greedily."""

    def __init__(self, width: int = 4, max_len: int = 256, prefill_chunks: int = 0,
                 cut_every: int = 0, swap_every: int = 0):
        self.token_ids = np.zeros((width, max_len), dtype=np.int32)
        self.num_tokens = np.zeros(width, dtype=np.int32)
        self.rows: list[str] = []  # request id of every row
        self.reqs: dict[str, dict] = {}
        self.waiting: list[tuple[str, list[int], object, int]] = []
        self.width, self.prefill_chunks = width, prefill_chunks
        self.cut_every, self.swap_every, self.step_no = cut_every, swap_every, 0
        self.drafts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}

    def submit(self, rid: str, prompt: list[int], target, max_new: int) -> None:
        self.waiting.append((rid, prompt, target, max_new))

    def _admit(self) -> None:
        while self.waiting and len(self.rows) < self.width:
            rid, prompt, target, max_new = self.waiting.pop(0)
            i = len(self.rows)
            self.rows.append(rid)
            self.token_ids[i, :len(prompt)] = prompt
            self.num_tokens[i] = len(prompt)
            self.reqs[rid] = {"target": target, "left": max_new, "prefill": self.prefill_chunks}
            self.outputs[rid] = []

    def _remove(self, rid: str) -> None:  # InputBatch.remove_request + condense
        i = self.rows.index(rid)
        last = len(self.rows) - 1
        if i != last:
            self.token_ids[i] = self.token_ids[last]
            self.num_tokens[i] = self.num_tokens[last]
            self.rows[i] = self.rows[last]
        self.rows.pop()

    def _swap(self, a: int, b: int) -> None:  # InputBatch.swap_states
        self.token_ids[[a, b]] = self.token_ids[[b, a]]
        self.num_tokens[[a, b]] = self.num_tokens[[b, a]]
        self.rows[a], self.rows[b] = self.rows[b], self.rows[a]

    def step(self) -> list[list[int]]:
        """One engine step: schedule, verify last drafts, emit; returns sampled per row."""
        self.step_no += 1
        for rid in [r for r in self.rows if self.reqs[r]["left"] <= 0]:
            self._remove(rid)
        self._admit()
        if self.swap_every and self.step_no % self.swap_every == 0 and len(self.rows) > 1:
            self._swap(0, len(self.rows) - 1)
        sampled = []
        for i, rid in enumerate(self.rows):
            r = self.reqs[rid]
            if r["prefill"] > 0:
                r["prefill"] -= 1
                sampled.append([])
                continue
            drafts = self.drafts.pop(rid, [])
            if self.cut_every and self.step_no % self.cut_every == 0:
                drafts = drafts[:1]
            ctx = list(self.token_ids[i, :self.num_tokens[i]])
            out = []
            for d in drafts + [None]:
                t = int(r["target"](ctx))
                out.append(t)
                ctx.append(t)
                if d != t:
                    break
            out = out[:r["left"]]
            r["left"] -= len(out)
            n = self.num_tokens[i]
            self.token_ids[i, n:n + len(out)] = out
            self.num_tokens[i] = n + len(out)
            self.outputs[rid].extend(out)
            sampled.append(out)
        return sampled

    def run(self, proposer: BatchProposer, max_steps: int = 400) -> list[dict[int, str]]:
        """Run to completion; returns, per call, stream id -> request id of the drafted rows."""
        seen = []
        while (self.waiting or self.rows) and max_steps > 0:
            max_steps -= 1
            sampled = self.step()
            drafts = proposer.propose(sampled, self.num_tokens, self.token_ids)
            assert len(drafts) == len(self.rows)
            self.drafts = {rid: d for rid, d in zip(self.rows, drafts) if d}
            seen.append({sid: rid for sid, rid in zip(proposer.last_rows, self.rows) if sid is not None})
        return seen


def _bijective(seen: list[dict[int, str]]) -> dict[int, str]:
    sid_to_req: dict[int, str] = {}
    req_to_sid: dict[str, int] = {}
    for call in seen:
        for sid, rid in call.items():
            assert sid_to_req.setdefault(sid, rid) == rid, f"stream {sid} served two requests"
            assert req_to_sid.setdefault(rid, sid) == sid, f"request {rid} moved to another stream"
    return sid_to_req


def _prompt(seed: int, n: int = 12) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, V, n)]


def test_read_verification_tells_acceptance_rejection_cut_and_disagreement():
    assert read_verification([5, 6, 7], [5, 6, 7, 8]) == read_verification([5, 6, 7], [5, 6, 7, 8])
    assert read_verification([5, 6, 7], [5, 6, 7, 8]).accepted == 3
    v = read_verification([5, 6, 7], [5, 9])  # second draft rejected, 9 emitted instead
    assert (v.accepted, v.verified, v.consistent) == (1, 3, True)
    v = read_verification([5, 6, 7], [5, 6])  # bonus equals the next draft: the scheduler cut at 1
    assert (v.accepted, v.verified, v.consistent) == (1, 1, True)
    assert not read_verification([5, 6], [4, 6, 1]).consistent
    assert not read_verification([], [1, 2]).consistent
    assert read_verification([], [3]) .consistent


def test_mapping_follows_requests_through_condense_reorder_prefill_and_cuts():
    sim = BatchSim(width=3, prefill_chunks=2, cut_every=5, swap_every=3)
    for j in range(8):
        target = periodic(3 + j % 4) if j % 3 else scrambled
        sim.submit(f"r{j}", _prompt(j), target, max_new=20 + 7 * j)
    prop = BatchProposer(BatchProposerConfig(drafters=("prompt-lookup", "suffix"), k=4, idle_steps=3))
    seen = sim.run(prop)
    assert not sim.rows and not sim.waiting
    mapping = _bijective(seen)
    assert sorted(mapping.values()) == [f"r{j}" for j in range(8)]
    assert prop.stats.requests == 8 and prop.stats.inconsistent == 0
    assert prop.stats.cut > 0  # the scheduler cuts were recognised, not counted as rejections
    moved = sum(1 for a, b in zip(seen, seen[1:]) for sid in a if sid in b and
                list(a).index(sid) != list(b).index(sid))
    assert moved > 0  # the batch really was reordered / condensed under the proposer
    totals = prop.stats.drafters
    assert sum(t.accepted for t in totals.values()) > 0


def test_identical_prompts_are_told_apart_by_their_drafts():
    tracker = RowTracker(lambda sid, ctx: sid, idle_steps=2)
    toks = np.zeros((2, 16), dtype=np.int32)
    toks[:, :4] = [1, 2, 3, 4]
    n = np.array([4, 4], dtype=np.int32)
    matches, _ = tracker.assign([[4], [4]], n, toks)
    a, b = matches[0].stream, matches[1].stream
    a.drafts, b.drafts = [8, 7], [8, 8]  # same context, different drafts (e.g. sampling)
    # rows swapped: row 0 now holds b (both drafts accepted, 9 added), row 1 holds a (7 rejected)
    toks[0, 4:7] = [8, 8, 9]
    toks[1, 4:6] = [8, 5]
    n[:] = [7, 6]
    matches, _ = tracker.assign([[8, 8, 9], [8, 5]], n, toks)
    assert matches[0].stream is b and matches[0].outcome.accepted == 2
    assert matches[1].stream is a and matches[1].outcome.accepted == 1 and matches[1].outcome.consistent


def test_selection_learns_across_requests_and_drafts_zero_when_told():
    sim = BatchSim(width=4)
    for j in range(6):
        sim.submit(f"r{j}", _prompt(j), periodic(4), max_new=40)
    cfg = BatchProposerConfig(drafters=("none", "prompt-lookup"), selector="ucbspec", k=4)
    prop = BatchProposer(cfg)
    sim.run(prop)
    t = prop.stats.drafters
    assert t["none"].drafted == 0 and t["none"].rounds > 0
    assert t["prompt-lookup"].rounds > 2 * t["none"].rounds  # learnt: the copy drafter wins
    assert t["prompt-lookup"].accepted / t["prompt-lookup"].drafted > 0.8

    prop = BatchProposer(BatchProposerConfig(drafters=("prompt-lookup",), length="ucbspec-length:L=3", k=4))
    sim = BatchSim(width=2)
    sim.submit("a", _prompt(1), periodic(2), max_new=10)
    sim.submit("b", _prompt(2), periodic(2), max_new=10)
    first = prop.propose(sim.step(), sim.num_tokens, sim.token_ids)
    assert first == [[], []]  # UCBSpec over lengths starts with length 0: plain decoding


def test_per_request_learners_and_shared_ones():
    prop = BatchProposer(BatchProposerConfig(drafters=("none", "prompt-lookup"), selector="exp3spec:scope=request"))
    sim = BatchSim(width=2)
    sim.submit("a", _prompt(1), periodic(3), max_new=12)
    sim.submit("b", _prompt(2), periodic(3), max_new=12)
    sim.step()
    prop.propose([[1], [2]], sim.num_tokens, sim.token_ids)
    a, b = (st.payload.parts for st in prop.tracker.streams.values())
    assert a.selector is not b.selector and a.selector is not prop.selector
    assert a.drafters[1] is not b.drafters[1]  # each request its own n-gram index
    shared = BatchProposer(BatchProposerConfig(selector="ucbspec"))
    assert shared.selector.scope == "global"
    assert with_scope("ucbspec:L=4", "global") == "ucbspec:L=4,scope=global"
    assert with_scope("ucbspec:scope=request", "global") == "ucbspec:scope=request"


def test_suffix_datastore_learns_finished_requests():
    prop = BatchProposer(BatchProposerConfig(drafters=("suffix:learn=true",), k=4, idle_steps=1))
    sim = BatchSim(width=1)
    sim.submit("a", _prompt(5), scrambled, max_new=30)
    sim.run(prop)
    for _ in range(3):  # the request is gone: after idle_steps empty calls it is finished
        prop.propose([], sim.num_tokens, sim.token_ids)
    assert prop.stats.finished == 1
    store = prop.prototypes[0].datastore
    assert store is not None and len(store) == 30  # the output, shared with every later request


def test_settings_errors_name_the_fix():
    with pytest.raises(ConfigError, match="not model-free"):
        BatchProposer(BatchProposerConfig(drafters=("model:smollm2",)))
    with pytest.raises(ConfigError, match="scope=request"):
        BatchProposer(BatchProposerConfig(selector="exp3spec"))
    with pytest.raises(ConfigError, match="allowed are"):
        BatchProposerConfig.from_dict({"drafter": ["suffix"]})
    with pytest.raises(ConfigError, match="draft length k"):
        BatchProposerConfig(k=0)
    with pytest.raises(ConfigError, match="rows of sampled tokens"):
        BatchProposer(BatchProposerConfig()).propose([[1], [2]], np.array([1]), np.zeros((1, 4), np.int32))


def _vllm_config(k: int, extra: dict | None):
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           model_config=SimpleNamespace(max_model_len=512, model="m", tokenizer=None),
                           additional_config=extra)


def test_vllm_arguments_round_trip_through_the_proposer_settings(tmp_path):
    cfg = BatchProposerConfig(drafters=("prompt-lookup:max_ngram=4", "suffix"), selector="round-robin",
                              k=3, stats_file=str(tmp_path / "s.json"), stats_every=1)
    spec = speculative_config(cfg.k)
    assert spec == {"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": 3}
    extra = json.loads(json.dumps(additional_config(cfg)))
    back = config_from_vllm(_vllm_config(3, extra))
    assert back == BatchProposerConfig(**{**cfg.to_dict(), "drafters": cfg.drafters, "max_model_len": 512})
    args = serve_command("/models/smol", cfg)
    assert args[:3] == ["vllm", "serve", "/models/smol"] and args[args.index("--host") + 1] == "127.0.0.1"
    assert json.loads(args[args.index("--speculative-config") + 1]) == spec
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        config_from_vllm(_vllm_config(3, {"adaspec": {"k": 5}}))
    with pytest.raises(ConfigError, match="num_speculative_tokens >= 1"):
        config_from_vllm(_vllm_config(None, None))
    prop = BatchProposer(back)
    prop.propose([[3]], np.array([5]), np.array([[1, 2, 1, 2, 3]], dtype=np.int32))
    written = json.loads((tmp_path / "s.json").read_text())
    assert written["stats"]["calls"] == 1 and written["config"]["selector"] == "round-robin"


def test_cli_prints_the_serve_command_and_refuses_model_drafters():
    from typer.testing import CliRunner

    from adaspec.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["vllm-args", "/models/smol", "-d", "prompt-lookup", "-d", "none",
                              "--selector", "round-robin", "--k", "3", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["speculative_config"]["num_speculative_tokens"] == 3
    assert out["additional_config"]["adaspec"] == {"drafters": ["prompt-lookup", "none"],
                                                   "selector": "round-robin"}
    assert out["command"][:3] == ["vllm", "serve", "/models/smol"]
    res = runner.invoke(app, ["vllm-args", "/models/smol", "--module"])
    assert res.exit_code == 0 and "vllm.entrypoints.openai.api_server --model /models/smol" in res.output
    res = runner.invoke(app, ["vllm-args", "/models/smol", "-d", "self"])
    assert res.exit_code == 2 and "not model-free" in res.output
