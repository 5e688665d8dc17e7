#!/usr/bin/env bash
# The scaling run of BENCHMARKS.md: benchmarks/step.py on 1, 2 and 4 (or 8)
# GPUs of one host for one model, logs and JSON under $OUT (default ./bench).
#   bash benchmarks/scaling.sh gpt 4        # GPT-2-small shape, 1, 2 and 4 GPUs
#   bash benchmarks/scaling.sh llama 4      # Llama-3.2-1B shape
# The 1- and 2-GPU runs share the host (GPU 0, and GPUs 2-3) and run at the
# same time; the largest run has the host to itself and records a profile.
set -euo pipefail
model=${1:-gpt}
max=${2:-4}
out=${OUT:-bench}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
run() {  # run <gpus> <visible devices> <port> [extra args]
  local n=$1 vis=$2 port=$3
  shift 3
  CUDA_VISIBLE_DEVICES=$vis ${PYTHON:-python3} -m torch.distributed.run --nproc_per_node="$n" --master_port="$port" benchmarks/step.py \
    --model "$model" --out "$out/${model}_${n}gpu.json" "$@" > "$out/${model}_${n}gpu.log" 2>&1
}
run 1 0 29601 &
p1=$!
run 2 2,3 29602 &
p2=$!
wait $p1 $p2
all=$(seq -s, 0 $((max - 1)))
run "$max" "$all" 29603 --profile "$out/profile_${model}_${max}gpu"
for n in 1 2 "$max"; do
  grep -v Warning "$out/${model}_${n}gpu.log" | grep -A12 "^$model L=" || tail -20 "$out/${model}_${n}gpu.log"
done
