"""The compiled step's FLOP / byte / collective budget and a roofline step-time estimate (tools.aot --json).

    from tools.budget import hlo_budget, step_budget
    hlo_budget(compiled.as_text())       # dot FLOPs, bytes accessed, collective bytes of the compiled HLO
    step_budget(compiled, chip="v5p", model_flops=...)   # + cost_analysis, roofline seconds, MFU

Everything here is an ESTIMATE read off the compiled program, not a measurement of a run.

Why not just `compiled.cost_analysis()`: XLA's cost analysis (CPU and the TPU compiler alike, checked
with jax 0.10.2 / libtpu: tests/test_aot_budget.py) counts a while loop's body ONCE, whatever its trip
count, and the train step runs its layers in a `scan` (a while loop): for a 78-layer stack it would
report about one layer. So the budget walks the compiled HLO text instead and multiplies each
instruction by the trip counts of the while loops around it:
- trip count: the `known_trip_count` backend config when the compiler writes it (CPU), otherwise
  the loop condition `compare(counter, constant(N)), direction=LT` (scan / fori_loop with static
  bounds, counter from 0 by 1: what the TPU compiler leaves). A data-dependent loop (a while_loop
  such as the dropless a2a rounds) counts once and is listed in `unknown_trip_loops`.
- FLOPs: 2 x output elements x contracted elements of every dot and convolution (also those inside
  fusions), and 2 M K N of each `ragged-dot` custom call (the TPU compiler's kernel for the forward
  and dX of `ragged_dot`, [M, K] rows x [G, K, N] groups; its `ragged-dot-metadata` kernel, 0): matmul
  FLOPs, what MFU counts. A Pallas TPU kernel (`tpu_custom_call`, e.g. megablox gmm / tgmm) counts the
  FLOPs and bytes of the cost estimate its pallas_call carries; one without an estimate counts 0 and is
  listed in `unknown_cost_kernels`.
  Elementwise work and other custom calls are left out.
- bytes accessed: operands + outputs of every instruction that runs as a kernel (not the fused
  computations' insides, nor tuples, parameters, get-tuple-element, bitcasts, constants); a fusion
  parameter read only through dynamic-slice or gather (nested fusions too) counts the slices / gathered
  rows, a fusion whose root is a dynamic-update-slice or scatter counts the update, not the whole buffer
  (as XLA's cost analysis does for slices).
- collective bytes: output bytes of all-gather / all-reduce / reduce-scatter / all-to-all /
  collective-permute (the `-done` half of async pairs), a proxy for what each chip moves over ICI.

Roofline: estimated_step_seconds = max(compiled_flops / peak FLOP/s, bytes_accessed / HBM bandwidth,
collective_bytes / ICI bandwidth): the bound if compute, HBM traffic and ICI traffic overlapped
perfectly (XLA overlaps async collectives with compute); the sum of the three (`serial_seconds`, no
overlap at all) is reported beside it as the pessimistic end. estimated_mfu = model_flops /
(estimated_step_seconds x peak FLOP/s).
"""

from __future__ import annotations

import math
import re

from glm5_jax.chips import TPU_CHIPS

# chip kind -> published peaks (units and sources: glm5_jax.chips, the one chip table)
CHIP_PEAKS = {k: {"peak_flops": c.peak_flops, "hbm_bytes_per_s": c.hbm_bytes_per_s, "ici_bytes_per_s": c.ici_bytes_per_s}
              for k, c in TPU_CHIPS.items()}

BUDGET_NOTE = ("estimates from the compiled HLO, not measurements: compiled_flops = dot/convolution FLOPs x "
               "while-loop trip counts; bytes_accessed = kernel operands + outputs; collective_bytes = "
               "collective outputs; estimated_step_seconds = max(flops / peak, bytes / HBM bw, collective "
               "bytes / ICI bw) with the chip's published peaks (perfect overlap); see tools/budget.py")

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all")
_NO_KERNEL = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call", "conditional",
              "after-all", "partition-id", "replica-id", "iota", "opt-barrier", "add-dependency", "domain"}
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")


