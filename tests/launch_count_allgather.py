"""main.py, with the calls of jax.experimental.multihost_utils.process_allgather made by main.py and
multihost.py counted (how often the training driver synchronises the processes; not orbax's own
barriers). Writes {"process": I, "driver_allgather_calls": N} to $COUNT_OUT ("{pid}" replaced by I)
when main.py exits.

usage: python tests/launch_count_allgather.py MAIN_ARGS...
"""
import json
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from jax.experimental import multihost_utils  # noqa: E402  (imports jax; main.py configures it later)

calls = [0]
allgather = multihost_utils.process_allgather


def counted(*args, **kwargs):
    if os.path.basename(sys._getframe(1).f_code.co_filename) in ("main.py", "multihost.py"):
        calls[0] += 1
    return allgather(*args, **kwargs)


multihost_utils.process_allgather = counted
sys.argv = [os.path.join(ROOT, "main.py"), *sys.argv[1:]]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    pid = os.environ.get("JAX_PROCESS_ID", "0")
    with open(os.environ["COUNT_OUT"].replace("{pid}", pid), "w") as f:
        json.dump({"process": int(pid), "driver_allgather_calls": calls[0]}, f)
