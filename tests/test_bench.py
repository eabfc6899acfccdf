"""bench.py in CI-sized form: the tiny preset, cut down, on simulated CPU devices, as subprocesses.

Checks that the JSON line has every field and that the numbers are positive (never the speed), and
that the pipeline FLOP count (a count, not a timing, so deterministic) shows only the GPipe bubble
as extra work in the pipelined blocks.
"""
import json
import os
import subprocess
import sys

import pytest

import bench

from ceiling import CEILING_S
from run_util import unoptimized
from small_configs import SMALL_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# small_configs' model, so compile + a few steps take seconds on a laptop CPU (compilation dominates; no remat
# and fp32 matmuls make the smallest program).
SMALL = ["--preset", "tiny", *SMALL_FLAGS, *"--vocab_size 1000 --max_tokens 4 --remat none --model_dtype float32".split()]
RUN = ["--n_device_axis", "2", "2", "2", "--train_batch_size", "4", "--micro_batch_size", "2", "--steps", "3",
       "--warmup", "1"]
M, PP = 2, 2
PIPELINE = ["--n_device_axis", "1", str(PP), "1", "--train_batch_size", "4", "--micro_batch_size", str(M),
            "--pipeline_flops"]

POSITIVE = ["devices", "tokens_per_s", "step_time_median_s", "compile_s", "flops_per_token", "matmul_peak_flops",
            "mfu_vs_measured_peak", "params_total", "params_active", "tokens_per_step", "global_batch",
            "compiled_memory_bytes", "hlo_matmul_flops_per_device_step"]
# Present, but null where the device cannot say (a CPU has no spec-sheet peak and no memory stats).
NULLABLE = ["mfu", "spec_peak_flops", "peak_memory_bytes"]


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("trace"))