def _dtype_bytes(dt: str) -> float:
    return _BYTES.get(dt, 1 if dt.startswith("f8") else 0)


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (an array or a tuple of arrays; layouts ignored)."""
    return int(sum(_dtype_bytes(dt) * math.prod(int(d) for d in dims.split(",") if d)
                   for dt, dims in _ARRAY.findall(shape)))


def _dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _attr(rest: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=(%?[\w.\-]+|\{{[^}}]*\}})", rest)
    return m.group(1) if m else None


def parse_hlo(text: str) -> dict:
    """{computation: [instr]} of an HLO module's text; instr = dict(name, shape, op, operands, rest, root)."""
    comps, cur, entry = {}, None, None
    for line in text.splitlines():
        if not line.startswith(" "):
            m = _HEADER.match(line)
            if m:
                cur = comps.setdefault(m.group(1), [])
                entry = m.group(1) if line.startswith("ENTRY") else entry
            elif cur and line.strip() != "}":
                cur[-1]["rest"] += line      # an instruction continued on the next line (--xla_dump_to files)
            continue
        m = _INSTR.match(line)
        if m is None or cur is None:
            if cur and m is None and line.strip():
                cur[-1]["rest"] += line
            continue
        name, shape, op, rest = m.groups()
        depth, i = 1, 0              # the operand list ends at the ')' matching the opcode's '('
        while i < len(rest) and depth:
            depth += {"(": 1, ")": -1}.get(rest[i], 0)
            i += 1
        args = rest[:i - 1]
        cur.append({"name": name, "shape": shape, "op": op, "operands": re.findall(r"%([\w.\-]+)", args),
                    "args": args, "rest": rest[i:], "root": line.lstrip().startswith("ROOT")})
    return {"computations": comps, "entry": entry}


def _trip_count(instr: dict, comps: dict) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instr["rest"])
    if m:
        return int(m.group(1))
    cond = comps.get((_attr(instr["rest"], "condition") or "").lstrip("%"), [])
    consts = {i["name"]: i for i in cond if i["op"] == "constant"}
    root = next((i for i in cond if i["root"]), None)
    if root is None or root["op"] != "compare" or len(root["operands"]) != 2:
        return None
    direction = _attr(root["rest"], "direction")
    a, b = root["operands"]
    c = consts.get(b) if direction == "LT" else consts.get(a) if direction == "GT" else None
    return int(c["args"]) if c is not None and re.fullmatch(r"\d+", c["args"].strip()) else None


_NOISE = re.compile(r"^(while|body|cond|closed_call|dot_general|convolution|checkpoint|rematted_computation|"
                    r"remat|layer_\d+|pjit|jit\(.*\)|shard_map|custom_vjp_call.*)$")


def flops_source(ins: dict) -> str:
    """A dot's op_name metadata without the loop / remat / transform wrappers: the module path
    (e.g. 'GLM5/moe_layers/attn/q_b_proj'), for the FLOPs breakdown."""
    m = re.search(r'op_name="([^"]*)"', ins["rest"])
    if not m:
        return "?"
    parts = [re.sub(r"^(?:\w+\()+|\)+$", "", p) for p in m.group(1).split("/")]
    return "/".join(p for p in parts if p and not _NOISE.match(p)) or "?"


def _valid_taps(n: int, out: int, size: int, stride: int, lo: int, lhs_dil: int, rhs_dil: int) -> int:
    """(output position, window tap) pairs of one spatial dim that land on a real input element (not
    padding, not a hole of lhs dilation): what a convolution multiplies along that dim."""
    if out * size > 1 << 20:                 # too many to enumerate: every tap counted
        return out * size
    hi = (n - 1) * lhs_dil
    return sum(1 for o in range(out) for w in range(size)
               if 0 <= (p := o * stride + w * rhs_dil - lo) <= hi and p % lhs_dil == 0)


def _conv_flops(ins: dict, shapes: dict) -> float:
    """2 x batch x output features x input features (per group) x valid window taps. Dots the TPU
    compiler rewrote as convolutions have no spatial dims; ragged dots become dilated convolutions
    over the groups, where only one tap in each window is real."""
    lhs, rhs, out = (_dims(shapes.get(ins["operands"][0], "")), _dims(shapes.get(ins["operands"][1], "")),
                     _dims(ins["shape"]))
    lab = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins["rest"])
    if not (lab and lhs and rhs and out) or any(len(x) != len(l) for x, l in zip((lhs, rhs, out), lab.groups())):
        return 0.0
    ll, rl, ol = lab.groups()
    w = re.search(r"window=\{([^}]*)\}", ins["rest"])
    win = dict(kv.split("=") for kv in re.findall(r"\w+=[\dx_\-]+", w.group(1) if w else ""))
    spatial = sorted(c for c in ol if c.isdigit())
    taps = 1
    for j, d in enumerate(spatial):
        get = lambda k, default: int(win[k].split("x")[j]) if k in win else default
        lo = int(win["pad"].split("x")[j].split("_")[0]) if "pad" in win else 0
        taps *= _valid_taps(lhs[ll.index(d)], out[ol.index(d)], get("size", 1), get("stride", 1), lo,
                            get("lhs_dilate", 1), get("rhs_dilate", 1))
    return 2.0 * out[ol.index("b")] * out[ol.index("f")] * rhs[rl.index("i")] * taps


