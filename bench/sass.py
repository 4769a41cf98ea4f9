"""The K loop of the weight-only GEMM in SASS, without a GPU: the kernel is compiled ahead of time for sm_90 with
the specializations a real launch gets (unit strides, 16-divisible sizes and pointers), disassembled with the
`cuobjdump` that Triton ships, and the longest loop's instructions are counted by opcode. The registers per thread
(which cap the programs an SM holds) come from the same cubin.

Run: python -m bench.sass [int8|int4|mxfp4|nvfp4] [--stages N]
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fxquant.kernels.codes import FORMATS
from fxquant.kernels.gemm_weight_only import _wo_gemm_kernel, wo_gemm_config

ARGS = ["a_ptr", "w_ptr", "s_ptr", "z_ptr", "gs_ptr", "c_ptr", "ws_ptr", "bias_ptr", "M", "N", "K",
        "stride_am", "stride_ak", "stride_wn", "stride_wk", "stride_sn", "stride_sk", "stride_cm", "stride_cn"]
UNIT_STRIDES = ("stride_ak", "stride_wk", "stride_sk", "stride_cn")
DIVISIBLE = ("N", "K", "stride_am", "stride_wn", "stride_sn", "stride_cm")
GROUPS = {"int8": 1, "int4": 128, "mxfp4": 32, "nvfp4": 16}


def decode_kernel_sass(fmt: str, stages: int | None = None) -> tuple[str, int]:
    """SASS and registers per thread of the decode (M <= 16) configuration, split-K on, with zero points for
    int4."""
    cfg = wo_gemm_config(16, 4096, fmt)
    types = ["*bf16", "*i8" if fmt == "int8" else "*i32", "*fp32" if fmt in ("int8", "int4") else "*u8", "*u8",
             "*fp32", "*bf16", "*fp32", "*bf16"] + ["i32"] * 11
    signature = dict(zip(ARGS, types, strict=True))
    constexprs = dict(FMT=FORMATS[fmt], GROUP=GROUPS[fmt], HAS_ZP=fmt == "int4", HAS_BIAS=False, SPLIT_K=4,
                      DOT=tl.bfloat16, OUT=tl.bfloat16, CAST=0, EVEN_K=True, BLOCK_M=cfg["BLOCK_M"],
                      BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], PDL=False,
                      **dict.fromkeys(UNIT_STRIDES, 1))
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    attrs = {(ARGS.index(name),): [["tt.divisibility", 16]] for name in ARGS[:8] + list(DIVISIBLE)}
    kernel = triton.compile(ASTSource(fn=_wo_gemm_kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=cfg["num_warps"], num_stages=stages or cfg["num_stages"]))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        dump = lambda flag: subprocess.run([cuobjdump, flag, cubin.name], capture_output=True, text=True,
                                           check=True).stdout
        return dump("-sass"), int(re.search(r"REG:(\d+)", dump("-res-usage")).group(1))


def longest_loop(sass: str) -> collections.Counter:
    """Opcodes of the longest backward branch's body: the K loop."""
    lines = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    address = lambda line: int(re.match(r"\s+/\*([0-9a-f]+)\*/", line).group(1), 16)
    loops = [(int(m.group(1), 16), address(line)) for line in lines
             if (m := re.search(r"BRA\s+0x([0-9a-f]+)", line)) and int(m.group(1), 16) < address(line)]
    first, last = max(loops, key=lambda loop: loop[1] - loop[0])
    opcode = lambda line: re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", line).split()[0]
    return collections.Counter(opcode(line) for line in lines if first <= address(line) <= last)


def main():
    fmt = next((a for a in sys.argv[1:] if a in FORMATS), "int4")
    stages = int(sys.argv[sys.argv.index("--stages") + 1]) if "--stages" in sys.argv else None
    sass, registers = decode_kernel_sass(fmt, stages)
    ops = longest_loop(sass)
    print(f"{fmt}: {sum(ops.values())} instructions per K step per thread, {registers} registers per thread "
          f"(triton {triton.__version__}, sm_90)")
    for name, count in ops.most_common(12):
        print(f"  {count:5d}  {name}")


if __name__ == "__main__":
    main()
