#!/usr/bin/env bash
# Device side of scripts/gpu/stage-bundle: `device-bundle.sh N` in call N
# (1-6, back to back: the machine keeps /tmp while warm). Installs the CUDA
# bundle as a user would (extract, point bin/nvidia at the machine's CUDA 13
# libraries), runs the smoke test, then the benchmark (scripts/bench.d/
# text_bench.py: mlxbcd through its socket, mlx-lm in process on the same
# weights) — call 5: SmolLM2 and Qwen2.5-0.5B; call 6: the tiny models.
set -u
step=$1
PY=/opt/torch/.venv/bin/python3
SP=$($PY -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')
mkdir -p /tmp/stage; [[ -d .dev/gpub/c$step ]] && cp -r ".dev/gpub/c$step/." /tmp/stage/
B=$(ls -d /tmp/mlxbc-*-cuda13 2>/dev/null)
repo=$PWD
bench() { # models... (BENCH_FLAGS: more text_bench.py flags, e.g. --step-rows)
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  export LD_LIBRARY_PATH=$(ls -d "$SP"/nvidia/*/lib | tr '\n' ':')
  timeout 560 $PY $repo/scripts/bench.d/text_bench.py --bench "$B/bin/mlxbc-bench" --export "$B/bin/mlxbc-gguf-to-mlx" \
    --work /tmp/bench-models --prompt 512 --decode 256 --runs 2 ${BENCH_FLAGS:-} --json $OUT/bench.jsonl "$@" 2>&1 | tee -a $OUT/bench.md
}
case $step in
1|2) echo "STEP${step}_DONE" ;;
3)
  cat /tmp/stage/bundle.part0 /tmp/stage/bundle.part1 | tar -C /tmp -xzf -
  B=$(ls -d /tmp/mlxbc-*-cuda13); ln -sfn "$SP/nvidia" "$B/bin/nvidia"
  cp /tmp/stage/mlxbc-bench /tmp/stage/mlxbc-gguf-to-mlx "$B/bin/"
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/stage/*.whl
  mkdir -p /tmp/site/mlx/lib; ln -sf "$B/bin/mlx/lib/libmlx.so" /tmp/site/mlx/lib/libmlx.so
  ln -sfn "$B/bin/mlx/include" /tmp/site/mlx/include; ln -sfn "$B/bin/mlx_cuda_13.libs" /tmp/site/mlx_cuda_13.libs
  ln -sfn "$SP/nvidia" /tmp/site/nvidia
  echo STEP3_DONE ;;
4)
  mkdir -p /tmp/models
  cat /tmp/stage/gguf.part0 /tmp/stage/gguf.part1 > /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "gguf md5 $(md5sum < /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf | cut -c1-32), expected $(cat /tmp/stage/gguf.md5)"
  $PY scripts/gpu/synth_gguf.py /tmp/stage/qwen25.header tests/fixtures/reference/gguf-blocks.gguf \
      /tmp/models/qwen2.5-coder-0.5b-shape.gguf
  export MLXBC_HOME=/tmp/mlxbc-home; mkdir -p $MLXBC_HOME/models
  ln -sf /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf $MLXBC_HOME/models/
  echo "=== smoke: mlxbc ask through the bundle's launcher (first request on this machine compiles CUDA kernels)"
  timeout 300 "$B/bin/mlxbc" ask -v -n 24 "What is the capital of France?" 2>&1 | tee $OUT/smoke.txt
  timeout 60 "$B/bin/mlxbc" ask -v -n 24 --temperature 0.7 --seed 1 "Name a colour." 2>&1 | tee -a $OUT/smoke.txt
  "$B/bin/mlxbc" ps 2>&1 | tee -a $OUT/smoke.txt; "$B/bin/mlxbc" status 2>&1 | tee -a $OUT/smoke.txt; "$B/bin/mlxbc" stop
  echo STEP4_DONE ;;
5)
  bench "SmolLM2-135M-Instruct Q4_1=/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf" \
        "Qwen2.5-Coder-0.5B shape, Q4_K_M blocks=/tmp/models/qwen2.5-coder-0.5b-shape.gguf"
  echo STEP5_DONE ;;
6)
  mkdir -p /tmp/models/tiny && tar -C /tmp/models/tiny -xf /tmp/stage/tiny.tar
  bench "tiny Qwen3 (f32)=/tmp/models/tiny/tiny-qwen3" "tiny Gemma 3 VLM, text only (4-bit)=/tmp/models/tiny/tiny-gemma3-vlm-4bit"
  echo STEP6_DONE ;;
esac
# diag: whether the fused projections (MLXBC_FUSE) or the decode step
# (MLXBC_DECODE) change the answer on this device (same prompt, greedy).
if [[ $step == diag ]]; then
  export MLXBC_HOME=/tmp/mlxbc-home; mkdir -p $MLXBC_HOME/models
  ln -sf /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf $MLXBC_HOME/models/
  for env in "" "MLXBC_FUSE=0" "MLXBC_DECODE=eager" "MLXBC_DECODE=compiled"; do
    echo "=== ${env:-defaults}"
    env $env timeout 200 "$B/bin/mlxbc" ask -v -n 12 "What is the capital of France?" 2>&1 | tail -2
    "$B/bin/mlxbc" stop >/dev/null 2>&1; sleep 1
  done
fi
