"""The demo (``python -m jax_kernels.demo``) runs end to end: a short training run in this process
prints an ``accuracy:`` line, writes its PNGs and lowers the loss. Skipped when the demo's
optional packages (the ``demo`` extra: scikit-learn, tqdm, Pillow) are not installed."""

import importlib.util
import re

import numpy as np
import pytest

_MISSING = [package for module, package in (("sklearn", "scikit-learn"), ("tqdm", "tqdm"),
                                            ("PIL", "Pillow"))
            if importlib.util.find_spec(module) is None]
pytestmark = pytest.mark.skipif(
    bool(_MISSING), reason=f"the demo needs {', '.join(_MISSING)} (pip install -e '.[demo]')")


def test_demo_trains_and_writes_its_figures(tmp_path, capsys):
    from jax_kernels import demo

    result = demo.main(["--steps", "40", "--out", str(tmp_path), "--seed", "3"])
    lines = capsys.readouterr().out.strip().splitlines()

    match = re.fullmatch(r"accuracy: (\d+\.\d+)", lines[-1])
    assert match, f"the last line is not 'accuracy: 0.xx': {lines[-1]!r}"
    assert 0.0 <= float(match.group(1)) <= 1.0
    assert float(match.group(1)) == pytest.approx(result["accuracy"], abs=0.005)
    assert lines[-2].startswith("canvas-head accuracy: ")
    assert 0.0 <= result["canvas_accuracy"] <= 1.0

    for name in ("transformer.png", "canvases.png"):
        path = tmp_path / name
        assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name

    losses = result["losses"]
    assert losses.shape == (40,) and np.all(np.isfinite(losses))
    assert losses[-10:].mean() < 0.95 * losses[:10].mean(), losses
