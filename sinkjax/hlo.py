"""What a compiled program computes and moves, read from the text of XLA's HLO after optimization, and how long that
takes at a chip's peaks: the walk `sinkjax.compile` reports its speed figures from.

`hlo_costs(text)`: per chip and step, FLOPs (matmuls, convolutions, the Pallas kernels' cost estimates, cuDNN's
fused attention), the part remat recomputes, HBM and host bytes, collective bytes by kind and their ring traffic,
with every while loop counted trip-count times (XLA's own `cost_analysis()` counts a loop body once), and
`breakdown`, where the bytes and FLOPs go by category, pass and instruction. `roofline(costs, chip, ...)`: the
step-time estimate over a chip's peak figures (`CHIPS`). `parse_hlo`: the one parser of HLO text (also
`bench.profile_summary`'s). Pure functions of the text: no JAX, no devices.
"""
from __future__ import annotations

import dataclasses
import math
import re


@dataclasses.dataclass(frozen=True)
class Chip:
  """Per-chip peak figures that the roofline estimate divides by."""
  peak_flops: float        # dense bf16 matmul FLOP/s
  hbm_bandwidth: float     # bytes/s
  ici_bandwidth: float     # bytes/s over all of the chip's inter-chip links (NVLink for GPUs)
  source: str
  clock_hz: float = 0.0    # TPU: peak / (2 x the MXUs' multiply-adds per cycle); what XLA:TPU's cycle estimates count


# The vendors' figures (docs/TPU.md shows this table).
CHIPS = {
    "v4": Chip(275e12, 1200e9, 1.1e15 / 4096, "cloud.google.com/tpu/docs/v4: 275 TFLOPs, 1200 GBps; ICI: the pod's "
                                               "1.1 PB/s all-reduce bandwidth / 4096 chips", 275e12 / (2 * 8 * 128 ** 2)),
    "v5e": Chip(197e12, 819e9, 400e9, "cloud.google.com/tpu/docs/v5e: 197 TFLOPs, 819 GBps, bidirectional ICI "
                                      "400 GBps per chip", 197e12 / (2 * 4 * 128 ** 2)),
    "v5p": Chip(459e12, 2765e9, 600e9, "cloud.google.com/tpu/docs/v5p: 459 TFLOPs, 2765 GBps, ICI 4800 Gbps",
                459e12 / (2 * 8 * 128 ** 2)),
    "v6e": Chip(918e12, 1638e9, 800e9, "cloud.google.com/tpu/docs/v6e: 918 TFLOPs, 1638 GBps, bidirectional ICI "
                                       "800 GBps per chip", 918e12 / (2 * 4 * 256 ** 2)),
    "h100": Chip(989e12, 3.35e12, 900e9, "NVIDIA H100 SXM datasheet: 989 TFLOPS dense BF16, 3.35 TB/s HBM3, NVLink "
                                         "900 GB/s"),
    "h200": Chip(989e12, 4.8e12, 900e9, "NVIDIA H200 SXM datasheet: 989 TFLOPS dense BF16, 4.8 TB/s HBM3e, NVLink "
                                        "900 GB/s"),
}

_DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
                "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16}
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\](?:\{([^}]*)\})?")
_INSTRUCTION = re.compile(r"\s*(?:ROOT\s+)?%([\w.\-]+) = ")
_COMPUTATION = re.compile(r"(?:ENTRY\s+)?%([\w.\-]+) \(")
_CALLEE = r"=%([\w.\-]+)"
# Instructions that move no HBM bytes of their own (views, control flow, the done half of async pairs).
_NO_TRAFFIC = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "call", "conditional",
               "after-all", "partition-id", "replica-id", "opt-barrier", "iota", "copy-done", "async-done"}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