def hlo_budget(text: str, top: int = 16) -> dict:
    """dot FLOPs, bytes accessed and collective bytes of a compiled HLO module's text, each instruction
    counted as many times as the while loops around it run (module docstring)."""
    mod = parse_hlo(text)
    comps = mod["computations"]
    mult: dict[str, float] = {}
    kernel_comps: set[str] = set()      # computations whose instructions run as kernels (not fused bodies)
    unknown: list[str] = []
    unknown_cost: list[str] = []
    trips: dict[str, int] = {}

    def visit(comp: str, m: float, kernels: bool):
        mult[comp] = mult.get(comp, 0) + m
        if kernels:
            kernel_comps.add(comp)
        for ins in comps.get(comp, []):
            if ins["op"] == "while":
                n = _trip_count(ins, comps)
                if n is None:
                    unknown.append(ins["name"])
                trips[ins["name"]] = n if n is not None else 1
                for key in ("body", "condition"):
                    c = _attr(ins["rest"], key)
                    if c:
                        visit(c.lstrip("%"), m * (n if n is not None else 1), True)
            elif ins["op"] in ("call", "async-start") or ins["op"] == "conditional":
                for c in re.findall(r"%([\w.\-]+)", _attr(ins["rest"], "to_apply") or _attr(ins["rest"], "calls")
                                    or _attr(ins["rest"], "branch_computations") or ""):
                    visit(c, m, True)
            elif ins["op"] == "fusion":
                c = _attr(ins["rest"], "calls")
                if c:
                    visit(c.lstrip("%"), m, False)

    visit(mod["entry"], 1.0, True)
    flops = bytes_ = 0.0
    coll: dict[str, float] = {}
    by_source: dict[str, float] = {}
    bytes_src: dict[str, float] = {}
    for comp, m in mult.items():
        instrs = comps.get(comp, [])
        shapes = {i["name"]: i["shape"] for i in instrs}
        for ins in instrs:
            op = ins["op"]
            if op == "dot" and len(ins["operands"]) == 2:
                lhs = _dims(shapes.get(ins["operands"][0], ""))
                cdims = _attr(ins["rest"], "lhs_contracting_dims") or "{}"
                k = math.prod(lhs[int(d)] for d in re.findall(r"\d+", cdims)) if lhs else 0
                f = m * 2 * math.prod(_dims(ins["shape"])) * k
            elif op == "convolution" and len(ins["operands"]) == 2:
                f = m * _conv_flops(ins, shapes)
            elif op == "custom-call" and _is_ragged_dot(ins):
                # the TPU compiler's own ragged_dot kernels (Mosaic, but no pallas_call: no cost estimate to
                # read). The grouped matmul (forward and dX of the routed experts): every row [M, K] meets one
                # group's [K, N] -> 2 M K N, invisible to XLA's cost analysis. Its `ragged-dot-metadata`
                # kernel (one operand, the group sizes -> tile offsets in scalar memory) does no matmul: 0.
                rows = ins["operands"][-2] if len(ins["operands"]) >= 2 else None
                lhs, out = _dims(shapes.get(rows, "")), _dims(ins["shape"])
                f = m * 2 * math.prod(out) * lhs[-1] if len(lhs) == 2 and len(out) == 2 else 0.0
            elif op == "custom-call" and _is_mosaic(ins):
                # a Pallas TPU kernel: its own cost estimate (pl.CostEstimate, in the backend config)
                est = mosaic_cost(ins)
                if est is None:
                    unknown_cost.append(ins["name"])
                f = m * est["flops"] if est else 0.0
            else:
                f = 0.0
            if f:
                flops += f
                src = flops_source(ins)
                by_source[src] = by_source.get(src, 0.0) + f
            if comp not in kernel_comps:
                continue
            base = op[:-5] if op.endswith("-done") else op
            if base in COLLECTIVES and not op.endswith("-start"):
                coll[base] = coll.get(base, 0) + m * shape_bytes(ins["shape"])
            if op in _NO_KERNEL or op.endswith("-start") or op.endswith("-done"):
                continue
            est = mosaic_cost(ins) if op == "custom-call" and _is_mosaic(ins) and not _is_ragged_dot(ins) else None
            nb = m * (est["bytes_accessed"] if est else _kernel_bytes(ins, shapes, comps))
            bytes_ += nb
            key = f"{flops_source(ins)} [{op}]"
            bytes_src[key] = bytes_src.get(key, 0.0) + nb
    top_flops = dict(sorted(by_source.items(), key=lambda kv: -kv[1])[:top])
    top_bytes = dict(sorted(bytes_src.items(), key=lambda kv: -kv[1])[:top])
    return {"flops": flops, "flops_by_source": top_flops, "flops_by_source_all": by_source, "bytes_accessed": bytes_,
            "bytes_by_source": top_bytes, "collective_bytes": sum(coll.values()),
            "collective_bytes_by_op": coll, "while_trip_counts": trips, "unknown_trip_loops": unknown,
            "unknown_cost_kernels": sorted(set(unknown_cost))}


