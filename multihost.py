"""What main.py needs to run as one of several processes (one per host): setting up the devices (and checking
a config against them) and joining jax.distributed within a time limit, printing on process 0, saying it has
started, the stop signals, agreeing on a stop without a per-step host sync, and the hang watchdog.

Environment:
  JAXFORMER_INIT_TIMEOUT=S   seconds to wait for every process to join jax.distributed (default 300);
                             then exit 1 with one line naming the coordinator and how many joined.
  JAXFORMER_STOP_CHECK_S=S   seconds of training between two cross-process stop checks (default 5):
                             a stop (SIGTERM) is honoured within about this plus a step; each check
                             costs one host-device sync.
"""
import errno
import faulthandler
import glob
import importlib.metadata
import importlib.util
import os
import signal
import sys
import threading
import time
import warnings

import jax
import numpy as np
from jax._src import distributed   # the state initialize() resolved, also when auto-detected
from jax.experimental import multihost_utils

import utils

INIT_TIMEOUT_ENV, INIT_TIMEOUT_S = "JAXFORMER_INIT_TIMEOUT", 300
STOP_CHECK_ENV, STOP_CHECK_S = "JAXFORMER_STOP_CHECK_S", 5


def seconds_from_env(name, default):
    """Environment variable `name` as a positive whole number of seconds, else `default`; a
    malformed value exits 2 with one line naming it."""
    value = os.environ.get(name, str(default))
    if not value.isdigit() or int(value) < 1:
        print(f"error: {name} must be a positive whole number of seconds, got {value!r}", file=sys.stderr)
        sys.exit(2)
    return int(value)


def initialize(**kwargs):
    """jax.distributed.initialize(**kwargs), bounded by $JAXFORMER_INIT_TIMEOUT. When a process never joins,
    JAX waits and then aborts with a stack trace that says neither where nor who; instead this
    process exits 1 after the timeout with one line saying both."""
    timeout = seconds_from_env(INIT_TIMEOUT_ENV, INIT_TIMEOUT_S)
    joined = threading.Event()

    def give_up():
        if not joined.wait(timeout):
            print(f"error: {_not_joined(timeout)}", file=sys.stderr, flush=True)
            os._exit(1)                 # the main thread is blocked inside JAX: nothing else can end it
    threading.Thread(target=give_up, daemon=True).start()
    # JAX's own limit comes later, so the line above is what the user sees
    try:
        jax.distributed.initialize(**kwargs, initialization_timeout=timeout + 60)
    finally:
        joined.set()                    # also when it raises (a single TPU host): the caller decides


def _not_joined(timeout):
    """The timeout line: on the coordinator's process, how many processes joined it; elsewhere,
    whether this process reached it."""
    state = distributed.global_state
    address = getattr(state, "coordinator_address", None) or os.environ.get("JAX_COORDINATOR_ADDRESS", "?")
    n, pid = getattr(state, "num_processes", None) or "?", getattr(state, "process_id", None)
    port = int(address.rsplit(":", 1)[1]) if address.rsplit(":", 1)[-1].isdigit() else None
    head = f"jax.distributed: not every process joined within {timeout} s ({INIT_TIMEOUT_ENV}): "
    if pid == 0:
        count = _connections(port, local=True)
        joined = f"{count} of {n} processes" if count is not None else f"an unknown number of {n} processes"
        return (head + f"{joined} joined the coordinator at {address} (this process); start the missing "
                f"host(s), or check JAX_NUM_PROCESSES")
    reached = _connections(port, local=False)
    where = ("connected to" if reached else "could not reach") if reached is not None else "waited for"
    return (head + f"process {pid} of {n} {where} the coordinator at {address}; "
            f"process 0's log says how many joined")


def _connections(port, local):
    """Established TCP connections with `port` as their local (local=True: clients of the
    coordinator service on this host) or remote end, from /proc/net; None where unreadable."""
    if port is None:
        return None
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            return None
        for row in rows:
            fields = row.split()
            end = fields[1] if local else fields[2]
            count += fields[3] == "01" and int(end.rsplit(":", 1)[1], 16) == port   # 01: ESTABLISHED
    return count


