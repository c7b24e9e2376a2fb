"""T2T-ViT / DeiT ImageNet training augmentations: timm's, as TensorFlow ops (eager or tf.data).
Each takes an int64 ``[2]`` seed, so a resumed run sees the augmentations of an uninterrupted one
(timm's distributions, not its random numbers). Differences from timm / PIL: geometric ops always
bilinear (:func:`affine`); Posterize with 0 bits gives black (PIL < 9)."""

from vit_jax.data.augment.mixing import mixup_cutmix, random_erasing
from vit_jax.data.augment.randaugment import (IMAGENET_FILL, MAX_LEVEL, OP_NAMES,
                                              RAND_INCREASING_TRANSFORMS, RAND_TRANSFORMS, affine,
                                              apply_op, auto_contrast, brightness, color,
                                              contrast, equalize, grayscale, invert, level_to_arg,
                                              posterize, rand_augment, rotate, sample_magnitude,
                                              sharpness, shear_x, shear_y, smooth, solarize,
                                              solarize_add, translate_x, translate_x_rel,
                                              translate_y, translate_y_rel)

__all__ = [
    'IMAGENET_FILL', 'MAX_LEVEL', 'OP_NAMES', 'RAND_INCREASING_TRANSFORMS', 'RAND_TRANSFORMS',
    'affine', 'apply_op', 'auto_contrast', 'brightness', 'color', 'contrast', 'equalize',
    'grayscale', 'invert', 'level_to_arg', 'mixup_cutmix', 'posterize', 'rand_augment',
    'random_erasing', 'rotate', 'sample_magnitude', 'sharpness', 'shear_x', 'shear_y', 'smooth',
    'solarize', 'solarize_add', 'translate_x', 'translate_x_rel', 'translate_y', 'translate_y_rel',
]
