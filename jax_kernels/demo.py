"""``python -m jax_kernels.demo``: train a small vision model on every op of jax_kernels.

The data are the 1797 real handwritten digits that scikit-learn ships (8x8 greyscale, no
download), split 80/20 into training and held-out digits with a fixed seed. One jitted
``train_step`` trains three parts together:

* a **spatial transformer** (Jaderberg et al. 2015): random affine distortions (rotation,
  scale, shear, translation) of each digit are rendered at 24x24 with ``affine_grid`` and
  ``grid_sample``; a small ``conv2d`` localisation net predicts a 2x3 matrix per image
  (initialised to the identity), and ``affine_grid`` + ``grid_sample`` resample the distorted
  image with it. It learns from the classification loss and from an alignment loss (the mean
  squared difference to the undistorted digit, which we know because we made the distortion);
* a **depthwise-separable classifier** of the transformer's output: ``repeat`` tiles the grey
  channel, then depthwise (``conv2d`` with ``groups=C``) and pointwise (1x1) convolutions;
* a **Fast R-CNN style head**: 2 to 4 digits pasted (with ``grid_sample`` again) at random
  positions and sizes onto a 48x48 canvas whose boxes are known; a ``conv2d`` feature map of the
  canvas, ``roi_align`` over the digits' boxes, a ``conv2d`` and a classifier of each box.

Adam's moment estimates and an exponential moving average (EMA) of the parameters are updated
with ``lerp``; the EMA parameters are the ones evaluated. The last line printed is the held-out
accuracy of the single-digit classifier (spatial transformer + separable trunk) on distorted
held-out digits, ``accuracy: 0.xx``; the line before it gives the canvas head's accuracy on
held-out digits pasted onto canvases. PNGs of what the transformer does and of the canvases
with their predicted classes go to ``--out``.

Needs the ``demo`` extra (``pip install -e ".[demo]"``: scikit-learn, tqdm, Pillow). Every
random draw comes from ``--seed`` (the split and the held-out distortions from fixed seeds), and
the kernels are deterministic, so a run repeats bit for bit on the same machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jax_kernels as jk

F32 = jnp.float32

# Geometry. Normalised coordinates run over [-1, 1] across an image (align_corners=False).
VIEW = 24              # side of the distorted and transformed single-digit images
SPAN = 2 / 3           # an undistorted digit fills the central 2/3 of the view (16x16 pixels)
MAX_ROTATION = math.radians(40)
SCALES = (0.75, 1.1)   # isotropic scale range of the distortions
MAX_SHEAR = 0.3
MAX_SHIFT = 0.2        # translation, in normalised view units (0.2 = 2.4 pixels)

CANVAS = 48            # canvases are CANVAS x CANVAS ...
CELLS = 3              # ... split into CELLS x CELLS cells, at most one digit per cell
CELL = CANVAS // CELLS
SLOTS = 4              # boxes per canvas; 2 to SLOTS of them hold a digit, the rest are masked
DIGIT_SIZES = (10, 16)  # side in canvas pixels of a pasted digit
FEATURE_STRIDE = 2     # the canvas feature map is CANVAS / 2 on a side
POOL = 6               # roi_align output: POOL x POOL bins per box

# Training.
BATCH = 64             # distorted single digits per step
CANVASES = 16          # canvases per step (SLOTS boxes each)
LEARNING_RATE = 3e-3   # Adam, cosine-decayed to zero over the run
ADAM_B1, ADAM_B2, ADAM_EPS = 0.9, 0.999, 1e-8
EMA_DECAY = 0.995      # the evaluated parameters' EMA (warmed up: see train_step)
ALIGN_WEIGHT = 10.0    # weight of the transformer's alignment loss
SPLIT_SEED = 0         # the train / held-out split (fixed: runs of any --seed are comparable)
EVAL_SEED = 1          # the held-out distortions and canvases (fixed likewise)


# --------------------------------------------------------------------------------------- data

def load_digits(split_seed: int = SPLIT_SEED):
    """sklearn's digits as float32 [N, 1, 8, 8] in [0, 1] and int32 labels, split 80/20."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(split_seed).permutation(len(labels))
    cut = int(round(0.8 * len(labels)))
    train, held_out = order[:cut], order[cut:]
    return (images[train], labels[train]), (images[held_out], labels[held_out])


