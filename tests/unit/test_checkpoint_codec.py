"""relaunch.checkpoint's format: the tree codec, the manifest, the saver on real files
(one process, no agent), the size flag."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint import _restores as restores
from relaunch.checkpoint._agree import _why_none
from relaunch.checkpoint._replica import _chosen
from relaunch.checkpoint._saver import Saver, Where
from relaunch.checkpoint._tree import encode
from relaunch.checkpoint._tree_read import decode, finish
from relaunch.cli import parse_args
from relaunch.errors import ConfigError, SnapshotError


def _where(root: Path, **kw: Any) -> Where:
    args: dict[str, Any] = dict(
        root=str(root), job="j", rank=0, world_size=1, keep=2, limit=None, durable=None
    )
    return Where(**{**args, **kw})


def _roundtrip(state: object) -> Any:
    tree, leaves, size = encode(state)
    data = torch.zeros(size, dtype=torch.uint8)
    for leaf in leaves:
        if leaf.raw is not None:
            data[leaf.offset : leaf.offset + leaf.nbytes] = torch.frombuffer(
                bytearray(leaf.raw), dtype=torch.uint8
            )
        elif leaf.nbytes:
            assert leaf.tensor is not None
            flat = leaf.tensor.contiguous().reshape(-1).view(torch.uint8)
            data[leaf.offset : leaf.offset + leaf.nbytes] = flat
    state, regions = decode(json.loads(json.dumps(tree)), size, "here")
    for offset, nbytes, target in regions:
        target.copy_(data[offset : offset + nbytes])
    return finish(state)


def test_every_supported_value_comes_back_equal() -> None:
    state = {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(),  # not contiguous
        "b": torch.tensor([True, False]),
        "h": torch.ones(3, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        7: [1, -(2**70), 0.1, float("inf"), "s", None, True, b"\x00\xff"],
        "t": (torch.float16, torch.device("cpu"), torch.Size([2, 3])),
    }
    back = _roundtrip(state)
    assert torch.equal(back["w"], state["w"]) and back["w"].dtype == torch.float32
    assert torch.equal(back["b"], state["b"]) and torch.equal(back["h"], state["h"])
    assert back["scalar"].shape == () and back["scalar"].item() == 2.5
    assert back["empty"].shape == (0, 4)
    assert back[7] == state[7] and back["t"] == state["t"]
    assert [type(v) for v in back["t"]] == [torch.dtype, torch.device, torch.Size]


def test_numpy_arrays_and_scalars_come_back_with_their_dtypes() -> None:
    rng = np.random.RandomState(7)
    state = {
        "np_rng": rng.get_state(),  # ("MT19937", uint32[624], int, int, float)
        "strided": np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2],
        "big_endian": np.arange(3, dtype=">f8"),
        "zero_d": np.array(1 + 2j, dtype=np.complex64),
        "empty": np.zeros((0, 3), dtype=np.bool_),
        "scalars": [np.float64(0.1), np.float32(1.5), np.int64(-3), np.uint8(255), np.bool_(True)],
        "read_only": np.frombuffer(b"\x01\x02\x03\x04", dtype=np.uint16),
        "np_str": np.str_("a str as well"),
    }
    back = _roundtrip(state)
    assert back["np_str"] == "a str as well"
    for key in ("strided", "big_endian", "zero_d", "empty", "read_only"):
        assert type(back[key]) is np.ndarray and back[key].dtype == state[key].dtype
        assert back[key].shape == state[key].shape and np.array_equal(back[key], state[key])
    for got, want in zip(back["scalars"], state["scalars"], strict=True):
        assert type(got) is type(want) and got == want
    expected = rng.randint(0, 2**31, size=5)
    restored = np.random.RandomState()
    restored.set_state(back["np_rng"])
    assert np.array_equal(restored.randint(0, 2**31, size=5), expected)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (np.array(["a"]), "a NumPy array of dtype '<U1'"),
        (np.array([object()]), "a NumPy array of dtype '|O'"),
        (np.zeros(2, dtype=[("x", "<i4")]), "a NumPy array of dtype"),
        (np.ma.masked_array([1, 2], mask=[0, 1]), "MaskedArray; expected a plain numpy.ndarray"),
        (np.datetime64("2026-01-01"), "a NumPy scalar of dtype '<M8"),
        (np.zeros(2, dtype=np.longdouble), "floats of 8 bytes at most"),
    ],
)
def test_an_unsupported_numpy_value_names_its_key_path_and_dtype(
    value: object, message: str
) -> None:
    with pytest.raises(SnapshotError, match=r"state\['m'\]\[0\]: .*" + re.escape(message)):
        encode({"m": [value]})


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"ndarray": ["<f4", [3], 0, 8]}, "8 bytes for shape"),
        ({"ndarray": ["|O", [1], 0, 8]}, "unknown NumPy dtype"),
        ({"ndarray": ["<f4", [-1], 0, 4]}, "expected a shape"),
        ({"ndarray": ["<f8", [2], 0, 16]}, "past the data's end"),
        ({"npscalar": ["<f4", "00"]}, "expected 4 bytes of <f4"),
        ({"npscalar": ["<f4", "zzzzzzzz"]}, "expected 4 bytes"),
        ({"npscalar": ["nodtype", "00"]}, "unknown NumPy dtype"),
        ({"ndarray": ["<f4", [0, 2**70], 0, 0]}, r"shape \[0, 1180591620717411303424\]"),
        ({"ndarray": ["<f16", [1], 0, 16]}, "unknown NumPy dtype"),
        ({"tensor": ["float32", [0, 2**70], 0, 0, "cpu"]}, "shape"),
        ({"dict": [[{"list": []}, {"none": None}]]}, "a key of type list"),
    ],
)
def test_a_corrupt_numpy_node_names_the_node(tree: object, message: str) -> None:
    with pytest.raises(layout.CorruptSnapshot, match=message):
        decode({"list": [tree]}, 8, "here")


def test_the_saver_writes_and_reads_numpy_arrays(tmp_path: Path) -> None:
    saver = Saver(_where(tmp_path))
    state = {"rng": np.random.RandomState(3).get_state(), "x": np.linspace(0, 1, 1000)}
    saver.save(1, state, blocking=True)
    saver.wait()
    back = saver.read(1)
    assert isinstance(back, dict) and np.array_equal(back["x"], state["x"])
    assert back["rng"][0] == "MT19937" and np.array_equal(back["rng"][1], state["rng"][1])


def test_buffers_the_next_forward_updates_are_snapshotted_as_of_the_save(
    tmp_path: Path,
) -> None:
    """BatchNorm's running statistics change in the next step's forward, which no
    optimizer hook waits for: the snapshot still holds them as of the save (cloned in
    ``save``; the weights, behind 64 MB of them, are copied beside the next step). A
    state no optimizer fences (an average of the weights kept by hand) makes the save
    block instead, with the same result."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 4096), nn.BatchNorm1d(4096))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 4096)).sum().backward()
    optimizer.step()
    saver = Saver(_where(tmp_path))
    try:
        for step in range(1, 4):
            state = {"model": model.state_dict(), "opt": optimizer.state_dict()}
            want = {k: v.clone() for k, v in model.state_dict().items()}
            saver.save(step, state)
            model[1](torch.randn(8, 4096) * 5)  # the next forward, at once
            saver.wait()
            back = saver.read(step)
            assert isinstance(back, dict)
            for key, value in want.items():
                assert torch.equal(back["model"][key], value), key
        average = {"ema": torch.zeros(1 << 22)}
        saver.save(4, average)
        average["ema"].add_(1.0)
        saver.wait()
        back = saver.read(4)
        assert isinstance(back, dict) and not back["ema"].any()
    finally:
        saver.close()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("join", ["torch's", "a reshape each"])
