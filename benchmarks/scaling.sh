#!/usr/bin/env bash
# The scaling run of BENCHMARKS.md: benchmarks/step.py on 1, 2, 4 (and 8)
# GPUs of one host for one model, logs, JSON and profiles under $OUT
# (default ./bench). Every run profiles one step per mode.
#   bash benchmarks/scaling.sh gpt 4          # GPT-2-small shape, 1, 2 and 4 GPUs
#   bash benchmarks/scaling.sh llama 8        # Llama-3.2-1B shape, 1, 2, 4 and 8 GPUs
#   bash benchmarks/scaling.sh gpt 8 small    # only the runs below 8 GPUs
#   bash benchmarks/scaling.sh gpt 8 large    # only the 8-GPU run
#   STEP_ARGS="--bucket-mb 64" bash benchmarks/scaling.sh gpt 4   # extra step.py options
# The runs below the largest size share the host on disjoint GPUs (1: GPU 0,
# 2: GPUs 2-3, 4: GPUs 4-7 when the host has 8) and run at the same time;
# the largest run has the host to itself.
set -euo pipefail
model=${1:-gpt}
max=${2:-4}
phase=${3:-all}
out=${OUT:-bench}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
run() {  # run <gpus> <visible devices> <port>
  local n=$1 vis=$2 port=$3
  CUDA_VISIBLE_DEVICES=$vis ${PYTHON:-python3} -m torch.distributed.run --nproc_per_node="$n" --master_port="$port" \
    benchmarks/step.py --model "$model" --out "$out/${model}_${n}gpu.json" --profile "$out/profile_${model}_${n}gpu" ${STEP_ARGS:-} \
    > "$out/${model}_${n}gpu.log" 2>&1
}
sizes=()
if [[ $phase != large ]]; then
  pids=()
  run 1 0 29601 & pids+=($!); sizes+=(1)
  run 2 2,3 29602 & pids+=($!); sizes+=(2)
  if (( max == 8 )); then run 4 4,5,6,7 29604 & pids+=($!); sizes+=(4); fi
  wait "${pids[@]}"
fi
if [[ $phase != small ]]; then
  run "$max" "$(seq -s, 0 $((max - 1)))" 29603
  sizes+=("$max")
fi
for n in "${sizes[@]}"; do
  grep -v Warning "$out/${model}_${n}gpu.log" | grep -A60 "^$model L=" || tail -30 "$out/${model}_${n}gpu.log"
done
