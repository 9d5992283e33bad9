"""``torch.distributed.checkpoint`` into the node's snapshots: a storage writer and a
storage reader. Each rank writes and reads back its own items (its shards, for a
sharded model), so the world's layout must be the one that saved.

    import torch.distributed.checkpoint as dcp
    from relaunch.checkpoint.dcp import SnapshotReader, SnapshotWriter

    reader = SnapshotReader()                  # every rank: agrees on the newest step
    if reader.step is not None:
        dcp.load(state_dict, storage_reader=reader)
        start = reader.step + 1
    for step in range(start, steps):
        ...
        dcp.save(state_dict, storage_writer=SnapshotWriter(step))

:class:`SnapshotWriter` hands DCP's planned items of this rank (tensors, and the bytes
DCP makes of other values) and this rank's metadata (the items' sizes, chunks, dtypes,
the planner's data; versioned, no pickle) to ``relaunch.checkpoint.save``: node
memory, a copy on a peer node, durable copies. :class:`SnapshotReader` takes the newest
step every rank holds whole (``relaunch.checkpoint.load``) and serves DCP's reads from
it. A half-written snapshot is never read.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from relaunch import checkpoint
from relaunch.checkpoint._formats import restored_as, tagged
from relaunch.errors import SnapshotError

__all__ = ["SnapshotReader", "SnapshotWriter"]

FORMAT = "relaunch.dcp"
VERSION = 1


class SnapshotWriter(StorageWriter):
    """Writes one ``dcp.save`` as this rank's snapshot of ``step``."""

    def __init__(self, step: int) -> None:
        super().__init__()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise SnapshotError(f"SnapshotWriter: step must be a non-negative int, got {step!r}")
        self.step = step
        self._planned: list[Any] = []

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._planned = list(plan.items)  # before DCP drops replicated items on all ranks but one
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        items: list[Any] = []
        results = []
        tensors: dict[str, dict[str, Any]] = {}
        blobs: list[str] = []
        storage: list[list[Any]] = []
        final = {item.index for item in plan.items}
        # every item of this rank's state: each rank restores its own, replicated ones too
        dropped = [i for i in self._planned if i.index not in final]
        for item in [*plan.items, *dropped]:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                value: Any = data.getvalue()
                blobs.append(item.index.fqn)
                nbytes = len(value)
            else:
                assert isinstance(data, torch.Tensor) and item.tensor_data is not None
                value = data.detach()
                nbytes = value.numel() * value.element_size()
                td = item.tensor_data
                entry = tensors.setdefault(
                    item.index.fqn,
                    {
                        "dtype": td.properties.dtype,
                        "requires_grad": td.properties.requires_grad,
                        "size": td.size,
                        "chunks": [],
                    },
                )
                entry["chunks"].append([td.chunk.offsets, td.chunk.sizes])
            storage.append([item.index.fqn, item.index.offset, item.index.index, len(items)])
            if item.index in final:
                results.append(
                    WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=len(items))
                )
            items.append(value)
        metadata = {"tensors": tensors, "bytes": blobs, "storage": storage,
                    "planner_data": plan.planner_data}  # fmt: skip
        checkpoint.save(self.step, tagged(FORMAT, VERSION, metadata=metadata, items=items))
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass  # every rank's snapshot holds its own metadata

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


class SnapshotReader(StorageReader):
    """The newest step every rank holds whole, for ``dcp.load`` (``step`` None: none).
    Every rank constructs it at the same point: the ranks agree over the default
    process group."""

    def __init__(self) -> None:
        super().__init__()
        restored = restored_as(checkpoint.load(), FORMAT, VERSION, "dcp.SnapshotWriter")
        self.step: int | None = None
        self._items: list[Any] = []
        self._metadata: Metadata | None = None
        if restored is None:
            return
        step, snap = restored
        self.step, self._items = step, snap["items"]
        self._metadata = _metadata(snap["metadata"], len(self._items))

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            raise SnapshotError("no snapshot to load (SnapshotReader.step is None)")
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *a: Any, **k: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self._metadata is not None
        where = self._metadata.storage_data
        for req in plan.items:
            stored = self._items[where[req.storage_index]]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(stored))
                continue
            for dim, (offset, length) in enumerate(
                zip(req.storage_offsets, req.lengths, strict=True)
            ):
                if offset != 0 or length != stored.size(dim):
                    stored = stored.narrow(dim, offset, length)
            target = planner.resolve_tensor(req).detach()
            if target.size() != stored.size():
                raise SnapshotError(
                    f"{req.storage_index.fqn}: the snapshot holds {tuple(stored.size())}, the "
                    f"state expects {tuple(target.size())} (another layout?)"
                )
            target.copy_(stored)
            planner.commit_tensor(req, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def _metadata(doc: Any, count: int) -> Metadata:
    """DCP's Metadata from the snapshot's; SnapshotError naming what is wrong."""
    try:
        sd: dict[str, Any] = {}
        for fqn, t in doc["tensors"].items():
            chunks = [
                ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                for o, s in t["chunks"]
            ]
            props = TensorProperties(dtype=t["dtype"], requires_grad=bool(t["requires_grad"]))
            sd[fqn] = TensorStorageMetadata(
                properties=props, size=torch.Size(t["size"]), chunks=chunks
            )
        for fqn in doc["bytes"]:
            sd[fqn] = BytesStorageMetadata()
        storage = {}
        for fqn, offset, index, at in doc["storage"]:
            if not isinstance(at, int) or not 0 <= at < count:
                raise SnapshotError(f"storage of {fqn!r}: item {at!r} of {count}")
            key = MetadataIndex(fqn, None if offset is None else torch.Size(offset), index)
            storage[key] = at
        return Metadata(
            state_dict_metadata=sd, planner_data=doc["planner_data"], storage_data=storage
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotError(f"the snapshot's DCP metadata is not one: {exc!r}") from exc
