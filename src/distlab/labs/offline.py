"""MNIST's files for a machine without network: a stand-in that torchvision's own ``MNIST`` class reads.

The GPU tier and ``scripts/play_labs.py --offline-data`` play the labs on it. The labs' GPU branch takes batches
of 128 (512 for the DDP lab's large batch) on each of two ranks, so the stand-in holds 2,100 training images: 1,050
a rank, 8 batches of 128 and 26 left over, 2 of 512 and 26 left over. Real MNIST's 30,000 a rank leave a partial
batch too (48 at 128), and a loader that keeps it takes one step more than ``distlab.train``, which drops it: so
the stand-in is not a multiple of any lab's batch, and a lab played on it meets that difference.
"""

from __future__ import annotations

from pathlib import Path

from ..data import write_tiny_mnist

TRAIN_IMAGES, TEST_IMAGES = 2100, 512


def write_offline_mnist(root: str | Path) -> Path:
    """MNIST-format files under ``root`` (``root/MNIST/raw``), large enough for every lab's GPU batches."""
    return write_tiny_mnist(Path(root), train_size=TRAIN_IMAGES, test_size=TEST_IMAGES)
