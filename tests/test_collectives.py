"""The project's collectives across processes as a user's CPU cluster runs them: two processes over gloo."""
import json
import os
import subprocess
import sys

from ceiling import CEILING_S
from launch_util import free_port

HERE = os.path.dirname(os.path.abspath(__file__))


def test_the_reduce_scatter_over_gloo_is_the_sum_whenever_the_ranks_arrive(tmp_path):
    """The pinned jaxlib's gloo reduce-scatter sends from a buffer it then overwrites: with ranks arriving
    apart, rank 0 got wrong values at the end of a large slice (jax-ml/jax#40830; here the embedding's
    gradient under FSDP, in about one two-process training run in four). collectives.psum_scatter runs as a
    psum and a slice over gloo: no reduce-scatter in the program, and every result is numpy's sum."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    out = tmp_path / "process{pid}.json"
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "gloo_reduce_scatter.py"), str(out), "20"],
                              env=dict(env, JAX_PROCESS_ID=str(i)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    for p in procs:
        printed = p.communicate(timeout=CEILING_S)[0]
        assert p.returncode == 0, printed[-4000:]
    for i in (0, 1):
        assert json.loads((tmp_path / f"process{i}.json").read_text()) == {"reduce_scatters": 0, "wrong": 0}
