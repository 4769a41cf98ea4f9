"""The part of PTX that fxquant's inline decode blocks use, run on the CPU over numpy words, so that the blocks are
checked bit for bit where no GPU is: 32-bit shifts, ands and lop3, byte permutes, packed bf16/fp16 multiplies and fmas,
e4m3 pairs converted to fp16 pairs, and movs that pack or unpack 16-bit halves. An instruction outside that part
raises, as does a packed product that its 16-bit type cannot hold exactly (the decode blocks claim exact arithmetic;
overflow to infinity excepted), so the emulator never has to pick a rounding the hardware might not make. fp32 FMAs
run through fp64, as the MMA below does, so a test of them states a bound.

`mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}` runs too, over operands of one warp (32 lanes, lane i at index
i), by the fragment layout PTX documents: lane (g, t) = (lane / 4, lane % 4) holds A rows g and g + 8 at columns
2t, 2t + 1 (registers 0 and 1) and 2t + 8, 2t + 9 (2 and 3), B rows 2t, 2t + 1 and 2t + 8, 2t + 9 of column g, and
D rows g, g + 8 at columns 2t, 2t + 1. Its products and sum are computed in fp64 and rounded once to fp32: the
hardware's order of summation is its own, so a test of it states a bound, not bits."""

from __future__ import annotations

import re

import numpy as np
import torch

U32 = np.uint32
HALF_TYPES = {"bf16x2": torch.bfloat16, "f16x2": torch.float16}


