"""A decode kernel's main loop in SASS, without a GPU: the weight-only or fp8 GEMM's K loop, or decode attention's
key loop over a bf16 cache or e4m3 codes. The kernel is compiled ahead of time for sm_90 with the specializations a real
launch gets (unit strides, 16-divisible sizes, strides and pointers), disassembled with the `cuobjdump` that Triton
ships, and the longest loop's instructions are counted by opcode. The registers per thread (which cap the programs
an SM holds) come from the same cubin.

Run: python -m bench.sass [int8|int4|mxfp4|nvfp4] [--stages N] [--rows M] [--pair-order] [--code-rows] [--prefetch]
                         [--tile BMxBNxWARPS]        (the tiles for M rows, 16 unless given; --pair-order: operands
                                                     in codes.pair_order; --code-rows: int4 codes in rows, not the
                                                     GPU's tiles; --prefetch: the first codes asked of the L2)
     python -m bench.sass fp8 [--stages N] [--swap] [--prefetch] [--weight-tma]   (row scales, M <= 8,
                                                     14336x4096: the decode tiles of gemm_configs; --swap: the
                                                     operands swapped, SWAP_AB; --weight-tma: WEIGHT_TMA)
     python -m bench.sass prologue [--stages N]   (bench.quant_prologue's GEMM: the per-token quantizer in its K
                                                     loop, 16 x 64 tiles over 4096 columns)
     python -m bench.sass w4a8 [--stages N]   (int4_fp8's GEMM at decode, 4096 rows, split in 8)
     python -m bench.sass grouped [--channel-groups] [--row-tiles] [--stages N] [--tile BMxBNxWARPS]   (the grouped
                                                     fp8 GEMM of MoE prefill on pointers, Mixtral's gate/up over 8192
                                                     rows, at its plan's tiles; --row-tiles: the row scales' tiles)
     --tile BMxBNxWARPS (weight-only and grouped): another tile's BLOCK_M, BLOCK_N and warps than the plan's
     python -m bench.sass mma [--stages N] [--code-rows] [--prefetch] [--offset-after] [--e4m3]   (int4 at M = 1
                                                     on mma.sync, 14336x4096, split in 5; --offset-after: zero points
                                                     applied after the MMAs; --e4m3: W4A8's e4m3 activations)
     python -m bench.sass fp4mma [mxfp4|nvfp4] [--stages N] [--tiles]   (MXFP4 / NVFP4 at M = 1 on mma.sync,
                                                     14336x4096, split in 5; codes in rows unless --tiles)
     python -m bench.sass attention [--codes] [--warps N] [--stages N] [--quantize]   (Llama-3-8B's heads at
                                                     B16, 1k keys; --quantize: the output quantized per token)
     python -m bench.sass silu           (silu(gate) * up quantized per token over 14336 columns: the whole
                                                     kernel, one program a row)
"""

from __future__ import annotations

import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench import quant_prologue
from fxquant.kernels import decode_attention as DA
from fxquant.kernels import (
    gemm_fp4_mma,
    gemm_fp8,
    gemm_grouped,
    gemm_int4_fp8,
    gemm_int4_mma,
    silu_mul_quant,
)
from fxquant.kernels.codes import FORMATS, PACKED
from fxquant.kernels.gemm_configs import fp8_gemm_config
from fxquant.kernels.gemm_weight_only import _wo_gemm_kernel, wo_gemm_config
from fxquant.kernels.launch import next_power_of_2
from fxquant.numerics.formats import AMAX_FLOOR, E4M3

ARGS = ["a_ptr", "w_ptr", "s_ptr", "z_ptr", "gs_ptr", "c_ptr", "ws_ptr", "bias_ptr", "counter_ptr", "M", "N", "K",
        "stride_am", "stride_ak", "stride_wn", "stride_wk", "stride_sn", "stride_sk", "stride_cm", "stride_cn"]
