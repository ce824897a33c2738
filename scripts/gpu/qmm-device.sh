#!/usr/bin/env bash
# Device side of the MLX-build comparison (issue "The GPU step at real
# sizes", item 1: does a newer MLX batch the quantized matmul?). Staged
# here into .dev/gq/c1..c4 (the two builds' libmlx.so, xz'd, tarred and
# split in four under the 64 MiB a call carries beside the tree; their headers and bundled libs; the mlx 0.32.2 and 0.32.4
# bindings). `qmm-device.sh N` in call N, back to back (the machine keeps
# /tmp while warm); call 4 installs both builds side by side and runs
# scripts/gpu/qmm_scale.py under each, rounds interleaved.
set -u
step=$1
PY=/opt/torch/.venv/bin/python3
SP=$($PY -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')
mkdir -p /tmp/gq && cp -r ".dev/gq/c$step/." /tmp/gq/
case $step in
1|2|3) nvidia-smi --query-gpu=name,memory.used --format=csv,noheader; ls /tmp/gq; echo "STEP${step}_DONE" ;;
4)
  cd /tmp/gq && cat part0 part1 part2 part3 | tar -xf - || exit 1
  for v in 0.32.2 0.32.4; do
    s=/tmp/site-$v; rm -rf $s; mkdir -p $s
    $PY -m pip install -q --no-index --no-deps --no-compile --target $s /tmp/gq/mlx-$v-cp312-*.whl
    tar -C $s -xJf /tmp/gq/inc_$v.tar.xz && mkdir -p $s/mlx/lib && xz -dc lib_$v.xz > $s/mlx/lib/libmlx.so
    if [ -f $SP/nvidia/cu13/include/cuda_runtime.h ]; then ln -sfn $SP/nvidia $s/nvidia
    else mkdir -p $s/nvidia; for d in $SP/nvidia/*; do b=$(basename $d)
      if [ $b = cu13 ]; then mkdir -p $s/nvidia/cu13; ln -s $d/lib $s/nvidia/cu13/lib; else ln -s $d $s/nvidia/$b; fi; done; fi
  done
  export CUDA_HOME=/usr/local/cuda PYTHONUNBUFFERED=1
  export LD_LIBRARY_PATH=$(ls -d "$SP"/nvidia/*/lib 2>/dev/null | tr '\n' ':')
  if [ "${QMM_RUN:-}" = ptx ]; then  # MLX's PTX cache: a new process with the same directory, then without one
    export PYTHONPATH=/tmp/site-0.32.2; rm -rf /tmp/ptxc
    for i in 1 2; do MLX_PTX_CACHE_DIR=/tmp/ptxc $PY "$OLDPWD/scripts/gpu/ptx_cache_check.py"; done
    for i in 1 2; do $PY "$OLDPWD/scripts/gpu/ptx_cache_check.py"; done
    find / -xdev -name "*.ptx" -newer /tmp/gq/part0 2>/dev/null | grep -v ptxc | head -5
    echo STEP4_DONE; exit 0
  fi
  echo "| MLX | weights | rows | ms/step | rows/s |"; echo "|---|---|---:|---:|---:|"
  for round in 1 2; do
    for v in ${QMM_VERSIONS:-0.32.2 0.32.4}; do
      PYTHONPATH=/tmp/site-$v timeout 280 $PY "$OLDPWD/scripts/gpu/qmm_scale.py" "$v r$round" 2>&1 | tee -a "$OUT/qmm.md"
    done
  done
  echo STEP4_DONE ;;
esac
