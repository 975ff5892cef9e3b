import time, statistics, sys
import mlx.core as mx
from common import base_parser, load
from engine.runtime import cpu_math
from engine.runtime.kv import ragged
from engine.runtime.kv.full_kv import FullKV
from engine.runtime.kv.sequence_kv import kv_shape
args = base_parser("x").parse_args([])
loaded = load(args); model = loaded.model
cpu_math.install(model); ragged.install(model)
shape = kv_shape(loaded.spec); n_layers=len(model.layers)
for batch, ctx in ((1, 60), (1, 150), (16, 60), (16, 150)):
    rows=[]
    for _ in range(batch):
        layers=[FullKV(shape, 256) for _ in range(n_layers)]
        for l in layers: l.reserve(ctx+8)
        model(mx.array([[1 + i % 1000 for i in range(ctx)]]), cache=layers); mx.eval([l.keys for l in layers]); rows.append(layers)
    token = mx.array([[5]]*batch)
    res = {False: [], True: []}
    for it in range(24):
        fast = it % 2 == 0
        cpu_math.install(model, fast)
        for layers in rows:
            for l in layers: l.offset = ctx
        caches = rows[0] if batch == 1 else [ragged.RaggedLayerCache([rows[i][j] for i in range(batch)]) for j in range(n_layers)]
        t0=time.perf_counter()
        with cpu_math.routing():
            out = model(token, cache=caches)[:, -1, :].argmax(-1)
        mx.eval(out); res[fast].append(time.perf_counter()-t0)
    print(batch, ctx, "mlx %.1f ms  fast %.1f ms" % (statistics.median(res[False][2:])*1e3, statistics.median(res[True][2:])*1e3))
