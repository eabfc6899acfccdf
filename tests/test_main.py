"""main.py end to end, as subprocesses on CPU: exact resume after SIGKILL and SIGTERM, the same loss
curve on meshes (1,1,1) and (2,2,2) (and a checkpoint restored across them), fallback from a corrupted
newest checkpoint, and --wandb without network or key.

Faults come from outside, as in production: the test watches the run's metrics.jsonl and checkpoint
directory and sends a real SIGKILL or SIGTERM to the process. Wherever the signal lands, resume is
checked bit-for-bit on CPU against an uninterrupted run: per-step losses after the restart and the
final parameters are identical. Samples are off (--max_tokens 0) except where a test asks for them.
A persistent XLA compilation cache shared by the runs keeps the suite to a couple of minutes.
"""
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ceiling import CEILING_S
from launch_util import free_port
from run_util import (MESH1, MESH8, N, REPO, SPAN, TINY_FLAGS, assert_final_line_compares_with_the_unigram_entropy,
                      checkpoints, last_step, records, run, start, unoptimized, wait_for, wait_for_step)

PHASES = ("startup", "compile", "train", "eval", "checkpoint", "tasks", "sample")


def losses(out):
    """Per-step training loss; after a restart the last record of a step wins."""
    return {r["step"]: r["loss"] for r in records(out) if "loss" in r}


def params(out, step):
    """The checkpoint's params and aux-loss-free routing bias."""
    import jax
    import orbax.checkpoint as ocp
    path = os.path.join(out, "run", "checkpoints", str(step), "state")
    with ocp.StandardCheckpointer() as ckptr:      # onto this process's first device, whatever mesh saved it
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        state = ckptr.restore(path, jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one),
                                                 ckptr.metadata(path).item_metadata.tree))
    return jax.tree.map(np.asarray, {"params": state["params"], "router_bias": state["router_bias"]})