def started_line(process_index, process_count):
    """Printed by every process once its first training step is dispatched (start-up done: config,
    data, restore, compile); launcher.sh and run.sh --ready wait for it (run.sh: ready_line)."""
    return f"jaxformer started: process {process_index} of {process_count}, first training step dispatched"


class StopAgreement:
    """stop(step, synced) -> True when every process is to stop after `step` (a SIGTERM/SIGINT on any
    of them): all processes must save and exit at the same step.

    Agreeing means a collective, which makes the host wait for the device; doing it every step
    would undo the one-step-ahead dispatch. So processes agree only at `synced` steps (log
    intervals, which sync anyway) and every K steps, K chosen so that checks come about every
    $JAXFORMER_STOP_CHECK_S seconds: each check gathers the time every process spent since the
    last one, and all derive the next check step from those same gathered numbers, so every
    process checks at the same steps. A single process needs no agreement and answers at once."""

    PROBE_STEPS = 4     # steps to the second check, the first that measures the step time

    def __init__(self, requested):
        self.requested = requested
        self.check_s = seconds_from_env(STOP_CHECK_ENV, STOP_CHECK_S)
        self.next_check, self.last_step, self.last_t = None, None, None

    def __call__(self, step, synced=False):
        if jax.process_count() == 1:
            return bool(self.requested())
        if self.next_check is not None and step < self.next_check and not synced:
            return False
        now = time.monotonic()
        mine = [float(bool(self.requested())), now - self.last_t if self.last_t is not None else 0.0]
        every = np.asarray(multihost_utils.process_allgather(np.array(mine, np.float32)))   # [processes, 2]
        steps = step - self.last_step if self.last_step is not None else 0
        per_step = float(every[:, 1].max()) / steps if steps else 0.0
        # the step after a check is dispatched at once (the check synced): measure over a few steps
        self.next_check = step + (max(1, int(self.check_s / per_step)) if per_step > 0 else self.PROBE_STEPS)
        self.last_step, self.last_t = step, now
        return bool(every[:, 0].max() > 0)


def log(*args, **kwargs):
    """Print on process 0 only (every host runs this same script)."""
    if jax.process_index() == 0:
        print(*args, **kwargs, flush=True)


def set_up_devices(cfg):
    """Before any JAX computation: the simulated CPU devices (--cpu_devices), then the multi-host join,
    which exits with one line when not every process joins within $JAXFORMER_INIT_TIMEOUT s."""
    if cfg.run.cpu_devices > 0:
        jax.config.update("jax_num_cpu_devices", cfg.run.cpu_devices)
        if not os.environ.get("JAX_PLATFORMS"):
            jax.config.update("jax_platforms", "cpu")
    elif not os.environ.get("JAX_PLATFORMS") and not _on_tpu_vm() and importlib.util.find_spec("libtpu"):
        # libtpu off a TPU VM (requirements-tpu.txt, for --compile_for): JAX would start its runtime, which
        # looks for a TPU and prints a screen of errors; "cuda" is skipped where no NVIDIA GPU is visible
        jax.config.update("jax_platforms", "cuda,cpu" if _has_cuda_plugin() else "cpu")
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        # GPU/CPU clusters (and launcher.sh): the coordinator and this host's rank come from the environment.
        if (jax.config.jax_platforms or "").startswith("cpu"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        initialize(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                             num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                             process_id=int(os.environ["JAX_PROCESS_ID"]))
    elif os.environ.get("SLURM_NTASKS", "1") != "1":
        initialize()            # SLURM: everything is auto-detected
    elif _on_tpu_vm():
        try:                              # TPU pod slices: auto-detected from the TPU metadata
            initialize()
        except Exception as e:            # a single-host TPU VM needs no coordination
            if _tpu_multihost():
                raise
            # one line: the cause (often the TPU metadata server, unreachable) is a page of HTTP retries
            print(f"one TPU host: running without jax.distributed ({type(e).__name__})", file=sys.stderr, flush=True)


def validate_on_devices(cfg):
    """cfg, checked against this job's devices and processes (ConfigError otherwise)."""
    utils.validate(cfg, jax.device_count())
    return utils.check_slices(cfg, jax.process_count(), len({getattr(d, "slice_index", 0) for d in jax.devices()}))


def _has_cuda_plugin():
    return any("cuda" in ep.name for ep in importlib.metadata.entry_points(group="jax_plugins"))


def _on_tpu_vm():
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
                or os.environ.get("TPU_ACCELERATOR_TYPE") or os.environ.get("TPU_WORKER_HOSTNAMES"))


