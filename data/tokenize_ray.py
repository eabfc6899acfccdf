"""Cluster tokenizer: Ray tasks feeding the shared core (data/shards.py); output identical to
data/tokenize_local.py for the same flags.

    python -m data.tokenize_ray --address auto --source HuggingFaceFW/fineweb-edu --hf_config sample-350BT \\
        --out gs://bucket/fineweb --shard_size 100000000 --val_shards 1 [--resume]

The driver streams documents and submits one task per batch of `--batch_docs` documents (a bounded
window of tasks in flight, `--inflight`, default 2 x the cluster's CPUs); results are taken back in
submission order, so the shards do not depend on which task finishes first. The repository must be at
the same path on every node (it is put on the workers' PYTHONPATH), or pass --working_dir to ship it.
Without --address a local Ray is started.
"""
import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data import shards  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def init_ray(address=None, num_cpus=None, working_dir=None):
    import ray
    if ray.is_initialized():
        return ray
    runtime_env = {"env_vars": {"PYTHONPATH": REPO}}
    if working_dir:
        runtime_env = {"working_dir": working_dir}
    kw = {"num_cpus": num_cpus} if address is None and num_cpus else {}
    ray.init(address=address, runtime_env=runtime_env, include_dashboard=False, log_to_driver=False, **kw)
    return ray


def ray_map(inflight=None):
    import ray
    remote = ray.remote(num_cpus=1)(shards.encode_batch).options(num_returns=1)
    window = inflight or max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))

    def encode_map(batches):
        return shards.ordered_map(lambda b: remote.remote(b), ray.get, batches, window=window)

    return encode_map


def run(out, plan, shard_size=shards.DEFAULT_SHARD_SIZE, resume=False, address=None, num_cpus=None,
        progress=True, batch_docs=256, inflight=None, working_dir=None):
    init_ray(address, num_cpus, working_dir)
    bar, update = shards.progress_bar(disable=not progress)
    try:
        return shards.tokenize(out, plan, shard_size, resume, ray_map(inflight), update, batch_docs=batch_docs)
    finally:
        bar.close()


def main(argv=None):
    p = shards.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    p.add_argument("--address", default=None, help="Ray cluster address ('auto' on a cluster); none = local Ray")
    p.add_argument("--num_cpus", type=int, default=None, help="CPUs for a local Ray")
    p.add_argument("--inflight", type=int, default=None, help="tasks in flight (default 2 x cluster CPUs)")
    p.add_argument("--working_dir", default=None, help="ship this directory to the workers (Ray runtime_env)")
    a = p.parse_args(argv)
    return shards.run_cli(a, lambda plan: run(a.out, plan, a.shard_size, a.resume, a.address, a.num_cpus,
                                              not a.no_progress, a.batch_docs, a.inflight, a.working_dir))


if __name__ == "__main__":
    sys.exit(main())
