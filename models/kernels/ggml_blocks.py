"""Linears whose weights stay in a GGUF file's ggml blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K), run as stored by our kernels (models/kernels/cpu/ggml_blocks.c).

A weight [N, K] is held as the file's bytes, N output channels of K / QK blocks each ([N, row
bytes] uint8, a GGUF tensor's rows), with the float16 scales and minimums inside them: nothing is
widened or rounded. A decode step's few rows (tokens) go through the matrix-vector kernel, which
writes each row in int8 digits per 32 inputs, or per 256 for the K types (two digits: within
max|x| / 32512 of x), and takes integer dot products with the blocks' quants (as llama.cpp's
vec_dot does with one digit), the blocks' scales joining in float32; a verify's k + 1 rows meet
each unpacked block together, each row's result the one-row call's to the bit. More rows (a
prefill) through a float32 GEMM on a tile of output channels dequantized into a reused buffer
(the same values: dequantizing is ggml's, bit for bit); at one digit (`set_activation_digits`,
the engine's `gguf_activation_digits`: llama.cpp's arithmetic) a prefill's rows take the integer
kernel too, in chunks whose digits stay in cache while the whole weight meets them.
Without our kernels (no compiler, MMSERVE_NATIVE=0) the tile is dequantized by gguf-py, slowly
but with the same values.

Where this build's vector path runs them, weights of every type are repacked at load
into groups of 8 output channels (`repack`, models/kernels/cpu/ggml_x8.c; the quants' bytes moved,
nothing widened), which the same kernels take as one more type each (KERNEL_TYPES): a decode
step's instruction then meets 8 channels at once. The file's block comes back byte for byte from
a group, so the values (and the dequantizer's output) are unchanged. A GGUF's repacked weights
are kept on disk between starts (models/gguf/repacks.py).

A token embedding table in blocks (`BlockEmbedding`) dequantizes only the rows a step looks up,
with the same C code (ggml's values, bit for bit), into the model dtype; a head tied to it is a
BlockLinear on the same bytes (the table repacked for it). The blocks not repacked are usually
read-only views of the file's mapping (models/mapped_files.py): nothing here writes into them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.kernels import native
from models.kernels import native_interface as c


@dataclass(frozen=True)
class BlockType:
    """A ggml block type the kernels run: its name, ggml's code, values and bytes per block."""

    name: str
    code: int
    values: int
    nbytes: int


BLOCK_TYPES: dict[str, BlockType] = {t.name: t for t in (
    BlockType("Q4_0", c.GGML_Q4_0, 32, 18), BlockType("Q4_1", c.GGML_Q4_1, 32, 20),
    BlockType("Q5_0", c.GGML_Q5_0, 32, 22), BlockType("Q5_1", c.GGML_Q5_1, 32, 24),
    BlockType("Q8_0", c.GGML_Q8_0, 32, 34), BlockType("Q4_K", c.GGML_Q4_K, 256, 144),
    BlockType("Q5_K", c.GGML_Q5_K, 256, 176), BlockType("Q6_K", c.GGML_Q6_K, 256, 210))}
# The layouts the kernels run: the file's types, and ours repacked from them (a file's type ->
# its layout): each type in groups of 8 output channels (models/kernels/cpu/ggml_x8.c), a
# channel's share of a group's block its stored size but for Q4_K's and Q5_K's (4 bytes more:
# their 6-bit sub-block scales written out as bytes).
KERNEL_TYPES: dict[str, BlockType] = {
    **BLOCK_TYPES, "Q4_Kx8": BlockType("Q4_Kx8", c.GGML_Q4_K_X8, 256, 148),
    "Q5_Kx8": BlockType("Q5_Kx8", c.GGML_Q5_K_X8, 256, 180),
    "Q6_Kx8": BlockType("Q6_Kx8", c.GGML_Q6_K_X8, 256, 210),
    "Q4_0x8": BlockType("Q4_0x8", c.GGML_Q4_0_X8, 32, 18),
    "Q4_1x8": BlockType("Q4_1x8", c.GGML_Q4_1_X8, 32, 20),
    "Q5_0x8": BlockType("Q5_0x8", c.GGML_Q5_0_X8, 32, 22),
    "Q5_1x8": BlockType("Q5_1x8", c.GGML_Q5_1_X8, 32, 24),
    "Q8_0x8": BlockType("Q8_0x8", c.GGML_Q8_0_X8, 32, 34)}
