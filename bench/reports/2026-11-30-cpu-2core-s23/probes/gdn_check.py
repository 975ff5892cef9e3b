import time, numpy as np, mlx.core as mx
import mlx_lm.models.gated_delta as gd
from engine.runtime.runner.backends.cpu import host_gated_delta as hg
mx.random.seed(0)
for (B,T,Hk,Hv,Dk,Dv) in [(1,466,16,16,128,128),(2,40,2,4,32,16)]:
    q = mx.random.normal((B,T,Hk,Dk))*0.1; k = mx.random.normal((B,T,Hk,Dk))*0.1; v = mx.random.normal((B,T,Hv,Dv))
    g = mx.exp(-mx.abs(mx.random.normal((B,T,Hv))))*1.0; beta = mx.sigmoid(mx.random.normal((B,T,Hv)))
    s0 = mx.random.normal((B,Hv,Dv,Dk))*0.1
    mx.eval(q,k,v,g,beta,s0)
    t=time.perf_counter(); y1, s1 = gd.gated_delta_ops(q,k,v,g,beta,s0); mx.eval(y1,s1); t1=time.perf_counter()-t
    hg.steps(q,k,v,g,beta,s0)
    t=time.perf_counter(); y2, s2 = hg.steps(q,k,v,g,beta,s0); mx.eval(y2,s2); t2=time.perf_counter()-t
    s0b = np.array(s0)
    print((B,T,Hk,Hv,Dk,Dv), f"ops {t1:.3f}s kernel {t2:.3f}s", "max|dy|", float(mx.abs(y1-y2).max()), "max|y|", float(mx.abs(y1).max()), "max|ds|", float(mx.abs(s1-s2).max()))
    y3, s3 = hg.steps(q,k,v,g,beta,s0); assert np.array_equal(np.array(s0), s0b), "input state modified"
