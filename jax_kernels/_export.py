"""``disabled_export_checks()``: what ``jax.export`` needs to serialize programs that use the ops.

``jax.export`` refuses custom calls whose targets promise no compatibility. The targets of this
package carry a version in their names (``_ffi.TARGET_VERSION``) and keep their attributes and
semantics for a major version, so a serialized program can name them; after ``import
jax_kernels`` in the process that deserializes it, they are registered again and the program runs.
"""

from __future__ import annotations

from jax import export

from . import _ffi


def disabled_export_checks() -> list:
    """``jax.export.DisabledSafetyCheck.custom_call`` for every FFI target of the package:
    ``jax.export.export(jax.jit(f), disabled_checks=jax_kernels.disabled_export_checks())``
    serializes any ``f`` that uses the ops. Deserialize after ``import jax_kernels``."""
    return [export.DisabledSafetyCheck.custom_call(name) for name in _ffi.targets()]
