"""The state's tree as JSON, its tensors as byte ranges of one data file (no pickle).

A state is what ``state_dict()`` returns: dicts (keys: str, int, float, bool, None),
lists and tuples of tensors and plain values (int, float, str, bool, None, bytes),
plus ``torch.dtype``, ``torch.device`` and ``torch.Size``, and NumPy arrays and scalars
of bool and numeric dtypes (:mod:`relaunch.checkpoint._numpy`). Anything else is
refused with its key path and type. An ``OrderedDict`` comes back as one, with its
``_metadata`` (what ``state_dict()`` records of each module's version, which a module's
``_load_from_state_dict`` reads: a module that upgrades an older format, as torch's
observers, took a state without it for the oldest one). Each node is a one-key JSON object::

    {"dict": [[key, value], ...]}  {"list": [...]}  {"tuple": [...]}
    {"odict": [[[key, value], ...], metadata]}  (metadata: null, or the ``_metadata``
    as JSON: {prefix: {name: int, float, str, bool or null}})
    {"tensor": [dtype, shape, offset, nbytes, device]}  {"bytes": [offset, nbytes]}
    {"int": "12"}  {"float": "0x1.8p+1"}  {"str": "x"}  {"bool": true}  {"none": null}
    {"dtype": "float32"}  {"device": "cuda:0"}  {"size": [2, 3]}
    {"ndarray": ["<u4", [624], offset, nbytes]}  {"npscalar": ["<f4", "0000c03f"]}

Tensor data is aligned to 64 bytes. Reading a tree back is
:mod:`~relaunch.checkpoint._tree_read`'s.
"""

from __future__ import annotations

import gc
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import torch

from relaunch.checkpoint import _numpy
from relaunch.errors import SnapshotError

__all__ = ["ALIGN", "Leaf", "encode", "flat_bytes", "json_metadata"]

ALIGN = 64


@dataclass(slots=True)
class Leaf:
    """A byte range of the data file and what fills it."""

    offset: int
    nbytes: int
    tensor: torch.Tensor | None = None
    raw: bytes | None = None
    device: Literal["cpu", "cuda", "other"] = "cpu"
    """Where the value is: ``"cpu"`` (bytes too), ``"cuda"`` (copied through pinned
    memory) or ``"other"`` (XPU, MPS: brought to the host by a copy of its own)."""


At = tuple["At", object] | None
"""Where a value is in the state: ``(where its container is, its key or index)``;
None for the state itself. Made a text only for an error (a save's walk of thousands
of tensors spends no time on paths)."""


def _path(at: At) -> str:
    keys: list[object] = []
    while at is not None:
        at, key = at
        keys.append(key)
    return "".join(f"[{key!r}]" for key in reversed(keys))


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def encode(state: object) -> tuple[Any, list[Leaf], int]:
    """(tree, leaves, data length) of ``state``; SnapshotError for an unsupported value.

    It runs on the training thread at each save, so its cost per value is kept low:
    no key path's text unless a value is refused, a tensor's attributes read once,
    ints and strs by their exact type first, and the garbage collector held off
    meanwhile (the walk makes thousands of small containers that all live until the
    snapshot is written: collecting them on the way was wasted work, 1-6 ms of a
    35-43 ms save of 3,200 tensors)."""
    data = _Data()
    collecting = gc.isenabled()
    gc.disable()
    try:
        tree = _walk(state, None, data)
    except RecursionError:
        raise SnapshotError(_too_deep(state)) from None
    finally:
        if collecting:
            gc.enable()
    return tree, data.leaves, data.end


def _too_deep(state: object) -> str:
    """Why the walk of ``state`` ran out of stack: a container that holds itself (its
    key path), or nesting deeper than Python's recursion limit. Looked for only then:
    the walk itself keeps no set of the containers it is in."""
    inside: set[int] = set()
    stack: list[tuple[object, At, bool]] = [(state, None, False)]
    while stack:
        obj, at, leaving = stack.pop()
        if leaving:
            inside.discard(id(obj))
            continue
        if not isinstance(obj, (dict, list, tuple)):
            continue
        if id(obj) in inside:
            return f"state{_path(at)}: a container that holds itself; expected a tree"
        inside.add(id(obj))
        stack.append((obj, at, True))
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        stack.extend((value, (at, key), False) for key, value in items)
    return "the state nests deeper than Python's recursion limit; expected a shallower tree"


class _Data:
    """The data file while the state is walked: its leaves and its length so far."""

    __slots__ = ("end", "leaves")

    def __init__(self) -> None:
        self.leaves: list[Leaf] = []
        self.end = 0

    def place(self, nbytes: int) -> int:
        """The offset of ``nbytes`` more bytes (aligned to :data:`ALIGN`)."""
        offset = -(-self.end // ALIGN) * ALIGN
        self.end = offset + nbytes
        return offset


def _walk(obj: object, at: At, data: _Data) -> Any:
    cls = type(obj)  # ints and strs by their exact type first: a state has thousands
    if cls is int:
        return {"int": str(obj)}
    if cls is str:
        return {"str": obj}
    if isinstance(obj, torch.Tensor):
        return _tensor(obj, at, data)
    if isinstance(obj, dict):
        pairs = [
            [{"str": key} if type(key) is str else _key(key, at), _walk(value, (at, key), data)]
            for key, value in obj.items()
        ]
        if isinstance(obj, OrderedDict):
            return {"odict": [pairs, json_metadata(getattr(obj, "_metadata", None))]}
        return {"dict": pairs}
    if isinstance(obj, torch.Size):
        return {"size": list(obj)}
    if isinstance(obj, (list, tuple)):
        kind = "list" if isinstance(obj, list) else "tuple"
        return {kind: [_walk(v, (at, i), data) for i, v in enumerate(obj)]}
    if isinstance(obj, (bytes, bytearray)):
        offset = data.place(len(obj))
        data.leaves.append(Leaf(offset, len(obj), raw=bytes(obj)))
        return {"bytes": [offset, len(obj)]}
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"device": str(obj)}
    # before _plain: np.float64 is a float; np.str_ is a str, and _plain's
    if type(obj).__module__.partition(".")[0] == "numpy" and not isinstance(obj, str):
        node, array = _numpy.encode_value(obj, _path(at), data.place)
        if array is not None:
            data.leaves.append(Leaf(node["ndarray"][2], array.numel(), tensor=array))
        return node
    return _plain(obj, at)


