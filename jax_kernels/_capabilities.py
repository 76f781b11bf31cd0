"""``capabilities()``: what this build provides, one row per (op, pass, dtype, platform)."""

from __future__ import annotations

from typing import NamedTuple

from . import _ffi

_DTYPES = (("float16", "float32"), ("bfloat16", "float32"), ("float32", "float32"),
           ("float64", "float64"))
_ATOMICS_IF_ASKED = "bitwise (deterministic=True); atomics otherwise for float32/float64"
# What the half-type rows of such a pass say: the op takes the ordered path for them whatever
# the flag (they have no fast atomics and accumulate in float32).
_HALF_TYPES_ORDERED = "bitwise (half types always take the ordered path)"


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
    """A list of :class:`Capability` rows. It prints as a compact table of the op passes and
    their determinism per platform, or, built with ``full=True``, as one line per row."""

    def __init__(self, rows=(), full: bool = False, gpu: str = "") -> None:
        super().__init__(rows)
        self.full = full
        self.gpu = gpu

    def __str__(self) -> str:
        return self._full_table() if self.full else self._summary()

    def _full_table(self) -> str:
        header = ("op", "pass", "dtype", "platform", "deterministic", "accumulator", "backend")
        return _table(header, [tuple(r)[:7] for r in self])

    def _summary(self) -> str:
        platforms = sorted({r.platform for r in self})
        passes: dict[tuple[str, str], dict[str, str]] = {}
        for r in self:
            determinism = "bitwise*" if r.deterministic == _ATOMICS_IF_ASKED else r.deterministic
            passes.setdefault((r.op, r.pass_), {})[r.platform] = determinism
        rows = [(op, pass_, *(by.get(p, "-") for p in platforms))
                for (op, pass_), by in passes.items()]
        cuda = ("CUDA module built" + (f", GPU: {self.gpu}" if self.gpu else ", no GPU visible")
                if _ffi.CUDA_BUILT else "CUDA module not built")
        lines = [f"jax_kernels on this machine: CPU module; {cuda}.",
                 _table(("op", "pass", *platforms), rows),
                 "Every pass takes float16 and bfloat16 (accumulated in float32), float32 and "
                 "float64."]
        if any(r.deterministic == _ATOMICS_IF_ASKED for r in self):
            lines.append("* float32/float64 may use atomics when called with deterministic=False.")
        lines.append("capabilities(full=True) lists every target, dtype and implementation.")
        return "\n".join(lines)


def _table(header, rows) -> str:
    rows = [header] + list(rows)
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def capabilities(full: bool = False) -> Capabilities:
    """The built kernels: for every FFI target and dtype, its op, pass, platform, whether it is
    bitwise deterministic, the accumulation type and the implementation. Prints as a compact
    summary (op passes and their determinism per platform); ``full=True`` prints every row."""
    table = Capabilities(full=full, gpu=_gpu_name())
    for platform, records in _ffi.records().items():
        for target, op, pass_, backend, determinism in sorted(records, key=lambda r: (r[1], r[0])):
            for dtype, accumulator in _DTYPES:
                row_determinism = (_HALF_TYPES_ORDERED if determinism == _ATOMICS_IF_ASKED and
                                   accumulator != dtype else determinism)
                table.append(Capability(op, pass_, dtype, platform, row_determinism, accumulator,
                                        backend, target))
    return table


def _gpu_name() -> str:
    if not _ffi.CUDA_BUILT:
        return ""
    import jax

    try:
        devices = jax.devices("cuda")
    except RuntimeError:  # no CUDA backend or no GPU
        return ""
    return f"{len(devices)} x {devices[0].device_kind}" if devices else ""
