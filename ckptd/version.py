"""ckptd's version, importable without the package's public API (the daemon and CLI name it)."""

__version__ = "0.1.0"
