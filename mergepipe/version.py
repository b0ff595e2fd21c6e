"""The MergePipe version (written into plans and manifests)."""

__version__ = "0.1.0"
