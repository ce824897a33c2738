#!/usr/bin/env bash
cd /work/main; fx=$PWD/target/test-fixtures; py=$fx/venv/bin/python
start() { # name bindir port
  local home=/tmp/loraab-$1; rm -rf $home; mkdir -p $home/models; ln -s "$fx/lora/base" "$home/models/smollm2-f32"
  MLXBC_HOME=$home $2/mlxbcd --http 127.0.0.1:$3 2> $home/log & echo $! > $home/pid
  for _ in $(seq 100); do [[ -S $home/mlxbcd.sock ]] && break; sleep 0.1; done
}
start before /tmp/lora-before 18201; start after $PWD/target/release 18202
for r in 0 1 2; do
  if (( r % 2 == 0 )); then order="before after"; else order="after before"; fi
  for n in $order; do
    port=18201; bin=/tmp/lora-before; [[ $n == after ]] && { port=18202; bin=$PWD/target/release; }
    echo "## round $r: $n"
    $py scripts/bench.d/lora_bench.py $bin/mlxbc http://127.0.0.1:$port /tmp/loraab-$n smollm2-f32 "$fx/lora/parrot" /tmp/loraab-$n/models 1 2>&1 | grep -E "^round|^\| (the|1|4|16)"
  done
done
for n in before after; do kill $(cat /tmp/loraab-$n/pid); done
