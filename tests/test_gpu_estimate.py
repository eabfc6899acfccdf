"""The H200 estimate (`--compile_for h200`): the kernel census it sums (`hlo.kernel_census`), the calibration
fitted to timed steps (step_time.calibrations), the one-call GPU measurement that refits it (scripts/gpu_bench.sh,
rehearsed with its stand-in, and scripts/refit_estimate.py) and the deviceless XLA:GPU compile. The compile
needs jax's CUDA plugin (requirements-gpu-aot.txt, ~6 GB, its own virtualenv): it runs with
JAXFORMER_SLOW_TESTS=1 and $JAXFORMER_GPU_PYTHON (default .venv-gpu/bin/python).
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile

import pytest

import hlo
from ceiling import CEILING_S
from planning import step_time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A loop of 8 trips whose body slices one row out of a stack and adds it to an accumulator, then a
# standalone convert and a fused matmul: every rule of the census once.
MODULE = """HloModule census

%fused_add (param_0: f32[4,256], param_1: f32[4,256]) -> f32[4,256] {
  %param_0 = f32[4,256]{1,0} parameter(0)
  %param_1 = f32[4,256]{1,0} parameter(1)
  ROOT %add.1 = f32[4,256]{1,0} add(%param_0, %param_1)
}

%fused_slice (param_0.1: f32[8,4,256], param_1.1: s32[]) -> f32[1,4,256] {
  %param_0.1 = f32[8,4,256]{2,1,0} parameter(0)
  %param_1.1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = f32[1,4,256]{2,1,0} dynamic-slice(%param_0.1, %param_1.1, %zero, %zero), dynamic_slice_sizes={1,4,256}
}

%fused_dot (param_0.2: bf16[4,256], param_1.2: bf16[256,128]) -> f32[4,128] {
  %param_0.2 = bf16[4,256]{1,0} parameter(0)
  %param_1.2 = bf16[256,128]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,128]{1,0} dot(%param_0.2, %param_1.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (s32[], f32[8,4,256], f32[4,256])) -> (s32[], f32[8,4,256], f32[4,256]) {
  %p = (s32[], f32[8,4,256]{2,1,0}, f32[4,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %stack = f32[8,4,256]{2,1,0} get-tuple-element(%p), index=1
  %acc = f32[4,256]{1,0} get-tuple-element(%p), index=2
  %slice = f32[1,4,256]{2,1,0} fusion(%stack, %i), kind=kLoop, calls=%fused_slice
  %row = f32[4,256]{1,0} bitcast(%slice)
  %sum = f32[4,256]{1,0} fusion(%acc, %row), kind=kLoop, calls=%fused_add
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,4,256]{2,1,0}, f32[4,256]{1,0}) tuple(%next, %stack, %sum)
}