def json_metadata(meta: object) -> dict[str, dict[str, object]] | None:
    """An OrderedDict's ``_metadata`` as JSON (``state_dict()``'s: each module's prefix
    and what it recorded, its version); None when it has none. What is not plain JSON
    (a hook's tuple or tensor, an int past 64 bits, NaN) is left out, name by name: the
    versions beside it are kept (``load_state_dict`` does without the rest)."""
    if not isinstance(meta, dict):
        return None
    out = {
        prefix: {
            name: value for name, value in entry.items() if type(name) is str and _json_plain(value)
        }
        for prefix, entry in meta.items()
        if type(prefix) is str and isinstance(entry, dict)
    }
    return out or None


def _json_plain(value: object) -> bool:
    """Whether a metadata value goes into the manifest as it is."""
    if value is None or isinstance(value, (bool, str)):
        return True
    if isinstance(value, int):
        return -(2**63) <= value < 2**63
    return isinstance(value, float) and math.isfinite(value)


def _tensor(obj: torch.Tensor, at: At, data: _Data) -> Any:
    if type(obj) is not torch.Tensor and type(obj).__torch_dispatch__ is not _PLAIN_DISPATCH:
        raise SnapshotError(_subclass_refused(obj, at))
    if obj.layout is not torch.strided:
        raise SnapshotError(f"state{_path(at)}: a {obj.layout} tensor; expected a dense one")
    if obj.is_quantized or obj.is_nested or obj.is_meta:
        kind = "quantized" if obj.is_quantized else "nested" if obj.is_nested else "meta"
        raise SnapshotError(
            f"state{_path(at)}: a {kind} tensor; expected a dense one with its data"
        )
    nbytes = obj.numel() * obj.element_size()
    offset = data.place(nbytes)
    if obj.is_cpu:
        data.leaves.append(Leaf(offset, nbytes, obj, None, "cpu"))
        device = "cpu"
    else:
        data.leaves.append(Leaf(offset, nbytes, obj, None, "cuda" if obj.is_cuda else "other"))
        device = str(obj.device)
    return {"tensor": [_dtype_name(obj.dtype), list(obj.shape), offset, nbytes, device]}


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
"""A tensor subclass with a dispatch of its own (a DTensor, a quantized or float8
wrapper) has no bytes of its own to copy: its class says where its data is."""


def _subclass_refused(obj: torch.Tensor, at: At) -> str:
    cls = type(obj)
    if cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed"):
        return (
            f"state{_path(at)}: a DTensor (this rank's shard of a distributed tensor: FSDP2, "
            "tensor parallel); expected a plain tensor: save the state through "
            "torch.distributed.checkpoint with relaunch.checkpoint.dcp.SnapshotWriter, whose "
            "SnapshotReader restores DTensors in place, or save the shard (.to_local())"
        )
    return (
        f"state{_path(at)}: a tensor subclass {cls.__module__}.{cls.__qualname__} with a "
        "dispatch of its own; expected a plain tensor (convert it to one first)"
    )


def _key(key: object, at: At) -> Any:
    if type(key) is int:
        return {"int": str(key)}
    if key is None or isinstance(key, (str, int, float)):
        return _plain(key, at)
    raise SnapshotError(
        f"state{_path(at)}: a key of type {type(key).__qualname__}; "
        "expected str, int, float, bool or None"
    )


def _plain(obj: object, at: At) -> Any:
    if obj is None:
        return {"none": None}
    if isinstance(obj, bool):
        return {"bool": obj}
    if isinstance(obj, int):
        return {"int": str(int(obj))}
    if isinstance(obj, float):
        return {"float": float(obj).hex()}
    if isinstance(obj, str):
        return {"str": obj}
    raise SnapshotError(
        f"state{_path(at)}: a value of type {type(obj).__module__}.{type(obj).__qualname__}; "
        "expected tensors, NumPy arrays, dicts, lists, tuples, int, float, str, bool, bytes "
        "or None"
    )


def flat_bytes(leaf: Leaf) -> torch.Tensor:
    """A CPU leaf's bytes, flat uint8."""
    if leaf.raw is not None:
        return torch.frombuffer(bytearray(leaf.raw), dtype=torch.uint8)
    tensor = leaf.tensor
    assert tensor is not None
    if tensor.requires_grad:
        tensor = tensor.detach()
    return tensor.contiguous().reshape(-1).view(torch.uint8)