def _tpu_multihost():
    """True on a TPU VM that is one host of several (TPU_WORKER_HOSTNAMES lists them all)."""
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h]) > 1


class StopSignals:
    """SIGTERM, SIGHUP (a closed terminal or tmux pane), a first Ctrl-C, or stdout or stderr gone (a closed
    terminal whose hangup did not reach this process, a dead pipe) set .requested (and .signal, its name):
    the loop finishes its step, saves, says where, then exits 0. A signal ignored when the process started
    stays ignored (nohup's SIGHUP, a background job's SIGINT), so `nohup python main.py &` outlives its
    terminal. A second Ctrl-C exits 130 at once without saving, even inside a long XLA call.

    Python runs a signal handler only when the main thread is back in the interpreter, which a compile
    or a step is not; so what a Ctrl-C does is said, and a second one obeyed, by a thread that reads the
    signals from the interpreter's wakeup pipe (signal.set_wakeup_fd) the moment they arrive. .compiling
    names what the main thread is compiling, for the first Ctrl-C to say why the stop waits."""

    def __init__(self):
        self.requested, self.signal, self.compiling = False, None, None
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            if signum == signal.SIGTERM or signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, self.on_signal)
        sys.stdout, sys.stderr = _Output(sys.stdout, 1, self.on_lost), _Output(sys.stderr, 2, self.on_lost)
        wakeup_r, wakeup_w = os.pipe()
        os.set_blocking(wakeup_w, False)
        signal.set_wakeup_fd(wakeup_w, warn_on_full_buffer=False)
        threading.Thread(target=self._answer_ctrl_c, args=(wakeup_r,), daemon=True).start()

    def on_signal(self, signum, frame):
        self.requested = True
        self.signal = self.signal or signal.Signals(signum).name

    def on_lost(self, name, error):
        self.requested = True
        self.signal = self.signal or f"{name} lost ({errno.errorcode.get(error.errno, error.errno)})"

    def _answer_ctrl_c(self, wakeup_r):
        presses = 0
        while True:
            for signum in os.read(wakeup_r, 64):       # one byte per signal caught, its number
                if signum != signal.SIGINT:
                    continue
                presses += 1
                # os.write: the main thread may hold the lock of a print to stderr
                if presses > 1:
                    _write_quietly(2, b"\nCtrl-C again: exiting now without saving (exit 130); the newest "
                                      b"checkpoint is the one to resume from\n")
                    os._exit(130)
                doing = (f"XLA is compiling {self.compiling}, which cannot be interrupted; then the step runs, "
                         f"the run saves and exits" if self.compiling else "finishing this step, then saving and exiting")
                _write_quietly(2, f"\nCtrl-C: {doing}; Ctrl-C again to exit now without saving\n".encode())


