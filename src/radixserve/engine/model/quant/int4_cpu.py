"""torch's CPU weight-only int4 GEMM: packing an ``Int4Affine`` for it, the matmul, and the weight dequantized from
the packed bytes for prefill-sized calls.

The kernel is ATen's ``_weight_int4pack_mm_for_cpu`` (``aten/src/ATen/native/cpu/int4mm_kernel.cpp``, the CPU port of
gpt-fast's tinygemm): ``y = x @ W.T`` with ``W[n, k] = (q[n, k] - 8) * scale[k // g, n] + zero[k // g, n]``, the scale
and zero stored as ``qScaleAndZeros`` ``[K / g, N, 2]`` in the activation's dtype, dequantized and accumulated in
float32 (AVX-512 / AVX2 paths; blocks of 4 rows by 64 columns, each row summed over K in order, so a row's result does
not depend on the other rows: the kernel is batch invariant as it is). N must be a multiple of 16.

The packed layout (``_convert_weight_to_int4pack_for_cpu``: ``[N, K]`` int32 -> ``[N, K / 2]`` uint8) depends on the
CPU capability ATen dispatches to (``PackLayout``): N is cut into blocks of ``block_n`` rows (64 on AVX-512, 32 on
AVX2 and the scalar path), each stored as ``[K, block_n / 2]`` bytes, the blocks one after another. In a full block
on AVX-512 / AVX2, byte ``j`` of a K row holds row ``j`` in its low nibble and row ``j + block_n / 2`` in its high one
(``interleaved``); the last, shorter block, and every block of the scalar path, hold rows ``2 j`` and ``2 j + 1``.
``pack_layout`` finds which one this process packs by packing a probe, so ``unpack_codes`` / ``dequantize`` read the
codes back from the packed bytes alone: one copy of the 4-bit codes per weight (packed bytes are only valid on the
machine, and torch build, that packed them).

Above ``DEQUANT_ROWS`` rows, ``int4_linear`` dequantizes the weight and runs the dense GEMM. The dequantization is a
few torch ops (``_dequantize_t``); ``prepare_dequantize`` compiles them once per weight shape with inductor into one
C++ loop (``torch._inductor.compile`` of a ``make_fx`` graph: no dynamo at call time, so it runs compiled inside the
custom op also when the model forward is itself ``torch.compile``-d, where a ``torch.compile``-d function runs eager).
Compiled and eager give the same weight bit for bit (``tests/test_quant_gguf.py``).

``torch.compile`` can trace the ATen op (it has a meta function); the engine calls it through the
``radixserve::int4_linear`` custom op, so the choice between kernel and dequantized GEMM is kept under compile.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.engine.model.forward_context import forward_is_extend
from radixserve.engine.model.quant.affine import GROUP, Int4Affine

logger = logging.getLogger(__name__)

N_MULTIPLE = 16  # the packing's N block (``_convert_weight_to_int4pack_cpu``: "expect N to be dividable by 16")


# Above this many rows a call dequantizes the weight to the activation dtype (``dequantize``, compiled: ~0.5 ms for
# 576 x 1536) and runs the dense GEMM (oneDNN, AMX where the CPU has it): the kernel dequantizes the weight again for
# every 4 rows, so its time grows with the rows while the dequantized path's barely does. Measured (bench/
# quant_kernels.py, Xeon with AMX, 1 thread, q4-bf16 vs q4-deq): the kernel faster at 16 rows (0.55-0.6x the
# dequantized path), slower at 32 (1.1-1.4x) and 64 (1.5-1.8x) for the SmolLM2 shapes; not so for a 576 -> 49152 LM
# head (56 MB dequantized: the kernel is faster up to 64 rows), which takes more than 32 rows only for batches of
# over 32 sequences.
DEQUANT_ROWS = 32

# Weights of fewer codes than this are dequantized by the eager ops, uncompiled: no compile (seconds each) for toy
# and test models, whose eager dequantization takes microseconds.
COMPILE_MIN_CODES = 1 << 16


@dataclass(frozen=True)
class Int4Packed:
    """A weight packed for ``int4_linear``: ``weight`` uint8 ``[N, C * K / 2]`` in the kernel's layout (the only
    copy of the codes), ``scale_zeros`` ``[C * K / 32, N, 2]`` in the activation dtype, ``input_copies`` ``C``
    (``Int4Affine``)."""

    weight: torch.Tensor
    scale_zeros: torch.Tensor
    input_copies: int

    @property
    def out_features(self) -> int:
        """``N``."""
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        """``K``."""
        return int(self.weight.shape[1]) * 2 // self.input_copies

    def nbytes(self) -> int:
        """Bytes of the packed codes and the scales."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale_zeros))


