"""record() in-process: return values, propagation of ChildFailedError subclasses."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaunch.errors import (
    ChildFailedError,
    ErrorRecord,
    ProcessFailure,
    build_error_data,
    read_error_file,
    record,
    write_error_file,
)


class TrainerFailed(ChildFailedError):
    """A subclass is propagated like ChildFailedError itself."""


def test_return_value_and_metadata_preserved(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)

    @record
    def add(a: int, b: int = 1) -> int:
        """Adds."""
        return a + b

    assert add(2, b=3) == 5
    assert add.__name__ == "add" and add.__doc__ == "Adds."


def test_subclass_of_child_failed_error_copies_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    child = str(tmp_path / "child.json")
    try:
        raise OSError("disk")
    except OSError as exc:
        write_error_file(child, build_error_data(exc))
    own = tmp_path / "own.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(own))

    @record
    def nanny() -> None:
        raise TrainerFailed("trainer", {0: ProcessFailure(0, 1, 1, child)})

    with pytest.raises(TrainerFailed):
        nanny()
    assert own.read_bytes() == Path(child).read_bytes()


def test_child_without_error_file_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = tmp_path / "own.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(own))

    @record
    def nanny() -> None:
        raise ChildFailedError("trainer", {0: ProcessFailure(0, 1, -9, "<N/A>")})

    with pytest.raises(ChildFailedError):
        nanny()
    assert not own.exists()


def test_exception_is_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    own = tmp_path / "own.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(own))

    @record
    def main() -> None:
        raise ZeroDivisionError("division by zero")

    with pytest.raises(ZeroDivisionError):
        main()
    result = read_error_file(str(own))
    assert isinstance(result, ErrorRecord)
    assert result.message == "ZeroDivisionError: division by zero"