def random_distortions(key: jax.Array, n: int) -> jax.Array:
    """[n, 2, 3] random affine maps ``p -> M p + t`` of the view (normalised coordinates)."""
    k_rot, k_scale, k_shear, k_shift = jax.random.split(key, 4)
    angle = jax.random.uniform(k_rot, (n,), F32, -MAX_ROTATION, MAX_ROTATION)
    log_scale = jax.random.uniform(k_scale, (n,), F32, math.log(SCALES[0]), math.log(SCALES[1]))
    scale = jnp.exp(log_scale)
    shear = jax.random.uniform(k_shear, (n,), F32, -MAX_SHEAR, MAX_SHEAR)
    shift = jax.random.uniform(k_shift, (n, 2), F32, -MAX_SHIFT, MAX_SHIFT)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    # M = rotation @ shear @ scale, written out.
    m = jnp.stack([jnp.stack([cos, cos * shear - sin], -1),
                   jnp.stack([sin, sin * shear + cos], -1)], -2) * scale[:, None, None]
    return jnp.concatenate([m, shift[:, :, None]], axis=-1)


def render_views(digits: jax.Array, distortions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Renders each 8x8 digit at VIEW x VIEW, distorted by ``p -> M p + t`` and undistorted.

    A view pixel at q shows the digit at ``(M^-1 (q - t)) / SPAN`` (digit coordinates), so the
    sampling matrix is ``[M^-1 | -M^-1 t] / SPAN``; the undistorted view's is ``[I | 0] / SPAN``.
    Both are one ``affine_grid`` + ``grid_sample`` call. A transformer that outputs ``[M | t]``
    maps the distorted view back onto the undistorted one.
    """
    n = digits.shape[0]
    m, t = distortions[:, :, :2], distortions[:, :, 2:]
    det = m[:, 0, 0] * m[:, 1, 1] - m[:, 0, 1] * m[:, 1, 0]
    m_inv = jnp.stack([jnp.stack([m[:, 1, 1], -m[:, 0, 1]], -1),
                       jnp.stack([-m[:, 1, 0], m[:, 0, 0]], -1)], -2) / det[:, None, None]
    distort = jnp.concatenate([m_inv, -m_inv @ t], axis=-1) / SPAN
    identity = jnp.broadcast_to(jnp.eye(2, 3, dtype=F32) / SPAN, (n, 2, 3))
    theta = jnp.concatenate([distort, identity])
    views = jk.grid_sample(jnp.concatenate([digits, digits]),
                           jk.affine_grid(theta, (2 * n, 1, VIEW, VIEW)))
    return views[:n], views[n:]


def random_canvases(key: jax.Array, digits: jax.Array, n: int):
    """``n`` canvases [n, 1, CANVAS, CANVAS] with 2..SLOTS of ``digits`` (cycled) pasted each.

    Returns the canvases, the boxes [n * SLOTS, 5] (canvas index, x1, y1, x2, y2) in canvas
    pixels, the index into ``digits`` of each box and a mask of the boxes that hold a digit.
    Every slot gets a distinct cell of the CELLS x CELLS grid, a size and a position inside it,
    so digits never overlap; masked slots keep a box of an empty region and their digit is not
    drawn.
    """
    k_count, k_cells, k_size, k_pos = jax.random.split(key, 4)
    count = jax.random.randint(k_count, (n, 1), 2, SLOTS + 1)
    present = jnp.arange(SLOTS)[None, :] < count                                   # [n, SLOTS]
    cells = jnp.argsort(jax.random.uniform(k_cells, (n, CELLS * CELLS), F32), axis=1)[:, :SLOTS]
    size = jax.random.randint(k_size, (n, SLOTS), DIGIT_SIZES[0], DIGIT_SIZES[1] + 1).astype(F32)
    # Top-left corner: the cell's corner plus a random offset that keeps the digit in the cell.
    offset = jax.random.uniform(k_pos, (n, SLOTS, 2), F32) * (CELL - size)[..., None]
    corner = jnp.stack([cells % CELLS, cells // CELLS], -1).astype(F32) * CELL + offset
    # Canvas pixels [x1, x1 + size] hold the whole digit: the sampling matrix maps the canvas's
    # normalised coordinates u to the digit's, (u - centre) * CANVAS / size.
    centre = (corner + size[..., None] / 2) * (2 / CANVAS) - 1
    zoom = (CANVAS / size)[..., None]
    theta = jnp.concatenate([jax.vmap(jax.vmap(jnp.diag))(jnp.broadcast_to(zoom, (n, SLOTS, 2))),
                             (-centre * zoom)[..., None]], -1).reshape(n * SLOTS, 2, 3)
    which = jnp.arange(n * SLOTS) % digits.shape[0]
    pasted = jk.grid_sample(digits[which], jk.affine_grid(theta, (n * SLOTS, 1, CANVAS, CANVAS)))
    pasted = pasted.reshape(n, SLOTS, CANVAS, CANVAS) * present[..., None, None]
    canvases = pasted.sum(axis=1, keepdims=True)
    # Column 0 of the boxes is the canvas index: a per-canvas column tiled over its slots.
    canvas_index = jk.repeat(jnp.arange(n, dtype=F32)[:, None], (1, SLOTS))
    boxes = jnp.concatenate([canvas_index[..., None], corner, corner + size[..., None]], -1)
    return canvases, boxes.reshape(n * SLOTS, 5), which, present.reshape(-1)


# -------------------------------------------------------------------------------------- model

def _conv_params(key, out_channels, in_channels, kernel):
    fan_in = in_channels * kernel * kernel
    w = jax.random.normal(key, (out_channels, in_channels, kernel, kernel), F32)
    return {"w": w * math.sqrt(2.0 / fan_in), "b": jnp.zeros((out_channels,), F32)}


def _dense_params(key, in_features, out_features):
    w = jax.random.normal(key, (in_features, out_features), F32)
    return {"w": w * math.sqrt(2.0 / in_features), "b": jnp.zeros((out_features,), F32)}


def init_params(key: jax.Array) -> dict:
    """The parameters of the three parts, as a pytree of float32 arrays."""
    k = iter(jax.random.split(key, 16))
    localisation = {
        "conv1": _conv_params(next(k), 8, 1, 3),     # 24 -> 12, stride 2
        "conv2": _conv_params(next(k), 16, 8, 3),    # 12 -> 6, stride 2
        "fc": _dense_params(next(k), 16 * 6 * 6, 64),
        # The last layer starts at zero weights and the identity's bias: the transformer starts
        # as the identity, the usual initialisation of a spatial transformer.
        "theta": {"w": jnp.zeros((64, 6), F32), "b": jnp.eye(2, 3, dtype=F32).reshape(6)},
    }
    trunk = {  # depthwise (groups = channels) and pointwise (1x1) convolutions
        "dw1": _conv_params(next(k), 16, 1, 3), "pw1": _conv_params(next(k), 32, 16, 1),
        "dw2": _conv_params(next(k), 32, 1, 3), "pw2": _conv_params(next(k), 64, 32, 1),
        "dw3": _conv_params(next(k), 64, 1, 3), "pw3": _conv_params(next(k), 64, 64, 1),
        "fc": _dense_params(next(k), 64, 10),
    }
    detector = {
        "conv1": _conv_params(next(k), 16, 1, 3),    # 48x48
        "conv2": _conv_params(next(k), 32, 16, 3),   # 48 -> 24, stride 2 (FEATURE_STRIDE)
        "conv3": _conv_params(next(k), 32, 32, 3),   # 24x24
        "box_conv": _conv_params(next(k), 64, 32, 3),  # POOL -> POOL - 2 on each box
        "fc": _dense_params(next(k), 64, 10),
    }
    return {"localisation": localisation, "trunk": trunk, "detector": detector}


def _conv(p, x, stride=1, padding="same", groups=1):
    return jk.conv2d(x, p["w"], p["b"], stride=stride, padding=padding, groups=groups)


def _dense(p, x):
    return x @ p["w"] + p["b"]


def transform(params: dict, views: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The spatial transformer: per-image 2x3 matrices and the views resampled with them."""
    p = params["localisation"]
    h = jax.nn.relu(_conv(p["conv1"], views, stride=2, padding=1))
    h = jax.nn.relu(_conv(p["conv2"], h, stride=2, padding=1))
    h = jax.nn.relu(_dense(p["fc"], h.reshape(h.shape[0], -1)))
    theta = _dense(p["theta"], h).reshape(-1, 2, 3)
    return theta, jk.grid_sample(views, jk.affine_grid(theta, views.shape))


def classify(params: dict, images: jax.Array) -> jax.Array:
    """The depthwise-separable trunk: [N, 1, VIEW, VIEW] images -> [N, 10] logits."""
    p = params["trunk"]
    # A depthwise convolution filters each channel on its own: tile the grey channel 16 times so
    # that the first one learns 16 different filters of it.
    h = jk.repeat(images, (1, p["dw1"]["w"].shape[0], 1, 1))
    for i, stride in ((1, 1), (2, 2), (3, 2)):
        dw = p[f"dw{i}"]
        h = _conv(dw, h, stride=stride, padding=1, groups=dw["w"].shape[0])
        h = jax.nn.relu(_conv(p[f"pw{i}"], h))  # pointwise: mixes the channels
    return _dense(p["fc"], h.mean(axis=(2, 3)))  # global average pooling


def detect(params: dict, canvases: jax.Array, boxes: jax.Array) -> jax.Array:
    """The Fast R-CNN style head: canvases and their boxes [K, 5] -> [K, 10] logits per box."""
    p = params["detector"]
    h = jax.nn.relu(_conv(p["conv1"], canvases))
    h = jax.nn.relu(_conv(p["conv2"], h, stride=FEATURE_STRIDE, padding=1))
    h = jax.nn.relu(_conv(p["conv3"], h))
    # Boxes are in canvas pixels; spatial_scale maps them onto the stride-2 feature map.
    # aligned=True: a pixel's centre is at +0.5, as detectron2 does.
    rois = jk.roi_align(h, boxes, POOL, spatial_scale=1 / FEATURE_STRIDE, sampling_ratio=2,
                        aligned=True)
    r = jax.nn.relu(_conv(p["box_conv"], rois, padding=0))
    return _dense(p["fc"], r.mean(axis=(2, 3)))


def _cross_entropy(logits, labels):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)[:, 0]


