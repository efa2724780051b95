"""Prefill time of multi-turn chats on llama.cpp with the prefix cache on and off (the
``LlamaCppTarget.prefix_cache`` that ``adaspec serve`` turns on): each conversation of the
built-in conversation suite (two user turns) plus ``--extra-turns`` follow-ups, greedy, the
two modes alternating conversation by conversation in one process.

    python scripts/prefix_cache_chat.py                      # SmolLM2's GGUF, 8 conversations
    python scripts/prefix_cache_chat.py -m ~/.cache/adaspec/smollm2-Q4_0.gguf --conversations 16

Prints, per turn, the median prompt length, tokens reused and prefill milliseconds of each mode,
and how many answers were identical in the two modes (the reused KV was computed in other
batches than a fresh prefill's, so an answer can part at a numeric near-tie, and the later turns
of that conversation then have other prompts).
"""

from __future__ import annotations

import argparse
import statistics
import time

from adaspec import SpeculativeEngine
from adaspec.bench.workloads import load_workload
from adaspec.config import GenerationConfig
from adaspec.exactness import divergence_gap

FOLLOW_UPS = ("Summarize your answers so far in one sentence.", "Thank you. Is there anything you would add?")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--extra-turns", type=int, default=2, choices=range(len(FOLLOW_UPS) + 1))
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64)
    args = ap.parse_args()

    engine = SpeculativeEngine.from_pretrained(args.model, backend="llama.cpp")
    target = engine.target
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    chats = load_workload("conversation")[: args.conversations]
    engine.generate(chats[0].text, cfg)  # warm-up (and the cost surface, if not cached)
    rows: dict[tuple[bool, int], list[tuple[int, int, float]]] = {}
    answers: dict[tuple[bool, int], list[list[int]]] = {}
    prompts: dict[tuple[bool, int], list[list[int]]] = {}
    t0 = time.perf_counter()
    for j, chat in enumerate(chats):
        for on in ((True, False) if j % 2 == 0 else (False, True)):
            target.prefix_cache = on
            messages: list[dict[str, str]] = []
            for t, text in enumerate([*chat.turns, *FOLLOW_UPS[: args.extra_turns]]):
                messages.append({"role": "user", "content": text})
                r = engine.generate(messages, cfg)
                s = r.stats
                rows.setdefault((on, t), []).append((s.prompt_tokens, s.cached_prompt_tokens, s.prefill_s))
                answers.setdefault((on, t), []).append(list(r.token_ids))
                prompts.setdefault((on, t), []).append(list(r.prompt_ids))
                messages.append({"role": "assistant", "content": r.text})
        print(f"conversation {j + 1}/{len(chats)} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\n{target.name}, llama.cpp, {target.threads} threads, {len(chats)} conversations, "
          f"{args.max_new_tokens} new tokens a turn (medians)")
    print("| turn | prompt tokens | reused (cache on) | prefill ms, cache off | prefill ms, cache on | off / on "
          "| answers identical |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    turns = sorted({t for _, t in rows})
    for t in turns:
        on, off = rows[(True, t)], rows[(False, t)]
        p_on = statistics.median(x[2] for x in on) * 1e3
        p_off = statistics.median(x[2] for x in off) * 1e3
        print(f"| {t + 1} | {statistics.median(x[0] for x in on):.0f} | {statistics.median(x[1] for x in on):.0f} "
              f"| {p_off:.1f} | {p_on:.1f} | {p_off / p_on:.2f}x "
              f"| {sum(a == b for a, b in zip(answers[(True, t)], answers[(False, t)]))}/{len(on)} |")
    total_on = sum(x[2] for t in turns for x in rows[(True, t)])
    total_off = sum(x[2] for t in turns for x in rows[(False, t)])
    print(f"\nprefill total: {total_off:.2f} s off, {total_on:.2f} s on ({total_off / total_on:.2f}x)")
    # where both modes had the same prompt and parted, the margin plain decoding saw there
    target.prefix_cache = False
    gaps = []
    for t in turns:
        for p_on, p_off, a_on, a_off in zip(prompts[(True, t)], prompts[(False, t)], answers[(True, t)],
                                            answers[(False, t)]):
            if p_on == p_off and a_on != a_off:
                gaps.append((t + 1, *divergence_gap(target, p_off, a_off, a_on)))
    print(f"answers that parted on the same prompt: {len(gaps)}; (turn, token, margin in nats): "
          + ", ".join(f"({t}, {at}, {'-' if g is None else format(g, '.3f')})" for t, at, g in gaps)
          + f"; {target.name}'s near-tie bound: {target.near_tie_nats} nats")


if __name__ == "__main__":
    main()
