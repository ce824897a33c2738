#!/bin/bash
# The first `mlxbc ask` of a fresh daemon and the one after it, with its
# `-v` statistics line: what a user sees right after set-up (load, and the
# decode rate the first request reports). CLEAR=1 empties MLX's CPU kernel
# cache first (/tmp/mlx/<version>/cpu), as on a fresh machine.
#   usage: scripts/bench.d/first_ask.sh BIN_DIR LABEL   (BIN_DIR holds mlxbcd and mlxbc)
# Interleave two builds for a comparison:
#   for i in 1 2 3; do for b in "old/ before" "target/release after"; do CLEAR=1 scripts/bench.d/first_ask.sh $b; done; done
set -u
bin=$1; h=$(mktemp -d /tmp/mlxbc-first.XXXX); mkdir -p "$h/models"
m=${MLXBC_TEST_FIXTURES:-$(dirname "$0")/../../target/test-fixtures}/models/SmolLM2-135M-Instruct.Q4_1.gguf
ln -s "$(realpath "$m")" "$h/models/"
[ -n "${CLEAR:-}" ] && rm -rf /tmp/mlx/*/cpu
MLXBC_HOME=$h "$bin/mlxbcd" 2>"$h/log" & pid=$!
for _ in $(seq 100); do MLXBC_HOME=$h "$bin/mlxbc" status >/dev/null 2>&1 && break; sleep 0.2; done
for run in first second; do
  echo "== $2 $run"
  MLXBC_HOME=$h "$bin/mlxbc" ask -v -m SmolLM2-135M-Instruct.Q4_1.gguf -n 16 --temperature 0 "Name three colors." 2>&1 | grep '^model'
done
kill $pid; wait $pid 2>/dev/null; rm -rf "$h"
