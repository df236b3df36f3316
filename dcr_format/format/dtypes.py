"""The dtypes the format carries, and their exact-bits integer views."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dcr_format.errors import SchemaError, UnsupportedDtypeError
from dcr_format.format.names import DTYPE_NAMES as DTYPE_NAMES  # re-exported
from dcr_format.format.npviews import UNSIGNED_NP as UNSIGNED_NP  # re-exported


@dataclass(frozen=True)
class DtypeInfo:
    """How one format dtype maps to torch, its width, and its bit-carrying views."""

    name: str  # the format's name (spec/FORMAT.md, "dtype" fields)
    torch_dtype: torch.dtype
    width: int  # bytes per element
    bits_dtype: torch.dtype  # signed integer view of the same width (xor, compare)
    safetensors: str  # the safetensors dtype code of a checkpoint holding this dtype


_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer view of each width that xor and compare work on (signed but for bytes)."""

_SAFETENSORS = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
"""Every dtype the format carries, with its safetensors code; its format name is torch's
(``torch.bfloat16``: ``bfloat16``), its width torch's item size."""

_INFOS = tuple(
    DtypeInfo(
        str(dtype).removeprefix("torch."),
        dtype,
        dtype.itemsize,
        _BITS_DTYPES[dtype.itemsize],
        code,
    )
    for dtype, code in _SAFETENSORS.items()
)

BY_NAME: dict[str, DtypeInfo] = {info.name: info for info in _INFOS}
BY_TORCH: dict[torch.dtype, DtypeInfo] = {info.torch_dtype: info for info in _INFOS}
if tuple(BY_NAME) != DTYPE_NAMES:  # one list of names: the schema validates with that one
    raise ImportError("dcr_format.format.names.DTYPE_NAMES differs from the dtypes mapped here")


def info_for(dtype: torch.dtype | str) -> DtypeInfo:
    """Look up a dtype by torch dtype (user input) or format name (stored input)."""
    if isinstance(dtype, str):
        try:
            return BY_NAME[dtype]
        except KeyError:
            raise SchemaError(
                f"unknown dtype {dtype!r} in stored object; expected one of "
                f"{', '.join(DTYPE_NAMES)}"
            ) from None
    try:
        return BY_TORCH[dtype]
    except KeyError:
        raise UnsupportedDtypeError(
            f"dtype {dtype} cannot be carried bit-exactly; convert the tensor to one of "
            f"{', '.join(DTYPE_NAMES)}"
        ) from None


_BITS_OF: dict[torch.dtype, torch.dtype] = {info.torch_dtype: info.bits_dtype for info in _INFOS}


def bits_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's exact bits as an integer tensor of the same width (no copy)."""
    dtype = tensor.dtype
    bits = _BITS_OF.get(dtype)
    if bits is None:
        bits = info_for(dtype).bits_dtype  # refuses it with the error the format has
    return tensor if dtype == bits else tensor.view(bits)


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.reshape(-1)``, and ``tensor`` itself where it already is one-dimensional
    (a reshape costs about 0.7 us even then, and the writer flattens each tensor several
    times on its way through the diff and the coders)."""
    return tensor if tensor.dim() == 1 else tensor.reshape(-1)


def flat_bits(tensor: torch.Tensor) -> torch.Tensor:
    """:func:`bits_view` of ``tensor``, flat (:func:`flat`)."""
    return flat(bits_view(tensor))


def bits_to_numpy(bits: torch.Tensor) -> np.ndarray:
    """Host numpy array of unsigned integers holding the same bits as an integer tensor."""
    width = bits.element_size()
    if bits.is_cpu and not bits.requires_grad and bits.is_contiguous():  # no copy, no detach
        return bits.numpy().view(UNSIGNED_NP[width])
    return bits.detach().cpu().contiguous().numpy().view(UNSIGNED_NP[width])


def numpy_to_bits(array: np.ndarray, info: DtypeInfo) -> torch.Tensor:
    """Integer torch tensor (``info.bits_dtype``) holding the bits of an unsigned array."""
    signed = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[info.width]
    return torch.from_numpy(np.ascontiguousarray(array).view(signed))
