"""How to install an extra, in the one form that works today: from a clone of the repository
(portable_llm is not on a package index yet), with the pinned versions of ``constraints.txt``.

Every message that tells the user to install something (a missing backend, the server, jinja2,
huggingface_hub) takes its command from :func:`install_hint`. This module imports nothing of
the package, so every layer may use it.
"""

from __future__ import annotations

__all__ = ["install_hint"]


def install_hint(*extras: str) -> str:
    """The command that installs ``extras`` (none: the package alone), run in a clone of
    portable_llm: ``pip install -c constraints.txt -e '.[serve]' (in a clone of portable_llm)``."""
    target = f"'.[{','.join(extras)}]'" if extras else "."
    return f"pip install -c constraints.txt -e {target} (in a clone of portable_llm)"
