#!/bin/bash
# One prepared calibration of a lent H200 (the device tool; 15 minutes a session, all tries).
#
# Here, once, in the repo root (the H200 image has torch, numpy, networkx, matplotlib, pyyaml
# and rich, but not simpy, and nothing can be downloaded there):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 -d .whl simpy==4.1.2
# Then through the device tool: run, carry [".whl"], timeout_s 540, command
#   bash calibration/device/calibrate-h200.sh
# and copy what comes back from $OUT (h200.json, h200.csv, h200-fit.png, the logs) to
# calibration/. DEVICE=cpu runs the same steps on this CPU (--quick), to try the script here.
set -euo pipefail
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-/tmp/zsim-h200}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/zsim-site .whl/*.whl
    export PYTHONPATH=/tmp/zsim-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
{ date -u; uname -a; nvidia-smi || true; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } \
    > "$OUT/machine.txt" 2>&1
if [ "$DEVICE" = cuda ]; then
    # 1 GPU: no collectives (a one-rank group moves nothing); compute, HBM, host link and Adam
    # at the shapes of a 1.3B GPT and a 7B LLaMA layer (bf16, micro-batches 1, 2, 4), attention
    # fused as training on an H200 runs it (`zsim run --flash-attention` uses these layers)
    args=(--device cuda --nproc 1 --model gpt-1.3b:layers=2 --model llama-7b:layers=1
          --micro-batches 1,2,4 --flash-attention --name h200)
else
    args=(--device cpu --nproc 2 --quick --model toy-mlp:hidden=256 --name cpu-try)
fi
name=$([ "$DEVICE" = cuda ] && echo h200 || echo cpu-try)
timeout 480 python3 -c 'import sys; from zsim.cli import main; sys.exit(main())' \
    calibrate "${args[@]}" --no-progress --out "$OUT/$name.json" 2>&1 | tee "$OUT/calibrate.log"