def test_small_values_are_joined_in_runs_and_snapshotted_as_of_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, join: str
) -> None:
    """A model's many small values go to the data file a run of neighbours of one
    dtype at a time (the alignment's zeros between them; a run up to 8 MiB), copied by
    the writer beside the next step. Held back until every value has changed, the
    writer still writes each as it was at ``save``: the optimizer's (its pre-step hook
    waits), and the others, cloned in ``save``, whatever their dtype, layout or
    neighbours. The same without torch's private join (a release that drops it)."""
    from torch import nn

    from relaunch.checkpoint import _fill

    if join == "a reshape each":
        monkeypatch.setattr(_fill, "_flatten", _fill._flatten_each)

    torch.manual_seed(1)
    saver = Saver(_where(tmp_path))  # its hook sees the optimizer step
    release = threading.Event()
    try:
        params = nn.ParameterList(nn.Parameter(torch.randn(64, 64)) for _ in range(1000))  # 16 MB
        optimizer = torch.optim.SGD(params, lr=0.1)
        sum(p.sum() for p in params).backward()
        optimizer.step()
        loose: dict[str, Any] = {f"v{i}": torch.randn(16, 16) for i in range(200)}
        loose.update(
            f64=torch.randn(3, dtype=torch.float64),
            bf16=torch.randn(5, dtype=torch.bfloat16),
            mask=torch.rand(9) > 0.5,
            ints=torch.arange(7),
            strided=torch.randn(6, 4).t(),
            f8=torch.randn(4, 4).to(torch.float8_e4m3fn),
            empty=torch.empty(0),
            scalar=torch.tensor(2.5),
            grad=torch.randn(3, requires_grad=True),
            big=torch.randn(3 << 17),  # 1.5 MB: copied alone, cloned in save too
        )
        state = {"params": list(params), "loose": loose, "raw": b"\x01\x02\x03"}
        want = {k: v.detach().clone() for k, v in loose.items()}
        want_params = [p.detach().clone() for p in params]
        joined: list[int] = []
        join = _fill._join

        def held_join(pieces: list[torch.Tensor], out: torch.Tensor) -> None:
            release.wait(10)  # a save that blocked waits for this one: then it passes first
            joined.append(out.numel() * out.element_size())
            join(pieces, out)

        monkeypatch.setattr(_fill, "_join", held_join)
        for step in (1, 2):  # the second reuses the first's file
            joined.clear()
            saver.save(step, state)
            assert not joined  # not a blocking save: it returned while the writer is held
            with torch.no_grad():
                for value in loose.values():
                    value.fill_(step % 2)
            release.set()
            saver.wait()
            release.clear()
            assert len(joined) > 3 and max(joined) <= 8 << 20  # runs, split at 8 MiB
            back = saver.read(step)
            assert isinstance(back, dict) and back["raw"] == b"\x01\x02\x03"
            for key, value in want.items():
                got = back["loose"][key]
                assert got.dtype == value.dtype and got.shape == value.shape, key
                assert torch.equal(_bytes(got), _bytes(value)), key
            for got, value in zip(back["params"], want_params, strict=True):
                assert torch.equal(got, value)
            want = {k: v.detach().clone() for k, v in loose.items()}
    finally:
        release.set()
        saver.close()