# Ring-algorithm traffic per chip in units of the collective's full array, n chips in the group.
_RING = {"all-gather": lambda n: (n - 1) / n, "reduce-scatter": lambda n: (n - 1) / n,
         "all-reduce": lambda n: 2 * (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
         "collective-permute": lambda n: 1.0}
# XLA:GPU's cuBLAS matmul custom calls (their output: (result, s8 workspace)).
_CUDNN_FMHA = re.compile(r'custom_call_target="__cudnn\$fmha\w*"')
_CUBLAS = re.compile(r'custom_call_target="__cublas\$(?:lt\$matmul|gemm)"')
# Pallas's Triton lowering drops `pl.CostEstimate`; sinkjax's GPU kernels put theirs in the kernel's name
# (`kernels.pallas_gpu`), which the compiled program keeps in the call's metadata.
GPU_COST_NAME = r"__cost_f(\d+)_t(\d+)_b(\d+)"
# tokamax's Pallas Mosaic-GPU attention kernels (sinkjax's `mosaic_gpu` backend): custom calls `mosaic_gpu_v2` whose
# metadata carries the op's arguments as JSON (tokamax's `metadata_payload`), quotes escaped
_MOSAIC_GPU = re.compile(r'custom_call_target="mosaic_gpu')
_TOKAMAX_ATTENTION = re.compile(r'tokamax:\{\\"op\\":\{\\"__type\\":\\"tokamax\._src\.ops\.attention\.\w+\.(\w+)\\"')
# Loop counters: lax.scan / fori_loop count in s32; XLA:TPU's windowed einsums (an FSDP all-gather decomposed into
# per-shard matmuls, `windowed_dot_general` loops) in u32.
_COUNTERS = ([("s32", ())], [("s64", ())], [("u32", ())], [("u64", ())])
_HOST_SPACE = 5                   # XLA:TPU's memory space of pinned host memory (S(5) in a layout)


def _close(text: str, start: int) -> int:
  """The index just past the bracket group that opens at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    depth += 1 if text[i] in "({[" else -1 if text[i] in ")}]" else 0
    if depth == 0:
      return i + 1
  return len(text)


def _arrays(type_text: str) -> list:
  """[(dtype, dims, memory space)] of an HLO type (an array or a tuple of them); memory space 0 is HBM (XLA:TPU:
  S(1) on-chip VMEM, S(5) host)."""
  out = []
  for dtype, dims, layout in _ARRAY.findall(type_text):
    space = re.search(r"S\((\d+)\)", layout or "")
    out.append((dtype, tuple(int(d) for d in dims.split(",") if d), int(space.group(1)) if space else 0))
  return out


def _nbytes(type_text: str, space: int | None = 0) -> int:
  """Bytes of the arrays of a type that live in memory space `space` (None: in any)."""
  return sum(math.prod(dims) * _DTYPE_BYTES.get(dt, 4) for dt, dims, sp in _arrays(type_text)
             if space is None or sp == space)


@dataclasses.dataclass
class Instruction:
  name: str
  type: str
  opcode: str
  args: str             # the text inside the opcode's parentheses
  attrs: str            # the rest of the line

  @property
  def operands(self) -> list:
    return re.findall(r"%([\w.\-]+)", self.args)

  def callees(self, key: str = r"calls|to_apply|body|true_computation|false_computation") -> list:
    return re.findall(rf"(?:{key}){_CALLEE}", self.attrs)


def parse_hlo(text: str) -> tuple[dict, str]:
  """({computation: {instruction name: Instruction}} in program order, the entry computation) of HLO text (the one
  parser of HLO text: `hlo_costs` here, `bench.profile_summary` for its categories)."""
  comps, entry, current = {}, None, None
  for line in text.splitlines():
    m = _COMPUTATION.match(line)
    if m and line.rstrip().endswith("{"):
      current = comps.setdefault(m.group(1), {})
      entry = m.group(1) if line.startswith("ENTRY") else entry
      continue
    m = _INSTRUCTION.match(line)
    if not m or current is None:
      continue
    i = m.end()
    j = _close(line, i) if line[i] == "(" else _ARRAY.match(line, i).end()
    op = re.match(r"\s*([\w\-]+)\(", line[j:])
    if op:
      k = j + op.end() - 1
      end = _close(line, k)
      current[m.group(1)] = Instruction(m.group(1), line[i:j], op.group(1), line[k + 1:end - 1], line[end:])
  return comps, entry


class _HloCosts:
  """The walk behind `hlo_costs`."""

  def __init__(self, text: str):
    self.comps, self.entry = parse_hlo(text)
    self.fused = {c for comp in self.comps.values() for i in comp.values() if i.opcode in ("fusion", "fusion-start")
                  for c in i.callees("calls")}
    self.out = dict(flops=0.0, recompute_flops=0.0, transcendentals=0.0, hbm_bytes=0.0, host_bytes=0.0,
                    ici_bytes=0.0, collective_bytes={k: 0.0 for k in COLLECTIVES}, loops_of_unknown_trips=0)
    self.channels = set()
    self._param_reads = {}
    self.records = {}                 # (computation, instruction) -> what it adds (`breakdown`)
    self.frames = _stack_frames(text)

  def type_of(self, comp: str, name: str) -> str:
    ins = self.comps.get(comp, {}).get(name)
    return ins.type if ins else ""

  def dims(self, comp: str, name: str):
    arrays = _arrays(self.type_of(comp, name))
    return arrays[0][1] if len(arrays) == 1 else None

  def trips(self, comp: str, loop: Instruction) -> int | None:
    """Trips of a while loop: its condition compares the counter with one integer constant N (`i < N`, how lax.scan
    and fori_loop lower), the counter starting at the loop's initial tuple element (a constant, else 0) and growing
    by its body's step (`step`)."""
    cond = re.search(r"condition" + _CALLEE, loop.attrs).group(1)
    inside = [cond] + [c for i in self.comps.get(cond, {}).values() if i.opcode == "fusion" for c in i.callees("calls")]
    values = [int(i.args) for c in inside for i in self.comps.get(c, {}).values() if i.opcode == "constant"
              and re.fullmatch(r"-?\d+", i.args.strip()) and [a[:2] for a in _arrays(i.type)] in _COUNTERS]
    if len(values) != 1:
      return None
    start, counter = 0, None
    for i in self.comps[cond].values():
      if i.opcode == "get-tuple-element" and i.operands:
        counter = int(re.search(r"index=(\d+)", i.attrs).group(1))
    init = self.comps[comp].get(loop.operands[0]) if loop.operands else None
    if init is not None and init.opcode == "tuple" and counter is not None and counter < len(init.operands):
      first = self.comps[comp].get(init.operands[counter])
      if first is not None and first.opcode == "constant" and re.fullmatch(r"-?\d+", first.args.strip()):
        start = int(first.args)
    return -(-(values[0] - start) // self.step(loop, counter))

  def step(self, loop: Instruction, counter: int | None) -> int:
    """What a loop's body adds to its counter (tuple element `counter`) per trip: the constant of `add(counter, k)`
    at that place of the body's root tuple (XLA:TPU's bidirectional windowed einsums count by 2), else 1."""
    body = self.comps.get(re.search(r"body" + _CALLEE, loop.attrs).group(1), {})
    root = list(body.values())[-1] if body else None
    if root is None or root.opcode != "tuple" or counter is None or counter >= len(root.operands):
      return 1
    new = body.get(root.operands[counter])
    if new is None or new.opcode != "add":
      return 1
    for name in new.operands:
      c = body.get(name)
      if c is not None and c.opcode == "constant" and re.fullmatch(r"-?\d+", c.args.strip()) and int(c.args) > 0:
        return int(c.args)
    return 1

  def flops(self, comp: str, ins: Instruction) -> int:
    if ins.opcode == "dot" or (ins.opcode == "custom-call" and _CUBLAS.search(ins.attrs)):   # XLA:GPU's matmuls
      lhs = self.dims(comp, ins.operands[0])                  # (a cuBLAS call has the dot's dimensions in its config)
      dims = re.search(r'lhs_contracting_dims=\{([\d,]*)\}|"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
      if lhs is None or dims is None:
        return 0
      listed = dims.group(1) if dims.group(1) is not None else dims.group(2)
      contracting = [int(d.strip('" ')) for d in listed.split(",") if d.strip('" ')]
      return 2 * math.prod(_arrays(ins.type)[0][1]) * math.prod(lhs[d] for d in contracting)
    if ins.opcode == "convolution":
      return self.conv_flops(comp, ins)
    if ins.opcode == "custom-call" and _CUDNN_FMHA.search(ins.attrs):
      return self.fmha_flops(comp, ins)
    if ins.opcode == "custom-call" and _MOSAIC_GPU.search(ins.attrs) and _TOKAMAX_ATTENTION.search(ins.attrs):
      return self.tokamax_attention_flops(ins)
    return 0

  @staticmethod
  def tokamax_attention_flops(ins: Instruction) -> int:
    """tokamax's Mosaic-GPU flash attention, from the op's arguments in its metadata (q [B, T, H, D], k [B, S, h, D],
    the causal mask's offset): the forward kernel's 2 matmuls (QK^T, PV); the backward's dQ kernel 3 (QK^T, dO V^T,
    dS K) and dK/dV kernel 4 (QK^T, dO V^T, P^T dO, dS^T Q), told apart by their outputs (dq; dk, dv); 2 FLOPs per
    multiply-add over the visible (query, key) pairs (causal: key s <= t + offset). Per-query key ranges (packed
    documents) count the whole causal rows: an upper bound, the ranges being data."""
    op = _TOKAMAX_ATTENTION.search(ins.attrs).group(1)
    shape = lambda name: re.search(r'\\"' + name + r'\\":\\"\w+\[([\d,]+)\]', ins.attrs)
    q, k = shape("q"), shape("k")
    if q is None or k is None:
      return 0
    B, T, H, D = (int(x) for x in q.group(1).split(","))
    S = int(k.group(1).split(",")[1])
    causal = re.search(r'\\"causal_mask\\":\{\\"offset\\":(-?\d+)', ins.attrs)
    if causal:
      offset = int(causal.group(1))
      pairs = sum(min(max(t + 1 + offset, 0), S) for t in range(T))
    else:
      pairs = T * S
    if op.endswith("Vjp"):
      matmuls = 3 if len(_arrays(ins.type)) == 1 else 4
    else:
      matmuls = 2
    return 2 * matmuls * B * H * pairs * D

  def fmha_flops(self, comp: str, ins: Instruction) -> int:
    """cuDNN's fused attention (sinkjax's `cudnn` backend, jax.nn's cudnn implementation): 2 matmuls forward (QK^T,
    PV), 5 backward (QK^T again, dO V^T, P^T dO, dS K, dS^T Q), 2 FLOPs per multiply-add over the visible (query,
    key) pairs of its [B, N, T, S] logits (causal: top-left aligned, sum over t of min(t + 1, S)). Packed documents
    (max_seg_per_batch > 1) count the whole rows: an upper bound, the split being data."""
    shape = re.search(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]', ins.attrs)
    q = self.dims(comp, ins.operands[0]) if ins.operands else None
    if shape is None or q is None:
      return 0
    B, N, T, S = (int(x.strip('" ')) for x in shape.group(1).split(","))
    mask = re.search(r'"mask_type":\s*"(\w+)"', ins.attrs)
    causal = mask is not None and "CAUSAL" in mask.group(1)
    pairs = sum(min(t + 1, S) for t in range(T)) if causal else T * S
    matmuls = 5 if "Backward" in _CUDNN_FMHA.search(ins.attrs).group(0) else 2
    return 2 * matmuls * B * N * pairs * q[-1]

  def conv_flops(self, comp: str, ins: Instruction) -> int:
    """2 x output elements x kernel input features x the kernel taps that land inside the unpadded input (XLA:TPU
    writes matmuls, batched ones too, as convolutions)."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    lhs, rhs = (self.dims(comp, o) for o in ins.operands[:2])
    if labels is None or lhs is None or rhs is None:
      return 0
    lhs_l, rhs_l, out_l = labels.groups()
    out = _arrays(ins.type)[0][1]
    window = re.search(r"window=\{([^}]*)\}", ins.attrs)
    fields = dict(f.split("=", 1) for f in window.group(1).split()) if window else {}
    taps = 1.0
    for n, c in enumerate(sorted(c for c in lhs_l if c.isdigit())):
      field = lambda key, default: fields[key].split("x")[n] if key in fields else default
      size, stride = int(field("size", 1)), int(field("stride", 1))
      lhs_dil, rhs_dil = int(field("lhs_dilate", 1)), int(field("rhs_dilate", 1))
      pad_lo = int(field("pad", "0_0").split("_")[0])
      n_in, n_out = lhs[lhs_l.index(c)], out[out_l.index(c)]
      valid = sum(1 for o in range(n_out) for k in range(size)
                  if 0 <= (p := o * stride + k * rhs_dil - pad_lo) <= (n_in - 1) * lhs_dil and p % lhs_dil == 0)
      taps *= valid / max(n_out, 1)
    return int(2 * math.prod(out) * rhs[rhs_l.index("i")] * taps)

  def param_reads(self, body_name: str) -> dict:
    """{parameter number: bytes read} of a fused computation's parameters that it reads only in part: through a
    slice, dynamic-slice or gather (the slice), as the buffer a dynamic-update-slice updates in place (nothing), or
    through a nested fusion that does one of these; directly or through bitcasts of it. A parameter absent from the
    result is read whole."""
    if body_name in self._param_reads:
      return self._param_reads[body_name]
    body = self.comps.get(body_name, {})
    params = {i.name: int(i.args) for i in body.values() if i.opcode == "parameter"}
    uses = {}
    for i in body.values():
      if i.opcode == "bitcast" and i.operands and i.operands[0] in params:
        params[i.name] = params[i.operands[0]]      # a bitcast of a parameter is the parameter: its uses are
        continue                                    # the parameter's (XLA:GPU gathers from [B, T, V] views)
      nested = self.param_reads(i.callees("calls")[0]) if i.opcode == "fusion" and i.callees("calls") else {}
      for pos, o in enumerate(i.operands):
        if o in params:
          part = _nbytes(i.type, None) if i.opcode in ("dynamic-slice", "slice", "gather") and pos == 0 else \
              0 if i.opcode == "dynamic-update-slice" and pos == 0 else nested.get(pos)
          uses.setdefault(params[o], []).append(part)
    self._param_reads[body_name] = out = {k: sum(v) for k, v in uses.items() if None not in v}
    return out

  def traffic(self, comp: str, ins: Instruction, space: int) -> int:
    """Bytes an unfused instruction reads and writes in memory space `space` (0: HBM, 5: host): its operands and
    outputs there; of a fusion's operand that the fusion only slices, the slices; a fusion that updates a slice in
    place writes the update. An async start (copy-start, slice-start, all-gather-start, ...) holds its operands in
    its output tuple as well: they count once, as reads (a slice-start reads its slice)."""
    written, reads = _nbytes(ins.type, space), {}
    operand_types = [self.type_of(comp, o) for o in ins.operands]
    if ins.opcode == "fusion-start" and ins.type.startswith("(("):
      # XLA:GPU's async fusion ((operand aliases), output, context): the fusion itself, on its output alone
      inner = ins.type[1:_close(ins.type, 1)]
      out = ins.type[len(inner) + 2:].rsplit(",", 1)[0].strip(" ,)")
      return self.traffic(comp, dataclasses.replace(ins, type=out, opcode="fusion"), space)
    if ins.opcode == "custom-call" and _CUBLAS.search(ins.attrs) and ins.type.startswith("("):
      written = sum(math.prod(d) * _DTYPE_BYTES.get(t, 4) for t, d, sp in _arrays(ins.type)[:-1] if sp == space)
    elif ins.opcode.endswith("-start") and ins.type.startswith("("):
      outs = _arrays(ins.type)
      for dt, dims, sp in (a for t in operand_types for a in _arrays(t)):   # the operands' aliases in the tuple
        if (dt, dims, sp) in outs:
          outs.remove((dt, dims, sp))
      written = sum(math.prod(d) * _DTYPE_BYTES.get(t, 4) for t, d, sp in outs if sp == space and d)
      if ins.opcode == "slice-start":
        reads = {0: min(_nbytes(operand_types[0], space),
                        sum(math.prod(d) * _DTYPE_BYTES.get(t, 4) for t, d, _ in outs if d))}
    elif ins.opcode in ("slice", "dynamic-slice", "gather"):
      reads = {0: min(_nbytes(operand_types[0], space), _nbytes(ins.type, None))}
    elif ins.opcode == "dynamic-update-slice":
      reads, written = {0: 0}, min(written, _nbytes(operand_types[1], None))
    elif ins.opcode == "fusion" and ins.callees("calls"):
      body = self.comps.get(ins.callees("calls")[0], {})
      reads = self.param_reads(ins.callees("calls")[0])
      root = list(body.values())[-1] if body else None
      outs = [body.get(o) for o in root.operands] if root is not None and root.opcode == "tuple" else [root]
      arrays = _arrays(ins.type)
      if len(outs) == len(arrays):    # an output updated in place (a scan stacking its residuals) writes the update
        written = sum(0 if sp != space else _nbytes(body[o.operands[1]].type, None)
                      if o is not None and o.opcode == "dynamic-update-slice" and o.operands[1] in body
                      else math.prod(dims) * _DTYPE_BYTES.get(dt, 4) for o, (dt, dims, sp) in zip(outs, arrays))
    operands = [_nbytes(t, space) for t in operand_types]
    return written + sum(min(reads.get(k, n), n) for k, n in enumerate(operands))

  def collective(self, comp: str, ins: Instruction, mult: float):
    kind = next((k for k in COLLECTIVES if ins.opcode.startswith(k)), None)
    if kind is None or ins.opcode.endswith("-done"):
      return 0
    channel = re.search(r"channel_id=(\d+)", ins.attrs)
    key = channel.group(1) if channel else (comp, ins.name)
    if key in self.channels:          # an async collective's start and done halves both hold it
      return 0
    self.channels.add(key)
    if kind == "all-reduce" and comp.startswith("all-reduce-scatter"):
      kind = "reduce-scatter"         # XLA:TPU's reduce-scatter: an all-reduce fused with the slice it keeps
    arrays = _arrays(ins.type)
    size = sum(math.prod(d) * _DTYPE_BYTES.get(t, 4) for t, d, _ in arrays[-1:] if kind != "reduce-scatter") or \
        sum(_nbytes(self.type_of(comp, o), None) for o in ins.operands)
    self.out["collective_bytes"][kind] += mult * size
    self.out["ici_bytes"] += mult * size * _RING[kind](_group_size(ins.attrs))
    return mult * size

  def walk(self, comp: str, mult: float, loops: tuple = (), owner: tuple | None = None):
    """Adds up comp's instructions, each `mult` times (the trips of the loops around it, `loops`); what a fused
    computation's instructions add is also recorded under the unfused instruction that calls it (`owner`)."""
    fused = comp in self.fused
    for ins in self.comps.get(comp, {}).values():
      op, attrs = ins.opcode, ins.attrs
      flops = self.flops(comp, ins)
      hbm = 0
      est = (re.search(r'"cost_estimate":\{"flops":"?(\d+)"?,"transcendentals":"?(\d+)"?,"bytes_accessed":"?(\d+)',
                       attrs) or re.search(GPU_COST_NAME, attrs)) if op == "custom-call" else None
      if est:                         # a Pallas kernel's pl.CostEstimate
        flops = int(est.group(1))
        self.out["transcendentals"] += mult * int(est.group(2))
        hbm = int(est.group(3))
      self.out["flops"] += mult * flops
      if "rematted_computation" in attrs:
        self.out["recompute_flops"] += mult * flops
      moved = self.collective(comp, ins, mult)
      if not fused and not est and op not in _NO_TRAFFIC and not op.endswith("-done") and \
          "AllocateBuffer" not in attrs:
        hbm = self.traffic(comp, ins, 0)
        self.out["host_bytes"] += mult * self.traffic(comp, ins, _HOST_SPACE)
      self.out["hbm_bytes"] += mult * hbm
      if hbm or flops or moved:
        key = owner or (comp, ins.name)
        rec = self.records.get(key)
        if rec is None:
          rec = self.records[key] = dict(hbm_bytes=0.0, flops=0.0, collective_bytes=0.0, mult=mult, loops=loops,
                                         instruction=ins if owner is None else self.comps[owner[0]][owner[1]],
                                         matmul=False, xla_cycles=0.0)
          cycles = re.search(r'"estimated_cycles":"(\d+)"', rec["instruction"].attrs)
          rec["xla_cycles"] = mult * int(cycles.group(1)) if cycles else 0.0
        rec["hbm_bytes"] += mult * hbm
        rec["flops"] += mult * flops
        rec["collective_bytes"] += moved
        rec["matmul"] |= bool(flops) and not est
      if op == "while":
        trips = self.trips(comp, ins)
        self.out["loops_of_unknown_trips"] += trips is None
        self.walk(re.search(r"body" + _CALLEE, attrs).group(1), mult * (trips if trips is not None else 1),
                  loops + ((trips, ins),))
      elif op == "conditional":       # the first branch stands for all of them
        branches = re.search(r"branch_computations=\{%?([\w.\-]+)", attrs)
        for c in ([branches.group(1)] if branches else ins.callees("true_computation")):
          self.walk(c, mult, loops)
      elif op in ("fusion", "call") or op.endswith("-start"):
        for c in ins.callees("calls|to_apply" if op == "call" else "calls"):
          self.walk(c, mult, loops, owner if op == "call" or owner else (comp, ins.name))


def _group_size(attrs: str) -> int:
  """Devices per replica group of a collective (its `replica_groups`, in any of XLA's three spellings)."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
  if m:
    sizes = {k: int(v) for k, v in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
    return max(1, math.prod(sizes.get(a.strip(" '"), 1) for a in m.group(2).split(",") if a.strip()))
  m = re.search(r"replica_groups=\[\d+,(\d+)\]", attrs)
  if m:
    return int(m.group(1))
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
  return max(1, len(m.group(1).split(","))) if m else 1


def _stack_frames(text: str) -> dict:
  """{stack frame id: (file, line, function, parent frame id or 0)} from the FileNames / FunctionNames /
  FileLocations / StackFrames tables that head a compiled module's text (instructions name their innermost frame:
  `stack_frame_id=N` in their metadata). The text prints each parent id one above the frame it means."""
  tables, current = {}, None
  for line in text.splitlines():
    if line.startswith(("HloModule", "%", "ENTRY")):
      if tables.get("StackFrames"):
        break
      continue
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      current = tables.setdefault(line, {})
    elif current is not None and line[:1].isdigit():
      n, rest = line.split(" ", 1)
      current[int(n)] = rest
  names = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
  funcs = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
  locs = {}
  for k, v in tables.get("FileLocations", {}).items():
    f = dict(re.findall(r"(\w+)=(\d+)", v))
    locs[k] = (names.get(int(f.get("file_name_id", 0)), "?"), int(f.get("line", 0)),
               funcs.get(int(f.get("function_name_id", 0)), "?"))
  frames = {}
  for k, v in tables.get("StackFrames", {}).items():
    f = dict(re.findall(r"(\w+)=(\d+)", v))
    frames[k] = locs.get(int(f.get("file_location_id", 0)), ("?", 0, "?")) + (max(int(f.get("parent_frame_id", 1)) - 1,
                                                                                 0),)
  return frames


# The per-category table of `hbm_breakdown`, in the order a record is tested against them.
CATEGORIES = ("attention kernels", "collectives", "loss", "optimizer", "matmuls", "prefetches into VMEM",
              "copies / transposes / slices", "elementwise / other fusions", "other")
# Functions whose work is the loss (the LM head, the cross-entropy, their chunking, and the fused loss's blocks,
# train.loss_impl=fused: `fused_ce_sum`, `_fused_ce*`; not `token_losses`, which also runs the layers).
LOSS_FUNCTIONS = ("chunked_nll", "Transformer.logits", "softmax_cross_entropy", "fused_ce_sum", "_fused_ce")
# Instructions that only move or re-arrange data (a fusion of nothing else is a copy).
_MOVES = {"parameter", "copy", "transpose", "bitcast", "reshape", "tuple", "get-tuple-element", "slice",
          "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "constant", "copy-start", "copy-done",
          "slice-start", "slice-done", "broadcast", "iota"}


def _source(frames: dict, frame: int, depth: int = 2) -> list:
  """The innermost `depth` frames of sinkjax's own code on the stack of frame `frame`, "file:line function"."""
  out, seen = [], set()
  while frame in frames and frame not in seen and len(out) < depth:
    seen.add(frame)
    path, line, func, parent = frames[frame]
    if "/sinkjax/" in path and "/site-packages/" not in path:
      out.append(f"{path[path.rindex('/sinkjax/') + 1:]}:{line} {func}")
    frame = parent
  return out


def _frame_functions(frames: dict, frame: int) -> list:
  """[(file, function)] of every frame on the stack of frame `frame`, innermost first."""
  out, seen = [], set()
  while frame in frames and frame not in seen:
    seen.add(frame)
    out.append((frames[frame][0], frames[frame][2]))
    frame = frames[frame][3]
  return out


def _category(costs: "_HloCosts", rec: dict, stack: list) -> str:
  ins = rec["instruction"]
  if ins.opcode == "custom-call" and ("tpu_custom_call" in ins.attrs or re.search(GPU_COST_NAME, ins.attrs)
                                      or "__gpu$xla.gpu.triton" in ins.attrs):
    return "attention kernels"
  if any(ins.opcode.startswith(k) for k in COLLECTIVES) or rec["collective_bytes"] or (
      ins.opcode == "fusion" and any(c.startswith("all-reduce-scatter") for c in ins.callees("calls"))):
    return "collectives"
  if any(f.startswith(LOSS_FUNCTIONS) for _, f in stack):
    return "loss"
  if any("/optax/" in p or p.endswith("sinkjax/optim.py") for p, _ in stack):
    return "optimizer"
  if rec["matmul"]:
    return "matmuls"
  if ins.opcode in ("copy-start", "slice-start") and any(sp == 1 for _, _, sp in _arrays(ins.type)):
    return "prefetches into VMEM"     # an operand read ahead into VMEM for a fusion (its read, counted here)
  if ins.opcode in _MOVES or (ins.opcode == "fusion" and all(
      i.opcode in _MOVES for c in ins.callees("calls") for i in costs.comps.get(c, {}).values())):
    return "copies / transposes / slices"
  if ins.opcode == "fusion" or ins.opcode in ("add", "multiply", "convert", "select", "reduce", "exponential"):
    return "elementwise / other fusions"
  return "other"


def _pass(op_name: str) -> str:
  """Which part of the step JAX's op name places an instruction in."""
  if "rematted_computation" in op_name:
    return "recompute"
  if "transpose(" in op_name:
    return "backward"
  if "jvp(" in op_name:
    return "forward"
  return "other"


def breakdown(costs: "_HloCosts", top: int = 25) -> dict:
  """Where a walked program's HBM bytes and FLOPs go (`hbm_breakdown`): `by_category` {category: {hbm_bytes, flops,
  instructions}} (CATEGORIES), `by_pass` {forward | backward | recompute | other: {hbm_bytes, flops}}, and `top`, the
  `top` unfused instructions of most HBM bytes, each with its fused work's FLOPs, the trips of the loops around it
  (`loops`: [{trips, body}], outermost first), its output type, JAX's op name and sinkjax's source lines; and
  `by_source`, the `top` (innermost sinkjax source line, pass, category) groups of every instruction by HBM bytes
  ({source ("" where none), phase, category, hbm_bytes, flops, instructions}): e.g. all of a step's RMSNorm fusions
  as one line, where `top` shows one instruction of each."""
  cats = {c: dict(hbm_bytes=0.0, flops=0.0, instructions=0, xla_cycles=0.0) for c in CATEGORIES}
  passes = {p: dict(hbm_bytes=0.0, flops=0.0) for p in ("forward", "backward", "recompute", "other")}
  rows = []
  for (comp, name), rec in costs.records.items():
    ins = rec["instruction"]
    op_name = (re.search(r'op_name="([^"]*)"', ins.attrs) or [None, ""])[1]
    frame = re.search(r"stack_frame_id=(\d+)", ins.attrs)
    stack = _frame_functions(costs.frames, int(frame.group(1))) if frame else []
    cat = _category(costs, rec, stack)
    cats[cat]["hbm_bytes"] += rec["hbm_bytes"]
    cats[cat]["flops"] += rec["flops"]
    cats[cat]["instructions"] += 1
    cats[cat]["xla_cycles"] += rec["xla_cycles"]
    ps = _pass(op_name)
    passes[ps]["hbm_bytes"] += rec["hbm_bytes"]
    passes[ps]["flops"] += rec["flops"]
    rows.append(dict(instruction=name, computation=comp, opcode=ins.opcode,
                     type=re.sub(r"\{[^}]*\}", "", ins.type).replace(" ", ""),
                     hbm_bytes=rec["hbm_bytes"], flops=rec["flops"], collective_bytes=rec["collective_bytes"],
                     trips=rec["mult"], loops=[dict(trips=t, body=re.search(r"body" + _CALLEE, w.attrs).group(1))
                                               for t, w in rec["loops"]],
                     category=cat, phase=ps, op_name=op_name,
                     source=_source(costs.frames, int(frame.group(1))) if frame else []))
  rows.sort(key=lambda r: -r["hbm_bytes"])
  # by the innermost sinkjax source line and pass: the lines whose work moves the most (all instructions, not the top)
  lines = {}
  for r in rows:
    line = lines.setdefault((r["source"][0] if r["source"] else "", r["phase"], r["category"]),
                            dict(hbm_bytes=0.0, flops=0.0, instructions=0))
    line["hbm_bytes"] += r["hbm_bytes"]
    line["flops"] += r["flops"]
    line["instructions"] += 1
  by_source = [dict(source=src, phase=ph, category=cat, **v) for (src, ph, cat), v in lines.items()]
  by_source.sort(key=lambda r: -r["hbm_bytes"])
  # what the core runs one after another: all but the collectives and the async copies / slices (DMAs beside it)
  synchronous = [(r["flops"], r["hbm_bytes"]) for r in rows
                 if r["category"] != "collectives" and not r["opcode"].endswith("-start")]
  return {"by_category": cats, "by_pass": passes, "top": rows[:top], "by_source": by_source[:top],
          "xla_cycles": sum(c["xla_cycles"] for c in cats.values()), "synchronous": synchronous}


def hlo_costs(text: str) -> dict:
  """Per chip and step, from the text of a compiled (SPMD-partitioned) program: `flops` (matmuls and convolutions,
  2 per multiply-add, plus the Pallas kernels' `pl.CostEstimate` flops, which Mosaic calls carry in their backend
  config and sinkjax's Triton calls in their names), `recompute_flops` (the part `jax.checkpoint` recomputes:
  instructions JAX names under "rematted_computation"), the kernels' `transcendentals`, `hbm_bytes` (what each unfused instruction reads and
  writes in HBM, operands and outputs, only the slices of an operand a fusion slices, kernels by their estimate),
  `host_bytes` (arrays copied to or from host memory: offloaded residuals), `collective_bytes` by kind (the arrays
  gathered, reduce-scattered, all-reduced, ...) and `ici_bytes` (what ring algorithms move per chip for them).

  Every while loop counts trip-count times, where XLA's own `cost_analysis()` counts a loop body once: the count
  is read from the loop's condition (`counter < N`, the form lax.scan and fori_loop lower to, the counter's start
  from the loop's initial value), nested loops multiply, and `loops_of_unknown_trips` counts loops read as one
  trip. So scanned layers, the chunked loss and micro-batches all count. Elementwise (VPU) work is not in `flops`
  (its cost shows in the bytes). XLA:GPU: cuBLAS matmul custom calls count as dots (their workspace output is no
  traffic), async fusions (`fusion-start`) as the fusions they run, sinkjax's Triton attention kernels by the
  estimate in their names (`GPU_COST_NAME`), cuDNN's fused attention by its logits' shape (`fmha_flops`)."""
  costs = _HloCosts(text)
  costs.walk(costs.entry, 1.0)
  b = breakdown(costs)
  return dict(costs.out, synchronous=b.pop("synchronous"), breakdown=b)


def roofline(costs: dict, chip: Chip, model_flops_per_chip: float) -> dict:
  """An estimate, not a measurement: the step cannot run faster than its FLOPs at the chip's peak, its HBM bytes at
  the HBM bandwidth, or its collectives' ring traffic at the ICI bandwidth; nor faster than its instructions one
  after another (`sequential`: the core runs one fusion, kernel or copy at a time, each no faster than its own FLOPs
  at peak or its own bytes at the HBM bandwidth, whichever is longer; collectives and async copies overlap them).
  With perfect overlap otherwise it takes the largest of these. The MFU bound is the model FLOPs (6N + attention)
  over that time at peak."""
  terms = {"compute": costs["flops"] / chip.peak_flops, "hbm": costs["hbm_bytes"] / chip.hbm_bandwidth,
           "ici": costs["ici_bytes"] / chip.ici_bandwidth}
  if costs.get("synchronous"):
    terms["sequential"] = sum(max(f / chip.peak_flops, b / chip.hbm_bandwidth) for f, b in costs["synchronous"])
  seconds = max(terms.values())
  return {"estimated_seconds_by_term": terms, "estimated_step_seconds": seconds,
          "estimated_bound": max(terms, key=terms.get),
          "estimated_mfu": model_flops_per_chip / (seconds * chip.peak_flops) if seconds > 0 else 0.0}


def attention_kernel(hlo: str, impl: str) -> str:
  """Which attention kernel the compiled program holds, read from its HLO (not from the settings)."""
  if "tpu_custom_call" in hlo:
    return "mosaic"
  if "__cudnn$fmha" in hlo:             # cuDNN's fused attention (a Triton fallback may sit beside it: cudnn.route)
    return "cudnn"
  if 'custom_call_target="mosaic_gpu' in hlo:   # Pallas Mosaic GPU (tokamax's kernels: sinkjax's mosaic_gpu backend)
    return "mosaic_gpu"
  if "__gpu$xla.gpu.triton" in hlo:     # Pallas's Triton custom call; bare "triton" is also XLA:GPU's own GEMM fusions
    return "triton"
  if impl in ("pallas_tpu", "pallas_gpu") and "callback" in hlo:
    return "pallas-interpreter"
  return impl
