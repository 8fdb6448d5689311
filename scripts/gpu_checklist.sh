#!/usr/bin/env bash
# The GPU checklist in one call of a lent CUDA machine (see docs/benchmarks.md, "GPU"): the compiled
# Triton kernels and the CUDA-graph engine against their references, the nano-vllm workload with and
# without CUDA graphs (rooflines and a profile included), and one served chat on the GPU.
#
# Run from the repository root on a machine with torch and triton but no network: the Python packages
# the image lacks come as cp312 manylinux wheels in .whl/ (on the lent H200 image: fastapi, starlette,
# uvicorn, pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions, gguf,
# llguidance, opentelemetry-api), the prebuilt CPU kernels in nanoserve/kernels/. Each step has its
# own time limit, so one that hangs costs only its own budget; every log lands in $OUT (default
# ./gpu-out). Arguments name the steps to run (default: all of tests graphs eager serve).
set -u
steps=" ${*:-tests graphs eager serve} "
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NANOSERVE_CACHE=/tmp/nanoserve-cache
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:.
  # nanoserve itself runs from the checkout; its metadata (serve logs the version) goes beside the wheels.
  meta=/tmp/site/nanoserve-0+checkout.dist-info
  mkdir -p $meta && printf 'Metadata-Version: 2.1\nName: nanoserve\nVersion: 0+checkout\n' >$meta/METADATA
else
  export PYTHONPATH=.
fi
ns=(python3 -c 'import sys; from nanoserve.cli import main; sys.exit(main())')
last=0
step() {  # step NAME SECONDS COMMAND...: run it with a limit, log to $OUT/NAME.log, say how it ended
  local name=$1 limit=$2; shift 2
  [[ $steps == *" $name "* ]] || return 0
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  last=$?
  echo "== $name: exit $last in $((SECONDS - t0)) s"
}

{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
      "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
  lscpu | grep -E "Model name|^CPU\(s\)"; } 2>&1 | tee "$OUT/env.log"

step tests 150 python3 -m pytest -p no:cacheprovider -rs \
  tests/attention/test_triton_attention.py tests/engine/test_cuda_graph.py tests/engine/test_engine.py \
  -m "not slow"
tail -1 "$OUT/tests.log"

workload=(bench throughput --model-shape qwen3-0.6b --device cuda --dtype bfloat16 --num-prompts 256
          --input-len-range 100 1024 --output-len-range 100 1024 --max-num-seqs 256)
step graphs 240 "${ns[@]}" "${workload[@]}" --profile-steps 50 --json "$OUT/graphs.json"
# Without CUDA graphs; should the graphed run have failed, on torch's attention too (the Triton kernels
# are then the first suspect).
backend=auto; [ "$last" = 0 ] || backend=torch
step eager 180 "${ns[@]}" "${workload[@]}" --enforce-eager --attention-backend $backend --no-roofline \
  --json "$OUT/eager.json"

step serve 60 python3 scripts/gpu_serve_smoke.py

for name in graphs eager; do echo "--- $name"; grep -E -A4 "^run +requests/s|^roofline|^weights read|^run +prefill" "$OUT/$name.log"; done
grep -E "^[0-9]{3} |SSE" "$OUT/serve.log"
