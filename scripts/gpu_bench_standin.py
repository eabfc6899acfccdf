"""A stand-in for bench.py's GPU step, so that scripts/gpu_bench.sh can be rehearsed on a CPU (STANDIN=1).

It takes bench.py's flags and writes what bench.py writes on a GPU: the JSON line, the train step's HLO
(--dump_hlo) and every kernel's time per step (--profile DIR: DIR/kernels.json). The program is a canned
one shaped like the model's (a layer loop of GEMMs, cuDNN attention and elementwise kernels; a cuBLAS
GEMM, a reduction and an optimizer pass over the weights outside it; --remat full replays the layer's
GEMM, --moe_impl ragged adds a grouped GEMM kernel), sized by --train_batch_size. Its kernels run at
PLANTED speeds: each class's factor times the kernel's roofline (hlo.kernel_census at step_time's rates),
PLANTED_PER_KERNEL_S beside each kernel (part of it a host copy the census does not know), so that
scripts/refit_estimate.py must find exactly those on the archive. As in a trace of XLA:GPU's CUDA graphs,
the layer loop's kernels name no HLO instruction: XLA's by their own names, cuDNN's and cuBLAS's by the
library's kernel names.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hardware  # noqa: E402
import hlo  # noqa: E402
from planning import step_time  # noqa: E402

PLANTED = {"gemm": 1.25, "attention": 2.5, "memory": 1.15}
PLANTED_PER_KERNEL_S = 2e-6
LAYERS, T, D, F, H, E = 48, 1024, 768, 3072, 12, 16
COPY_SHARE = 0.25            # of the per-kernel time, what the trace shows as a host copy with no HLO instruction
IN_GRAPH = {"up", "replay", "experts", "act", "attn", "next"}     # the layer loop's kernels
LIBRARY_NAMES = {"custom-call:__cudnn$fmhaSoftmax": "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x64_4x1x1_kernel0_0",
                 "custom-call:__cublas$gemm": "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1"}


def program(batch, remat, ragged):
    """The canned train step's optimized HLO, as XLA:GPU would print it."""
    rows = batch * T
    attention = (', custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config": '
                 f'{{"intermediate_tensor_shape": {{"element_type": "BF16", "dimensions": ["{batch}", "{H}", "{T}", "{T}"]}}, '
                 '"mask_type": "CAUSAL"}}')
    replay = (f"  %replay = f32[{rows},{F}]{{1,0}} fusion(%x, %w), kind=kCustom, calls=%fused_up\n" if remat == "full" else "")
    grouped = (f"  %experts = bf16[{rows},{D}]{{1,0}} custom-call(%xb, %we), custom_call_target=\"__gpu$xla.gpu.triton\"\n"
               if ragged else "")
    return f"""HloModule standin_train_step

%fused_up (p0: bf16[{rows},{D}], p1: bf16[{D},{F}]) -> f32[{rows},{F}] {{
  %p0 = bf16[{rows},{D}]{{1,0}} parameter(0)
  %p1 = bf16[{D},{F}]{{1,0}} parameter(1)
  ROOT %dot.1 = f32[{rows},{F}]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%fused_gelu (p2: f32[{rows},{F}]) -> bf16[{rows},{F}] {{
  %p2 = f32[{rows},{F}]{{1,0}} parameter(0)
  %t = f32[{rows},{F}]{{1,0}} tanh(%p2)
  ROOT %c = bf16[{rows},{F}]{{1,0}} convert(%t)
}}

%fused_adam (p3: f32[{D},{F}], p4: f32[{D},{F}]) -> f32[{D},{F}] {{
  %p3 = f32[{D},{F}]{{1,0}} parameter(0)
  %p4 = f32[{D},{F}]{{1,0}} parameter(1)
  ROOT %u = f32[{D},{F}]{{1,0}} subtract(%p3, %p4)
}}

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

%fused_sum (p5: f32[{rows},{F}]) -> f32[] {{
  %p5 = f32[{rows},{F}]{{1,0}} parameter(0)
  %zero = f32[] constant(0)
  ROOT %r = f32[] reduce(%p5, %zero), dimensions={{0,1}}, to_apply=%add
}}

%body (p: (s32[], f32[{rows},{F}])) -> (s32[], f32[{rows},{F}]) {{
  %p = (s32[], f32[{rows},{F}]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[{rows},{D}]{{1,0}} constant({{...}})
  %xb = bf16[{rows},{D}]{{1,0}} constant({{...}})
  %w = bf16[{D},{F}]{{1,0}} constant({{...}})
  %we = bf16[{E},{D},{D}]{{2,1,0}} constant({{...}})
  %q = bf16[{batch},{T},{H},{D // H}]{{3,2,1,0}} constant({{...}})
  %up = f32[{rows},{F}]{{1,0}} fusion(%x, %w), kind=kCustom, calls=%fused_up
{replay}{grouped}  %act = bf16[{rows},{F}]{{1,0}} fusion(%up), kind=kLoop, calls=%fused_gelu
  %attn = (bf16[{batch},{T},{H},{D // H}]{{3,2,1,0}}, f32[{batch},{H},{T}]{{2,1,0}}) custom-call(%q, %q, %q){attention}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[{rows},{F}]{{1,0}}) tuple(%next, %up)
}}

%cond (c: (s32[], f32[{rows},{F}])) -> pred[] {{
  %c = (s32[], f32[{rows},{F}]{{1,0}}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant({LAYERS})
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}}

ENTRY %main (h: f32[{rows},{F}], m: f32[{D},{F}], v: f32[{D},{F}], a: bf16[{F},{rows}], b: bf16[{rows},{D}]) -> f32[] {{
  %h = f32[{rows},{F}]{{1,0}} parameter(0)
  %m = f32[{D},{F}]{{1,0}} parameter(1)
  %v = f32[{D},{F}]{{1,0}} parameter(2)
  %a = bf16[{F},{rows}]{{1,0}} parameter(3)
  %b = bf16[{rows},{D}]{{1,0}} parameter(4)
  %start = s32[] constant(0)
  %init = (s32[], f32[{rows},{F}]{{1,0}}) tuple(%start, %h)
  %loop = (s32[], f32[{rows},{F}]{{1,0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"{LAYERS}"}}}}
  %grad = (f32[{F},{D}]{{1,0}}, s8[1024]{{0}}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={{"gemm_backend_config":{{"dot_dimension_numbers":{{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}}}}
  %adam = f32[{D},{F}]{{1,0}} fusion(%m, %v), kind=kLoop, calls=%fused_adam
  %out = f32[{rows},{F}]{{1,0}} get-tuple-element(%loop), index=1
  ROOT %loss = f32[] fusion(%out), kind=kInput, calls=%fused_sum
}}
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--train_batch_size", type=int, default=8)
    parser.add_argument("--remat", default="auto")
    parser.add_argument("--moe_impl", default="buffers")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dump_hlo", default="")
    parser.add_argument("--profile", default="")
    args, _ = parser.parse_known_args(argv)
    text = program(args.train_batch_size, args.remat, args.moe_impl == "ragged")
    census = hlo.kernel_census(text, step_time.GPU_GEMM_FLOPS, hardware.GpuTarget("h200", 1).hbm_bandwidth)
    kernels = [{"name": LIBRARY_NAMES.get(row["kind"], name.replace(".", "_")), "hlo_op": None if name in IN_GRAPH else name,
                "launches": row["count"],
                "ms_per_step": 1e3 * PLANTED["memory" if row["class"] == "collective" else row["class"]] * row["roofline_s"]}
               for name, row in census["by_name"].items()]
    overhead_s = PLANTED_PER_KERNEL_S * census["kernels"]
    kernels.append({"name": "MemcpyDtoH", "hlo_op": None, "launches": 1.0, "ms_per_step": 1e3 * COPY_SHARE * overhead_s})
    step = sum(k["ms_per_step"] for k in kernels) / 1e3 + (1 - COPY_SHARE) * overhead_s
    if args.dump_hlo:
        with open(args.dump_hlo, "w") as f:
            f.write(text)
    result = {"preset": args.preset, "mesh": [1, 1, 1], "devices": 1, "device_kind": "cpu (scripts/gpu_bench_standin.py)",
              "backend": "cpu", "remat": args.remat, "global_batch": args.train_batch_size, "T": T,
              "tokens_per_step": args.train_batch_size * T, "steps": args.steps, "tokens_per_s": args.train_batch_size * T / step,
              "step_time_median_s": step, "compile_s": 0.0, "mfu": None, "spec_peak_flops": None,
              "mfu_vs_measured_peak": None, "matmul_peak_flops": None, "peak_memory_bytes": None}
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        with open(os.path.join(args.profile, "kernels.json"), "w") as f:
            json.dump({"steps": args.steps, "kernels": sorted(kernels, key=lambda k: -k["ms_per_step"])}, f)
        result["profile"] = {"steps": args.steps, "kernels": os.path.join(args.profile, "kernels.json")}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
