"""Hypothesis strategies shared by every test: shapes ``N.. x D``, float dtypes, seeds."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from portable_llm.backends import get_backend

__all__ = ["float_dtypes", "seeds", "shapes"]


def shapes(
    *, min_dims: int = 1, max_dims: int = 4, max_side: int = 6, last: Any = None, max_last: int = 64
) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes ``N.. x D``: leading sides in ``[1, max_side]``, last side ``last`` or ``[1, max_last]``.

    ``last`` may be an int or a strategy.
    """
    if last is None:
        last = st.integers(1, max_last)
    elif isinstance(last, int):
        last = st.just(last)
    lead = st.lists(st.integers(1, max_side), min_size=min_dims - 1, max_size=max_dims - 1)
    return st.tuples(lead, last).map(lambda t: (*t[0], t[1]))


def float_dtypes(backend: str, device: Any = None) -> st.SearchStrategy[str]:
    """The float dtype names ``backend`` supports on ``device``."""
    return st.sampled_from(get_backend(backend).float_dtypes(device))


def seeds() -> st.SearchStrategy[int]:
    """Seeds for :func:`portable_llm.testing.random_array`."""
    return st.integers(0, 2**32 - 1)
