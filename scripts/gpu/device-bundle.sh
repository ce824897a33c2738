#!/usr/bin/env bash
# Device side of scripts/gpu/stage-bundle: `device-bundle.sh N` in call N
# (1-7, back to back: the machine keeps /tmp while warm). 1-3: install the
# CUDA bundle as a user would (extract, point bin/nvidia at the machine's
# CUDA 13 libraries); 4: the smoke test, the fused quantized matmul check and
# greedy ids against mlx-lm on the same arrays (check_ids.py; QUICK=1: only
# the f16 exports steps 8 and 9 need); 5: MLX's CUDA
# graph settings, both engines under each; 6: the benchmark
# (scripts/bench.d/text_bench.py: mlxbcd through its socket, mlx-lm in
# process on the same weights) with RUN_ENV (e.g. "MLX_MAX_OPS_PER_BUFFER=100")
# applied to both; 7: the tiny models' benchmark and the prefill chunk sweep;
# 8 (SmolLM2) and 9 (the Qwen2.5-0.5B shape), after 4: many clients at once
# (mlxbc-bench --concurrency: 1, 4, 16, 64 clients of 128 tokens, each
# batched answer compared with its prompt alone, a short question during a
# 1,000-token answer) beside mlx-lm's BatchGenerator on the same packed f16
# weights; 10, after 4: the prompt cache's agent loop (mlxbc-bench --prompts:
# 2,000-token system prompt, 20 turns of ~200 tokens, a 4,000-token prefix
# from disk after a restart, misses) beside mlx-lm's server on the same loop;
# 11, after 4: the HTTP gateway's APIs and what logprobs and json_object cost
# (scripts/bench.d/gateway_bench.py, G as in 10); 12 (after 3, with c6) and
# 13 (with c7): Whisper tiny.en, mlxbcd (encoder miss and hit) beside
# mlx-whisper 0.4.3 on the GPU (scripts/bench.d/audio_bench.py).
set -u
step=$1
PY=/opt/torch/.venv/bin/python3
SP=$($PY -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')
mkdir -p /tmp/stage; [[ -d .dev/gpub/c$step ]] && cp -r ".dev/gpub/c$step/." /tmp/stage/
B=$(ls -d /tmp/mlxbc-*-cuda13 2>/dev/null)
repo=$PWD
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export LD_LIBRARY_PATH=$(ls -d "$SP"/nvidia/*/lib 2>/dev/null | tr '\n' ':')
smol="SmolLM2-135M-Instruct Q4_1=/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf"
qwen="Qwen2.5-Coder-0.5B shape, Q4_K_M blocks=/tmp/models/qwen2.5-coder-0.5b-shape.gguf"
bench() { # text_bench.py flags and models (BENCH_FLAGS: more flags)
  timeout ${BENCH_TIMEOUT:-560} $PY $repo/scripts/bench.d/text_bench.py --bench "$B/bin/mlxbc-bench" \
    --export "$B/bin/mlxbc-gguf-to-mlx" --work /tmp/bench-models ${BENCH_FLAGS:-} "$@" 2>&1
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
  if [[ -n ${QUICK:-} ]]; then # only what steps 8 and 9 need: the f16 exports for mlx-lm
    for g in SmolLM2-135M-Instruct.Q4_1 qwen2.5-coder-0.5b-shape; do
      "$B/bin/mlxbc-gguf-to-mlx" /tmp/models/$g.gguf /tmp/bench-models/$g-f16 float16 >/dev/null
    done
    echo STEP4_DONE; exit 0
  fi
  echo "=== smoke: mlxbc ask through the bundle's launcher (first request on this machine compiles CUDA kernels)"
  timeout 300 "$B/bin/mlxbc" ask -v -n 24 "What is the capital of France?" 2>&1 | tee $OUT/smoke.txt
  timeout 60 "$B/bin/mlxbc" ask -v -n 24 --temperature 0.7 --seed 1 "Name a colour." 2>&1 | tee -a $OUT/smoke.txt
  "$B/bin/mlxbc" ps 2>&1 | tee -a $OUT/smoke.txt; "$B/bin/mlxbc" status 2>&1 | tee -a $OUT/smoke.txt; "$B/bin/mlxbc" stop
  echo "=== fused quantized matmul on this device"
  timeout 60 $PY scripts/gpu/fused_qmm_check.py 2>&1 | tee $OUT/fused-qmm.txt
  echo "=== greedy ids: mlxbcd vs mlx-lm on the same arrays (f16, packed)"
  for g in SmolLM2-135M-Instruct.Q4_1 qwen2.5-coder-0.5b-shape; do
    "$B/bin/mlxbc-gguf-to-mlx" /tmp/models/$g.gguf /tmp/bench-models/$g-f16 float16 >/dev/null
  done
  timeout 400 $PY scripts/gpu/check_ids.py "$B/bin/mlxbc" \
    "SmolLM2-135M Q4_1=/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf=/tmp/bench-models/SmolLM2-135M-Instruct.Q4_1-f16" \
    "Qwen2.5-0.5B shape Q4_K_M=/tmp/models/qwen2.5-coder-0.5b-shape.gguf=/tmp/bench-models/qwen2.5-coder-0.5b-shape-f16" \
    2>&1 | tee $OUT/ids.txt
  "$B/bin/mlxbc" stop >/dev/null 2>&1
  echo STEP4_DONE ;;
5)
  mkdir -p /tmp/models/tiny && tar -C /tmp/models/tiny -xf /tmp/stage/tiny.tar
  # MLX's CUDA backend records operations into CUDA graphs of at most
  # MLX_MAX_OPS_PER_BUFFER nodes (default 20) before launching them; both
  # engines run under each setting.
  for env in "" "MLX_MAX_OPS_PER_BUFFER=60" "MLX_MAX_OPS_PER_BUFFER=100 MLX_MAX_MB_PER_BUFFER=1000" \
             "MLX_MAX_OPS_PER_BUFFER=250 MLX_MAX_MB_PER_BUFFER=4000" "MLX_USE_CUDA_GRAPHS=0"; do
    echo "=== ${env:-MLX defaults}" | tee -a $OUT/sweep.md
    ( [[ -n $env ]] && export $env; BENCH_TIMEOUT=100 bench --prompt 512 --decode 256 --runs 1 "$smol" ) | tee -a $OUT/sweep.md
  done
  echo STEP5_DONE ;;
6)
  echo "=== RUN_ENV: ${RUN_ENV:-none}" | tee $OUT/bench.md
  [[ -n ${RUN_ENV:-} ]] && export $RUN_ENV
  BENCH_TIMEOUT=420 bench --prompt 512 --decode 256 --runs 2 --json $OUT/bench.jsonl "$smol" "$qwen" | tee -a $OUT/bench.md
  echo STEP6_DONE ;;
7)
  [[ -n ${RUN_ENV:-} ]] && export $RUN_ENV
  echo "=== RUN_ENV: ${RUN_ENV:-none}" | tee $OUT/bench-tiny.md $OUT/chunks.md
  BENCH_TIMEOUT=150 bench --prompt 512 --decode 256 --runs 1 --json $OUT/bench-tiny.jsonl \
    "tiny Qwen3 (f32)=/tmp/models/tiny/tiny-qwen3" "tiny Gemma 3 VLM, text only (4-bit)=/tmp/models/tiny/tiny-gemma3-vlm-4bit" \
    | tee -a $OUT/bench-tiny.md
  echo "=== prefill chunk sweep (4096-token prompt)" | tee -a $OUT/chunks.md
  BENCH_TIMEOUT=300 bench --prompt 4096 --decode 8 --chunks 256,512,1024,2048,4096 "$smol" "$qwen" | tee -a $OUT/chunks.md
  echo STEP7_DONE ;;
8|9)
  # ROUNDS (default 3) rounds, the two engines interleaved (ours, then
  # mlx-lm's, per round); the first of ours also compares every batched
  # answer with its prompt alone. Medians (concurrency_median.py).
  g=$([[ $step == 8 ]] && echo SmolLM2-135M-Instruct.Q4_1 || echo qwen2.5-coder-0.5b-shape)
  echo "=== concurrency: $g, ${ROUNDS:-3} rounds" | tee $OUT/concurrency-$g.md
  for r in $(seq 1 ${ROUNDS:-3}); do
    check=$([[ $r == 1 ]] && echo 1 || echo 0)
    MLXBC_BENCH_LOG=${MLXBC_BENCH_LOG:-info} MLXBC_BENCH_CHECK_IDS=$check timeout 300 "$B/bin/mlxbc-bench" --concurrency /tmp/models/$g.gguf ${CLIENTS:-1,4,16,64} 128 1000 \
      > $OUT/conc-$g-r$r.json 2> $OUT/conc-$g-r$r.log
    timeout 150 $PY scripts/bench.d/mlx_lm_batch.py /tmp/bench-models/$g-f16 ${CLIENTS:-1,4,16,64} 128 1 > $OUT/conc-mlxlm-$g-r$r.json
  done
  $PY scripts/bench.d/concurrency_median.py $OUT/conc-$g-r*.json > $OUT/conc-$g.json
  $PY scripts/bench.d/concurrency_median.py $OUT/conc-mlxlm-$g-r*.json > $OUT/conc-mlxlm-$g.json
  $PY scripts/bench.d/concurrency_table.py $OUT/conc-$g.json $OUT/conc-mlxlm-$g.json 128 "$g" | tee -a $OUT/concurrency-$g.md
  echo STEP${step}_DONE ;;
10) # G=one model's file stem runs only that one (each run fits a call)
  for g in ${G:-SmolLM2-135M-Instruct.Q4_1 qwen2.5-coder-0.5b-shape}; do
    timeout 240 "$B/bin/mlxbc-bench" --prompts /tmp/models/$g.gguf 2000 20 200 32 4000 > $OUT/prompts-$g.json 2> $OUT/prompts-$g.log
    timeout 120 $PY scripts/bench.d/mlx_lm_server_loop.py /tmp/bench-models/$g-f16 2000 20 200 32 4000 > $OUT/prompts-mlxlm-$g.json
    $PY scripts/bench.d/prompts_table.py $OUT/prompts-$g.json $OUT/prompts-mlxlm-$g.json | tee $OUT/prompts-$g.md
  done
  echo STEP10_DONE ;;
11)
  export MLXBC_HOME=/tmp/mlxbc-gateway; mkdir -p $MLXBC_HOME/models
  gs=${G:-SmolLM2-135M-Instruct.Q4_1 qwen2.5-coder-0.5b-shape}
  for g in $gs; do ln -sf /tmp/models/$g.gguf $MLXBC_HOME/models/; done
  "$B/bin/mlxbcd" --http 127.0.0.1:18080 2> $OUT/gateway-daemon.log & pid=$!
  for _ in $(seq 300); do [[ -S $MLXBC_HOME/mlxbcd.sock ]] && break; sleep 0.1; done
  for g in $gs; do
    echo "=== $g ($(nvidia-smi --query-gpu=name --format=csv,noheader))" | tee -a $OUT/gateway.md
    timeout ${GW_TIMEOUT:-240} $PY scripts/bench.d/gateway_bench.py http://127.0.0.1:18080 $g.gguf ${ROUNDS:-7} ${TOKENS:-128} \
      2>&1 | tee -a $OUT/gateway.md
  done
  kill $pid; wait $pid 2>/dev/null
  echo STEP11_DONE ;;
12)
  mkdir -p /tmp/whisper/whisper-tiny.en && cp /tmp/stage/whisper.part0 /tmp/stage/config.json /tmp/stage/tokenizer.json /tmp/whisper/
  tar -C /tmp/whisper -xf /tmp/stage/clips.tar
  echo STEP12_DONE ;;
13)
  w=/tmp/whisper; cat $w/whisper.part0 /tmp/stage/whisper.part1 > $w/whisper-tiny.en/model.safetensors
  cp $w/config.json $w/tokenizer.json $w/whisper-tiny.en/
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/stage/*.whl
  $PY scripts/fixtures/hf_whisper_to_mlx.py $w/whisper-tiny.en $w/mlx-tiny.en
  export MLXBC_HOME=/tmp/mlxbc-audio; mkdir -p $MLXBC_HOME/models; ln -sfn $w/whisper-tiny.en $MLXBC_HOME/models/
  "$B/bin/mlxbcd" --http 127.0.0.1:18081 2> $OUT/audio-daemon.log & pid=$!
  for _ in $(seq 300); do [[ -S $MLXBC_HOME/mlxbcd.sock ]] && break; sleep 0.1; done
  echo "=== $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee $OUT/audio.md
  BENCH_DEVICE=gpu timeout ${AUDIO_TIMEOUT:-500} $PY scripts/bench.d/audio_bench.py http://127.0.0.1:18081 ${ROUNDS:-5} \
    $w/clips tests/fixtures/audio/sentences.txt "whisper-tiny.en:$w/mlx-tiny.en:none" 2>&1 | tee -a $OUT/audio.md
  kill $pid; wait $pid 2>/dev/null
  echo STEP13_DONE ;;
esac
