r"""Throughput, compile time, memory and FLOP utilisation of a model, optionally beside timm.

Examples:
  # ViT-B/16, batch 8 at 224 px: our training step and inference beside timm's, 3 rounds.
  python -m vit_jax.benchmark ViT-B_16 --batch 8 --compare timm --rounds 3 --json b16.json
  # Only the compile time of ViT-H/14's training step, scanned (the default) and unrolled.
  python -m vit_jax.benchmark ViT-H_14 --batch 1 --mode train --compile-only
  python -m vit_jax.benchmark ViT-H_14 --batch 1 --mode train --compile-only --set scan=False

What runs is the trainer's own step: the benchmark builds the training config
(`vit_jax.config.get_config(MODEL, ...)` in the pretraining regime, --batch as batch_size,
--resolution as data.image_size, --dtype as model.dtype, each --set a config.model field),
resolves it for the devices it runs on (`vit_jax.config.resolve`) and compiles
`vit_jax.step.build(config, ...).jit_train_step()`, as `python -m vit_jax.main` does. So the
model runs with the training execution defaults (`vit_jax.config.TRAINING_DEFAULTS`: scan=True,
remat=True, remat_policy='auto', on a CPU 'dots_and_attention_saveable'; --set scan=False
--set remat=False for the plain unrolled model) and the attention implementation that
training would choose on this machine (`config.model.attention='auto'`, `vit_jax.dispatch`: on
one CPU, vit_jax's fused kernel where it is built, applies and is faster than XLA's on this
CPU's instruction set; cuDNN's on a GPU in bfloat16). --set attention=xla (or cpu_kernel,
cudnn) forces one. The report says which ran and why: the resolved implementation, the reason, and
whether the compiled step calls the CPU kernel (in the JSON and the notes). timm runs its default
model, without gradient checkpointing unless --set remat=True is given.

Every configuration (model x mode x framework x round) runs in a fresh subprocess pinned to
--threads cores, under the huge-page malloc of `vit_jax.platform`, the frameworks alternating.
Reported: images/s (batch / median timed step), lower, compile and first-step times, peak
memory, XLA's and the analytic FLOPs, FLOP/s against the device's peak, ratios ours / timm;
docs/benchmarks.md explains each. Exit status: 0; 1 a measurement failed; 2 bad input (one
FATAL line). Modules: `ours`, `timm`, `inputs` (the input pipeline), `runner` (subprocesses),
`report`, `cli`, `common`.
"""
