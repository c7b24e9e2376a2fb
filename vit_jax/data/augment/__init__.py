"""T2T-ViT / DeiT ImageNet training augmentations (TensorFlow ops).

Reproduces, as TensorFlow ops usable eagerly and inside `tf.data` maps, the
timm (pytorch-image-models) augmentations that T2T-ViT and DeiT train with:

* `rand_augment`: timm `rand_augment_transform('rand-m9-mstd0.5-inc1')`
  (RandAugment with timm's op list, level mappings, per-op probability 0.5 and
  Gaussian magnitude noise), with every op defined as PIL's `ImageOps` /
  `ImageEnhance` / `Image.transform` define it (see the op functions below);
* `random_erasing`: timm `RandomErasing(mode='pixel')`, applied to one
  normalized image;
* `mixup_cutmix`: timm `Mixup(mode='batch', correct_lam=True)` on a batch of
  images and label vectors.

All randomness is *stateless*: every function takes an int64 [2] `seed` and its
output is a deterministic function of (inputs, seed, arguments), so that a
resumed run sees exactly the augmentations of an uninterrupted one. Random
numbers are not those of timm (which uses Python's / numpy's global RNGs), only
their distributions are.

Known differences from timm / PIL (documented where they occur):
* geometric ops always interpolate bilinearly (timm picks bilinear or bicubic
  at random when `interpolation='random'`, as in T2T-ViT; DeiT uses bicubic),
  with float32 rather than float64 arithmetic: a pixel can differ by 1 from
  PIL's;
* Posterize with 0 bits gives black (as PIL < 9 did; current PIL raises).

Modules: `pil_ops` (the PIL-equivalent ops), `randaugment` (timm's level mappings and op
lists, the RandAugment policy), `erasing` (random erasing), `mixing` (Mixup / CutMix),
`stateless` (the seeded random numbers all of them draw). This package exports their public names.
"""

from vit_jax.data.augment.erasing import random_erasing
from vit_jax.data.augment.mixing import mixup_cutmix
from vit_jax.data.augment.pil_ops import (IMAGENET_FILL, affine, auto_contrast, brightness,
                                          color, contrast, equalize, grayscale, invert,
                                          posterize, rotate, sharpness, shear_x, shear_y, smooth,
                                          solarize, solarize_add, translate_x, translate_x_rel,
                                          translate_y, translate_y_rel)
from vit_jax.data.augment.randaugment import (MAX_LEVEL, OP_NAMES, RAND_INCREASING_TRANSFORMS,
                                              RAND_TRANSFORMS, apply_op, level_to_arg,
                                              rand_augment, sample_magnitude)

__all__ = [
    'IMAGENET_FILL',
    'MAX_LEVEL',
    'OP_NAMES',
    'RAND_INCREASING_TRANSFORMS',
    'RAND_TRANSFORMS',
    'affine',
    'apply_op',
    'auto_contrast',
    'brightness',
    'color',
    'contrast',
    'equalize',
    'grayscale',
    'invert',
    'level_to_arg',
    'mixup_cutmix',
    'posterize',
    'rand_augment',
    'random_erasing',
    'rotate',
    'sample_magnitude',
    'sharpness',
    'shear_x',
    'shear_y',
    'smooth',
    'solarize',
    'solarize_add',
    'translate_x',
    'translate_x_rel',
    'translate_y',
    'translate_y_rel',
]
