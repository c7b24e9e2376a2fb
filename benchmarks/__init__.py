r"""Throughput, compile time, memory and FLOP utilisation of a model, optionally beside timm.

Examples:
  # ViT-B/16, batch 8 at 224 px: our training step and inference beside timm's, 3 rounds.
  python -m benchmarks ViT-B_16 --batch 8 --compare timm --rounds 3 --json b16.json
  # Only the compile time of ViT-H/14's training step, scanned (the default) and unrolled.
  python -m benchmarks ViT-H_14 --batch 1 --mode train --compile-only
  python -m benchmarks ViT-H_14 --batch 1 --mode train --compile-only --set scan=False

What runs is the trainer's own step (`vit_jax.step.build` of MODEL's pretraining config with
--batch, --resolution, --dtype and each --set), scan, remat and the attention `vit_jax.dispatch`
picks as `python -m vit_jax.main` would; timm runs its default model. Each configuration runs
in a fresh subprocess pinned to --threads cores, the frameworks alternating. The report and each
figure: docs/benchmarks.md. Exit status: 0; 1 a measurement failed; 2 bad input (one FATAL
line). Run from the repository root: benchmarks/ is a development tool of the repository, not
installed with the vit_jax package.
"""