%cond (p.1: (s32[], f32[8,4,256], f32[4,256])) -> pred[] {
  %p.1 = (s32[], f32[8,4,256]{2,1,0}, f32[4,256]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(8)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (a: f32[8,4,256], w: bf16[256,128]) -> f32[4,128] {
  %a = f32[8,4,256]{2,1,0} parameter(0)
  %w = bf16[256,128]{1,0} parameter(1)
  %start = s32[] constant(0)
  %init = f32[4,256]{1,0} constant({...})
  %tuple = (s32[], f32[8,4,256]{2,1,0}, f32[4,256]{1,0}) tuple(%start, %a, %init)
  %loop = (s32[], f32[8,4,256]{2,1,0}, f32[4,256]{1,0}) while(%tuple), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"8"}}
  %total = f32[4,256]{1,0} get-tuple-element(%loop), index=2
  %total16 = bf16[4,256]{1,0} convert(%total)
  ROOT %out = f32[4,128]{1,0} fusion(%total16, %w), kind=kOutput, calls=%fused_dot
}
"""


def test_the_census_counts_each_kernel_per_run_with_the_bytes_it_moves():
    census = hlo.kernel_census(MODULE, peak_flops=1e6, hbm_bandwidth=1e6)
    row = 4 * 256 * 4
    per_trip = {"slice": (row + 4) + row,            # reads the row it slices (and the index), writes it
                "add": 3 * row,                      # the accumulator and the row in, the sum out
                "counter": 3 * 4}                    # the loop counter's s32 add
    convert = row + row // 2
    matmul_bytes, matmul_flops = (row // 2 + 256 * 128 * 2) + 4 * 128 * 4, 2 * 4 * 128 * 256
    kinds = census["kinds"]
    assert census["kernels"] == 8 * 3 + 2
    # both fusions of the body are elementwise by their ops; the slice one reads one row of the stack
    assert kinds["fusion:elementwise"] == {"count": 16, "bytes": 8 * (per_trip["slice"] + per_trip["add"]), "flops": 0.0}
    assert kinds["add"]["count"] == 8 and kinds["add"]["bytes"] == 8 * per_trip["counter"]
    assert kinds["convert"] == {"count": 1, "bytes": convert, "flops": 0.0}
    assert kinds["fusion:matmul"] == {"count": 1, "bytes": matmul_bytes, "flops": matmul_flops}
    assert census["by_dtype"] == {"bf16 x bf16": matmul_flops}
    moved = 8 * (per_trip["slice"] + per_trip["add"] + per_trip["counter"]) + convert
    assert census["bytes"] == moved + matmul_bytes
    # the matmul is compute-bound at these rates, everything else memory-bound
    assert census["roofline_s"] == pytest.approx(moved / 1e6 + matmul_flops / 1e6)
    # by instruction (each with its launches), and by class: the one GEMM and the memory-bound rest
    assert census["by_name"]["sum"] == {"kind": "fusion:elementwise", "class": "memory", "count": 8,
                                        "bytes": 8 * per_trip["add"], "flops": 0.0, "roofline_s": 8 * per_trip["add"] / 1e6}
    assert census["by_name"]["out"]["class"] == "gemm" and census["classes"]["gemm"]["flops"] == matmul_flops
    assert census["classes"]["memory"]["roofline_s"] == pytest.approx(moved / 1e6)
    assert sum(c["count"] for c in census["classes"].values()) == census["kernels"] and census["uncounted"] == {}


B, H, T, DQK, DV, M, K, N, G = 2, 4, 128, 96, 32, 512, 64, 48, 8
FMHA = (', custom_call_target="{target}", backend_config={{"cudnn_fmha_backend_config": {{"intermediate_tensor_shape": '
        '{{"element_type": "BF16", "dimensions": ["{B}", "{H}", "{T}", "{T}"]}}, "mask_type": "{mask}"}}}}')
# cuDNN's attention forward and backward (causal and not), a cuBLAS GEMM, a grouped GEMM (a Triton kernel
# by its shapes), a kernel whose FLOPs are not known and an fp32 dot: each custom-call rule once.
CUSTOM = f"""HloModule custom