UNIT_STRIDES = ("stride_ak", "stride_wk", "stride_sk", "stride_cn")
DIVISIBLE = ("N", "K", "stride_am", "stride_wn", "stride_sn", "stride_cm")
GROUPS = {"int8": 1, "int4": 128, "mxfp4": 32, "nvfp4": 16}
MMA_DIVISIBLE = ("N", "K", "stride_am", "stride_wn", "stride_ws")  # besides the pointers, for the mma.sync kernels


def decode_kernel_sass(fmt: str, stages: int | None = None, rows: int = 16,
                       pair_order: bool = False, code_rows: bool = False, prefetch: bool = False,
                       tile: dict | None = None) -> tuple[str, int]:
    """SASS and registers per thread of the configuration for `rows` activation rows (decode: up to 16), split-K
    on and summed by the last slice, with zero points for int4; pair_order: operands in codes.pair_order; int4 codes
    in tiles, as the backend holds them on the GPU, unless code_rows; prefetch: packed codes' first steps asked of
    the L2 before the wait; tile: BLOCK_M, BLOCK_N and num_warps replacing the configuration's."""
    cfg = {**wo_gemm_config(rows, 4096, fmt), **(tile or {})}
    types = ["*bf16", "*i8" if fmt == "int8" else "*i32", "*fp32" if fmt in ("int8", "int4") else "*u8", "*u8",
             "*fp32", "*bf16", "*fp32", "*bf16", "*i32"] + ["i32"] * 11
    signature = dict(zip(ARGS, types, strict=True))
    constexprs = dict(FMT=FORMATS[fmt], GROUP=GROUPS[fmt], HAS_ZP=fmt == "int4", HAS_BIAS=False, SPLIT_K=4,
                      LAST_SLICE_SUMS=True, DOT=tl.bfloat16, OUT=tl.bfloat16, CAST=0, EVEN_K=True,
                      BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
                      PDL=False, PAIR_ORDER=pair_order, TILED=fmt == "int4" and not code_rows,
                      PREFETCH=prefetch and fmt in PACKED,  # as weight_only_mm: packed 4-bit codes only
                      **dict.fromkeys(UNIT_STRIDES, 1))
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    attrs = {(ARGS.index(name),): [["tt.divisibility", 16]] for name in ARGS[:9] + list(DIVISIBLE)}
    return compiled_sass(_wo_gemm_kernel, signature, constexprs, attrs, cfg["num_warps"], stages or cfg["num_stages"])


def fp8_kernel_sass(stages: int | None = None, swap: bool = False, prefetch: bool = False,
                    weight_tma: bool = False) -> tuple[str, int]:
    """SASS and registers per thread of the fp8 GEMM with row scales at decode (M <= 8) on the 14336x4096 weight,
    in the tiles `gemm_configs` gives it, unsplit; swap: with the operands swapped (the weight's rows as the MMA's
    M); prefetch: its first weights asked of the L2 before the wait; weight_tma: the weight's tiles through a
    tensor descriptor (WEIGHT_TMA)."""
    cfg = fp8_gemm_config(8, 14336, 4096, block_scales=False)
    constexprs = dict(BLOCK_SCALES=False, SCALE_BLOCK=128, HAS_BIAS=False, OUT=tl.bfloat16, CAST=0, SPLIT_K=1,
                      LAST_SLICE_SUMS=False, COMPILER_PROMOTES=True, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                      BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], PDL=True, SWAP_AB=swap,
                      WEIGHT_TMA=weight_tma, PREFETCH=prefetch, stride_ak=1, stride_bk=1, stride_cn=1)
    desc = f"tensordesc<fp8e4nv[{cfg['BLOCK_N']}, {cfg['BLOCK_K']}]>" if weight_tma else "*fp8e4nv"
    pointers = dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", c_ptr="*bf16", ws_ptr="*fp32", a_scale_ptr="*fp32",
                    b_scale_ptr="*fp32", bias_ptr="*bf16", counter_ptr="*i32", b_desc=desc)
    divisible = [name for name in pointers if name != "b_desc" or not weight_tma]
    return compiled_by_name(gemm_fp8._fp8_gemm_kernel, constexprs, pointers,
                            [*divisible, "N", "K", "stride_am", "stride_bn", "stride_cm"], cfg["num_warps"],
                            stages or cfg["num_stages"])


