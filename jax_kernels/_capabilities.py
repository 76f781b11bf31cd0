"""``capabilities()``: what this build provides, one row per (op, pass, dtype, platform)."""

from __future__ import annotations

from typing import NamedTuple

from . import _ffi

_DTYPES = (("float16", "float32"), ("bfloat16", "float32"), ("float32", "float32"),
           ("float64", "float64"))


class Capability(NamedTuple):
    op: str
    pass_: str
    dtype: str
    platform: str
    deterministic: str
    accumulator: str
    backend: str
    target: str


class Capabilities(list):
    """A list of :class:`Capability` rows that prints as a table."""

    def __str__(self) -> str:
        header = ("op", "pass", "dtype", "platform", "deterministic", "accumulator", "backend")
        rows = [header] + [tuple(r)[:7] for r in self]
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
        lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def capabilities() -> Capabilities:
    """The built kernels: for every FFI target and dtype, its op, pass, platform, whether it is
    bitwise deterministic, the accumulation type and the implementation."""
    table = Capabilities()
    for platform, records in _ffi.records().items():
        for target, op, pass_, backend, determinism in sorted(records, key=lambda r: (r[1], r[0])):
            for dtype, accumulator in _DTYPES:
                table.append(Capability(op, pass_, dtype, platform, determinism, accumulator,
                                        backend, target))
    return table
