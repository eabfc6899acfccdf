"""Reading an optimized, SPMD-partitioned HLO module (`compiled.as_text()`: per device) as XLA:CPU,
XLA:GPU or libtpu writes it: computations and instructions (`parse`), loops times their trip counts
(`trip_count`, `loop_sum`), and from that the matmul FLOPs (`matmul_flops`, by part, pass and operand
dtype), the collective bytes (`collective_bytes`) and the largest buffers (`largest_buffers`) of one
run of the module. Nothing here imports the project: bench.py and planning/ use it.
"""
import math
import re

_COMP_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_SHAPE = re.compile(r"^\(?\s*(\w+)\[([\d,]*)\]")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def _dims(text):
    return [int(d) for d in text.split(",") if d]


def _dot_category(rhs):
    """Which part of the model a dot belongs to, from the op_name JAX writes into its metadata: the
    output layer's dots run under the named scope "output_layer" (loss.chunked_cross_entropy_sum), and
    the dots of the backward pass keep the forward's name inside "transpose(...)"."""
    name = re.search(r'op_name="([^"]*)"', rhs)
    name = name.group(1) if name else ""
    part = "output_layer" if "output_layer" in name else ("blocks" if name else "unattributed")
    phase = ("remat" if "rematted_computation" in name else "backward" if "transpose(" in name else "forward")
    return part, phase


def _conv_flops(rhs, shapes):
    """FLOPs of an HLO convolution, which is how TPU HLO writes matmuls (batch dimensions become
    strided, dilated or padded windows): 2 x batch x output features x input features per group x,
    for each spatial dimension, the (output position, window tap) pairs that land on a real input
    element rather than padding or a dilation hole (as XLA's own cost analysis counts them)."""
    out = _SHAPE.match(rhs.strip())
    operands = re.search(r"\bconvolution\(([^)]*)\)", rhs)
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", rhs)
    if not (out and operands and labels):
        return 0.0
    names = [o.strip().split(" ")[-1].lstrip("%") for o in operands.group(1).split(",")]
    lhs_shape, rhs_shape = (shapes.get(n) for n in names[:2])
    if lhs_shape is None or rhs_shape is None:
        return 0.0
    out_shape = _dims(out.group(2))
    lhs_l, rhs_l, out_l = labels.groups()
    window = dict(re.findall(r"(\w+)=([\dx_]+)", (re.search(r"window=\{([^}]*)\}", rhs) or [None, ""])[1]))
    per_dim = lambda key, default: ([tuple(map(int, v.split("_"))) if "_" in v else int(v)
                                     for v in window[key].split("x")] if key in window else None) or default
    spatial = sorted(c for c in lhs_l if c.isdigit())
    n = len(spatial)
    size, stride, pad = per_dim("size", [1] * n), per_dim("stride", [1] * n), per_dim("pad", [(0, 0)] * n)
    lhs_dilate, rhs_dilate = per_dim("lhs_dilate", [1] * n), per_dim("rhs_dilate", [1] * n)
    taps = 1
    for i, d in enumerate(spatial):
        extent = (lhs_shape[lhs_l.index(d)] - 1) * lhs_dilate[i] + 1
        taps *= sum(1 for o in range(out_shape[out_l.index(d)]) for k in range(size[i])
                    if 0 <= (p := o * stride[i] + k * rhs_dilate[i] - pad[i][0]) < extent and p % lhs_dilate[i] == 0)
    return 2.0 * out_shape[out_l.index("b")] * out_shape[out_l.index("f")] * rhs_shape[rhs_l.index("i")] * taps


def parse(hlo_text):
    """An optimized HLO module's text as ({computation: [instruction lines]}, entry name), or None
    when the text has no ENTRY computation."""
    comps, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        stripped = line.strip()
        m = _COMP_HEADER.match(stripped)
        if m and ("->" in stripped or stripped.startswith("ENTRY")):
            current = m.group(1)
            comps[current] = []
            if stripped.startswith("ENTRY"):
                entry = current
            continue
        if stripped == "}":
            current = None
            continue
        if current is not None and " = " in stripped:
            comps[current].append(stripped)
    return (comps, entry) if entry is not None else None


