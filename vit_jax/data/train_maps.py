"""The training pipeline's per-example and per-batch maps (augmentation, normalization, targets),
keyed by element id so that a resumed run sees an uninterrupted one's batches."""

from __future__ import annotations

import tensorflow as tf

from vit_jax.data import augment
from vit_jax.data import preprocess


class TrainMaps:
  """The training pipeline's maps, keyed by element id (epoch * 2**32 + index): every
  augmentation is a function of (seed, id). Order as timm's loader: crop / flip / resize,
  RandAugment (uint8) and normalization per example (in the parallel map), then Mixup / CutMix
  and random erasing per batch (timm's prefetcher order, T2T-ViT's). Vectorized (static-size
  images, no crop or RandAugment): resize, flip and normalization per batch too."""

  def __init__(self, data_cfg, source, run_key):
    self.data_cfg = data_cfg
    self.source = source
    self.encoded = not data_cfg.cache and source.images_encoded_after_read
    self.vectorized = (source.static_image_hw is not None and data_cfg.augment != 'inception_crop'
                       and data_cfg.randaugment_num_layers <= 0)
    self.augment_key = preprocess.fold_in(run_key, 1)
    self.mix_key = preprocess.fold_in(run_key, 2)
    self.erase_key = preprocess.fold_in(run_key, 3)
    self.mixing = (data_cfg.mixup_alpha > 0 or data_cfg.cutmix_alpha > 0) and data_cfg.mix_prob > 0

  @tf.autograph.experimental.do_not_convert
  def per_example(self, i, ex):
    if self.vectorized:  # Only decode here; the rest is done per batch.
      image = self.source.decode(ex['image'], self.encoded) if self.encoded else ex['image']
    else:
      seed = preprocess.fold_in(self.augment_key, i)
      image = preprocess.train_image(
          ex['image'], encoded=self.encoded, seed=seed,
          size=self.data_cfg.image_size, augment=self.data_cfg.augment,
          min_area=self.data_cfg.inception_crop_min_area, normalization=None,
          pad_pixels=self.data_cfg.pad_crop_pixels)
      # RandAugment on the cropped, flipped uint8 image, as timm does.
      if self.data_cfg.randaugment_num_layers > 0:
        image = tf.cast(augment.rand_augment(
            tf.cast(tf.round(image), tf.uint8), preprocess.fold_in(seed, 1),
            num_layers=self.data_cfg.randaugment_num_layers,
            magnitude=self.data_cfg.randaugment_magnitude,
            magnitude_std=self.data_cfg.randaugment_magnitude_std), tf.float32)
      image = preprocess.normalize(image, self.data_cfg.normalization)
    lab = ex['label']
    if self.source.label.multi_label:  # Ragged label sets -> fixed-size multi-hot.
      lab = preprocess.targets(lab, self.source.label.num_classes, True)
    return i, {'image': image, 'label': lab}

  @tf.autograph.experimental.do_not_convert
  def per_batch(self, ids, ex):
    image = ex['image']
    if self.vectorized:
      key = preprocess.fold_in(self.augment_key, ids[0])
      if self.data_cfg.augment == 'pad_crop':  # Translation, then flip (as per example).
        image = preprocess.pad_crop(image, preprocess.fold_in(key, 1),
                                    self.data_cfg.pad_crop_pixels)
      if self.data_cfg.augment in ('flip', 'pad_crop'):  # Resizing commutes with flipping.
        image = tf.image.stateless_random_flip_left_right(image, key)
      image = preprocess.resize(image, self.data_cfg.image_size)
      image = preprocess.normalize(image, self.data_cfg.normalization)
    labels = ex['label']
    if not self.source.label.multi_label:
      labels = preprocess.targets(labels, self.source.label.num_classes, False)
    if self.mixing:  # One mixing decision per batch (and per process), as timm.
      image, labels = augment.mixup_cutmix(
          image, labels, preprocess.fold_in(self.mix_key, ids[0]),
          mixup_alpha=self.data_cfg.mixup_alpha, cutmix_alpha=self.data_cfg.cutmix_alpha,
          switch_prob=self.data_cfg.mix_switch_prob, prob=self.data_cfg.mix_prob)
    if self.data_cfg.random_erasing > 0:  # After the mix, as T2T-ViT's (timm's prefetcher).
      image = tf.map_fn(lambda args: augment.random_erasing(
          args[0], preprocess.fold_in(self.erase_key, args[1]),
          probability=self.data_cfg.random_erasing), (image, ids), fn_output_signature=tf.float32)
    return {'image': image, 'labels': labels}
