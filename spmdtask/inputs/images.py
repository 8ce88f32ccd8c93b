"""A synthetic image-classification input: deterministic per (seed, step, row)."""
import dataclasses

import numpy as np

from spmdtask.core.host_input import StepIndexedInput


@dataclasses.dataclass
class SyntheticImageInput(StepIndexedInput):
  """Images of a class are that class's fixed random pattern plus Gaussian noise.

  The patterns depend on `class_seed` only, so a train and an eval input with different
  `seed`s draw different examples of the same classes (the labels are learnable).

  Attributes:
    batch_size: the GLOBAL batch size; each process yields its own rows.
    image_size, channels: images are [image_size, image_size, channels] float32.
    num_classes: labels are in [0, num_classes).
    noise: standard deviation of the noise added to a class's pattern.
    seed: with the step and row, fixes every example, whatever the process count.
    class_seed: fixes the class patterns.
    num_batches / num_examples: as `SyntheticLmInput` (None = endless).
  """
  batch_size: int = 16
  image_size: int = 16
  channels: int = 3
  num_classes: int = 10
  noise: float = 1.0
  seed: int = 0
  class_seed: int = 0
  num_batches: int | None = None
  num_examples: int | None = None
  process_index: int | None = None
  process_count: int | None = None

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    """This process's rows of global batch number `step`."""
    shape = (self.image_size, self.image_size, self.channels)
    patterns = np.random.default_rng(self.class_seed).normal(size=(self.num_classes,) + shape)
    rows = self.local_rows(step) - step * self.batch_size
    labels = np.empty(len(rows), np.int32)
    images = np.empty((len(rows),) + shape, np.float32)
    for i, row in enumerate(rows):
      g = np.random.default_rng((self.seed, step, int(row)))
      labels[i] = g.integers(0, self.num_classes)
      images[i] = patterns[labels[i]] + self.noise * g.normal(size=shape)
    return {"images": images, "labels": labels, "weights": np.ones(len(rows), np.float32)}