# ----------------------------------------------------------------------------------- training

def make_batch(key: jax.Array, images: jax.Array, labels: jax.Array) -> dict:
    """A training batch, drawn on the device: distorted views and canvases of training digits."""
    k_pick, k_distort, k_canvas_pick, k_canvas = jax.random.split(key, 4)
    pick = jax.random.randint(k_pick, (BATCH,), 0, images.shape[0])
    distorted, clean = render_views(images[pick], random_distortions(k_distort, BATCH))
    pick_canvas = jax.random.randint(k_canvas_pick, (CANVASES * SLOTS,), 0, images.shape[0])
    canvases, boxes, which, present = random_canvases(k_canvas, images[pick_canvas], CANVASES)
    return {"distorted": distorted, "clean": clean, "labels": labels[pick],
            "canvases": canvases, "boxes": boxes, "box_labels": labels[pick_canvas][which],
            "present": present}


def loss_fn(params: dict, batch: dict) -> tuple[jax.Array, dict]:
    _, transformed = transform(params, batch["distorted"])
    single = _cross_entropy(classify(params, transformed), batch["labels"]).mean()
    align = jnp.mean((transformed - batch["clean"]) ** 2)
    present = batch["present"].astype(F32)
    per_box = _cross_entropy(detect(params, batch["canvases"], batch["boxes"]), batch["box_labels"])
    boxes = jnp.sum(per_box * present) / jnp.sum(present)
    total = single + boxes + ALIGN_WEIGHT * align
    return total, {"single": single, "boxes": boxes, "align": align}


