"""Rank 1 dies (`die`) or stops (`stop`) after one collective; rank 0 tries another.
MLX_HOSTFILE=hosts.json MLX_RANK=r python ring_fault.py die|stop"""
import os
import signal
import sys
import time

import mlx.core as mx

g = mx.distributed.init(strict=True, backend="ring")
mx.eval(mx.distributed.all_sum(mx.ones(4), group=g))
if g.rank() == 1:
    if sys.argv[1] == "die":
        os._exit(9)
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(0.5)
t = time.time()
try:
    mx.eval(mx.distributed.all_sum(mx.ones(4), group=g))
    print(f"rank 0: answered after {time.time() - t:.2f}s", flush=True)
except Exception as e:
    print(f"rank 0: error after {time.time() - t:.2f}s: {e}", flush=True)