_COST = re.compile(r'"cost_estimate":\{([^}]*)\}')     # its keys in any order (jax 0.10: flops first; 0.12: sorted)


def _is_mosaic(ins: dict) -> bool:
    return 'custom_call_target="tpu_custom_call"' in ins["rest"]


def _is_ragged_dot(ins: dict) -> bool:
    """One of the TPU compiler's ragged_dot kernels (`ragged-dot-none.N` the grouped matmul, `ragged-dot-metadata.N`
    its group offsets), named by the compiler, not a user's pallas_call."""
    return ins["name"].startswith("ragged-dot")


def mosaic_cost(ins: dict) -> dict | None:
    """{'flops', 'bytes_accessed'} of a Pallas TPU kernel (a `tpu_custom_call`) from the cost estimate
    its pallas_call carries in the backend config (megablox gmm / tgmm: 2 M K N), None without one."""
    m = _COST.search(ins["rest"])
    fields = dict(re.findall(r'"(\w+)":"(\d+)"', m.group(1))) if m else {}
    if "flops" not in fields:
        return None
    return {"flops": float(fields["flops"]), "bytes_accessed": float(fields.get("bytes_accessed", 0))}


def _read_bytes(comp: list[dict], param: str, comps: dict, depth: int = 0) -> float | None:
    """Bytes a fused computation reads of its parameter `param` when it reads only parts of it: the
    slices of dynamic-slices, the rows of gathers, nothing where it is a scatter's in-place target
    (the scatter counts its updates), recursively through nested fusions; None when some user reads
    it whole (then the whole parameter counts)."""
    users = [i for i in comp if param in i["operands"]]
    if not users or depth > 8:
        return None
    total = 0.0
    for u in users:
        first = u["operands"][0] == param and u["operands"].count(param) == 1
        if u["op"] in ("dynamic-slice", "gather") and first:
            total += shape_bytes(u["shape"])
        elif u["op"] == "scatter" and first:
            continue
        elif u["op"] == "fusion":
            body = comps.get((_attr(u["rest"], "calls") or "").lstrip("%"), [])
            params = {int(i["args"]): i["name"] for i in body if i["op"] == "parameter" and i["args"].strip().isdigit()}
            for j, o in enumerate(u["operands"]):
                if o != param:
                    continue
                got = _read_bytes(body, params.get(j, ""), comps, depth + 1) if j in params else None
                if got is None:
                    return None
                total += got
        else:
            return None
    return total


