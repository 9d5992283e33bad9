"""NumPy values in a snapshot's tree, without pickle: arrays as byte ranges of the data
file, scalars inline.

Nodes (see :mod:`relaunch.checkpoint._tree`)::

    {"ndarray": [dtype, shape, offset, nbytes]}   {"npscalar": [dtype, hex bytes]}

``dtype`` is NumPy's ``dtype.str`` (``"<f8"``, ``"|b1"``, ``">i4"``): the byte order
is kept, so an array comes back with the dtype it was saved with. Only bool and numeric
dtypes (kinds ``b i u f c``) are stored, floats of 8 bytes at most (``longdouble``'s
bytes differ between platforms); strings, objects, records and dates are refused with
the value's key path, as other unsupported values are. A NumPy string scalar is a
``str`` and is stored as one. What this is for:
``np.random.get_state()``, metrics and data-loader positions kept as NumPy values in a
training state. An array shares no storage with an optimizer, so ``save`` clones it
(or blocks, for a large one: :mod:`relaunch.checkpoint._fence`) before it returns.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from relaunch.checkpoint._layout import CorruptSnapshot
from relaunch.errors import SnapshotError

__all__ = ["decode_array", "decode_scalar", "encode_value"]

_KINDS = "biufc"
"""The dtype kinds stored: bool, signed and unsigned integers, floats, complex."""

Place = Callable[[int], int]
"""Reserves ``nbytes`` of the data file; returns their offset."""


def encode_value(obj: object, path: str, place: Place) -> tuple[Any, torch.Tensor | None]:
    """The tree node of a NumPy array or scalar, and for an array its bytes (a flat uint8
    tensor over its memory, or over a contiguous copy); SnapshotError for a value of
    another NumPy type or dtype."""
    if isinstance(obj, np.generic):
        _check_dtype(obj.dtype, path, "scalar")
        return {"npscalar": [obj.dtype.str, obj.tobytes().hex()]}, None
    if type(obj) is not np.ndarray and type(obj) is not np.memmap:
        raise SnapshotError(
            f"state{path}: a value of type {type(obj).__module__}.{type(obj).__qualname__}; "
            "expected a plain numpy.ndarray (or a NumPy scalar)"
        )
    array: np.ndarray[Any, Any] = obj
    _check_dtype(array.dtype, path, "array")
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    if not flat.flags.writeable:  # torch.from_numpy warns of a read-only array
        flat = flat.copy()
    offset = place(flat.nbytes)
    node = {"ndarray": [array.dtype.str, list(array.shape), offset, flat.nbytes]}
    return node, torch.from_numpy(flat)


def _stored(dtype: np.dtype[Any]) -> bool:
    """Whether values of ``dtype`` are stored: bool and numeric, of a layout that is the
    same everywhere (not ``longdouble``, whose bytes differ between platforms)."""
    wide = {"f": 8, "c": 16}.get(dtype.kind, 8)
    return dtype.kind in _KINDS and dtype.fields is None and dtype.itemsize <= wide


def _check_dtype(dtype: np.dtype[Any], path: str, what: str) -> None:
    if not _stored(dtype):
        raise SnapshotError(
            f"state{path}: a NumPy {what} of dtype {dtype.str!r}; expected a bool or "
            "numeric dtype (kinds b, i, u, f, c; floats of 8 bytes at most)"
        )


def _dtype(text: object, path: str, bad: Callable[[str, str], CorruptSnapshot]) -> np.dtype[Any]:
    try:
        dtype = np.dtype(str(text)) if isinstance(text, str) else None
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or not _stored(dtype):
        raise bad(path, f"unknown NumPy dtype {text!r:.40}")
    return dtype


def decode_array(
    value: object,
    path: str,
    span: Callable[[list[object], str, int], tuple[int, int]],
    bad: Callable[[str, str], CorruptSnapshot],
) -> tuple[np.ndarray[Any, Any], tuple[int, int, torch.Tensor] | None]:
    """An empty array of the node's dtype and shape, and the region of the data file
    that fills it: ``(offset, nbytes, flat uint8 tensor over its memory)``, None for no
    bytes."""
    if not isinstance(value, list) or len(value) != 4:
        raise bad(path, f"expected [dtype, shape, offset, nbytes], got {value!r:.80}")
    dtype = _dtype(value[0], path, bad)
    shape = value[1]
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise bad(path, f"expected a shape, got {shape!r:.80}")
    offset, nbytes = span(value, path, 4)
    if math.prod(shape) * dtype.itemsize != nbytes:
        raise bad(path, f"{nbytes} bytes for shape {shape} of {dtype.str}")
    try:
        array = np.empty(shape, dtype=dtype)
    except (TypeError, ValueError, OverflowError, MemoryError) as exc:  # numpy cannot
        why = str(exc).partition("\n")[0][:120]
        raise bad(path, f"shape {shape!r:.80} of {dtype.str} ({why})") from exc
    if not nbytes:
        return array, None
    return array, (offset, nbytes, torch.from_numpy(array.reshape(-1).view(np.uint8)))


def decode_scalar(value: object, path: str, bad: Callable[[str, str], CorruptSnapshot]) -> object:
    """The NumPy scalar of a ``npscalar`` node."""
    if not isinstance(value, list) or len(value) != 2 or not isinstance(value[1], str):
        raise bad(path, f"expected [dtype, hex bytes], got {value!r:.80}")
    dtype = _dtype(value[0], path, bad)
    try:
        raw = bytes.fromhex(value[1])
    except ValueError:
        raw = b""
    if len(raw) != dtype.itemsize:
        raise bad(path, f"expected {dtype.itemsize} bytes of {dtype.str}, got {value[1]!r:.40}")
    return np.frombuffer(raw, dtype=dtype)[0]
