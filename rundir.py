"""The run directory, OUTPUT_DIR/NAME, local or on any fsspec store (gs://): its growing files
(metrics.jsonl, samples.txt; on an object store, whole numbered parts), the logger and wandb, the lock
that keeps one run per directory (on object stores too), and --restart, which moves a run aside.
"""
import atexit
import contextlib
import dataclasses
import glob
import json
import math
import os
import posixpath
import re
import socket
import sys
import time
import warnings

import fsspec

import dataset
import metrics_schema
from multihost import log


class RunRefused(Exception):
    """Starting would lose or mix work (a changed model, another run live in the directory, no readable
    checkpoint, a prompt that does not fit): main() prints the message and exits 2, nothing touched."""


def os_error(e):
    """The OS-level cause of a failed save, in one line (Orbax wraps it several layers deep)."""
    cause = e
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno:
            return str(cause)
        cause = cause.__cause__ or cause.__context__
    code = re.search(r"os_error_code='?(\d+)", str(e))
    if code:
        return f"[Errno {code.group(1)}] {os.strerror(int(code.group(1)))}"
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:300]}"


def is_url(path):
    """True for an fsspec URL (gs://bucket/x, memory://x); such a path is never touched with os.*. A file://
    URL is not one: run_dir_of turns it into the local path it names."""
    return "://" in str(path) and not str(path).startswith("file://")


def make_run_dir(run_dir):
    """RunRefused, naming --output_dir, when the run directory cannot be made (a file is in the way, a
    read-only or unwritable parent)."""
    fs, path = fsspec.core.url_to_fs(run_dir)
    created = not is_url(run_dir) and not os.path.isdir(path)
    try:
        fs.makedirs(path, exist_ok=True)       # a no-op under a bucket, where directories are prefixes
    except OSError as e:
        raise RunRefused(f"cannot create the run directory {run_dir} ({os_error(e)}); --output_dir must be a "
                         f"directory this process can write, or a URL (gs://bucket/runs)") from e
    if created:                 # a run refused at start leaves no empty directory (rmdir takes only an empty one)
        atexit.register(_remove_if_empty, path)


def _remove_if_empty(path):
    with contextlib.suppress(OSError):
        os.rmdir(path)


EXIT_WAIT_S = 5.0           # at exit, how long a store that does not answer may hold the process


def _exit_timeout(fs):
    """fsspec's per-call time limit, for the writes at exit (an async filesystem such as gcsfs takes one; gcsfs
    alone retries a refused connection for about 30 s)."""
    return {"timeout": EXIT_WAIT_S} if isinstance(fs, fsspec.asyn.AsyncFileSystem) else {}


def _warn(text):
    print(f"WARNING: {text}", file=sys.stderr, flush=True)


