"""Small forward + backward cases of every op (and second-order ones of grid_sample and
roi_align), for compute-sanitizer memcheck on the GPU (tools/gpu_check.sh). Shapes are odd on purpose: tails, broadcasts, zero repeats.

    python tools/sanitize_cases.py [--dtypes float32,bfloat16] [op ...]
    (default: every op and every dtype; ops e.g. conv2d grid_sample)"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_kernels as jk
from jax_kernels import conv as jk_conv

jax.config.update("jax_enable_x64", True)
rng = np.random.default_rng(0)


def rand(*shape, dtype=jnp.float32):
    return jnp.asarray(rng.uniform(-1, 1, size=shape)).astype(dtype)



def second_order(loss, *args):
    """Forward over reverse and reverse over reverse of `loss`: every directional pass of
    grid_sample / roi_align (order-1 and order-2 gathers and scatters, the order-2 reduce)."""
    grad = jax.grad(loss, argnums=tuple(range(len(args))))
    jax.block_until_ready(jax.jvp(grad, args, args))
    penalty = lambda *a: sum(jnp.sum(g.astype(jnp.float32) ** 2) for g in grad(*a))
    jax.block_until_ready(jax.grad(penalty, argnums=tuple(range(len(args))))(*args))


def lerp_cases(dtype):
    a, b, w = rand(3, 37, dtype=dtype), rand(37, dtype=dtype), rand(3, 1, dtype=dtype)
    jax.block_until_ready(jax.grad(lambda a, b, w: jnp.sum(jk.lerp(a, b, w).astype(jnp.float32)), argnums=(0, 1, 2))(a, b, w))
    jax.block_until_ready(jax.grad(lambda a, b: jnp.sum(jk.lerp(a, b, 0.7).astype(jnp.float32)), argnums=(0, 1))(a, a))


def repeat_cases(dtype):
    for shape, repeats in (((5, 7), (3, 2)), ((2, 3), (0, 2)), ((1, 1), (40, 70)), ((3,), (2, 1, 2)), ((64, 64), (2, 2))):
        x = rand(*shape, dtype=dtype)
        jax.block_until_ready(jax.grad(lambda v: jnp.sum(jk.repeat(v, repeats).astype(jnp.float32)))(x))


def roi_align_cases(dtype):
    # roi_align: boxes inside, outside, reversed, degenerate, NaN, huge and with invalid batch
    # indices; fixed and adaptive grids, both input-gradient paths, a vmap, no boxes.
    x = rand(2, 5, 9, 11, dtype=dtype)
    boxes = jnp.asarray([[0, 1.5, 2.0, 7.5, 6.0], [1, -4.0, -3.0, 20.0, 15.0],
                         [0, 6.0, 5.0, 2.0, 1.0], [1, 3.0, 3.0, 3.0, 3.0], [0, np.nan, 1, 5, 5],
                         [1, -1e30, 2, 1e30, 3], [2, 1, 1, 5, 5], [-1, 1, 1, 5, 5],
                         [0.5, 1, 1, 5, 5]]).astype(dtype)
    for data_format in ("NCHW", "NHWC"):  # channels last: the jk_roi_align_nhwc_* kernels
        xl = x if data_format == "NCHW" else jnp.moveaxis(x, 1, -1)
        for sampling_ratio, aligned, deterministic in ((2, False, True), (-1, True, True),
                                                       (-1, False, False)):
            op = lambda x, b: jk.roi_align(x, b, (3, 2), 0.9, sampling_ratio, aligned,
                                           deterministic=deterministic,
                                           data_format=data_format).astype(jnp.float32)
            grad = jax.grad(lambda x, b: jnp.sum(op(x, b)), argnums=(0, 1))
            jax.block_until_ready(grad(xl, boxes))
            jax.block_until_ready(jax.vmap(grad)(jnp.stack([xl, -xl]), jnp.stack([boxes, boxes])))
            second_order(lambda x, b: jnp.sum(op(x, b) ** 2), xl, boxes)
    # many boxes over larger images: the CUDA forward's staged regions (and their edge tiles), on
    # every call that the region forward takes (its switch is read at every call)
    crowded = jnp.asarray(np.concatenate([
        np.column_stack([np.arange(120) % 2, np.linspace(-6, 40, 120), np.linspace(-4, 30, 120),
                         np.linspace(2, 70, 120), np.linspace(5, 45, 120)]),
        [[0, -30, -20, 90, 60], [1, 1, 1, np.inf, 5]]])).astype(dtype)
    big = rand(2, 37, 35, 50, dtype=dtype)
    route = os.environ.get("JAX_KERNELS_ROI_ALIGN_REGIONS")
    os.environ["JAX_KERNELS_ROI_ALIGN_REGIONS"] = "all"
    try:
        for data_format, xl in (("NCHW", big), ("NHWC", jnp.moveaxis(big, 1, -1))):
            jax.block_until_ready(jk.roi_align(xl, crowded, 7, 1.0, 2, False,
                                               data_format=data_format))
    finally:
        if route is None:
            del os.environ["JAX_KERNELS_ROI_ALIGN_REGIONS"]
        else:
            os.environ["JAX_KERNELS_ROI_ALIGN_REGIONS"] = route
    no_boxes = lambda x: jnp.sum(jk.roi_align(x, boxes[:0], 3).astype(jnp.float32))
    jax.block_until_ready(jax.grad(no_boxes)(x))
    # boxes over an input with no image or no channel, both layouts
    for empty in (x[:0], x[:, :0]):
        for data_format, e in (("NCHW", empty), ("NHWC", jnp.moveaxis(empty, 1, -1))):
            op = lambda x, b: jnp.sum(jk.roi_align(x, b, (3, 2), 0.9, 2, True,
                                                   data_format=data_format).astype(jnp.float32))
            jax.block_until_ready(jax.grad(op, argnums=(0, 1))(e, boxes))


def grid_sample_cases(dtype):
    # grid_sample: every mode, 4-D and 5-D, coordinates inside, outside, on the borders, NaN,
    # infinite and huge, under each padding; both d_input paths, a vmap over grids, no points;
    # channels-first and channels-last (the jk_grid_sample_nhwc_* kernels; 4-D channels-last
    # with 3 channels, which the deterministic gathers take in one thread per cell).
    specials = [0.3, -1.0, 1.0, -1.7, 2.5, np.nan, np.inf, -np.inf, 1e30, -1e10]
    for rank, data_format in ((4, "NCHW"), (5, "NCHW"), (4, "NHWC"), (5, "NHWC")):
        dims = rank - 2
        channels = 3 if (rank, data_format) == (4, "NHWC") else 5
        x = rand(2, channels, *((4, 7, 9)[3 - dims:]), dtype=dtype)
        if data_format == "NHWC":
            x = jnp.moveaxis(x, 1, -1)
        coords = np.stack(np.meshgrid(*[specials] * dims, indexing="ij"), axis=-1)
        grid = jnp.asarray(np.broadcast_to(coords.reshape((1,) * dims + (-1, dims)),
                                           (2,) + (1,) * (dims - 1) + (len(specials) ** dims, dims)))
        grid = grid.astype(dtype)
        atomics = (False,) if dtype in (jnp.float32, jnp.float64) else ()
        for mode in ("bilinear", "nearest", "bicubic")[: 3 if rank == 4 else 2]:
            for padding, align, deterministic in (("zeros", False, True), ("reflection", True, True),
                                                  *(("border", False, d) for d in atomics)):
                op = lambda x, g: jk.grid_sample(x, g, mode, padding, align,
                                                 deterministic=deterministic,
                                                 data_format=data_format)
                grad = jax.grad(lambda x, g: jnp.sum(op(x, g).astype(jnp.float32)), argnums=(0, 1))
                jax.block_until_ready(grad(x, grid))
                if deterministic:
                    second_order(lambda x, g: jnp.sum(op(x, g).astype(jnp.float32) ** 2), x, grid)
        jax.block_until_ready(jax.vmap(grad, (None, 0))(x, jnp.stack([grid, -grid])))
        no_points = lambda x: jnp.sum(jk.grid_sample(x, grid[:, :0], data_format=data_format)
                                      .astype(jnp.float32))
        jax.block_until_ready(jax.grad(no_points)(x))
        # an input of one cell along every axis with align_corners: every coordinate but NaN
        # reads that cell (+-Inf included)
        one = x[(slice(None),) * (1 if data_format == "NHWC" else 2) + (slice(0, 1),) * dims]
        for mode in ("bilinear", "nearest", "bicubic")[: 3 if rank == 4 else 2]:
            for padding in ("zeros", "border", "reflection"):
                op = lambda x, g: jnp.sum(jk.grid_sample(x, g, mode, padding, True,
                                                         data_format=data_format)
                                          .astype(jnp.float32))
                jax.block_until_ready(jax.grad(op, argnums=(0, 1))(one, grid))
    # The channels-first forward's survey (forward_copy.cu), from 4 MiB here (32 by default): a
    # random and a half-random grid (far-apart points: the copy, 32 channels) and a smooth one
    # (in place). JAX_KERNELS_GRID_SAMPLE_COPY=1 / =2 send the small cases above through the
    # copy / the scattered route.
    if dtype != jnp.float64:
        os.environ["JAX_KERNELS_GRID_SAMPLE_SURVEY_MIB"] = "4"
        big = rand(2, 32, 256, 260, dtype=dtype)
        ys, xs = np.meshgrid(np.linspace(-1, 1, 64), np.linspace(-1, 1, 70), indexing="ij")
        smooth = np.broadcast_to(np.stack([xs, ys], -1), (2, 64, 70, 2))
        scattered = rng.uniform(-1, 1, size=smooth.shape)
        half = np.where(rng.random(smooth.shape[:-1] + (1,)) < 0.5, scattered, smooth)
        for grid in (scattered, half, smooth):
            jax.block_until_ready(jk.grid_sample(big, jnp.asarray(grid, dtype)))
        del os.environ["JAX_KERNELS_GRID_SAMPLE_SURVEY_MIB"]


def conv2d_cases(dtype):
    # conv2d: the unrolled 7x7/5x5/3x3 stencils (strip kernels, 7- and 8-row strips; tensor-core
    # kernels for the half types; 16-byte vector and element staging; several column and row
    # tiles), the generic and the global-memory stencils, every weight-gradient kernel, the bias
    # gradient, the tensor-core path where it takes the problem (on Hopper its sm_90a forward
    # kernels; the im2col route for few input channels: a 7x7/2 stem, a 5x5/2 two-channel conv,
    # a 3x3 3->128 conv over 16 images through the batched GEMM on channel-major columns), a
    # filter large enough for the weights' tiled transpose, per-example weights and an empty
    # batch.
    for x_shape, w_shape, options in (
            ((2, 4, 14, 14), (4, 1, 7, 7), dict(padding=3, groups=4)),
            ((1, 3, 16, 20), (6, 1, 5, 5), dict(padding=2, groups=3)),
            ((2, 4, 16, 16), (4, 1, 3, 3), dict(padding=1, groups=4)),
            ((2, 4, 13, 12), (8, 1, 3, 3), dict(stride=2, padding=1, groups=4)),
            ((2, 2, 11, 11), (4, 2, 5, 5), dict(stride=2, padding=2)),
            ((1, 2, 130, 130), (2, 1, 3, 3), dict(dilation=60, padding=1, groups=2)),
            ((2, 16, 9, 9), (8, 16, 3, 3), dict(padding=1)),
            ((2, 4, 56, 56), (4, 1, 7, 7), dict(padding=3, groups=4)),
            ((2, 3, 64, 72), (3, 1, 7, 7), dict(padding=3, groups=3)),
            ((1, 2, 70, 136), (2, 1, 5, 5), dict(padding=2, groups=2)),
            ((2, 4, 24, 24), (4, 1, 3, 3), dict(stride=2, padding=1, groups=4)),
            ((2, 3, 17, 18), (16, 3, 7, 7), dict(stride=2, padding=3)),
            ((16, 3, 8, 8), (128, 3, 3, 3), dict(padding=1)),
            ((2, 128, 5, 6), (132, 128, 3, 3), dict(padding=1)),
            ((2, 32, 16, 16), (64, 32, 1, 1), dict(stride=2)),
            ((2, 24, 15, 13), (40, 24, 1, 1), dict(stride=(3, 2), padding=1))):
        x, w, b = rand(*x_shape, dtype=dtype), rand(*w_shape, dtype=dtype), rand(w_shape[0], dtype=dtype)
        conv_grad = jax.grad(lambda x, w, b: jnp.sum(jk.conv2d(x, w, b, **options).astype(jnp.float32)),
                             argnums=(0, 1, 2))
        jax.block_until_ready(conv_grad(x, w, b))
    jax.block_until_ready(jax.vmap(conv_grad, in_axes=(None, 0, 0))(x, jnp.stack([w, -w]), jnp.stack([b, b])))
    jax.block_until_ready(jax.grad(lambda w: jnp.sum(jk.conv2d(x[:0], w, **options).astype(jnp.float32)))(w))
    bias_gradient_cases(dtype, "NCHW")


def bias_gradient_cases(dtype, layout):
    # the bias gradient cut into many chunks (partials in scratch, then added in order): planes
    # of a multiple of 8 positions and not, filters in granules of 8 and not (channels last).
    for n, k, p, q in ((5, 16, 40, 48), (3, 3, 37, 41)):
        dy = rand(2, n, k, p, q, dtype=dtype) if layout == "NCHW" else rand(2, n, p, q, k, dtype=dtype)
        jax.block_until_ready(jax.jit(lambda dy: jk_conv._bias_gradient(dy, layout))(dy))


def conv2d_nhwc_cases(dtype):
    # channels-last conv2d: the tensor-core path in place (fprop, unit-stride dgrad as fprop,
    # strided dgrad, wgrad), repacked (grouped, channels off the 128-bit access) and on im2col
    # columns (3-channel stems, with the output in place or unpacked), the direct channels-last
    # stencil, wgrad and bias gradient (depthwise, strided, dilated), per-example weights,
    # Hopper's split wgrad, filters large enough for the weights' tiled transpose (one group
    # and two, padded filters and channels, the im2col route), and 1x1 stride-1 convolutions,
    # whose forward and dgrad run Hopper's pointwise GEMM (a narrow tile; a wide one with
    # filters and pixels off the tile, its dgrad over three k-blocks, the last short) and
    # wgrad its pointwise wgrad GEMM.
    for x_shape, w_shape, options in (
            ((2, 9, 9, 16), (3, 3, 16, 16), dict(padding=1)),
            ((2, 11, 10, 16), (3, 3, 16, 32), dict(stride=2, padding=1)),
            ((2, 8, 8, 32), (1, 1, 32, 16), dict()),
            ((2, 9, 11, 24), (1, 1, 24, 136), dict()),
            ((2, 14, 14, 8), (7, 7, 1, 8), dict(padding=3, groups=8)),
            ((2, 23, 19, 6), (5, 5, 1, 12), dict(padding=2, groups=6)),
            ((1, 17, 21, 5), (3, 3, 1, 5), dict(padding=1, groups=5)),
            ((1, 20, 37, 70), (5, 5, 1, 70), dict(padding=(2, 3), groups=70)),
            ((2, 13, 12, 4), (3, 3, 1, 8), dict(stride=2, padding=1, groups=4)),
            ((1, 30, 30, 3), (3, 3, 3, 5), dict(dilation=7, padding=2)),
            ((2, 10, 10, 32), (3, 3, 16, 32), dict(padding=1, groups=2)),
            ((2, 17, 18, 3), (7, 7, 3, 16), dict(stride=2, padding=3)),
            ((2, 16, 16, 3), (4, 4, 3, 12), dict(stride=4)),
            ((2, 12, 12, 24), (3, 3, 24, 20), dict(padding=1)),
            ((2, 8, 9, 36), (3, 2, 18, 44), dict(padding=1, groups=2)),
            ((2, 5, 6, 128), (3, 3, 128, 132), dict(padding=1)),
            ((2, 7, 6, 200), (3, 3, 100, 264), dict(stride=2, padding=1, groups=2)),
            ((1, 12, 12, 3), (7, 7, 3, 896), dict(stride=2, padding=3)),
            # Hopper's split wgrad (half types, 64-channel multiples): 3 slices, the last short,
            # a wide tile with filters off it; one slice, a narrow tile with 40 filters; more
            # slices than the ordered sum's 8 runs (slice_sum.cuh), the last run short.
            ((8, 15, 15, 64), (3, 3, 64, 72), dict(padding=1)),
            ((4, 12, 13, 64), (3, 3, 64, 40), dict(padding=2, dilation=2)),
            ((16, 24, 23, 64), (3, 3, 64, 64), dict(padding=1)),
            # Hopper's pointwise wgrad GEMM: in float32 6 slices of 660 pixels, which end mid
            # k-block, filters as the GEMM's rows, then channels as its rows; in half types 3
            # slices, 96 channels under 192 filters, then 160 channels over 32 filters.
            ((4, 30, 33, 64), (1, 1, 64, 128), dict()),
            ((4, 30, 33, 128), (1, 1, 128, 64), dict()),
            ((4, 30, 33, 96), (1, 1, 96, 192), dict()),
            ((4, 30, 33, 160), (1, 1, 160, 32), dict()),
            # Strided 1x1s over x's sampled pixels (plan_sampled): 16-byte units with the last
            # row and column unread, then element units with padding sampled as zeros.
            ((2, 17, 15, 64), (1, 1, 64, 128), dict(stride=2)),
            ((2, 13, 11, 12), (1, 1, 12, 20), dict(stride=(2, 3), padding=1))):
        x, w, b = rand(*x_shape, dtype=dtype), rand(*w_shape, dtype=dtype), rand(w_shape[-1], dtype=dtype)
        conv_grad = jax.grad(lambda x, w, b: jnp.sum(
            jk.conv2d(x, w, b, data_format="NHWC", **options).astype(jnp.float32)), argnums=(0, 1, 2))
        jax.block_until_ready(conv_grad(x, w, b))
    jax.block_until_ready(jax.vmap(conv_grad, in_axes=(None, 0, 0))(x, jnp.stack([w, -w]), jnp.stack([b, b])))
    jax.block_until_ready(jax.grad(lambda w: jnp.sum(
        jk.conv2d(x[:0], w, data_format="NHWC", **options).astype(jnp.float32)))(w))
    bias_gradient_cases(dtype, "NHWC")


OPS = {"lerp": lerp_cases, "repeat": repeat_cases, "roi_align": roi_align_cases,
       "grid_sample": grid_sample_cases, "conv2d": conv2d_cases, "conv2d_nhwc": conv2d_nhwc_cases}
args = sys.argv[1:]
dtypes = ["float16", "bfloat16", "float32", "float64"]
if args[:1] == ["--dtypes"]:
    dtypes, args = args[1].split(","), args[2:]
for dtype in dtypes:
    for op in args or OPS:
        OPS[op](jnp.dtype(dtype))
print("sanitize cases ran")