REPACKED = {name: f"{name}x8" for name in BLOCK_TYPES}  # each type: its groups of 8
REPACK_FORMAT = 2  # bump when a repacked layout's bytes change (kept layouts then miss)
FEW_ROWS = 16  # up to this many rows (tokens) of x, the matrix-vector kernel; past it a GEMM
TILE_BYTES = 4 << 20  # float32 bytes of a tile of output channels dequantized for the GEMM
MIN_TILE_CHANNELS = 64  # a tile's output channels, at least


def takes(type_name: str, in_features: int) -> bool:
    """Whether a weight of ggml type `type_name` with `in_features` inputs runs as stored."""
    block = BLOCK_TYPES.get(type_name)
    return block is not None and in_features > 0 and in_features % block.values == 0


def row_bytes(block: BlockType, in_features: int) -> int:
    return in_features // block.values * block.nbytes


def repacked_as(type_name: str, n: int, in_features: int) -> str | None:
    """The layout of KERNEL_TYPES `repack` turns a weight [n, in_features] of `type_name`
    into on this build (None: it stays as stored)."""
    target = REPACKED.get(type_name)
    kernels = native.load() if target is not None else None
    if kernels is None or not kernels.ggml_repack_takes(BLOCK_TYPES[type_name].code, n,
                                                        in_features):
        return None
    return target


def repack(blocks: torch.Tensor, type_name: str, in_features: int) -> tuple[str, torch.Tensor]:
    """A weight's blocks as the file holds them ([N, row bytes] uint8) -> (the type its
    kernels run, the blocks in that layout): every type in groups of 8 output
    channels where this build's vector path runs them (the quants' bytes moved, nothing
    widened; Q4_K's 6-bit scales as bytes, 148 bytes a super-block for the file's 144), else the
    blocks unchanged.
    The file's pages of a repacked weight are let go (models.mapped_files.let_go)."""
    from models.kernels.huge_pages import empty_in_huge_pages
    from models.mapped_files import let_go

    n, k = blocks.shape[0], in_features
    target = repacked_as(type_name, n, k)
    if target is None:
        return type_name, blocks
    kernels = native.load()
    blocks = blocks.contiguous()
    # written once here, read every decode step: in huge pages from the start (not copied
    # there after loading, as other weights made at load are)
    out = empty_in_huge_pages(n * row_bytes(KERNEL_TYPES[target], k)).view(n, -1)
    status = kernels.ggml_repack(blocks.data_ptr(), BLOCK_TYPES[type_name].code, n, k,
                                 out.data_ptr(), torch.get_num_threads())
    assert status == 0, f"mm_ggml_repack refused {type_name} [{n}, {k}]"
    let_go(blocks)
    return target, out


def held_bytes(type_name: str, n: int, k: int) -> int:
    """Bytes of a weight [n, k] in a file's block type as a BlockLinear holds it: in our layout
    where this build repacks the type (`repack`), else the file's."""
    target = repacked_as(type_name, n, k)
    return n * row_bytes(KERNEL_TYPES[target or type_name], k)


