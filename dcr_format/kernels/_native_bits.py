"""Word-level helpers of the compiled kernels that numba's Python subset cannot express.

Private, imported by the compiled kernel modules only (it needs numba). Each is a numba
*intrinsic*: a few lines of LLVM IR that LLVM lowers to what the machine has (vector
compares into a mask register and a population count where the CPU has them, a few
scalar instructions where it does not); the results are the same everywhere, since LLVM
defines them, not the target.

- :func:`class_masks`: the members of each of up to 16 exponent classes among 64
  consecutive elements, a word per class: the block's classes are computed at once and
  narrowed to bytes, then each class is one byte compare of the whole block (the class
  passes of :mod:`dcr_format.codings._classed_kernels`).
- :func:`popcount`: the set bits of a word (LLVM's ``ctpop``).
- :func:`deposit_select`: the index of the ``k``-th set bit of a word, as one bit deposit
  (BMI2's ``pdep``) and a count of trailing zeros; :func:`deposit`, the deposit itself.
  Only for machines where :func:`fast_deposit` says so; elsewhere the kernels keep their
  portable select.
- :func:`mul_high`: the upper 64 bits of the 128-bit product of two uint64 (one
  ``mul``/``mulx`` on x86-64, ``umulh`` on arm64), which turns a division by a number
  known ahead into a multiply (:mod:`dcr_format.codings._rans_kernels`).
- :func:`load_be64`: eight bytes from any offset of a byte array as one big-endian word
  (a single unaligned load, byte-swapped on little-endian hosts), so that bit readers
  take a whole field at once instead of byte by byte.
- :func:`prefetch_write`: a hint that an element of an array is about to be written
  (LLVM's ``prefetch``, which never faults), so that a scatter of sparse positions keeps
  many cache misses in flight instead of waiting on each.
- :func:`pointer_to`: an integer address as a pointer to elements of an array's dtype,
  for a kernel that writes into several tensors passed by address.
"""

from __future__ import annotations

import platform
import sys
from typing import Any

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import config
from numba.cpython.unsafe.numbers import trailing_zeros as _trailing_zeros
from numba.extending import intrinsic

BLOCK = 64
"""Elements :func:`class_masks` takes at once: one bit each in a 64-bit word."""

TRAILING_ZEROS: Any = _trailing_zeros
"""The trailing zero bits of an integer (numba's intrinsic: callable in kernels only)."""


def _splat(builder: Any, value: Any, vector: ir.VectorType) -> Any:
    """``value`` in every element of a vector of type ``vector``."""
    undefined = ir.Constant(vector, ir.Undefined)
    first = builder.insert_element(undefined, value, ir.Constant(ir.IntType(32), 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), vector.count), [0] * vector.count)
    return builder.shuffle_vector(first, undefined, zeros)


def _flat_unsigned(bits: Any) -> bool:
    """Whether a numba type is a C-contiguous 1-d array of unsigned integers."""
    return (
        isinstance(bits, types.Array)
        and bits.ndim == 1
        and bits.layout == "C"
        and bits.dtype in types.unsigned_domain
    )


_SLOW_DEPOSIT = ("znver1", "znver2", "bdver")
"""CPU names (prefixes) whose ``pdep`` is microcoded (hundreds of cycles, not three)."""


def has_deposit() -> bool:
    """Whether kernels compiled here can use :func:`deposit_select` at all: an x86-64 host
    with BMI2, and numba compiling for that host (``NUMBA_CPU_NAME`` or
    ``NUMBA_CPU_FEATURES`` pick another target, which may lack the instruction)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if getattr(config, "CPU_NAME", None) or getattr(config, "CPU_FEATURES", None):
        return False
    return bool(llvm.get_host_cpu_features().get("bmi2"))


def fast_deposit() -> bool:
    """Whether kernels compiled here should use :func:`deposit_select`: where they can
    (:func:`has_deposit`) and the host's ``pdep`` is not microcoded."""
    return has_deposit() and not llvm.get_host_cpu_name().startswith(_SLOW_DEPOSIT)


