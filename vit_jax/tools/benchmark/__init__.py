r"""Throughput, compile time, memory and FLOP utilisation of a model, optionally beside timm.

Usage:
  python -m vit_jax.benchmark MODEL [MODEL ...] [--batch 8] [--resolution 224]
      [--dtype float32|bfloat16] [--mode train|inference|both] [--warmup 2] [--steps 5]
      [--threads N] [--override KEY=VALUE ...] [--compare timm] [--rounds R] [--compile-only]
      [--input-pipeline] [--json PATH]

Examples:
  # ViT-B/16, batch 8 at 224 px: our training step and inference beside timm's, 3 rounds.
  python -m vit_jax.benchmark ViT-B_16 --batch 8 --compare timm --rounds 3 --json b16.json
  # Only the compile time of ViT-H/14's training step, scanned (the default) and unrolled.
  python -m vit_jax.benchmark ViT-H_14 --batch 1 --mode train --compile-only
  python -m vit_jax.benchmark ViT-H_14 --batch 1 --mode train --compile-only --override scan=False
  # The training step with XLA's attention instead of the automatic choice.
  python -m vit_jax.benchmark ViT-Ti_16 --mode train --override attention=xla

What runs is the trainer's own step: the benchmark builds the training config
(`vit_jax.config.get_config(MODEL, ...)` in the pretraining regime, --batch as batch_size,
--resolution as data.image_size, --dtype as model.dtype, each --override a config.model field),
resolves it for the devices it runs on (`vit_jax.config.resolve`) and compiles
`vit_jax.step.build(config, ...).jit_train_step()`, as `python -m vit_jax.main` does. So the
model runs with the training execution defaults (`vit_jax.config.TRAINING_DEFAULTS`: scan=True,
remat=True, remat_policy='auto', on a CPU 'dots_and_attention_saveable'; --override scan=False
--override remat=False for the plain unrolled model) and the attention implementation that
training would choose on this machine (`config.model.attention='auto'`, `vit_jax.dispatch`: on
one CPU, vit_jax's fused kernel where it is built, applies and is faster than XLA's on this
CPU's instruction set; cuDNN's on a GPU in bfloat16). --override attention=xla (or cpu_kernel,
cudnn) forces one. The report says which ran and why: the resolved implementation, the reason, and
whether the compiled step calls the CPU kernel (in the JSON and the notes). timm runs its default
model, without gradient checkpointing unless --override remat=True is given.

What is measured, for every model and mode (one row each):
  train      one step of `vit_jax.train`, `vit_jax.step.make_train_step`: forward, backward,
             the pretraining regime's optimizer (AdamW, weight decay on kernels, global-norm
             clipping at 1, linear warmup and decay) and loss (sigmoid cross-entropy, head bias
             -10), the step's metrics, jitted with the state donated. timm:
             `torch.optim.AdamW` (weight decay 0.1 on matrices), `clip_grad_norm_(1.0)`,
             `CrossEntropyLoss`.
  inference  the forward pass in eval mode (`model.apply(..., train=False)`; timm:
             `model.eval()` under `torch.inference_mode()`).
  For each: the time to lower and to compile the jitted step (ours; timm runs eagerly), the
  first execution apart from that, then --warmup untimed steps and --steps timed ones, each
  waited for with `block_until_ready`; images/s = batch / the median step time. Peak memory:
  the process's peak resident set (`getrusage(RUSAGE_SELF).ru_maxrss`, host RSS) on CPU and,
  on GPU/TPU, the device's `memory_stats()['peak_bytes_in_use']` too. Every configuration
  (model x mode x framework x round) runs in a fresh subprocess, so peaks do not mix.
  FLOPs per step: XLA's cost analysis of the compiled step (it counts a `scan` body once, so a
  model with `scan=True` shows about 1/num_layers of the layers' work, and it counts the
  elementwise work and the optimizer too) and the analytic count of the matrix products,
  3 x 2 x `flops.model_forward_macs` x batch for training, 2 x MACs x batch for inference.
  Achieved FLOP/s = analytic FLOPs / median step time, as a fraction of the device's peak
  (`accounting.local_hardware`: a measured float32 2048^3 matmul on CPU, the published table on
  GPU/TPU); timm's rows use the same analytic count and peak.

--input-pipeline also measures the training input pipeline alone (`inputs.measure_input`):
images/s of `vit_jax.data.create_train_iterator` with the training defaults (Inception crop
fused with decoding, flip, resize to --resolution, normalisation, prefetch) at the same batch
and threads, on the offline Fashion-MNIST builder and on a generated folder of 500x375 JPEGs,
with the multiple of our fastest measured training step (> 1: the input is not the bottleneck).

Threads (--threads N, default: every core this process may run on): the subprocesses are
pinned to N cores (`sched_setaffinity`); JAX's CPU client sizes its intra-op (Eigen) thread
pool from NPROC=N (which XLA reads, otherwise the schedulable cores), torch gets
`torch.set_num_threads(N)` and OMP_NUM_THREADS=N. The counts used, XLA_FLAGS, the versions and
the CPU are recorded in the JSON under 'environment'.

Memory allocator: like `vit_jax.main`, the command re-executes itself with
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (glibc >= 2.35, transparent huge pages 'madvise' or
'always'; `vit_jax.platform.huge_pages_environment`), and every measuring subprocess, timm's
included, inherits it, so both frameworks run under the same allocator. XLA:CPU allocates each
step's temporaries afresh, and without huge pages it page-faults on all of them every step.
VIT_JAX_HUGE_PAGES=0 measures without (a note in the report says which).

--compare timm runs timm's equivalent model (`timm.create_model('vit_base_patch16_224',
pretrained=False, num_classes=..., img_size=...)` for ViT-B_16; Ti, S, L, H likewise; other
architectures through timm's keyword arguments) with the same batch, resolution, dtype
(bfloat16: `torch.autocast`), optimizer and thread count, in separate processes alternating
with ours over --rounds rounds (the order flips every round), and prints the medians and the
ratios ours / timm of images/s and peak RSS. It needs the optional extra
`pip install -e '.[bench]'` (torch and timm). T2T-ViT and hybrid models have no timm
equivalent: only ours is measured (a note says so).

Absolute figures depend on the machine (CPU model, cores, memory bandwidth, other load); the
ratios between the frameworks on one machine are what to compare. Exit status: 0, 1 when a
measurement failed, 2 for bad input (a one-line message, no traceback).

The package, one module per concern: `ours` (the trainer's step, compiled and timed), `timm`
(timm's equivalent model), `inputs` (the input pipeline alone), `runner` (rounds of fresh
subprocesses), `report` (medians, ratios, notes, tables), `cli` (flags and exit status),
`common` (units, errors, timing helpers).
"""