def quant_prologue_kernel_sass(stages: int | None = None) -> tuple[str, int]:
    """SASS and registers per thread of the quantizer-prologue probe's GEMM at decode (`bench.quant_prologue`: the
    bf16 rows' amax read first, each K step quantized per token before its MMA), 16 x 64 tiles over 4 warps, 4096
    columns, unsplit."""
    constexprs = dict(FMAX=E4M3.max, AMAX_FLOOR=AMAX_FLOOR, QCAST=0, OUT=tl.bfloat16, CAST=0, ROW=4096,
                      CHUNK=quant_prologue.AMAX_CHUNK, SPLIT_K=1, LAST_SLICE_SUMS=False, BLOCK_M=16, BLOCK_N=64,
                      BLOCK_K=128, PDL=True, PREFETCH=True)
    pointers = dict(x_ptr="*bf16", b_ptr="*fp8e4nv", c_ptr="*bf16", ws_ptr="*fp32", b_scale_ptr="*fp32",
                    counter_ptr="*i32")
    return compiled_by_name(quant_prologue._quant_prologue_gemm_kernel, constexprs, pointers,
                            [*pointers, "N", "K", "stride_xm", "stride_bn", "stride_cm"], 4, stages or 4)


def w4a8_kernel_sass(stages: int | None = None) -> tuple[str, int]:
    """SASS and registers per thread of the W4A8 GEMM (int4 codes with zero points, e4m3 activations) at decode (M <=
    16) on a 4096-row weight, in the tiles `int4_fp8_config` gives it, split in 8 and summed by the last slice."""
    cfg = gemm_int4_fp8.int4_fp8_config(16, 4096)
    constexprs = dict(HAS_ZP=True, HAS_BIAS=False, OUT=tl.bfloat16, CAST=0, SPLIT_K=8, LAST_SLICE_SUMS=True,
                      GROUP=gemm_int4_fp8.GROUP, DOT=tl.float16, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                      GROUP_M=cfg["GROUP_M"], PDL=True, PAIR_ORDER=cfg["PAIR_ORDER"])
    pointers = dict(a_ptr="*i32", a_scale_ptr="*fp32", w_ptr="*i32", w_scale_ptr="*fp32", w_zero_ptr="*u8",
                    bias_ptr="*bf16", out_ptr="*bf16", ws_ptr="*fp32", counter_ptr="*i32")
    return compiled_by_name(gemm_int4_fp8._int4_fp8_kernel, constexprs, pointers,
                            [*pointers, "N", "K", "stride_am", "stride_wn", "stride_sn", "stride_om"], cfg["num_warps"],
                            stages or cfg["num_stages"])


def int4_mma_kernel_sass(stages: int | None = None, code_rows: bool = False, prefetch: bool = False,
                         offset_after: bool = False, e4m3: bool = False) -> tuple[str, int]:
    """SASS and registers per thread of the int4 mma.sync kernel at M = 1 (bf16, zero points) on 14336x4096, split
    in 5 (`int4_mma_split`) and summed by the last slice, with dependent launch; its codes in tiles, as the backend
    holds them on the GPU, unless code_rows; prefetch: its first codes asked of the L2 before the wait;
    offset_after: zero points applied after the MMAs (`gemm_int4_mma.step_asm`); e4m3: W4A8, e4m3 activations on
    the fp16 MMA and symmetric codes, as int4_fp8's."""
    stages = stages or 3  # int4_mma_mm's default
    constexprs = dict(GROUP=gemm_int4_mma.STEP_K, HAS_ZP=not e4m3, BF16=not e4m3, SPLIT_K=5, LAST_SLICE_SUMS=True,
                      HAS_BIAS=False, OUT=tl.bfloat16, CAST=0, STAGES=stages, PDL=True, TILED=not code_rows,
                      PREFETCH=prefetch and not code_rows,
                      STEP=gemm_int4_mma.step_asm(torch.float16 if e4m3 else torch.bfloat16, offset_after),
                      OFFSET_AFTER=offset_after, A_E4M3=e4m3)
    pointers = dict(a_ptr="*i32", w_ptr="*i32", s_ptr="*fp32", z_ptr="*i32", ws_ptr="*fp32", c_ptr="*bf16",
                    bias_ptr="*bf16", counter_ptr="*i32", a_scale_ptr="*fp32")
    return compiled_by_name(gemm_int4_mma._int4_mma_kernel, constexprs, pointers, [*pointers, *MMA_DIVISIBLE], 1,
                            stages)


