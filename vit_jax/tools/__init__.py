"""Tools built on the library, apart from it: nothing in `vit_jax` imports them.

  benchmark   throughput, compile time, memory and MFU of the trainer's step, beside timm's
              (`python -m vit_jax.benchmark`; a package, one module per concern)
  cost        what a training run will cost before it runs: FLOPs, TPU-core-days, wall time
              (`python -m vit_jax.cost`)
  convert     checkpoint conversion between the formats (`python -m vit_jax.convert`)
  predict     the top classes of images under a trained model (`python -m vit_jax.predict`;
              `Predictor` for notebooks)
  evaluate    evaluation only: top-1/top-5/loss, per-class accuracy, a confusion matrix
              (`python -m vit_jax.evaluate`)
  fewshot     few-shot linear accuracy of a trained model's features (`python -m vit_jax.fewshot`)
  export_images  examples of a dataset as PNG files, e.g. to try predict on
              (`python -m vit_jax.tools.export_images`)
  common      what the command-line tools share (FATAL lines, SOURCE arguments)
  preflight   the trainer's steps compiled for a TPU slice on any machine, with libtpu: memory
              per device, fits or not, and the overrides that would (`python -m vit_jax.preflight`)

`vit_jax/benchmark.py`, `cost.py`, `convert.py`, `preflight.py`, `predict.py`, `evaluate.py` and
`fewshot.py` are the entry points that keep those commands.
"""