@pytest.fixture(scope="module")
def runs(trace_dir):
    """Both bench.py runs, started together (each is mostly a single-threaded compile), XLA at -O0: no other
    test compiles their programs, and a few steps never earn -O2's compile back (run_util.unoptimized)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               **unoptimized({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}))
    start = lambda args: subprocess.Popen([sys.executable, os.path.join(REPO, "bench.py"), *SMALL, *args], cwd=REPO,
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = {"run": start(RUN + ["--profile", trace_dir, "--dump_hlo", os.path.join(trace_dir, "step.hlo.txt")]),
             "pipeline": start(PIPELINE)}
    results = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=CEILING_S)
            lines = [line for line in stdout.splitlines() if line.startswith("{")]
            results[name] = (proc.returncode, stderr[-3000:], lines)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return results


def result(runs, name):
    returncode, stderr, lines = runs[name]
    assert returncode == 0, stderr
    assert len(lines) == 1, lines
    return json.loads(lines[0])


def test_bench_json_fields_on_a_3d_mesh(runs, trace_dir):
    out = result(runs, "run")
    assert out["preset"] == "tiny" and out["mesh"] == [2, 2, 2] and out["devices"] == 8
    assert out["device_kind"] and out["backend"] == "cpu"
    for name in POSITIVE:
        assert out[name] is not None and out[name] > 0, (name, out[name])
    for name in NULLABLE:
        assert name in out and (out[name] is None or out[name] > 0), (name, out[name])
    spread = out["step_time_spread"]
    assert 0 < spread["min"] <= out["step_time_median_s"] <= spread["max"]
    assert out["tokens_per_step"] == 2 * 4 * 32
    assert out["params_active"] < out["params_total"]
    assert out["final_loss"] == pytest.approx(out["final_loss"]) and 0 < out["final_loss"] < 20   # finite
    # --profile traced 3 more steps into the directory; a CPU trace has no device plane, so the host's
    # thunks stand in for kernels: every one is an instruction of the step's HLO that --dump_hlo wrote.
    profile = out["profile"]
    assert profile["trace"].startswith(trace_dir) and profile["trace"].endswith(".xplane.pb")
    assert os.path.getsize(profile["trace"]) > 0 and profile["steps"] == 3
    with open(os.path.join(trace_dir, "step.hlo.txt")) as f:
        step = f.read()
    with open(profile["kernels"]) as f:
        kernels = json.load(f)["kernels"]
    assert kernels and all(f"%{k['hlo_op']} = " in step for k in kernels), [k["hlo_op"] for k in kernels][:20]
    assert [row[0] for row in profile["top_ops"]] == [k["name"] for k in kernels][:30]
    assert "device op time per step over 3 traced steps" in runs["run"][1]
    # the step's time by seam: every group the tiny model has is there, and the groups are all of the time
    by_seam = profile["by_seam"]
    assert list(by_seam) == [*bench.SEAM_GROUPS, "other"] and all(by_seam[g] > 0 for g in bench.SEAM_GROUPS), by_seam
    assert sum(by_seam.values()) == pytest.approx(profile["ops_ms"]) == pytest.approx(sum(k["ms_per_step"] for k in kernels))
    assert "by seam: attention " in runs["run"][1]


def test_kernel_times_sum_a_traced_program_per_step_by_hlo_instruction(tmp_path):
    """kernel_times over a real trace of 3 calls: each op once a call, its time divided by 3, named by the
    HLO instruction it ran for (on a CPU the host's thunks, the device planes' stand-in)."""
    import jax
    import jax.numpy as jnp

    import bench

    f = jax.jit(lambda a: jnp.tanh(a @ a) @ a)
    a = jnp.ones((256, 256))
    f(a).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(3):
            f(a).block_until_ready()
    rows = bench.kernel_times(str(next(tmp_path.rglob("*.xplane.pb"))), 3)
    ms = [row["ms_per_step"] for row in rows]
    assert rows and ms == sorted(ms, reverse=True) and all(0 < t < 1000 for t in ms)
    compiled = f.lower(a).compile().as_text()
    assert all(row["launches"] == 1 and f"%{row['hlo_op']} = " in compiled for row in rows), rows


def test_an_ops_time_is_its_own_less_the_ops_inside_it():
    """A TPU's while loop is an op around its body's ops on the same line: the loop keeps only its own time, and
    the ops sum to the time the line was busy."""
    spans = [(0, 100), (10, 20), (40, 30), (45, 5), (200, 10)]      # a loop [0, 100) around two ops, one nested
    own = bench._own_times(spans)
    assert own == [50, 20, 25, 5, 10] and sum(own) == 100 + 10


def test_a_kernel_is_grouped_by_the_first_seam_its_op_names_carry():
    names = {"fusion.1": ["jit(train_step)/jvp()/while/body/attention/products/dot_general"],
             "fusion.2": ["jit(train_step)/transpose(jvp())/experts/products/dot_general", "jit(train_step)/add"],
             # its own name first: the product, though a reused helper's fused op names the optimizer
             "fusion.3": ["jit(train_step)/jvp()/products/dot_general", "jit(train_step)/optimizer/jit(nanmedian)/lt"],
             # a jitted helper's lowering reused from the optimizer: its path after "jit(train_step)" again is not
             # this kernel's place
             "fusion.4": ["jit(train_step)/jvp()/vmap(jit(_bernoulli))/jit(train_step)/optimizer/jit(nanmedian)/lt"],
             "fusion.5": ["jit(train_step)/optimizer/mul"], "copy.6": []}
    kernels = [{"hlo_op": name, "ms_per_step": float(i)} for i, name in enumerate(names, 1)]
    assert bench.by_seam(kernels, names) == {"attention": 1.0, "experts": 2.0, "cross_entropy": 0.0, "optimizer": 5.0,
                                             "products": 3.0, "other": 4.0 + 6.0}


def test_a_fusions_op_names_are_those_of_the_ops_fused_into_it():
    import jax
    import jax.numpy as jnp

    import hlo

    def f(a):
        with jax.named_scope("inner"):
            b = jnp.tanh(a) * 2
        return jnp.sum(b * a)
    text = jax.jit(f).lower(jnp.ones((64, 64))).compile().as_text()
    names = hlo.op_names(text)
    # XLA:CPU makes one kernel of it: its names are the scoped tanh's and the unscoped product's
    assert [n for n, ops in names.items() if "fusion" in n and {"jit(f)/inner/tanh", "jit(f)/mul"} <= set(ops)], names


def test_pipeline_flops_only_the_bubble_is_extra(runs):
    out = result(runs, "pipeline")
    pp = PP
    assert out["preset"] == "tiny" and out["mesh"] == [1, pp, 1] and out["flat_mesh"] == [1, 1, 1]
    assert out["per_device_flops_pp"] > 0 and out["per_device_flops_pp1"] > 0
    assert out["gpipe_expected_ratio"] == pytest.approx((M + pp - 1) / (M * pp))
    # The pipelined blocks do exactly the GPipe share; the output layer is split evenly over stages.
    assert out["ratio_by_part"]["blocks"] == pytest.approx(out["gpipe_expected_ratio"], rel=0.10)
    assert out["ratio_by_part"]["output_layer"] == pytest.approx(1 / pp, rel=0.10)
    assert 0 < out["ratio"] <= out["gpipe_expected_ratio"] * 1.10
    # The table over pp = 1 and 2 (GPipe, R = 1) repeats the pair, with the expected ratio of each.
    assert out["pipeline_repeats"] == 1 and out["expected_ratio"] == out["gpipe_expected_ratio"]
    one, two = out["by_pp"]
    assert (one["pp"], one["ratio"], one["expected_ratio"]) == (1, 1.0, 1.0)
    assert two["pp"] == pp and two["per_device_flops"] == out["per_device_flops_pp"]
    assert two["blocks_ratio"] == pytest.approx(two["expected_ratio"], rel=0.10)
    assert two["expected_flops"] == pytest.approx(two["expected_ratio"] * out["per_device_flops_pp1"])


def test_levers_are_timed_against_the_baseline_in_one_process(cpu_env):
    """scripts/levers.py: the baseline, then each lever, one JSON line each and a table; a lever that changes
    only the program (the dense layers unrolled) trains to the same loss, bit for bit in fp32."""
    script = os.path.join(REPO, "scripts", "levers.py")
    flags = [a for a in SMALL if a not in ("--preset", "tiny")] + ["--n_device_axis", "1", "1", "1", "--train_batch_size", "2"]
    proc = subprocess.run([sys.executable, script, "--preset", "tiny", *flags, "--levers", "unrolled_layers",
                           "--steps", "1", "--warmup", "1"], cwd=REPO, env=cpu_env | unoptimized(cpu_env),
                          capture_output=True, text=True, timeout=CEILING_S)        # -O0: programs of its own
    assert proc.returncode == 0, proc.stderr[-3000:]
    baseline, lever = [json.loads(line) for line in proc.stdout.splitlines()]
    assert (baseline["lever"], lever["lever"]) == ("baseline", "unrolled_layers")
    assert lever["loss"] == baseline["loss"] and baseline["speedup"] == 1.0
    assert lever["speedup"] == pytest.approx(baseline["step_ms"] / lever["step_ms"])
    assert "unrolled_layers" in proc.stderr.splitlines()[-1]
    proc = subprocess.run([sys.executable, script, "--levers", "faster"], cwd=REPO, env=cpu_env, capture_output=True,
                          text=True, timeout=CEILING_S)
    assert proc.returncode == 2 and "--levers: faster unknown; the levers: unrolled_layers" in proc.stderr


def test_attention_kernels_are_timed_against_xlas_and_agree_with_it(cpu_env):
    """scripts/attention_bench.py on a CPU (Pallas' interpret mode, small shapes): a JSON line per variant and
    head width, XLA's first (ratio 1), our kernel's and splash's outputs and gradients XLA's to bf16 rounding."""
    script = os.path.join(REPO, "scripts", "attention_bench.py")
    proc = subprocess.run([sys.executable, script, "--batch", "1", "--heads", "2", "--T", "256", "--reps", "1",
                           "--only", "xla_8_chunks,mla_kernel_128,splash_256_256_fused"], cwd=REPO, env=cpu_env,
                          capture_output=True, text=True, timeout=CEILING_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["widths"], r["variant"]) for r in rows] == [(w, v) for w in ("192/64", "64/64")
                                                            for v in ("xla_8_chunks", "mla_kernel_128",
                                                                      "splash_256_256_fused")]
    xla, splash = rows[0], rows[2]
    assert xla["speedup"] == 1.0 and xla["max_rel_error"] == 0.0
    assert all(0 < r["max_rel_error"] < 2e-2 for r in rows if r["variant"] != "xla_8_chunks"), rows
    assert splash["speedup"] == pytest.approx(xla["ms"] / splash["ms"], rel=0.01)
