#!/usr/bin/env bash
# The GPU figures of the performance and GPU-tuning pages, on one CUDA GPU (world size 1).
#   bash tools/gpu_session.sh STAGE... [-o OUTDIR]
# Stages: tests (make test-gpu), l1b (llama-1b, mfsdp against FSDP2 and upstream), l1b-4096,
# l3b (the 3B shape with recompute), profile (torch.profiler table of mfsdp ZeRO-3), train
# (mfsdp train, the llama3-8b preset cut to 6 layers, 50 iterations on mock data and on an
# indexed dataset). Needs a python3 with CUDA PyTorch, jinja2, tqdm, safetensors and pytest;
# upstream's megatron_fsdp as a wheel in .whl/ (pip download --no-deps megatron_fsdp==0.6.1 -d .whl).
set -uo pipefail
out=${OUT:-build/gpu}; stages=()
while (($#)); do if [[ $1 == -o ]]; then out=$2; shift 2; else stages+=("$1"); shift; fi; done
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" | tee -a "$out/gpu.txt"
B="python3 -m mfsdp.cli bench --device cuda --world-sizes 1 --bf16 --warmup 3 --rounds 10"
FAST="--compile --fused-adam"
Z3=mfsdp-optim_grads_params
bench() { echo "== mfsdp bench ${*#--device cuda}" | tee -a "$out/bench.txt"
          $B "$@" 2>&1 | grep -v '^\[bench\]' | tee -a "$out/bench.txt"; }
for stage in "${stages[@]}"; do case $stage in
  probe)  # the one test that failed on the first run, verbose
    timeout 200 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -x -k two_ranks 2>&1 | tail -40 ;;
  tests)
    timeout 420 python3 -m pytest -m gpu tests/gpu -rs -q -p no:cacheprovider 2>&1 | tee "$out/test-gpu.txt" | tail -30 ;;
  l1b)
    bench --model llama-1b --seq-length 2048 --micro-batch-size 4 --systems $Z3 fsdp2 $FAST --json "$out/l1b-2048.json"
    bench --model llama-1b --seq-length 2048 --micro-batch-size 4 --systems $Z3 megatron_fsdp $FAST --no-memory ;;
  l1b-4096)
    bench --model llama-1b --seq-length 4096 --micro-batch-size 2 --systems $Z3 fsdp2 $FAST --no-memory
    bench --model llama-1b --seq-length 4096 --micro-batch-size 4 --systems $Z3 $FAST --json "$out/l1b-4096-mb4.json" ;;
  l3b)
    for s in $Z3 fsdp2; do
      bench --model llama-3b --recompute --seq-length 4096 --micro-batch-size 4 --systems $s $FAST --json "$out/l3b-$s.json"
    done ;;
  profile)
    $B --model llama-1b --seq-length 2048 --micro-batch-size 4 $FAST --profile $Z3 > "$out/profile.txt" 2>&1
    tail -36 "$out/profile.txt" ;;
  train)
    python3 - "$out" <<'PY'
import numpy, sys
from mfsdp.data.indexed import IndexedDatasetBuilder
rng = numpy.random.default_rng(0)  # Zipf-distributed token ids, documents of 200 to 8,000 tokens
b = IndexedDatasetBuilder("/tmp/gpudata_text_document.bin", numpy.int32)
n = 0
while n < 1_200_000:
    doc = numpy.minimum(rng.zipf(1.2, rng.integers(200, 8000)), 128000) .tolist() + [0]
    b.add_document(doc); n += len(doc)
b.finalize("/tmp/gpudata_text_document.idx")
print(f"indexed dataset: {n:,} tokens")
PY
    T="torchrun --standalone --nproc-per-node 1 -m mfsdp.train --use-megatron-fsdp --model-preset llama3-8b --num-layers 6 --bf16 --seq-length 8192 --micro-batch-size 1 --global-batch-size 1 --train-iters 50 --log-interval 10 --log-throughput --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 5"
    echo "== $T --mock-data" | tee -a "$out/train.txt"
    $T --mock-data 2>&1 | grep -v Warning | tee -a "$out/train.txt" | tail -8
    echo "== $T --data-path /tmp/gpudata_text_document --split 100,0,0" | tee -a "$out/train.txt"
    $T --data-path /tmp/gpudata_text_document --split 100,0,0 --tokenizer-type NullTokenizer --vocab-size 128256 --eval-iters 0 2>&1 | grep -v Warning | tee -a "$out/train.txt" | tail -8 ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac; done
