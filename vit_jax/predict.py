"""`python -m vit_jax.predict`: predicts image classes with a trained model; the command and
`Predictor` live in `vit_jax.tools.predict` (``from vit_jax.predict import Predictor`` works and
imports them only when first used)."""

_EXPORTS = ('Prediction', 'Predictor')


def __getattr__(name):
  if name in _EXPORTS:
    from vit_jax.tools import predict  # pylint: disable=g-import-not-at-top
    return getattr(predict, name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
  return sorted(list(globals()) + list(_EXPORTS))


if __name__ == "__main__":
  from vit_jax.tools import predict
  predict.run_main()
