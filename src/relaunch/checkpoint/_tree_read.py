"""A snapshot's tree read back (:mod:`~relaunch.checkpoint._tree` writes it): the state
it describes, its tensors allocated, and the byte ranges of the data file that fill
them. :func:`decode` checks every node against the data length and names the path of
the first one that is wrong (CorruptSnapshot); no node of any shape raises anything else.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeGuard

import torch

from relaunch.checkpoint import _numpy
from relaunch.checkpoint._layout import CorruptSnapshot
from relaunch.checkpoint._tree import json_metadata

__all__ = ["Region", "decode", "finish"]

Region = tuple[int, int, torch.Tensor]
"""``(offset, nbytes, target)``: bytes of the data file that go into ``target`` (flat
uint8 over the value's storage)."""


class _Bytes(bytearray):
    """A ``bytes`` leaf while its bytes are read (made ``bytes`` afterwards)."""


def decode(tree: object, size: int, where: str) -> tuple[object, list[Region]]:
    """The state ``tree`` describes, with its tensors allocated (each owns its storage,
    as ``torch.load`` gives them: ``torch.set_rng_state`` and the like need that), and
    the regions of the data file (``size`` bytes) to read into them, by offset. Call
    :func:`finish` once they are read. CorruptSnapshot naming ``where`` and the path
    of the first wrong node."""
    decoder = _Decoder(size, where)
    state = decoder.walk(tree, "")
    regions = sorted(decoder.regions, key=lambda r: r[0])
    for (a, n, _), (b, _m, _t) in itertools.pairwise(regions):
        if a + n > b:
            raise decoder.bad("", f"bytes {a}..{a + n} overlap the next value's at {b}")
    return state, regions


class _Decoder:
    """One walk of a tree for :func:`decode`: the values it makes, the regions of the
    data file (``size`` bytes) that fill them, and the refusal of the first wrong node."""

    def __init__(self, size: int, where: str) -> None:
        self.size = size
        self.where = where
        self.regions: list[Region] = []

    def bad(self, path: str, what: str) -> CorruptSnapshot:
        """The refusal of the node at ``path``."""
        return CorruptSnapshot(f"{self.where}: tree{path}: {what}")

    def span(self, node: list[object], path: str, count: int) -> tuple[int, int]:
        """The byte range ``[..., offset, nbytes]`` that ends ``node`` (``count`` items),
        refused when it is not one or goes past the data's end."""
        offset, nbytes = node[count - 2], node[count - 1]
        if not (_is_int(offset) and _is_int(nbytes)) or offset < 0 or nbytes < 0:
            raise self.bad(path, f"expected a byte range, got {node!r}")
        if offset + nbytes > self.size:
            raise self.bad(
                path, f"bytes {offset}..{offset + nbytes} past the data's end ({self.size})"
            )
        return offset, nbytes

    def walk(self, node: object, path: str) -> object:
        """The value of ``node`` (a one-key object: its kind and what it holds)."""
        if not isinstance(node, dict) or len(node) != 1:
            raise self.bad(path, f"expected a one-key object, got {node!r:.80}")
        ((kind, value),) = node.items()
        if kind == "tensor":
            return self.tensor(value, path)
        if kind == "dict":
            return self.mapping(value, path)
        if kind == "odict":
            return self.ordered(value, path)
        if kind in ("list", "tuple"):
            if not isinstance(value, list):
                raise self.bad(path, f"expected a list, got {value!r:.80}")
            items = [self.walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
            return items if kind == "list" else tuple(items)
        if kind == "bytes":
            return self.raw(value, path)
        if kind == "ndarray":
            array, region = _numpy.decode_array(value, path, self.span, self.bad)
            if region is not None:
                self.regions.append(region)
            return array
        if kind == "npscalar":
            return _numpy.decode_scalar(value, path, self.bad)
        return _plain_value(kind, value, path, self.bad)

    def tensor(self, value: object, path: str) -> torch.Tensor:
        """An empty tensor of the node's dtype and shape; its bytes become a region."""
        if not isinstance(value, list) or len(value) != 5:
            raise self.bad(path, f"expected [dtype, shape, offset, nbytes, device], got {value!r}")
        dtype = getattr(torch, str(value[0]), None)
        if not isinstance(dtype, torch.dtype):
            raise self.bad(path, f"unknown dtype {value[0]!r}")
        shape = value[1]
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise self.bad(path, f"expected a shape, got {shape!r}")
        offset, nbytes = self.span(value, path, 4)
        count = 1
        for d in shape:
            count *= d
        if count * dtype.itemsize != nbytes:
            raise self.bad(path, f"{nbytes} bytes for shape {shape} of {value[0]}")
        try:
            tensor = torch.empty(shape, dtype=dtype)
        except (RuntimeError, TypeError, ValueError, OverflowError, MemoryError) as exc:
            why = str(exc).partition("\n")[0][:120]
            raise self.bad(path, f"shape {shape!r:.80} of {value[0]} ({why})") from exc
        if nbytes:
            self.regions.append((offset, nbytes, tensor.reshape(-1).view(torch.uint8)))
        return tensor

    def ordered(self, value: object, path: str) -> OrderedDict[object, object]:
        """An OrderedDict from ``[pairs, metadata]`` (:func:`~relaunch.checkpoint._tree.json_metadata`)."""
        if not isinstance(value, list) or len(value) != 2:
            raise self.bad(path, f"expected [pairs, metadata], got {value!r:.80}")
        out: OrderedDict[object, object] = OrderedDict()
        self.mapping(value[0], path, out)
        meta = value[1]
        if meta is not None:
            kept = json_metadata(meta)
            if kept is None or kept != meta:
                raise self.bad(path, f"expected a state_dict's _metadata, got {meta!r:.80}")
            out._metadata = OrderedDict(kept)  # type: ignore[attr-defined]
        return out

    def mapping(
        self, value: object, path: str, out: dict[object, object] | None = None
    ) -> dict[object, object]:
        """A dict (``out``, else a new one) from its ``[key, value]`` pairs (keys are
        nodes too)."""
        if not isinstance(value, list):
            raise self.bad(path, "expected a list of [key, value] pairs")
        out = {} if out is None else out
        for pair in value:
            if not isinstance(pair, list) or len(pair) != 2:
                raise self.bad(path, f"expected a [key, value] pair, got {pair!r:.80}")
            key = self.walk(pair[0], f"{path}.key")
            if not isinstance(key, (str, int, float, type(None))):  # bool is an int
                raise self.bad(path, f"a key of type {type(key).__qualname__}")
            out[key] = self.walk(pair[1], f"{path}[{key!r}]")
        return out

    def raw(self, value: object, path: str) -> _Bytes:
        """A ``bytes`` leaf to fill from its region (``[offset, nbytes]``)."""
        if not isinstance(value, list) or len(value) != 2:
            raise self.bad(path, f"expected [offset, nbytes], got {value!r}")
        offset, nbytes = self.span(value, path, 2)
        raw = _Bytes(nbytes)
        if nbytes:
            self.regions.append((offset, nbytes, torch.frombuffer(raw, dtype=torch.uint8)))
        return raw


def finish(state: Any) -> Any:
    """The state :func:`decode` made, once its regions are read: ``bytes`` leaves made
    ``bytes``."""
    if isinstance(state, _Bytes):
        return bytes(state)
    if isinstance(state, dict):  # in place: an OrderedDict stays one, with its _metadata
        for k, v in state.items():
            state[k] = finish(v)
        return state
    if isinstance(state, list):
        state[:] = [finish(v) for v in state]
        return state
    if type(state) is tuple:  # not a torch.Size (a tuple of ints: nothing to finish)
        return tuple(finish(v) for v in state)
    return state


def _plain_value(
    kind: str, value: object, path: str, bad: Callable[[str, str], CorruptSnapshot]
) -> object:
    try:
        if kind == "none" and value is None:
            return None
        if kind == "bool" and isinstance(value, bool):
            return value
        if kind == "int" and isinstance(value, str):
            return int(value)
        if kind == "float" and isinstance(value, str):
            return float.fromhex(value)
        if kind == "str" and isinstance(value, str):
            return value
        if kind == "dtype" and isinstance(getattr(torch, str(value), None), torch.dtype):
            return getattr(torch, str(value))
        if kind == "device" and isinstance(value, str):
            return torch.device(value)
        if kind == "size" and isinstance(value, list) and all(_is_int(d) for d in value):
            return torch.Size(value)
    except (ValueError, RuntimeError) as exc:
        raise bad(path, f"bad {kind} {value!r:.80} ({exc})") from exc
    raise bad(path, f"unknown node {kind!r} with {value!r:.80}")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
