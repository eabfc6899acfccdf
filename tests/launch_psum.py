"""Stand-in for main.py in the launch tests: join jax.distributed (same env-var contract as main.py),
psum across every device of every process over gloo, and write the result as JSON.

usage: python tests/launch_psum.py OUT_JSON
"""
import json
import os
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    jax.distributed.initialize(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                               num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                               process_id=int(os.environ["JAX_PROCESS_ID"]))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

n = jax.device_count()
mesh = Mesh(np.array(jax.devices()).reshape(2, 2, n // 4), ("dp", "pp", "tp"))
sharding = NamedSharding(mesh, PartitionSpec(("dp", "pp", "tp")))
# the i-th device of the global list holds i + 1; the psum over all devices is n (n + 1) / 2 everywhere
index = {d: i for i, d in enumerate(jax.devices())}
local = [jax.device_put(jnp.full((1,), index[d] + 1.0), d) for d in jax.local_devices()]
x = jax.make_array_from_single_device_arrays((n,), sharding, local)
total = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, ("dp", "pp", "tp")), mesh=mesh,
                              in_specs=PartitionSpec(("dp", "pp", "tp")),
                              out_specs=PartitionSpec(("dp", "pp", "tp"))))(x)
values = [float(s.data[0]) for s in total.addressable_shards]
result = {"process_id": jax.process_index(), "process_count": jax.process_count(),
          "device_count": n, "local_device_count": jax.local_device_count(), "psum": values,
          "wandb_key_set": bool(os.environ.get("WANDB_API_KEY"))}
print(json.dumps(result), flush=True)
with open(sys.argv[1].replace("{pid}", str(jax.process_index())), "w") as f:
    json.dump(result, f)
