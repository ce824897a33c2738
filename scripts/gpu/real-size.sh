#!/usr/bin/env bash
# Device side of issue "The GPU step at real sizes": the CUDA bundle against
# random-weight models of real shapes (scripts/gpu/real/make_big.py: the
# Qwen3-8B shape 4-bit group 64, as mlx-community ships 8B models, and the
# Qwen2.5-0.5B shape), beside mlx-lm 0.32.2 on the same directories.
# Staged here by `scripts/gpu/real-size.sh stage` into .dev/rs/c0..cN (32 MiB parts)
# (the bundle split under the 64 MiB a call carries; the last part with the
# mlx/mlx-lm wheels; .dev/rs/ct a Qwen tokenizer). On the device, call by
# call (the machine keeps /tmp while warm):
#   base          (carry .dev/rs-old, after install) an earlier build's daemon
#                 (`stage-base COMMIT` here): daemons given BIN=base in
#                 SWEEP / PASS_AB run it, for before/after in one run
#   part N        copy part N (all but the last; and `part t`, the tokenizer)
#   install       the last part (carry .dev/rs/ctz with it, and no `part t`
#                 is needed); extract the bundle, install the wheels,
#                 write the models (~10 s for 8B)
#   bursts MODEL  a fresh daemon (empty kernel cache): load, time the idle
#                 warming of batch sizes, then 16, 16, 64, 64 clients (first
#                 and second bursts), then 1/16/64 clients, 2 rounds
#                 (BATCH_WEIGHTS=packed: the choice before this issue;
#                 W4A16_ROWS=N: our kernel for steps of up to N rows)
#   single MODEL  single stream, mlxbcd vs mlx-lm, interleaved
#   mlxlm MODEL   mlx-lm's BatchGenerator at 16 and 64 on the same directory
#   kernel        scripts/gpu/w4a16.py: our W4A16 kernel, checked and timed
#   parts         scripts/gpu/step_parts.py: an 8B step part by part
#   graphs [MODEL] scripts/gpu/pass_graphs.py: a verify pass's host cost
#                 (build / launch / wait) in mlx-lm, with MLX's CUDA graphs
#                 as they are, off, and 100 operations a graph
#   ids MODEL     scripts/gpu/check_ids_dense.py: greedy ids against mlx-lm
#   ab MODEL      two warm daemons, A as configured and B with
#                 MLXBC_BATCH_ATTENTION=mask: interleaved rounds of 16 and 64
#                 clients (scripts/gpu/real/attention_ab.py), greedy ids
#                 compared; first scripts/gpu/prefill_shapes.py
#   sweep MODEL   (MODEL_NAME= for a model not written here, e.g. SmolLM2's
#                 GGUF after spart 0..2) several warm daemons, each with its own environment
#                 (SWEEP="label:VAR=1,VAR2=2 label2:..."; "base:" for none):
#                 interleaved rounds at LEVELS (scripts/gpu/real/env_sweep.py);
#                 at most two 8B daemons on an 80 GB H100 (three slowed one
#                 another: docs/measurements/h100-2026-12-05b-batched-host.md)
#   spart N       copy SmolLM2 Q4_1 (real weights) part N (0, 1, 2) for `spec`
#   spec MODEL    speculation off / auto / ngram: three warm daemons
#                 (SPEC_DAEMONS=one: one, the mode per request),
#                 scripts/bench.d/speculative_bench.py with MODEL for the
#                 code rows (CODE_MODEL=SmolLM2-135M-Instruct.Q4_1.gguf:
#                 real weights there too) and SmolLM2 for the quotation and chat rows
#   passab MODEL  a verify pass's cost under several settings: one warm
#                 daemon each (PASS_AB="label:mode:VAR=1,VAR2=2 ...", the first
#                 the baseline), the code-edit rows (TASKS) rotated, medians and
#                 each daemon's decode profile (scripts/gpu/real/pass_ab.py);
#                 CODE_MODEL as for spec
#   qpart N       copy Qwen2.5-Coder-0.5B Q4_K_M (real weights) part N (0..14,
#                 staged by `stage-coder`); `spec` with CODE_MODEL= and
#                 SMALL_MODEL=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
#   wpart N       copy Whisper part N (0, 1); `whisper` takes the last one
#   draftrows MODEL  rows drafting with a draft model together / apart /
#                 off: two daemons (scripts/bench.d/draft_rows_bench.py;
#                 DRAFTS="qwen2.5-0.5b-4bit qwen3-4b-same": a name ending
#                 in -same drafts with MODEL's own weights)
#   epart N       copy all-MiniLM-L6-v2 (real weights) part N (0, 1, 2): carry
#                 .dev/rs/eN beside a step that carries little (bursts, ab)
#   embed         all-MiniLM-L6-v2 embeddings and a cross-encoder of its shape
#                 reranking (scripts/bench.d/embed_bench.py, REFERENCE=none:
#                 no sentence-transformers on the device)
#   launch        scripts/gpu/launch_costs.py: what one MLX operation costs
#                 the host per kind (packed and dense matmuls, attention with
#                 and without a mask, a custom kernel), after `install`
#   qmm           scripts/gpu/qmm_rows.py: an 8B step's projections by rows,
#                 packed as a decode batch gives them (3-D), flattened, dense
#   nsys MODEL    one warm daemon (BATCH_WEIGHTS= as in bursts) under Nsight
#                 Systems: a steady burst of CLIENTS (16) traced, the kernels
#                 and CUDA calls summed by time (nsys stats)
#   views         scripts/gpu/split_views_check.py: which operations read a
#                 fused projection's parts right as views (no copies)
#   kv MODEL      a TOKENS-long prompt (32,768) with the KV cache at full
#                 precision, 8 and 4 bits (scripts/bench.d/kv_bench.py)
#   group MODEL   issue 40 (two GPUs, kind nvidia-h200-x2): MODEL on one GPU
#                 against two mlxbcd ranks over NCCL, then the faults
#                 (scripts/gpu/two_gpu_bench.py); smollm2 for SmolLM2
#   lora MODEL    16 clients over 0, 1, 4 and 16 random LoRA adapters of the
#                 model's shape (scripts/bench.d/lora_bench.py)
#   whisper       Whisper tiny.en, mlxbcd beside mlx-whisper 0.4.3
#                 (scripts/bench.d/audio_bench.py)
# MODEL: qwen3-8b | qwen3-4b | qwen2.5-0.5b. Everything under $OUT comes back.
set -u
step=$1; shift
repo=$PWD
if [[ $step == stage ]]; then # here, at no device time
  set -e
  out=.dev/rs; rm -rf "$out"; mkdir -p "$out"
  scripts/bundle cuda >/dev/null
  b=$(ls dist/mlx*-cuda13.tar.gz | head -1)
  split -b 32M -d -a 1 "$b" "$out/part"
  n=$(ls "$out"/part* | wc -l)
  for i in $(seq 0 $((n - 1))); do mkdir -p "$out/c$i"; mv "$out/part$i" "$out/c$i/"; done
  last=$out/c$((n - 1))
  # The Python bindings for the device's Python 3.12 (libmlx comes from the bundle).
  python3 -m pip download --no-deps --quiet -d "$last" --python-version 3.12 --only-binary=:all: \
      --platform manylinux_2_35_x86_64 mlx==0.32.2
  python3 -m pip download --no-deps --quiet -d "$last" mlx-lm==0.32.2
  # The Qwen tokenizer, padded to the shapes' 151,936 ids (tiny-qwen3's is
  # SmolLM2's 49,152: two random picks in three fell outside it, and a
  # draft stops before such an id, docs/measurements/h100-2026-12-06b-draft-rows.md).
  # In a part of its own (`part t`): beside the last part of the bundle and
  # the repository it passed what a call carries.
  mkdir -p "$out/ct"
  cp "${MLXBC_TEST_FIXTURES:-$PWD/target/test-fixtures}"/mlx/tiny-qwen3_5/tokenizer{,_config}.json "$out/ct/"
  # The same gzipped (1.9 MB): small enough to ride with the last part, so
  # `install N` carried with [.dev/rs/cN, .dev/rs/ctz] needs no `part t`.
  mkdir -p "$out/ctz"; gzip -9 -c "$out/ct/tokenizer.json" > "$out/ctz/tokenizer.json.gz"
  cp "$out/ct/tokenizer_config.json" "$out/ctz/"
  # Whisper tiny.en for `whisper` (its weights in three, under what a call carries).
  fx=${MLXBC_TEST_FIXTURES:-$PWD/target/test-fixtures}; wt=$fx/models/whisper-tiny.en
  mkdir -p "$out/w0" "$out/w1" "$out/w2"
  split -n 3 -d -a 1 "$wt/model.safetensors" "$out/whisper."
  for i in 0 1 2; do mv "$out/whisper.$i" "$out/w$i/"; done
  cp "$wt/config.json" "$wt/tokenizer.json" "$out/w0/"
  tar -C "$fx/whisper" -cf "$out/w0/clips.tar" clips/s1.wav clips/s2.wav clips/s3.wav clips/s4.wav clips/s5.wav \
      clips/s6.wav clips/s7.wav clips/s8.wav clips/long.wav
  python3 -m pip download --no-deps --quiet -d "$out/w1" --python-version 3.12 --only-binary=:all: \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 mlx-whisper==0.4.3 tiktoken regex
  # all-MiniLM-L6-v2 for `embed` (its weights in three, carried beside other
  # steps: the working tree itself takes ~29 MB of what a call carries).
  mkdir -p "$out/e0" "$out/e1" "$out/e2"
  split -n 3 -d -a 1 "$fx/models/all-MiniLM-L6-v2/model.safetensors" "$out/minilm."
  for i in 0 1 2; do mv "$out/minilm.$i" "$out/e$i/"; done
  tar -C "$fx/models" --exclude=model.safetensors -cf "$out/e0/minilm.tar" all-MiniLM-L6-v2
  # SmolLM2 Q4_1 for `spec` (real weights; in three, under what a call carries).
  split -n 3 -d -a 1 "$fx/models/SmolLM2-135M-Instruct.Q4_1.gguf" "$out/smol."
  for i in 0 1 2; do mkdir -p "$out/s$i"; mv "$out/smol.$i" "$out/s$i/"; done
  echo "$n parts"; du -sh "$out"/c* "$out"/w* "$out"/s* "$out"/e*
  exit 0