def trip_count(rhs, comps):
    """Iterations of the while loop whose instruction right-hand side is `rhs`. XLA:CPU writes
    known_trip_count; TPU HLO does not, but its loop conditions compare the counter (from 0) with a
    constant: `compare(counter, constant(N)), direction=LT`. 1 when neither says."""
    trip = _TRIP.search(rhs)
    if trip:
        return int(trip.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", rhs)
    lines = comps.get(cond.group(1), []) if cond else []
    constants = {ins.partition(" = ")[0].strip().lstrip("%"): int(c.group(1)) for ins in lines
                 if (c := re.search(r"\bconstant\((-?\d+)\)", ins))}
    root = next((ins for ins in lines if ins.startswith("ROOT") and "direction=LT" in ins), "")
    operands = re.search(r"compare\(([^)]*)\)", root)
    bound = [constants[o.strip().lstrip("%")] for o in operands.group(1).split(",")
             if o.strip().lstrip("%") in constants] if operands else []
    return bound[0] if bound else 1


def loop_sum(comps, entry, count, key, enters=lambda rhs: True):
    """Sum of count(instruction right-hand side) -> {name: number} over everything the entry
    computation runs: every while body times its trip count (nested loops multiply), every fusion,
    call or async computation once where it is called (an async-start's, not again at its
    async-update/-done) if enters(its caller's right-hand side), and a conditional's costliest branch:
    the one with the largest value of `key` (a name in count's dicts, or a function of the branch's
    dict)."""
    memo = {}
    add = lambda acc, other, n=1: [acc.__setitem__(k, acc.get(k, 0.0) + n * v) for k, v in other.items()]

    def cost(name):
        if name in memo:
            return memo[name]
        memo[name] = {}               # recursion guard
        total = {}
        for ins in comps.get(name, []):
            rhs = ins.partition(" = ")[2]
            add(total, count(rhs))
            if re.search(r"\bwhile\(", rhs):
                body = re.search(r"body=%?([\w.\-]+)", rhs)
                if body:
                    add(total, cost(body.group(1)), trip_count(rhs, comps))
            elif re.search(r"\bconditional\(", rhs):
                branches = re.search(r"branch_computations=\{([^}]*)\}", rhs)
                names = ([b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else
                         re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", rhs))
                costs = [cost(b) for b in names]
                if costs:
                    add(total, max(costs, key=key if callable(key) else lambda c: c.get(key, 0.0)))
            elif not re.search(r"\basync-(?:update|done)\(", rhs) and enters(rhs):
                for callee in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", rhs):
                    add(total, cost(callee))
        memo[name] = total
        return total

    return cost(entry)


def matmul_flops(hlo_text):
    """Matmul FLOPs (2 x output elements x contracted size per dot) of an optimized, SPMD-partitioned
    HLO module (so: per device), counting every while body times its known trip count, every fusion
    or call where it is called, and a conditional's costliest branch (`hlo_sum`). Returns {"total": F,
    "output_layer": F, "blocks": F, "unattributed": F, "forward": F, "backward": F, "remat": F}:
    the first three split the total by part ("unattributed": dots XLA created without an op_name,
    seen inside the pipelined blocks), the last three by pass ("remat" is the forward recomputed
    inside the backward). The output layer is recognised by its "output_layer" scope. "by_dtype":
    the total by operand dtypes, {"bf16 x bf16": F, "f32 x f32": F, ...}. A TPU's Pallas kernel counts the
    FLOPs it declares (`_pallas_kernel`)."""
    parsed = parse(hlo_text)
    if parsed is None:
        return None
    comps, entry = parsed
    defined = _definitions(comps)

    def matmuls(rhs):
        product = _matmul(rhs, defined) or _pallas_kernel(rhs, defined)
        if product is None:
            return {}
        flops, dtypes = product
        part, phase = _dot_category(rhs)
        return {"total": flops, part: flops, phase: flops, ("dtype", dtypes): flops}

    result = {k: 0.0 for k in ("total", "output_layer", "blocks", "unattributed", "forward", "backward", "remat")}
    result["by_dtype"] = {}
    for k, v in loop_sum(comps, entry, matmuls, "total").items():
        if isinstance(k, tuple):
            result["by_dtype"][k[1]] = v
        else:
            result[k] = result.get(k, 0.0) + v
    return result



def _definitions(comps):
    """{instruction name: its right-hand side}: instruction names are unique in an HLO module, fused
    computations' included."""
    return {ins.partition(" = ")[0].replace("ROOT", "").strip().lstrip("%"): ins.partition(" = ")[2]
            for lines in comps.values() for ins in lines}


def _matmul(rhs, defined):
    """(FLOPs, "lhs x rhs" operand dtypes) of a dot (2 x output elements x contracted size) or a
    convolution (`_conv_flops`); None for any other instruction. Operands are named ("%x", defined
    in `defined`) or typed inline ("f32[4,8]{1,0} %x")."""
    operation = re.search(r"\b(dot|convolution)\(([^)]*)\)", rhs)
    if not operation:
        return None
    operands = [o.strip() for o in operation.group(2).split(",")][:2]
    names = [o.split(" ")[-1].lstrip("%") for o in operands]
    typed = [_SHAPE.match(o) or _SHAPE.match(defined.get(n, "").strip()) for o, n in zip(operands, names)]
    dtypes = " x ".join(t.group(1) if t else "?" for t in typed)
    if operation.group(1) == "convolution":
        return _conv_flops(rhs, {n: _dims(t.group(2)) for n, t in zip(names, typed) if t}), dtypes
    out, contract = _SHAPE.match(rhs.strip()), re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rhs)
    if not (out and contract and typed and typed[0]):
        return 0.0, dtypes
    lhs = _dims(typed[0].group(2))
    return 2.0 * math.prod(_dims(out.group(2))) * math.prod(lhs[d] for d in _dims(contract.group(1))), dtypes


def _pallas_kernel(rhs, defined):
    """(FLOPs, "lhs x rhs" dtypes) a TPU Pallas kernel declares in its cost estimate (engine/tpu_attention.py's
    attention: its products'), or None for any other instruction."""
    # the cost estimate's keys in either order: the chip's compiler writes them sorted, libtpu's AOT flops first
    flops = re.search(r'custom_call_target="tpu_custom_call".*"cost_estimate":\{[^}]*"flops":"(\d+)"', rhs)
    if not flops:
        return None
    # its first two operands by name (the chip's compiler types them inline too, layouts and all)
    names = re.findall(r"%([\w.\-]+)", rhs.partition("custom-call(")[2])[:2]
    typed = [_SHAPE.match(defined.get(n, "").strip()) for n in names]
    return float(flops.group(1)), " x ".join(t.group(1) if t else "?" for t in typed)


COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
_COLLECTIVE_OP = re.compile(r'^([^="]*?)\s(' + "|".join(sorted(COLLECTIVES, key=len, reverse=True))
                            + r")(-start|-done)?\(")


def collective_bytes(hlo_text):
    """Per-chip collective traffic of one run of an optimized, SPMD-partitioned HLO module (as
    `compiled.as_text()` gives it): {kind: {"count": ops run, "bytes": B, "link_bytes": L}} for each
    kind in COLLECTIVES that occurs. Ops inside while loops count once per iteration (the trip
    count XLA annotates, or the loop condition's bound; nested loops multiply), fused or async ones
    where they are called (an async pair once), a conditional's branch with the most bytes.

    bytes: the op's full-size buffer on one chip: an all-gather's result, a reduce-scatter's input
    (group size x its result), an all-reduce's, all-to-all's or collective-permute's input (= its
    result), a ragged-all-to-all's input (the send buffer: an upper bound, the rows actually sent
    depend on the routing). link_bytes: what a ring or pairwise algorithm sends out of each chip
    for that buffer over a group of n chips: (n-1)/n of it for all-gather, reduce-scatter,
    all-to-all and ragged-all-to-all, 2(n-1)/n for all-reduce, all of it for collective-permute."""
    parsed = parse(hlo_text)
    if parsed is None:
        return {}
    comps, entry = parsed
    partitions = re.search(r"num_partitions=(\d+)", hlo_text)
    partitions = int(partitions.group(1)) if partitions else 1
    defined = _definitions(comps)

    def result_bytes(rhs):                           # an array or a tuple of arrays
        result_type = re.match(r'^([^="]*?)\s[\w\-]+\(', rhs)
        return sum(math.prod(_dims(dims)) * DTYPE_BYTES[dtype] for dtype, dims in
                   re.findall(r"\b(\w+)\[([\d,]*)\]", result_type.group(1) if result_type else "")
                   if dtype in DTYPE_BYTES)

    def first_operand(rhs):                          # its defining instruction's right-hand side
        name = re.search(r"[\w\-]+\(\s*(?:[^%(),]*\s)?%([\w.\-]+)", rhs)
        return defined.get(name.group(1), "") if name else ""

    def group_size(rhs):
        explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", rhs)
        if explicit:
            return len(explicit.group(1).split(","))
        mesh = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", rhs)   # mesh[...] {'axis_1',...}
        if mesh:
            sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
            return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", mesh.group(2)))
        iota = re.search(r"replica_groups=\[([\d,]+)\]<=", rhs)        # [groups, size]<=[devices]
        return int(iota.group(1).split(",")[-1]) if iota else partitions

    def count(rhs):
        m = _COLLECTIVE_OP.match(rhs)
        if not m or m.group(3) == "-start":          # an async pair counts at its -done
            return {}
        kind = m.group(2)
        attrs = first_operand(rhs) if m.group(3) == "-done" else rhs      # the groups are on the -start
        n = group_size(attrs)
        size = result_bytes(first_operand(rhs) if kind == "ragged-all-to-all" else rhs)
        if kind == "reduce-scatter":
            size *= n
        share = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(kind, (n - 1) / n)
        return {(kind, "count"): 1, (kind, "bytes"): size, (kind, "link_bytes"): share * size}

    totals = loop_sum(comps, entry, count, key=lambda c: sum(v for (_, what), v in c.items() if what == "bytes"))
    return {kind: {"count": int(totals[kind, "count"]), "bytes": int(totals[kind, "bytes"]),
                   "link_bytes": totals[kind, "link_bytes"]}
            for kind in COLLECTIVES if (kind, "count") in totals}


DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
                "u32": 4, "f64": 8, "s64": 8, "u64": 8}


# A collective across TPU slices (megascale, over DCN) is not an HLO collective: the program is one slice's, and
# libtpu's megascale runtime moves the data between slices, through host transfers that name it.
_DCN_SEND = re.compile(r'^\(([a-z]\w*)\[([\d,]*)\][^,]*,.*\ssend\(.*_xla_megascale_transfer_type="(\w+)"')


def dcn_bytes(hlo_text):
    """Per-chip traffic across TPU slices of one run of a multi-slice program (`--compile_for NxSLICE`):
    {transfer type (ALL_REDUCE, ...): {"count": transfers run, "bytes": each one's buffer on the chip,
    summed}}, loops counted as in `collective_bytes`; {} for one slice."""
    parsed = parse(hlo_text)
    if parsed is None:
        return {}
    comps, entry = parsed

    def count(rhs):
        m = _DCN_SEND.match(rhs)
        if not m or m.group(1) not in DTYPE_BYTES:
            return {}
        size = math.prod(_dims(m.group(2))) * DTYPE_BYTES[m.group(1)]
        return {(m.group(3), "count"): 1, (m.group(3), "bytes"): size}

    totals = loop_sum(comps, entry, count, key=lambda c: sum(v for (_, what), v in c.items() if what == "bytes"))
    return {kind: {"count": int(totals[kind, "count"]), "bytes": int(totals[kind, "bytes"])}
            for kind in sorted({kind for kind, _ in totals})}


def largest_buffers(hlo_text, n):
    """The n largest distinct array shapes the per-chip program materialises (values inside a fusion
    never reach HBM, so fused computations are skipped), each with the JAX operation that first makes
    one."""
    sizes, fused = {}, False
    for line in hlo_text.splitlines():
        if line.startswith(("%", "ENTRY")):
            fused = line.startswith("%fused")
        m = re.match(r"\s*(?:ROOT )?%\S+ = (\w+)\[([\d,]+)\]", line)
        op = re.search(r'op_name="([^"]+)"', line)
        if fused or not (m and op) or m.group(1) not in DTYPE_BYTES:
            continue
        (dtype, dims), op = m.groups(), op.group(1)
        shape = f"{dtype}[{dims}]"
        if shape not in sizes:
            size = math.prod(int(d) for d in dims.split(",")) * DTYPE_BYTES[dtype]
            sizes[shape] = (size, f"{shape} {op.split('/')[-1].replace(chr(92), '')} ({_short_scope(op)})")
    return [(what, size) for size, what in sorted(sizes.values(), key=lambda v: -v[0])[:n]]


def op_names(hlo_text):
    """{instruction: [op_name, ...]} of every instruction of a module (names are unique in one): the op_name JAX
    wrote into its metadata and, for a fusion, those of the instructions fused into it (a kernel's named scopes
    are those of everything it computes)."""
    comps, _ = parse(hlo_text)
    by_comp = _instructions(comps)

    def names(d):
        own = re.findall(r'op_name="([^"]*)"', d["rhs"])[:1]
        fused = d["op"] == "fusion"
        return own + [n for callee in (_callees(d) if fused else []) for x in by_comp.get(callee, []) for n in names(x)]
    return {d["name"]: names(d) for ds in by_comp.values() for d in ds}


def _callees(d):
    return re.findall(r"calls=%?([\w.\-]+)", d["rhs"])


def _short_scope(op_name):
    """A readable place for an op_name: the forward/backward pass and the named scope, if any."""
    scope = "output layer" if "output_layer" in op_name else "blocks" if "while" in op_name else "step"
    return ("backward, " if "transpose(" in op_name else "") + scope


# ----------------------------------------------------------------------------------------------------------
# Kernel census: what each kernel of a GPU program reads and writes, for a roofline estimate of its step

_ARRAY = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")
_NOT_A_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
                 "call", "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
                 "async-start"}
