"""How far llama.cpp's batched verification moves logits from its own one-token decoding.

Speculative verification computes k positions in one forward; plain decoding computes one at a
time. On llama.cpp's CPU kernels these agree bit for bit while the KV cache holds at most 256
cells; past that, a single query takes flash attention's split-KV path (``nek1 >= 512`` in
``ggml_compute_forward_flash_attn_ext_f16``) and a batch does not, so the numbers differ. This
script decodes each prompt greedily one token at a time (as llama.cpp and adaspec's AR do),
then recomputes the same positions in verify blocks of ``--block`` tokens, and reports how
much the margin between the two best tokens moves (nats), below and above 256 cached tokens.
A greedy speculative output can only differ from plain decoding where the plain margin is
below that bound: the bench's near-tie threshold on llama.cpp (``NEAR_TIE_NATS_LLAMACPP``).

    python tools/llamacpp_numerics.py [--suite all] [--per-category 2] [-n 128] [--block 5] [--flash-attn on|off]

``--flash-attn``: the backend's flash attention (default: the backend's, off on a CPU). Without
it the non-flash attention kernels differ between a block and one token at every length.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from adaspec import SpeculativeEngine
from adaspec.bench.workloads import load_workload
from adaspec.exactness import NEAR_TIE_NATS_LLAMACPP
from adaspec.models import load_model


def margins(logits: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits.double(), -1)
    return lp.gather(1, first[:, None])[:, 0] - lp.gather(1, second[:, None])[:, 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--suite", default="all")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--block", type=int, default=5, help="verify block: the last token + block-1 drafts")
    ap.add_argument("--flash-attn", choices=["on", "off"], default=None,
                    help="llama.cpp's flash attention (default: the backend's, off on a CPU)")
    args = ap.parse_args()
    flash = None if args.flash_attn is None else args.flash_attn == "on"
    target = load_model(args.model, backend="llama.cpp", flash_attn=flash)
    print(f"flash attention: {target.flash_attn}")
    engine = SpeculativeEngine(target, [])
    work = load_workload(args.suite, per_category=args.per_category)
    moved: dict[str, list[float]] = {"<=256": [], ">256": []}
    flips = {"<=256": 0, ">256": 0}
    for i, p in enumerate(work):
        prompt = engine.encode_prompt(p.text)
        out = engine.generate(prompt, max_new_tokens=args.max_new_tokens).token_ids
        seq = prompt + out
        single, batched = [], []
        for rows, block in ((single, 1), (batched, args.block)):
            state = target.new_state()
            try:
                target.prefill(state, prompt)
                j = len(prompt) - 1  # the next input position
                while j < len(seq) - 1:
                    ids = seq[j:min(j + block, len(seq) - 1)]
                    rows.append(target.forward(state, ids, keep=len(ids))[0])
                    j += len(ids)
            finally:
                target.release(state)
        a, b = torch.cat(single), torch.cat(batched)
        top2 = torch.topk(a, 2, dim=-1).indices
        delta = (margins(a, top2[:, 0], top2[:, 1]) - margins(b, top2[:, 0], top2[:, 1])).abs()
        for pos, d in enumerate(delta.tolist()):
            key = "<=256" if len(prompt) + pos <= 256 else ">256"
            moved[key].append(d)
            flips[key] += int(a[pos].argmax() != b[pos].argmax())
        print(f"[{i + 1}/{len(work)}] {p.id}: prompt {len(prompt)} tokens, max margin move "
              f"{delta.max().item():.4f} nats", flush=True)
    print(f"\nmargin between the two best tokens, one-token decoding vs verify blocks of {args.block} "
          f"({len(work)} prompts x {args.max_new_tokens} tokens, {args.suite}):")
    for key, vals in moved.items():
        if not vals:
            continue
        v = np.array(vals)
        print(f"  cache {key:>5} tokens: {len(v):5d} positions, {np.mean(v > 0):6.1%} moved, "
              f"p50 {np.median(v):.4f}, p99 {np.quantile(v, 0.99):.4f}, max {v.max():.4f} nats; "
              f"argmax flips {flips[key]}")
    print(f"bench near-tie threshold on llama.cpp: {NEAR_TIE_NATS_LLAMACPP} nats")


if __name__ == "__main__":
    main()
