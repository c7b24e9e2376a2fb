"""`python -m vit_jax.predict`: predicts image classes with a trained model; the command and
`Predictor` (``from vit_jax.predict import Predictor``) live in `vit_jax.tools.predict`."""
from vit_jax.tools.predict import Prediction  # noqa: F401
from vit_jax.tools.predict import Predictor  # noqa: F401
from vit_jax.tools.predict import run_main

if __name__ == "__main__":
  run_main()