def _halves(word: np.ndarray, dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The low and high 16-bit halves of 32-bit words as float64 values of `dtype`."""
    def value(bits):
        return torch.from_numpy(bits.astype(np.int16)).view(dtype).double().numpy()
    return value(word & 0xFFFF), value(word >> 16)


def _packed(low: np.ndarray, high: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """float64 values rounded to `dtype` (exactly, or overflowing to infinity) and packed into 32-bit words."""
    def bits(values):
        rounded = torch.from_numpy(values).to(dtype)
        back = rounded.double().numpy()
        inexact = (back != values) & np.isfinite(back) & ~np.isnan(values)
        if inexact.any():
            raise ArithmeticError(f"a packed {dtype} result is not exact: {values[inexact][:4]}")
        return rounded.view(torch.int16).numpy().astype(np.uint16).astype(U32)
    return bits(low) | (bits(high) << U32(16))


def _e4m3_as_f16(code: np.ndarray) -> np.ndarray:
    """e4m3 codes (bytes in 32-bit words) as fp16 bits; NaN as the canonical 0x7FFF."""
    values = torch.from_numpy(code.astype(np.uint8)).view(torch.float8_e4m3fn).half()
    bits = values.view(torch.int16).numpy().astype(np.uint16).astype(U32)
    return np.where(torch.isnan(values).numpy(), U32(0x7FFF), bits)


def _lop3(a, b, c, lut: int) -> np.ndarray:
    """lop3.b32: bit i of the result is lut's bit (a_i << 2 | b_i << 1 | c_i)."""
    out = np.zeros_like(a)
    for index in range(8):
        if lut >> index & 1:
            pick = [(x if index >> shift & 1 else ~x) for x, shift in ((a, 2), (b, 1), (c, 0))]
            out |= pick[0] & pick[1] & pick[2]
    return out


def run(asm: str, operands: list, outputs: int) -> list[np.ndarray]:
    """Run `asm` with $outputs.. bound to `operands` (32-bit words: numpy arrays or ints, broadcast together); returns
    $0..$(outputs - 1), each as it was last written (a 16-bit output in the low half of its word)."""
    shape = np.broadcast_shapes((1,), *(np.shape(o) for o in operands))
    regs = {f"${outputs + i}": np.broadcast_to(np.asarray(o, dtype=np.int64) & 0xFFFFFFFF, shape).astype(U32)
            for i, o in enumerate(operands)}

    def read(token: str) -> np.ndarray:
        token = token.strip()
        if token in regs:
            return regs[token]
        if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", token):
            return np.full(shape, int(token, 0) & 0xFFFFFFFF, dtype=U32)
        raise KeyError(f"ptx_emulator: {token!r} is neither a register written before nor an immediate")

    for line in asm.splitlines():
        line = line.strip().rstrip(";").strip()
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        opcode, _, rest = line.partition(" ")
        if opcode == "mov.b32" and rest.startswith("{"):  # {lo, hi}, word: unpack
            lo, hi, word = re.fullmatch(r"\{\s*(\S+),\s*(\S+)\s*\},\s*(\S+)", rest).groups()
            regs[lo], regs[hi] = read(word) & U32(0xFFFF), read(word) >> U32(16)
            continue
        if opcode == "mov.b32" and "{" in rest:  # word, {lo, hi}: pack
            word, lo, hi = re.fullmatch(r"(\S+),\s*\{\s*(\S+),\s*(\S+)\s*\}", rest).groups()
            regs[word] = (read(lo) & U32(0xFFFF)) | (read(hi) << U32(16))
            continue
        if opcode.startswith("mma.sync.aligned.m16n8k16.row.col.f32."):
            _mma(regs, opcode, rest, read)
            continue
        dest, *args = [token.strip() for token in rest.split(",")]
        if opcode == "mov.b32":
            regs[dest] = read(args[0])
        elif opcode == "shl.b32":
            regs[dest] = read(args[0]) << U32(int(args[1], 0))
        elif opcode == "shr.u32":
            regs[dest] = read(args[0]) >> U32(int(args[1], 0))
        elif opcode == "and.b32":
            regs[dest] = read(args[0]) & read(args[1])
        elif opcode == "cvt.rn.f16x2.e4m3x2":  # e4m3 is a subset of fp16: exact, the high byte to the high half
            pair = read(args[0])
            regs[dest] = _e4m3_as_f16(pair & U32(0xFF)) | (_e4m3_as_f16(pair >> U32(8) & U32(0xFF)) << U32(16))
        elif opcode == "prmt.b32":  # default mode: byte i of dest is byte (selector nibble i) of {args[1], args[0]}
            selector = int(args[2], 0)
            if selector & 0x8888:
                raise NotImplementedError(f"ptx_emulator: prmt's sign-replicating selectors ({line!r})")
            source = read(args[0]).astype(np.uint64) | (read(args[1]).astype(np.uint64) << np.uint64(32))
            regs[dest] = np.zeros_like(read(args[0]))
            for i in range(4):
                byte = (source >> np.uint64(8 * (selector >> 4 * i & 7))) & np.uint64(0xFF)
                regs[dest] |= byte.astype(U32) << U32(8 * i)
        elif opcode == "lop3.b32":
            regs[dest] = _lop3(read(args[0]), read(args[1]), read(args[2]), int(args[3], 0))
        elif opcode == "fma.rn.f32":  # the product exact in fp64, the sum rounded there and then to fp32, as _mma's
            x, y, z = (read(arg).view(np.float32).astype(np.float64) for arg in args)
            regs[dest] = (x * y + z).astype(np.float32).view(U32)
        elif (m := re.fullmatch(r"(mul|fma)\.rn\.(bf16x2|f16x2)", opcode)):
            dtype = HALF_TYPES[m.group(2)]
            halves = [_halves(read(arg), dtype) for arg in args]
            combine = (lambda x, y: x * y) if m.group(1) == "mul" else (lambda x, y, z: x * y + z)
            regs[dest] = _packed(combine(*(h[0] for h in halves)), combine(*(h[1] for h in halves)), dtype)
        else:
            raise NotImplementedError(f"ptx_emulator: {opcode} is not emulated ({line!r})")
    return [regs[f"${i}"] for i in range(outputs)]


def _mma(regs: dict, opcode: str, rest: str, read) -> None:
    """mma.sync m16n8k16, row.col, fp32 accumulators, 16-bit A and B: D = A @ B + C over one warp's fragments."""
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[opcode.split(".")[-3]]
    d, a, b, c = [[token.strip() for token in group.split(",")] for group in re.findall(r"\{([^}]*)\}", rest)]
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    if read(a[0]).shape != (32,):
        raise ValueError("ptx_emulator: mma.sync takes the operands of one warp, 32 lanes")
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for reg, rows, cols in ((0, g, 2 * t), (1, g + 8, 2 * t), (2, g, 2 * t + 8), (3, g + 8, 2 * t + 8)):
        A[rows, cols], A[rows, cols + 1] = _halves(read(a[reg]), dtype)
    for reg, k in ((0, 2 * t), (1, 2 * t + 8)):
        B[k, g], B[k + 1, g] = _halves(read(b[reg]), dtype)
    as_float = lambda word: word.astype(U32).view(np.float32).astype(np.float64)
    C = np.zeros((16, 8))
    for reg, rows, cols in ((0, g, 2 * t), (1, g, 2 * t + 1), (2, g + 8, 2 * t), (3, g + 8, 2 * t + 1)):
        C[rows, cols] = as_float(read(c[reg]))
    D = (A @ B + C).astype(np.float32)
    for reg, rows, cols in ((0, g, 2 * t), (1, g, 2 * t + 1), (2, g + 8, 2 * t), (3, g + 8, 2 * t + 1)):
        regs[d[reg]] = D[rows, cols].view(U32)
