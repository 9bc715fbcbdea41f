"""The package version, in one place (pyproject reads it too)."""

__version__ = "0.1.0"
