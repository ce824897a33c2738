#!/usr/bin/env bash
# The device side of scripts/gpu/stage: `scripts/gpu/device.sh N` in call N (1-4),
# with .dev/gpu/cN carried. Assembles /tmp/site (kept while the machine is
# warm), then in the last call runs the smoke test and the benchmark:
# mlxbcd (warm daemon, through the socket) and mlx-lm (in process) on the same
# SmolLM2 weights, prefill at 512 tokens and decode over 256.
set -u
step=$1
PY=/opt/torch/.venv/bin/python3
SP=$($PY -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=$(ls -d "$SP"/nvidia/*/lib 2>/dev/null | tr '\n' ':')${LD_LIBRARY_PATH:-}
[[ -d /usr/local/cuda ]] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p /tmp/stage /tmp/site
cp -r ".dev/gpu/c$step/." /tmp/stage/
case $step in
1)
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/stage/*.whl
  tar -C /tmp/site -xJf /tmp/stage/inc_libs.tar.xz
  tar -C /tmp/site -xJf /tmp/stage/bin.tar.xz
  ln -sfn "$SP/nvidia" /tmp/site/nvidia
  ls /tmp/site; echo STEP1_DONE ;;
2)
  mkdir -p /tmp/site/mlx/lib
  cat /tmp/stage/libmlx.so.xz.part0 /tmp/stage/libmlx.so.xz.part1 | xz -dc > /tmp/site/mlx/lib/libmlx.so
  echo "libmlx.so md5 $(md5sum < /tmp/site/mlx/lib/libmlx.so | cut -c1-32), expected $(sed -n 1p /tmp/stage/md5s.txt)"
  ldd /tmp/site/mlx/lib/libmlx.so | grep "not found"
  cd /tmp/site && $PY -c "import mlx.core as mx; print('python mlx default device', mx.default_device())"
  echo STEP2_DONE ;;
3)
  echo STEP3_DONE ;;
4)
  mkdir -p /tmp/models
  cat /tmp/stage/gguf.part0 /tmp/stage/gguf.part1 /tmp/stage/gguf.part2 > /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "gguf md5 $(md5sum < /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf | cut -c1-32), expected $(sed -n 2p /tmp/stage/md5s.txt)"
  repo=$PWD; cd /tmp/site
  export MLXBC_HOME=/tmp/mlxbc-home; mkdir -p $MLXBC_HOME/models
  ln -sf /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf $MLXBC_HOME/models/
  echo "=== smoke: mlxbc ask (starts mlxbcd)"
  timeout 120 ./mlxbc ask -v -n 24 "What is the capital of France?" 2>&1 | tee $OUT/smoke.txt
  ./mlxbc status 2>&1 | tee -a $OUT/smoke.txt; ./mlxbc stop
  tail -20 $MLXBC_HOME/logs/mlxbcd.log > $OUT/daemon.log 2>/dev/null
  echo "=== mlxbcd bench (GGUF, 512 prompt, 256 decode)"
  timeout 240 ./mlxbc-bench /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf 512 256 2>&1 | tee $OUT/mlxbcd-gguf.json
  echo "=== mlx-lm on the same weights (MLX dir made from the GGUF)"
  timeout 120 $PY $repo/scripts/reference/gguf_to_mlx.py /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/models/smollm2-mlx \
      --tokenizer-dir $repo/tests/fixtures/tokenizers/smollm2-135m-instruct 2>&1 | tail -2
  timeout 240 ./mlxbc-bench /tmp/models/smollm2-mlx 512 256 2>&1 | tee $OUT/mlxbcd-mlx.json
  timeout 240 $PY $repo/scripts/bench.d/mlx_lm_bench.py /tmp/models/smollm2-mlx 512 256 packed 2>&1 | tee $OUT/mlxlm-packed.json
  echo STEP4_DONE ;;
esac