_FUSION_KINDS = (("scatter",), ("gather",), ("dynamic-update-slice",), ("reduce", "reduce-window"))


def _nbytes(shape_text):
    """Bytes of an HLO array type or tuple of them: "(f32[4,8]{1,0}, bf16[2])" -> 136."""
    return sum(DTYPE_BYTES[t] * math.prod(_dims(d)) for t, d in _ARRAY.findall(shape_text))


def _instructions(comps):
    """{computation: [{name, shape, op, operands, rhs, root}]} from `parse`'s instruction lines."""
    out = {}
    for comp, lines in comps.items():
        out[comp] = []
        for line in lines:
            lhs, _, rhs = line.partition(" = ")
            m = re.match(r"\s*(\(.*?\)|\S+)\s+([\w\-]+)\((.*)$", rhs)
            if not m:
                continue
            depth, i, args = 1, 0, m.group(3)
            while i < len(args) and depth:          # the operand list ends at its matching parenthesis
                depth += {"(": 1, ")": -1}.get(args[i], 0)
                i += 1
            out[comp].append({"name": lhs.replace("ROOT", "").strip().lstrip("%"), "shape": m.group(1),
                              "op": m.group(2), "operands": re.findall(r"%([\w.\-]+)", args[:i - 1]),
                              "rhs": rhs, "root": lhs.startswith("ROOT")})
    return out


