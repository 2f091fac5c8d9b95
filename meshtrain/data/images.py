"""Image classification data: the embedded 8×8 digits, a user ``.npz`` of images, fake images.

Every image source becomes a "classify" dataset whose rows are the images flattened in
[H, W, C] order (float32), with the image shape kept on the dataset (``image_shape``) so a
convolutional model can check it and fold the rows back. Batching, sharding over processes
and the resumable position are the array datasets' own (`meshtrain.data.batches`).

The digits are the 1,797 8×8 images of the UCI "Optical Recognition of Handwritten Digits"
test set (E. Alpaydin and C. Kaynak, 1998; CC BY 4.0), the copy scikit-learn ships as its
``load_digits``; pixels are counts 0..16, scaled here to [0, 1]. They are stored in
``digits.npz`` beside this module (45 kB), so nothing is downloaded and scikit-learn is not
needed.
"""

from __future__ import annotations

import functools
import zipfile
from pathlib import Path

import numpy as np

from meshtrain.data.arrays import arrays_dataset, read_npz
from meshtrain.data.batches import Dataset
from meshtrain.data.config import DataConfig, min_size

DIGITS_FILE = Path(__file__).with_name("digits.npz")
FAKE_CLASSES = 10


@functools.lru_cache(maxsize=1)
def digits() -> tuple[np.ndarray, np.ndarray]:
    """The embedded digits: float32 images [1797, 8, 8, 1] in [0, 1] and int32 labels [1797]."""
    with np.load(DIGITS_FILE) as npz:
        images, labels = npz["images"], npz["labels"]
    return (images[..., None] / 16.0).astype(np.float32), labels.astype(np.int32)


def as_images(inputs: np.ndarray, what: str) -> np.ndarray:
    """[N, H, W] or [N, H, W, C] numbers → float32 [N, H, W, C]; uint8 pixels scaled to [0, 1]."""
    inputs = np.asarray(inputs)
    if inputs.ndim not in (3, 4) or not np.issubdtype(inputs.dtype, np.number):
        raise ValueError(
            f"{what}: images must be a numeric array [N, H, W] or [N, H, W, C] (channels "
            f"last), got {inputs.dtype} {inputs.shape}; for [N, C, H, W] arrays save "
            "inputs.transpose(0, 2, 3, 1)"
        )
    if inputs.ndim == 3:
        inputs = inputs[..., None]
    scale = 255.0 if inputs.dtype == np.uint8 else 1.0
    return (inputs / scale).astype(np.float32)


def images_dataset(images, labels, what: str, config: DataConfig) -> Dataset:
    """A classify `Dataset` of flattened `images` [N, H, W, C], with ``image_shape`` set."""
    images = as_images(images, what)
    if np.asarray(labels).ndim != 1:
        raise ValueError(
            f"{what}: targets must be 1-D class ids [N], got shape {np.asarray(labels).shape}"
        )
    flat = images.reshape(len(images), -1)
    data = arrays_dataset(flat, labels, what, **config._common())
    data.image_shape = tuple(int(d) for d in images.shape[1:])
    return data


def fake_images(config: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    """Random images of ``config.image_shape`` with random labels, for throughput runs.

    Enough rows for 8 training batches plus the held-out share; the same for a given seed.
    """
    n = min_size(8 * config.batch_size, config.batch_size, config.val_fraction)
    rng = np.random.default_rng(config.seed)
    images = rng.random((n, *config.image_shape), dtype=np.float32)
    return images, rng.integers(0, FAKE_CLASSES, n).astype(np.int32)


def image_source(config: DataConfig) -> Dataset:
    """The dataset of an image source: ``digits``, ``images`` (an .npz) or ``fake_images``."""
    if config.source == "digits":
        return images_dataset(*digits(), "the embedded digits", config)
    if config.source == "fake_images":
        return images_dataset(*fake_images(config), "fake images", config)
    return images_dataset(*read_image_npz(config.path), f"data.path={config.path!r}", config)


def read_image_npz(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Images and labels of an .npz: ``inputs``/``targets``, or Keras' MNIST/CIFAR layout
    (``x_train``, ``y_train`` and, when present, ``x_test``, ``y_test`` appended last, so the
    held-out tail is test images)."""
    try:
        npz = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile):
        return read_npz(path)  # its one-line error says what the file is instead
    if not isinstance(npz, np.lib.npyio.NpzFile):
        return read_npz(path)
    with npz:
        files = set(npz.files)
        if {"x_train", "y_train"} <= files:
            parts = [("x_train", "y_train")]
            if {"x_test", "y_test"} <= files:
                parts.append(("x_test", "y_test"))
            x = np.concatenate([npz[a] for a, _ in parts])
            y = np.concatenate([np.asarray(npz[b]).reshape(-1) for _, b in parts])
            return x, y
    return read_npz(path)
