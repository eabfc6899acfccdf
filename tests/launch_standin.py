"""Stand-in for main.py in the launcher tests, fast (it computes nothing): what process I does comes from its
argument I (I = $JAX_PROCESS_ID, 0 without a coordinator):
  ready    print main.py's start-up line (multihost.started_line) and a step line, then sleep
  until:P  as ready, then exit 0 once the file P exists (a run that ends when the test says)
  fail:N   print an error and exit N at once, before start-up
  hang     never reach start-up (sleep)
First it prints its MEGASCALE_* and JAX_* environment (what the launcher gave this host) on one line.

usage: python tests/launch_standin.py ACTION_FOR_PROCESS_0 [ACTION_FOR_PROCESS_1 ...]
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import multihost  # noqa: E402

pid = int(os.environ.get("JAX_PROCESS_ID", "0"))
n = int(os.environ.get("JAX_NUM_PROCESSES", "1"))
action = sys.argv[1 + pid]
shown = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(("MEGASCALE_", "JAX_")))
print("stand-in environment:", *shown, flush=True)
print(f"stand-in process {pid} of {n}: {action}", flush=True)
if action.startswith("fail:"):
    print("error: the stand-in fails before start-up", file=sys.stderr, flush=True)
    sys.exit(int(action.split(":")[1]))
if action == "ready" or action.startswith("until:"):
    print(multihost.started_line(pid, n), flush=True)
    print("step     12 | loss 7.2500 | val 7.3000 | lr 1.00e-03", flush=True)
while action.startswith("until:"):
    if os.path.exists(action.split(":", 1)[1]):
        sys.exit(0)
    time.sleep(0.1)
time.sleep(300)
