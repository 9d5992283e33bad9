"""A ``state_dict()`` comes back as ``torch.save`` would give it: an OrderedDict with
its ``_metadata`` (each module's version), which ``load_state_dict`` reads."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.ao.quantization.observer import MinMaxObserver

from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint._saver import Saver, Where
from relaunch.checkpoint._tree_read import decode


def _saver(root: Path) -> Saver:
    return Saver(
        Where(root=str(root), job="j", rank=0, world_size=1, keep=2, limit=None, durable=None)
    )


def _saved_and_read(root: Path, state: object) -> Any:
    saver = _saver(root)
    try:
        saver.save(1, state, blocking=True)
        saver.wait()
        return saver.read(1)
    finally:
        saver.close()


def test_a_state_dict_comes_back_ordered_with_each_module_s_version(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    observer = MinMaxObserver(eps=1e-3)  # its version tells it where eps is kept
    state = {"model": model.state_dict(), "observer": observer.state_dict(), "step": 4}
    back = _saved_and_read(tmp_path, state)
    assert type(back) is dict  # a plain dict stays one
    for key in ("model", "observer"):
        assert type(back[key]) is collections.OrderedDict
        assert list(back[key]) == list(state[key])
        assert back[key]._metadata == state[key]._metadata
    fresh = MinMaxObserver(eps=1e-3)
    fresh.load_state_dict(back["observer"])
    # without the version the observer took the state for its oldest format and set
    # eps to float32's epsilon
    assert fresh.eps.item() == pytest.approx(1e-3)
    other = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    other.load_state_dict(back["model"])
    for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_metadata_that_is_not_plain_json_is_left_out_name_by_name(tmp_path: Path) -> None:
    odd: collections.OrderedDict[str, object] = collections.OrderedDict(a=1)
    odd._metadata = {"": object()}  # type: ignore[attr-defined]
    mixed: collections.OrderedDict[str, object] = collections.OrderedDict(b=2)
    mixed._metadata = {  # type: ignore[attr-defined]
        "": {"version": 1, "hook": (1, 2), "big": 10**30, "nan": float("nan")},
        "junk": "x",
        "m": {"version": 2, "note": "kept"},
    }
    plain = collections.OrderedDict(c=3)
    back = _saved_and_read(tmp_path, {"odd": odd, "mixed": mixed, "plain": plain})
    assert back["odd"] == {"a": 1} and type(back["odd"]) is collections.OrderedDict
    assert not hasattr(back["odd"], "_metadata")
    assert back["mixed"]._metadata == {"": {"version": 1}, "m": {"version": 2, "note": "kept"}}
    assert not hasattr(back["plain"], "_metadata")


def test_a_snapshot_of_the_first_format_is_still_read(tmp_path: Path) -> None:
    """Version 1 manifests (plain dicts only) were written before ``odict`` nodes."""
    saver = _saver(tmp_path)
    try:
        saver.save(1, {"w": torch.arange(4.0), "n": {"k": 1}}, blocking=True)
        saver.wait()
        folder = layout.step_dir(layout.rank_dir(str(tmp_path), 0), 1)
        path = Path(folder) / layout.MANIFEST
        path.write_text(json.dumps({**json.loads(path.read_text()), "version": 1}))
        back = saver.read(1)
    finally:
        saver.close()
    assert isinstance(back, dict)
    assert torch.equal(back["w"], torch.arange(4.0)) and back["n"] == {"k": 1}


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"odict": [[]]}, r"expected \[pairs, metadata\]"),
        ({"odict": [[], {"": 3}]}, "expected a state_dict's _metadata"),
        ({"odict": [[], {"": {"version": [1]}}]}, "expected a state_dict's _metadata"),
        ({"odict": [[], {"": {"version": 10**30}}]}, "expected a state_dict's _metadata"),
        ({"odict": [[[{"str": "a"}]], None]}, r"expected a \[key, value\] pair"),
    ],
)
def test_a_corrupt_ordered_dict_node_names_the_node(tree: object, message: str) -> None:
    with pytest.raises(layout.CorruptSnapshot, match=message):
        decode(tree, 8, "here")
