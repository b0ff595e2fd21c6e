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


def brief(value, limit: int = 80) -> str:
    """A repr of ``value`` for an error message, about ``limit`` characters at most. It looks at a few
    items of a few levels only, so a huge or alias-expanded value (a YAML list of lists of 10^9 leaves)
    costs microseconds, never the whole repr."""
    if isinstance(value, str):
        return repr(value[:limit]) + ("..." if len(value) > limit else "")
    text = _BRIEF.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _brief_repr():
    import reprlib

    class Brief(reprlib.Repr):
        def repr_int(self, x, level):  # reprlib calls repr() first: an int of 4,300+ digits raises
            if x.bit_length() <= 128:
                return repr(x)
            return f"<an integer of about {int(x.bit_length() * 0.30103) + 1} digits>"

        def repr_bytes(self, x, level):
            return repr(x[:self.maxstring]) + ("..." if len(x) > self.maxstring else "")

    r = Brief()
    r.maxlevel, r.maxstring, r.maxother, r.maxlong = 2, 40, 40, 40
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = r.maxfrozenset = r.maxdeque = r.maxarray = 4
    return r


_BRIEF = _brief_repr()
