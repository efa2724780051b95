"""scripts/tree_replay.py: live verify ratios over the grid a replay prices on (issue 18)."""
import csv
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from adaspec.costs import EngineOverheads, VerifyCostSurface

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tree_replay.py"
spec = importlib.util.spec_from_file_location("tree_replay", SCRIPT)
replay = importlib.util.module_from_spec(spec)
sys.modules.setdefault("tree_replay", replay)  # its dataclasses look their module up
spec.loader.exec_module(replay)


def flat(step: float) -> VerifyCostSurface:
    """Every width and cache length costs ``step`` seconds."""
    return VerifyCostSurface([0, 4096], [1, 16], [[step, step], [step, step]], [0.0, 0.0])


def rounds_csv(path: Path, verify_s: dict[int, float], n: int = 5) -> str:
    """``n`` rounds of each width (drafted + 1), each verified in ``verify_s[width]`` seconds."""
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, ["config", "prompt_id", "turn", "round", "drafted", "emitted", "verify_s"])
        w.writeheader()
        r = 0
        for width, secs in verify_s.items():
            for _ in range(n):
                w.writerow({"config": "c", "prompt_id": "p", "turn": 0, "round": r, "drafted": width - 1,
                            "emitted": 1, "verify_s": secs})
                r += 1
    return str(path)


def test_live_ratios_are_over_the_surface_the_replay_prices_on(tmp_path):
    trace = SimpleNamespace(prompts=[SimpleNamespace(meta={"id": "p", "turn": 0}, prompt=[1, 2, 3])],
                            surface=flat(0.010), overheads=EngineOverheads(round_s=0.001, request_s=0.002))
    path = rounds_csv(tmp_path / "rounds.csv", {1: 0.020, 6: 0.030})
    own = replay.live_ratios(trace, path)  # over the trace's own grid
    assert own.verify_widths == [1, 6] and own.verify_ratios == pytest.approx([2.0, 3.0])
    other = replay.live_ratios(trace, path, flat(0.020))  # over a grid measured beside the run
    assert other.verify_ratios == pytest.approx([1.0, 1.5])
    assert (other.round_s, other.request_s) == (0.001, 0.002)  # the trace's overheads are kept
    # too few rounds of a width: no ratio for it
    assert replay.live_ratios(trace, rounds_csv(tmp_path / "few.csv", {1: 0.02}, n=2)).verify_widths == []


def test_live_ratios_need_a_trace(tmp_path):
    rec = tmp_path / "ar.json"
    rec.write_text('{"vocab": 8, "eos": [0], "max_new_tokens": 4, "requests": []}')
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps(flat(0.01).to_dict()))
    with pytest.raises(SystemExit, match="needs a bench trace"):
        replay.load_workload(str(rec), str(grid), rounds_csv=str(tmp_path / "rounds.csv"))
    work = replay.load_workload(str(rec), str(grid))
    assert work.priced.cost(1, 10) == pytest.approx(0.01)


def test_the_oracle_pays_each_verify_step_on_the_engines_clock():
    """The replayed engine's timer runs on by each verify forward's price (width, cache length),
    not by the prefill, so its cost model learns the live/grid ratio as a live engine does."""
    from adaspec.trees import DraftTree

    priced = VerifyCostSurface([0, 4096], [1, 16], [[0.1, 0.25], [0.1, 0.25]], [0.0, 0.0])
    target = replay.OracleTarget(vocab=8, eos=[7], priced=priced)
    target.seq = [1, 2, 3, 4, 5, 6]
    state = target.new_state()
    target.forward(state, [1, 2, 3])  # the prefill
    assert target.elapsed == 0.0
    target.forward(state, [4, 5], keep=2)
    assert target.elapsed == pytest.approx(priced.cost(2, 3))
    before = target.elapsed
    target.forward_tree(state, 6, DraftTree(tokens=[1, 2, 3], parents=[-1, -1, 0]))
    assert target.elapsed - before == pytest.approx(priced.cost(4, 5))
    t0 = target.clock()
    target.elapsed += 2.0
    assert target.clock() - t0 >= 2.0