def _append(path, data):
    """Append `data` whole or not at all: a disk that fills up mid-write is truncated back, so that no half
    record is left to be glued to the next one."""
    with open(path, "ab", buffering=0) as f:
        start = f.seek(0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[f.write(view):]
        except OSError:
            f.truncate(start)
            raise


class RunFile:
    """One growing text file of the run directory (metrics.jsonl, samples.txt), written by process 0.

    A local directory gets every record appended at once (after a newline, should a killed process have
    left the file's last line cut short). An object store cannot append, and rewriting a growing object
    on every line would cost O(lines^2): records wait in memory and go out as whole numbered objects,
    NAME.parts/000001, 000002, ... at flush() (each checkpoint, at most every FLUSH_S seconds otherwise,
    and at close). `read_run_file` puts either layout back together.

    A write that fails (a read-only or full disk, a store that is down) never stops training: one warning,
    and the records wait in memory for the next write that succeeds. At close (also at exit, however the
    process ends) what is still waiting is tried once more, then spilled to a local file in
    $JAXFORMER_CACHE/unwritten that one line names; the next RunFile for the same file on this host (the
    same command, started again) writes the spill there first, where its records belong."""
    FLUSH_S = 60.0

    def __init__(self, run_dir, name):
        self.run_dir, self.name = run_dir, name
        self.remote = is_url(run_dir)
        self.path = f"{run_dir.rstrip('/')}/{name}" if self.remote else os.path.join(run_dir, name)
        self._buf, self._last, self._failing, self._line_ended = [], time.monotonic(), False, False
        if self.remote:
            self.fs, parts = fsspec.core.url_to_fs(f"{self.path}.parts")
            self.parts = parts.rstrip("/")
            self._next = 1 + max([int(p.split(".")[0]) for p in _part_names(self.fs, self.parts)] or [0])
        self._write_spills()
        atexit.register(self.close)

    def write(self, text):
        self._buf.append(text)
        if not self.remote or time.monotonic() - self._last >= self.FLUSH_S:
            self.flush()

    def flush(self):
        """Write what is waiting (never fatal): appended to the local file, or as the next part object."""
        if not self._buf:
            return
        try:
            self._put("".join(self._buf))
        except Exception as e:                 # metrics never stop training; kept for the next try
            self._last = time.monotonic()      # a store that is down is tried again in FLUSH_S, not every record
            if not self._failing:
                _warn(f"could not write {self._target()} ({os_error(e)}); keeping its records in memory and "
                      f"trying again {'at the next checkpoint' if self.remote else 'with the next record'}")
            self._failing = True
            return
        self._buf, self._last, self._failing = [], time.monotonic(), False

    def close(self):
        """The last try at what is waiting (at most EXIT_WAIT_S on a store); what it cannot write goes to a
        local file in $JAXFORMER_CACHE/unwritten, named in one line with what becomes of it."""
        if not self._buf:
            return
        text, n, target = "".join(self._buf), len(self._buf), self._target()
        self._buf = []
        try:
            self._put(text, **(_exit_timeout(self.fs) if self.remote else {}))
            return
        except Exception as e:
            error = f"no answer in {EXIT_WAIT_S:.0f} s" if isinstance(e, TimeoutError) else os_error(e)
        spill = os.path.join(_spill_dir(), f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{self.name}")
        # on a store, a part name no writer takes (theirs are digits alone) that sorts right after the parts
        # written before these records, and before any written after them
        part = f"{self._next - 1:06d}.{os.path.basename(spill)}" if self.remote else None
        try:
            os.makedirs(os.path.dirname(spill), exist_ok=True)
            _append(spill, text.encode("utf-8"))
            _write_whole(f"{spill}{SPILL_TARGET}", json.dumps({"target": self.path, "part": part}).encode())
        except OSError as e:
            _warn(f"{n} record(s) could not be written to {target} ({error}) nor to {spill} ({e}): they are lost")
            return
        by_hand = (f"upload it as {self.path}.parts/{part}" if self.remote else f"cat {spill} >> {self.path}")
        _warn(f"{n} record(s) could not be written to {target} ({error}); they are in {spill}: the next start of "
              f"this run on this host writes them there first (or by hand: {by_hand}, then delete {spill}*)")

    def _write_spills(self):
        """Write the records an earlier process spilled for this file (`close`), in the order they were
        spilled, and delete each spill once written; one that still cannot be written waits for the next
        start."""
        for meta_path in sorted(glob.glob(os.path.join(_spill_dir(), f"*{SPILL_TARGET}"))):
            spill = meta_path[:-len(SPILL_TARGET)]
            try:
                with open(meta_path) as f:
                    meta = json.load(f)
                if meta.get("target") != self.path:
                    continue
                with open(spill, "rb") as f:
                    data = f.read()
                if self.remote:
                    self.fs.pipe_file(f"{self.parts}/{meta['part']}", data)
                else:
                    self._put(data.decode("utf-8"))
            except (OSError, ValueError) as e:
                _warn(f"could not write the records spilled in {spill} to {self.path} ({os_error(e)}); "
                      f"trying again at the next start")
                continue
            os.remove(spill)
            os.remove(meta_path)
            lines = data.count(b"\n")
            log(f"wrote {lines} record(s) an earlier process could not write to {self.path} (they were in {spill})")

    def _target(self):
        return f"{self.path}.parts/{self._next:06d}" if self.remote else self.path

    def _put(self, text, **kwargs):
        if not self.remote:
            if not self._line_ended:           # a line cut short by a kill would swallow the next record
                self._line_ended = True
                if _ends_mid_line(self.path):
                    _append(self.path, b"\n")
            _append(self.path, text.encode("utf-8"))
            return
        self.fs.pipe_file(f"{self.parts}/{self._next:06d}", text.encode("utf-8"), **kwargs)
        self._next += 1


SPILL_TARGET = ".target.json"     # beside each spill: the file (or URL) its records belong to, and the part


def _spill_dir():
    return os.path.join(dataset.default_cache_dir(), "unwritten")


def _ends_mid_line(path):
    try:
        with open(path, "rb") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


def _write_whole(path, data):
    """A small file written whole or not at all (a temporary name, then a rename; the temporary file of a write
    that fails, a full disk's, is removed)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_whole(run_dir, name, text):
    """RUN_DIR/NAME written whole or not at all (locally a temporary name, then a rename; an object store's
    objects appear whole); its path."""
    if not is_url(run_dir):
        os.makedirs(run_dir, exist_ok=True)
        _write_whole(os.path.join(run_dir, name), text.encode())
        return os.path.join(run_dir, name)
    path = f"{run_dir.rstrip('/')}/{name}"
    fs, fs_path = fsspec.core.url_to_fs(path)
    fs.pipe_file(fs_path, text.encode())
    return path


def _part_names(fs, parts):
    """The names of a run file's parts in order: NNNNNN, and a spill's NNNNNN.SPILL right after NNNNNN."""
    try:
        names = [posixpath.basename(str(p).rstrip("/")) for p in fs.ls(parts, detail=False)]
    except FileNotFoundError:
        return []
    numbered = [n for n in names if re.fullmatch(r"\d+(\.[\w.-]+)?", n)]
    return sorted(numbered, key=lambda n: (int(n.split(".")[0]), n))


def read_run_file(run_dir, name):
    """The whole of a run file, as bytes (its reader decodes it line by line, so that a damaged byte costs one
    line): the local file, or its part objects in order on an object store."""
    fs, path = fsspec.core.url_to_fs(f"{run_dir.rstrip('/')}/{name}")
    data = fs.cat_file(path) if fs.exists(path) else b""
    return data + b"".join(fs.cat_file(f"{path}.parts/{p}") for p in _part_names(fs, f"{path}.parts"))


SKIPPED_NAMED = 10     # lines named one by one by a read's warnings; the rest in one line
_named = set()         # (file, line number) already named by this process, which may read the file more than once


def metrics_records(run_dir):
    """The records of run_dir's metrics.jsonl, in order: the one reader of it (a resume, plot.py). A line that is
    not one (not UTF-8, not JSON, or not of a kind and shape metrics_schema knows: edited or damaged) is skipped
    with a warning naming it, once per process; so is a record cut short by a kill, which the next start ends
    with a newline. The last line, while nothing ends it (being written, or cut by a kill), is skipped unsaid."""
    path = f"{run_dir.rstrip('/')}/metrics.jsonl"
    lines = read_run_file(run_dir, "metrics.jsonl").split(b"\n")
    records, skipped = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record, problem = metrics_schema.parse(line)
        if problem is None:
            records.append(record)
        elif number < len(lines) and (path, number) not in _named:
            skipped.append((number, problem))
    _named.update((path, number) for number, _ in skipped)
    for number, problem in skipped[:SKIPPED_NAMED]:
        _warn(f"{path} line {number}: {problem}; skipped")
    if len(skipped) > SKIPPED_NAMED:
        _warn(f"{path}: {len(skipped) - SKIPPED_NAMED} more lines that are not records skipped too (the first "
              f"line {skipped[SKIPPED_NAMED][0]}, the last line {skipped[-1][0]})")
    return records


class Logger:
    """metrics.jsonl and samples.txt in the run directory (local or any fsspec URL), and wandb."""

    def __init__(self, cfg, run_dir, run_id, enabled):
        self.enabled = enabled
        if enabled:
            self.metrics_file, self.samples_file = RunFile(run_dir, "metrics.jsonl"), RunFile(run_dir, "samples.txt")
        self.wandb = self.wandb_html = None
        if enabled and cfg.run.wandb:
            self.wandb, self.wandb_html = _init_wandb(cfg, run_dir, run_id)

    def flush(self):
        if self.enabled:
            self.metrics_file.flush()
            self.samples_file.flush()

    def metrics(self, record):
        if not self.enabled:
            return
        self.metrics_file.write(json.dumps(_finite(record), allow_nan=False) + "\n")
        if self.wandb is not None:
            try:
                self.wandb.log(wandb_scalars(record), step=record["step"])
            except Exception as e:                  # a tracker failure never stops training
                warnings.warn(f"wandb.log failed ({e}); continuing with metrics.jsonl only")
                self.wandb = None

    def sample(self, step, prompt, text):
        if not self.enabled:
            return
        self.samples_file.write(f"=== step {step}\n{prompt}{text}\n\n")
        if self.wandb is not None:
            try:
                self.wandb.log({"sample": self.wandb_html(f"<pre>{prompt}{text}</pre>")}, step=step)
            except Exception as e:
                warnings.warn(f"wandb sample logging failed ({e})")

    def close(self):
        if self.enabled:
            self.metrics_file.close()
            self.samples_file.close()
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception as e:
                warnings.warn(f"wandb.finish failed ({e})")


def _finite(value):
    """`value` with every non-finite float as None: json.dumps writes NaN and Infinity, which strict JSON
    readers (jq, JavaScript, pandas' default engine) reject, so metrics.jsonl holds null there."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def wandb_scalars(record):
    """A record's numbers under wandb keys: a per-MoE-layer list NAME becomes NAME/layer0, ..., and
    expert_load's per-expert lists expert_load/layer0/expert0, ...; a task's NAME tasks/TASK/NAME."""
    flat, prefix = {}, f"tasks/{record['task']}/" if "task" in record else ""
    for name, value in record.items():
        if isinstance(value, list):
            for layer, v in enumerate(value):
                if isinstance(v, list):
                    flat.update({f"{name}/layer{layer}/expert{e}": x for e, x in enumerate(v)})
                else:
                    flat[f"{name}/layer{layer}"] = v
        elif isinstance(value, (int, float)) and name not in ("step", "time"):
            flat[prefix + name] = value
    return flat


def _init_wandb(cfg, run_dir, run_id):
    """(wandb run, wandb.Html): online when WANDB_API_KEY is set, otherwise offline files under the run dir;
    (None, None) when it cannot start, which is never fatal."""
    try:
        import wandb      # here, not at the top: only --wandb runs pay its import (about 2 s)
        if is_url(run_dir):                   # wandb writes a local directory: keep it in the cache
            run_dir = os.path.join(dataset.default_cache_dir(), "wandb", run_id)
            os.makedirs(run_dir, exist_ok=True)
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "jaxformer"), name=cfg.run.name, id=run_id,
                         resume="allow", dir=run_dir, mode=mode, config=dataclasses.asdict(cfg),
                         settings=wandb.Settings(init_timeout=float(os.environ.get("WANDB_INIT_TIMEOUT", 30)),
                                                 silent=True))
        log(f"wandb: {mode} run {run_id}" + (f" in {run_dir}/wandb" if mode == "offline" else ""))
        return run, wandb.Html
    except Exception as e:
        warnings.warn(f"wandb could not start ({type(e).__name__}: {e}); continuing with metrics.jsonl only")
        return None, None



def move_aside(src, dst):
    """Rename a checkpoint directory, locally or on any fsspec store (there: copy + delete)."""
    fs, src_path = fsspec.core.url_to_fs(src)
    if fs.exists(src_path):
        dst_path = fsspec.core.url_to_fs(dst)[1]
        fs.makedirs(posixpath.dirname(dst_path), exist_ok=True)
        fs.mv(src_path, dst_path, recursive=True)


RUN_FILES = ("checkpoints", "unreadable_checkpoints", "metrics.jsonl", "metrics.jsonl.parts", "samples.txt",
             "samples.txt.parts", "wandb")


def set_aside_previous_run(run_dir):
    """--restart: move the run's checkpoints and logs to RUN_DIR/replaced/TIME (kept, never deleted)."""
    fs, path = fsspec.core.url_to_fs(run_dir)
    names = [n for n in RUN_FILES if fs.exists(f"{path.rstrip('/')}/{n}")]
    if names:
        dst = f"{run_dir.rstrip('/')}/replaced/{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
        for name in names:
            move_aside(f"{run_dir.rstrip('/')}/{name}", f"{dst}/{name}")
        log(f"--restart: moved {', '.join(names)} to {dst}")


def lock_run_dir(run_dir):
    """Create RUN_DIR and take RUN_DIR/lock for this process (host, pid, start time), released at exit if it is
    still this process'. RunRefused when a live run holds it, or when the directory cannot be created or
    written (nothing else is touched); a lock whose process is provably gone (killed, host rebooted) is taken
    over with a warning. On an object store the lock is an object created only where none exists (GCS: a
    generation precondition), so two runs cannot both take it there either."""
    make_run_dir(run_dir)
    lock = _ObjectLock(run_dir) if is_url(run_dir) else _FileLock(run_dir)
    mine = dict(_process_identity(os.getpid()), host=_hostname(),
                started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    try:
        for _ in range(3):
            if lock.create(mine):
                atexit.register(lock.release, mine)
                return lock.path
            holder, token = lock.read()
            if token is None:
                continue                # released meanwhile
            if holder is not None and _alive(holder):
                raise RunRefused(f"{run_dir} is in use by another run: pid {holder.get('pid')} on "
                                 f"{holder.get('host')}, started {holder.get('started')} (lock {lock.path}); stop "
                                 f"it or use another --name; if that run is gone, delete {lock.path}")
            log(f"WARNING: taking over {lock.path}: " + (
                f"pid {holder.get('pid')} on {holder.get('host')} that held it is gone" if holder is not None else
                "it holds no lock record this code can read (not written by a run, or cut short)"))
            lock.remove(token)
        raise RunRefused(f"could not take the lock {lock.path}: other runs keep taking it")
    except OSError as e:
        raise RunRefused(f"cannot write the run directory {run_dir} ({os_error(e)}); --output_dir must be a "
                         f"directory this process can write") from e


class _FileLock:
    """RUN_DIR/lock in a local directory: a hard link of a file written whole, so that it appears atomically
    and only where none exists. Its token (what read() found) is True."""

    def __init__(self, run_dir):
        self.path = os.path.join(run_dir, "lock")
        self._tmp = f"{self.path}.{os.getpid()}.tmp"

    def create(self, mine):
        try:
            with open(self._tmp, "w") as f:
                json.dump(mine, f)
            os.link(self._tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(OSError):
                os.remove(self._tmp)

    def read(self):
        try:
            with open(self.path) as f:
                return json.load(f), True
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError):
            return None, True

    def remove(self, token):
        try:                            # not atomic with the read: two runs taking over at once can both win
            os.remove(self.path)
        except FileNotFoundError:
            pass

    def release(self, mine):
        """At exit; never raises (a directory turned read-only keeps the lock: the next run takes it over)."""
        try:
            if self.read()[0] == mine:
                self.remove(True)
        except OSError:
            pass


class _ObjectLock:
    """RUN_DIR/lock on an fsspec object store, written with fsspec's create-only mode (GCS and S3: a
    precondition the store enforces). On GCS read() returns the object's generation as its token and
    remove() deletes only that generation, so a takeover never deletes the lock a third run just took;
    elsewhere the token is the bytes read, compared again just before the delete."""

    def __init__(self, run_dir):
        self.path = f"{run_dir.rstrip('/')}/lock"
        self.fs, self._key = fsspec.core.url_to_fs(self.path)
        self._gcs = "gs" in self.fs.protocol           # gcsfs: ("gs", "gcs")

    def create(self, mine):
        try:
            self.fs.pipe_file(self._key, json.dumps(mine).encode(), mode="create")
            return True
        except FileExistsError:
            return False

    def read(self, **kwargs):
        try:
            if self._gcs:               # the body and its generation from one request
                headers, body = self.fs.call("GET", "b/{}/o/{}", *self.fs.split_path(self._key)[:2], alt="media",
                                             **kwargs)
                token = headers["X-Goog-Generation"]
            else:
                body = token = self.fs.cat_file(self._key, **kwargs)
        except FileNotFoundError:
            return None, None
        try:
            return json.loads(body), token
        except ValueError:
            return None, token

    def remove(self, token, **kwargs):
        try:
            if self._gcs:
                self.fs.call("DELETE", "b/{}/o/{}", *self.fs.split_path(self._key)[:2], ifGenerationMatch=token,
                             **kwargs)
            elif self.fs.cat_file(self._key, **kwargs) == token:
                self.fs.rm_file(self._key, **kwargs)
        except (FileNotFoundError, FileExistsError):   # gone, or replaced (GCS answers 412 as FileExistsError)
            pass

    def release(self, mine):
        """At exit, within EXIT_WAIT_S; never raises (a store that is down keeps the lock: the next run on this
        host takes it over)."""
        try:
            holder, token = self.read(**_exit_timeout(self.fs))
            if holder == mine:
                self.remove(token, **_exit_timeout(self.fs))
        except Exception:
            pass


def _process_identity(pid):
    """pid plus what tells it from a later process with the same pid: boot id and start time (Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        with open(f"/proc/{pid}/stat") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]      # field 22, starttime in clock ticks
        return {"pid": pid, "boot_id": boot, "proc_start": started}
    except (OSError, IndexError):
        return {"pid": pid}


def _alive(holder):
    """False only when the lock's process is provably gone: same host, and no process with its identity."""
    if holder.get("host") != _hostname():
        return True
    if "proc_start" not in holder:  # no /proc: whether any process has that pid
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return False
        except (OSError, KeyError, ValueError):
            pass
        return True
    return _process_identity(holder["pid"]) == {k: holder.get(k) for k in ("pid", "boot_id", "proc_start")}


def _hostname():
    return socket.gethostname()


def run_dir_of(rc):
    """OUTPUT_DIR/NAME; a file:// URL is the local path it names (os.* and Orbax are given the path)."""
    if is_url(rc.output_dir):
        return f"{rc.output_dir.rstrip('/')}/{rc.name}"
    local = fsspec.core.url_to_fs(rc.output_dir)[1] if rc.output_dir.startswith("file://") else rc.output_dir
    return os.path.join(local, rc.name)
