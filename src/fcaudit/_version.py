"""The version, in a module that imports nothing (every layer may read it)."""

__version__ = "0.1.0"
