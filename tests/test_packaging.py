"""What the installed package ships (tox installs the built wheel, so this checks the wheel)."""

from __future__ import annotations

from importlib import resources


def test_py_typed_is_shipped() -> None:
    """PEP 561: without ``py.typed`` a user's mypy treats the whole API as ``Any``."""
    marker = resources.files("portable_llm").joinpath("py.typed")
    assert marker.is_file()
    assert marker.read_bytes().strip() == b""