# What a kernel is, for the estimate's per-class factors: it multiplies matrices (a dot, cuBLAS, a grouped
# GEMM), it is a fused attention (cuDNN), it is a collective, or its time is the bytes it moves.
KERNEL_CLASSES = ("gemm", "attention", "memory", "collective")


def _kernel_class(kind):
    if kind in ("matmul", "fusion:matmul") or kind.startswith("custom-call:__cublas") or kind == "custom-call:grouped-gemm":
        return "gemm"
    if kind.startswith("custom-call:__cudnn$fmha"):
        return "attention"
    return "collective" if kind.startswith("collective:") else "memory"


def _first_array(shape_text):
    m = _ARRAY.search(shape_text)
    return (m.group(1), _dims(m.group(2))) if m else (None, [])


def _cudnn_attention_flops(target, d, operand_shapes):
    """FLOPs of a cuDNN fused attention from its operands: q [B, T, H, Dqk], k, v [B, S, H, Dv] (operands 0-2,
    the head width last) and the [B, H, T, S] scores it never writes (its intermediate_tensor_shape). The
    forward runs two GEMMs, q k^T and p v: 2 B H T S (Dqk + Dv); the backward five, the scores again, dp =
    do v^T, dv = p^T do, dq = ds k and dk = ds^T q: 2 B H T S (3 Dqk + 2 Dv). A causal mask halves both (the
    model's FLOPs count them so too)."""
    scores = re.search(r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*\[([^\]]*)\]', d["rhs"])
    if not scores or len(operand_shapes) < 3:
        return 0.0
    bhts = math.prod(int(x.strip().strip('"')) for x in scores.group(1).split(",") if x.strip())
    dqk, dv = operand_shapes[0][1][-1], operand_shapes[2][1][-1]
    widths = 3 * dqk + 2 * dv if "Backward" in target else dqk + dv
    causal = 0.5 if re.search(r'"mask_type":\s*"[A-Z_]*CAUSAL', d["rhs"]) else 1.0
    return 2.0 * bhts * widths * causal


