#!/usr/bin/env python3
"""One MiniLM layer on MLX's CPU backend piece by piece (8 texts of 240 tokens
by default; argv[1] texts), medians of 3, the projections through addmm as
the daemon's Linear, and cpu_math's polynomial softmax and GELU beside MLX's.
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 [OPENBLAS_CORETYPE=SkylakeX] \
        target/test-fixtures/venv/bin/python scripts/bench.d/bert_layer_cpu.py 8"""
import mlx.core as mx, time, math, statistics, sys
mx.set_default_device(mx.cpu)
B,L,D,I,NH=int(sys.argv[1]) if len(sys.argv)>1 else 8,240,384,1536,12
hd=D//NH
LN2=math.log(2)
EXP2=[1.0,LN2,0.2402265,5.550411e-2,9.618129e-3,1.3333558e-3,1.540353e-4,1.5252734e-5]
ERF_P=[-2.7261423e-10,2.7706814e-8,-2.101024e-6,-5.6925064e-5,-7.3499063e-4,-2.9546e-3,-1.6096034e-2]
ERF_Q=[-1.4566072e-5,-2.1337406e-4,-1.682827e-3,-7.3733292e-3,-1.426474e-2]
def horner(x,c):
    p=mx.array(c[0])
    for v in c[1:]: p=p*x+v
    return p
def expn(x):
    y=mx.maximum(x,-87.0)*(1/LN2); k=mx.floor(y)
    t=horner(y-k,EXP2[::-1]); bits=(k.astype(mx.int32)+127)*(1<<23)
    return t*bits.view(mx.float32)
def softmax(x):
    e=expn(x-x.max(-1,keepdims=True)); return e/e.sum(-1,keepdims=True)
def erf(x):
    x=mx.clip(x,-4,4); x2=x*x; return horner(x2,ERF_P)*x/horner(x2,ERF_Q)
def gelu(x): return x*(erf(x*(1/math.sqrt(2)))+1)*0.5
def lin(w,b): return lambda x: mx.addmm(b,x,w.T)
r=lambda *s: mx.random.normal(s)*0.05
Wq,Wk,Wv,Wo=[lin(r(D,D),r(D)) for _ in range(4)]
Wi,Wd=lin(r(I,D),r(I)),lin(r(D,I),r(D))
g,bb=mx.ones(D),mx.zeros(D)
x=r(B,L,D); bias=mx.zeros((B,1,1,L))
mx.eval(x,bias)
heads=lambda t: t.reshape(B,L,NH,hd).transpose(0,2,1,3)
pieces={}
def T(name,f,*a):
    out=f(*a); mx.eval(out)
    ts=[]
    for _ in range(3):
        t=time.perf_counter(); mx.eval(f(*a)); ts.append(time.perf_counter()-t)
    pieces[name]=statistics.median(ts)*1000; return out
q=T("q proj",lambda: heads(Wq(x))); k=T("k",lambda: heads(Wk(x))); v=T("v",lambda: heads(Wv(x)))
qc=T("q contiguous copy", lambda: mx.contiguous(q))
s=T("scores matmul",lambda: (q*0.125)@k.transpose(0,1,3,2))
sb=T("bias add",lambda: s+bias)
p=T("softmax poly",lambda: softmax(sb))
T("softmax mlx",lambda: mx.softmax(sb,axis=-1))
o=T("p@v",lambda: p@v)
of=T("from heads",lambda: o.transpose(0,2,1,3).reshape(B,L,D))
a=T("o proj",lambda: Wo(of))
x1=T("res+LN",lambda: mx.fast.layer_norm(a+x,g,bb,1e-12))
h=T("intermediate",lambda: Wi(x1))
hg=T("gelu poly",lambda: gelu(h))
T("gelu mlx",lambda: mx.erf(h))
d=T("down",lambda: Wd(hg))
T("res+LN2",lambda: mx.fast.layer_norm(d+x1,g,bb,1e-12))
tot=sum(v for k,v in pieces.items() if k not in ("softmax mlx","gelu mlx","q contiguous copy"))
for k_,v_ in pieces.items(): print(f"{k_:20s} {v_:8.1f} ms")
print("total", round(tot,1), "ms; texts/s one stream", round(B/(tot*6/1000),1))
