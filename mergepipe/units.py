"""Byte counts as people read them: binary units everywhere (CLI, dashboard, EXPLAIN, model cards)."""


def human_bytes(n) -> str:
    """1536 -> '1.50 KiB'; None -> '-'."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