@dataclass(frozen=True)
class PackLayout:
    """How ``_convert_weight_to_int4pack_for_cpu`` lays out the codes (module docstring): blocks of ``block_n``
    rows, each ``[K, block_n / 2]`` bytes; ``interleaved``: a full block's byte ``j`` holds rows ``j`` (low nibble)
    and ``j + block_n / 2`` (high), else rows ``2 j`` and ``2 j + 1``."""

    block_n: int
    interleaved: bool


# ATen's three packings: AVX-512 (64-row blocks), AVX2 (32), the scalar fallback (32, pairs)
_LAYOUTS = (PackLayout(64, True), PackLayout(32, True), PackLayout(32, False))


def int4_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """True where the kernel runs: CPU, activations float32 / bfloat16 / float16 (only bfloat16 has a vectorized
    kernel on x86; float32 and float16 run a scalar loop, 10-100x slower)."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)


def _pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` uint8 0..15 ``[N, K]`` -> the kernel's packed uint8 ``[N, K / 2]``."""
    packed: torch.Tensor = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    return packed


def pack(w: Int4Affine, dtype: torch.dtype) -> Int4Packed:
    """Pack ``w`` for activations of ``dtype``; the scale and zero are rounded once, float64 -> ``dtype`` (exact for
    Q4_0 / Q8_0 in float32 and float16, and for Q4_1's scale; within one rounding of ``dtype`` otherwise).

    Raises ValueError when N is not a multiple of 16 (the caller keeps such a weight dense).
    """
    if w.out_features % N_MULTIPLE:
        raise ValueError(f"the CPU int4 kernel needs N divisible by {N_MULTIPLE}, got N = {w.out_features}")
    scale_zeros = torch.stack([w.scale, w.zero], dim=-1).to(dtype).transpose(0, 1).contiguous()
    return Int4Packed(_pack_codes(w.codes), scale_zeros, w.input_copies)


