"""The ring backend's all_sum time by payload size, two ranks on loopback:
a decode row up to a prefill chunk's activations (positions x 576, SmolLM2's
hidden size). Run as two processes:
  MLX_HOSTFILE=hosts.json MLX_RANK=0 python ring_throughput.py &
  MLX_HOSTFILE=hosts.json MLX_RANK=1 python ring_throughput.py
"""
import statistics, time
import mlx.core as mx

g = mx.distributed.init(strict=True, backend="ring")
mx.eval(mx.distributed.all_sum(mx.ones((4,)), group=g))
for positions in (1, 16, 64, 256, 384, 448, 455, 456, 480, 512, 1024, 2048):
    x = mx.ones((1, positions, 576))
    times = []
    for _ in range(20):
        t = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=g))
        times.append(time.perf_counter() - t)
    mb = x.nbytes / 1e6
    med = statistics.median(times)
    if g.rank() == 0:
        print(f"| {positions} | {mb:.2f} | {med * 1e3:.2f} | {mb / med:.0f} |", flush=True)
