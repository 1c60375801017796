"""The package's version, which a client and its pool must share; no internal imports."""

__version__ = "0.2.0"
