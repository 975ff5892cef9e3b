#!/usr/bin/env bash
# Issue 15's GPU checks with mlx[cuda13], on a random-weight model of a real shape: one agent through the
# engine against mlx-lm's generate_step (bench_single_stream), where a decode step's time goes at batch 1, 4
# and 16 (bench_step_profile), and against mlx_lm.server the throughput workload (bench_vs_mlx_lm_server)
# and warm turns as the context grows (bench_context_sweep); and the sampler's filters (bench_sampling).
#
#   bench/device/run_speed.sh [--shape llama-3.2-1b] [--out DIR] [--wheels DIR] [--tokenizer DIR] [--system]
#                             [--only "bench_sampling bench_step_profile ..."]
#
# Options as in run_cuda.sh; --only runs the named benchmarks alone, in the order above. Each benchmark
# writes OUT/<name>.json; their output goes to OUT/speed.log. A
# benchmark that fails does not stop the others; the script exits non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/../.."

shape=llama-3.2-1b; out=""; wheels=""; tokenizer=""; system=0
only="bench_sampling bench_single_stream bench_step_profile bench_vs_mlx_lm_server bench_context_sweep"
while [ $# -gt 0 ]; do
  case "$1" in
    --shape) shape=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --wheels) wheels=$2; shift 2 ;;
    --tokenizer) tokenizer=$2; shift 2 ;;
    --system) system=1; shift ;;
    --only) only=$2; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
out=${out:-bench/results/cuda-speed-$shape-$(date +%Y%m%d-%H%M%S)}
work=${TMPDIR:-/tmp}/semantic-cuda-bench
mkdir -p "$out"
set -e
source bench/device/prepare_cuda.sh
set +e

export PYTHONUNBUFFERED=1
failed=0
run() {  # run NAME ARGS...: one benchmark (if --only names it), its JSON in OUT, its output in OUT/speed.log
  local name=$1; shift
  case " $only " in *" $name "*) ;; *) return 0 ;; esac
  echo "# ===== $name $* ($(date +%T))" | tee -a "$out/speed.log"
  "$python" -m "bench.$name" --model "$model" --json "$out/$name.json" "$@" 2>&1 | tee -a "$out/speed.log"
  local code=${PIPESTATUS[0]}
  echo "# ===== $name: exit $code ($(date +%T))" | tee -a "$out/speed.log"
  [ "$code" = 0 ] || failed=1
}
case "$out" in /*) ;; *) out=$PWD/$out ;; esac
# A bigger pool than the CPU default: a GPU holds many agents of a 1B-8B model.
run bench_sampling
run bench_single_stream --pool-mb 8192 --repeats 8
run bench_step_profile --pool-mb 8192
run bench_vs_mlx_lm_server --pool-mb 8192 --workloads throughput
run bench_context_sweep --pool-mb 8192
exit $failed