def _cublas_flops(d, operand_shapes):
    """FLOPs of a cuBLAS GEMM custom call: 2 x its output's elements x the contracted size of its lhs."""
    contract = re.search(r'"lhs_contracting_dimensions":\s*\[([^\]]*)\]', d["rhs"])
    out = _first_array(d["shape"])[1]
    if not contract or not operand_shapes:
        return 0.0
    lhs = operand_shapes[0][1]
    return 2.0 * math.prod(out) * math.prod(lhs[int(i.strip().strip('"'))] for i in contract.group(1).split(",") if i.strip())


def _grouped_gemm_flops(d, operand_shapes):
    """FLOPs of a kernel that is a grouped GEMM by its shapes (a Pallas/Triton/Mosaic custom call): rows
    [M, K] against G stacked matrices [G, K, N] (or [G, N, K]) into [M, N], each row multiplied by one of
    them: 2 M K N; or its backward's per-group one, rows [M, K] and [M, N] into G matrices [G, K, N], each
    row's outer product added to its group's: 2 M K N too. 0 when the shapes are not those of one."""
    out = _first_array(d["shape"])[1]
    rows = [s for _, s in operand_shapes if len(s) == 2]
    stack = next((s for _, s in operand_shapes if len(s) == 3), None)
    if len(out) == 3 and len(rows) >= 2 and rows[0][0] == rows[1][0] and out[1:] == [rows[0][1], rows[1][1]]:
        return 2.0 * rows[0][0] * rows[0][1] * rows[1][1]
    if not (rows and stack and len(out) == 2 and out[0] == rows[0][0]):
        return 0.0
    m, k = rows[0]
    n = out[1]
    return 2.0 * m * k * n if sorted(stack[1:]) == sorted((k, n)) else 0.0


