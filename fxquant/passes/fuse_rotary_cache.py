"""fuse_rotary_cache: a decode step's rotary embedding of q and k and its KV cache writes become one op, whose kernel
rotates q, writes the rotated k and v into the cache, and returns q: one launch where Inductor makes three to five.

Pre: a torch-level graph from dynamo (the cache written by `index_copy_`, as transformers' StaticCache writes it).
Post: where the writes go to caches on a device in `devices`, for at most MAX_QUERIES positions:

    %q2 = q * cos + cat(-q[..., D/2:], q[..., :D/2]) * sin;  %k2 likewise from k, with the same cos and sin
    K.index_copy_(2, %p, %k2);  V.index_copy_(2, %p, v)
        ->  %q2 = fxquant.rotary_cache_write(q, k, v, cos, sin, %p, K, V)

(GPT-OSS spells the rotation cat((a * c - b * s, b * c + a * s), -1) with a, b = q.chunk(2, -1) and c, s half as
wide: the same rotation, taken with its half-width c and s), and over an e4m3 cache (fxquant.FP8StaticCache), whose
twin layer writes the scales at its own positions %s:

    %ck, %sk = quantize_fp8(%k2, 0);  %cv, %sv = quantize_fp8(v, 0)
    Sk.index_copy_(2, %s, %sk);  Sv.index_copy_(2, %s, %sv)
    K.index_copy_(2, %p, %ck.view(uint8));  V.index_copy_(2, %p, %cv.view(uint8))
        ->  %q2 = fxquant.rotary_cache_write_e4m3(q, k, v, cos, sin, %p, %s, K, V, Sk, Sv)

The op runs where the last write was. It is taken only where the rotated k feeds nothing but its write (or its
quantizer, whose outputs feed only their writes), the writes' results are unread, the rotated q is computed before
the last write and read only after it, and nothing but views touches a cache between the first write and the last:
the writes keep their order against every read. Left as they are: torch.export's aten graphs (their writes are
functional), rotations of part of a head (partial rotary), the interleaved form (rotate_every_two), sliding-window
layers (they roll their cache), and prefill. Where the graph rounds cos and sin from fp32 to the model's dtype, the
op takes them in fp32, as Inductor's unfused code reads them; it rounds the rotation once
(`fxquant.numerics.reference_rotary`), so a rotated element may differ from the unfused graph's by one ulp
(docs/decisions/0022-rotary-and-cache-write-in-one-kernel.md).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx.passes.infra.pass_base import PassResult

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.kernels.rotary_cache import supports as kernel_supports
from fxquant.kernels.rotary_cache import supports_codes as codes_supports
from fxquant.passes.annotations import fake_value, module_path
from fxquant.passes.order import FxquantPass
from fxquant.passes.patterns import MAX_QUERIES
from fxquant.passes.side_effects import alias_root, has_side_effects
from fxquant.passes.spellings import ADD, CAT, DTYPE_CASTS, MUL, SUB, UNSQUEEZE, target_of
from fxquant.passes.state import PipelineState

ROTARY_CACHE_WRITE = torch.ops.fxquant.rotary_cache_write.default
ROTARY_CACHE_WRITE_E4M3 = torch.ops.fxquant.rotary_cache_write_e4m3.default
QUANTIZE = torch.ops.fxquant.quantize_fp8.default
NEG = {torch.neg, torch.Tensor.neg, operator.neg}
CHUNK = {torch.chunk, torch.Tensor.chunk}
INDEX_COPY_ = torch.Tensor.index_copy_


def _half_of(node, x: torch.fx.Node, half: int) -> str | None:
    """"lo" or "hi" where node is x[..., :half] or x[..., half:] (the last dim sliced, the others whole)."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and node.args[0] is x and isinstance(node.args[1], tuple) and node.args[1]):
        return None
    *leading, last = node.args[1]
    whole = slice(None, None, None)
    value = fake_value(x)
    if not isinstance(last, slice) or last.step not in (None, 1) or not all(i is Ellipsis or i == whole
                                                                            for i in leading):
        return None
    if Ellipsis not in leading and (value is None or len(leading) != value.dim() - 1):
        return None
    if last.start in (None, 0) and last.stop == half:
        return "lo"
    if last.start == half and last.stop in (None, 2 * half):
        return "hi"
    return None