def _kernel_bytes(ins: dict, shapes: dict, comps: dict) -> float:
    """Operand + output bytes of one kernel, counting what it touches of a buffer it only indexes:
    dynamic-slice / gather (also inside fusions, nested ones too) count the slice or the gathered rows,
    dynamic-update-slice / scatter (a fusion's root) count the update, written in place (XLA's cost
    analysis counts slices the same way). Without this a loop that reads one row of a buffer per step
    counts the whole buffer every step (the 128K attention loops: docs/scaleout.md, issue 42)."""
    out = shape_bytes(ins["shape"])
    operands = [shape_bytes(shapes.get(o, "")) for o in ins["operands"]]
    if ins["op"] in ("dynamic-slice", "gather"):
        return 2 * out + sum(operands[1:])
    if ins["op"] == "dynamic-update-slice" and len(operands) > 1:
        return 2 * operands[1]
    if ins["op"] == "scatter" and len(operands) > 2:
        return 3 * operands[2] + operands[1]        # read + write the updated rows, read the updates
    if ins["op"] != "fusion":
        return out + sum(operands)
    body = comps.get((_attr(ins["rest"], "calls") or "").lstrip("%"), [])
    params = {int(i["args"]): i["name"] for i in body if i["op"] == "parameter" and i["args"].strip().isdigit()}
    root = next((i for i in body if i["root"]), None)
    inner = {i["name"]: i["shape"] for i in body}
    total = 0.0
    in_place = None
    if root is not None and root["op"] == "dynamic-update-slice" and len(root["operands"]) > 1:
        total += shape_bytes(inner.get(root["operands"][1], ""))      # written in place: the update only
        in_place = root["operands"][0]
    elif root is not None and root["op"] == "scatter" and len(root["operands"]) > 2:
        total += 2 * shape_bytes(inner.get(root["operands"][2], ""))  # read-modify-write of the updated rows
        in_place = root["operands"][0]
    else:
        total += out
    for idx, nbytes in enumerate(operands):
        p = params.get(idx)
        if p is not None and p == in_place:
            continue
        got = _read_bytes(body, p, comps) if p is not None else None
        total += nbytes if got is None else min(got, nbytes)
    return total


def cost_analysis(compiled) -> dict:
    """XLA's own figures (while bodies counted once): {'flops', 'bytes_accessed'} of device 0."""
    try:
        ca = compiled.cost_analysis()
    except Exception:          # pragma: no cover - a backend without cost analysis
        return {}
    ca = ca[0] if isinstance(ca, (list, tuple)) and ca else ca
    if not isinstance(ca, dict):
        return {}
    return {"flops": float(ca.get("flops", 0.0)), "bytes_accessed": float(ca.get("bytes accessed", 0.0))}


def model_flops_per_device(model_cfg, batch_size: int, seq_len: int, devices: int) -> float:
    """glm5_jax.flops.train_flops_per_token (6 x active matmul params + attention for the configured
    attention / top-k, + the MTP blocks at every depth) x tokens per optimizer step / devices."""
    from glm5_jax.flops import train_flops_per_token
    return train_flops_per_token(model_cfg, seq_len) * batch_size * seq_len / devices


def step_budget(compiled, chip: str, model_flops: float) -> dict:
    """The `budget` section of tools.aot's report for one compiled step (per device, estimates)."""
    return text_budget(compiled.as_text(), chip, model_flops, xla_cost=cost_analysis(compiled))


def _matching(by_source: dict[str, float], regex: str) -> dict:
    """The sources whose name matches regex and the sum of their FLOPs."""
    hits = sorted(src for src in by_source if re.search(regex, src))
    return {"regex": regex, "flops": sum(by_source[src] for src in hits), "sources": hits}


def text_budget(text: str, chip: str, model_flops: float, xla_cost: dict | None = None,
                match: str | None = None, top: int = 16) -> dict:
    """step_budget of a compiled HLO module's text (tools.aot --save_hlo, or another program's
    `--xla_dump_to` *after_optimizations.txt): the same fields, XLA's cost analysis only if given.
    match: a regex over flops_source names; the FLOPs of every matching source are summed in
    `flops_matching` (e.g. 'attn' for the attention of every layer, not only the top 16 sources).
    top: how many of the largest sources `flops_by_source` / `bytes_by_source` list."""
    h = hlo_budget(text, top)
    peaks = CHIP_PEAKS[chip]
    t_flops = h["flops"] / peaks["peak_flops"]
    t_hbm = h["bytes_accessed"] / peaks["hbm_bytes_per_s"]
    t_ici = h["collective_bytes"] / peaks["ici_bytes_per_s"] if peaks["ici_bytes_per_s"] else 0.0
    est = max(t_flops, t_hbm, t_ici)
    bound = {t_flops: "compute", t_hbm: "hbm", t_ici: "ici"}[est]
    return {
        "compiled_flops": h["flops"], "model_flops": float(model_flops),
        "useful_flops_fraction": round(model_flops / h["flops"], 4) if h["flops"] else None,
        "bytes_accessed": h["bytes_accessed"], "collective_bytes": h["collective_bytes"],
        "collective_bytes_by_op": h["collective_bytes_by_op"],
        "estimated_step_seconds": est, "serial_seconds": t_flops + t_hbm + t_ici,
        "seconds_by_bound": {"compute": t_flops, "hbm": t_hbm, "ici": t_ici}, "bound": bound,
        "estimated_mfu": round(model_flops / (est * peaks["peak_flops"]), 4) if est else None,
        "flops_by_source": h["flops_by_source"], "bytes_by_source": h["bytes_by_source"], "chip_peaks": peaks,
        "while_trip_counts": h["while_trip_counts"],
        "unknown_trip_loops": h["unknown_trip_loops"], "unknown_cost_kernels": h["unknown_cost_kernels"],
        "xla_cost_analysis": xla_cost or {},
        "budget_note": BUDGET_NOTE,
        **({"flops_matching": _matching(h["flops_by_source_all"], match)} if match else {}),
    }


