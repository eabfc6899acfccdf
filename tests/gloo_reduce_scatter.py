"""Run as two processes of one CPU device each (gloo; JAX_COORDINATOR_ADDRESS, JAX_PROCESS_ID): the
project's reduce-scatter (collectives.psum_scatter) of a 12 MiB slice per rank, along dim 0 and dim 1,
against numpy's sum, with process 1 arriving up to 50 ms late each time (the timing under which the
pinned jaxlib's gloo reduce-scatter hands rank 0 wrong values). Writes JSON: the compiled program's
reduce-scatter ops and the wrong results.

usage: python tests/gloo_reduce_scatter.py OUT_JSON ITERATIONS
"""
import json
import os
import sys
import time

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], 2, int(os.environ["JAX_PROCESS_ID"]))

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from collectives import psum_scatter  # noqa: E402

mesh = jax.make_mesh((2,), ("dp",))
pid, rows, cols = jax.process_index(), 49152, 128                 # [R, C] fp32 per rank: 24 MiB, 12 MiB kept
full = np.random.default_rng(0).standard_normal((2, rows, cols)).astype(np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("dp")), full[pid:pid + 1], (2, rows, cols))
total = full[0] + full[1]
steps, wanted = [], []
for dim in (0, 1):
    steps.append(jax.jit(jax.shard_map(lambda x_1RC, dim=dim: psum_scatter(x_1RC[0], "dp", dim)[None], mesh=mesh,
                                       in_specs=PartitionSpec("dp"), out_specs=PartitionSpec("dp"))))
    wanted.append(np.split(total, 2, axis=dim)[pid])
reduce_scatters = sum(f.lower(x).compile().as_text().count(" reduce-scatter(") for f in steps)
rng, wrong = np.random.default_rng(pid), 0
for _ in range(int(sys.argv[2])):
    for f, want in zip(steps, wanted):
        if pid == 1:
            time.sleep(0.05 * rng.random())
        wrong += not np.array_equal(np.asarray(f(x).addressable_data(0))[0], want)
with open(sys.argv[1].replace("{pid}", str(pid)), "w") as out:
    json.dump({"reduce_scatters": reduce_scatters, "wrong": wrong}, out)
