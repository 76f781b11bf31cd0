"""jax_kernels: fast, exact, deterministic grid_sample, roi_align, conv2d, lerp and repeat for JAX,
as CUDA and C++ kernels registered with XLA through the typed FFI (and affine_grid, in jnp)."""

from ._capabilities import capabilities
from ._export import disabled_export_checks
from .affine_grid import affine_grid
from .conv import conv2d
from .grid_sample import grid_sample
from .lerp import lerp
from .repeat import repeat
from .roi_align import roi_align

__all__ = ["affine_grid", "capabilities", "conv2d", "disabled_export_checks", "grid_sample", "lerp", "repeat", "roi_align"]
__version__ = "0.1.0"