def assert_same_params(a, b):
    import jax
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def baseline(cpu_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    run(cpu_env, out, *MESH1)
    return out, losses(out)


def test_straight_run_logs_every_step_and_checkpoints(baseline):
    out, curve = baseline
    assert sorted(curve) == list(range(1, N + 1))
    assert all(np.isfinite(v) for v in curve.values())
    assert curve[N] < curve[1]
    assert sorted(os.listdir(os.path.join(out, "run", "checkpoints"))) == ["10", "20"]
    records = [json.loads(l) for l in open(os.path.join(out, "run", "metrics.jsonl"))]
    evals = [r for r in records if "val_loss" in r]
    assert len(evals) == N and all(len(r["expert_load"]) == 2 and len(r["expert_load"][0]) == 4 for r in evals)
    for r in evals:                 # per MoE layer: idle experts, max/mean load, drops, balance term
        assert all(len(r[name]) == 2 for name in ("idle_expert_fraction", "load_max_over_mean", "layer_drop_rate",
                                                  "layer_balance"))
        assert all(v >= 1 for v in r["load_max_over_mean"])
        np.testing.assert_allclose(sum(r["layer_balance"]), r["balance"], rtol=1e-5)
    assert any("unigram_entropy" in r for r in records)
    assert np.any(params(out, N)["router_bias"] != 0)


def test_resume_after_sigkill_is_exact(cpu_env, baseline, tmp_path):
    out, curve = baseline
    # Killed a couple of steps after the checkpoint of step 10 is on disk, wherever that lands (the run
    # is given more steps than it will live for, so it cannot end first; the schedule does not depend
    # on --training_steps).
    log = tmp_path / "killed"
    proc = start(cpu_env, tmp_path, log, *MESH1, steps=10 * N)
    wait_for(proc, log, lambda: N // 2 in checkpoints(tmp_path) and last_step(tmp_path) >= N // 2 + 2,
             f"the checkpoint of step {N // 2} and step {N // 2 + 2}")
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    killed = time.time()
    newest, logged = max(checkpoints(tmp_path)), last_step(tmp_path)
    assert newest < N, "killed too late to test a resume"
    time.sleep(2)                                   # the run is down for a while before its restart
    proc = run(cpu_env, tmp_path, *MESH1)
    assert f"resumed from {tmp_path}/run/checkpoints/{newest}: step {newest}," in proc.stdout
    goodput = [r for r in records(tmp_path) if "redone_steps" in r][-1]        # the resumed session's
    assert goodput["redone_steps"] == logged - newest > 0 and 0 < goodput["redone_s"] < goodput["train_s"]
    assert f"redone after the restart: {logged - newest} steps" in proc.stdout
    # the whole run: from the first session's start, its phases, the killed session's work after its
    # last checkpoint and the time down between the kill and the restart add up to its wall time
    whole = [r for r in records(tmp_path) if "run_sessions" in r][-1]
    parts = sum(whole[f"run_{p}_s"] for p in PHASES) + whole["run_lost_s"] + whole["run_down_s"]
    assert whole["run_sessions"] == 2 and parts == pytest.approx(whole["run_wall_s"], abs=0.01), whole
    assert whole["run_down_s"] == goodput["down_s"] and 2 <= goodput["down_s"] <= time.time() - killed, goodput
    assert whole["run_lost_s"] > 0 and whole["run_train_s"] > goodput["train_s"], whole
    assert re.search(rf"run goodput over 2 sessions \d+% of {SPAN}: startup .* \| lost after an interrupted session's "
                     rf"last checkpoint {SPAN} \| down between sessions {SPAN}", proc.stdout), proc.stdout
    resumed = losses(tmp_path)
    for s in range(newest + 1, N + 1):
        assert resumed[s] == curve[s], (s, resumed[s], curve[s])
    assert_same_params(params(tmp_path, N), params(out, N))


def test_the_goodput_record_adds_up_to_the_runs_wall_time(cpu_env, tmp_path):
    """Every phase, the bundled task's scoring at each checkpoint included (whose records and lines this
    also checks, with val bits per byte in each interval and at the end)."""
    started = time.time()
    proc = run(cpu_env, tmp_path, *MESH1, "--max_tokens", "4", "--eval_tasks", "kjv_endings", "--eval_tasks_limit",
               "40", steps=12)
    wall = time.time() - started
    scored = [r for r in records(tmp_path) if "task" in r]
    assert [(r["step"], r["task"], r["examples"], r["chance"]) for r in scored] == [(10, "kjv_endings", 40, 0.25),
                                                                                  (12, "kjv_endings", 40, 0.25)]
    assert all(0 <= r[m] <= 1 for r in scored for m in ("acc", "acc_norm")) and all(r["bpb"] > 0 for r in scored)
    assert re.search(r"^task @ 12: kjv_endings: acc \d+\.\d% \(chance 25%\) \| acc_norm \d+\.\d% \| bpb \d+\.\d{3} \| "
                     rf"40 examples, \d+ cut on the left \| {SPAN}$", proc.stdout, re.M), proc.stdout[-2000:]
    intervals = [r for r in records(tmp_path) if "val_loss" in r]
    assert len(intervals) == 12 and all(r["val_bpb"] > 0 for r in intervals)
    [final] = [r for r in records(tmp_path) if "final_val_loss" in r]
    assert final["final_val_bpb"] == intervals[-1]["val_bpb"]
    assert f"val cross-entropy {final['final_val_loss']:.4f} nats, {final['final_val_bpb']:.4f} bits per byte" in proc.stdout
    snapshots = [r for r in records(tmp_path) if "redone_steps" in r]   # at each checkpoint, the last step's the end's
    assert [r["step"] for r in snapshots] == [10, 12], snapshots
    goodput = snapshots[-1]
    phases = {p: goodput[f"{p}_s"] for p in PHASES}
    assert sum(phases.values()) == pytest.approx(goodput["wall_s"], rel=1e-9) and min(phases.values()) > 0, phases
    # from the process's start to its last checkpoint, against the whole process timed from outside
    # (which also holds the interpreter's start and exit)
    assert wall - 5 <= goodput["wall_s"] <= wall and goodput["wall_s"] >= 0.9 * wall, (goodput, wall)
    assert goodput["redone_steps"] == 0 and goodput["goodput"] == pytest.approx(phases["train"] / goodput["wall_s"])
    assert re.search(rf"goodput \d+% of {SPAN}: startup {SPAN} \(\d+%\) \| compile", proc.stdout), proc.stdout[-2000:]
    # one session: the run's record is the session's, and no second line
    whole = [r for r in records(tmp_path) if "run_sessions" in r][-1]       # the end's, stamped with its time
    assert whole["time"] == goodput["time"]
    assert whole["run_sessions"] == 1 and whole["run_lost_s"] == whole["run_down_s"] == 0 and goodput["down_s"] is None
    assert all(whole[f"run_{p}_s"] == v for p, v in phases.items()) and "run goodput" not in proc.stdout


def test_resume_after_sigterm_is_exact(cpu_env, baseline, tmp_path):
    out, curve = baseline
    # SIGTERM once step 7 is logged: step 7 (the signal lands in its interval's evaluation, --checkpoint_steps
    # 1) or the step in flight finishes, is checkpointed (not a regular save step), and the process exits 0.
    log = tmp_path / "terminated"
    proc = start(cpu_env, tmp_path, log, *MESH1, steps=10 * N)
    wait_for_step(proc, tmp_path, log, 7)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=CEILING_S) == 0, open(f"{log}.err").read()[-3000:]
    saved = max(checkpoints(tmp_path))
    assert 7 <= saved < N and saved == last_step(tmp_path), (saved, last_step(tmp_path))
    assert f"SIGTERM: checkpoint of step {saved} written" in open(f"{log}.out").read()
    run(cpu_env, tmp_path, *MESH1)
    resumed = losses(tmp_path)
    for s in range(saved + 1, N + 1):
        assert resumed[s] == curve[s], (s, resumed[s], curve[s])
    assert_same_params(params(tmp_path, N), params(out, N))


