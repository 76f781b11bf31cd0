"""The one place that touches the native modules and ``jax.ffi``.

Imports ``jax_kernels._cpu`` (always built) and ``jax_kernels._cuda`` (built when a CUDA toolkit
was found), registers every FFI target for platform ``"cpu"`` and, when the CUDA module exists,
``"CUDA"``; when it does not, every target name is registered for ``"CUDA"`` with a stand-in
handler whose error says how to reinstall with CUDA. The op modules build their custom calls
through :func:`call` (and :func:`call_with_cuda_scratch` where the CUDA kernels need temporary
memory, the one place that chooses by platform), size scratch with :func:`query`, and take the
codes of enum attributes from :data:`ENUMS` (exported by the native module, so that the codes are
written once, in C++).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp

try:
    from . import _cpu
except ImportError as error:  # e.g. the source tree imported in place of an installed package
    raise ImportError(
        f"jax_kernels: the native module jax_kernels._cpu is not built next to {__file__}. "
        "If jax_kernels is installed (pip install .), you are importing the source tree instead: "
        "run from another directory, or install in editable mode (pip install -e .); for a "
        "development build in place: tools/build_inplace.sh") from error

try:
    from . import _cuda
except ImportError:  # built without CUDA
    _cuda = None

CUDA_BUILT = _cuda is not None

#: What :func:`query` returns for a problem whose sizes no 64-bit integer describes (possible in a
#: shape traced with ``jax.eval_shape`` or ``jax.export``, which allocates nothing); the op raises
#: a ValueError. A query's own refusals are -1.
SIZE_OVERFLOW: int = _cpu.size_overflow

#: ``{enum: {name: code}}`` of the enum attributes and query arguments (e.g.
#: ``ENUMS["GridSampleMode"]["bilinear"]``), as the C++ headers define them.
ENUMS: dict[str, dict[str, int]] = {name: dict(codes) for name, codes in _cpu.enums.items()}


#: The version of every FFI target, part of its registered name (``jk_lerp_fwd_v1``): programs
#: serialized with ``jax.export`` name the targets they call, and a target keeps its name, its
#: attributes and its semantics for the whole major version of the package. A change to any of
#: them registers a new version next to the old one (XLA's typed FFI has no optional
#: attributes, so an attribute is never added to an existing version).
TARGET_VERSION = 1


def target_name(name: str) -> str:
    """The registered name of the target of pass ``name`` (e.g. ``jk_lerp_fwd``)."""
    return f"{name}_v{TARGET_VERSION}"


def _register() -> None:
    cpu_targets = _cpu.registrations()
    for name, capsule in cpu_targets.items():
        jax.ffi.register_ffi_target(target_name(name), capsule, platform="cpu")
    if _cuda is not None:
        for name, capsule in _cuda.registrations().items():
            jax.ffi.register_ffi_target(target_name(name), capsule, platform="CUDA")
    else:
        missing = _cpu.cuda_module_missing_handler()
        for name in cpu_targets:
            jax.ffi.register_ffi_target(target_name(name), missing, platform="CUDA")


_register()


def targets() -> list[str]:
    """The registered names of every target (on every platform)."""
    return sorted(target_name(name) for name in _cpu.registrations())


def records() -> dict[str, list[tuple[str, str, str, str, str]]]:
    """Per platform, the (registered target, op, pass, backend, determinism) records of the
    built targets."""
    out = {"cpu": [(target_name(r[0]),) + tuple(r[1:]) for r in _cpu.records()]}
    if _cuda is not None:
        out["cuda"] = [(target_name(r[0]),) + tuple(r[1:]) for r in _cuda.records()]
    return out


def query(name: str, platform: str = "cuda", **arguments: Any) -> int:
    """Calls host function ``name`` of the ``platform`` module with named integer arguments (e.g.
    the scratch bytes a CUDA pass needs for a problem). Raises RuntimeError when that module was
    not built, ValueError for a missing or unknown argument."""
    module = _cuda if platform == "cuda" else _cpu
    if module is None:
        raise RuntimeError(f"jax_kernels: the {platform} module was not built")
    return int(module.query(name, {key: int(value) for key, value in arguments.items()}))


def call(
    target: str,
    results: jax.ShapeDtypeStruct | Sequence[jax.ShapeDtypeStruct],
    *args: Any,
    vmap_method: str | None = None,
    **attributes: Any,
) -> Any:
    """Emits the custom call ``target`` on ``args`` with static ``attributes``.

    ``vmap_method`` is ``ffi_call``'s: ``"expand_dims"`` for kernels that treat extra leading
    dimensions as batch (or broadcast) dimensions; ``None`` for calls whose op batches them
    with its own rule.
    """
    return jax.ffi.ffi_call(target_name(target), results, vmap_method=vmap_method)(
        *args, **attributes)


# The platforms of the lowering in progress (set by the primitives' lowering rule), so that a
# program lowered for the CPU alone never traces the CUDA branch, whose scratch query may refuse
# a problem that only the CUDA kernels cannot take.
_LOWERING_PLATFORMS: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "jax_kernels_lowering_platforms", default=None)


@contextlib.contextmanager
def lowering_for(platforms: Sequence[str] | None) -> Iterator[None]:
    """Within this block, :func:`call_with_cuda_scratch` emits only the branches of
    ``platforms`` (None: unknown, every branch)."""
    token = _LOWERING_PLATFORMS.set(None if platforms is None else tuple(platforms))
    try:
        yield
    finally:
        _LOWERING_PLATFORMS.reset(token)


def call_with_cuda_scratch(
    target: str,
    result: jax.ShapeDtypeStruct,
    *args: Any,
    scratch_bytes: Callable[[], int],
    cpu_scratch: bool = False,
    plain_target: str | None = None,
    **attributes: Any,
) -> Any:
    """Emits ``target`` on ``args`` -> ``result``, whose CUDA handler also takes temporary memory
    from XLA as an extra ``uint8`` result (dropped here) of ``scratch_bytes()`` bytes, asked at
    trace time when the CUDA branch is traced (it may raise for a problem the CUDA kernels cannot
    take). The CPU handler takes no scratch result, or an empty one when ``cpu_scratch``. With
    ``plain_target``, a target without scratch, the CPU emits that one instead, and so does CUDA
    where ``scratch_bytes()`` is 0."""

    def with_scratch(nbytes: int) -> Callable[..., Any]:
        def emit(*args: Any) -> Any:
            scratch = jax.ShapeDtypeStruct((nbytes,), jnp.uint8)
            return call(target, (result, scratch), *args, **attributes)[0]
        return emit

    def on_cpu(*args: Any) -> Any:
        if plain_target is not None:
            return call(plain_target, result, *args, **attributes)
        if cpu_scratch:
            return with_scratch(0)(*args)
        return call(target, result, *args, **attributes)

    def on_cuda(*args: Any) -> Any:
        nbytes = scratch_bytes()
        if plain_target is not None and nbytes == 0:
            return call(plain_target, result, *args, **attributes)
        return with_scratch(nbytes)(*args)

    platforms = _LOWERING_PLATFORMS.get()
    if not CUDA_BUILT or (platforms is not None and "cuda" not in platforms):
        return on_cpu(*args)
    if platforms == ("cuda",):
        return on_cuda(*args)
    return jax.lax.platform_dependent(*args, default=on_cpu, cuda=on_cuda)
