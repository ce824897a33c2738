import mlx.core as mx, sys, time
t=time.time()
g = mx.distributed.init(strict=True, backend="ring")
x = mx.array([float(g.rank() + 1)] * 4)
y = mx.distributed.all_sum(x, group=g); mx.eval(y)
n=200; big=mx.ones((1, 576)); t1=time.time()
for _ in range(n):
    z = mx.distributed.all_sum(big, group=g); mx.eval(z)
dt=(time.time()-t1)/n
print(f"rank {g.rank()}/{g.size()} all_sum={y.tolist()} init {t1-t:.2f}s, all_sum of [1,576] f32: {dt*1e6:.0f} us", flush=True)
