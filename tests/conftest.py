"""Every test sees 8 simulated CPU devices; set before JAX is imported anywhere."""
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"])
os.environ.setdefault("WANDB_MODE", "offline")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