def test_the_fence_clones_only_what_no_optimizer_holds() -> None:
    """The parameters and the state of an optimizer that stepped are left for the copy
    beside the next step (views of them too); a buffer is cloned; before any step,
    or beyond an eighth of the state's bytes, nothing is cloned and the save blocks."""
    from torch import nn

    from relaunch.checkpoint._fence import Fence

    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    fence = Fence()
    state = {"model": model.state_dict(), "view": model[0].weight.detach()[:2]}
    _, leaves, nbytes = encode(state)
    assert fence.secure(leaves, nbytes)  # no optimizer has stepped: block
    fence.saw(optimizer)
    optimizer.step()
    state = {"model": model.state_dict(), "opt": optimizer.state_dict(),
             "view": model[0].weight.detach()[:2]}  # fmt: skip
    _, leaves, nbytes = encode(state)
    before = [leaf.tensor for leaf in leaves]
    assert not fence.secure(leaves, nbytes)
    buffers = {id(b) for b in state["model"].values() if b.data_ptr() in
               {x.data_ptr() for x in model[1].buffers()}}  # fmt: skip
    for old, leaf in zip(before, leaves, strict=True):
        if old is None or not leaf.nbytes:
            continue
        assert (leaf.tensor is not old) == (id(old) in buffers)
        assert leaf.tensor is not None and torch.equal(leaf.tensor, old)
    _, leaves, _ = encode({"ema": torch.zeros(1 << 16), "model": model.state_dict()})
    assert fence.secure(leaves, sum(leaf.nbytes for leaf in leaves))  # too large: block


def test_an_unsupported_value_names_its_key_path_and_type() -> None:
    with pytest.raises(SnapshotError, match=r"state\['opt'\]\['state'\]\[0\]: a value of type"):
        encode({"opt": {"state": [object()]}})
    with pytest.raises(SnapshotError, match="a key of type tuple"):
        encode({(1, 2): 3})
    with pytest.raises(SnapshotError, match="dense"):
        encode({"s": torch.eye(2).to_sparse()})
    with pytest.raises(SnapshotError, match=r"state\['m'\]: a meta tensor"):
        encode({"m": torch.empty(3, device="meta")})
    with warnings.catch_warnings():  # (torch's: a prototype, deprecated)
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
        quantized = torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8)
    with pytest.raises(SnapshotError, match=r"state\[0\]: a nested tensor"):
        encode([nested])
    with pytest.raises(SnapshotError, match=r"state\['q'\]: a quantized tensor"):
        encode({"q": quantized})
    with pytest.raises(SnapshotError, match=r"state\['w'\]: a tensor subclass .*_Wrapped"):
        encode({"w": _Wrapped(torch.zeros(2))})
    encode({"p": torch.nn.Parameter(torch.zeros(2))})  # a subclass of torch's own dispatch


