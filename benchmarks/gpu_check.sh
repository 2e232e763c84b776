#!/usr/bin/env bash
# One device call: versions, the whole test suite on the GPU (CPU-sized tests run there too),
# then a launch-configuration sweep of the main case. Logs go to $OUT when it is set.
set -o pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MSA_CODEGEN_HOME=${MSA_CODEGEN_HOME:-/tmp/msa_home}
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout ${TEST_TIMEOUT:-400} python3 -m pytest tests -q -n 8 -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee $OUT/pytest.log | tail -40
if [ -n "${SWEEP:-1}" ]; then
  timeout ${SWEEP_TIMEOUT:-150} python3 benchmarks/sweep.py --rep 100 ${SWEEP_ARGS:-} 2>&1 | tee $OUT/sweep.log
fi
