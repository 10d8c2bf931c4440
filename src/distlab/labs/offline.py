"""MNIST's files for a machine without network: a stand-in that torchvision's own ``MNIST`` class reads.

The GPU tier and ``scripts/play_labs.py --offline-data`` play the labs on it. The labs' GPU branch takes batches
of 128 (512 for the DDP lab's large batch) on each of two ranks, so the stand-in holds 2,048 training images: 8
batches of 128 a rank, 2 of 512 (the first GPU run's size; lab 0 played in 60 s on one H200).
"""

from __future__ import annotations

from pathlib import Path

from ..testing import write_tiny_mnist

TRAIN_IMAGES, TEST_IMAGES = 2048, 512


def write_offline_mnist(root: str | Path) -> Path:
    """MNIST-format files under ``root`` (``root/MNIST/raw``), large enough for every lab's GPU batches."""
    return write_tiny_mnist(Path(root), train_size=TRAIN_IMAGES, test_size=TEST_IMAGES)