def _block_codes(blocks: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Packed blocks uint8 ``[blocks, K, b / 2]`` -> their codes uint8 ``[K, blocks * b]`` (transposed: column = row
    of the weight). Both nibbles by one broadcast shift by a constant ``[0, 4]``, which inductor folds and vectorizes
    (a ``stack`` or ``cat`` of the two nibbles, or shifts from ``arange``, it compiles to a scalar loop: 4-10x
    slower)."""
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=blocks.device)  # low nibble, high nibble
    if interleaved:  # [blocks, K, nibble, j]: row nibble * b / 2 + j
        q = (blocks[:, :, None, :] >> shifts[:, None]) & 0x0F
    else:  # [blocks, K, j, nibble]: row 2 j + nibble
        q = (blocks[..., None] >> shifts) & 0x0F
    return q.permute(1, 0, 2, 3).reshape(blocks.shape[1], -1)


def _codes_t(weight: torch.Tensor, layout: PackLayout) -> torch.Tensor:
    """The codes of a packed ``weight`` uint8 ``[N, Kc / 2]`` as uint8 ``[Kc, N]`` (transposed)."""
    n, kc = weight.shape[0], weight.shape[1] * 2
    b = layout.block_n
    full = n // b * b
    flat = weight.reshape(-1)
    parts = []
    if full:
        parts.append(_block_codes(flat[: full * kc // 2].view(full // b, kc, b // 2), layout.interleaved))
    if n > full:  # the last, shorter block: row pairs
        parts.append(_block_codes(flat[full * kc // 2 :].view(1, kc, (n - full) // 2), False))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


@functools.cache
def pack_layout() -> PackLayout | None:
    """The layout this process's ``_convert_weight_to_int4pack_for_cpu`` packs in, found by packing a probe (random
    codes, ``N = 112``: one 64-row block and a 48-row tail, which tells the three apart); None when it is none of
    ``_LAYOUTS`` (a torch whose packing changed: then ``int4_linear`` runs the kernel at every row count)."""
    codes = torch.randint(0, 16, (112, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = _pack_codes(codes)
    for layout in _LAYOUTS:
        if torch.equal(_codes_t(packed, layout).T, codes):
            return layout
    logger.warning("unknown int4 packing layout (torch %s): prefill runs the int4 kernel", torch.__version__)
    return None


def unpack_codes(weight: torch.Tensor) -> torch.Tensor:
    """The codes of a packed ``weight`` uint8 ``[N, Kc / 2]`` back in plain order, uint8 0..15 ``[N, Kc]`` (what
    ``pack`` was given). Raises RuntimeError when ``pack_layout`` is unknown."""
    layout = pack_layout()
    if layout is None:
        raise RuntimeError("unknown int4 packing layout")
    return _codes_t(weight, layout).T.contiguous()


def dequantize_codes(
    codes: torch.Tensor, scale_zeros: torch.Tensor, input_copies: int, dtype: torch.dtype
) -> torch.Tensor:
    """The reference: the weight ``[N, K]`` in ``dtype`` from plain ``codes`` uint8 0..15 ``[N, C * K]`` (an
    ``Int4Affine``'s, or ``unpack_codes``) and ``scale_zeros``: the kernel's ``(q - 8) * scale + zero`` in float32,
    the input copies summed, then rounded to ``dtype``."""
    n = codes.shape[0]
    q = codes.view(n, -1, GROUP).float()
    sz = scale_zeros.float().transpose(0, 1)  # [N, groups, 2]
    w = torch.addcmul(sz[..., 1:], q - 8, sz[..., :1]).reshape(n, input_copies, -1)
    return (w[:, 0] if input_copies == 1 else w.sum(1)).to(dtype)


def _dequantize_t(
    weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, input_copies: int, layout: PackLayout
) -> torch.Tensor:
    """The weight transposed, ``[K, N]`` in the dtype of ``scale``, from the packed bytes and the scales and zeros
    ``[C * K / 32, N]`` (contiguous: inductor vectorizes no loop that reads them interleaved, as ``scale_zeros``
    holds them; measured 8x slower): the value of ``dequantize_codes`` bit for bit (the product ``(q - 8) * scale``
    is exact in float32, a 4-bit integer times a scale of at most 11 significant bits, so the one rounding is that of
    the sum, whichever way it is computed).

    Plain torch ops, traced for ``compile_dequantize``. One input copy: ``addcmul`` in the weight's dtype (ATen and
    inductor compute bfloat16 / float16 in float32 and round once); more (Q8_0's two halves) are summed in float32.
    """
    codes_t = _codes_t(weight, layout)  # [C * K, N]
    kc, n = codes_t.shape
    shape = (input_copies, kc // input_copies // GROUP, GROUP, n)  # [C, K / 32, 32, N]
    s, z = scale.view(input_copies, -1, 1, n), zero.view(input_copies, -1, 1, n)
    if input_copies == 1:
        q = codes_t.to(scale.dtype).view(shape) - 8
        return torch.addcmul(z, q, s).view(kc, n)
    q = codes_t.float().view(shape) - 8
    w = torch.addcmul(z.float(), q, s.float()).sum(0)
    return w.to(scale.dtype).view(kc // input_copies, n)


def _split(scale_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``scale_zeros`` ``[G, N, 2]`` -> contiguous ``(scale, zero)``, each ``[G, N]`` (1/16 of the codes' count)."""
    return scale_zeros[..., 0].contiguous(), scale_zeros[..., 1].contiguous()


_Key = tuple[tuple[int, ...], tuple[int, ...], int, torch.dtype]
_Dequantize = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_compiled: dict[_Key, _Dequantize | None] = {}


def _key(weight: torch.Tensor, scale_zeros: torch.Tensor, input_copies: int) -> _Key:
    return tuple(weight.shape), tuple(scale_zeros.shape), input_copies, scale_zeros.dtype


def compile_dequantize(weight: torch.Tensor, scale_zeros: torch.Tensor, input_copies: int) -> _Dequantize:
    """``_dequantize_t`` for tensors of these shapes and dtype, compiled by inductor: ``fn(weight, scale, zero)``
    (``_split``) -> ``[K, N]``. Seconds (a C++ compile; inductor's FX-graph cache keeps it across restarts).

    Raises RuntimeError when the packing layout is unknown; whatever inductor raises (no C++ compiler, ...).
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    layout = pack_layout()
    if layout is None:
        raise RuntimeError("unknown int4 packing layout")
    fn = functools.partial(_dequantize_t, input_copies=input_copies, layout=layout)
    example: list[torch.Tensor | int | torch.SymInt | None] = [weight, *_split(scale_zeros)]
    with torch.inference_mode(False), torch.no_grad():
        gm = make_fx(fn)(*example)
        compiled = torch._inductor.compile(gm, example)

    def run(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        out = compiled(w, scale, zero)
        result: torch.Tensor = out[0] if isinstance(out, (tuple, list)) else out
        return result

    return run


def prepare_dequantize(weight: torch.Tensor, scale_zeros: torch.Tensor, input_copies: int) -> bool:
    """Compile the dequantization of weights like this one (once per shape and dtype, ``compile_dequantize``), so
    prefill-sized ``int4_linear`` calls run it: at load, not at the first request. Weights under
    ``COMPILE_MIN_CODES`` codes are left to the eager ops. Returns True when a compiled one is ready; a failed compile
    is logged and leaves the eager ops (same values, slower)."""
    key = _key(weight, scale_zeros, input_copies)
    if key not in _compiled:
        if weight.numel() * 2 < COMPILE_MIN_CODES or pack_layout() is None:
            return False
        try:
            _compiled[key] = compile_dequantize(weight, scale_zeros, input_copies)
        except Exception:  # inductor's errors are many (no compiler, codegen); the eager ops give the same weight
            logger.warning("int4 dequantize not compiled for %s: eager ops for prefill", key, exc_info=True)
            _compiled[key] = None
    return _compiled[key] is not None


def dequantize(weight: torch.Tensor, scale_zeros: torch.Tensor, input_copies: int) -> torch.Tensor:
    """The weight ``[N, K]`` of a packed ``weight`` (a transposed view of a contiguous ``[K, N]``) in the dtype of
    ``scale_zeros``: ``dequantize_codes`` bit for bit; compiled when ``prepare_dequantize`` prepared it, else eager.

    Raises RuntimeError when the packing layout is unknown.
    """
    fn = _compiled.get(_key(weight, scale_zeros, input_copies))
    if fn is not None:
        return fn(weight, *_split(scale_zeros)).T
    layout = pack_layout()
    if layout is None:
        raise RuntimeError("unknown int4 packing layout")
    return _dequantize_t(weight, *_split(scale_zeros), input_copies, layout).T


def int4_mm(x: torch.Tensor, weight: torch.Tensor, scale_zeros: torch.Tensor, input_copies: int) -> torch.Tensor:
    """The kernel alone: ``x @ W.T``, ``x`` ``[T, K]`` (the dtype of ``scale_zeros``) -> ``[T, N]``, whatever ``T``.

    Raises RuntimeError (from the kernel) on a dtype or shape mismatch.
    """
    if input_copies > 1:
        x = x.repeat(1, input_copies)
    out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), weight, GROUP, scale_zeros)
    return out


@torch.library.custom_op("radixserve::int4_linear", mutates_args=())
def int4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_zeros: torch.Tensor,
    input_copies: int,
    dequant_rows: int = DEQUANT_ROWS,
) -> torch.Tensor:
    """``x @ W.T`` for a packed ``W`` ``[N, K]`` (an ``Int4Packed``'s tensors): ``x`` ``[T, K]`` -> ``[T, N]``; the int4
    kernel up to ``dequant_rows`` rows, above them, and in every prefill (``forward_is_extend``: regression, a cached
    prompt's last token went through the kernel and a cold one's through the GEMM, and the demo GGUF's greedy answer
    to one question changed on its second asking), the dequantized weight (``dequantize``) through the dense GEMM
    (``-1``: always the kernel, which is batch invariant: ``--enable-deterministic-inference``; also where the
    packing layout is unknown).

    One custom op, so ``torch.compile`` keeps the choice (the row count is symbolic there) and compiled rows equal
    eager rows. Raises RuntimeError on a dtype or shape mismatch.
    """
    if 0 <= dequant_rows and (dequant_rows < x.shape[0] or forward_is_extend()) and pack_layout() is not None:
        return F.linear(x, dequantize(weight, scale_zeros, input_copies))
    return int4_mm(x, weight, scale_zeros, input_copies)


@int4_linear.register_fake
def _int4_linear_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_zeros: torch.Tensor,
    input_copies: int,
    dequant_rows: int = DEQUANT_ROWS,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))
