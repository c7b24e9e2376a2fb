"""Default `config.data` for the vit_jax input pipeline."""

import ml_collections
from ml_collections import config_dict

#: Allowed values of `config.data.augment`.
AUGMENTATIONS = ('inception_crop', 'flip', 'none')
#: Allowed values of `config.data.normalization`.
NORMALIZATIONS = ('minus_one_to_one', 'imagenet')
#: Allowed values of `config.data.bad_images`.
BAD_IMAGES = ('fail', 'skip')


def check_bad_images(value) -> str:
  """Returns `value` if it is a valid `config.data.bad_images`.

  Raises:
    ValueError: naming the field and its valid values.
  """
  if value not in BAD_IMAGES:
    raise ValueError(f'Unknown config.data.bad_images={value!r}; choose one of '
                     f'{BAD_IMAGES} (fail with the file names, or skip '
                     'undecodable images).')
  return value


def get_default_config() -> ml_collections.ConfigDict:
  """Returns the default `config.data` (a `ml_collections.ConfigDict`).

  Experiment configs start from this and override fields. Every field is
  documented inline below. The defaults reproduce the official vit_jax
  fine-tuning input pipeline (Inception crop + flip for training, plain
  bilinear resize for eval, pixels scaled to [-1, 1]), on the offline
  Fashion-MNIST builder so that they work without network access.
  """
  c = ml_collections.ConfigDict()

  # Dataset: a registered tfds name ('imagenet2012', 'cifar10',
  # 'fashion_mnist_local', 'imagenet21k', 'imagenet2012_real', 'name/config',
  # 'name:1.2.3', ...) OR a path to the directory of a prepared tfds dataset
  # (the version folder holding dataset_info.json, or a folder above it; read
  # with `tfds.builder_from_directory`: bring your own TFRecords with a feature
  # spec this way). A name is treated as a path when it starts with '/', '.',
  # '~', contains '://', or is an existing directory. Ignored if
  # `image_folder` is set.
  c.name = 'fashion_mnist_local'
  # Root of an image-folder dataset: root/<split>/<class>/*.{jpg,jpeg,png},
  # read with `tfds.folder_dataset.ImageFolder`; split names are the
  # subfolder names (e.g. 'train', 'test'), class names are sorted.
  c.image_folder = config_dict.placeholder(str)
  # tfds data_dir (local path or gs://...); None = tfds default
  # ($TFDS_DATA_DIR or ~/tensorflow_datasets).
  c.data_dir = config_dict.placeholder(str)
  # Directory with manually downloaded source files, passed as
  # `tfds.download.DownloadConfig(manual_dir=...)` when preparing (e.g. the
  # ImageNet tars; for 'fashion_mnist_local' the IDX files, default
  # /usr/share/datasets/fashion-mnist from the Debian package
  # `dataset-fashion-mnist`).
  c.manual_dir = config_dict.placeholder(str)
  # Call `download_and_prepare` if the dataset is not prepared in data_dir yet.
  # Only for builders that prepare from local files (manual_dir builders and
  # offline builders like 'fashion_mnist_local'); nothing is ever downloaded,
  # builders that need the network raise an error with a hint instead.
  c.prepare = True

  # Splits, with tfds slicing syntax ('train[:98%]', 'train[1000:]',
  # 'train+validation', ...).
  c.train_split = 'train'
  c.eval_split = 'test'

  # Side S of the square [S, S, 3] images fed to the model.
  c.image_size = 224
  # Training augmentation: 'inception_crop' (random crop covering
  # [inception_crop_min_area, 1] of the image with aspect ratio in [3/4, 4/3],
  # resized to S, + random left-right flip; the ViT fine-tuning recipe),
  # 'flip' (resize to S + random left-right flip), 'none' (resize to S).
  # Eval resizes the full image to S (bilinear) unless eval_crop_pct is set (below).
  c.augment = 'inception_crop'
  # Minimum fraction of the image area kept by the Inception crop.
  c.inception_crop_min_area = 0.05
  # Extra training augmentations of the T2T-ViT / DeiT ImageNet recipe (timm's), off by
  # default; see vit_jax.data.augment. All are seeded by (seed, step), so resuming is exact.
  # RandAugment after the crop / flip (timm 'rand-m9-mstd0.5-inc1'): this many ops per image
  # (0 disables), each with probability 0.5, magnitude ~ N(magnitude, magnitude_std) in [0, 10].
  c.randaugment_num_layers = 0
  c.randaugment_magnitude = 9.0
  c.randaugment_magnitude_std = 0.5
  # Random erasing after normalization: with this probability one rectangle (2%-33% of the
  # area, aspect ratio 0.3-3.3) is filled with standard-normal noise (timm mode 'pixel').
  c.random_erasing = 0.0
  # Mixup / CutMix of each process's batch with its reverse (timm Mixup, mode 'batch'): with
  # probability mix_prob a batch is mixed, by CutMix with probability mix_switch_prob when both
  # alphas are > 0; lambda ~ Beta(alpha, alpha) (CutMix: corrected to the pasted area); labels
  # become lambda * y + (1 - lambda) * y_reversed. 0 disables each.
  c.mixup_alpha = 0.0
  c.cutmix_alpha = 0.0
  c.mix_switch_prob = 0.5
  c.mix_prob = 1.0
  # Eval resizing: None resizes the whole image to S (bilinear; the official ViT eval); a
  # fraction p resizes the shorter side to floor(S / p) (bicubic) and takes the central S x S
  # crop (timm; T2T-ViT uses 0.9).
  c.eval_crop_pct = config_dict.placeholder(float)
  # Pixel normalization: 'minus_one_to_one' (x / 127.5 - 1, values in [-1, 1],
  # the ViT convention) or 'imagenet' ((x / 255 - mean) / std with ImageNet
  # mean (0.485, 0.456, 0.406) and std (0.229, 0.224, 0.225), values in about
  # [-2.12, 2.64], the T2T-ViT / timm convention).
  c.normalization = 'minus_one_to_one'

  # Examples in the training shuffle buffer (per process). The buffer holds
  # encoded images (decoded ones if cache=True).
  c.shuffle_buffer = 50_000
  # Batches prefetched by tf.data.
  c.prefetch = 2
  # Cache the decoded, un-augmented images in memory before shuffling (train)
  # and before resizing (eval). Good for small datasets (Fashion-MNIST,
  # CIFAR); the whole split of this process must fit in host RAM.
  c.cache = False
  # Parallelism of the decode / augment maps; -1 = tf.data.AUTOTUNE.
  c.num_parallel_calls = -1

  # Images that cannot be decoded: corrupt, truncated or empty files, files
  # that are not images. 'fail': reading one raises
  # `vit_jax.data.BadImageError` naming the file(s) (image folders: every
  # undecodable file of the split being read, found by a parallel validation
  # pass after the first decoding error; tfds datasets: dataset, split and
  # TensorFlow's message) and the fix. 'skip': an image folder is validated
  # once when it is opened (every file of every split fully decoded, in
  # parallel, cached per folder; see `sources.find_undecodable` for the cost)
  # and undecodable files are left out of all splits before slicing, so the
  # counts of `get_info` exclude them (`DatasetInfo.num_skipped_images`), one
  # warning names them and the data order stays deterministic / resumable;
  # for tfds datasets undecodable examples are dropped while reading
  # (tf.data `ignore_errors`, one warning each): their number is not known
  # in advance, `get_info` counts include them, and a resumed run is exact
  # only if none was dropped before the resume step.
  # Valid but unusual images are decoded in both modes, to RGB: grayscale and
  # CMYK JPEGs; RGBA, palette, grayscale and 16-bit PNGs; PNGs named .jpg (and
  # JPEGs named .png); images smaller than image_size (upsampled).
  c.bad_images = 'fail'

  # Feature holding the image.
  c.image_key = 'image'
  # Feature holding the labels; None = auto: 'real_label' for
  # 'imagenet2012_real', else 'label' or 'labels' (whichever exists). A
  # ClassLabel feature gives one-hot targets; a Sequence(ClassLabel) feature
  # (imagenet21k-style or your own multi-label set) gives multi-hot targets.
  # For 'real_label' (ImageNet ReaL) eval examples without any label are
  # masked out (mask=False), i.e. skipped as in the ViT paper.
  c.label_key = config_dict.placeholder(str)
  return c