def fp4_mma_kernel_sass(fmt: str, stages: int | None = None, tiled: bool = False) -> tuple[str, int]:
    """SASS and registers per thread of the MXFP4 / NVFP4 mma.sync kernel at M = 1 on 14336x4096, split in 5 and
    summed by the last slice, with dependent launch; codes in rows as `quantize` packs them, or in tiles."""
    stages = stages or 3  # fp4_mma_mm's default
    constexprs = dict(FMT=FORMATS[fmt], SPLIT_K=5, LAST_SLICE_SUMS=True, HAS_BIAS=False, OUT=tl.bfloat16, CAST=0,
                      STAGES=stages, PDL=True, TILED=tiled)
    pointers = dict(a_ptr="*i32", w_ptr="*i32", s_ptr="*i32", gs_ptr="*fp32", ws_ptr="*fp32", c_ptr="*bf16",
                    bias_ptr="*bf16", counter_ptr="*i32")
    return compiled_by_name(gemm_fp4_mma._fp4_mma_kernel, constexprs, pointers, [*pointers, *MMA_DIVISIBLE], 1,
                            stages)


def attention_kernel_sass(codes: bool, warps: int | None = None, stages: int | None = None,
                          quantize: bool = False) -> tuple[str, int]:
    """SASS and registers per thread of the split-KV attention kernel as it runs for Llama-3-8B's heads at B16 over
    1024 keys (128 pairs, three splits over bf16 and two over codes, merged by the last), with transformers' per-key
    mask: over bf16 or over e4m3 codes with per-token scales; quantize: its output quantized per token as it
    merges (fuse_attention_quant)."""
    plan = dict(DA.CODES_PLANS)[128] if codes else DA.SHORT_PLAN
    constexprs = dict(HKV=8, D=128, BLOCK_M=16, BLOCK_N=plan[3], SPLITS=2 if codes else 3, KV_CODES=codes,
                      SCALE_PER_TOKEN=codes, MASK=2, MASK_PER_KEY=True, HAS_LENS=False, SOFTCAP=False,
                      DOT=tl.float16 if codes else tl.bfloat16, PRECISION="tf32", LAST_SPLIT_MERGES=True, ROWS=4,
                      HAS_SINKS=False, OUT=tl.bfloat16, CAST=0, PDL=True, QUANT=DA.PER_TOKEN if quantize else 0,
                      QGROUP=1, FMAX=DA.E4M3_MAX if quantize else 0.0, FP8=tl.float8e4nv,
                      AMAX_FLOOR=DA.AMAX_FLOOR if quantize else 0.0, BLOCK_W=4096 if quantize else 1,
                      SCAN=DA.MASK_SCAN)
    cache = "*fp8e4nv" if codes else "*bf16"
    pointers = dict(q_ptr="*bf16", k_ptr=cache, v_ptr=cache, k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                    mask_ptr="*i1", lens_ptr="*i32", o_part_ptr="*fp32", lse_part_ptr="*fp32", sinks_ptr="*bf16",
                    out_ptr="*bf16", counter_ptr="*i32", codes_ptr="*fp8e4nv", qscale_ptr="*fp32")
    # pointers and the batch, head and token strides of q, k, v, the scales and out: multiples of 16 elements
    divisible = [*pointers, "sqb", "sqh", "sqq", "skb", "skh", "sks", "svb", "svh", "svs", "ssb", "ssh", "sob",
                 "soh", "soq"]
    return compiled_by_name(DA._decode_attention_split_kernel, constexprs, pointers, divisible, warps or plan[2],
                            stages or (*plan[4:], 2)[0], floats=("scale", "softcap"))


