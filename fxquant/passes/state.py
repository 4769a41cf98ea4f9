"""What the passes hand each other, in one explicit object the pipeline creates and reads back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from fxquant.config import QuantConfig


class QuantizedBuffers(NamedTuple):
    """The graph module's buffer names of one quantized weight's tensors; None where the format has no such tensor."""

    data: str
    scale: str
    global_scale: str | None
    zero_point: str | None
    row_scale: str | None


@dataclass
class LayerRecord:
    """One weight-bearing layer, for the report and for re-quantizing a weight that changed after compile."""

    fqn: str
    shape: tuple[int, ...]  # [N, K]
    recipe: str | None  # None: kept in high precision
    reason: str  # why kept, or ""
    bytes_before: int
    bytes_after: int
    weight_sqnr: float | None = None  # dB, the quantized weight against the original
    worst_row_sqnr: float | None = None  # dB, its lowest output channel
    source: torch.Tensor | None = None  # the user's weight, as the graph stores it
    transposed: bool = False  # source is [K, N] (Conv1D, x @ W): quantized as source.T
    version: int = 0
    buffers: QuantizedBuffers | None = None  # where the graph holds its quantized weight (the backend's pass only)
    rows: tuple[int, int, int] | None = None  # merged with siblings: its rows [first, stop) of `of` in the buffers
    dtype: torch.dtype | None = None  # the weight's, which its activations share: whether kernels can take them
    device: torch.device | None = None  # where the weight lives
    tiled: bool = False  # its int4 codes are held in tiles (weight_store.tiles_chosen), and re-quantized into them


@dataclass
class PipelineState:
    config: QuantConfig
    layers: list[LayerRecord] = field(default_factory=list)
    upcast: list[str] = field(default_factory=list)  # reductions moved to fp32, by module path
    fused_norms: list[str] = field(default_factory=list)  # norms computed with their fp8 quantizers
    decode_attention: list[str] = field(default_factory=list)  # decode attention on fxquant's kernel, by module
    rotary_cache: list[str] = field(default_factory=list)  # rotary embedding and cache write in one op, by module
    cache_length: list[str] = field(default_factory=list)  # the cache's length counted in that op, by module
    attention_left: list[tuple[str, str]] = field(default_factory=list)  # (module, why) decode attention left
    auto_reasons: dict[str, str] = field(default_factory=dict)  # fqn -> why recipe="auto" kept the layer
