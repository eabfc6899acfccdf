"""Data throughput benchmark: `python -m data.bench [--loader_batches 300]`.

1. Tokenizer: the bundled corpus 4 times over (~4M tokens) through the multiprocessing driver with 1 and 2 workers,
   end to end (read with `datasets`, encode, pack, write shards + manifest), tokens/s.
2. Loader: BatchLoader over the bundled train shards, global batch 16 x T=128 on 8 (simulated CPU)
   devices, meshes dp=8 and (2,2,2), through the prefetching iterator; tokens/s delivered, to compare
   with the tiny training config's consumption (32 sequences x 128 tokens per step).
"""
import argparse
import os
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY_TOKENS_PER_STEP = 32 * 128


def bench_tokenizer(workers_list, tmp, repeat):
    import gzip
    import shutil
    from data import corpus, shards, tokenize_local
    src = os.path.join(tmp, "corpus.jsonl.gz")         # the bundled corpus `repeat` times over
    with gzip.open(corpus.PATH, "rb") as f:
        raw = f.read()
    with gzip.open(src, "wb", compresslevel=1) as f:
        for _ in range(repeat):
            f.write(raw)
    plan = shards.make_plan(src, val_shards=1)
    out = {}
    for w in workers_list:
        d = os.path.join(tmp, f"tok_w{w}")
        t = time.perf_counter()
        m = tokenize_local.run(d, plan, 1 << 22, workers=w, progress=False)
        dt = time.perf_counter() - t
        n = sum(s["tokens"] for s in m["shards"])
        out[w] = n / dt
        print(f"tokenizer  workers={w}: {n:,} tokens in {dt:.2f} s = {n / dt / 1e6:.2f} M tokens/s "
              f"(end to end: read with datasets, encode, pack, write shards)", flush=True)
        shutil.rmtree(d)
    return out


def bench_loader(tmp, n_batches, B=16, T=128):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=8"])
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import dataset
    from data import tokenizer as tok
    d = dataset.ensure_bundled_shards(os.path.join(tmp, "cache"))
    ds = dataset.TokenDataset(d, "train", tok.VOCAB_SIZE)
    res = {}
    for shape in ((8, 1, 1), (2, 2, 2)):
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), ("dp", "pp", "tp"))
        loader = dataset.BatchLoader(ds, T, B, NamedSharding(mesh, P("dp", None)), seed=0)
        it = loader.iterate(0)
        x, y = next(it)                                   # warm up
        t = time.perf_counter()
        for _ in range(n_batches):
            x, y = next(it)
            x.block_until_ready()
            y.block_until_ready()
        dt = time.perf_counter() - t
        loader.close()
        tps = n_batches * B * T / dt
        res[shape] = tps
        print(f"loader     mesh dp,pp,tp={shape}: {n_batches} batches of {B}x{T} in {dt:.2f} s = "
              f"{tps / 1e6:.2f} M tokens/s ({dt / n_batches * 1e3:.2f} ms/batch)", flush=True)
    worst = min(res.values())
    steps = worst / TINY_TOKENS_PER_STEP
    print(f"tiny config consumes {TINY_TOKENS_PER_STEP:,} tokens/step (32 x 128): the loader can feed "
          f"{steps:,.0f} tiny steps/s, so it delivers >= 20x the training consumption whenever a tiny "
          f"training step takes >= {20 / steps * 1e3:.1f} ms on this machine", flush=True)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--loader_batches", type=int, default=300)
    p.add_argument("--repeat", type=int, default=4, help="tokenize the bundled corpus this many times over")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        bench_tokenizer(a.workers, tmp, a.repeat)               # before JAX starts threads, so the pool forks
        bench_loader(tmp, a.loader_batches)


if __name__ == "__main__":
    main()
