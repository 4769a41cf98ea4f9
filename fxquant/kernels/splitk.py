"""Split-K for small M: the K loop is cut into SPLIT_K slices run by separate programs, each writing an fp32
partial. The last slice to finish a tile adds all its partials in slice order, adds the bias and casts
(`tiles.store_tile`): the same bits on every run, unlike atomics, and no second kernel launch.

At decode (M <= 16) a GEMM's time is weight bytes / bandwidth, and an N-only grid of 32-64 tiles leaves most of
the 132 SMs idle; cutting K gives every SM a slice of the weight to stream.
"""

from __future__ import annotations

import torch

TARGET_PROGRAMS = 264  # two programs per SM of an H200 (132 SMs) keep loads in flight while one waits
TILE_LOCKS = 4096  # arrival counters per stream: split-K grids have fewer tiles than programs (<= 1056 here)
_locks: dict[tuple, torch.Tensor] = {}


def split_k(tiles: int, k_steps: int, M: int, programs: int = TARGET_PROGRAMS) -> int:
    """Slices of K for a grid of `tiles` output tiles and `k_steps` BLOCK_K steps, aiming at `programs` programs:
    1 above decode sizes."""
    if M > 16 or tiles >= programs:
        return 1
    split = 1
    while tiles * split * 2 <= programs and k_steps // (split * 2) >= 4:  # keep >= 4 K steps per slice
        split *= 2
    return split


def tile_locks(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 arrival counters, one per output tile; the last slice of a tile sets its counter back to zero.
    One set per (device, stream), so GEMMs on concurrent streams never share one. Under CUDA graph capture a new
    set is zeroed inside the graph (capture runs nothing, so a cached set made there would hold garbage)."""
    if tiles > TILE_LOCKS:
        raise ValueError(f"fxquant: a split-K grid of {tiles} tiles exceeds the {TILE_LOCKS} tile counters; "
                         "ask for fewer programs")
    cuda = device.type == "cuda"
    key = (device, torch.cuda.current_stream(device).cuda_stream if cuda else 0)
    locks = _locks.get(key)
    if locks is None:
        locks = torch.zeros(TILE_LOCKS, dtype=torch.int32, device=device)
        if not (cuda and torch.cuda.is_current_stream_capturing()):
            _locks[key] = locks
    return locks
