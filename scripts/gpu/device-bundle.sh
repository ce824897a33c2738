#!/usr/bin/env bash
# Device side of scripts/gpu/stage-bundle: `device-bundle.sh N` in call N (1-4).
# Installs the CUDA bundle as a user would (extract, point bin/nvidia at the
# machine's CUDA 13 libraries), then the smoke test and the benchmark:
# mlxbcd through the socket and mlx-lm in process on the same weights.
set -u
step=$1
PY=/opt/torch/.venv/bin/python3
SP=$($PY -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')
mkdir -p /tmp/stage; cp -r ".dev/gpub/c$step/." /tmp/stage/
case $step in
1|2) echo "STEP${step}_DONE" ;;
3)
  cat /tmp/stage/bundle.part0 /tmp/stage/bundle.part1 | tar -C /tmp -xzf -
  B=$(ls -d /tmp/mlxbc-*-cuda13); ln -sfn "$SP/nvidia" "$B/bin/nvidia"; cp /tmp/stage/mlxbc-bench "$B/bin/"
  echo "=== the launcher's check on a machine without LD_LIBRARY_PATH"; ldd "$B/bin/mlx/lib/libmlx.so" | grep -c "not found"
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/stage/*.whl
  mkdir -p /tmp/site/mlx/lib; ln -sf "$B/bin/mlx/lib/libmlx.so" /tmp/site/mlx/lib/libmlx.so
  ln -sfn "$B/bin/mlx/include" /tmp/site/mlx/include; ln -sfn "$B/bin/mlx_cuda_13.libs" /tmp/site/mlx_cuda_13.libs
  ln -sfn "$SP/nvidia" /tmp/site/nvidia
  echo STEP3_DONE ;;
4)
  B=$(ls -d /tmp/mlxbc-*-cuda13); mkdir -p /tmp/models
  cat /tmp/stage/gguf.part0 /tmp/stage/gguf.part1 > /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "gguf md5 $(md5sum < /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf | cut -c1-32), expected $(cat /tmp/stage/gguf.md5)"
  export MLXBC_HOME=/tmp/mlxbc-home; mkdir -p $MLXBC_HOME/models
  ln -sf /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf $MLXBC_HOME/models/
  echo "=== smoke through the bundle's launcher"
  timeout 200 "$B/bin/mlxbc" ask -v -n 24 "What is the capital of France?" 2>&1 | tee $OUT/smoke.txt
  "$B/bin/mlxbc" status 2>&1 | tee -a $OUT/smoke.txt; "$B/bin/mlxbc" stop
  repo=$PWD
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  export LD_LIBRARY_PATH=$(ls -d "$SP"/nvidia/*/lib | tr '\n' ':')
  timeout 120 $PY $repo/scripts/reference/gguf_to_mlx.py /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/models/smollm2-mlx \
      --tokenizer-dir $repo/tests/fixtures/tokenizers/smollm2-135m-instruct 2>&1 | tail -1
  for run in 1 2; do
    for m in /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/models/smollm2-mlx; do
      echo "=== mlxbcd $m (run $run)"; timeout 240 "$B/bin/mlxbc-bench" $m 512 256 2>&1 | tail -1 | tee -a $OUT/mlxbcd.jsonl
    done
    echo "=== mlx-lm packed (run $run)"; timeout 240 $PY $repo/scripts/bench.d/mlx_lm_bench.py /tmp/models/smollm2-mlx 512 256 packed 2>&1 | tail -1 | tee -a $OUT/mlxlm.jsonl
  done
  echo STEP4_DONE ;;
esac