def grouped_kernel_sass(channel_groups: bool, overrides: dict | None = None) -> tuple[str, int]:
    """SASS and registers per thread of the grouped fp8 GEMM on pointers as MoE prefill runs it: Mixtral's gate/up
    (28672x4096, 8 experts) over 8192 rows, row scales or W4A8's channel groups (the codes made e4m3), at the plan's
    tiles (the pointer kernel's, as where tensor descriptors cannot read the operands) unless overridden."""
    _, split, _, planned = gemm_grouped._fp8_plan(8192, 28672, 4096, 8, channel_groups, channel_groups,
                                                  tuple(sorted({"TMA": False, **(overrides or {})}.items())))
    meta = dict(planned)  # the plan's own dict is cached
    warps, stages = meta.pop("num_warps"), meta.pop("num_stages")
    # channel groups are block scales ([E, N, K/128]) with the token's scale per row
    constexprs = dict(BLOCK_SCALES=channel_groups, CHANNEL_GROUPS=channel_groups, SCALE_BLOCK=128, OUT=tl.bfloat16,
                      CAST=0, SPLIT_K=split, **meta, stride_ak=1, stride_bk=1, stride_cn=1,
                      stride_bsk=1 if channel_groups else 0)
    pointers = dict(a_ptr="*fp8e4nv", offs_ptr="*i32", b_ptr="*fp8e4nv", c_ptr="*bf16", ws_ptr="*fp32",
                    a_scale_ptr="*fp32", b_scale_ptr="*fp32")
    divisible = [*pointers, "N", "K", "stride_am", "stride_be", "stride_bn", "stride_cm", "stride_bse", "stride_bsn"]
    return compiled_by_name(gemm_grouped._grouped_fp8_kernel, constexprs, pointers, divisible, warps, stages)


def silu_kernel_sass() -> tuple[str, int]:
    """SASS and registers per thread of the gated-MLP quantizer at decode (bf16, e4m3 per token, 14336 columns):
    one program a token's row."""
    width = 14336
    constexprs = dict(OUT=tl.bfloat16, FMAX=E4M3.max, FP8=tl.float8e4nv, CAST=0, AMAX_FLOOR=AMAX_FLOOR, PDL=True,
                      BLOCK_ROWS=1, BLOCK_COLS=next_power_of_2(width))  # quant_fp8.rows_plan for one row
    pointers = dict(gate_ptr="*bf16", up_ptr="*bf16", y_ptr="*fp8e4nv", scale_ptr="*fp32")
    kernel = silu_mul_quant._silu_mul_quant_fp8_kernel
    divisible = [*pointers, "row_len", "width", "stride_gate", "stride_up"]
    return compiled_by_name(kernel, constexprs, pointers, divisible, 8, 1)


def opcodes(sass: str) -> collections.Counter:
    """Every instruction of a kernel by opcode: for kernels without a main loop."""
    return collections.Counter(map(_opcode, _instructions(sass)))


def _instructions(sass: str) -> list[str]:
    return [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]


def _opcode(line: str) -> str:
    return re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", line).split()[0]


def compiled_by_name(kernel, constexprs: dict, pointers: dict, divisible: list, warps: int, stages: int,
                     floats: tuple = ()) -> tuple[str, int]:
    """`compiled_sass` of a kernel whose arguments are named: `constexprs` by value, `pointers` by type, `floats`
    fp32, every other int32; the arguments named in `divisible` multiples of 16."""
    params = list(inspect.signature(kernel.fn).parameters)
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "fp32" if name in floats else "i32")
                 for name in params}
    attrs = {(params.index(name),): [["tt.divisibility", 16]] for name in divisible}
    return compiled_sass(kernel, signature, constexprs, attrs, warps, stages)


def compiled_sass(kernel, signature: dict, constexprs: dict, attrs: dict, warps: int, stages: int) -> tuple[str, int]:
    """The kernel compiled for sm_90: its SASS, and its registers per thread."""
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        dump = lambda flag: subprocess.run([cuobjdump, flag, cubin.name], capture_output=True, text=True,
                                           check=True).stdout
        return dump("-sass"), int(re.search(r"REG:(\d+)", dump("-res-usage")).group(1))


