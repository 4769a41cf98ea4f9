"""bench.sass compiles each kernel it reads for sm_90 with the arguments the kernel takes today, and finds its main
loop: a kernel whose signature changed would otherwise break it silently until its next use. It compiles for real,
so it runs in a process without Triton's interpreter."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COUNT = """
import json
from bench import sass
found = {}
for what, (code, registers) in {"int4": sass.decode_kernel_sass("int4"),
                                 "mxfp4": sass.decode_kernel_sass("mxfp4"),
                                 "nvfp4 on 32 rows": sass.decode_kernel_sass("nvfp4", rows=32),
                                 "w4a8": sass.w4a8_kernel_sass(),
                                 "int4 mma": sass.int4_mma_kernel_sass(),
                                 "int4 mma offset after": sass.int4_mma_kernel_sass(offset_after=True),
                                 "int4 mma e4m3": sass.int4_mma_kernel_sass(e4m3=True),
                                 "mxfp4 mma": sass.fp4_mma_kernel_sass("mxfp4"),
                                 "nvfp4 mma": sass.fp4_mma_kernel_sass("nvfp4", tiled=True),
                                 "fp8": sass.fp8_kernel_sass(),
                                 "fp8 swapped": sass.fp8_kernel_sass(swap=True),
                                 "fp8 weight tma": sass.fp8_kernel_sass(prefetch=True, weight_tma=True),
                                 "attention": sass.attention_kernel_sass(codes=False),
                                 "attention codes": sass.attention_kernel_sass(codes=True),
                                 "attention quantized": sass.attention_kernel_sass(codes=False, quantize=True),
                                 "grouped channel groups": sass.grouped_kernel_sass(channel_groups=True)}.items():
    found[what] = dict(registers=registers, ops=sass.longest_loop(code), usual=sass.longest_loop(code, shortest=True))
