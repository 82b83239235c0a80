"""Type aliases shared by the package.

``Array`` stands for an array of any supported library (NumPy, torch, MLX, JAX,
array-api-strict). The Array API has no common base class, so it is ``Any`` to the type
checker; the alias is for the reader: a parameter typed ``Array`` takes an array, one typed
``Any`` takes anything else (an option, a namespace, a cache).
"""

from __future__ import annotations

from typing import Any, TypeAlias

__all__ = ["Array", "Namespace"]

#: An array of one of the supported libraries.
Array: TypeAlias = Any
#: An Array API namespace (``xp``).
Namespace: TypeAlias = Any
