"""Data throughput benchmark: `python scripts/data_bench.py [--loader_batches 300] [--pod_only]`.

1. Tokenizer: the bundled corpus 4 times over (~4M tokens) through the multiprocessing driver with 1 and 2 workers,
   end to end (read with `datasets`, encode, pack, write shards + manifest), tokens/s.
2. Loader: BatchLoader over the bundled train shards, global batch 16 x T=128 on 8 (simulated CPU)
   devices, meshes dp=8 and (2,2,2), through the prefetching iterator; tokens/s delivered, to compare
   with the tiny training config's consumption (32 sequences x 128 tokens per step).
3. Pod scale: a train split of 2,000 shards, local (sparse files of the guide's 1e8 tokens: 800 GB that
   take no disk) and on a local GCS server (data/emulator.py; 32 KB objects): loader start-up time
   (manifest + one listing with every shard's size checked) and the bytes one host of the guide's
   8 reads per step (moe1B: 32 of 256 rows, T = 1024), against rows x (T + 1) x 4.
"""
import argparse
import gzip
import os
import shutil
import socket
import sys
import tempfile
import threading
import time

import fsspec
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dataset                                                      # noqa: E402 (after the path above)
from data import corpus, emulator, shards, tokenize_local          # noqa: E402
from data import tokenizer as tok                                   # noqa: E402

TINY_TOKENS_PER_STEP = 32 * 128


def _eight_cpu_devices():
    """Before JAX's first use: 8 simulated CPU devices (a mesh like a small pod's)."""
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)


def bench_tokenizer(workers_list, tmp, repeat):
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
    d = dataset.ensure_bundled_shards(os.path.join(tmp, "cache"))
    ds = dataset.TokenDataset(d, "train", tok.VOCAB_SIZE)
    res = {}
    for shape in ((8, 1, 1), (2, 2, 2)):
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), ("dp", "pp", "tp"))
        loader = dataset.BatchLoader(ds, T, B, NamedSharding(mesh, PartitionSpec("dp", None)), seed=0)
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


def _proc_rchar():
    """Bytes this process has read through any read()-like system call (files and sockets)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def make_split(url, n_shards, shard_tokens, sparse):
    """A complete shard directory: n_shards train shards (+1 val) of shard_tokens zeros; sparse local files
    take no disk. The sha256 fields are placeholders (the loader never hashes; data.verify would flag them)."""
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(root, exist_ok=True)
    entries, blobs = [], {}
    for split, n in (("val", 1), ("train", n_shards)):
        for i in range(n):
            name = f"{split}_{i:06d}.bin"
            entries.append({"file": name, "split": split, "tokens": shard_tokens, "sha256": "0" * 64})
            if sparse:
                with open(f"{root}/{name}", "wb") as f:
                    f.truncate(4 * shard_tokens)
            else:
                blobs[f"{root}/{name}"] = bytes(4 * shard_tokens)
    if blobs:
        fs.pipe(blobs)                  # concurrent uploads
    w = shards.Writer(shards.Output(url), plan=[], shard_size=shard_tokens, shards=entries, complete=True, counts=None)
    w._write_manifest()


class CountingProxy:
    """A TCP relay on 127.0.0.1 to a local server that counts the bytes sent back to the client (HTTP
    headers included): what a host really receives per step from the GCS emulator."""

    def __init__(self, target_port):
        self.target, self.received, self._lock = target_port, 0, threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            client, _ = self.sock.accept()
            upstream = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._relay, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._relay, args=(upstream, client, True), daemon=True).start()

    def _relay(self, src, dst, count):
        try:
            while data := src.recv(1 << 16):
                if count:
                    with self._lock:
                        self.received += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass


def bench_pod_scale(url, n_shards, shard_tokens, steps=20, T=1024, global_batch=256, n_hosts=8,
                    received=_proc_rchar):
    """received(): bytes this host has taken in so far (default: read/pread calls, i.e. local files)."""
    t = time.perf_counter()
    make_split(url, n_shards, shard_tokens, sparse="://" not in url)
    made = time.perf_counter() - t
    mesh = Mesh(np.array(jax.devices()[:n_hosts]).reshape(n_hosts, 1, 1), ("dp", "pp", "tp"))
    t = time.perf_counter()
    ds = dataset.TokenDataset(url, "train", tok.VOCAB_SIZE)
    loader = dataset.BatchLoader(ds, T, global_batch, NamedSharding(mesh, PartitionSpec("dp", None)), seed=0)
    startup = time.perf_counter() - t
    rows = loader.local_rows(jax.devices()[:1])            # one host's devices: here 1 of the 8 dp rows
    want = len(rows) * (T + 1) * 4
    before, t = received(), time.perf_counter()
    for step in range(steps):
        loader.read_rows(step, rows)
    per_step_s = (time.perf_counter() - t) / steps
    wire, payload = (received() - before) / steps, ds.bytes_read / steps
    where = "gcs emulator" if "://" in url else "local"
    print(f"pod-scale  {where}: {n_shards:,} train shards of {shard_tokens:,} tokens "
          f"({n_shards * shard_tokens * 4 / 1e9:,.1f} GB; made in {made:.1f} s): start-up {startup:.3f} s; "
          f"one host's {len(rows)} of {global_batch} rows x T+1={T + 1}: {payload:,.0f} bytes/step from storage "
          f"= {payload / want:.3f} x rows x (T+1) x 4 ({want:,})"
          + f"; {wire:,.0f} bytes/step received ({wire / want:.3f} x"
          + (", read/pread calls)" if "://" not in url else ", HTTP headers included)")
          + f"; {per_step_s * 1e3:.1f} ms/step", flush=True)
    return {"startup_s": startup, "payload_ratio": payload / want, "wire_ratio": wire / want}


def bench_pod(tmp, n_shards):
    res = {"local": bench_pod_scale(os.path.join(tmp, "pod"), n_shards, 100_000_000)}
    proc, url = emulator.start()
    try:
        proxy = CountingProxy(int(url.rsplit(":", 1)[1]))
        emulator.point_this_process_at(f"http://127.0.0.1:{proxy.port}")
        res["emulator"] = bench_pod_scale(f"gs://{emulator.DEFAULT_BUCKET}/pod", n_shards, 8_192,
                                          received=lambda: proxy.received)
    finally:
        proc.terminate()
        proc.wait()
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--loader_batches", type=int, default=300)
    p.add_argument("--repeat", type=int, default=4, help="tokenize the bundled corpus this many times over")
    p.add_argument("--pod_shards", type=int, default=2000, help="shards of the pod-scale loader split")
    p.add_argument("--pod_only", action="store_true", help="only the pod-scale loader figures")
    a = p.parse_args(argv)
    # gcsfs picks its plain GCSFileSystem (no gRPC bucket-type probe) only if this is set before its import
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    _eight_cpu_devices()
    with tempfile.TemporaryDirectory() as tmp:
        if not a.pod_only:
            bench_tokenizer(a.workers, tmp, a.repeat)           # before JAX starts threads, so the pool forks
            bench_loader(tmp, a.loader_batches)
        bench_pod(tmp, a.pod_shards)


if __name__ == "__main__":
    main()