def test_a_state_that_holds_itself_or_nests_too_deep_is_a_clear_error() -> None:
    looped: dict[str, object] = {"w": torch.zeros(1)}
    looped["opt"] = {"param_groups": [{"params": [0]}, looped]}
    with pytest.raises(
        SnapshotError, match=r"state\['opt'\]\['param_groups'\]\[1\]: a container that holds itself"
    ):
        encode(looped)
    deep: list[object] = []
    for _ in range(sys.getrecursionlimit() + 10):
        deep = [deep]
    with pytest.raises(SnapshotError, match="nests deeper than Python's recursion limit"):
        encode(deep)
    shared = [torch.zeros(1)]
    encode({"a": shared, "b": shared})  # the same list twice is no cycle


class _Wrapped(torch.Tensor):
    """A wrapper subclass (as torchao's or float8's): its data is not its storage."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapped:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)  # type: ignore[attr-defined,no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(func)


def test_a_dtensor_is_refused_with_the_way_to_save_it() -> None:
    """An FSDP2 or tensor-parallel state_dict holds DTensors: refused in save(), naming
    the DCP writer that restores them (before: the writer thread failed on torch.cat)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        shard = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)], run_check=False)
        with pytest.raises(SnapshotError, match=r"state\['model'\]\['w'\]: a DTensor .*dcp"):
            encode({"model": {"w": shard}})
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"tensor": ["float32", [4], 0, 16, "cpu"]}, "past the data's end"),
        ({"tensor": ["nofloat", [1], 0, 4, "cpu"]}, "unknown dtype"),
        ({"tensor": ["float32", [3], 0, 8, "cpu"]}, "8 bytes for shape"),
        ({"dict": [[{"str": "a"}]]}, "expected a \\[key, value\\] pair"),
        ({"int": 3}, "unknown node 'int'"),
        ({"list": [{"float": "zz"}]}, r"tree\[0\]: bad float"),
        ({"a": 1, "b": 2}, "one-key object"),
    ],
)
def test_a_corrupt_tree_names_the_node(tree: object, message: str) -> None:
    with pytest.raises(layout.CorruptSnapshot, match=message):
        decode(tree, 8, "here")


def test_a_manifest_is_checked_field_by_field(tmp_path: Path) -> None:
    good = layout.Manifest(job="j", rank=0, world_size=1, step=3, nbytes=0, crc32=0, tree={})
    layout.write_manifest(str(tmp_path), good)
    assert layout.read_manifest(str(tmp_path)) == good
    doc = json.loads((tmp_path / layout.MANIFEST).read_text())
    for key, value, message in [
        ("version", 3, r"version: expected one of \(1, 2\)"),
        ("version", True, r"version: expected one of \(1, 2\), got True"),
        ("step", -1, "step: expected a non-negative int"),
        ("rank", True, "rank: expected int"),
        ("format", "x", "format: expected"),
    ]:
        (tmp_path / layout.MANIFEST).write_text(json.dumps({**doc, key: value}))
        with pytest.raises(layout.CorruptSnapshot, match=message):
            layout.read_manifest(str(tmp_path))


def test_the_saver_keeps_the_newest_and_never_offers_a_partial_one(tmp_path: Path) -> None:
    saver = Saver(_where(tmp_path))
    for step in range(4):
        saver.save(step, {"x": torch.full((10,), float(step))})
    saver.wait()
    assert saver.steps() == [3, 2]
    rank_root = tmp_path / "rank-00000"
    (rank_root / ".partial-step-000000000004-999999").mkdir()  # a killed writer's
    assert saver.steps() == [3, 2]
    assert torch.equal(saver.read(3)["x"], torch.full((10,), 3.0))  # type: ignore[index]
    saver.save(4, {"x": torch.zeros(1)})
    saver.wait()
    assert sorted(p.name for p in rank_root.iterdir()) == [
        "step-000000000003",
        "step-000000000004",
    ]


