"""The dataset trees the other tests and the benchmarks are built on."""
from __future__ import annotations

import hashlib
import os

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

from quiverfs.bench.data import (MAX_SIZE, MIN_SIZE, Tree, synthetic_sizes,
                                 write_digits_tree, write_synthetic_tree)


def file_hashes(root: str) -> dict[str, str]:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root)] = hashlib.sha256(
                    f.read()).hexdigest()
    return out


def test_digits_tree_is_an_image_folder_of_pngs(digits_tree: Tree) -> None:
    classes = sorted(os.listdir(digits_tree.root))
    assert classes == [str(i) for i in range(10)]
    counts = [len(os.listdir(os.path.join(digits_tree.root, c))) for c in classes]
    assert sum(counts) == digits_tree.files == 1797
    assert min(counts) >= 170  # every digit has ~180 samples
    with Image.open(os.path.join(digits_tree.root, "0", "0000.png")) as img:
        assert (img.format, img.mode, img.size) == ("PNG", "L", (8, 8))
        pixels = np.asarray(img)
    expected = np.rint(load_digits().images[0] * (255 / 16)).astype(np.uint8)
    assert (pixels == expected).all()


def test_digits_tree_is_deterministic(digits_tree: Tree, tmp_path) -> None:
    again = write_digits_tree(str(tmp_path / "again"))
    assert file_hashes(again.root) == file_hashes(digits_tree.root)


def test_synthetic_tree_sizes_classes_and_decoding(synthetic_tree: Tree) -> None:
    classes = sorted(os.listdir(synthetic_tree.root))
    assert len(classes) == synthetic_tree.classes >= 10
    paths = [os.path.join(synthetic_tree.root, c, n) for c in classes
             for n in os.listdir(os.path.join(synthetic_tree.root, c))]
    sizes = [os.path.getsize(p) for p in paths]
    assert len(paths) == synthetic_tree.files and sum(sizes) == synthetic_tree.bytes
    assert all(MIN_SIZE <= s <= MAX_SIZE for s in sizes)
    assert len(set(file_hashes(synthetic_tree.root).values())) == len(paths)  # all distinct
    for p in paths:
        with Image.open(p) as img:
            assert img.format == "JPEG"
            img.load()  # decodes the whole image


def test_synthetic_tree_is_deterministic_per_seed(tmp_path) -> None:
    a = write_synthetic_tree(str(tmp_path / "a"), 12, 10, seed=4)
    b = write_synthetic_tree(str(tmp_path / "b"), 12, 10, seed=4)
    c = write_synthetic_tree(str(tmp_path / "c"), 12, 10, seed=5)
    assert file_hashes(a.root) == file_hashes(b.root)
    assert file_hashes(a.root) != file_hashes(c.root)


def test_synthetic_sizes_look_like_imagenet() -> None:
    sizes = synthetic_sizes(20_000, seed=0)
    assert 100_000 <= sizes.mean() <= 120_000
    assert sizes.min() >= MIN_SIZE and sizes.max() <= MAX_SIZE


def test_synthetic_tree_of_small_files_honours_mean_and_range(tmp_path) -> None:
    tree = write_synthetic_tree(str(tmp_path / "small"), 300, 10, seed=3, mean_size=4_000,
                                size_range=(1_000, 12_000))
    sizes = [os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(tree.root)
             for n in ns]
    assert len(sizes) == tree.files == 300 and sum(sizes) == tree.bytes
    assert 3_600 <= tree.bytes / tree.files <= 4_400
    assert min(sizes) >= 1_000 and max(sizes) <= 12_000
    for d, _, names in os.walk(tree.root):
        for n in names:
            with Image.open(os.path.join(d, n)) as img:
                assert img.format == "JPEG"
                img.load()
