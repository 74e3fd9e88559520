"""``quiver bench train``: a real torchvision model trained through the mount, beside the
same training from a local directory and on the device alone.

The dataset is an ImageFolder of synthetic JPEGs (``data.write_synthetic_tree``), read
with ``RandomResizedCrop`` + flip by a ``DataLoader`` with worker processes
(``pin_memory`` and bf16 autocast + channels_last on cuda). Each run trains a fresh model
(same seed) for WARMUP batches, then times the next TIMED batches; its batch sampler
hands out exactly that many batches, so the workers read no item the model is not
trained on. Four runs:

- ``gpu_only``: the same model and batch size on one batch of tensors already on the
  device (on ``--device cpu``: the CPU alone), the upper bound;
- ``local``: ImageFolder(src), the page cache dropped from the local files first;
- ``exact``: ImageFolder(mount/NAME), NAME a fresh mount name (no kernel page cache),
  every item in mountd's store (a fill pass read them all), the store's files dropped
  from the page cache;
- ``sampler``: the same over another fresh name, batches from ``QuiverBatchSampler``.

For the mount runs the report holds mountd's CPU and its FUSE requests by opcode over
the run, divided by the images read (warm-up included: mountd served those too).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
import torchvision
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler
from torchvision import transforms

from digest_tools.create import create_digest
from quiverfs.bench.cpu_time import process_cpu_seconds
from quiverfs.bench.data import write_synthetic_tree
from quiverfs.bench.processes import MountdProcess, running_mountd
from quiverfs.bench.read import drop_page_cache, files_under, read_all, remount
from quiverfs.errors import ExitCode, QuietError
from quiverfs.torch import QuiverBatchSampler

log = logging.getLogger(__name__)

SEED = 0
PREFETCH_FACTOR = 4
FILL_THREADS = 16
# ImageNet's channel means and deviations, as torchvision's pretrained models expect
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclasses.dataclass(frozen=True)
class Setup:
    """One size of the benchmark."""

    items: int
    classes: int
    mean_bytes: int  # of a JPEG
    model: str
    crop: int  # RandomResizedCrop's side, pixels
    batch_size: int
    warmup_batches: int
    timed_batches: int
    workers: int  # DataLoader worker processes

    @property
    def batches(self) -> int:
        """The batches a run trains on, warm-up included."""
        return self.warmup_batches + self.timed_batches


FULL = Setup(items=20_000, classes=100, mean_bytes=75_000, model="resnet50", crop=224,
             batch_size=256, warmup_batches=5, timed_batches=35, workers=os.cpu_count() or 1)
QUICK = Setup(items=400, classes=10, mean_bytes=30_000, model="resnet18", crop=64,
              batch_size=16, warmup_batches=2, timed_batches=8, workers=2)


class FirstBatches(Sampler[list[int]]):
    """The first ``count`` batches of a batch sampler."""

    def __init__(self, batches: Iterable[list[int]], count: int) -> None:
        self.batches = batches
        self.count = count

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batches), self.count)

    def __len__(self) -> int:
        return self.count


class Trainer:
    """A fresh model with its loss and optimizer on one device; one step per batch."""

    def __init__(self, model: str, classes: int, device: str) -> None:
        torch.manual_seed(SEED)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.memory_format = torch.channels_last if self.cuda else torch.contiguous_format
        self.model = torchvision.models.get_model(model, weights=None, num_classes=classes)
        self.model.to(self.device, memory_format=self.memory_format).train()
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9,
                                         weight_decay=1e-4)
        self.loss = torch.zeros((), device=self.device)

    def put(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor,
                                                                        torch.Tensor]:
        """A batch on the device, in the model's memory format (a no-op if it is there)."""
        return (images.to(self.device, non_blocking=True, memory_format=self.memory_format),
                labels.to(self.device, non_blocking=True))

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        images, labels = self.put(images, labels)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cuda):
            out = self.model(images)
            # inception_v3 and googlenet also return their auxiliary heads when training
            logits = out[0] if isinstance(out, tuple) else out
            loss = self.loss_fn(logits, labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.loss = loss.detach()

    def sync(self) -> None:
        """Wait for the device's queued work, so that a clock reading follows it."""
        if self.cuda:
            torch.cuda.synchronize(self.device)


def train(trainer: Trainer, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
          setup: Setup) -> dict[str, Any]:
    """WARMUP steps, then TIMED timed ones: images/s of the timed steps."""
    it = iter(batches)
    warmup_images = 0
    for images, labels in itertools.islice(it, setup.warmup_batches):
        trainer.step(images, labels)
        warmup_images += len(labels)
    trainer.sync()
    started = time.perf_counter()
    timed = timed_images = 0
    for images, labels in it:
        trainer.step(images, labels)
        timed += 1
        timed_images += len(labels)
    trainer.sync()
    seconds = time.perf_counter() - started
    if timed != setup.timed_batches:
        raise RuntimeError(f"{timed} timed batches, not {setup.timed_batches}: the "
                           "dataset is too small for the run")
    loss = float(trainer.loss)
    if not loss > 0:  # also refuses nan
        raise RuntimeError(f"the last step's loss is {loss}")
    return {"images_per_s": round(timed_images / seconds, 1), "seconds": round(seconds, 3),
            "batches": timed, "images": timed_images,
            "images_read": warmup_images + timed_images, "loss": round(loss, 4)}


def transform(crop: int) -> transforms.Compose:
    return transforms.Compose([transforms.RandomResizedCrop(crop),
                               transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                               transforms.Normalize(MEAN, STD)])


def loader(dataset: torchvision.datasets.ImageFolder, batches: Sampler[list[int]],
           setup: Setup, cuda: bool) -> DataLoader:
    return DataLoader(dataset, batch_sampler=batches, num_workers=setup.workers,
                      pin_memory=cuda, prefetch_factor=PREFETCH_FACTOR)


def shuffled(dataset: Sized, setup: Setup) -> FirstBatches:
    """A shuffled epoch's first batches, as DataLoader(shuffle=True) draws them."""
    generator = torch.Generator().manual_seed(SEED)
    return FirstBatches(BatchSampler(RandomSampler(dataset, generator=generator),
                                     setup.batch_size, drop_last=True),
                        setup.batches)


def gpu_only(setup: Setup, model: str, device: str) -> dict[str, Any]:
    trainer = Trainer(model, setup.classes, device)
    generator = torch.Generator().manual_seed(SEED)
    batch = trainer.put(torch.randn(setup.batch_size, 3, setup.crop, setup.crop,
                                    generator=generator),
                        torch.randint(setup.classes, (setup.batch_size,), generator=generator))
    return train(trainer, itertools.repeat(batch, setup.batches), setup)


def local(src: str, setup: Setup, model: str, device: str) -> dict[str, Any]:
    drop_page_cache(files_under(src))
    dataset = torchvision.datasets.ImageFolder(src, transform=transform(setup.crop))
    trainer = Trainer(model, setup.classes, device)
    return train(trainer, loader(dataset, shuffled(dataset, setup), setup, trainer.cuda),
                 setup)


def _dataset_counters(m: MountdProcess, name: str) -> Counter[str]:
    return Counter(next(d["counters"] for d in m.status()["datasets"] if d["name"] == name))


def through_mount(m: MountdProcess, data: bytes, name: str, setup: Setup, model: str,
                  device: str, sampler: bool) -> dict[str, Any]:
    """A run over a fresh mount name of ``data``, its store's pages dropped first."""
    drop_page_cache(files_under(os.path.join(m.cache_dir, "store")))
    root = remount(m, data, name)
    dataset = torchvision.datasets.ImageFolder(root, transform=transform(setup.crop))
    trainer = Trainer(model, setup.classes, device)
    job = QuiverBatchSampler(root, setup.batch_size, seed=SEED, dataset=dataset) \
        if sampler else None
    batches = FirstBatches(job, setup.batches) if job is not None else shuffled(dataset, setup)
    try:
        requests0 = Counter(m.status()["fuse_requests"])
        cpu0 = process_cpu_seconds(m.proc.pid)
        out = train(trainer, loader(dataset, batches, setup, trainer.cuda), setup)
        time.sleep(0.2)  # the kernel sends RELEASE after close returns
        cpu = process_cpu_seconds(m.proc.pid) - cpu0
        requests = Counter(m.status()["fuse_requests"]) - requests0
    finally:
        if job is not None:
            job.close()
    images = out["images_read"]
    return {**out, "mountd_cpu_s": round(cpu, 3),
            "mountd_cpu_ms_per_image": round(cpu * 1e3 / images, 4),
            "fuse_requests_per_image": round(sum(requests.values()) / images, 3),
            "fuse_requests": dict(sorted(requests.items())),
            # a fresh name: the dataset's counters are this run's
            "counters": dict(sorted(_dataset_counters(m, name).items()))}


def _check(model: str, device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise QuietError("--device cuda: torch sees no CUDA device here (use --device cpu)",
                         ExitCode.USAGE)
    models = torchvision.models.list_models(module=torchvision.models)
    if model not in models:
        raise QuietError(f"--model {model!r} is not a torchvision classifier (these are: "
                         f"{', '.join(models)})", ExitCode.USAGE)


def run(quick: bool, workdir: str, model: str | None = None,
        device: str | None = None) -> dict[str, Any]:
    """The four runs of ``model`` (default: the size's) on ``device`` (default: cuda
    where torch sees one, else cpu)."""
    setup = QUICK if quick else FULL
    model = model or setup.model
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    _check(model, device)
    # fixed input sizes: let cuDNN pick its fastest kernels, as torchvision's reference
    # training script does
    torch.backends.cudnn.benchmark = device == "cuda"
    src = os.path.join(workdir, "src")
    tree = write_synthetic_tree(src, setup.items, n_classes=setup.classes, seed=SEED,
                                mean_size=setup.mean_bytes)
    data = create_digest(src, "train", workers=os.cpu_count() or 1)
    runs: dict[str, dict[str, Any]] = {"gpu_only": gpu_only(setup, model, device)}
    log.info("gpu_only: %s images/s", runs["gpu_only"]["images_per_s"])
    runs["local"] = local(src, setup, model, device)
    log.info("local: %s images/s", runs["local"]["images_per_s"])
    with running_mountd(workdir, cache_size=str(tree.bytes * 2 + (64 << 20)),
                        name="train") as m:
        fill = remount(m, data, "fill")
        read_all(files_under(fill), FILL_THREADS)
        for name in ("exact", "sampler"):
            runs[name] = through_mount(m, data, name, setup, model, device,
                                       sampler=name == "sampler")
            log.info("%s: %s images/s", name, runs[name]["images_per_s"])
    local_rate = runs["local"]["images_per_s"]
    summary = {"train_ratio_exact": round(runs["exact"]["images_per_s"] / local_rate, 3),
               "train_ratio_sampler": round(runs["sampler"]["images_per_s"] / local_rate, 3),
               "images_per_s_local": local_rate,
               "images_per_s_gpu_only": runs["gpu_only"]["images_per_s"],
               "mountd_cpu_ms_per_image": runs["exact"]["mountd_cpu_ms_per_image"],
               "fuse_requests_per_image": runs["exact"]["fuse_requests_per_image"]}
    return {"summary": summary, "runs": runs,
            "settings": {**dataclasses.asdict(setup), "model": model, "device": device,
                         "prefetch_factor": PREFETCH_FACTOR, "torch": torch.__version__,
                         "cuda_device": torch.cuda.get_device_name(device)
                         if device == "cuda" else None},
            "dataset": {"items": tree.files, "bytes": tree.bytes, "classes": tree.classes}}
