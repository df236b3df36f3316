"""The dtypes the format carries, and their exact-bits integer views."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dcr_format.errors import SchemaError, UnsupportedDtypeError


@dataclass(frozen=True)
class DtypeInfo:
    """How one format dtype maps to torch, its width, and its bit-carrying views."""

    name: str  # the format's name (spec/FORMAT.md, "dtype" fields)
    torch_dtype: torch.dtype
    width: int  # bytes per element
    bits_dtype: torch.dtype  # signed integer view of the same width (xor, compare)
    safetensors: str  # the safetensors dtype code of a checkpoint holding this dtype


_INFOS = (
    DtypeInfo("bool", torch.bool, 1, torch.uint8, "BOOL"),
    DtypeInfo("uint8", torch.uint8, 1, torch.uint8, "U8"),
    DtypeInfo("int8", torch.int8, 1, torch.uint8, "I8"),
    DtypeInfo("int16", torch.int16, 2, torch.int16, "I16"),
    DtypeInfo("int32", torch.int32, 4, torch.int32, "I32"),
    DtypeInfo("int64", torch.int64, 8, torch.int64, "I64"),
    DtypeInfo("float16", torch.float16, 2, torch.int16, "F16"),
    DtypeInfo("bfloat16", torch.bfloat16, 2, torch.int16, "BF16"),
    DtypeInfo("float32", torch.float32, 4, torch.int32, "F32"),
    DtypeInfo("float64", torch.float64, 8, torch.int64, "F64"),
    DtypeInfo("float8_e4m3fn", torch.float8_e4m3fn, 1, torch.uint8, "F8_E4M3"),
    DtypeInfo("float8_e5m2", torch.float8_e5m2, 1, torch.uint8, "F8_E5M2"),
)

BY_NAME: dict[str, DtypeInfo] = {info.name: info for info in _INFOS}
BY_TORCH: dict[torch.dtype, DtypeInfo] = {info.torch_dtype: info for info in _INFOS}
DTYPE_NAMES: tuple[str, ...] = tuple(BY_NAME)

# numpy unsigned views of each width, used by the host-side stream codecs
UNSIGNED_NP: dict[int, np.dtype[Any]] = {
    1: np.dtype("<u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}


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


def bits_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's exact bits as an integer tensor of the same width (no copy)."""
    info = info_for(tensor.dtype)
    if tensor.dtype == info.bits_dtype:
        return tensor
    return tensor.view(info.bits_dtype)


def bits_to_numpy(bits: torch.Tensor) -> np.ndarray:
    """Host numpy array of unsigned integers holding the same bits as an integer tensor."""
    width = bits.element_size()
    return bits.detach().cpu().contiguous().numpy().view(UNSIGNED_NP[width])


def numpy_to_bits(array: np.ndarray, info: DtypeInfo) -> torch.Tensor:
    """Integer torch tensor (``info.bits_dtype``) holding the bits of an unsigned array."""
    signed = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[info.width]
    return torch.from_numpy(np.ascontiguousarray(array).view(signed))
