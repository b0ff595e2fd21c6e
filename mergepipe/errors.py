"""Exceptions. Every error a user can cause is a MergePipeError: the CLI prints its message on one
line and exits 2, without a traceback, and nothing stored has changed."""


class MergePipeError(Exception):
    """A user-caused error (bad path, corrupt file, bad budget, unknown id, ...)."""

    exit_code = 2


class StorageError(MergePipeError):
    """A checkpoint file is missing, unreadable or not a valid safetensors file."""


class CatalogError(MergePipeError):
    """The catalog does not hold what was asked for, or refuses a change."""


class PlanError(MergePipeError):
    """A plan cannot be made from the given inputs."""


class ExecutionError(MergePipeError):
    """A merge failed; no snapshot was published."""


class VerifyError(MergePipeError):
    """A snapshot does not match its manifest."""

    exit_code = 1