%fused_f32_dot (p0: f32[64,64], p1: f32[64,64]) -> f32[64,64] {{
  %p0 = f32[64,64]{{1,0}} parameter(0)
  %p1 = f32[64,64]{{1,0}} parameter(1)
  ROOT %d = f32[64,64]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

ENTRY %main (q: bf16[{B},{T},{H},{DQK}], v: bf16[{B},{T},{H},{DV}], x: bf16[{M},{K}], w: bf16[{G},{K},{N}], a: f32[64,64]) -> f32[] {{
  %q = bf16[{B},{T},{H},{DQK}]{{3,2,1,0}} parameter(0)
  %v = bf16[{B},{T},{H},{DV}]{{3,2,1,0}} parameter(1)
  %x = bf16[{M},{K}]{{1,0}} parameter(2)
  %w = bf16[{G},{K},{N}]{{2,1,0}} parameter(3)
  %a = f32[64,64]{{1,0}} parameter(4)
  %fwd = (bf16[{B},{T},{H},{DV}]{{3,2,1,0}}, f32[{B},{H},{T}]{{2,1,0}}) custom-call(%q, %q, %v){FMHA.format(target="__cudnn$fmhaSoftmax", B=B, H=H, T=T, mask="CAUSAL")}
  %bwd = (bf16[{B},{T},{H},{DQK}]{{3,2,1,0}}, bf16[{B},{T},{H},{DQK}]{{3,2,1,0}}, bf16[{B},{T},{H},{DV}]{{3,2,1,0}}) custom-call(%q, %q, %v, %v){FMHA.format(target="__cudnn$fmhaSoftmaxBackward", B=B, H=H, T=T, mask="NO_MASK")}
  %gemm = (f32[{K},{K}]{{1,0}}, s8[1024]{{0}}) custom-call(%x, %x), custom_call_target="__cublas$gemm", backend_config={{"gemm_backend_config":{{"dot_dimension_numbers":{{"lhs_contracting_dimensions":["0"],"rhs_contracting_dimensions":["0"]}}}}}}
  %grouped = bf16[{M},{N}]{{1,0}} custom-call(%x, %w), custom_call_target="__gpu$xla.gpu.triton"
  %other = bf16[{M},{K}]{{1,0}} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton"
  %tf32 = f32[64,64]{{1,0}} fusion(%a, %a), kind=kCustom, calls=%fused_f32_dot
  ROOT %zero = f32[] constant(0)
}}
"""


def test_the_census_counts_the_flops_of_custom_calls_from_their_operands():
    census = hlo.kernel_census(CUSTOM, peak_flops=1e6, hbm_bandwidth=1e12)
    rows, scores = census["by_name"], B * H * T * T
    # cuDNN's attention: q k^T and p v forward, five GEMMs backward; a causal mask halves them
    assert rows["fwd"]["flops"] == 2 * scores * (DQK + DV) / 2 and rows["fwd"]["class"] == "attention"
    assert rows["bwd"]["flops"] == 2 * scores * (3 * DQK + 2 * DV) and rows["bwd"]["class"] == "attention"
    assert rows["gemm"]["flops"] == 2 * K * K * M and rows["gemm"]["class"] == "gemm"
    assert rows["grouped"] == rows["grouped"] | {"kind": "custom-call:grouped-gemm", "class": "gemm", "flops": 2 * M * K * N}
    assert rows["other"]["flops"] == 0 and census["uncounted"] == {"custom-call:__gpu$xla.gpu.triton": 1}
    # an fp32 product runs on TF32 tensor cores, at half the bf16 rate
    assert rows["tf32"]["flops"] == 2 * 64 ** 3 and rows["tf32"]["roofline_s"] == pytest.approx(2 * 64 ** 3 / 0.5e6)
    assert census["classes"]["attention"]["flops"] == rows["fwd"]["flops"] + rows["bwd"]["flops"]


def synthetic_runs(factors, per_kernel_s, shapes):
    """Calibration rows whose step times are exactly the given factors' and per-kernel time's."""
    return [{"name": f"run{i}", "tree": "t", "timed": "d", "source": "s", "step_s":
             sum(factors[c] * seconds[c] for c in step_time.CLASSES) + per_kernel_s * kernels,
             "kernels": kernels, "roofline_s": seconds} for i, (seconds, kernels) in enumerate(shapes)]


SHAPES = [({"gemm": g, "attention": a, "memory": m}, n) for g, a, m, n in
          [(0.06, 0.01, 0.09, 11000), (0.06, 0.01, 0.11, 11500), (0.11, 0.02, 0.20, 11900), (0.20, 0.01, 0.15, 11600),
           (0.25, 0.04, 0.31, 13000), (0.064, 0.0095, 0.089, 10800), (0.064, 0.0095, 0.095, 12000)]]


def test_the_calibration_finds_planted_factors_and_its_band_spans_its_forms():
    planted = {"gemm": 1.2, "attention": 3.0, "memory": 1.25}
    runs = synthetic_runs(planted, 3e-6, SHAPES)
    fits = step_time.calibrations(runs)
    whole = {f["form"]: f for f in fits if f["held_out"] is None}
    assert set(whole) == set(step_time.FORMS)          # no kernel times: the step-time forms only
    exact = whole["per class, per kernel"]
    assert exact["factors"] == pytest.approx(planted, rel=1e-4) and exact["per_kernel"] == pytest.approx(3e-6, rel=1e-3)
    assert len(fits) == len(step_time.FORMS) * (1 + len(runs))   # each form on all runs and with each one held out
    # a program unlike the timed ones (half the GEMM-bound time, far fewer kernels): the point is the exact
    # form's, the band spans every fit's prediction
    program = {"gemm": 0.15, "attention": 0.02, "memory": 0.11}
    point, low, high, used, _ = step_time.estimate(program, 5000, runs)
    assert used["form"] == "per class, per kernel" and point == pytest.approx(step_time.predict(exact, program, 5000))
    assert low < point < high and {low, high} <= {step_time.predict(f, program, 5000) for f in fits}


def test_the_stored_calibration_holds_every_step_it_was_fitted_on_inside_its_band():
    runs = step_time.load_calibration()["runs"]
    assert runs and all(r["step_s"] > 0 and r["kernels"] > 0 for r in runs)
    for r in runs:
        _, low, high, _, _ = step_time.estimate(r["roofline_s"], r["kernels"], runs)
        assert low * (1 - 1e-9) <= r["step_s"] <= high * (1 + 1e-9), r["name"]     # a fit may pass through it


def load_standin():
    spec = importlib.util.spec_from_file_location("gpu_bench_standin", os.path.join(ROOT, "scripts", "gpu_bench_standin.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_bench_rehearsed_with_its_stand_in_gives_one_archive_that_refits_to_the_planted_speeds(tmp_path):
    """scripts/gpu_bench.sh end to end on this CPU, the GPU step replaced by its stand-in: one archive comes
    back with every run's JSON line, HLO and kernel times, the summary table is the end of stdout, and the
    refit on the archive finds the speeds the stand-in planted."""
    env = dict(os.environ, STANDIN="1", PYTHON=sys.executable, BUDGET_S="300")
    env.pop("OUT", None)
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_bench.sh"), str(tmp_path / "out")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=CEILING_S)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert os.listdir(tmp_path / "out") == ["gpu_bench.tar.gz"]
    runs = ["tiny_sanity", "b32_auto", "b32_full", "b32_dropless", "b8_full"]
    table = p.stdout.rstrip().splitlines()[-len(runs):]
    assert [line.split()[:2] for line in table] == [[name, "ok"] for name in runs], p.stdout[-2000:]
    with tarfile.open(tmp_path / "out" / "gpu_bench.tar.gz") as archive:
        names = {os.path.basename(m.name) for m in archive.getmembers() if m.isfile()}
    assert {f"{run}.{ext}" for run in runs[1:] for ext in ("json", "hlo.txt", "kernels.json")} <= names
    assert {"summary.txt", "meta.json", "versions.txt", "refit.txt"} <= names
    refit = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "refit_estimate.py"),
                            str(tmp_path / "out" / "gpu_bench.tar.gz"), "--write", str(tmp_path / "calibration.json")],
                           cwd=ROOT, capture_output=True, text=True, timeout=CEILING_S)
    assert refit.returncode == 0, refit.stderr[-3000:]
    standin = load_standin()
    calibration = json.loads((tmp_path / "calibration.json").read_text())
    assert [r["name"] for r in calibration["runs"]] == sorted(runs[1:])
    factors = step_time.kernel_time_factors(calibration["runs"])
    assert factors["factors"] == pytest.approx(standin.PLANTED, rel=1e-6)
    assert factors["per_kernel"] == pytest.approx(standin.PLANTED_PER_KERNEL_S, rel=1e-6)
    used = step_time.estimate(calibration["runs"][0]["roofline_s"], calibration["runs"][0]["kernels"],
                              calibration["runs"]).calibration
    assert used["form"] == "kernel times"


def compile_for_h200(python, *args, cwd, env=None):
    env = dict(os.environ if env is None else env)
    env.pop("JAX_PLATFORMS", None)            # main.py chooses the CPU backend itself
    return subprocess.run([python, os.path.join(ROOT, "main.py"), *args, "--compile_for", "h200"], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=1200)


def test_compile_for_h200_without_the_cuda_plugin_says_what_to_install(tmp_path):
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['jax_plugins.xla_cuda12'] = None\n")
    p = compile_for_h200(sys.executable, "--preset", "tiny", cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(blocker)))
    assert p.returncode == 2 and "pip install -r requirements-gpu-aot.txt" in p.stderr, p.stderr[-2000:]


GPU_PYTHON = os.environ.get("JAXFORMER_GPU_PYTHON", os.path.join(ROOT, ".venv-gpu", "bin", "python"))


@pytest.mark.slow("jax's CUDA plugin, ~6 GB, in a virtualenv of its own")
@pytest.mark.skipif(not os.path.exists(GPU_PYTHON), reason="needs a virtualenv from requirements-gpu-aot.txt")
def test_compile_for_h200_estimates_the_step_from_the_compiled_kernels(tmp_path):
    p = compile_for_h200(GPU_PYTHON, "--preset", "tiny", "--remat", "full", cwd=tmp_path)
    out = p.stdout
    assert p.returncode == 0 and "fits on h200" in out, p.stderr[-3000:]
    assert re.search(r"memory per GPU: state .* total +[\d.]+ GiB of 141.00 GiB", out)
    dtypes = re.search(r"matmul FLOPs by operand dtype: bf16 x bf16 ([\d.]+)%", out)
    assert dtypes and float(dtypes.group(1)) > 99            # the GPU program multiplies in bf16
    # attention is cuDNN's fused kernel, and its FLOPs are counted
    assert re.search(r"cuDNN fmhaSoftmax [\d.]+e\+\d+, cuDNN fmhaSoftmaxBackward [\d.]+e\+\d+\)", out)
    assert re.search(r"custom-call:__cudnn\$fmhaSoftmax +[\d,]+ kernels .* [\d.]+e\+\d+ FLOPs", out)
    step = re.search(r"estimated on an H200: step ([\d.]+) ms \(band ([\d.]+)-([\d.]+) ms\), [\d,]+ tokens/s .*, "
                     r"MFU ([\d.]+)% \(([\d.]+)-([\d.]+)%\), HFU [\d.]+% \([\d.]+-[\d.]+%\) of the 989 TFLOP/s datasheet bf16 "
                     r"peak; of the measured 779 TFLOP/s GEMM rate: MFU", out)
    assert step, out[-3000:]
    point, low, high, mfu, mfu_low, mfu_high = map(float, step.groups())
    assert low < point < high and mfu_low < mfu < mfu_high
    assert "calibrated on: 7 steps timed on an H200 on 2026-11-30 at 70f0744" in out