def _mapped_under(root: Path) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.split(None, 5)[-1].strip() for line in f if str(root) in line]


def test_the_writer_holds_no_memory_of_a_removed_snapshot(tmp_path: Path) -> None:
    """The writer keeps its data files mapped between saves (a reused file costs no page
    faults), but never a removed one: a pruned or discarded snapshot's memory is freed."""
    saver = Saver(_where(tmp_path))
    for step in range(6):
        saver.save(step, {"x": torch.full((1 << 18,), float(step)), "n": step})
        saver.wait()
        mapped = _mapped_under(tmp_path)
        assert not [m for m in mapped if m.endswith("(deleted)")], mapped
        assert len(mapped) <= 2, mapped
    assert torch.equal(saver.read(5)["x"], torch.full((1 << 18,), 5.0))  # type: ignore[index]
    saver.save(6, {"x": torch.ones(1 << 17)})  # another size: the reused file is mapped anew
    saver.wait()
    assert torch.equal(saver.read(6)["x"], torch.ones(1 << 17))  # type: ignore[index]
    assert torch.equal(saver.read(5)["x"], torch.full((1 << 18,), 5.0))  # type: ignore[index]
    saver.discard_newer(None)
    assert saver.steps() == [] and _mapped_under(tmp_path) == []


def test_a_foreign_snapshot_is_refused_and_the_limit_holds(tmp_path: Path) -> None:
    Saver(_where(tmp_path, job="other")).save(1, {"x": torch.zeros(4)})
    mine = Saver(_where(tmp_path))
    mine.wait()
    assert mine.steps() == []  # another job's: refused (one warning)
    small = Saver(_where(tmp_path / "small", limit=1000))
    with pytest.raises(SnapshotError, match="over its limit of 1000"):
        small.save(0, {"x": torch.zeros(1000)})
    assert not os.path.exists(tmp_path / "small" / "rank-00000" / "step-000000000000")