def define_flags(fv) -> None:
    """This CLI's flags, defined into `fv` (its own FlagValues: no collision with another tool's flags)."""
    from absl import flags
    flags.DEFINE_enum("chip", "v5p", list(CHIP_PEAKS), "chip peaks", flag_values=fv)
    flags.DEFINE_float("model_flops", 0.0, "model FLOPs per device (for useful fraction / MFU)", flag_values=fv)
    flags.DEFINE_string("match", None, "also sum the FLOPs of every source matching this regular expression "
                        "(flops_matching), e.g. 'attn'", flag_values=fv)
    flags.DEFINE_integer("top", 16, "list this many of the largest FLOP and byte sources", lower_bound=1,
                         flag_values=fv)
    flags.DEFINE_bool("json", False, "print the budget as one JSON line", flag_values=fv)


def main(argv=None) -> int:
    """python -m tools.budget HLO_TEXT_FILE --chip=v5p [--model_flops=F] [--json]: the budget of a dumped,
    compiled HLO module (e.g. tools.aot --save_hlo, or MaxText's train_compile with
    XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text: DIR/*train_step*after_optimizations.txt).
    argv: the arguments without the program name (default sys.argv[1:]). Bad flags or input: exit 2."""
    import gzip
    import json
    import sys

    from absl import flags

    from glm5_jax.cli import USAGE_EXIT
    from tools.flagparse import parse
    fv = flags.FlagValues()
    define_flags(fv)
    rest = parse(fv, "tools.budget", argv, usage="HLO_TEXT_FILE [flags]")
    if isinstance(rest, int):
        return rest
    if len(rest) != 1:
        print(f"error: give exactly one compiled HLO text file (.txt or .txt.gz), got {rest or 'none'}",
              file=sys.stderr)
        return USAGE_EXIT
    a, hlo = fv, rest[0]
    if a.match is not None:
        try:
            re.compile(a.match)
        except re.error as e:
            print(f"error: --match={a.match!r} is not a regular expression: {e}", file=sys.stderr)
            return USAGE_EXIT
    try:
        opener = gzip.open if hlo.endswith(".gz") else open
        with opener(hlo, "rt") as f:
            text = f.read()
    except OSError as e:
        print(f"error: {hlo}: {e.strerror or e}", file=sys.stderr)
        return USAGE_EXIT
    if "ENTRY" not in text:
        print(f"error: {hlo}: not an HLO module's text (no ENTRY computation)", file=sys.stderr)
        return USAGE_EXIT
    b = text_budget(text, a.chip, a.model_flops, match=a.match, top=a.top)
    if a.json:
        print(json.dumps(b))
    else:
        t = b["seconds_by_bound"]
        print(f"compiled FLOPs {b['compiled_flops']:.4g}, model FLOPs {b['model_flops']:.4g}, useful "
              f"{b['useful_flops_fraction']}; bytes {b['bytes_accessed']:.4g}, collectives {b['collective_bytes']:.4g}; "
              f"compute {t['compute']:.4g}s HBM {t['hbm']:.4g}s ICI {t['ici']:.4g}s -> {b['estimated_step_seconds']:.4g}s "
              f"({b['bound']}), MFU {b['estimated_mfu']}; unknown-cost kernels {len(b['unknown_cost_kernels'])}, "
              f"unknown-trip loops {len(b['unknown_trip_loops'])}")
        print(f"FLOPs by source (top {a.top}):")
        for src, f in b["flops_by_source"].items():
            print(f"  {f:12.4g}  {src}")
        print(f"bytes accessed by source [op] (top {a.top}):")
        for src, f in b["bytes_by_source"].items():
            print(f"  {f:12.4g}  {src}")
        if a.match is not None:
            fm = b["flops_matching"]
            print(f"FLOPs of the {len(fm['sources'])} sources matching {a.match!r}: {fm['flops']:.4g}")
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