def init_state(key: jax.Array) -> dict:
    params = init_params(key)
    # Separate buffers for each (the step donates its state).
    return {"params": params, "m": jax.tree.map(jnp.zeros_like, params),
            "v": jax.tree.map(jnp.zeros_like, params), "ema": jax.tree.map(jnp.copy, params),
            "step": jnp.zeros((), jnp.int32)}


def train_step(state: dict, images: jax.Array, labels: jax.Array, key: jax.Array,
               total_steps: int) -> tuple[dict, jax.Array, dict]:
    """One step: a fresh batch, the gradient, Adam, and the EMA of the parameters.

    ``total_steps`` is static (the cosine schedule's length).
    """
    step = state["step"]
    batch = make_batch(jax.random.fold_in(key, step), images, labels)
    (loss, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
    # Adam: the moments are EMAs of the gradient and its square, lerp(m, g, 1 - b1).
    m = jax.tree.map(lambda m, g: jk.lerp(m, g, 1 - ADAM_B1), state["m"], grads)
    v = jax.tree.map(lambda v, g: jk.lerp(v, g * g, 1 - ADAM_B2), state["v"], grads)
    t = (step + 1).astype(F32)
    progress = jnp.minimum(step.astype(F32) / total_steps, 1.0)
    lr = LEARNING_RATE * 0.5 * (1 + jnp.cos(math.pi * progress))
    lr = lr * jnp.sqrt(1 - ADAM_B2 ** t) / (1 - ADAM_B1 ** t)  # bias correction
    params = jax.tree.map(lambda p, m, v: p - lr * m / (jnp.sqrt(v) + ADAM_EPS),
                          state["params"], m, v)
    # EMA of the parameters, ema += (1 - decay) * (params - ema), with a decay that starts near
    # 0.2 and grows to EMA_DECAY, so that short runs average only their recent steps.
    decay = jnp.minimum(EMA_DECAY, (1 + t) / (10 + t))
    ema = jax.tree.map(lambda e, p: jk.lerp(e, p, 1 - decay), state["ema"], params)
    return {"params": params, "m": m, "v": v, "ema": ema, "step": step + 1}, loss, parts


@jax.jit
def evaluate(params: dict, views: jax.Array, canvases: jax.Array, boxes: jax.Array):
    """Predictions of the single-digit path (and its transformed views) and of the boxes."""
    _, transformed = transform(params, views)
    return (jnp.argmax(classify(params, transformed), axis=1), transformed,
            jnp.argmax(detect(params, canvases, boxes), axis=1))


def held_out_set(images: np.ndarray, seed: int = EVAL_SEED) -> dict:
    """The evaluation data: each held-out digit distorted once, and canvases of held-out digits
    (about as many boxes as digits), from a fixed key."""
    k_distort, k_canvas, k_order = jax.random.split(jax.random.key(seed), 3)
    digits = jnp.asarray(images)
    distorted, clean = jax.jit(render_views)(digits, random_distortions(k_distort, len(images)))
    order = jax.random.permutation(k_order, len(images))
    n_canvases = -(-len(images) // 3)  # 3 digits per canvas on average
    canvases, boxes, which, present = jax.jit(random_canvases, static_argnums=2)(
        k_canvas, digits[order], n_canvases)
    return {"distorted": distorted, "clean": clean, "canvases": canvases, "boxes": boxes,
            "box_digit": np.asarray(order)[np.asarray(which)], "present": np.asarray(present)}


# ------------------------------------------------------------------------------------ figures

def _to_pil(image: np.ndarray, zoom: int):
    from PIL import Image

    pixels = (np.clip(image, 0, 1) * 255).astype(np.uint8)
    return Image.fromarray(pixels).resize((image.shape[1] * zoom, image.shape[0] * zoom),
                                          Image.NEAREST).convert("RGB")


def _font(size: int):
    """Pillow's default font at ``size`` pixels (its small bitmap font on old or FreeType-less
    Pillows)."""
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ImportError, OSError):
        return ImageFont.load_default()


def save_transformer_grid(path, distorted, transformed, predicted, labels, count=32, zoom=3):
    """Pairs of (distorted input | what the transformer made of it), predicted class under each
    pair (green: right, red: wrong)."""
    from PIL import Image, ImageDraw

    columns, side, pad, caption, title = 8, VIEW * zoom, 6, 16, 20
    rows = -(-count // columns)
    cell_w, cell_h = 2 * side + pad, side + caption
    sheet = Image.new("RGB", (columns * (cell_w + pad) + pad, rows * (cell_h + pad) + pad + title),
                      "white")
    draw, font = ImageDraw.Draw(sheet), _font(13)
    draw.text((pad, 3), "distorted input | spatial transformer output   (predicted / true class)",
              fill="black", font=font)
    for i in range(count):
        x = pad + (i % columns) * (cell_w + pad)
        y = title + pad + (i // columns) * (cell_h + pad)
        sheet.paste(_to_pil(distorted[i, 0], zoom), (x, y))
        sheet.paste(_to_pil(transformed[i, 0], zoom), (x + side + pad, y))
        good = predicted[i] == labels[i]
        draw.text((x, y + side + 1), f"{predicted[i]} / {labels[i]}",
                  fill=(0, 140, 0) if good else (220, 0, 0), font=font)
    sheet.save(path)


def save_canvases(path, canvases, boxes, present, predicted, labels, count=8, zoom=4):
    """Canvases with each digit's box and its predicted class (green: right, red: wrong)."""
    from PIL import Image, ImageDraw

    columns, side, pad = 4, CANVAS * zoom, 8
    rows = -(-count // columns)
    sheet = Image.new("RGB", (columns * (side + pad) + pad, rows * (side + pad) + pad), "white")
    draw, font = ImageDraw.Draw(sheet), _font(15)
    for c in range(count):
        x0, y0 = pad + (c % columns) * (side + pad), pad + (c // columns) * (side + pad)
        sheet.paste(_to_pil(canvases[c, 0], zoom), (x0, y0))
        for k in range(c * SLOTS, (c + 1) * SLOTS):
            if not present[k]:
                continue
            _, x1, y1, x2, y2 = (boxes[k] * zoom).tolist()
            colour = (0, 200, 0) if predicted[k] == labels[k] else (255, 40, 40)
            draw.rectangle((x0 + x1, y0 + y1, x0 + x2 - 1, y0 + y2 - 1), outline=colour, width=2)
            # The class on a tab of the box's colour, in the box's top-left corner.
            at, text = (x0 + x1 + 3, y0 + y1 + 2), str(predicted[k])
            _, _, right, bottom = draw.textbbox(at, text, font=font)
            draw.rectangle((x0 + x1, y0 + y1, right + 2, bottom + 2), fill=colour)
            draw.text(at, text, fill="black", font=font)
    sheet.save(path)


# --------------------------------------------------------------------------------------- main

def select_platform(platform: str | None) -> None:
    """Makes JAX run on ``platform`` ('cpu' or 'gpu'); must run before any computation."""
    if platform is None:
        return  # JAX's default: a GPU if there is one
    jax.config.update("jax_platforms", {"cpu": "cpu", "gpu": "cuda"}[platform])
    try:
        backend = jax.default_backend()
    except Exception as error:  # jax raises RuntimeError or AssertionError when it has no GPU
        raise SystemExit(f"demo: --platform {platform}: JAX found no such device ({error!r}); "
                         "a GPU needs jax's CUDA plugin (pip install \"jax[cuda13]\")") from None
    if backend != platform:  # the backends were started before (e.g. inside another program)
        raise SystemExit(f"demo: --platform {platform}: JAX already runs on {backend}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jax_kernels.demo",
        description="Trains a spatial transformer, a depthwise-separable classifier and a Fast "
                    "R-CNN style box classifier on scikit-learn's handwritten digits, with every "
                    "op of jax_kernels in one jitted step, and prints the held-out accuracy.")
    parser.add_argument("--steps", type=int, default=1500, help="training steps (default: 1500)")
    parser.add_argument("--out", default="demo_out", help="directory for the PNGs (default: "
                        "demo_out)")
    parser.add_argument("--platform", choices=("cpu", "gpu"), default=None,
                        help="where JAX runs (default: JAX's choice, a GPU if there is one)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initialisation and the training batches (default: 0)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the demo; returns the accuracies, the per-step losses and the PNGs' paths."""
    args = parse_args(argv)
    select_platform(args.platform)
    # The demo extra: the data, the progress bar and the figures.
    missing = [package for module, package in (("sklearn", "scikit-learn"), ("tqdm", "tqdm"),
                                               ("PIL", "Pillow"))
               if importlib.util.find_spec(module) is None]
    if missing:
        raise SystemExit(f"demo: needs {', '.join(missing)}: pip install -e \".[demo]\"")
    from tqdm import tqdm

    start = time.perf_counter()
    device = jax.devices()[0]
    print(f"jax {jax.__version__} on {device.device_kind} ({device.platform})")

    (train_x, train_y), (test_x, test_y) = load_digits()
    print(f"sklearn digits: {len(train_y)} training, {len(test_y)} held out")
    images, labels = jnp.asarray(train_x), jnp.asarray(train_y)
    key_init, key_data = jax.random.split(jax.random.key(args.seed))
    state = init_state(key_init)

    # Compile ahead of time, so that the progress bar's throughput is the steps' own.
    step_fn = jax.jit(train_step, static_argnums=4, donate_argnums=0)
    compiled = step_fn.lower(state, images, labels, key_data, args.steps).compile()
    print(f"compiled train_step in {time.perf_counter() - start:.1f} s (from the start)")

    per_step = BATCH + CANVASES  # images per step: distorted digits and canvases
    losses = []
    bar = tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=True)
    tic, done = time.perf_counter(), 0
    for i in bar:
        state, loss, _ = compiled(state, images, labels, key_data)
        losses.append(loss)
        if (i + 1) % 20 == 0 or i + 1 == args.steps:  # synchronises: report now and then
            value = float(loss)
            toc = time.perf_counter()
            rate = (i + 1 - done) * per_step / (toc - tic)
            tic, done = toc, i + 1
            bar.set_postfix({"loss": f"{value:.3f}", "examples/s": f"{rate:.0f}"})
    bar.close()
    losses = np.asarray(jax.device_get(jnp.stack(losses)))
    train_seconds = time.perf_counter() - start

    data = held_out_set(test_x)
    predicted, transformed, box_predicted = jax.device_get(
        evaluate(state["ema"], data["distorted"], data["canvases"], data["boxes"]))
    accuracy = float(np.mean(predicted == test_y))
    box_labels = test_y[data["box_digit"]]
    present = data["present"]
    canvas_accuracy = float(np.mean((box_predicted == box_labels)[present]))
    # How far the views are from the undistorted digits, before and after the transformer.
    clean = np.asarray(data["clean"])
    misalignment = [float(np.mean((views - clean) ** 2))
                    for views in (np.asarray(data["distorted"]), transformed)]

    os.makedirs(args.out, exist_ok=True)
    files = [os.path.join(args.out, "transformer.png"), os.path.join(args.out, "canvases.png")]
    save_transformer_grid(files[0], np.asarray(data["distorted"]), transformed, predicted, test_y)
    save_canvases(files[1], np.asarray(data["canvases"]), np.asarray(data["boxes"]), present,
                  box_predicted, box_labels)

    first, last = losses[:10].mean(), losses[-10:].mean()
    print(f"loss {first:.3f} -> {last:.3f} (mean of the first and last 10 steps); "
          f"{args.steps} steps, {time.perf_counter() - start:.1f} s in all "
          f"({train_seconds:.1f} s to the end of training)")
    print(f"wrote {', '.join(files)}")
    print(f"spatial transformer: mean squared difference to the undistorted held-out digits "
          f"{misalignment[0]:.4f} -> {misalignment[1]:.4f}")
    print(f"canvas-head accuracy: {canvas_accuracy:.2f} "
          f"({int(present.sum())} boxes of held-out digits on {len(data['canvases'])} canvases)")
    print(f"accuracy: {accuracy:.2f}")
    return {"accuracy": accuracy, "canvas_accuracy": canvas_accuracy, "losses": losses,
            "misalignment": misalignment, "files": files}


if __name__ == "__main__":
    main()