@pytest.mark.parametrize(
    ("text", "size"), [("1000", 1000), ("8G", 8 << 30), ("512MiB", 512 << 20), ("1.5k", 1536)]
)
def test_snapshot_limit_takes_sizes(text: str, size: int, tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    config = parse_args([f"--snapshot-limit={text}", str(script)])
    assert config.snapshot_limit == size


@pytest.mark.parametrize("text", ["0", "-1", "lots", "8X"])
def test_a_bad_snapshot_limit_is_one_clear_error(text: str, tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(ConfigError, match="--snapshot-limit: expected a size in bytes"):
        parse_args([f"--snapshot-limit={text}", str(script)])


def test_restore_records_are_read_strictly(tmp_path: Path) -> None:
    restores.append_restore(str(tmp_path), restores.Restore(1, 29, 30, "memory"))
    with open(tmp_path / restores.RESTORES, "a") as f:
        f.write('{"v":1,"rank":-1,"step":3,"newest":4,"source":"memory"}\n{not json\n')
    restores.append_restore(str(tmp_path), restores.Restore(0, None, 7, None))
    found, bad = restores.read_restores(str(tmp_path))
    assert bad == 2
    assert found == [restores.Restore(1, 29, 30, "memory"), restores.Restore(0, None, 7, None)]
    assert [r.redone for r in found] == [1, 8]


def test_restored_tensors_own_their_storage(tmp_path: Path) -> None:
    # torch.set_rng_state (and torch.save) need a tensor at the start of its own storage
    from relaunch.checkpoint._saver import Saver, Where

    saver = Saver(Where(str(tmp_path), "j", 0, 1, 2, None, None))
    state = {"a": torch.arange(5.0), "rng": torch.random.get_rng_state(), "b": b"xyz"}
    saver.save(3, state, blocking=True)
    saver.wait()
    back = saver.read(3)
    assert isinstance(back, dict) and back["b"] == b"xyz"
    for key in ("a", "rng"):
        assert torch.equal(back[key], state[key])
        assert back[key].storage_offset() == 0
        assert back[key].untyped_storage().nbytes() == state[key].untyped_storage().nbytes()
    torch.random.set_rng_state(back["rng"])


def test_save_outside_relaunch_is_the_same_clear_error_every_time(tmp_path: Path) -> None:
    """No snapshot directory: every save says so (a failed first save once left the
    package's saver slot holding the submodule: the second save was an AttributeError)."""
    import subprocess
    import sys

    script = (
        "from relaunch import checkpoint\n"
        "from relaunch.errors import SnapshotError\n"
        "for _ in range(2):\n"
        "    try:\n"
        "        checkpoint.save(0, {})\n"
        "    except SnapshotError as exc:\n"
        "        print('refused:', exc)\n"
        "checkpoint.wait(); checkpoint.wait_copied()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != layout.ENV_DIR}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all("no snapshot directory" in line for line in lines), lines


def test_a_save_of_an_earlier_step_drops_the_later_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The newest save is the rank's state, whatever its step: a script whose step count
    went back, or a restarted one that did not load its past life's snapshots, must not
    have them outrank what it saves now."""
    past = Saver(_where(tmp_path))
    for step in (7, 8):
        past.save(step, {"x": torch.full((4,), float(step))})
    past.close()
    saver = Saver(_where(tmp_path))  # the rank's next life, which does not load
    saver.save(0, {"x": torch.zeros(4)})
    saver.wait()
    assert saver.steps() == [0]
    assert "saving step 0 after step 8: dropped the snapshots of steps [8, 7]" in caplog.text
    saver.save(5, {"x": torch.ones(4)})
    saver.save(3, {"x": torch.full((4,), 3.0)})  # the same life's count went back
    saver.save(3, {"x": torch.full((4,), 4.0)})  # the same step again: replaced
    saver.wait()
    assert saver.steps() == [3, 0]
    assert torch.equal(saver.read(3)["x"], torch.full((4,), 4.0))  # type: ignore[index]
    saver.close()


def test_a_save_of_an_earlier_step_drops_the_later_durable_copies(tmp_path: Path) -> None:
    """A new allocation's script that does not load: the durable copies of the past
    job's later steps would outrank its saves at its next restore."""
    memory, durable = tmp_path / "memory", tmp_path / "durable"
    past = Saver(_where(memory))
    past.save(9, {"x": torch.ones(4)})
    past.close()
    shutil.copytree(memory / "rank-00000", durable / "rank-00000")  # as the agent copies
    shutil.rmtree(memory)  # every node lost
    saver = Saver(_where(memory, durable=str(durable)))
    saver.save(1, {"x": torch.zeros(4)})
    saver.wait()
    assert not (durable / "rank-00000" / "step-000000000009").exists()
    assert saver.steps() == [1]
    saver.close()


def test_a_save_after_a_fresh_start_keeps_another_layout_s_durable_copies(
    tmp_path: Path,
) -> None:
    """Copies of another world size (refused by load(), kept for a world that comes
    back) are not this layout's later steps: a save of step 0 leaves them."""
    memory, durable = tmp_path / "memory", tmp_path / "durable"
    past = Saver(_where(memory, world_size=4))
    past.save(900, {"x": torch.ones(4)})
    past.close()
    shutil.copytree(memory / "rank-00000", durable / "rank-00000")
    shutil.rmtree(memory)
    saver = Saver(_where(memory, durable=str(durable), world_size=2))
    saver.discard_newer(None)  # load()'s fresh start
    saver.save(0, {"x": torch.zeros(4)})
    saver.wait()
    assert (durable / "rank-00000" / "step-000000000900").exists()
    saver.close()


def test_a_fresh_start_says_why_when_some_rank_held_a_snapshot() -> None:
    """A script that saves on rank 0 only (as a DDP tutorial's torch.save) restores
    nothing: the line says which ranks hold none, in ranges however many there are."""
    offers = [[2, 1], *([[]] * 999)]
    assert _why_none(offers, 2).startswith(
        "ranks 1-999 hold no snapshot, rank 0 does (newest step 2); each rank restores"
    )
    assert _why_none([[], [4], [4], [], [6]], 6).startswith(
        "ranks 0, 3 hold no snapshot, ranks 1-2, 4 do (newest step 6)"
    )
    assert _why_none([[5, 4], [3, 2]], 5) == (
        "no step is held whole by every rank (their newest steps: 3 to 5)"
    )


def test_the_copy_every_rank_restores_is_the_one_most_ranks_read() -> None:
    assert _chosen([None, None]) is None
    assert _chosen([7, None, 9, 9]) == 9
    assert _chosen([None, 7, 9]) == 7  # of equals, the lowest rank's


def test_load_s_replicated_is_a_bool() -> None:
    from relaunch import checkpoint

    with pytest.raises(SnapshotError, match="replicated must be True or False, got 'yes'"):
        checkpoint.load(replicated="yes")  # type: ignore[arg-type]
