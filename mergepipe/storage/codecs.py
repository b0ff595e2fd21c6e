"""Compact codecs without numpy (what a request, the CLI and a page name): the codec enum, record sizes and
checks. The record format and the numpy decoder live in storage/compact.py."""

from __future__ import annotations

from enum import Enum

LEVELS = (1, 2, 4)  # bits per entry a plan can read
DEFAULT_GROUP = 128
GROUP_RANGE = (16, 4096)
MAGIC = b"MPCOMPACT1\n\0\0\0\0\0"  # 16 bytes at the start of every compact file


class Codec(str, Enum):
    """What ANALYZE stores (its highest level) and the levels a plan may read from it."""

    SIGN1 = "sign1"
    Q2 = "q2"
    Q4 = "q4"
    PROGRESSIVE = "progressive"

    @property
    def stored_level(self) -> int:
        return {"sign1": 1, "q2": 2, "q4": 4, "progressive": 4}[self.value]

    @property
    def levels(self) -> tuple[int, ...]:
        return {"sign1": (1,), "q2": (2,), "q4": (4,), "progressive": LEVELS}[self.value]

    @property
    def help(self) -> str:
        return {"sign1": "1 bit per entry: sign x the group's mean |delta|",
                "q2": "2 bits: ternary, sign x 0.75 x the group's max |delta| where |delta| >= max/2, else 0",
                "q4": "4 bits: sign x 8 magnitude levels of the group's max |delta|",
                "progressive": "one 4-bit record read at 1, 2 or 4 bits per block, as the planner chooses"}[self.value]


CODECS = tuple(c.value for c in Codec)


def codec(name) -> Codec:
    """The codec named ``name`` (an error line naming the choices otherwise)."""
    from mergepipe.errors import CatalogError
    try:
        return Codec(str(name).lower())
    except ValueError:
        raise CatalogError(f"unknown compact codec {name!r} (choose from {', '.join(CODECS)})") from None


def groups(n: int, group: int) -> int:
    return -(-n // group)


def plane_bytes(n: int) -> int:
    return -(-n // 8)


def level_bytes(n: int, group: int, level: int) -> int:
    """Bytes of a block's record read at ``level`` bits (a prefix of the stored record)."""
    ng, p = groups(n, group), plane_bytes(n)
    one = 2 * ng + p
    return {1: one, 2: 2 * one, 4: 2 * one + 2 * p}[level]


def growth_text(compact_bytes: int, expert_bytes: int) -> str:
    """"+6.6 % of expert bytes" (what ANALYZE and the README state)."""
    pct = 100.0 * compact_bytes / expert_bytes if expert_bytes else 0.0
    return f"+{pct:.1f} % of expert bytes" if pct >= 0.05 or not compact_bytes else f"+{pct:.2g} % of expert bytes"


def check_group(group) -> int:
    from mergepipe.errors import CatalogError
    if isinstance(group, bool) or not isinstance(group, int) or not (GROUP_RANGE[0] <= group <= GROUP_RANGE[1]) \
            or group % 8:
        raise CatalogError(f"--compact-group must be a multiple of 8 in [{GROUP_RANGE[0]}, {GROUP_RANGE[1]}], "
                           f"not {group!r}")
    return group


def bits_per_entry(level: int, group: int) -> float:
    """Bits per delta entry read at ``level`` (planes plus the group scales)."""
    return {1: 1 + 16 / group, 2: 2 + 32 / group, 4: 4 + 32 / group}[level]


# what a merge request's ``compact`` takes: the levels stored (auto), none (off), or a codec's levels
COMPACT_MODES = ("auto", "off", *CODECS)
