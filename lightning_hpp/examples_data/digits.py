"""The digits data set of scikit-learn as a LightningDataModule.

``sklearn.datasets.load_digits`` reads 1797 8x8 grayscale images of handwritten digits from a file
shipped inside scikit-learn, so the example trains without any download. The module splits them
once, stratified by class and with a fixed seed, into a training and a validation set, and makes
every batch divisible into the pipeline's micro-batches.
"""

from __future__ import annotations

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpp.validation import check_int

NUM_CLASSES = 10
NUM_IMAGES = 1797
PIXEL_MAX = 16.0
"""The digits images hold integer intensities 0..16."""


class DigitsDataError(ValueError):
    """A :class:`DigitsDataModule` setting that cannot work; the message names the value and the fix."""


class DigitsDataModule(L.LightningDataModule):
    """Train / validation loaders over scikit-learn's bundled digits images.

    Images are scaled to ``[0, 1]``, standardised with the training split's mean and standard
    deviation, optionally resized to ``image_size`` x ``image_size`` (bilinear), and served as
    ``float32`` tensors of shape ``(1, image_size, image_size)`` with ``int64`` labels.

    Training batches all have exactly ``batch_size`` samples (``drop_last=True``); the default
    validation split (384 images) and ``val_batch_size`` (96) cut the validation set into equal
    batches, also when two data-parallel replicas share it.

    Args:
        batch_size: Training batch size (the global batch of one pipeline replica).
        val_batch_size: Validation and prediction batch size.
        val_size: Number of images in the validation split (stratified by class).
        image_size: Side of the served images: 8 (native) or larger to upsample.
        n_microbatches: The pipeline's micro-batch count; both batch sizes must be divisible by it.
        seed: Seed of the train / validation split (independent of the training seed).

    Raises:
        DigitsDataError: a setting that is out of range or a batch size that the micro-batch count
            does not divide.
    """

    def __init__(
        self,
        batch_size: int = 64,
        val_batch_size: int = 96,
        val_size: int = 384,
        image_size: int = 8,
        n_microbatches: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (
            ("batch_size", batch_size),
            ("val_batch_size", val_batch_size),
            ("n_microbatches", n_microbatches),
        ):
            check_int(value, f"DigitsDataModule({name}=...)", error=DigitsDataError)
        for name, value in (("batch_size", batch_size), ("val_batch_size", val_batch_size)):
            if value % n_microbatches:
                fix = value - value % n_microbatches or n_microbatches
                raise DigitsDataError(
                    f"`DigitsDataModule({name}={value!r})` is not divisible by n_microbatches="
                    f"{n_microbatches!r}, so its batches cannot be cut into equal micro-batches. "
                    f"Use a multiple of {n_microbatches}, e.g. {name}={fix}."
                )
        max_val = NUM_IMAGES - batch_size
        check_int(
            val_size,
            "DigitsDataModule(val_size=...)",
            minimum=NUM_CLASSES,
            maximum=max_val,
            error=DigitsDataError,
            hint=f"{NUM_CLASSES}: one image per class; {max_val}: one training batch of {batch_size} "
            f"left out of {NUM_IMAGES} images.",
        )
        check_int(
            image_size,
            "DigitsDataModule(image_size=...)",
            minimum=8,
            error=DigitsDataError,
            hint="The digits images are 8x8; larger sizes upsample them.",
        )
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size
        self.val_size = val_size
        self.image_size = image_size
        self.n_microbatches = n_microbatches
        self.seed = seed
        self.train_indices: np.ndarray | None = None
        self.val_indices: np.ndarray | None = None
        self.mean: float | None = None
        self.std: float | None = None
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        """Load the images from scikit-learn's package data and split them (idempotent)."""
        if self.train_set is not None:
            return
        images, labels = load_digits_arrays()
        self.train_indices, self.val_indices = split_indices(labels, self.val_size, self.seed)
        train = images[self.train_indices] / PIXEL_MAX
        self.mean, self.std = float(train.mean()), float(train.std())
        self.train_set = self._dataset_of(images, labels, self.train_indices)
        self.val_set = self._dataset_of(images, labels, self.val_indices)

    def _dataset_of(self, images: np.ndarray, labels: np.ndarray, indices: np.ndarray) -> TensorDataset:
        return TensorDataset(self._prepare(images[indices]), torch.from_numpy(labels[indices]))

    def _prepare(self, images: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(images / PIXEL_MAX).float()
        x = ((x - self.mean) / self.std).unsqueeze(1)  # (N, 1, 8, 8)
        if self.image_size != 8:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
        return x.contiguous()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self._dataset("train"), batch_size=self.batch_size, shuffle=True, drop_last=True, num_workers=0
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset("val"), batch_size=self.val_batch_size, shuffle=False, num_workers=0)

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def _dataset(self, split: str) -> TensorDataset:
        self.setup()
        return self.train_set if split == "train" else self.val_set


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 digits images ``(N, 8, 8)`` as float64 in 0..16 and their int64 labels.

    Raises:
        ImportError: scikit-learn is not installed.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError(
            "The digits data set comes with scikit-learn, which is not installed. Install it with "
            "`pip install 'lightning-hpp[examples]'` (or `pip install scikit-learn`)."
        ) from err
    bunch = load_digits()
    return np.asarray(bunch.images, dtype=np.float64), np.asarray(bunch.target, dtype=np.int64)


def split_indices(labels: np.ndarray, val_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A stratified, seeded train / validation split of ``range(len(labels))``.

    Args:
        labels: Class label of every sample.
        val_size: Number of validation samples.
        seed: Seed of the split.

    Returns:
        Sorted training indices and sorted validation indices (disjoint, covering all samples).
    """
    from sklearn.model_selection import train_test_split

    train, val = train_test_split(
        np.arange(len(labels)), test_size=val_size, stratify=labels, random_state=seed, shuffle=True
    )
    return np.sort(train), np.sort(val)