def test_same_curve_on_mesh_222_and_restore_across_meshes(cpu_env, baseline, tmp_path):
    out, curve = baseline
    # From scratch on (2,2,2): the first half of the curve.
    run(cpu_env, tmp_path / "scratch", *MESH8, steps=N // 2)
    mesh_curve = losses(tmp_path / "scratch")
    for s in range(1, N // 2 + 1):
        np.testing.assert_allclose(mesh_curve[s], curve[s], rtol=2e-4, err_msg=f"step {s}")
    # The routing bias moves by signs of integer load differences: the same bits on both meshes.
    np.testing.assert_array_equal(params(tmp_path / "scratch", N // 2)["router_bias"],
                                  params(out, N // 2)["router_bias"])
    # The (1,1,1) checkpoint at step 10 restored onto (2,2,2): the second half.
    ckpt = tmp_path / "cross" / "run" / "checkpoints"
    shutil.copytree(os.path.join(out, "run", "checkpoints", str(N // 2)), ckpt / str(N // 2))
    proc = run(cpu_env, tmp_path / "cross", *MESH8)
    assert "resumed from" in proc.stdout
    cross = losses(tmp_path / "cross")
    for s in range(N // 2 + 1, N + 1):
        np.testing.assert_allclose(cross[s], curve[s], rtol=5e-4, err_msg=f"step {s}")


# Two slices of 2 x 2 devices (--n_device_axis 4 1 2: dp 4 = 2 slices of 2, tp 2), one process each, joined by
# jax.distributed over gloo as two TPU slices are over DCN: the global batch of 8 as MESH1's.
SLICES_RTOL = 1e-6       # measured: 9.0e-8 at most (one ulp), over the 20 steps and both resumes
SLICES = "--n_device_axis 4 1 2 --n_slices 2 --train_batch_size 2 --val_batch_size 8 --cpu_devices 4".split()


def run_two_slices(cpu_env, out, *args, steps=N):
    """main.py as two processes, each a "slice" (process i holds slice i's devices), to their end. XLA at -O0
    (run_util.unoptimized): process 1 never reads the persistent cache (launch_util.ONE_DEVICE says why), so each
    start waited on its cold -O2 compile, and process 0, its programs read back, on it in gloo's 30-s first
    exchange; the losses keep their ulp (9.0e-8 at most at -O0 too)."""
    env = dict(cpu_env, **unoptimized(cpu_env), JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}",
               JAX_NUM_PROCESSES="2")
    cmd = [sys.executable, os.path.join(REPO, "main.py"), *TINY_FLAGS, "--output_dir", str(out), "--name", "run",
           "--training_steps", str(steps), *SLICES, *args]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=dict(env, JAX_PROCESS_ID=str(i)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    outputs = [p.communicate(timeout=CEILING_S)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(o[-3000:] for o in outputs)
    return outputs[0]


def test_two_slices_equal_one_device_and_resume_across_slice_counts(cpu_env, baseline, tmp_path):
    """The same curve on 2 slices (2 processes) as on one device, fp32: its first 10 steps from scratch, the last
    10 resumed on them from the one-device run's checkpoint; a checkpoint of one resumes on the other, both ways,
    on the same curve; the routing bias (integer counts) the same bits."""
    out, curve = baseline
    shown = run_two_slices(cpu_env, tmp_path / "slices", steps=N // 2)      # its last checkpoint: step 10
    assert "mesh: dp=4 pp=1 tp=2 (2 slices of dp=2, joined over DCN) over 8 of 8" in shown, shown[-2000:]
    on_slices = losses(tmp_path / "slices")
    assert sorted(on_slices) == list(range(1, N // 2 + 1))
    np.testing.assert_allclose([on_slices[s] for s in on_slices], [curve[s] for s in on_slices], rtol=SLICES_RTOL)
    # 2 slices -> 1 device, and 1 device -> 2 slices, from the step-10 checkpoints
    for source, target in ((tmp_path / "slices", tmp_path / "to-one"), (out, tmp_path / "to-two")):
        shutil.copytree(os.path.join(source, "run", "checkpoints", str(N // 2)),
                        target / "run" / "checkpoints" / str(N // 2))
    assert "resumed from" in run(cpu_env, tmp_path / "to-one", *MESH1).stdout
    assert "resumed from" in run_two_slices(cpu_env, tmp_path / "to-two")
    for target in (tmp_path / "to-one", tmp_path / "to-two"):
        resumed = losses(target)
        assert sorted(resumed) == list(range(N // 2 + 1, N + 1))
        np.testing.assert_allclose([resumed[s] for s in resumed], [curve[s] for s in resumed], rtol=SLICES_RTOL,
                                   err_msg=target.name)
        np.testing.assert_array_equal(params(target, N)["router_bias"], params(out, N)["router_bias"])


def _garbage(state):
    for root, _, files in os.walk(state):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"\x00garbage" * 7)


def _flip_one_byte(state):
    """One bit of one byte in the middle of the largest data file: the file still decodes (its zstd
    frames have no checksum of their own), into an array with one element changed."""
    path = max((os.path.join(root, n) for root, _, names in os.walk(state) for n in names), key=os.path.getsize)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("corrupt, message", [(_garbage, "unreadable"), (_flip_one_byte, "does not match the checksum")],
                         ids=["garbage", "one-flipped-byte"])
def test_corrupted_newest_checkpoint_falls_back_with_warning(cpu_env, baseline, tmp_path, corrupt, message):
    out, curve = baseline
    shutil.copytree(os.path.join(out, "run", "checkpoints"), tmp_path / "run" / "checkpoints")
    corrupt(tmp_path / "run" / "checkpoints" / str(N) / "state")
    proc = run(cpu_env, tmp_path, *MESH1, steps=N // 2 + 2)
    assert "unreadable" in proc.stdout + proc.stderr and message in proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout and f"step {N // 2}," in proc.stdout
    resumed = losses(tmp_path)
    assert resumed == {s: curve[s] for s in (N // 2 + 1, N // 2 + 2)}
    assert os.listdir(tmp_path / "run" / "unreadable_checkpoints")


# key-no-network: wandb.init gives up on the closed port after WANDB_INIT_TIMEOUT s (rundir._init_wandb), all waited
# for; the run goes on without it, as after the default 30 s
@pytest.mark.parametrize("wandb_env", [{}, {"WANDB_API_KEY": "x" * 40, "WANDB_INIT_TIMEOUT": "3"}],
                         ids=["no-key", "key-no-network"])
def test_wandb_without_network_or_key_does_not_hang(cpu_env, tmp_path, wandb_env):
    e = {k: v for k, v in cpu_env.items() if k != "WANDB_MODE"}
    e.update(wandb_env, WANDB_BASE_URL="http://127.0.0.1:9")      # nothing listens there
    proc = run(e, tmp_path, *MESH1, "--wandb", "--max_tokens", "4", steps=2)
    assert "final: val cross-entropy" in proc.stdout
    samples = open(tmp_path / "run" / "samples.txt").read()
    assert "=== step 2" in samples
    if not wandb_env:
        assert os.path.isdir(tmp_path / "run" / "wandb")


def test_stop_at_val_loss_ends_at_the_first_evaluation_reaching_it(cpu_env, baseline, tmp_path):
    out, _ = baseline
    val = {r["step"]: r["val_loss"] for r in map(json.loads, open(os.path.join(out, "run", "metrics.jsonl")))
           if "val_loss" in r}
    target = val[5]
    stop = min(s for s, v in val.items() if v <= target)
    proc = run(cpu_env, tmp_path, *MESH1, "--stop_at_val_loss", str(target))
    assert f"<= --stop_at_val_loss {target} at step {stop}: stopping" in proc.stdout
    assert_final_line_compares_with_the_unigram_entropy(proc.stdout)          # above it, so early
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == [str(stop)]
    assert max(losses(tmp_path)) == stop
    # The same command again: the run is finished, as after its last step; nothing more is trained.
    proc = run(cpu_env, tmp_path, *MESH1, "--stop_at_val_loss", str(target))
    assert "nothing to do" in proc.stdout and max(losses(tmp_path)) == stop


def test_checkpoint_from_before_the_router_bias_restores_with_a_zero_bias(tmp_path):
    """Such a checkpoint routed with no bias, i.e. a bias of 0: it resumes as it was."""
    import jax
    import jax.numpy as jnp

    import checkpoints
    import utils
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {"params": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=sharding),
                "router_bias": jax.ShapeDtypeStruct((2, 4), jnp.float32, sharding=sharding)}
    mc = utils.ModelConfig()
    mngr = checkpoints.checkpoint_manager(str(tmp_path))
    checkpoints.save(mngr, 7, {"params": jnp.arange(3.0)}, {"step": 7, "model": dataclasses.asdict(mc)})
    checkpoints.wait_for_save(mngr)
    state, meta = checkpoints.restore_latest(mngr, abstract, str(tmp_path), mc)
    assert meta["step"] == 7
    np.testing.assert_array_equal(state["params"], [0, 1, 2])
    np.testing.assert_array_equal(state["router_bias"], np.zeros((2, 4)))


@pytest.mark.parametrize("flags, message", [
    (["--n_device_axis", "1", "1", "3"], "TP of --n_device_axis"),
    (["--n_device_axis", "2", "2", "2"], "which must divide the 1 available; valid meshes have DP x PP x TP dividing 1 "
                                         "(to try this mesh on a CPU: --cpu_devices 8)"),
    (["--max_lr", "inf"], "--max_lr must be a finite number, got inf"),
    (["--seed", "-1"], "--seed must be in [0, "),
    (["--name", "../.."], "--name must be one directory name under --output_dir"),
    (["--preset", "moe1B"], "--data_dir: --preset moe1B is the guide's run on FineWeb-Edu, not the bundled corpus")])
def test_config_error_names_the_flag(cpu_env, tmp_path, flags, message):
    """Refused before anything is compiled or written (a seed of -1 used to fail after the compile)."""
    proc = run(cpu_env, tmp_path, *flags, expect=2)
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not os.listdir(tmp_path)


def test_a_mistyped_flag_is_one_line_naming_the_flag_it_resembles(cpu_env, tmp_path):
    """Not argparse's 30 lines of usage before the one that matters."""
    proc = run(cpu_env, tmp_path, "--modle_dimension", "64", expect=2)
    assert proc.stderr.splitlines() == ["main.py: error: unrecognized arguments: --modle_dimension 64 (did you mean "
                                        "--model_dimension?); python main.py --help lists every flag"], proc.stderr


def test_a_cpu_run_is_quiet_with_libtpu_installed(cpu_env, tmp_path):
    """requirements-tpu.txt (for --compile_for) puts libtpu in the training virtualenv; off a TPU VM, with
    JAX_PLATFORMS unset, JAX would start its TPU runtime, which printed five lines of errors first."""
    pytest.importorskip("libtpu")
    env = {k: v for k, v in cpu_env.items() if k != "JAX_PLATFORMS"}
    proc = run(env, tmp_path, "--n_device_axis", "1", "1", "3", expect=2)   # the devices are counted
    assert proc.stderr.splitlines()[0] == "invalid configuration:" and "TPU" not in proc.stderr, proc.stderr


def test_a_diverging_run_stops_keeping_its_finite_checkpoint_and_resumes_from_it(cpu_env, baseline, tmp_path):
    """From the straight run's step-10 checkpoint at lr 1e20: the first update makes the parameters huge,
    the next steps' losses are NaN, their updates are skipped, and after --max_bad_steps 3 of them in a
    row the run ends with exit 1 and one line; no checkpoint holds the NaN state (none is written after
    10, nor rotates step 10 away). The same command with the preset's lr resumes from step 10 exactly."""
    out, curve = baseline
    os.makedirs(tmp_path / "run" / "checkpoints")
    shutil.copytree(os.path.join(out, "run", "checkpoints", str(N // 2)), tmp_path / "run" / "checkpoints" / str(N // 2))
    proc = run(cpu_env, tmp_path, *MESH1, "--max_lr", "1e20", "--min_lr", "1e20", steps=3 * N, expect=1)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    first, last = map(int, re.match(r"error: steps (\d+)-(\d+) in a row had a non-finite loss", errors[0]).groups())
    assert last - first == 2 and f"checkpoints/{N // 2}, is from before them" in errors[0]
    assert [r["step"] for r in records(tmp_path) if r.get("nonfinite")] == list(range(first, last + 1))
    assert checkpoints(tmp_path) == [N // 2] and last < 2 * N
    proc = run(cpu_env, tmp_path, *MESH1, steps=N // 2 + 2)
    assert f"resumed from {tmp_path}/run/checkpoints/{N // 2}: step {N // 2}," in proc.stdout
    resumed = losses(tmp_path)
    assert {s: resumed[s] for s in (N // 2 + 1, N // 2 + 2)} == {s: curve[s] for s in (N // 2 + 1, N // 2 + 2)}


def test_eval_steps_beyond_the_val_split_are_capped_with_a_note(cpu_env, tmp_path):
    # The bundled val split holds 21,264 tokens: 664 windows of T+1 = 33, i.e. 2 batches of 300.
    proc = run(cpu_env, tmp_path, *MESH1, "--val_batch_size", "300", "--eval_steps", "3", steps=1)
    assert "enough for 2 of --eval_steps 3 batches of 300; evaluating on 2" in proc.stdout
    assert "final: val cross-entropy" in proc.stdout


def test_a_model_without_shared_experts_or_dense_layers_saves_resumes_exactly_and_restores_on_another_mesh(
        cpu_env, tmp_path):
    """--n_shared 0 (no shared expert) and --layers_per_block 1 (every layer MoE), together: models of their
    own, not empty weights, which Orbax refuses to save; either alone used to end its run at the first
    checkpoint."""
    flags = ["--n_shared", "0", "--layers_per_block", "1"]
    cpu_env = cpu_env | unoptimized(cpu_env)            # a model of this test's own, a few steps a run
    run(cpu_env, tmp_path / "straight", *MESH1, *flags, steps=4)
    run(cpu_env, tmp_path / "resumed", *MESH1, *flags, steps=2)
    proc = run(cpu_env, tmp_path / "resumed", *MESH1, *flags, steps=4)
    assert f"resumed from {tmp_path}/resumed/run/checkpoints/2: step 2," in proc.stdout
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    saved = params(tmp_path / "resumed", 4)
    assert_same_params(saved, params(tmp_path / "straight", 4))
    assert set(saved["params"]["blocks"]) == {"moe"} and "shared_up" not in saved["params"]["blocks"]["moe"]["moe"]
    proc = run(cpu_env, tmp_path / "resumed", *MESH8, *flags, "--sample", "--max_tokens", "4", steps=4)
    assert f"sample @ 4 of {tmp_path}/resumed/run/checkpoints:" in proc.stdout
