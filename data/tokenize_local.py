"""Single-VM tokenizer: a multiprocessing pool feeding the shared core (data/shards.py).

    python -m data.tokenize_local --source HuggingFaceFW/fineweb-edu --hf_config sample-350BT \\
        --out gs://bucket/fineweb --shard_size 100000000 --val_shards 1 [--resume]
    python -m data.tokenize_local --source bundled --out /tmp/kjv_shards --shard_size 100000
    python -m data.tokenize_local --train_source 'a.jsonl.gz,b.jsonl.gz' --val_source c.parquet --out DIR

Workers default to half the cores. The main process streams documents, sends batches of them to the
pool (a bounded window of tasks in flight, results taken back in order), packs the tokens into shards
and shows a progress bar in tokens. `--workers 0` encodes in the main process.
"""
import argparse
import multiprocessing as mp
import os
import sys

if __package__ in (None, ""):                      # `python data/tokenize_local.py ...` works too
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data import shards  # noqa: E402
from data import tokenizer as tok  # noqa: E402


def pool_map(workers, window_per_worker=4):
    """An encode_map over a fork pool (created before any thread is started in the parent)."""
    if workers <= 0:
        return shards.serial_map, lambda: None
    tok.get_tokenizer()                            # load once, inherited by forked workers
    # fork is fast and shares the loaded tokenizer; a process that already runs JAX (whose runtime
    # threads make fork unsafe) gets spawn. Spawn needs the `if __name__ == "__main__"` idiom in scripts.
    ctx = mp.get_context("spawn" if "jax" in sys.modules or sys.platform == "win32" else "fork")
    pool = ctx.Pool(workers)

    def encode_map(batches):
        return shards.ordered_map(lambda b: pool.apply_async(shards.encode_batch, (b,)), lambda h: h.get(),
                                  batches, window=workers * window_per_worker)

    def close():
        pool.close()
        pool.join()

    return encode_map, close


def run(out, plan, shard_size=shards.DEFAULT_SHARD_SIZE, resume=False, workers=None, progress=True,
        batch_docs=256):
    workers = default_workers() if workers is None else workers
    encode_map, close = pool_map(workers)
    bar, update = shards.progress_bar(disable=not progress)
    try:
        return shards.tokenize(out, plan, shard_size, resume, encode_map, update, batch_docs=batch_docs)
    finally:
        bar.close()
        close()


def default_workers():
    return max(1, (os.cpu_count() or 2) // 2)


def main(argv=None):
    p = shards.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    p.add_argument("--workers", type=int, default=None, help="pool size (default: half the cores)")
    a = p.parse_args(argv)
    return shards.run_cli(a, lambda plan: run(a.out, plan, a.shard_size, a.resume, a.workers,
                                              progress=not a.no_progress, batch_docs=a.batch_docs))


if __name__ == "__main__":
    sys.exit(main())
