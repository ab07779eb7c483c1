#!/usr/bin/env bash
# The GPU checks in one command: tests/gpu, then benchmarks/gpu.py. Logs and tables go to $OUT
# (or ./gpu-check-out). On a machine with dask-train installed it uses that; on a bare GPU image
# with torch, transformers and accelerate but no network, first put wheels of dask, distributed,
# what they need that the image lacks, datasets, and dask-train itself (`pip wheel --no-deps .`)
# in .whl/: they are installed into /tmp/site. Settings: TESTS (default tests/gpu), TEST_S and
# BENCH_S (time limits; BENCH_S=0 skips the benchmark), SECONDS_EACH (per benchmark runner).
set -o pipefail
out=${OUT:-gpu-check-out}; mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit
    export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, dask, transformers, accelerate; print('torch', torch.__version__, 'dask', dask.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'nccl', torch.cuda.nccl.version())"
timeout "${TEST_S:-300}" python3 -m pytest ${TESTS:-tests/gpu} -q -p no:cacheprovider --timeout 240 \
    --durations=0 2>&1 | tee "$out/gpu-tests.log"
[ "${BENCH_S:-200}" = 0 ] || timeout "${BENCH_S:-200}" python3 benchmarks/gpu.py --seconds "${SECONDS_EACH:-20}" 2>&1 \
    | tee "$out/gpu-bench.log"
cp benchmarks/results/gpu.md benchmarks/results/gpu.json "$out/" 2>/dev/null
true