def kernel_census(hlo_text, peak_flops, hbm_bandwidth):
    """The kernels one run of an optimized GPU HLO module launches: every instruction outside a fusion
    (a fusion is one kernel) that is not a parameter, constant, tuple, bitcast or control flow, every
    while body times its trip count, a conditional's costliest branch. A kernel's HBM bytes are its
    operands plus its result, except: a dynamic-(update-)slice moves its slice, in place; a fusion
    reads only the slice of an operand it reads only through (dynamic-)slices or gathers, does not
    read an operand it only updates in place, and writes only the update when its root is a
    dynamic-update-slice. FLOPs: dots' and convolutions', cuBLAS custom calls' (from their dimension
    numbers), cuDNN fused attention's (`_cudnn_attention_flops`) and a grouped GEMM's by its shapes, its
    backward's per-group product included (`_grouped_gemm_flops`); any other custom call counts bytes only
    and is listed in "uncounted".
    A product with an fp32 operand runs at half peak_flops (TF32 tensor cores: half the bf16 rate on
    Hopper and Ampere). The roofline sum, over kernels of max(FLOPs / rate, bytes / hbm_bandwidth):
    the time at the roofline with every kernel alone.

    Returns {"kinds": {kind: {"count", "bytes", "flops"}}, "classes": {class: {"count", "bytes", "flops",
    "roofline_s"}}, "by_name": {instruction: {"kind", "class", "count", "bytes", "flops", "roofline_s"}},
    "by_dtype": {"bf16 x bf16": FLOPs, ...}, "uncounted": {kind: kernels}, "kernels": N, "bytes": B,
    "flops": F, "roofline_s": the roofline sum}; kind is the opcode, "matmul", a fusion's "fusion:<what it
    does>", "custom-call:<target>" ("custom-call:grouped-gemm" for a grouped GEMM) or "collective:<op>";
    class one of KERNEL_CLASSES (`_kernel_class`)."""
    comps, entry = parse(hlo_text)
    by_comp, defined = _instructions(comps), _definitions(comps)
    shape_of = {d["name"]: d["shape"] for ds in by_comp.values() for d in ds}
    parsed = {d["rhs"]: d for ds in by_comp.values() for d in ds}

    def fused(comp):
        """Every instruction inside a fused computation, nested fusions included."""
        for d in by_comp.get(comp, []):
            yield d
            for callee in _callees(d):
                yield from fused(callee)

    def fusion_operand_bytes(body, index, full):
        param = next((d["name"] for d in by_comp.get(body, []) if d["op"] == "parameter"
                      and re.search(rf"parameter\({index}\)", d["rhs"])), None)
        users = [d for d in by_comp.get(body, []) if param in d["operands"]]
        if users and all(u["op"] in ("dynamic-slice", "slice", "gather") and u["operands"][0] == param for u in users):
            return sum(_nbytes(u["shape"]) for u in users)
        if users and all(u["op"] == "dynamic-update-slice" and u["operands"][0] == param for u in users):
            return 0
        return full

    def custom_call(d):
        """(kind, FLOPs, operand dtypes) of a custom call."""
        target = re.search(r'custom_call_target="([^"]+)"', d["rhs"])
        target = target.group(1) if target else "?"
        shapes = [_first_array(shape_of.get(o, "")) for o in d["operands"]]
        dtypes = " x ".join(t or "?" for t, _ in shapes[:2])
        if target.startswith("__cudnn$fmha"):
            return "custom-call:" + target, _cudnn_attention_flops(target, d, shapes), dtypes
        if target.startswith("__cublas"):
            return "custom-call:" + target, _cublas_flops(d, shapes), dtypes
        grouped = _grouped_gemm_flops(d, shapes)
        return ("custom-call:grouped-gemm", grouped, dtypes) if grouped else ("custom-call:" + target, 0.0, None)

    def kernel(d):
        """(kind, bytes, FLOPs, dtypes) of one kernel."""
        op, result = d["op"], _nbytes(d["shape"])
        operands = [_nbytes(shape_of.get(o, "")) for o in d["operands"]]
        flops, dtypes, kind = 0.0, None, op
        if op == "fusion":
            body = _callees(d)[0]
            inner = list(fused(body))
            ops = {x["op"] for x in inner}
            dots = [_matmul(x["rhs"], defined) for x in inner if x["op"] in ("dot", "convolution")]
            if dots:
                kind, flops, dtypes = "fusion:matmul", sum(f for f, _ in dots), dots[0][1]
            else:
                kind = next((f"fusion:{names[0]}" for names in _FUSION_KINDS if ops & set(names)), None) or (
                    "fusion:transpose/copy" if "transpose" in ops or ops <= {"parameter", "copy", "bitcast"} else
                    "fusion:concat/pad" if ops & {"concatenate", "pad"} else "fusion:elementwise")
            operands = [fusion_operand_bytes(body, i, b) for i, b in enumerate(operands)]
            root = next((x for x in by_comp.get(body, []) if x["root"]), None)
            if root and root["op"] == "dynamic-update-slice":
                result = _nbytes(shape_of.get(root["operands"][1], ""))
        elif op in ("dot", "convolution"):
            (flops, dtypes), kind = _matmul(d["rhs"], defined), "matmul"
        elif op == "dynamic-update-slice":
            result = operands[1]
            operands = [0] + operands[1:]
        elif op in ("dynamic-slice", "slice"):
            operands = [result] + operands[1:]
        elif op == "custom-call":
            kind, flops, dtypes = custom_call(d)
        elif op.removesuffix("-start") in COLLECTIVES:
            kind = "collective:" + op.removesuffix("-start")
        return kind, result + sum(operands), flops, dtypes

    def count(rhs):
        """{key: amount} of one instruction: nothing unless it is a kernel."""
        d = parsed.get(rhs)
        if d is None or d["op"] in _NOT_A_KERNEL or d["op"].endswith(("-done", "-update")):
            return {}
        kind, nbytes, flops, dtypes = kernel(d)
        kind_of[d["name"]] = kind
        rate = peak_flops / 2 if dtypes and "f32" in dtypes.split(" x ") else peak_flops
        seconds = max(flops / rate, nbytes / hbm_bandwidth)
        name = d["name"]
        totals = {(kind, "count"): 1, (kind, "bytes"): nbytes, (kind, "flops"): flops, "roofline_s": seconds,
                  ("kernel", name, "count"): 1, ("kernel", name, "bytes"): nbytes, ("kernel", name, "flops"): flops,
                  ("kernel", name, "roofline_s"): seconds}
        if kind.startswith("custom-call:") and not flops and not kind.startswith("custom-call:__cudnn"):
            totals[("uncounted", kind)] = 1
        return totals | ({("dtype", dtypes): flops} if flops else {})

    # kernels run where they are launched: calls and async computations are entered, fusions and
    # reducers (inside a kernel) are not
    launches = lambda rhs: re.search(r"\bcall\(", rhs) or (re.search(r"-start\(", rhs) and "calls=" in rhs)
    kind_of = {}
    totals = loop_sum(comps, entry, count, "roofline_s", enters=launches)
    kinds, by_name, uncounted, by_dtype = {}, {}, {}, {}
    for key, v in totals.items():
        if not isinstance(key, tuple):
            continue
        if key[0] == "dtype":
            by_dtype[key[1]] = v
        elif key[0] == "uncounted":
            uncounted[key[1]] = int(v)
        elif key[0] == "kernel":
            row = by_name.setdefault(key[1], {"kind": kind_of[key[1]], "class": _kernel_class(kind_of[key[1]])})
            row[key[2]] = v
        else:
            kinds.setdefault(key[0], {"count": 0, "bytes": 0.0, "flops": 0.0})[key[1]] += v
    classes = {c: {"count": 0, "bytes": 0.0, "flops": 0.0, "roofline_s": 0.0} for c in KERNEL_CLASSES}
    for row in by_name.values():
        for field in ("count", "bytes", "flops", "roofline_s"):
            classes[row["class"]][field] += row[field]
    return {"kinds": kinds, "classes": classes, "by_name": by_name, "by_dtype": by_dtype, "uncounted": uncounted,
            "kernels": int(sum(k["count"] for k in kinds.values())), "bytes": sum(k["bytes"] for k in kinds.values()),
            "flops": sum(k["flops"] for k in kinds.values()), "roofline_s": totals.get("roofline_s", 0.0)}