found["quant prologue"] = dict(ops=sass.longest_loop(sass.quant_prologue_kernel_sass()[0]))
code, registers = sass.silu_kernel_sass()
found["silu"] = dict(registers=registers, ops=sass.opcodes(code))
found["int4 mma chain"] = sass.longest_mma_chain(sass.int4_mma_kernel_sass()[0])
print(json.dumps(found))
"""


def test_the_main_loop_of_each_kernel_is_found_and_counted():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COUNT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.splitlines()[-1])
    for what, tensor_core in [("int4", "HMMA.16816.F32.BF16"), ("mxfp4", "HMMA.16816.F32.BF16"),
                              ("nvfp4 on 32 rows", "HMMA.16816.F32.BF16"), ("w4a8", "HMMA.16816.F32"),
                              ("int4 mma", "HMMA.16816.F32.BF16"), ("int4 mma offset after", "HMMA.16816.F32.BF16"),
                              ("int4 mma e4m3", "HMMA.16816.F32"), ("mxfp4 mma", "HMMA.16816.F32.BF16"),
                              ("nvfp4 mma", "HMMA.16816.F32.BF16"),
                              ("fp8", "HMMA.16816.F32"),
                              ("fp8 swapped", "QGMMA.64x16x32.F32.E4M3.E4M3"),  # wgmma on the codes as stored
                              ("fp8 weight tma", "HMMA.16816.F32"),
                              ("attention", "HMMA.16816.F32.BF16"),
                              ("attention codes", "HMMA.16816.F32"),
                              ("attention quantized", "HMMA.16816.F32.BF16"),  # the key loop, not the quantizer's
                              ("grouped channel groups", "QGMMA.64x128x32.F32.E4M3.E4M3")]:  # wgmma at prefill
        ops = found[what]["ops"]
        assert 0 < found[what]["registers"] <= 255, (what, found[what]["registers"])
        # the loop holds the products, not a prologue's backward jump
        assert ops.get(tensor_core, 0) > 0 and sum(ops.values()) > 100, (what, ops)
    # the gated-MLP quantizer: one program a row computes the sigmoids (one MUFU.EX2 a value) of 16384 columns, the
    # row of 14336 padded, over 8 warps of 32 threads: 64 a thread
    assert found["silu"]["ops"]["MUFU.EX2"] == 64
    # the quantizer-prologue probe makes its operand's codes in the K loop, each once a program: a 16 x 128 step over
    # 128 threads is 16 values a thread, 8 saturating e4m3 packs of two (32 where each of the 4 warps made the whole
    # step); the fp8 GEMM's loop reads codes and packs none
    pack = "F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C"
    assert found["quant prologue"]["ops"][pack] == 8
    assert pack not in found["fp8"]["ops"]
    # the weight through a tensor descriptor: one bulk copy a K step in the loop, not the barrier's wait placed past
    # the kernel's exits that jumps back into it
    assert found["fp8 weight tma"]["ops"]["UTMALDG.2D"] == 1
    assert "EXIT" not in found["fp8 weight tma"]["ops"]
    # MXFP4 on mma.sync: a warp whose scales pass 2 takes the step's other path, two multiplies a decoded pair
    # against one; both paths run the step's 32 MMAs
    longest, usual = found["mxfp4 mma"]["ops"], found["mxfp4 mma"]["usual"]
    assert longest["HMUL2.BF16_V2"] == 2 * usual["HMUL2.BF16_V2"] == 256
    assert longest["HMMA.16816.F32.BF16"] == usual["HMMA.16816.F32.BF16"] == 32
    # W4A8's channel groups at MoE prefill: each 128-wide K step's partial (128 x 128 over 8 warps) scaled into the
    # accumulator, one FFMA an element of a thread's 64; the step's group scales read one a thread
    # (`gemm_fp8.channel_scales`), not reloaded as 32 scalar loads a thread in the accumulator's layout
    assert found["grouped channel groups"]["ops"]["FFMA"] == 64
    assert found["grouped channel groups"]["ops"].get("LDG.E", 0) <= 1
    # int4 with its zero points applied after the MMAs: no packed FMA a pair of codes (128 a step a thread), 8 more
    # MMAs (the activation sums) and 16 more FFMAs (their offsets) than the zero points applied before
    before, after = found["int4 mma"]["ops"], found["int4 mma offset after"]["ops"]
    assert before["HADD2.BF16_V2"] == 128 and "HADD2.BF16_V2" not in after
    assert after["HMMA.16816.F32.BF16"] - before["HMMA.16816.F32.BF16"] == 8
    assert after["FFMA"] - before["FFMA"] == 16
    # W4A8 on the int4 kernel: a lane's 32 e4m3 activations of a step become 16 fp16 pairs, one byte permute and one
    # conversion each, and the step's 32 MMAs are fp16's; its fp16 decode takes each of a step's 32 code words with
    # one shift, where bf16's takes three. Triton 3.6's build of the loop holds one byte permute more (17), 3.8's none
    e4m3 = found["int4 mma e4m3"]["ops"]
    assert e4m3["F2FP.F16.E4M3.UNPACK_B"] == 16 and 16 <= e4m3["PRMT"] <= 17 and e4m3["HMMA.16816.F32"] == 32
    assert e4m3["SHF.R.U32.HI"] == 32 and found["int4 mma"]["ops"]["SHF.R.U32.HI"] >= 96
    # the int4 kernel's step written as four interleaved chains compiles to overlapped chains, not a run of one
    # block's 8 dependent MMAs
    assert found["int4 mma chain"] <= 4


def test_a_tile_named_on_the_command_line_replaces_the_plans(monkeypatch):
    from bench import sass

    monkeypatch.setattr(sys, "argv", ["sass", "grouped", "--tile", "128x64x8", "--stages", "3"])
    assert sass.tile_option() == dict(BLOCK_M=128, BLOCK_N=64, num_warps=8)
    monkeypatch.setattr(sys, "argv", ["sass", "grouped"])
    assert sass.tile_option() == {}