def dequantize_channels(blocks: torch.Tensor, type_name: str, in_features: int,
                        channels: slice | torch.Tensor | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Output channels of a block weight ([N, row bytes] uint8) to float32 [channels,
    in_features], as ggml dequantizes them: all of them, a slice, or those an int64 index tensor
    names (an embedding's lookup: its channels are token ids). `out`: a float32 buffer to
    fill."""
    block = KERNEL_TYPES[type_name]
    n = blocks.shape[0]
    assert blocks.dtype == torch.uint8 and blocks.is_contiguous()
    assert blocks.shape[1] == row_bytes(block, in_features), "blocks [N, row bytes]"
    ids = None
    if channels is None or isinstance(channels, slice):
        first, last, _ = (channels or slice(0, n)).indices(n)
        count = max(0, last - first)
    else:
        ids = channels.to(torch.int64).contiguous().reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise IndexError(f"channel ids outside [0, {n})")
        first, count = 0, ids.numel()
    if out is None:
        out = torch.empty(count, in_features, dtype=torch.float32)
    assert out.dtype == torch.float32 and out.is_contiguous() and out.numel() == count * in_features
    kernels = native.load()
    if kernels is None:
        picked = blocks[first:first + count] if ids is None else blocks[ids]
        out.view(count, in_features).copy_(torch.from_numpy(_gguf_dequantize(picked, block)))
        return out.view(count, in_features)
    status = kernels.ggml_dequantize(
        blocks.data_ptr(), block.code, None if ids is None else ids.data_ptr(), first, count,
        in_features, out.data_ptr(), torch.get_num_threads())
    if status:
        raise ValueError(f"native ggml dequantize does not take {type_name} rows of "
                         f"{in_features}")
    return out.view(count, in_features)


def _gguf_dequantize(blocks: torch.Tensor, block: BlockType) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(blocks.numpy(), GGMLQuantizationType[block.name])
    return np.ascontiguousarray(values, dtype=np.float32)


DECODE_PATHS = ("vector", "plain", "float")
DIGITS = 2  # int8 digits per input of the integer kernel's x, by default (set_activation_digits)


def block_linear(x: torch.Tensor, blocks: torch.Tensor, type_name: str,
                 in_features: int, path: str = "vector", digits: int = DIGITS) -> torch.Tensor:
    """x [M, K] (float32 / bfloat16) . W^T through the matrix-vector kernel, W held as blocks
    [N, row bytes] -> [M, N] in x's dtype. `path`: "vector" (x written per 32 inputs, 256 for
    the K types, in `digits` int8 digits, dx (h + l / 256) with dx = max|x| / 127 over them,
    and integer dot products
    with the blocks' quants in the variant's vector code), "plain" (the same in plain C, for
    tests), "float" (each block dequantized and multiplied in float32: the earlier kernel, for
    bench/ggml_kernels.py). One digit keeps each input within max|x| / 254 (llama.cpp's
    activations), two within max|x| / 32512 (our int4 kernel's) at twice the integer work."""
    if path not in DECODE_PATHS or digits not in (1, 2):
        raise ValueError(f"decode path {path!r} with {digits} digits: the paths are "
                         f"{DECODE_PATHS}, the digits 1 or 2")
    kernels = native.load()
    assert kernels is not None, "the matrix-vector kernel needs the native library"
    block = KERNEL_TYPES[type_name]
    m, k = x.shape
    assert k == in_features and blocks.shape[1] == row_bytes(block, k)
    x = x.contiguous()
    n = blocks.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    args = (x.data_ptr(), native.DTYPES[x.dtype], blocks.data_ptr(), block.code, y.data_ptr())
    if path == "float":
        status = kernels.ggml_linear_float(*args, m, n, k, torch.get_num_threads())
    else:
        status = kernels.ggml_linear(*args, n, m, n, k, digits, int(path == "plain"),
                                     torch.get_num_threads())
    if status == 2:
        raise ValueError(f"native ggml linear does not take {type_name} rows of {k}")
    if status:
        raise MemoryError("native ggml linear: out of memory for the input's float32 copy")
    return y


_SCRATCH = threading.local()


def _tile_buffer(numel: int) -> torch.Tensor:
    """This thread's float32 tile buffer, at least `numel` long (grown, never shrunk)."""
    buffer = _SCRATCH.__dict__.get("buffer")
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):  # writable outside the engine's inference mode too
            buffer = _SCRATCH.buffer = torch.empty(numel, dtype=torch.float32)
    return buffer[:numel]


def tiled_gemm(x: torch.Tensor, blocks: torch.Tensor, type_name: str,
               in_features: int) -> torch.Tensor:
    """x [M, K] . W^T for many rows: a float32 GEMM on tiles of W's output channels, each
    dequantized into a reused buffer of about TILE_BYTES (in the last-level cache for the GEMM
    that reads it). -> [M, N] in x's dtype."""
    n, k = blocks.shape[0], in_features
    xf = x.float()
    channels = max(MIN_TILE_CHANNELS, TILE_BYTES // (4 * k))
    if channels >= n:
        return F.linear(xf, dequantize_channels(blocks, type_name, k)).to(x.dtype)
    buffer = _tile_buffer(channels * k)
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    for first in range(0, n, channels):
        last = min(n, first + channels)
        tile = dequantize_channels(blocks, type_name, k, slice(first, last),
                                   buffer[: (last - first) * k])
        out[:, first:last] = F.linear(xf, tile)
    return out.to(x.dtype)


class BlockPart(nn.Module):
    """Output channels of a weight [N, K] held in ggml blocks of one type, as a GGUF file
    stores them (`blocks` [N, row bytes] uint8): x . W^T without a bias. With
    `repack_blocks`, held in the layout our decode kernel runs the type in (`repack`), where
    there is one: `type_name` stays the file's type, `kernel_type` names the layout."""

    def __init__(self, blocks: torch.Tensor, type_name: str, in_features: int,
                 repack_blocks: bool = False, kernel_type: str | None = None) -> None:
        """`kernel_type`: the blocks are already in that layout of KERNEL_TYPES (repacked from
        `type_name`'s: a head on its tied embedding's blocks)."""
        super().__init__()
        if not takes(type_name, in_features):
            raise ValueError(f"ggml {type_name} blocks do not hold rows of {in_features}")
        block = KERNEL_TYPES[kernel_type or type_name]
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or (
                blocks.shape[1] != row_bytes(block, in_features)):
            raise ValueError(f"{type_name} blocks for rows of {in_features} are [N, "
                             f"{row_bytes(block, in_features)}] uint8, not "
                             f"{list(blocks.shape)} {blocks.dtype}")
        self.type_name, self.in_features = type_name, in_features
        self.out_features = blocks.shape[0]
        self.kernel_type = kernel_type or type_name
        if repack_blocks and kernel_type is None:
            self.kernel_type, blocks = repack(blocks, type_name, in_features)
        self.register_buffer("blocks", blocks.contiguous())
        # int8 digits per input of x in the integer kernel (set_activation_digits)
        self.digits = DIGITS

    def dequantize(self) -> torch.Tensor:
        return dequantize_channels(self.blocks, self.kernel_type, self.in_features)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, K] float32 / bfloat16 -> [M, N] in their dtype: a decode's or a verify's few
        rows through the integer kernel, a prefill's through the float32 GEMM (the file's
        values, only the order of the sums differing) or, at one digit, through the integer
        kernel too (int8 products, twice the GEMM's rate on the CPUs measured)."""
        if (rows.shape[0] <= FEW_ROWS or self.digits == 1) and native.load() is not None:
            return block_linear(rows, self.blocks, self.kernel_type, self.in_features,
                                digits=self.digits)
        return tiled_gemm(rows, self.blocks, self.kernel_type, self.in_features)


class BlockLinear(nn.Module):
    """A linear layer whose weight [N, K] is held as a GGUF file stores it: one or more parts
    of consecutive output channels (a fused q / k / v whose tensors differ in type), each in
    ggml blocks of its own type, run as stored; bias in the model dtype."""

    def __init__(self, parts: list[tuple[str, torch.Tensor]] | list[BlockPart],
                 in_features: int, bias: torch.Tensor | None, repack_blocks: bool = True,
                 kernel_type: str | None = None) -> None:
        """`parts`: (the file's type, its blocks as stored) each, or parts already made.
        `repack_blocks`: each (type, blocks) part in the layout our decode kernel runs its
        type in (a copy of the file's blocks: `repack`). `kernel_type`: one part whose blocks
        are already in that layout (BlockEmbedding.tied_head)."""
        super().__init__()
        if not parts or (kernel_type is not None and len(parts) > 1):
            raise ValueError("a block linear needs at least one part (one in a kernel layout)")
        self.parts = nn.ModuleList(
            part if isinstance(part, BlockPart)
            else BlockPart(part[1], part[0], in_features, repack_blocks, kernel_type)
            for part in parts)
        if any(part.in_features != in_features for part in self.parts):
            raise ValueError(f"a part of the block linear does not hold rows of {in_features}")
        self.in_features = in_features
        self.out_features = sum(part.out_features for part in self.parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def format(self) -> str:
        """The parts' block types ("Q4_K", "Q4_K+Q6_K")."""
        return "+".join(dict.fromkeys(part.type_name for part in self.parts))

    @property
    def nbytes(self) -> int:
        return sum(part.blocks.nbytes for part in self.parts)

    def dequantize(self) -> torch.Tensor:
        """The weight as the kernels compute with it: [N, K] float32."""
        return torch.cat([part.dequantize() for part in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if rows.dtype not in native.DTYPES:
            rows = rows.float()
        outs = [part(rows) for part in self.parts]
        out = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"blocks={self.format}, bias={self.bias is not None}")


def set_activation_digits(model: nn.Module, digits: int) -> int:
    """Every block linear of `model` (heads tied to a table too) writes x in `digits` int8
    digits per input from now on: 2 (within max|x| / 32512 of x: the file's float32 reading to
    float32 rounding) or 1 (within max|x| / 254: llama.cpp's Q8 activations, half the integer
    work, and a prefill through the integer kernel). -> the number of parts set."""
    if digits not in (1, 2):
        raise ValueError(f"activation digits are 1 or 2, not {digits!r}")
    parts = [module for module in model.modules() if isinstance(module, BlockPart)]
    for part in parts:
        part.digits = digits
    return len(parts)


class BlockEmbedding(nn.Module):
    """A token embedding table [V, H] held in ggml blocks of one type, as a GGUF file stores it
    (`blocks` [V, row bytes] uint8): a lookup dequantizes the rows it reads, as ggml does, and
    rounds them to the model dtype (the values a table dequantized at load would hold)."""

    def __init__(self, blocks: torch.Tensor, type_name: str, embedding_dim: int,
                 dtype: torch.dtype, repack_blocks: bool = False,
                 kernel_type: str | None = None) -> None:
        """`repack_blocks`: the table in the layout our decode kernel runs its type in (where
        there is one: `repack`), for a head tied to it (`tied_head`), the lookups reading the
        same values from it. `kernel_type`: the blocks are already in that layout of
        KERNEL_TYPES (repacked at an earlier start)."""
        super().__init__()
        if not takes(type_name, embedding_dim):
            raise ValueError(f"ggml {type_name} blocks do not hold rows of {embedding_dim}")
        block = KERNEL_TYPES[kernel_type or type_name]
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous() or (
                blocks.shape[1] != row_bytes(block, embedding_dim)):
            raise ValueError(f"{block.name} blocks for rows of {embedding_dim} are contiguous "
                             f"[V, {row_bytes(block, embedding_dim)}] uint8, not "
                             f"{list(blocks.shape)} {blocks.dtype}")
        self.type_name, self.embedding_dim = type_name, embedding_dim
        self.num_embeddings = blocks.shape[0]
        self.kernel_type = kernel_type or type_name
        if repack_blocks and kernel_type is None:
            self.kernel_type, blocks = repack(blocks, type_name, embedding_dim)
        self.register_buffer("blocks", blocks)
        # What callers read of an embedding's `weight`: the model dtype and device.
        self.register_buffer("probe", torch.empty(0, embedding_dim, dtype=dtype),
                             persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """Not the table: an empty [0, H] tensor in the model dtype, on the table's device (the
        dtype and device are what callers of `embed_tokens.weight` read)."""
        return self.probe

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def dequantize(self) -> torch.Tensor:
        """The whole table as the lookups read it: [V, H] float32."""
        return dequantize_channels(self.blocks, self.kernel_type, self.embedding_dim)

    def tied_head(self) -> BlockLinear:
        """A head whose weight is this table: a BlockLinear on the same blocks, in their
        layout (no copy)."""
        return BlockLinear([(self.type_name, self.blocks)], self.embedding_dim, None,
                           kernel_type=self.kernel_type)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (any shape, int) -> [*ids.shape, H] in the model dtype."""
        rows = dequantize_channels(self.blocks, self.kernel_type, self.embedding_dim,
                                   ids.reshape(-1))
        return rows.to(self.probe.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, blocks={self.type_name}, "
                f"dtype={self.probe.dtype}")