fi
if [[ $step == stage-base ]]; then # here: COMMIT's daemon, built in a worktree, for `base`
  set -e
  c=$(git rev-parse --short "${2:?stage-base COMMIT}"); wt=$(mktemp -d)/base
  git worktree add -f "$wt" "$c" >/dev/null
  # The worktree goes whether or not its build succeeds.
  trap 'git worktree remove --force "$wt" 2>/dev/null; rm -rf "$(dirname "$wt")"' EXIT
  # The same target folder: only the workspace's crates build again.
  here=$PWD; (cd "$wt" && MLXBC_BLAS=reference CARGO_TARGET_DIR="$here/target/gpu" cargo build --release --bins --quiet)
  mkdir -p .dev/rs-old; gzip -9 -c target/gpu/release/mlxbcd > .dev/rs-old/mlxbcd-base.gz; echo "$c" > .dev/rs-old/commit
  # This tree's build again, so the next `stage` bundles it.
  MLXBC_BLAS=reference CARGO_TARGET_DIR=$PWD/target/gpu cargo build --release --bins --quiet
  ls -la .dev/rs-old; exit 0
fi
if [[ $step == stage-coder ]]; then # here: Qwen2.5-Coder-0.5B Q4_K_M (real weights, 469 MiB) in 15 parts of 32 MiB
  set -e
  out=.dev/rs; rm -rf "$out"/q*; fx=${MLXBC_TEST_FIXTURES:-$PWD/target/test-fixtures}
  split -b 32M -d -a 2 "$fx/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" "$out/coder."
  for f in "$out"/coder.*; do i=$((10#${f##*.})); mkdir -p "$out/q$i"; mv "$f" "$out/q$i/"; done
  # The whole file's hash and the part count ride with part 0: `qpart` joins and checks.
  (cd "$fx/models" && sha256sum qwen2.5-coder-0.5b-instruct-q4_k_m.gguf) > "$out/q0/coder.sha256"
  ls -d "$out"/q* | wc -l | tee "$out/q0/coder.parts"; exit 0
fi
PY=/opt/torch/.venv/bin/python3
SP=$($PY -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export LD_LIBRARY_PATH=$(ls -d "$SP"/nvidia/*/lib 2>/dev/null | tr '\n' ':')
mkdir -p /tmp/stage
B=$(ls -d /tmp/mlxbc-*-cuda13 2>/dev/null)
R=$repo/scripts/gpu/real
model_dir() { echo "/tmp/models/$1-4bit"; }
daemon() { # a daemon of its own home; $1: home, rest: env (BIN=base: the `base` step's build)
  local home=$1; shift
  local bin=$B/bin/mlxbcd envs=()
  for e in "$@"; do case $e in BIN=base) bin=$B/bin/mlxbcd-base ;; *) envs+=("$e") ;; esac; done
  mkdir -p "$home/models"; ln -sfn /tmp/models/* "$home/models/" 2>/dev/null
  env MLXBC_HOME=$home MLXBC_LOG=info "${envs[@]}" "$bin" >"$home/daemon.log" 2>&1 &
  # Not `mlxbc status`: a client starts a daemon of its own when none answers.
  for _ in $(seq 100); do [[ -S $home/mlxbcd.sock ]] && return 0; sleep 0.2; done
  echo "daemon did not start"; tail -20 "$home/daemon.log"; return 1
}
case $step in
base) # an earlier build's daemon beside this bundle's (carry .dev/rs-old; staged by
  # `scripts/gpu/real-size.sh stage-base COMMIT`): daemons given BIN=base run it
  zcat .dev/rs-old/mlxbcd-base.gz > "$B/bin/.mlxbcd-base" && chmod +x "$B/bin/.mlxbcd-base" || exit 1
  sed 's|\.mlxbcd"|.mlxbcd-base"|g' "$B/bin/mlxbcd" > "$B/bin/mlxbcd-base" && chmod +x "$B/bin/mlxbcd-base"
  grep -c mlxbcd-base "$B/bin/mlxbcd-base"; cat .dev/rs-old/commit 2>/dev/null ;;
part)
  cp -r ".dev/rs/c$1/." /tmp/stage/; ls -la /tmp/stage; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader ;;
install)
  cp -r ".dev/rs/c$1/." /tmp/stage/
  if [[ -f .dev/rs/ctz/tokenizer.json.gz ]]; then # carried beside the last part
    zcat .dev/rs/ctz/tokenizer.json.gz > /tmp/stage/tokenizer.json; cp .dev/rs/ctz/tokenizer_config.json /tmp/stage/
  fi
  cat /tmp/stage/part* | tar -C /tmp -xzf - || exit 1
  B=$(ls -d /tmp/mlxbc-*-cuda13); ln -sfn "$SP/nvidia" "$B/bin/nvidia"
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/stage/*.whl
  mkdir -p /tmp/site/mlx/lib; ln -sf "$B/bin/mlx/lib/libmlx.so" /tmp/site/mlx/lib/libmlx.so
  ln -sfn "$B/bin/mlx/include" /tmp/site/mlx/include; ln -sfn "$B/bin/mlx_cuda_13.libs" /tmp/site/mlx_cuda_13.libs
  ln -sfn "$SP/nvidia" /tmp/site/nvidia
  mkdir -p /tmp/tok /tmp/models; cp /tmp/stage/tokenizer*.json /tmp/tok/
  for shape in qwen3-8b qwen3-4b qwen2.5-0.5b; do $PY "$R/make_big.py" "$(model_dir $shape)" /tmp/tok $shape || exit 1; done
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader ;;
bursts)
  m=$1-4bit; home=/tmp/home-$RANDOM; tokens=${TOKENS:-128}
  daemon "$home" ${BATCH_WEIGHTS:+MLXBC_BATCH_WEIGHTS=$BATCH_WEIGHTS} ${W4A16_ROWS:+MLXBC_W4A16_ROWS=$W4A16_ROWS} || exit 1
  t0=$(date +%s%N)
  MLXBC_HOME=$home "$B/bin/mlxbc" load "$m" --keep-alive 30m
  for _ in $(seq 600); do MLXBC_HOME=$home "$B/bin/mlxbc" ps | grep -q "warming" || break; sleep 0.5; done
  echo "load + warming: $(( ($(date +%s%N) - t0) / 1000000 )) ms"
  MLXBC_HOME=$home "$B/bin/mlxbc" ps
  grep -E "batched paths warmed|model loaded|expand" "$home/daemon.log" | cut -c1-200
  echo "### first and second bursts (a warm daemon, one stream served first)"
  MLXBC_HOME=$home timeout 280 $PY "$R/conc.py" "$B/bin/mlxbc" "$m" 16,16,64,64 1 "$tokens" "$OUT/bursts-$1.jsonl"
  echo "### steady"
  MLXBC_HOME=$home timeout 250 $PY "$R/conc.py" "$B/bin/mlxbc" "$m" 1,16,64 2 "$tokens" "$OUT/steady-$1.jsonl"
  grep -E "decode \(" "$home/daemon.log" | awk '{print $0}' | cut -c1-200 | tail -12
  MLXBC_HOME=$home "$B/bin/mlxbc" stop
  cp "$home/daemon.log" "$OUT/daemon-$1-${BATCH_WEIGHTS:-auto}-w${W4A16_ROWS:-0}.log" ;;
single)
  m=$1-4bit; home=/tmp/home-single-$RANDOM
  daemon "$home" ${W4A16_ROWS:+MLXBC_W4A16_ROWS=$W4A16_ROWS} || exit 1
  MLXBC_HOME=$home timeout 500 $PY "$R/single.py" "$B/bin/mlxbc" "$m" "$(model_dir $1)" ${ROUNDS:-4} ${TOKENS:-256} "$1" "$OUT/single-$1.jsonl"
  MLXBC_HOME=$home "$B/bin/mlxbc" stop ;;
ids) # greedy ids with the default (dense copies) against mlx-lm dequantized and packed
  m=$1-4bit; home=/tmp/home-ids-$RANDOM
  daemon "$home" || exit 1
  MLXBC_HOME=$home timeout 400 $PY "$repo/scripts/gpu/check_ids_dense.py" "$B/bin/mlxbc" "$m" "$(model_dir $1)" 2>&1 | tee "$OUT/ids-$1.txt"
  MLXBC_HOME=$home "$B/bin/mlxbc" stop ;;
nsys)
  NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/nsight-systems*/bin/nsys 2>/dev/null | head -1)
  [[ -n $NSYS ]] || { echo "no nsys on this machine"; ls /usr/local/cuda/bin | head -50; exit 1; }
  m=$1-4bit; home=/tmp/home-nsys-$RANDOM; mkdir -p "$home/models"; ln -sfn /tmp/models/* "$home/models/"
  env MLXBC_HOME=$home MLXBC_LOG=info ${BATCH_WEIGHTS:+MLXBC_BATCH_WEIGHTS=$BATCH_WEIGHTS} \
    "$NSYS" launch --trace=cuda,nvtx --session=mlxbc "$B/bin/mlxbcd" >"$home/daemon.log" 2>&1 &
  for _ in $(seq 200); do [[ -S $home/mlxbcd.sock ]] && break; sleep 0.2; done
  MLXBC_HOME=$home "$B/bin/mlxbc" load "$m" --keep-alive 30m
  for _ in $(seq 600); do MLXBC_HOME=$home "$B/bin/mlxbc" ps | grep -q "warming" || break; sleep 0.5; done
  MLXBC_HOME=$home timeout 120 $PY "$R/conc.py" "$B/bin/mlxbc" "$m" ${CLIENTS:-16} 1 ${TOKENS:-64} /dev/null
  "$NSYS" start --session=mlxbc -o "$OUT/prof" --force-overwrite=true
  MLXBC_HOME=$home timeout 120 $PY "$R/conc.py" "$B/bin/mlxbc" "$m" ${CLIENTS:-16} 1 ${TOKENS:-64} "$OUT/nsys-burst.jsonl"
  "$NSYS" stop --session=mlxbc
  grep -E "decode \(" "$home/daemon.log" | cut -c60-200 | tail -4
  MLXBC_HOME=$home "$B/bin/mlxbc" stop
  "$NSYS" stats --report cuda_gpu_kern_sum,cuda_api_sum --format csv -o "$OUT/stats" "$OUT/prof.nsys-rep" >/dev/null 2>&1
  for f in "$OUT"/stats*.csv; do echo "## $f"; head -30 "$f" | cut -c1-220; done
  rm -f "$OUT/prof.nsys-rep" "$OUT"/prof.sqlite ;;
parts) # an 8B step part by part, per rows (scripts/gpu/step_parts.py)
  timeout 400 $PY "$repo/scripts/gpu/step_parts.py" 2>&1 | tee "$OUT/step-parts.txt" ;;
graphs) # what a verify pass costs the host, and whether MLX's CUDA graphs are it (scripts/gpu/pass_graphs.py)
  timeout 560 $PY "$repo/scripts/gpu/pass_graphs.py" "$(model_dir ${1:-qwen2.5-0.5b})" 2>&1 | tee "$OUT/pass-graphs.txt" ;;
kernel) # our W4A16 kernel against MLX's quantized matmul (scripts/gpu/w4a16.py)
  timeout 300 $PY "$repo/scripts/gpu/w4a16.py" 2>&1 | tee "$OUT/w4a16.txt" ;;
ab)
  m=$1-4bit; ha=/tmp/home-a-$RANDOM; hb=/tmp/home-b-$RANDOM
  if [[ -z ${SKIP_PREFILL:-} ]]; then
    timeout 120 $PY "$repo/scripts/gpu/prefill_shapes.py" 2>&1 | tee "$OUT/prefill-shapes.txt"
    MLX_CUDA_USE_CUDNN_SPDA=0 MLX_CUDA_USE_CUDNN_SDPA=0 timeout 120 $PY "$repo/scripts/gpu/prefill_shapes.py" 2>&1 \
      | tee -a "$OUT/prefill-shapes.txt"
  fi
  daemon "$ha" ${A_ENV:-} || exit 1
  daemon "$hb" ${B_ENV-MLXBC_BATCH_ATTENTION=mask} || exit 1
  for h in "$ha" "$hb"; do
    MLXBC_HOME=$h "$B/bin/mlxbc" load "$m" --keep-alive 30m
    for _ in $(seq 600); do MLXBC_HOME=$h "$B/bin/mlxbc" ps | grep -q "warming" || break; sleep 0.5; done
  done
  MLXBC_HOME=$ha timeout 450 $PY "$R/attention_ab.py" "$B/bin/mlxbc" "$m" "$ha" "$hb" ${LEVELS:-16,64} ${ROUNDS:-4} \
    ${TOKENS:-128} "$OUT/ab-$1.jsonl" 2>&1 | tee "$OUT/ab-$1.txt"
  grep -E "padded batches|kernel" "$ha/daemon.log" | cut -c1-240 | head -5
  grep -E "decode \(" "$ha/daemon.log" | cut -c1-200 | tail -4; grep -E "decode \(" "$hb/daemon.log" | cut -c1-200 | tail -4
  for h in "$ha" "$hb"; do MLXBC_HOME=$h "$B/bin/mlxbc" stop; done
  cp "$ha/daemon.log" "$OUT/daemon-ab-a-$1.log"; cp "$hb/daemon.log" "$OUT/daemon-ab-b-$1.log" ;;
sweep)
  m=${MODEL_NAME:-$1-4bit}; args=()
  for spec in ${SWEEP:?}; do
    label=${spec%%:*}; envs=${spec#*:}; h=/tmp/home-sweep-$label-$RANDOM
    daemon "$h" ${envs//,/ } || exit 1
    MLXBC_HOME=$h "$B/bin/mlxbc" load "$m" --keep-alive 30m
    args+=("$label=$h")
  done
  # Every daemon loaded first, then their batch sizes warm together.
  for a in "${args[@]}"; do
    for _ in $(seq 600); do MLXBC_HOME=${a#*=} "$B/bin/mlxbc" ps | grep -q "warming" || break; sleep 0.5; done
  done
  timeout ${SWEEP_TIMEOUT:-500} $PY "$R/env_sweep.py" "$B/bin/mlxbc" "$m" ${LEVELS:-1,16,64} ${ROUNDS:-3} ${TOKENS:-128} \
    "$OUT/sweep-$1.jsonl" "${args[@]}" 2>&1 | tee "$OUT/sweep-$1.txt"
  for a in "${args[@]}"; do
    h=${a#*=}; echo "## ${a%%=*}"; grep -E "decode \(" "$h/daemon.log" | cut -c60-200 | tail -6
    grep -E "own CUDA kernel|failed its check|was not built" "$h/daemon.log" | cut -c1-260
    MLXBC_HOME=$h "$B/bin/mlxbc" stop; cp "$h/daemon.log" "$OUT/daemon-sweep-${a%%=*}.log"
  done ;;
spart)
  mkdir -p /tmp/smol; cp -r ".dev/rs/s$1/." /tmp/smol/; ls -la /tmp/smol
  # With the last part there, SmolLM2 joins the models (MODEL_NAME=SmolLM2-135M-Instruct.Q4_1 for `sweep`).
  [[ -f /tmp/smol/smol.2 ]] && cat /tmp/smol/smol.0 /tmp/smol/smol.1 /tmp/smol/smol.2 \
    > /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf && ls -la /tmp/models ;;
qpart)
  # Qwen2.5-Coder-0.5B part N (stage-coder); with every part there it joins
  # the models (CODE_MODEL=SMALL_MODEL=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf for `spec`).
  mkdir -p /tmp/coder; cp -r ".dev/rs/q$1/." /tmp/coder/; ls /tmp/coder/coder.[0-9]* | wc -l
  if [[ -f /tmp/coder/coder.parts && $(ls /tmp/coder/coder.[0-9]* | wc -l) == "$(cat /tmp/coder/coder.parts)" ]]; then
    cat /tmp/coder/coder.[0-9]* > /tmp/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
    (cd /tmp/models && sha256sum -c /tmp/coder/coder.sha256) || exit 1
  fi ;;
spec)
  # SmolLM2's rows need its parts (spart 0..2); ONLY=batched,long do not.
  [[ -f /tmp/smol/smol.2 ]] && { cat /tmp/smol/smol.0 /tmp/smol/smol.1 /tmp/smol/smol.2 \
    > /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1; }
  hs=()
  if [[ ${SPEC_DAEMONS:-three} == one ]]; then # one daemon, the mode per request (memory for 8k prompts)
    h=/tmp/home-spec-one-$RANDOM; daemon "$h" || exit 1; hs=("$h" "$h" "$h")
  else
    for mode in off auto ngram; do
      # SPEC_ENV: more of the daemons' environment (e.g. MLXBC_FEW_QUERIES=mlx for an A/B).
      h=/tmp/home-spec-$mode-$RANDOM; daemon "$h" MLXBC_SPECULATE=$mode ${SPEC_ENV:-} || exit 1; hs+=("$h")
    done
  fi
  ONLY=${ONLY:-alone,batched,long,draft} DRAFT_TARGET=$1-4bit DRAFTS=qwen2.5-0.5b-4bit \
  CODE_MODEL=${CODE_MODEL:-$1-4bit} SMALL_MODEL=${SMALL_MODEL:-SmolLM2-135M-Instruct.Q4_1.gguf} timeout ${SPEC_TIMEOUT:-560} \
    $PY scripts/bench.d/speculative_bench.py "$B/bin/mlxbc" "${hs[@]}" ${ROUNDS:-3} 2>&1 | tee "$OUT/spec-$1${SPEC_LABEL:+-$SPEC_LABEL}.txt"
  for h in $(printf '%s\n' "${hs[@]}" | sort -u); do
    grep -E "decode \(" "$h/daemon.log" | cut -c60-220 | tail -4; MLXBC_HOME=$h "$B/bin/mlxbc" ps
    MLXBC_HOME=$h "$B/bin/mlxbc" stop; cp "$h/daemon.log" "$OUT/daemon-spec${SPEC_LABEL:+-$SPEC_LABEL}-$(basename "$h").log"
  done ;;
passab)
  # What a verify pass costs under several settings (scripts/gpu/real/pass_ab.py):
  # PASS_AB="label:mode:VAR=1,VAR2=2 ..." (the first the baseline), one warm
  # daemon each, the rows of TASKS (0,1) with each daemon's mode, rounds rotated.
  args=()
  for d in ${PASS_AB:-off:off: ngram:ngram: ngram-packed:ngram:MLXBC_PASS_WEIGHTS=packed auto:auto:}; do
    IFS=: read -r label mode envs <<<"$d"
    # A label's home again if this machine has one: its kernels are compiled there.
    h=$(ls -d /tmp/home-passab-$label-[0-9]* 2>/dev/null | head -1); h=${h:-/tmp/home-passab-$label-$RANDOM}
    daemon "$h" ${envs//,/ } || exit 1; args+=("$label=$h:$mode")
  done
  CODE_MODEL=${CODE_MODEL:-$1-4bit} SMALL_MODEL=${SMALL_MODEL:-$1-4bit} timeout ${SPEC_TIMEOUT:-560} \
    $PY scripts/gpu/real/pass_ab.py "$B/bin/mlxbc" ${ROUNDS:-3} "${args[@]}" 2>&1 | tee "$OUT/passab-$1${SPEC_LABEL:+-$SPEC_LABEL}.txt"
  for a in "${args[@]}"; do
    h=${a#*=}; h=${h%:*}; grep -E "kernel|attend" "$h/daemon.log" | cut -c1-220 | head -4
    MLXBC_HOME=$h "$B/bin/mlxbc" stop; cp "$h/daemon.log" "$OUT/daemon-passab-$(basename "$h").log"
  done ;;
draftrows)
  # A batch's rows drafting with a draft model, together (the default)
  # against apart (MLXBC_DRAFT_ROWS=apart) and off: two daemons, MODEL as
  # the target, DRAFTS (default the 0.5B shape: random, so a cost row; a
  # name ending in -same is MODEL's own directory under another name:
  # every draft accepted) forced per request (scripts/bench.d/draft_rows_bench.py).
  for d in ${DRAFTS:-qwen2.5-0.5b-4bit}; do [[ $d == *-same ]] && ln -sfn "$(model_dir $1)" /tmp/models/$d; done
  hs=()
  for rows in together apart; do
    # Half the card each (MLX caches freed buffers up to a quarter of its
    # budget; two daemons that each think the card theirs ran out of it).
    h=/tmp/home-draftrows-$rows-$RANDOM; mkdir -p "$h"; echo "memory_budget_mib = ${BUDGET_MIB:-34000}" > "$h/config.toml"
    daemon "$h" MLXBC_DRAFT_ROWS=$rows || exit 1; hs+=("$h")
  done
  TARGET=$1-4bit DRAFTS=$(echo ${DRAFTS:-qwen2.5-0.5b-4bit} | tr ' ' ,) timeout ${SPEC_TIMEOUT:-560} \
    $PY scripts/bench.d/draft_rows_bench.py "$B/bin/mlxbc" "${hs[@]}" ${ROUNDS:-3} 2>&1 | tee "$OUT/draftrows-$1.txt"
  for h in "${hs[@]}"; do
    grep -E "decode \(" "$h/daemon.log" | cut -c60-260 | tail -3; MLXBC_HOME=$h "$B/bin/mlxbc" ps
    MLXBC_HOME=$h "$B/bin/mlxbc" stop; cp "$h/daemon.log" "$OUT/daemon-draftrows-$(basename "$h").log"
  done ;;
epart)
  mkdir -p /tmp/minilm; cp -r ".dev/rs/e$1/." /tmp/minilm/; ls -la /tmp/minilm ;;
embed)
  e=/tmp/minilm; mkdir -p /tmp/emodels; tar -C /tmp/emodels -xf $e/minilm.tar || exit 1
  cat $e/minilm.0 $e/minilm.1 $e/minilm.2 > /tmp/emodels/all-MiniLM-L6-v2/model.safetensors
  # The cross-encoder of its shape (scripts/bench.d/make_cross_encoder.py's recipe, with MLX's safetensors).
  $PY - /tmp/emodels/all-MiniLM-L6-v2 /tmp/emodels/minilm-cross-encoder <<'PYEOF' || exit 1
import json, shutil, sys
from pathlib import Path
import mlx.core as mx
src, out = Path(sys.argv[1]), Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True)
w = mx.load(str(src / "model.safetensors")); t = {f"bert.{k}": v for k, v in w.items()}
h = w["embeddings.word_embeddings.weight"].shape[1]; mx.random.seed(0)
t.setdefault("bert.pooler.dense.weight", mx.random.normal((h, h)) * 0.02); t.setdefault("bert.pooler.dense.bias", mx.zeros((h,)))
t["classifier.weight"] = mx.random.normal((1, h)) * 0.02; t["classifier.bias"] = mx.zeros((1,))
mx.save_safetensors(str(out / "model.safetensors"), t, metadata={"format": "pt"})
c = json.loads((src / "config.json").read_text())
c.update(architectures=["BertForSequenceClassification"], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
(out / "config.json").write_text(json.dumps(c))
for f in ["tokenizer.json", "special_tokens_map.json"]: shutil.copy(src / f, out / f)
tc = json.loads((src / "tokenizer_config.json").read_text()); tc["model_max_length"] = 512
(out / "tokenizer_config.json").write_text(json.dumps(tc))
PYEOF
  home=/tmp/mlxbc-embed; mkdir -p $home/models; ln -sfn /tmp/emodels/* $home/models/
  MLXBC_HOME=$home MLXBC_LOG=info "$B/bin/mlxbcd" --http 127.0.0.1:18082 2> $OUT/embed-daemon.log & pid=$!
  for _ in $(seq 300); do [[ -S $home/mlxbcd.sock ]] && break; sleep 0.1; done
  REFERENCE=none timeout ${EMBED_TIMEOUT:-300} $PY scripts/bench.d/embed_bench.py http://127.0.0.1:18082 ${ROUNDS:-3} \
    /tmp/emodels/all-MiniLM-L6-v2 /tmp/emodels/minilm-cross-encoder 2>&1 | tee $OUT/embed.md
  kill $pid; wait $pid 2>/dev/null ;;
qmm) # an 8B step's projections by rows: packed 3-D, packed 2-D, dense (qmm_rows.py)
  timeout 400 $PY "$repo/scripts/gpu/qmm_rows.py" ${ROWS_LIST:-1,2,4,8,16,32,64} 2>&1 | tee "$OUT/qmm-rows.txt" ;;
views) # which consumers of a fused projection's parts read them right as views (split_views_check.py)
  timeout 200 $PY "$repo/scripts/gpu/split_views_check.py" 2>&1 | tee "$OUT/split-views.txt" ;;
launch)
  timeout 300 $PY "$repo/scripts/gpu/launch_costs.py" ${N:-400} 2>&1 | tee "$OUT/launch-costs.md" ;;
kv)
  home=/tmp/mlxbc-kv-$RANDOM; mkdir -p $home/models; ln -sfn "$(model_dir $1)" $home/models/
  MLXBC_HOME=$home MLXBC_LOG=info "$B/bin/mlxbcd" --http 127.0.0.1:18083 2> $OUT/kv-daemon.log & pid=$!
  for _ in $(seq 300); do [[ -S $home/mlxbcd.sock ]] && break; sleep 0.1; done
  # Per position: layers x KV heads x head_dim x (k, v) values of 2 bytes (f16); the budget: 16 GiB.
  values=$($PY -c "import json;c=json.load(open('$(model_dir $1)/config.json'));print(c['num_hidden_layers']*c['num_key_value_heads']*c.get('head_dim',128)*2)")
  timeout ${KV_TIMEOUT:-500} $PY scripts/bench.d/kv_bench.py http://127.0.0.1:18083 "$1-4bit" ${TOKENS:-32768} ${ROUNDS:-2} \
    "$values" 2 $((16 << 30)) 2>&1 | tee $OUT/kv-$1.md
  kill $pid; wait $pid 2>/dev/null ;;
wpart)
  mkdir -p /tmp/whisper; cp -r ".dev/rs/w$1/." /tmp/whisper/; ls -la /tmp/whisper ;;
whisper)
  w=/tmp/whisper; cp -r .dev/rs/w2/. $w/
  mkdir -p $w/whisper-tiny.en; cat $w/whisper.0 $w/whisper.1 $w/whisper.2 > $w/whisper-tiny.en/model.safetensors
  cp $w/config.json $w/tokenizer.json $w/whisper-tiny.en/; tar -C $w -xf $w/clips.tar
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $w/*.whl
  $PY scripts/fixtures/hf_whisper_to_mlx.py $w/whisper-tiny.en $w/mlx-tiny.en || exit 1
  home=/tmp/mlxbc-audio; mkdir -p $home/models; ln -sfn $w/whisper-tiny.en $home/models/
  MLXBC_HOME=$home MLXBC_LOG=info "$B/bin/mlxbcd" --http 127.0.0.1:18081 2> $OUT/audio-daemon.log & pid=$!
  for _ in $(seq 300); do [[ -S $home/mlxbcd.sock ]] && break; sleep 0.1; done
  BENCH_DEVICE=gpu timeout ${AUDIO_TIMEOUT:-400} $PY scripts/bench.d/audio_bench.py http://127.0.0.1:18081 ${ROUNDS:-5} \
    $w/clips tests/fixtures/audio/sentences.txt "whisper-tiny.en:$w/mlx-tiny.en:none" 2>&1 | tee $OUT/audio.md
  kill $pid; wait $pid 2>/dev/null ;;
group)
  # Issue "The distributed group on two NVIDIA GPUs": MODEL on one GPU
  # against a group of two ranks over NCCL (one GPU each, from the
  # hostfile), then rank 1 killed mid-answer (scripts/gpu/two_gpu_bench.py;
  # checked on a CPU with BACKEND=ring). SmolLM2 (spart 0..2) is rank 0's
  # local model in the fault rows, and MODEL=smollm2 splits it instead.
  [[ -f /tmp/smol/smol.2 && ! -f /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf ]] && \
    cat /tmp/smol/smol.0 /tmp/smol/smol.1 /tmp/smol/smol.2 > /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf
  m=$1-4bit; [[ $1 == smollm2 ]] && m=SmolLM2-135M-Instruct.Q4_1.gguf
  nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
  OUT=$OUT timeout ${GROUP_TIMEOUT:-580} $PY scripts/gpu/two_gpu_bench.py "$B/bin" /tmp/models "$m" \
    SmolLM2-135M-Instruct.Q4_1.gguf ${BACKEND:-nccl} ${ROUNDS:-3} ${TOKENS:-256} ${LEVELS:-1,16,64} 2>&1 | tee "$OUT/group-$1.md" ;;
lora)
  # 16 clients over 0, 1, 4 and 16 LoRA adapters on MODEL (issue 39's
  # adapter rows): an adapter as mlx_lm.lora writes one (rank 8, scale 20,
  # every projection of the last 16 layers), random, written here for the
  # shape; scripts/bench.d/lora_bench.py perturbs 16 copies of it.
  home=/tmp/mlxbc-lora-$RANDOM; mkdir -p $home/models /tmp/lora-seed
  ln -sfn "$(model_dir $1)" $home/models/
  $PY - "$(model_dir $1)/config.json" /tmp/lora-seed <<'PYEOF' || exit 1
import json, sys
import mlx.core as mx
c = json.load(open(sys.argv[1])); out = sys.argv[2]
h, f, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
hd = c.get("head_dim") or h // c["num_attention_heads"]
q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
          "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, f), "mlp.up_proj": (h, f), "mlp.down_proj": (f, h)}
mx.random.seed(0); w = {}
for layer in range(n - 16, n):
    for key, (i, o) in shapes.items():
        w[f"model.layers.{layer}.{key}.lora_a"] = mx.random.normal((i, 8)) * 0.02
        w[f"model.layers.{layer}.{key}.lora_b"] = mx.random.normal((8, o)) * 0.001
mx.save_safetensors(f"{out}/adapters.safetensors", w)
json.dump({"fine_tune_type": "lora", "num_layers": 16, "lora_parameters": {"rank": 8, "dropout": 0.0, "scale": 20.0}},
          open(f"{out}/adapter_config.json", "w"))
PYEOF
  # MLXBC_LORA_KERNEL=off (exported): MLX's matmuls for the updates, for a
  # run beside one with mlxbc's kernels; its files are named -kernel-off.
  tag=${MLXBC_LORA_KERNEL:+-kernel-$MLXBC_LORA_KERNEL}
  MLXBC_HOME=$home MLXBC_LOG=info "$B/bin/mlxbcd" --http 127.0.0.1:18084 2> $OUT/lora-daemon$tag.log & pid=$!
  for _ in $(seq 300); do [[ -S $home/mlxbcd.sock ]] && break; sleep 0.1; done
  timeout ${LORA_TIMEOUT:-500} $PY scripts/bench.d/lora_bench.py "$B/bin/mlxbc" http://127.0.0.1:18084 $home "$1-4bit" \
    /tmp/lora-seed $home/models ${ROUNDS:-3} 2>&1 | tee $OUT/lora-$1$tag.md
  grep -E "LoRA updates|decode \(" $OUT/lora-daemon$tag.log | cut -c1-260 | tail -6
  kill $pid; wait $pid 2>/dev/null ;;
mlxlm)
  timeout 500 $PY "$R/batch_mlxlm.py" "$1" "$(model_dir $1)" ${BATCHES:-16,64} 1 ${TOKENS:-128} "$OUT/mlxlm-$1.jsonl" ;;
esac