def _turned(node, x: torch.fx.Node, half: int) -> bool:
    """node is cat((-x[..., half:], x[..., :half]), dim=-1): transformers' rotate_half(x)."""
    if not (isinstance(node, torch.fx.Node) and target_of(node) in CAT):
        return False
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    value = fake_value(x)
    if value is None or dim not in (-1, value.dim() - 1) or not isinstance(parts, list | tuple) or len(parts) != 2:
        return False
    negated, low = parts
    return (isinstance(negated, torch.fx.Node) and target_of(negated) in NEG and len(negated.args) == 1
            and _half_of(negated.args[0], x, half) == "hi" and _half_of(low, x, half) == "lo")


def _operand_pairs(node) -> list:
    """Both (a, b) orders of the node operands of a product a * b; [] where node is not one."""
    if not (isinstance(node, torch.fx.Node) and target_of(node) in MUL and len(node.args) == 2 and not node.kwargs):
        return []
    a, b = node.args
    return [(a, b), (b, a)] if isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node) else []


def rotary(node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(x, cos, sin) where node rotates x's whole last dim, in either spelling, in any operand order: transformers'
    x * cos + rotate_half(x) * sin (cos and sin as wide as x), or GPT-OSS's cat((a * c - b * s, b * c + a * s), -1)
    with a, b = x.chunk(2, -1) (cos and sin half as wide); else None."""
    return _rotate_half_form(node) or _chunked_form(node)


def _chunk_of(node) -> tuple[torch.fx.Node, int] | None:
    """(x, i) where node is x.chunk(2, dim=-1)[i]."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], torch.fx.Node) and target_of(node.args[0]) in CHUNK):
        return None
    chunk = node.args[0]
    x, chunks = chunk.args[0], chunk.args[1] if len(chunk.args) > 1 else chunk.kwargs.get("chunks")
    dim = chunk.args[2] if len(chunk.args) > 2 else chunk.kwargs.get("dim", 0)
    value = fake_value(x)
    if chunks != 2 or not isinstance(value, torch.Tensor) or dim not in (-1, value.dim() - 1) or value.shape[-1] % 2:
        return None
    return x, node.args[1]


def _chunked_form(node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(x, c, s) where node is cat((a * c - b * s, b * c + a * s), dim=-1) with a, b = x.chunk(2, -1)."""
    if not (isinstance(node, torch.fx.Node) and target_of(node) in CAT and node.args):
        return None
    parts, dim = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(parts, list | tuple) or len(parts) != 2 or dim != -1:
        return None
    first, second = parts
    if not (isinstance(first, torch.fx.Node) and target_of(first) in SUB and len(first.args) == 2
            and isinstance(second, torch.fx.Node) and target_of(second) in ADD and len(second.args) == 2):
        return None
    for a, c in _operand_pairs(first.args[0]):
        halves = _chunk_of(a)
        if halves is None or halves[1] != 0:
            continue
        x = halves[0]
        for b, s in _operand_pairs(first.args[1]):
            if _chunk_of(b) != (x, 1):
                continue
            t1, t2 = second.args
            if (_is_product(t1, b, c) and _is_product(t2, a, s)) or (_is_product(t2, b, c) and _is_product(t1, a, s)):
                return x, c, s
    return None


def _is_product(node, p: torch.fx.Node, q: torch.fx.Node) -> bool:
    """node is p * q, either order."""
    return (p, q) in _operand_pairs(node)


def _rotate_half_form(node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(x, cos, sin) where node is x * cos + rotate_half(x) * sin."""
    if not (isinstance(node, torch.fx.Node) and target_of(node) in ADD and len(node.args) == 2 and not node.kwargs):
        return None
    for straight, turned in (node.args, node.args[::-1]):
        for x, cos in _operand_pairs(straight):
            value = fake_value(x)
            if not isinstance(value, torch.Tensor) or value.dim() < 1 or value.shape[-1] % 2:
                continue
            for rotated_half, sin in _operand_pairs(turned):
                if _turned(rotated_half, x, value.shape[-1] // 2):
                    return x, cos, sin
    return None


def _before_rounding(node: torch.fx.Node) -> tuple[torch.fx.Node, int | None] | None:
    """(the fp32 source, the unsqueeze's dim or None) where node is unsqueeze(fp32.to(low), dim) or fp32.to(low): the
    cos or sin before its rounding to the model's dtype, which Inductor's unfused code reads; else None."""
    dim = None
    if target_of(node) in UNSQUEEZE and len(node.args) == 2 and isinstance(node.args[1], int) and not node.kwargs:
        node, dim = node.args[0], node.args[1]
    if not (isinstance(node, torch.fx.Node) and target_of(node) in DTYPE_CASTS and node.args
            and isinstance(node.args[0], torch.fx.Node)):
        return None
    source, rounded = fake_value(node.args[0]), fake_value(node)
    if not (isinstance(source, torch.Tensor) and isinstance(rounded, torch.Tensor) and source.dtype == torch.float32
            and rounded.dtype in (torch.bfloat16, torch.float16) and source.shape == rounded.shape
            and source.device == rounded.device):
        return None
    return node.args[0], dim


def _unrounded(graph: torch.fx.Graph, cos: torch.fx.Node, sin: torch.fx.Node, before: torch.fx.Node):
    """cos and sin in fp32 where the graph rounds both from fp32 (new unsqueezes inserted before `before`), else as
    they are."""
    found = [_before_rounding(n) for n in (cos, sin)]
    if None in found or found[0][1] != found[1][1]:
        return cos, sin
    unrounded = []
    for source, dim in found:
        if dim is None:
            unrounded.append(source)
            continue
        with graph.inserting_before(before):
            node = graph.call_method("unsqueeze", (source, dim))
        value = fake_value(source)
        with value.fake_mode:
            node.meta["example_value"] = value.unsqueeze(dim)
        unrounded.append(node)
    return tuple(unrounded)


def _cache_write(node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(cache, positions, value) where node is cache.index_copy_(2, positions, value) and its result is unread."""
    if target_of(node) is not INDEX_COPY_ or node.users or node.kwargs or len(node.args) != 4:
        return None
    cache, dim, positions, value = node.args
    if dim != 2 or not all(isinstance(n, torch.fx.Node) for n in (cache, positions, value)):
        return None
    return cache, positions, value


def _quantized_codes(value) -> torch.fx.Node | None:
    """The quantizer node q where value is q[0].view(uint8): e4m3 codes of a row quantizer (quantize_fp8(x, 0)),
    stored as an e4m3 cache stores them, with nothing else reading the codes."""
    if not (isinstance(value, torch.fx.Node) and target_of(value) is torch.Tensor.view and len(value.args) == 2
            and value.args[1] is torch.uint8 and len(value.users) == 1):
        return None
    codes = value.args[0]
    if not (isinstance(codes, torch.fx.Node) and codes.target is operator.getitem and codes.args[1] == 0
            and len(codes.users) == 1):
        return None
    quantizer = codes.args[0]
    if not (isinstance(quantizer, torch.fx.Node) and quantizer.target is QUANTIZE and quantizer.args[1:] == (0,)):
        return None
    return quantizer


def _scale_write(writes: dict, quantizer: torch.fx.Node) -> torch.fx.Node | None:
    """The write of quantizer's scales (its output 1, read by nothing else), among `writes`."""
    return next((w for w, (_, _, value) in writes.items() if value.target is operator.getitem
                 and value.args == (quantizer, 1) and len(value.users) == 1), None)


VIEWS = {torch.Tensor.view, torch.Tensor.unsqueeze, torch.Tensor.expand, torch.Tensor.transpose}


def _is_view(node: torch.fx.Node) -> bool:
    """A view made without reading memory: basic indexing (slices, ints, None, Ellipsis) or a view method."""
    if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2:
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        return isinstance(node.args[0], torch.fx.Node) and all(
            i is None or i is Ellipsis or isinstance(i, int | slice) for i in index)
    return target_of(node) in VIEWS


@dataclass
class CacheWrites:
    """A layer's cache writes the op replaces, and what it writes: k before rotation, v, the caches."""

    writes: list[torch.fx.Node]
    k_rot: torch.fx.Node  # the rotated k the writes store (or quantize)
    k_reader: torch.fx.Node  # k_rot's one reader: its write, or its quantizer
    v: torch.fx.Node
    positions: torch.fx.Node
    caches: tuple[torch.fx.Node, ...]  # (K, V), or the e4m3 cache's (K codes, V codes, K scales, V scales)
    scale_positions: torch.fx.Node | None = None  # the e4m3 cache's scales', counted by its twin layer


def _plain_writes(k_write: torch.fx.Node, writes: dict, later: list) -> CacheWrites | None:
    """K.index_copy_(2, p, rotated k) and the next write at p, V.index_copy_(2, p, v)."""
    k_cache, positions, k_rot = writes[k_write]
    v_write = next((w for w in later if writes[w][1] is positions), None)
    if v_write is None or rotary(k_rot) is None:
        return None
    v_cache, _, v = writes[v_write]
    return CacheWrites([k_write, v_write], k_rot, k_write, v, positions, (k_cache, v_cache))


def _e4m3_writes(k_write: torch.fx.Node, writes: dict, later: list) -> CacheWrites | None:
    """An e4m3 cache's four: the codes of quantize_fp8(rotated k, 0) and of quantize_fp8(v, 0) at p, their scales at
    the twin layer's p'."""
    k_codes, positions, value = writes[k_write]
    k_quantizer = _quantized_codes(value)
    v_write = next((w for w in later if writes[w][1] is positions and _quantized_codes(writes[w][2])), None)
    if k_quantizer is None or v_write is None:
        return None
    v_quantizer = _quantized_codes(writes[v_write][2])
    k_scales, v_scales = _scale_write(writes, k_quantizer), _scale_write(writes, v_quantizer)
    if k_scales is None or v_scales is None or writes[k_scales][1] is not writes[v_scales][1]:
        return None
    if len(k_quantizer.users) != 2 or len(v_quantizer.users) != 2:
        return None
    return CacheWrites([k_write, v_write, k_scales, v_scales], k_quantizer.args[0], k_quantizer,
                       v_quantizer.args[0], positions, (k_codes, writes[v_write][0], writes[k_scales][0],
                                                        writes[v_scales][0]), writes[k_scales][1])


class FuseRotaryCache(FxquantPass):
    name = "fuse_rotary_cache"
    optional = True

    def __init__(self, state: PipelineState | None = None, devices: tuple[str, ...] = ("cuda",)):
        super().__init__()
        self.state = state
        self.devices = devices  # where the kernel runs; elsewhere the op's reference would only add a copy

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        modified = False
        order = {node: i for i, node in enumerate(gm.graph.nodes)}
        writes = {node: found for node in gm.graph.nodes if (found := _cache_write(node)) is not None}
        done = set()
        for k_write in writes:
            later = [w for w in writes if order[w] > order[k_write] and w not in done]
            found = None if k_write in done else (_plain_writes(k_write, writes, later)
                                                  or _e4m3_writes(k_write, writes, later))
            if found is not None and self._fuse(gm.graph, order, found):
                done |= set(found.writes)
                modified = True
                if self.state is not None:
                    self.state.rotary_cache.append(module_path(k_write) or k_write.name)
        return PassResult(gm, modified)  # the rotations and quantizers left unread go with cleanup's dead code

    def _fuse(self, graph: torch.fx.Graph, order: dict, found: CacheWrites) -> bool:
        rotation = rotary(found.k_rot)
        if rotation is None or list(found.k_rot.users) != [found.k_reader]:
            return False
        k, cos, sin = rotation
        first, last = min(found.writes, key=order.get), max(found.writes, key=order.get)
        q_rot = self._query(found.k_rot, cos, sin)
        if q_rot is None or order[q_rot] > order[last] or any(order[u] < order[last] for u in q_rot.users):
            return False
        q = rotary(q_rot)[0]
        values = [fake_value(n) for n in (q, k, found.v, cos, sin, found.positions, *found.caches)]
        if not all(isinstance(t, torch.Tensor) for t in values):
            return False
        fq, fk, fv, fcos, fsin, _, fkc, fvc = values[:8]
        if (fq.device.type not in self.devices or fq.dim() != 4 or not isinstance(fq.shape[2], int)
                or fq.shape[2] > MAX_QUERIES or fkc.dim() != 4 or fkc.shape[:2] != fk.shape[:2]
                or fvc.shape[:2] != fv.shape[:2] or fkc.shape[-1] != fk.shape[-1]):
            return False
        try:
            width = fq.shape[3] if fcos.shape[-1] == fq.shape[3] else fq.shape[3] // 2  # the chunked spelling's half
            torch.broadcast_shapes(fcos.shape, fsin.shape, (fq.shape[0], 1, fq.shape[2], width))
        except RuntimeError:
            return False
        if fcos.dim() > 4 or (fcos.dim() == 4 and fcos.shape[1] != 1) or kernel_supports(*values[:8]) is not None:
            return False
        if found.scale_positions is not None and codes_supports(fq, fkc, *values[8:]) is not None:
            return False
        if self._caches_touched_between(graph, order, first, last, found):
            return False
        cos, sin = _unrounded(graph, cos, sin, last)  # what Inductor's unfused code reads: one rounding fewer
        with graph.inserting_before(last):
            if found.scale_positions is None:
                op = graph.call_function(ROTARY_CACHE_WRITE, (q, k, found.v, cos, sin, found.positions,
                                                              *found.caches))
            else:
                op = graph.call_function(ROTARY_CACHE_WRITE_E4M3, (q, k, found.v, cos, sin, found.positions,
                                                                   found.scale_positions, *found.caches))
        op.meta.update(q_rot.meta)
        q_rot.replace_all_uses_with(op)
        for write in found.writes:
            graph.erase_node(write)
        return True

    @staticmethod
    def _query(k_rot: torch.fx.Node, cos: torch.fx.Node, sin: torch.fx.Node) -> torch.fx.Node | None:
        """The one other rotation by the same cos and sin nodes, within the three steps from cos either spelling
        takes: the query's."""
        near, frontier = set(), {cos}
        for _ in range(3):
            frontier = {user for node in frontier for user in node.users}
            near |= frontier
        candidates = {node for node in near
                      if node is not k_rot and (found := rotary(node)) is not None and found[1:] == (cos, sin)}
        return candidates.pop() if len(candidates) == 1 else None

    @staticmethod
    def _caches_touched_between(graph, order, first, last, found: CacheWrites) -> bool:
        """Whether a node strictly between the first and last write, other than the writes and views (which read
        nothing; their readers count), reads or writes a cache (or is a module call, whose writes are not known)."""
        roots = {alias_root(c) for c in found.caches}
        for node in graph.nodes:
            if not order[first] < order.get(node, -1) < order[last] or node in found.writes or _is_view(node):
                continue
            if any(alias_root(n) in roots for n in node.all_input_nodes) or (
                    has_side_effects(node) and node.op == "call_module"):
                return True
        return False
