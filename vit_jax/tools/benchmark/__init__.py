r"""Throughput, compile time, memory and FLOP utilisation of a model, optionally beside timm.

Examples:
  # ViT-B/16, batch 8 at 224 px: our training step and inference beside timm's, 3 rounds.
  python -m vit_jax.benchmark ViT-B_16 --batch 8 --compare timm --rounds 3 --json b16.json
  # Only the compile time of ViT-H/14's training step, scanned (the default) and unrolled.
  python -m vit_jax.benchmark ViT-H_14 --batch 1 --mode train --compile-only
  python -m vit_jax.benchmark ViT-H_14 --batch 1 --mode train --compile-only --set scan=False

What runs is the trainer's own step: the training config of MODEL (pretraining regime; --batch,
--resolution, --dtype, each --set a config.model field) resolved for this machine and compiled by
`vit_jax.step.build(...)`, as `python -m vit_jax.main` does: scan and remat on (--set scan=False
--set remat=False: the plain unrolled model), the attention `vit_jax/dispatch.py` picks (--set
attention=xla, cpu_kernel or cudnn forces one); the report says which ran and why. timm runs
its default model, without gradient checkpointing unless --set remat=True.

Every configuration (model x mode x framework x round) runs in a fresh subprocess pinned to
--threads cores, under the huge-page malloc of `vit_jax.platform`, the frameworks alternating.
Reported: images/s (batch / median timed step), lower, compile and first-step times, peak
memory, XLA's and the analytic FLOPs, FLOP/s against the device's peak, ratios ours / timm;
docs/benchmarks.md explains each. Exit status: 0; 1 a measurement failed; 2 bad input (one
FATAL line). Modules: `ours`, `timm`, `inputs` (the input pipeline), `runner` (subprocesses),
`report`, `cli`, `common`.
"""
