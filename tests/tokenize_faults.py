"""Crash the real tokenizer at a chosen point, from outside data/ (nothing there knows about tests).

    python tests/tokenize_faults.py EVENT:N [data.tokenize_local flags ...]
    python tests/tokenize_faults.py none    [data.tokenize_local flags ...]

runs the multiprocessing driver (`data.tokenize_local.main`) with its writer watched by monkeypatching
and, at the N-th EVENT of this process (counting from 1), SIGKILLs the driver's process group: its pool
workers too, like `kill -9 -PGID` (the tests start it in a new session; outside one, only itself):

  doc:N       right after the N-th document is packed (mid-shard; in a resumed run the tail of the
              document straddling the last shard boundary counts as one),
  tmp:N       halfway through writing the N-th shard: half its bytes flushed, then killed (a torn temp
              file, or a torn upload on an object store),
  shard:N     after the N-th shard is in place, before the manifest lists it,
  manifest:N  after the first manifest written since the N-th shard (mid-document when one straddles).

`install(setattr, point, fire)` is the same watch for an in-process run, with any `fire` (the in-process
tests raise an exception where this script kills). `fakegcs://` URLs (tests/fakegcs.py) work here too.
"""
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [p for p in (os.path.dirname(HERE), HERE) if p not in sys.path]

import fakegcs  # noqa: E402,F401  (registers fakegcs://)
from data import manifest, shards  # noqa: E402

EVENTS = ("doc", "tmp", "shard", "manifest")


def parse(spec):
    """'doc:7' -> ('doc', 7)."""
    event, n = spec.split(":")
    if event not in EVENTS:
        raise ValueError(f"unknown event {event!r}; one of {EVENTS}")
    return event, int(n)


class _TornFile:
    """A file open for writing that writes half of what it is given, flushes, and fires."""

    def __init__(self, f, fire):
        self._f, self._fire = f, fire

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def write(self, data):
        self._f.write(data[: len(data) // 2])
        self._f.flush()
        self._fire()


class _TornFS:
    """A filesystem whose files opened for writing are _TornFiles; everything else is `fs`."""

    def __init__(self, fs, fire):
        self._fs, self._fire = fs, fire

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def open(self, path, mode="rb", **kw):
        f = self._fs.open(path, mode, **kw)
        return _TornFile(f, self._fire) if "w" in mode else f


def install(setattr, point, fire):
    """Watch the tokenizer's writer and call fire() at point = (event, n). setattr(obj, name, value)
    patches (pytest's monkeypatch.setattr, or the builtin in a process about to die)."""
    event, n = point
    seen = {"doc": 0, "shard": 0}
    write_atomic, pack = shards.Output.write_atomic, shards.Writer._pack

    def watched_write_atomic(self, name, data):
        if name == manifest.MANIFEST:
            write_atomic(self, name, data)
            if event == "manifest" and seen["shard"] == n:
                fire()
            return
        seen["shard"] += 1
        if (event, seen["shard"]) == ("tmp", n):
            fs, self.fs = self.fs, _TornFS(self.fs, fire)
            try:
                write_atomic(self, name, data)
            finally:
                self.fs = fs
        else:
            write_atomic(self, name, data)
        if (event, seen["shard"]) == ("shard", n):
            fire()

    def watched_pack(self, *args, **kwargs):
        pack(self, *args, **kwargs)
        seen["doc"] += 1
        if (event, seen["doc"]) == ("doc", n):
            fire()

    setattr(shards.Output, "write_atomic", watched_write_atomic)
    setattr(shards.Writer, "_pack", watched_pack)


def sigkill_group():
    if os.getpgrp() == os.getpid():           # we lead our own group: take the pool workers down too
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv):
    from data import tokenize_local
    if argv[0] != "none":
        install(setattr, parse(argv[0]), sigkill_group)
    return tokenize_local.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
