"""Every op differentiates like a JAX primitive: forward mode, reverse mode and second order in
both, under jit and vmap.

Oracles: finite differences (``jax.test_util.check_grads`` with its default modes, forward and
reverse, at order 2, in float64, at points away from interpolation kinks), ``lax.conv`` and
``jnp`` formulations differentiated by JAX, and finite differences of the gradient for
Hessian-vector products. Runs unchanged with JAX_PLATFORMS=cuda.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_kernels as jk
from jk_testing import assert_lowered
from test_grid_sample import smooth_grid

jax.config.update("jax_enable_x64", True)


def rand(seed, shape, low=-1.0, high=1.0):
    return jnp.asarray(np.random.default_rng(seed).uniform(low, high, size=shape))


def allclose(a, b, rtol=1e-9):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = max(np.abs(y).max(initial=0.0), 1e-300)
        np.testing.assert_allclose(x, y, rtol=0, atol=rtol * scale)


# --- check_grads order 2, fwd and rev, every op, argument and option family ---------------------

CONV_OPTIONS = [
    dict(),
    dict(stride=2, padding=1),
    dict(stride=(1, 2), padding=(2, 0), dilation=(2, 1)),
    dict(padding="same", groups=2),
    dict(padding=1, groups=4),  # depthwise
]


@pytest.mark.parametrize("bias", [True, False], ids=("bias", "no_bias"))
@pytest.mark.parametrize("options", CONV_OPTIONS, ids=lambda o: str(sorted(o.items())))
def test_conv2d_check_grads_order2(options, bias):
    groups = options.get("groups", 1)
    x = rand(0, (2, 4, 6, 7))
    w = rand(1, (4, 4 // groups, 3, 2))
    b = rand(2, (4,)) if bias else None
    if bias:
        f = lambda x, w, b: jk.conv2d(x, w, b, **options)
        check_grads(f, (x, w, b), order=2)
    else:
        f = lambda x, w: jk.conv2d(x, w, None, **options)
        check_grads(f, (x, w), order=2)


def test_lerp_check_grads_order2():
    a, b, w = rand(0, (3, 4)), rand(1, (4,)), rand(2, (2, 1, 4), 0.1, 0.9)
    check_grads(jk.lerp, (a, b, w), order=2)
    check_grads(lambda a, b: jk.lerp(a, b, 0.3), (a, b), order=2)
    check_grads(lambda a, b: jk.lerp(a, b, 0.7), (a, b), order=2)
    # Through a nonlinearity, so that second derivatives are not all zero.
    check_grads(lambda a, b, w: jnp.sin(jk.lerp(a, b, w)), (a, b, w), order=2)


def test_repeat_check_grads_order2():
    x = rand(0, (2, 3))
    check_grads(lambda v: jk.repeat(v, (2, 1, 3)), (x,), order=2)
    check_grads(lambda v: jnp.sin(jk.repeat(v, (3, 2))), (x,), order=2)


GRID_CASES = ([(4, m, p, a) for m in ("bilinear", "nearest", "bicubic")
               for p in ("zeros", "border", "reflection") for a in (False, True)]
              + [(5, m, p, a) for m in ("bilinear", "nearest")
                 for p in ("zeros", "border", "reflection") for a in (False, True)])


def grid_inputs(rank, align, seed=0):
    if rank == 4:
        x = rand(seed, (2, 2, 5, 6))
        grid = smooth_grid(seed + 1, 2, (3, 4), (5, 6), align)
    else:
        x = rand(seed, (2, 2, 3, 4, 5))
        grid = smooth_grid(seed + 1, 2, (2, 2, 3), (3, 4, 5), align)
    return x, jnp.asarray(grid)


@pytest.mark.parametrize("rank,mode,padding,align", GRID_CASES)
def test_grid_sample_check_grads_order2(rank, mode, padding, align):
    x, grid = grid_inputs(rank, align)
    f = lambda x, g: jk.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=align)
    check_grads(f, (x, grid), order=2, eps=1e-5)


@pytest.mark.parametrize("sampling_ratio", [2, -1])
@pytest.mark.parametrize("aligned", [False, True])
def test_roi_align_check_grads_order2(aligned, sampling_ratio):
    # Boxes whose samples lie strictly inside cells and whose sizes are not clamped; only the
    # coordinates are perturbed (the batch index is an integer label).
    x = rand(0, (2, 2, 9, 10))
    coords = jnp.asarray([[0.9, 1.3, 6.1, 5.7], [2.2, 0.6, 7.7, 7.3], [1.35, 2.15, 4.6, 6.4]])
    batch = jnp.asarray([[0.0], [1.0], [1.0]])
    f = lambda x, c: jk.roi_align(x, jnp.concatenate([batch, c], axis=1), (2, 3), 1.0,
                                  sampling_ratio, aligned)
    check_grads(f, (x, coords), order=2, eps=1e-5)


# --- every transformation agrees with a jnp / lax formulation ------------------------------------


def lax_conv(x, w, b, stride=1, padding=0, groups=1):
    pad = ((padding, padding), (padding, padding))
    y = jax.lax.conv_general_dilated(x, w, (stride, stride), pad, feature_group_count=groups,
                                     precision=jax.lax.Precision.HIGHEST)
    return y + b[None, :, None, None]


def conv_loss(conv):
    return lambda x, w, b: jnp.sum(jnp.tanh(conv(x, w, b, stride=2, padding=1, groups=2)) ** 2)


def test_conv2d_every_transformation_matches_lax():
    x, w, b = rand(0, (2, 4, 7, 6)), rand(1, (6, 2, 3, 3)), rand(2, (6,))
    ours, ref = conv_loss(jk.conv2d), conv_loss(lax_conv)
    args = (x, w, b)
    tangents = (rand(3, x.shape), rand(4, w.shape), rand(5, b.shape))
    allclose(jax.jvp(ours, args, tangents), jax.jvp(ref, args, tangents))
    out, lin = jax.linearize(ours, *args)
    allclose(lin(*tangents), jax.jvp(ref, args, tangents)[1])
    argnums = (0, 1, 2)
    allclose(jax.jit(jax.jacfwd(ours, argnums))(*args), jax.jacrev(ref, argnums)(*args))
    allclose(jax.jit(jax.jacrev(ours, argnums))(*args), jax.jacrev(ref, argnums)(*args))
    # Second order: grad of grad, hessian, forward-over-reverse.
    allclose(jax.grad(lambda *a: jnp.sum(jax.grad(ours)(*a) ** 2), argnums)(*args),
             jax.grad(lambda *a: jnp.sum(jax.grad(ref)(*a) ** 2), argnums)(*args))
    hessian = jax.jit(jax.hessian(ours, (0, 1)))(x, w, b)
    allclose(hessian, jax.jacfwd(jax.jacrev(ref, (0, 1)), (0, 1))(x, w, b))
    allclose(jax.jvp(jax.grad(ours, argnums), args, tangents),
             jax.jvp(jax.grad(ref, argnums), args, tangents))


def test_conv2d_second_order_under_vmap():
    xs, ws, b = rand(0, (3, 2, 4, 6, 6)), rand(1, (3, 6, 2, 3, 3)), rand(2, (6,))
    for in_axes in ((0, None, None), (None, 0, None), (0, 0, None)):
        args = (xs if in_axes[0] == 0 else xs[0], ws if in_axes[1] == 0 else ws[0], b)

        def hvp(loss):
            def one(x, w, b):
                return jax.jvp(jax.grad(loss, (0, 1)), (x, w, b),
                               (jnp.ones_like(x), jnp.ones_like(w), jnp.zeros_like(b)))[1]
            return jax.jit(jax.vmap(one, in_axes))

        allclose(hvp(conv_loss(jk.conv2d))(*args), hvp(conv_loss(lax_conv))(*args))


def test_gradient_penalty_matches_lax_conv():
    """WGAN-GP / R1: the gradient w.r.t. the weights of the squared norm of the gradient w.r.t.
    the input, through a two-layer network."""
    x = rand(0, (4, 3, 8, 8))
    params = (rand(1, (8, 3, 3, 3)), rand(2, (8,)), rand(3, (4, 8, 3, 3)), rand(4, (4,)))

    def critic(conv):
        def f(params, x):
            w1, b1, w2, b2 = params
            h = jax.nn.softplus(conv(x, w1, b1, padding=1))
            return jnp.sum(conv(h, w2, b2, stride=2, padding=1))
        return f

    def penalty(conv):
        def p(params, x):
            g = jax.grad(critic(conv), argnums=1)(params, x)
            return jnp.mean((jnp.sqrt(jnp.sum(g ** 2, axis=(1, 2, 3))) - 1.0) ** 2)
        return jax.jit(jax.grad(p))

    allclose(penalty(jk.conv2d)(params, x), penalty(lax_conv)(params, x))
    # The jitted program runs the conv kernels only: no XLA convolution.
    text = assert_lowered(penalty(jk.conv2d), params, x,
                          targets=("jk_conv2d_fwd", "jk_conv2d_bwd_input",
                                   "jk_conv2d_bwd_weight"))
    assert "convolution" not in text


def hvp_by_differences(grad, x, v, eps=1e-6):
    return (grad(x + eps * v) - grad(x - eps * v)) / (2 * eps)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_grid_sample_hessian_vector_product_matches_differences(mode):
    x, grid = grid_inputs(4, False, seed=3)
    target = rand(7, (2, 2, 3, 4))

    def loss(grid):
        return jnp.sum((jk.grid_sample(x, grid, mode=mode, padding_mode="border") - target) ** 2)

    v = rand(8, grid.shape)
    grad = jax.jit(jax.grad(loss))
    hvp = jax.jit(lambda g, v: jax.jvp(jax.grad(loss), (g,), (v,))[1])(grid, v)
    allclose(hvp, hvp_by_differences(grad, grid, v), rtol=1e-6)
    # Reverse-over-reverse gives the same product.
    rr = jax.grad(lambda g: jnp.vdot(jax.grad(loss)(g), v))(grid)
    allclose(rr, hvp, rtol=1e-10)


def test_roi_align_hessian_vector_product_matches_differences():
    x = rand(0, (2, 3, 9, 10))
    coords = jnp.asarray([[0.9, 1.3, 6.1, 5.7], [2.2, 0.6, 7.7, 7.3]])
    batch = jnp.asarray([[0.0], [1.0]])
    target = rand(1, (2, 3, 2, 2))

    def loss(c):
        boxes = jnp.concatenate([batch, c], axis=1)
        return jnp.sum((jk.roi_align(x, boxes, 2, 1.0, 2, True) - target) ** 2)

    v = rand(2, coords.shape)
    grad = jax.jit(jax.grad(loss))
    hvp = jax.jvp(jax.grad(loss), (coords,), (v,))[1]
    allclose(hvp, hvp_by_differences(grad, coords, v), rtol=1e-6)


@pytest.mark.parametrize("op", ["grid_sample", "roi_align", "conv2d", "lerp", "repeat"])
def test_linearize_and_hessian_equals_jacfwd_of_jacrev_and_jacrev_of_jacfwd(op):
    if op == "grid_sample":
        x, grid = grid_inputs(4, True, seed=5)
        x, grid = x[:1, :1], grid[:1, :2, :2]
        f = lambda x, g: jnp.sum(jnp.sin(jk.grid_sample(x, g, mode="bicubic",
                                                        align_corners=True)))
        args = (x, grid)
    elif op == "roi_align":
        x = rand(0, (1, 2, 6, 6))
        coords = jnp.asarray([[0.9, 1.3, 4.1, 4.7]])
        f = lambda x, c: jnp.sum(jnp.sin(jk.roi_align(
            x, jnp.concatenate([jnp.zeros((1, 1)), c], axis=1), 2, 1.0, 2)))
        args = (x, coords)
    elif op == "conv2d":
        f = lambda x, w: jnp.sum(jnp.sin(jk.conv2d(x, w, padding=1)))
        args = (rand(0, (1, 2, 4, 4)), rand(1, (2, 2, 3, 3)))
    elif op == "lerp":
        f = lambda a, w: jnp.sum(jnp.sin(jk.lerp(a, jnp.ones(3), w)))
        args = (rand(0, (2, 3)), rand(1, (2, 1)))
    else:
        f = lambda x, y: jnp.sum(jnp.sin(jk.repeat(x, (2, 2)) * jk.repeat(y, (1, 2))))
        args = (rand(0, (2, 3)), rand(1, (4, 3)))
    argnums = (0, 1)
    # linearize gives jvp's tangent map, under jit too.
    tangents = tuple(rand(40 + i, a.shape) for i, a in enumerate(args))
    _, f_lin = jax.linearize(f, *args)
    allclose(jax.jit(f_lin)(*tangents), jax.jit(lambda *t: jax.jvp(f, args, t)[1])(*tangents),
             rtol=1e-12)
    hessian = jax.jit(jax.hessian(f, argnums))(*args)
    allclose(hessian, jax.jacfwd(jax.jacrev(f, argnums), argnums)(*args), rtol=1e-12)
    allclose(hessian, jax.jacrev(jax.jacfwd(f, argnums), argnums)(*args), rtol=1e-10)
    allclose(hessian, jax.jacrev(jax.jacrev(f, argnums), argnums)(*args), rtol=1e-10)


def test_grid_sample_forward_mode_under_vmap_and_jit():
    x, grid = grid_inputs(4, False, seed=9)
    xs, grids = jnp.stack([x, 2 * x]), jnp.stack([grid, grid * 0.9])
    f = lambda x, g: jk.grid_sample(x, g, mode="bilinear", padding_mode="reflection")
    tangents = (rand(10, x.shape), rand(11, grid.shape))
    one = lambda x, g: jax.jvp(f, (x, g), tangents)[1]
    batched = jax.jit(jax.vmap(one))(xs, grids)
    for i in range(2):
        allclose(batched[i], one(xs[i], grids[i]), rtol=1e-12)
    # jacfwd over the grid vmaps the grid tangent with the input and the grid unbatched: the
    # kernels reuse the input through a batch map instead of copying it.
    jac = jax.jacfwd(f, argnums=1)(x, grid)
    allclose(jac, jax.jacrev(f, argnums=1)(x, grid), rtol=1e-12)


def test_third_order_along_the_grid_is_refused_clearly():
    x, grid = grid_inputs(4, False)
    grid = grid[:, :1, :2]
    f = lambda g: jnp.sum(jk.grid_sample(x, g) ** 3)
    with pytest.raises(NotImplementedError, match="grid_sample"):
        jax.jacfwd(jax.hessian(f))(grid)
    # Third order in the input alone works: the op is linear in it.
    small = rand(12, (2, 1, 3, 3))
    g = lambda x: jnp.sum(jnp.sin(jk.grid_sample(x, grid)))
    third = jax.jacfwd(jax.hessian(g))(small).reshape((small.size,) * 3)
    # sum(sin(J x)) for the linear map J: the third derivative is -sum_o cos(y_o) J_oi J_oj J_ok.
    jac = jax.jacrev(lambda x: jk.grid_sample(x, grid))(small).reshape(-1, small.size)
    y = jk.grid_sample(small, grid).reshape(-1)
    allclose(third, -jnp.einsum("o,oi,oj,ok->ijk", jnp.cos(y), jac, jac, jac), rtol=1e-12)


def test_first_order_programs_are_unchanged():
    """Reverse mode of the forward runs exactly the first-order kernels (no directional pass)."""
    x, grid = grid_inputs(4, False)
    f = lambda x, g: jnp.sum(jk.grid_sample(x, g) ** 2)
    text = assert_lowered(jax.grad(f, argnums=(0, 1)), x, grid,
                          targets=("jk_grid_sample_fwd", "jk_grid_sample_bwd_input",
                                   "jk_grid_sample_bwd_grid"))
    assert "directional" not in text


def test_transposes_sum_over_reused_operands():
    """grad(vmap(f)) with an unbatched input: the kernels read it through a batch map (no copy),
    and the transpose sums the per-row cotangents over the reuse."""
    x, grid = grid_inputs(4, False, seed=13)
    grids = jnp.stack([grid, grid * 0.8, grid[::-1]])
    xs = jnp.stack([x, -x])
    one = lambda x, g: jnp.sum(jnp.sin(jk.grid_sample(x, g)))
    nested = lambda xs, gs: jnp.sum(jnp.sin(jax.vmap(jax.vmap(jk.grid_sample, (None, 0)),
                                                     (0, None))(xs, gs)))
    got = jax.jit(jax.grad(nested, argnums=(0, 1)))(xs, grids)
    d_xs = jnp.stack([sum(jax.grad(one)(xs[j], grids[i]) for i in range(3)) for j in range(2)])
    d_grids = jnp.stack([sum(jax.grad(one, 1)(xs[j], grids[i]) for j in range(2))
                         for i in range(3)])
    allclose(got, (d_xs, d_grids), rtol=1e-12)
    assert_lowered(jax.grad(nested, argnums=(0, 1)), xs, grids,
                   targets=("jk_grid_sample_bwd_input", "jk_grid_sample_bwd_grid"))


def _op_and_args(op):
    """(f(a, b), (a, b)) of a nonlinear scalar function through `op`, for batched checks."""
    if op == "grid_sample":
        x, grid = grid_inputs(4, False, seed=21)
        return (lambda x, g: jnp.sum(jnp.sin(jk.grid_sample(x, g, mode="bicubic")))), (x, grid)
    if op == "roi_align":
        x = rand(22, (2, 2, 9, 10))
        coords = jnp.asarray([[0.9, 1.3, 6.1, 5.7], [2.2, 0.6, 7.7, 7.3]])
        batch = jnp.asarray([[0.0], [1.0]])
        return (lambda x, c: jnp.sum(jnp.sin(jk.roi_align(
            x, jnp.concatenate([batch, c], axis=1), 2, 1.0, 2)))), (x, coords)
    if op == "conv2d":
        return (lambda x, w: jnp.sum(jnp.sin(jk.conv2d(x, w, padding=1, groups=2)))), (
            rand(23, (2, 4, 5, 5)), rand(24, (4, 2, 3, 3)))
    if op == "lerp":
        return (lambda a, w: jnp.sum(jnp.sin(jk.lerp(a, jnp.ones(3), w)))), (
            rand(25, (2, 3)), rand(26, (2, 1)))
    return (lambda x, y: jnp.sum(jnp.sin(jk.repeat(x, (2, 2)) * jk.repeat(y, (1, 2))))), (
        rand(27, (2, 3)), rand(28, (4, 3)))


@pytest.mark.parametrize("op", ["grid_sample", "roi_align", "conv2d", "lerp", "repeat"])
def test_second_order_under_vmap_folds_into_the_kernels(op):
    """vmap of a Hessian-vector product (forward over reverse) and of grad of grad equal the
    per-example results, and lower to the kernels with no loop."""
    f, (a, b) = _op_and_args(op)
    scales = jnp.asarray([1.0, 0.9, 1.1])
    va, vb = rand(29, a.shape), rand(30, b.shape)

    def hvp(s):
        return jax.jvp(jax.grad(f, (0, 1)), (a * s, b * s), (va, vb))[1]

    def grad_of_grad(s):
        return jax.grad(lambda a, b: sum(jnp.sum(g ** 2) for g in jax.grad(f, (0, 1))(a, b)),
                        (0, 1))(a * s, b * s)

    for fn in (hvp, grad_of_grad):
        batched = jax.jit(jax.vmap(fn))(scales)
        for i, s in enumerate(scales):
            allclose(jax.tree.map(lambda t: t[i], batched), fn(s), rtol=1e-12)
        assert_lowered(jax.vmap(fn), scales)
