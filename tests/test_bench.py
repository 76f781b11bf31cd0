"""The benchmark's training-step case (jax_kernels.bench): the jax_kernels, pure-JAX and torch
forms of the model compute the same loss and gradients from the same parameters and data (what
makes their timings comparable), the jax_kernels step is bitwise reproducible, the case builds
at the --quick size, and the table prints "-" for a case without a floor.

At the --quick size, where these run. At larger sizes the loss and the trunk's gradients still
agree at float32 tolerance, but the localisation gradients can differ by about 1e-3: bilinear
sampling's gradient jumps where a coordinate crosses an integer, and near the identity transform
some sample lands within rounding of one, on either side depending on the implementation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kernels import bench

MODEL, BATCH, SIDE = bench.TRAIN_SIZES["quick"]


@pytest.fixture(scope="module", autouse=True)
def on_the_cpu():
    """The three forms are compared at full float32 precision, so every computation here runs on
    the CPU: on a GPU, float32 convolutions default to TF32 (1e-3 relative: jk.conv2d's and
    lax.conv's), which would hide a real difference between the models."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(scope="module")
def problem():
    return bench.train_init(MODEL), bench.train_data(MODEL, BATCH, SIDE, seed=1)


@pytest.fixture(scope="module")
def jax_kernels_result(problem):
    params, data = problem
    loss = bench.train_loss(bench.TRAIN_OPS["jax_kernels"], MODEL)
    return jax.jit(jax.value_and_grad(loss))(params, *data)


def _assert_same(value, grads, reference):
    ref_value, ref_grads = reference
    assert set(grads) == set(ref_grads)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-6)
    for name, ref in ref_grads.items():
        got, ref = np.asarray(grads[name], np.float64), np.asarray(ref, np.float64)
        # per parameter, relative to its gradient's size: entries near zero carry no scale
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(),
                                   err_msg=name)


def test_pure_jax_matches(problem, jax_kernels_result):
    params, data = problem
    loss = bench.train_loss(bench.TRAIN_OPS["pure JAX"], MODEL)
    _assert_same(*jax.jit(jax.value_and_grad(loss))(params, *data), jax_kernels_result)


def test_torch_matches(problem, jax_kernels_result):
    if bench.torch is None or bench.torchvision is None:
        pytest.skip("torch or torchvision (roi_align) does not import")
    torch = bench.torch
    params, (images, boxes, labels) = problem
    leaves = {k: torch.from_numpy(np.array(v)).requires_grad_(True) for k, v in params.items()}
    value = bench.torch_train_loss(MODEL)(leaves, torch.from_numpy(np.array(images)),
                                          torch.from_numpy(np.array(boxes)),
                                          torch.from_numpy(np.array(labels)).long())
    grads = dict(zip(leaves, torch.autograd.grad(value, list(leaves.values()))))
    _assert_same(value.item(), {k: g.numpy() for k, g in grads.items()}, jax_kernels_result)


def test_quick_case(problem, jax_kernels_result):
    """The float32 cases at the --quick size: no floor, every contender, the reproducibility
    note; the jax_kernels step is bitwise reproducible and applies the gradients, the pure-JAX
    step gives the same loss. (The pure-JAX scan is left uncalled: a compilation of ~5 s.)"""
    ctx = bench.Context("cpu", True, "cpu" if bench.torch is not None else None)
    one, scan = bench._train_step_cases(ctx, MODEL, BATCH, SIDE, jnp.float32, steps=2)
    assert one.floor_bytes is None and scan.floor_bytes is None and scan.calls == 2
    names = ["jax_kernels", "pure JAX"] + (["torch"] if bench.torchvision is not None else [])
    assert [c.name for c in one.contenders] == names
    assert [c.name for c in scan.contenders] == ["jax_kernels", "pure JAX"]
    assert scan.notes == ["jax_kernels 2 steps run twice: bitwise identical"]

    params, _ = problem
    first, second = one.contenders[0].fn(), one.contenders[0].fn()
    assert bench._tree_bits(first) == bench._tree_bits(second)
    new, ema, value = first
    ref_value, grads = jax_kernels_result
    assert float(value) == float(ref_value)
    for name, p in params.items():
        np.testing.assert_allclose(new[name], p - MODEL.learning_rate * grads[name], rtol=1e-6,
                                   atol=1e-7, err_msg=name)
        np.testing.assert_allclose(ema[name], p + MODEL.ema_rate * (new[name] - p), rtol=1e-6,
                                   atol=1e-7, err_msg=name)
    np.testing.assert_allclose(float(one.contenders[1].fn()[2]), float(ref_value), rtol=1e-6)


def test_table_without_floor(monkeypatch, capsys):
    x = jnp.ones(8)
    case = bench.Case("no floor", None, [bench.Contender("jax_kernels", lambda: x + 1)],
                      notes=["a note"])
    monkeypatch.setitem(bench.CASES, "fake", lambda ctx: [case])
    report = bench.run(["fake"], quick=True, dispatches=1, rounds=1)
    assert report["cases"][0]["floor_ms"] is None
    assert report["cases"][0]["notes"] == ["a note"]
    out = capsys.readouterr().out.splitlines()
    assert "# no floor: a note" in out
    row = next(line for line in out if line.startswith("no floor "))
    assert row.split()[-2:] == ["-", "1.00"]


def test_match_and_contenders_select_cases_and_columns(monkeypatch):
    """--match keeps the cases whose name holds one of its substrings, --contenders the named
    contenders of those (what an A/B run on a GPU uses)."""
    x = jnp.ones(8)

    def cases(ctx):
        return [bench.Case(name, None, [bench.Contender("jax_kernels", lambda: x + 1),
                                        bench.Contender("jnp", lambda: x + 2)])
                for name in ("conv a fwd", "conv b fwd", "conv a wgrad")]

    monkeypatch.setitem(bench.CASES, "fake", cases)
    report = bench.run(["fake"], quick=True, dispatches=1, rounds=1, match=["a fwd", "wgrad"],
                       contenders=["jnp"])
    assert [c["case"] for c in report["cases"]] == ["conv a fwd", "conv a wgrad"]
    assert all(list(c["ms"]) == ["jnp"] for c in report["cases"])