def _address(line: str) -> int:
    return int(re.match(r"\s+/\*([0-9a-f]+)\*/", line).group(1), 16)


def _main_loop(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body that runs an MMA and never exits: the K loop (an
    epilogue's loop, such as the quantizer's over a token's row, has no MMA; the jump back from a barrier's wait
    placed after the kernel's end, as tensor-descriptor loads have, spans its exits)."""
    lines = _instructions(sass)
    body = lambda loop: [line for line in lines if loop[0] <= _address(line) <= loop[1]]
    loops = [(int(m.group(1), 16), _address(line)) for line in lines
             if (m := re.search(r"BRA\s+0x([0-9a-f]+)", line)) and int(m.group(1), 16) < _address(line)]
    with_mma = [loop for loop in loops if any("MMA" in _opcode(line) for line in body(loop))
                and not any(_opcode(line) == "EXIT" for line in body(loop))]
    return body(max(with_mma or loops, key=lambda loop: loop[1] - loop[0]))


def longest_loop(sass: str, shortest: bool = False) -> collections.Counter:
    """Opcodes of the main loop (`_main_loop`). A body with branches inside counts its longest path through them,
    or with `shortest` its shortest (a kernel that takes a slower path only on rare data)."""
    return collections.Counter(_path(_main_loop(sass), _address, _opcode, shortest))


def longest_mma_chain(sass: str) -> int:
    """The most MMAs in a row, in the main loop's order, that write one register: each of them waits for the one
    before it, with nothing of the warp's own between to cover its latency."""
    targets = [m.group(1) for line in _main_loop(sass) if (m := re.search(r"MMA\S*\s+(R\d+)", line))]
    longest = run = 0
    for i, target in enumerate(targets):
        run = run + 1 if i and target == targets[i - 1] else 1
        longest = max(longest, run)
    return longest


def _path(body: list[str], address, opcode, shortest: bool) -> list[str]:
    """The opcodes on the longest (or shortest) path from a loop's first instruction to its last, through the
    forward branches inside it: each instruction falls through to the next unless it is an unpredicated branch,
    and a branch also goes to its target."""
    at = {address(line): i for i, line in enumerate(body)}
    better = min if shortest else max
    paths: list[list[str] | None] = [None] * len(body)
    paths[0] = []
    for i, line in enumerate(body):
        if paths[i] is None:
            continue
        here = paths[i] + [opcode(line)]
        if i == len(body) - 1:
            return here
        target = re.search(r"BRA\s+0x([0-9a-f]+)", line)
        successors = [] if target and not re.search(r"@!?U?P\w+", line) else [i + 1]
        if target and int(target.group(1), 16) in at and at[int(target.group(1), 16)] > i:
            successors.append(at[int(target.group(1), 16)])
        for j in successors:
            paths[j] = here if paths[j] is None else better(paths[j], here, key=len)
    raise ValueError("bench.sass: no path reaches the loop's back branch")


def tile_option() -> dict:
    """--tile BMxBNxWARPS as the BLOCK_M, BLOCK_N and num_warps it names (none where not given)."""
    if "--tile" not in sys.argv:
        return {}
    block_m, block_n, warps = map(int, sys.argv[sys.argv.index("--tile") + 1].split("x"))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)


def main():
    stages = int(sys.argv[sys.argv.index("--stages") + 1]) if "--stages" in sys.argv else None
    code_rows = "--code-rows" in sys.argv
    if "silu" in sys.argv:
        sass, registers = silu_kernel_sass()
        ops = opcodes(sass)
        print(f"silu(gate) * up quantized per token, 14336 columns, one program a row: {sum(ops.values())} "
              f"instructions in the kernel, {registers} registers per thread (triton {triton.__version__}, sm_90)")
        for name, count in ops.most_common(12):
            print(f"  {count:5d}  {name}")
        return
    if "attention" in sys.argv:
        codes = "--codes" in sys.argv
        warps = int(sys.argv[sys.argv.index("--warps") + 1]) if "--warps" in sys.argv else None
        quantize = "--quantize" in sys.argv
        sass, registers = attention_kernel_sass(codes, warps, stages, quantize)
        what = f"attention over {'e4m3 codes' if codes else 'bf16'}{', output quantized' if quantize else ''}"
        step = "key block"
    elif "fp4mma" in sys.argv:
        fmt = "nvfp4" if "nvfp4" in sys.argv else "mxfp4"
        tiled = "--tiles" in sys.argv
        sass, registers = fp4_mma_kernel_sass(fmt, stages, tiled)
        what = (f"{fmt} on mma.sync, M = 1 (64 rows x 128 codes a warp), codes in {'tiles' if tiled else 'rows'}; "
                "its usual path (MXFP4's scales up to 2: one multiply)")
        step = "K step"
    elif "mma" in sys.argv:
        prefetch, offset_after, e4m3 = "--prefetch" in sys.argv, "--offset-after" in sys.argv, "--e4m3" in sys.argv
        sass, registers = int4_mma_kernel_sass(stages, code_rows, prefetch, offset_after, e4m3)
        what = (f"int4 on mma.sync, M = 1 (64 rows x 128 codes a warp), codes in {'rows' if code_rows else 'tiles'}"
                f"{', first codes prefetched' if prefetch else ''}"
                f"{', zero points after the MMAs' if offset_after else ''}"
                f"{', e4m3 activations (W4A8), symmetric codes' if e4m3 else ''}")
        step = "K step"
    elif "grouped" in sys.argv:
        channel_groups = "--channel-groups" in sys.argv
        tiles = {"num_stages": stages} if stages else {}
        if "--row-tiles" in sys.argv:  # the row scales' pointer tiles, to compare at one tile
            tiles = {**gemm_grouped._fp8_plan(8192, 28672, 4096, 8, False, False, (("TMA", False),))[3], **tiles}
        sass, registers = grouped_kernel_sass(channel_groups, {**tiles, **tile_option()})
        what = f"grouped fp8 GEMM over {'channel groups (W4A8)' if channel_groups else 'row scales'}, MoE prefill"
        step = "K step"
    elif "w4a8" in sys.argv:
        sass, registers = w4a8_kernel_sass(stages)
        what, step = "W4A8 (int4 codes, e4m3 activations)", "K step"
    elif "prologue" in sys.argv:
        sass, registers = quant_prologue_kernel_sass(stages)
        what, step = "the quantizer-prologue probe's GEMM, each K step of the rows quantized per token", "K step"
    elif "fp8" in sys.argv:
        swap, prefetch, weight_tma = "--swap" in sys.argv, "--prefetch" in sys.argv, "--weight-tma" in sys.argv
        sass, registers = fp8_kernel_sass(stages, swap, prefetch, weight_tma)
        what = (f"fp8 GEMM, row scales{', operands swapped' if swap else ''}"
                f"{', first weights prefetched' if prefetch else ''}"
                f"{', weight through a tensor descriptor' if weight_tma else ''}")
        step = "K step"
    else:
        fmt = next((a for a in sys.argv[1:] if a in FORMATS), "int4")
        rows = int(sys.argv[sys.argv.index("--rows") + 1]) if "--rows" in sys.argv else 16
        pairs = "--pair-order" in sys.argv
        sass, registers = decode_kernel_sass(fmt, stages, rows, pairs, code_rows, "--prefetch" in sys.argv,
                                             tile_option())
        tiles = ", codes in tiles" if fmt == "int4" and not code_rows else ""
        what, step = f"{fmt}, {rows} rows{', pair order' if pairs else ''}{tiles}", "K step"
    ops = longest_loop(sass, shortest="fp4mma" in sys.argv)
    print(f"{what}: {sum(ops.values())} instructions per {step} per thread, {registers} registers per thread, "
          f"at most {longest_mma_chain(sass)} MMAs in a row into one register (triton {triton.__version__}, sm_90)")
    for name, count in ops.most_common(12):
        print(f"  {count:5d}  {name}")


if __name__ == "__main__":
    main()
