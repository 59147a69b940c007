import time, jax, jax.numpy as jnp, numpy as np
from jax_fa4.config import AttentionConfig
from jax_fa4.reference import Masks
from jax_fa4.rules.ranges import query_ranges, key_ranges
B,S=2,8192
docs=jnp.asarray(np.repeat(np.arange(8,dtype=np.int32),1024)[None].repeat(2,0))
cfg=AttentionConfig(scale=1.0,causal=True,segments=True)
f=jax.jit(lambda s: (query_ranges(cfg,S,S,Masks(None,None,s,s),B), key_ranges(cfg,S,S,Masks(None,None,s,s),B)))
cfg2=AttentionConfig(scale=1.0,causal=True,window=(1024,0))
g=jax.jit(lambda s: (query_ranges(cfg2,S,S,Masks(),B), key_ranges(cfg2,S,S,Masks(),B)))
for name, fn in (("segments", f), ("window", g)):
    jax.block_until_ready(fn(docs))
    t=time.perf_counter()
    for _ in range(50): out=fn(docs)
    jax.block_until_ready(out)
    print(name, "fwd+bwd ranges:", round((time.perf_counter()-t)/50*1e6,1), "us", flush=True)
