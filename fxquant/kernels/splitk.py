"""Split-K where the output tiles are too few for the SMs: the K loop is cut into SPLIT_K slices run by separate
programs, each writing an fp32 partial; the partials are summed in a fixed order (deterministic, unlike atomic adds
into the output), the bias added and the sum cast once.

At decode (M <= 16), and at medium M where the tile configs ask for it, a GEMM's time is mostly weight bytes /
bandwidth, and an N-only grid of 32-64 tiles leaves most of the 132 SMs idle; cutting K gives every SM a slice of
the weight to stream.

Who sums: the slice that finishes last for its tile (`sum_if_last_slice`). Each slice stores its partial, then
counts itself in at the tile's counter; the one that sees every other slice counted reads the partials back in
slice order, writes the output and resets the counter. A decode layer thus launches one kernel per GEMM instead of
two. The counters are zeros kept per device, and each GEMM leaves them zero; the next GEMM on the stream counts only
once this one has ended. Decode attention counts its key splits on the same counters (`decode_attention.py`).
Split GEMMs that run at once on two streams of one device would count on the same counters: give them
FXQUANT_SPLIT_REDUCE=kernel. The separate reduce kernel (`reduce_partials`) stays for GEMMs traced into a package
(a kept buffer is not an input Inductor can see), for more tiles than there are counters, and where
`reduce_in_gemm(False)` or FXQUANT_SPLIT_REDUCE=kernel asks. Both give the same bits
(docs/decisions/0019-split-k-summed-by-the-last-slice.md).
"""

from __future__ import annotations

import os
import threading

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import cast_float, float_cast_mode
from fxquant.kernels.dependent_launch import launch_options, wait_for_previous
from fxquant.kernels.launch import cdiv, inlined, set_inside, visible

TARGET_PROGRAMS = 264  # two programs per SM of an H200 (132 SMs) keep loads in flight while one waits
COUNTERS = 16384  # output tiles a split GEMM may have and still sum in its last slice: 64 KB of int32 a device
_in_gemm = [os.environ.get("FXQUANT_SPLIT_REDUCE", "gemm") != "kernel"]
_counters: dict[torch.device, torch.Tensor] = {}


def split_k(tiles: int, k_steps: int, programs: int = TARGET_PROGRAMS) -> int:
    """Slices of K for a grid of `tiles` output tiles and `k_steps` BLOCK_K steps, aiming at `programs` programs."""
    if tiles >= programs:
        return 1
    split = 1
    while tiles * split * 2 <= programs and k_steps // (split * 2) >= 4:  # keep >= 4 K steps per slice
        split *= 2
    return split


@triton.jit
def _splitk_reduce_kernel(
    # pointers
    ws_ptr, c_ptr, bias_ptr,
    # sizes and strides
    M, N, stride_cm, stride_cn,
    # meta-parameters
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # a fixed order: the same bits on every run; unrolled, all loads in flight
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    m, n = offs // N, offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + m * stride_cm + n * stride_cn, cast_float(acc, OUT, CAST), mask=mask)


def reduce_partials(ws: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, out_tl) -> torch.Tensor:
    """out = sum(ws [SPLIT_K, M, N], 0) + bias, cast once to out's dtype."""
    split, M, N = ws.shape
    # 256 outputs on 2 warps, one 16-byte load per thread per slice: at decode's M = 1 the reduce spreads over
    # N / 256 programs. Against 1024 on 4 warps with a rolled loop it took 1.2 against 1.9 us after a 4096x4096 int4
    # GEMM split 8, and 1.4 against 2.6 after 4096x14336 split 14 (docs/decisions/0009-int4-split-and-reduce.md).
    block = 256
    visible(_splitk_reduce_kernel)[(cdiv(M * N, block),)](
        ws, out, bias if bias is not None else ws, M, N, out.stride(0), out.stride(1),
        SPLIT_K=split, HAS_BIAS=bias is not None, OUT=out_tl, CAST=float_cast_mode(_splitk_reduce_kernel),
        BLOCK=block, num_warps=2, **launch_options(out.device),
    )
    return out


@triton.jit
def sum_if_last_slice(ws_ptr, c_ptr, bias_ptr, counter_ptr, tile, offs_m, offs_n, M, N, stride_cm, stride_cn,
                      HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr):
    """After this program stored its partial of output tile `tile` (rows offs_m, columns offs_n) in ws [SPLIT_K, M,
    N]: count it in, and if it is the tile's last slice, sum the partials in slice order (the reduce kernel's
    order, so its bits), add the bias, cast into C and zero the counter for the next GEMM."""
    tl.debug_barrier()  # every thread's partial is stored before the count releases it
    done = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if done == SPLIT_K - 1:
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        at = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        acc = tl.zeros((offs_m.shape[0], offs_n.shape[0]), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # read through L2 (.cg): other SMs wrote these
            acc += tl.load(ws_ptr + s * M * N + at, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, cast_float(acc, OUT, CAST), mask=mask)
        tl.store(counter_ptr + tile, 0)  # the next GEMM waits for this one to end before it counts


def counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's zeroed tile counters, where the last slice of a split GEMM of `tiles` output tiles is to sum it:
    outside a package's tracing, within COUNTERS tiles, unless turned off, and once they exist. They are made at the
    first such GEMM outside a CUDA graph capture (a graph's private pool would own them, and a later graph would reuse
    that memory); a capture that finds none yet launches the reduce kernel. None: launch `reduce_partials`."""
    if not _in_gemm[0] or inlined() or tiles > COUNTERS:
        return None
    kept = _counters.get(device)
    if kept is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        kept = _counters[device] = _zeros_outside_graph_pools(device)
    return kept


def _zeros_outside_graph_pools(device: torch.device) -> torch.Tensor:
    """COUNTERS int32 zeros in the caching allocator's ordinary memory. Made on a thread of their own: while
    torch.compile's CUDA graphs warm up, every allocation of the calling thread goes to their pool, which must hold
    only what the graph outputs. The thread waits for the zeros to be written."""
    made = []

    def make():
        try:
            made.append(torch.zeros(COUNTERS, dtype=torch.int32, device=device))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as error:  # raised again on the caller's thread
            made.append(error)

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    if isinstance(made[0], Exception):
        raise made[0]
    return made[0]


def reduce_in_gemm(enabled: bool):
    """Split GEMMs and decode attention launched inside the block sum in their last slice (True) or through the
    reduce and merge kernels (False)."""
    return set_inside(_in_gemm, enabled)
