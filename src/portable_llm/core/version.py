"""The package version (one place: the root package and the CLI read it from here)."""

__version__ = "0.1.0"