def _pdep(builder: Any, source: Any, word: Any) -> Any:
    """BMI2's ``pdep`` of two 64-bit values: the low bits of ``source`` onto the set bits
    of ``word``."""
    word64 = ir.IntType(64)
    deposit = builder.module.declare_intrinsic(
        "llvm.x86.bmi.pdep.64", fnty=ir.FunctionType(word64, [word64, word64])
    )
    return builder.call(deposit, [source, word])


@intrinsic
def _deposit_select(typingctx: Any, word: Any, k: Any) -> Any:
    """The index of the ``k``-th set bit (from 0) of a uint64 ``word``: bit ``k`` of a word
    deposited into the set bits of ``word`` (``pdep``) lands on it. ``k`` must be below the
    number of set bits (else the result is 64)."""
    if not (isinstance(word, types.Integer) and isinstance(k, types.Integer)):
        return None
    sig = types.int64(types.uint64, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        k = context.cast(builder, args[1], signature.args[1], types.uint64)
        spread = _pdep(builder, builder.shl(ir.Constant(ir.IntType(64), 1), k), args[0])
        return builder.cttz(spread, ir.Constant(ir.IntType(1), 0))

    return sig, codegen


@intrinsic
def _deposit(typingctx: Any, source: Any, word: Any) -> Any:
    """The low bits of ``source`` deposited into the set bits of ``word``, in order (bit
    ``k`` of ``source`` lands on the ``k``-th set bit; the rest of ``source`` is ignored):
    BMI2's ``pdep``, both uint64."""
    if not (isinstance(source, types.Integer) and isinstance(word, types.Integer)):
        return None
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return _pdep(builder, args[0], args[1])

    return sig, codegen


CLASSES = 16
"""Words :func:`class_masks` fills: one per class, at most this many classes."""


@intrinsic
def _class_masks(
    typingctx: Any, bits: Any, start: Any, shift: Any, mask: Any, base: Any, top: Any, out: Any
) -> Any:
    """``out[c]`` (``c`` in ``0 .. 15``) = the bits ``q`` whose element ``bits[start + q]``
    (``q`` in ``0 .. 63``) is of class ``c = min(max(e - base, 0), top)``, ``e`` its
    exponent field ``(x >> shift) & mask``; ``bits`` a C-contiguous 1-d array of unsigned
    integers, ``out`` one of 16 uint64. ``base`` at most ``mask + 1`` and ``top`` below
    16 (so both fit an element). No bounds check: the caller makes sure that ``start +
    64 <= bits.size``."""
    if not (_flat_unsigned(bits) and isinstance(out, types.Array) and out.dtype == types.uint64):
        return None
    sig = types.void(bits, types.int64, types.int64, types.int64, types.int64, types.int64, out)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        array = context.make_array(signature.args[0])(context, builder, args[0])
        element = context.get_value_type(signature.args[0].dtype)
        vector = ir.VectorType(element, BLOCK)

        def splat(value: Any) -> Any:
            return _splat(builder, builder.trunc(value, element), vector)

        at = builder.gep(array.data, [args[1]])
        block = builder.load(builder.bitcast(at, vector.as_pointer()), align=1)
        exponent = builder.and_(builder.lshr(block, splat(args[2])), splat(args[3]))
        base = splat(args[4])
        zeros = ir.Constant(vector, [0] * BLOCK)
        above = builder.select(
            builder.icmp_unsigned(">=", exponent, base), builder.sub(exponent, base), zeros
        )
        top = splat(args[5])
        classes = builder.select(builder.icmp_unsigned("<", above, top), above, top)
        byte = ir.IntType(8)
        narrow = builder.trunc(classes, ir.VectorType(byte, BLOCK))
        words = context.make_array(signature.args[6])(context, builder, args[6]).data
        word = ir.IntType(BLOCK)
        for c in range(CLASSES):
            equal = builder.icmp_unsigned(
                "==", narrow, ir.Constant(ir.VectorType(byte, BLOCK), [c] * BLOCK)
            )
            builder.store(builder.bitcast(equal, word), builder.gep(words, [ir.Constant(word, c)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _popcount(typingctx: Any, word: Any) -> Any:
    """The number of set bits of a uint64 (as int64)."""
    if not isinstance(word, types.Integer):
        return None
    sig = types.int64(types.uint64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.ctpop(args[0])

    return sig, codegen


@intrinsic
def _mul_high(typingctx: Any, a: Any, b: Any) -> Any:
    """``(a * b) >> 64`` of two uint64 (as uint64), exact."""
    if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
        return None
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        wide = ir.IntType(128)
        product = builder.mul(builder.zext(args[0], wide), builder.zext(args[1], wide))
        return builder.trunc(builder.lshr(product, ir.Constant(wide, 64)), ir.IntType(64))

    return sig, codegen


@intrinsic
def _load_be64(typingctx: Any, data: Any, at: Any) -> Any:
    """``data[at : at + 8]`` as a big-endian uint64; ``data`` a C-contiguous 1-d uint8
    array. No bounds check: the caller makes sure that ``at + 8 <= data.size``."""
    if not (
        isinstance(data, types.Array)
        and data.ndim == 1
        and data.layout == "C"
        and data.dtype == types.uint8
        and isinstance(at, types.Integer)
    ):
        return None
    sig = types.uint64(data, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        array = context.make_array(signature.args[0])(context, builder, args[0])
        word = ir.IntType(64)
        at = builder.gep(array.data, [args[1]])
        value = builder.load(builder.bitcast(at, word.as_pointer()), align=1)
        if sys.byteorder == "big":
            return value
        swap = builder.module.declare_intrinsic("llvm.bswap", [word])
        return builder.call(swap, [value])

    return sig, codegen


@intrinsic
def _prefetch_write(typingctx: Any, array: Any, index: Any) -> Any:
    """Hint that ``array[index]`` will be written soon (``array`` a C-contiguous 1-d
    array); no effect on results, and no fault whatever ``index`` is."""
    if not (
        isinstance(array, types.Array)
        and array.ndim == 1
        and array.layout == "C"
        and isinstance(index, types.Integer)
    ):
        return None
    sig = types.void(array, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte_pointer = ir.IntType(8).as_pointer()
        word = ir.IntType(32)
        kind = ir.FunctionType(ir.VoidType(), [byte_pointer, word, word, word])
        prefetch = builder.module.declare_intrinsic("llvm.prefetch", [byte_pointer], kind)
        at = builder.bitcast(builder.gep(data, [args[1]]), byte_pointer)
        # a write (1), kept in every cache level (3), of data (1)
        builder.call(
            prefetch, [at, ir.Constant(word, 1), ir.Constant(word, 3), ir.Constant(word, 1)]
        )
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _pointer_to(typingctx: Any, address: Any, like: Any) -> Any:
    """The integer ``address`` as a pointer to elements of ``like``'s dtype (an array)."""
    if not (isinstance(address, types.Integer) and isinstance(like, types.Array)):
        return None
    sig = types.CPointer(like.dtype)(address, like)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


# intrinsics are callable in compiled code only; typed Any, as numba's stubs type their
# decorator's result as taking the typing context too
class_masks: Any = _class_masks
deposit: Any = _deposit
popcount: Any = _popcount
deposit_select: Any = _deposit_select
load_be64: Any = _load_be64
mul_high: Any = _mul_high
pointer_to: Any = _pointer_to
prefetch_write: Any = _prefetch_write

__all__ = [
    "BLOCK",
    "CLASSES",
    "TRAILING_ZEROS",
    "class_masks",
    "deposit",
    "deposit_select",
    "fast_deposit",
    "has_deposit",
    "load_be64",
    "mul_high",
    "pointer_to",
    "popcount",
    "prefetch_write",
]