class _Output:
    """sys.stdout or sys.stderr, whose terminal or pipe may go away: a write that fails so (EIO: the
    terminal is gone; EPIPE: the pipe's reader, tee or a pane, is) points the file descriptor at
    /dev/null and tells on_lost, so that the run saves and exits 0 rather than dying in a print. What still
    reads the output (run.sh's log, through a tee that outlives the pane) gets the rest of it."""

    def __init__(self, stream, fd, on_lost):
        self._stream, self._fd, self._on_lost = stream, fd, on_lost

    def write(self, text):
        return self._guarded(self._stream.write, text)

    def flush(self):
        return self._guarded(self._stream.flush)

    def _guarded(self, method, *args):
        try:
            return method(*args)
        except OSError as e:
            if e.errno not in (errno.EIO, errno.EPIPE):
                raise
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._fd)
            os.close(null)
            self._on_lost(("stdout", "stderr")[self._fd - 1], e)
            return len(args[0]) if args else None

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _write_quietly(fd, data):
    """os.write that ignores a terminal that is gone: a signal handler or the watchdog must go on."""
    try:
        os.write(fd, data)
    except OSError:
        pass


HUNG_EXIT = 3


class Watchdog:
    """--hang_timeout: a collective that waits on a stopped, hung or lost host never returns, and the
    run would wait forever. Once the first step has run (its compile is over), every sign of progress
    (`progress`: a step's results fetched, an evaluation, a save) restarts the clock; with none for
    `timeout` seconds this process writes what it was doing and every thread's stack to stderr (the
    host's log) and exits HUNG_EXIT, so that a supervisor can restart the run from its last checkpoint.
    SIGUSR1 writes the same stacks at any time and the run goes on (run.sh --stacks sends it).

    With --heartbeat_file, every progress (and `note`) rewrites that file whole (a temporary name, then
    a rename), one "key value" line each: step (the newest step whose results were fetched), step_time
    (Unix seconds when it was), time (of this write), doing, and the notes (goodput lines); launcher.sh
    --status reads it on every host."""

    def __init__(self, timeout, heartbeat_file=""):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        # Asked of jax once, here: when the watchdog fires, the main thread may be unwinding an error (a
        # collective's timeout) through jax's shutdown, and a call into jax then tries to make a new backend,
        # fails, and ends this thread instead of the process.
        self.process = f"{jax.process_index()} of {jax.process_count()}"
        self.timeout, self.last, self.doing = timeout, None, "compiling the training step"
        self.heartbeat, self.step, self.step_time, self.notes = heartbeat_file, None, None, {}
        self._beat()                        # the clock starts with the first step; the file at once
        if timeout:
            threading.Thread(target=self._watch, daemon=True).start()

    def progress(self, doing, step=None):
        self.last, self.doing = time.monotonic(), doing
        if step is not None and step != self.step:
            self.step, self.step_time = step, time.time()
        self._beat()

    def note(self, **lines):
        self.notes.update(lines)
        self._beat()

    def _beat(self):
        if not self.heartbeat:
            return
        fields = {"step": self.step, "step_time": self.step_time, "time": time.time(), "doing": self.doing,
                  "process": self.process, **self.notes}
        tmp = f"{self.heartbeat}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write("".join(f"{k} {'' if v is None else v}\n" for k, v in fields.items()))
            os.replace(tmp, self.heartbeat)
        except OSError as e:                # a status aid: never the run's end
            warnings.warn(f"--heartbeat_file {self.heartbeat}: cannot write it ({e}); not writing it again")
            self.heartbeat = ""

    def _watch(self):
        while True:
            time.sleep(min(5.0, self.timeout / 4))
            last = self.last
            if last is not None and time.monotonic() - last > self.timeout:
                # os.write and faulthandler: the main thread may hold locks print would need
                _write_quietly(2, (f"\nerror: process {self.process} made no progress "
                                   f"for {self.timeout} s (--hang_timeout) after: {self.doing}; a host is stopped, "
                                   f"hung or gone if this waits in a collective. Every thread's stack follows; "
                                   f"exiting {HUNG_EXIT} (the same command resumes from the last checkpoint)\n").encode())
                faulthandler.dump_traceback(all_threads=True)
                os._exit(HUNG_EXIT)
