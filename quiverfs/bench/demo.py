"""``make demo``: digest the digits dataset, mount it, train a small CNN through the mount.

Everything is real: the ``quiver`` CLI, a mountd process with a FUSE mount, a
diskcache store on disk, torchvision's ImageFolder and a multi-worker DataLoader.
The "bucket" is a local directory (file://), the embedded default.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torchvision
from torch import nn

from quiverfs.bench.data import write_digits_tree
from quiverfs.bench.processes import unmount
from quiverfs.mount_point import is_mounted

EPOCHS = 4


def quiver(*args: str) -> str:
    """Run a real ``quiver`` command, echoing it like a shell session."""
    print(f"$ quiver {' '.join(shlex.quote(a) for a in args)}", flush=True)
    out = subprocess.run([sys.executable, "-m", "quiverfs.cli", *args], check=True,
                         capture_output=True, text=True).stdout
    print(out, end="", flush=True)
    return out


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def train(dataset_root: str) -> float:
    """Train on 80% of ImageFolder(dataset_root), return test accuracy on the rest (%)."""
    tf = torchvision.transforms.Compose([torchvision.transforms.Grayscale(),
                                         torchvision.transforms.ToTensor()])
    data = torchvision.datasets.ImageFolder(dataset_root, transform=tf)
    gen = torch.Generator().manual_seed(0)
    train_set, test_set = torch.utils.data.random_split(data, [0.8, 0.2], generator=gen)
    loader = torch.utils.data.DataLoader(train_set, batch_size=64, shuffle=True,
                                         num_workers=2, generator=gen)
    torch.manual_seed(0)
    model = small_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for epoch in range(EPOCHS):
        start, total = time.monotonic(), 0.0
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            total += loss.item() * len(y)
        print(f"epoch {epoch + 1}: loss {total / len(train_set):.3f}, "
              f"{time.monotonic() - start:.2f} s", flush=True)
    correct = 0
    with torch.no_grad():
        for x, y in torch.utils.data.DataLoader(test_set, batch_size=256, num_workers=2):
            correct += (model(x).argmax(1) == y).sum().item()
    return 100.0 * correct / len(test_set)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="quiver-demo-") as work:
        src, root, cache = (os.path.join(work, d) for d in ("bucket", "mnt", "cache"))
        os.makedirs(root)
        tree = write_digits_tree(os.path.join(src, "digits"))
        print(f"the 'bucket' is {src} (a local directory); {tree.files} digit images\n")
        digest = os.path.join(work, "digits.qd")
        quiver("digest", "create", tree.root, "-o", digest, "--name", "digits")
        try:
            quiver("mountd", "--root", root, "--cache-dir", cache, "--cache-size", "64M")
            quiver("mount", digest, "--root", root)
            dataset = os.path.join(root, "digits")
            print(f"\ntraining a small CNN on ImageFolder({dataset!r}) "
                  f"with DataLoader(num_workers=2)")
            accuracy = train(dataset)
            print(f"test accuracy: {accuracy:.1f}%\n")
            quiver("status", "--root", root)
            quiver("umount", "digits", "--root", root)
        finally:
            stop_mountd(root)
    return 0


def stop_mountd(root: str) -> None:
    """SIGTERM the background mountd (its pid comes from status) and wait for the unmount."""
    try:
        pid = json.loads(subprocess.run(
            [sys.executable, "-m", "quiverfs.cli", "status", "--json", "--root", root],
            check=True, capture_output=True, text=True).stdout)["pid"]
    except subprocess.CalledProcessError:
        pid = None  # it never started
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while is_mounted(root) and time.monotonic() < deadline:
            time.sleep(0.1)
    unmount(root)
    print(f"mountd stopped, {root} unmounted")


if __name__ == "__main__":
    sys.exit(main())
