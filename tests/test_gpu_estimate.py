"""The H200 estimate (`--compile_for h200`): the kernel census it sums (`hlo.kernel_census`) and the
deviceless XLA:GPU compile. The compile needs jax's CUDA plugin (requirements-gpu-aot.txt, ~6 GB, its own
virtualenv): it runs with JAXFORMER_SLOW_TESTS=1 and $JAXFORMER_GPU_PYTHON (default .venv-gpu/bin/python).
"""
import os
import re
import subprocess
import sys

import pytest

import hlo

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


@pytest.mark.skipif(os.environ.get("JAXFORMER_SLOW_TESTS") != "1" or not os.path.exists(GPU_PYTHON),
                    reason="JAXFORMER_SLOW_TESTS=1 and a virtualenv from requirements-gpu-aot.txt")
def test_compile_for_h200_estimates_the_step_from_the_compiled_kernels(tmp_path):
    p = compile_for_h200(GPU_PYTHON, "--preset", "tiny", "--remat", "full", cwd=tmp_path)
    out = p.stdout
    assert p.returncode == 0 and "fits on h200" in out, p.stderr[-3000:]
    assert re.search(r"memory per GPU: state .* total +[\d.]+ GiB of 141.00 GiB", out)
    kernels = int(re.search(r"kernels per step ([\d,]+)", out).group(1).replace(",", ""))
    sigma_ms = float(re.search(r"= ([\d.]+) ms \(matmuls", out).group(1))
    step_ms = float(re.search(r"estimated on an H200 .*: step ([\d.]+) ms", out).group(1))
    assert step_ms == pytest.approx(1.695 * sigma_ms + 1.6e-3 * kernels, rel=2e-3)
    dtypes = re.search(r"matmul FLOPs by operand dtype: bf16 x bf16 ([\d.]+)%", out)
    assert dtypes and float(dtypes.group(1)) > 99            # the GPU program multiplies in bf16
    assert "custom-call:__cudnn$fmha" in out                 # attention is cuDNN's fused kernel
    assert re.search(r"MFU [\d.]+%, HFU [\d.]+% of the 989 TFLOP/s bf16 peak", out)
