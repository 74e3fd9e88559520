"""Datasets for tests, demos and benchmarks, written as ImageFolder trees.

``write_digits_tree`` exports scikit-learn's handwritten digits (real data, 1797 PNGs).
``write_synthetic_tree`` writes decodable JPEGs with ImageNet-like sizes (or another mean
and range, down to about a kilobyte): each item is one of a few pre-encoded random-noise
images, padded with JPEG comment segments of random bytes up to the item's drawn size,
so gigabytes take seconds and every item has distinct content.
"""
from __future__ import annotations

import bisect
import dataclasses
import io
import math
import os

import numpy as np
from PIL import Image

# Synthetic item sizes in bytes: log-normal (ImageNet-1k train averages ~110 KB),
# clipped to the range seen in practice.
MIN_SIZE = 20_000
MAX_SIZE = 300_000
SIZE_SIGMA = 0.45
JPEG_QUALITY = 90
_BASE_SIDES = range(8, 616, 8)  # noise images from ~0.7 KB to ~320 KB at JPEG_QUALITY
_COM_MAX = 65_533  # payload bytes of one JPEG COM segment (its length field is u16)
_COM_OVERHEAD = 4  # marker (FF FE) + length field
_MIN_PAD = _COM_OVERHEAD + 32  # 32 random bytes make every item's content distinct


@dataclasses.dataclass(frozen=True)
class Tree:
    """A dataset tree written to disk."""

    root: str
    files: int
    bytes: int
    classes: int


def write_digits_tree(dest: str) -> Tree:
    """Write scikit-learn's digits as ``dest/<digit>/<index>.png`` (8x8 greyscale)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = np.rint(digits.images * (255 / 16)).astype(np.uint8)
    total = 0
    for i, (image, target) in enumerate(zip(pixels, digits.target)):
        class_dir = os.path.join(dest, str(target))
        os.makedirs(class_dir, exist_ok=True)
        path = os.path.join(class_dir, f"{i:04d}.png")
        Image.fromarray(image, mode="L").save(path, format="PNG")
        total += os.path.getsize(path)
    return Tree(dest, len(pixels), total, len(set(digits.target.tolist())))


def _base_jpegs(rng: np.random.Generator) -> list[bytes]:
    """Random-noise JPEGs of increasing size (noise does not compress, like photos)."""
    bases = []
    for side in _BASE_SIDES:
        pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels, mode="RGB").save(out, format="JPEG", quality=JPEG_QUALITY)
        bases.append(out.getvalue())
    return sorted(bases, key=len)


def _padded(base: bytes, size: int, rng: np.random.Generator) -> bytes:
    """``base`` with COM segments of random bytes after SOI, making it ``size`` bytes."""
    pad = size - len(base)
    if pad < _MIN_PAD:
        raise ValueError(f"cannot pad a {len(base)}-byte JPEG to {size} bytes")
    count = -(-pad // (_COM_MAX + _COM_OVERHEAD))
    payload = pad - count * _COM_OVERHEAD
    segments = []
    for j in range(count):
        n = payload // count + (1 if j < payload % count else 0)
        segments.append(b"\xff\xfe" + (n + 2).to_bytes(2, "big") + rng.bytes(n))
    return base[:2] + b"".join(segments) + base[2:]


def synthetic_sizes(n_items: int, seed: int, mean_size: int = 110_000,
                    size_range: tuple[int, int] = (MIN_SIZE, MAX_SIZE)) -> np.ndarray:
    """Item sizes in bytes: log-normal with mean ~``mean_size``, clipped to ``size_range``."""
    rng = np.random.default_rng(seed)
    median = mean_size / math.exp(SIZE_SIGMA ** 2 / 2)
    sizes = rng.lognormal(math.log(median), SIZE_SIGMA, n_items)
    return np.clip(np.rint(sizes), *size_range).astype(np.int64)


def write_synthetic_tree(dest: str, n_items: int, n_classes: int = 10, seed: int = 0,
                         mean_size: int = 110_000,
                         size_range: tuple[int, int] = (MIN_SIZE, MAX_SIZE)) -> Tree:
    """Write ``n_items`` JPEGs as ``dest/nCCCCCCCC/nCCCCCCCC_I.JPEG``; same seed, same bytes.
    Sizes as ``synthetic_sizes``; the smallest a JPEG here can be is about 0.8 KB."""
    if n_classes < 1 or n_items < n_classes:
        raise ValueError(f"need at least one item per class ({n_items} items, "
                         f"{n_classes} classes)")
    rng = np.random.default_rng(seed)
    bases = _base_jpegs(rng)
    base_lens = [len(b) for b in bases]
    total = 0
    for c in range(n_classes):
        os.makedirs(os.path.join(dest, f"n{c:08d}"), exist_ok=True)
    for i, size in enumerate(synthetic_sizes(n_items, seed, mean_size, size_range).tolist()):
        # the largest base that leaves room for the padding
        data = _padded(bases[max(0, bisect.bisect_right(base_lens, size - _MIN_PAD) - 1)],
                       size, rng)
        wnid = f"n{i % n_classes:08d}"
        with open(os.path.join(dest, wnid, f"{wnid}_{i}.JPEG"), "wb") as f:
            f.write(data)
        total += len(data)
    return Tree(dest, n_items, total, n_classes)
