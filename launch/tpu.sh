#!/usr/bin/env bash
# Cloud TPU VMs for vit_jax, from a single v3-8 to a multi-host pod or several slices: create the
# TPU, install the project on every worker, start the same training command on all of them
# (reading data that is in a bucket through a gcsfuse mount), follow the logs, stop, delete.
# `launch/tpu.sh --help` documents every command and setting; launch/README.md has worked examples.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

PROG="$0"
LAUNCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(dirname "$LAUNCH_DIR")"
# shellcheck source=common.sh
source "$LAUNCH_DIR/common.sh"

# Each worker keeps the project, its virtual environment and the training logs in ~/vit_jax; the
# source archive travels to ~/vit_jax-src.tar.gz.
REMOTE_ARCHIVE="vit_jax-src.tar.gz"
# Seconds `run` watches the new training processes before reporting success: enough to catch a
# bad config key or a missing dataset, which fail while the program starts.
START_CHECK_SECONDS=20
# run mounts gs://BUCKET read-only at $GCSFUSE_ROOT/BUCKET on every worker (unless --no-gcsfuse).
GCSFUSE_ROOT=/mnt/gcsfuse
# The file cache of the gcsfuse mount: its directory (one subdirectory per bucket) and size in MiB. A TPU
# VM's boot disk is about 100 GiB, shared with the image, ~/vit_jax/.venv and the logs.
GCSFUSE_DEFAULT_CACHE_DIR=/tmp/gcsfuse-cache
GCSFUSE_DEFAULT_CACHE_MB=40960

usage() {
  cat <<EOF
Usage: $PROG COMMAND [options] [--config.key=value ...] [-- extra args]

Run vit_jax on a Cloud TPU VM, a single host (v3-8), a multi-host pod (v3-32, v4-32, ...) or
several slices (--slices N: multi-slice over the data-centre network, TPU v4 and newer).

Commands:
  create   Create the TPU VM, or with --queued a queued resource that creates it once capacity
           is free. Does nothing if it already exists. Arguments after -- go to gcloud's create
           (e.g. -- --network=NET --subnetwork=SUBNET). With --slices N: a queued resource of N
           TPUs of --type, named NAME-0 ... NAME-(N-1) (--node-count=N --node-prefix=NAME).
  setup    Copy this checkout to every worker (a git archive of HEAD plus uncommitted edits to
           tracked files), or with --repo clone a git repository there, and install it with
           pip install -e '.[tpu]' into ~/vit_jax/.venv, made with the first of python3.12,
           python3.13, python3 that is 3.12 or 3.13, so that the newest jax is installed (on the
           Ubuntu 22.04 images, whose python3 is 3.10, it installs uv from PyPI with pip and
           CPython 3.12 with uv). Safe to rerun (after a code change too); a venv of an older
           Python is made again.
  preflight
           Here, on this machine (no TPU, no gcloud): compile the training step of --config for
           TPU_TYPE with libtpu's TPU compiler (python -m vit_jax.preflight) and print its memory
           per device against the HBM, or the overrides that would fit. Takes the same --config
           and --config.key=value overrides as run; anything after -- goes to vit_jax.preflight
           (e.g. -- --largest_batch). Exit code 0 fits, 1 does not, 2 a bad setting or config,
           or no libtpu (pip install -e '.[tpu]' into .venv). Uses .venv/bin/python of this checkout, else
           python3 (TPU_PREFLIGHT_PYTHON overrides). With --slices N it compiles for N slices of
           TPU_TYPE (--config.mesh.dcn_data=N, as run passes it).
  run      With --preflight, first run preflight here (before anything is asked of gcloud when
           TPU_TYPE is set) and start nothing if it does not fit.
           On every worker: clear inherited MEGASCALE_* variables (below), mount the data
           bucket when the data is in one (see --gcsfuse), stop a previous vit_jax.main, kill
           processes holding the TPU, remove /tmp/libtpu_lockfile, then start in the background
           (it survives the ssh session) python -m vit_jax.main --config CONFIG --workdir WORKDIR
           [overrides], logging to ~/vit_jax/logs/ (latest.log points at the newest).
           --config.key=value arguments and anything after -- are passed to vit_jax.main.
           Rerunning with the same --workdir resumes from the latest checkpoint.
           With --slices N it adds --config.mesh.dcn_data=N (data parallelism across the slices;
           a different dcn_data among the overrides is refused).
  logs     Follow the training log of one worker (--worker N, default 0; with --slices, of slice
           --slice K, default 0). Ctrl-C stops following, not training.
  status   The TPU's state and type (and its queued resource; with --slices every slice's), and
           on each worker whether training runs and the last log line.
  stop     Stop training on every worker (the TPU keeps running, and billing). The gcsfuse
           mounts stay (a rerun reuses them and their cache); --unmount unmounts them too.
  delete   Delete the TPU, or its queued resource (with the TPU, or all its slices) when one
           exists. Asks first; --yes (or FORCE=1) skips the question, which is required when
           stdin is not a terminal.

Settings (a flag, or the environment variable; the flag wins):
  --name NAME             TPU_NAME             TPU VM name (required)
  --zone ZONE             TPU_ZONE             zone, e.g. us-central1-a, europe-west4-a (required)
  --project PROJECT       TPU_PROJECT          Google Cloud project id (required)
  --type TYPE             TPU_TYPE             accelerator type: v3-8, v3-32, v4-32, v5litepod-16,
                                               v5p-8, v6e-8, ... Required by create; the other
                                               commands read it from the TPU (with --dry-run,
                                               run and any --slices command need it).
                                               --accelerator-type is an alias.
  --runtime-version V     TPU_RUNTIME_VERSION  TPU VM image; default tpu-ubuntu2204-base (v2-v4),
                                               v2-alpha-tpuv5-lite (v5litepod), v2-alpha-tpuv5
                                               (v5p), v2-alpha-tpuv6e (v6e)
  --spot                  TPU_SPOT=1           Spot capacity: cheaper, can be preempted any time
  --preemptible           TPU_PREEMPTIBLE=1    legacy preemptible TPU (not with --queued or --spot)
  --reserved              TPU_RESERVED=1       use the project's reserved capacity
  --queued                TPU_QUEUED=1         create through a queued resource (waits for capacity;
                                               the usual way to get pods and Spot TPUs)
  --qr-name ID            TPU_QR_NAME          queued resource id (default NAME-qr)
  --slices N              TPU_SLICES           N >= 2 TPUs of --type as one multi-slice run:
                                               create makes a queued resource (implies --queued)
                                               of TPUs NAME-0 ... NAME-(N-1); setup, run, logs,
                                               status, stop and delete then act on every worker
                                               of every slice (give the same --slices to each)
  --config CONFIG         TPU_CONFIG           run: e.g. configs/vit.py:b16,imagenet2012 (required)
  --workdir DIR           TPU_WORKDIR          run: gets checkpoints (DIR/checkpoints), TensorBoard
                                               events and cost.json (required; gs://... on a
                                               multi-host TPU)
  --bucket BUCKET         TPU_BUCKET           run: TFDS data_dir defaults to
                                               gs://BUCKET/tensorflow_datasets (mounted, see
                                               --gcsfuse)
  --data-dir DIR          TPU_DATA_DIR         run: TFDS data_dir (--config.data.data_dir),
                                               gs://BUCKET/PATH (mounted, see --gcsfuse) or a
                                               path on the workers
  --gcsfuse               TPU_GCSFUSE=1        run: the default when the data is in a bucket
                                               (--bucket, --data-dir gs://...), since random
                                               reads of ArrayRecord files from gs:// send the
                                               rest of the file per read (docs/data.md "Reading
                                               from a bucket"): mount the bucket read-only with
                                               Cloud Storage FUSE (gcsfuse) at
                                               $GCSFUSE_ROOT/BUCKET on every worker (gcsfuse is
                                               installed from Google's apt repository if missing;
                                               a mount already there is kept), check it, and give
                                               vit_jax.main the local path as the data_dir:
                                               $GCSFUSE_ROOT/BUCKET/tensorflow_datasets, or
                                               $GCSFUSE_ROOT/BUCKET/PATH. A --config.data.data_dir
                                               override turns the default off (run says so, and
                                               vit_jax.main reads that data_dir as it is); an
                                               explicit --gcsfuse refuses it, as it refuses a
                                               local --data-dir and a run without a bucket
  --no-gcsfuse            TPU_GCSFUSE=0        run: mount nothing; vit_jax.main reads gs://
                                               directly
  --gcsfuse-cache-dir DIR TPU_GCSFUSE_CACHE_DIR
                                               run (gcsfuse): file cache directory on the worker's
                                               local disk, one subdirectory per bucket (default
                                               $GCSFUSE_DEFAULT_CACHE_DIR)
  --gcsfuse-cache-mb MB   TPU_GCSFUSE_CACHE_MB run (gcsfuse): file cache size in MiB (default
                                               $GCSFUSE_DEFAULT_CACHE_MB = 40 GiB; 0: no file
                                               cache). A TPU VM's boot disk is about 100 GiB,
                                               shared with the image, ~/vit_jax/.venv and the
                                               logs: a larger cache needs another disk (a data
                                               disk, with --gcsfuse-cache-dir on it)
  --repo URL              TPU_REPO             setup: clone this git URL on the workers instead of
                                               copying the checkout
  --ref REF               TPU_REF              setup: branch, tag or commit of --repo (default HEAD)
  --preflight             TPU_PREFLIGHT=1      run: compile the step for TPU_TYPE here first (see
                                               preflight) and refuse to start if it does not fit
  --worker N                                   logs: which worker (default 0)
  --slice K                                    logs --slices: which slice (default 0)
  --lines N                                    logs: lines of history to show (default 100)
  --no-follow                                  logs: print and exit instead of following
  --unmount                                    stop: also unmount the gcsfuse mounts under
                                               $GCSFUSE_ROOT (the next run mounts again and
                                               sees objects added since)
  --yes, -y               FORCE=1              delete: do not ask
  --dry-run               DRY_RUN=1            print the commands instead of running them (and
                                               skip the checks that need gcloud). delete cannot
                                               know whether the TPU came from a queued resource:
                                               it prints the tpu-vm delete (with --queued the
                                               queued-resources delete) and the other one as a
                                               '# if ...' comment
  --help, -h                                   this help

Examples (a v3-8; a pod is the same with --type v3-32 --queued, 'status' until the TPU is
READY before setup, and a gs:// workdir; the data of --bucket is read through a gcsfuse mount):
  export TPU_NAME=vit-v3-8 TPU_ZONE=europe-west4-a TPU_PROJECT=my-project TPU_TYPE=v3-8
  $PROG create --spot
  $PROG setup
  $PROG run --config configs/vit.py:b16,imagenet2012 --workdir gs://my-bucket/b16_i1k \\
      --bucket my-bucket --config.batch_size=1024
                    # mounts gs://my-bucket: data_dir $GCSFUSE_ROOT/my-bucket/tensorflow_datasets
  $PROG logs
  $PROG delete

The same data read from gs:// directly, without gcsfuse (data_dir gs://my-bucket/...):
  $PROG run --config configs/vit.py:b16,imagenet2012 --workdir gs://my-bucket/b16_i1k \\
      --bucket my-bucket --no-gcsfuse

Two slices of v5litepod-16 (8 workers; --config.mesh.dcn_data=2 is added):
  export TPU_NAME=vit-ms TPU_TYPE=v5litepod-16 TPU_SLICES=2
  $PROG create --spot       # queued resource vit-ms-qr: TPUs vit-ms-0, vit-ms-1
  $PROG status              # until ACTIVE and both READY
  $PROG setup
  $PROG run --config configs/vit.py:b16,imagenet2012 --workdir gs://my-bucket/b16_ms \\
      --bucket my-bucket
  $PROG logs --slice 1 --worker 3

Multi-slice runs get their MEGASCALE_* settings (coordinator, number of slices, slice id) from
each TPU's 'tpu-env' metadata, which the queued resource writes; jax and libtpu read a variable
of the environment first. run therefore unsets every MEGASCALE_* variable the worker's shell
inherited before python starts (a stale MEGASCALE_NUM_SLICES left from an earlier, larger run
makes libtpu wait forever for slices that are gone), and refuses to start when the metadata's
number of slices is not --slices (or, without --slices, when the TPU is one slice of several).
EOF
}

# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

EXTRA_ARGS=()  # --config.key=value overrides and everything after --
LOG_WORKER=0
LOG_SLICE=0
LOG_LINES=100
LOG_FOLLOW=1
STOP_UNMOUNT=0
GCSFUSE=0  # run: whether the data bucket is mounted (choose_gcsfuse)

parse_options() {
  local arg opt value inline
  while (($# > 0)); do
    arg="$1"
    shift
    case "$arg" in
      --)
        EXTRA_ARGS+=("$@")
        break
        ;;
      --config.*)  # a vit_jax.main config override, passed through as it is
        EXTRA_ARGS+=("$arg")
        continue
        ;;
    esac
    # Accept both `--flag value` and `--flag=value`.
    opt="$arg"
    value=""
    inline=0
    if [[ "$arg" == --*=* ]]; then
      opt="${arg%%=*}"
      value="${arg#*=}"
      inline=1
    fi
    case "$opt" in
      --name | --zone | --project | --type | --accelerator-type | --runtime-version | --qr-name | \
        --config | --workdir | --bucket | --data-dir | --repo | --ref | --worker | --lines | \
        --slices | --slice | --gcsfuse-cache-dir | --gcsfuse-cache-mb)
        if ((!inline)); then
          (($# > 0)) || die "$opt needs a value"
          value="$1"
          shift
        fi
        [[ -n "$value" ]] || die "$opt needs a non-empty value"
        ;;
      *)
        ((!inline)) || die "$opt takes no value"
        ;;
    esac
    case "$opt" in
      --name) TPU_NAME="$value" ;;
      --zone) TPU_ZONE="$value" ;;
      --project) TPU_PROJECT="$value" ;;
      --type | --accelerator-type) TPU_TYPE="$value" ;;
      --runtime-version) TPU_RUNTIME_VERSION="$value" ;;
      --qr-name) TPU_QR_NAME="$value" ;;
      --config) TPU_CONFIG="$value" ;;
      --workdir) TPU_WORKDIR="$value" ;;
      --bucket) TPU_BUCKET="$value" ;;
      --data-dir) TPU_DATA_DIR="$value" ;;
      --repo) TPU_REPO="$value" ;;
      --ref) TPU_REF="$value" ;;
      --worker) LOG_WORKER="$value" ;;
      --lines) LOG_LINES="$value" ;;
      --slices) TPU_SLICES="$value" ;;
      --slice) LOG_SLICE="$value" ;;
      --gcsfuse-cache-dir) TPU_GCSFUSE_CACHE_DIR="$value" ;;
      --gcsfuse-cache-mb) TPU_GCSFUSE_CACHE_MB="$value" ;;
      --gcsfuse) TPU_GCSFUSE=1 ;;
      --no-gcsfuse) TPU_GCSFUSE=0 ;;
      --unmount) STOP_UNMOUNT=1 ;;
      --spot) TPU_SPOT=1 ;;
      --preemptible) TPU_PREEMPTIBLE=1 ;;
      --reserved) TPU_RESERVED=1 ;;
      --queued) TPU_QUEUED=1 ;;
      --preflight) TPU_PREFLIGHT=1 ;;
      --no-follow) LOG_FOLLOW=0 ;;
      --yes | -y) FORCE=1 ;;
      --dry-run) DRY_RUN=1 ;;
      -h | --help)
        usage
        exit 0
        ;;
      -*) die "unknown option '$arg' (see '$PROG --help'; vit_jax.main flags go after --)" ;;
      *) die "unexpected argument '$arg': options take the form --flag VALUE, config overrides --config.key=value" ;;
    esac
  done
}

# hint COMMAND [ARGS...]: the command line to type next, with this TPU's location spelled out.
hint() {
  local slices=()
  ! multi_slice || slices=(--slices "$SLICES")
  quote_args "$PROG" "$1" --name "$TPU_NAME" --zone "$TPU_ZONE" --project "$TPU_PROJECT" \
    "${slices[@]}" "${@:2}"
}

# confirm QUESTION: go on only after a 'y' typed on a terminal (or with --yes / FORCE=1).
confirm() {
  local answer=""
  if is_true "${FORCE:-0}"; then
    return 0
  fi
  if [[ ! -t 0 ]]; then
    die "refusing to delete without confirmation: stdin is not a terminal. Pass --yes (or FORCE=1) to delete"
  fi
  read -r -p "$1 [y/N] " answer || true
  case "${answer,,}" in
    y | yes) return 0 ;;
    *) die "not deleted" ;;
  esac
}

# ---------------------------------------------------------------------------------------------
# Scripts that run on the workers (POSIX sh, through `gcloud compute tpus tpu-vm ssh --command`)
# ---------------------------------------------------------------------------------------------

# The training process, matched by its command line. The pattern is anchored on the python
# executable so that it never matches the ssh shell running these scripts (whose own command line
# contains "vit_jax.main" too, and would otherwise kill itself).
remote_training_pattern() {
  cat <<'EOF'
pattern='^[^ ]*python[0-9.]* -m vit_jax[.]main( |$)'
EOF
}

# Sets $worker to this worker's number (from the TPU VM metadata; the hostname if unavailable).
remote_worker_number() {
  cat <<'EOF'
worker="$(curl -sf -m 5 -H 'Metadata-Flavor: Google' \
  http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number \
  || hostname)"
EOF
}

# Stops vit_jax.main: SIGTERM, up to 30 s to exit, then SIGKILL.
remote_stop_training() {
  cat <<'EOF'
if pgrep -f "$pattern" >/dev/null; then
  echo "worker $worker: stopping vit_jax.main (pid $(pgrep -f "$pattern" | tr '\n' ' '))"
  sudo pkill -TERM -f "$pattern" || true
  waited=0
  while pgrep -f "$pattern" >/dev/null && [ "$waited" -lt 30 ]; do
    sleep 1
    waited=$((waited + 1))
  done
  sudo pkill -KILL -f "$pattern" || true
fi
EOF
}

# Frees the TPU for a new run: any other process holding it (an old job, a notebook) makes the
# next start fail with "TPU in use", and so does a stale libtpu lock file.
remote_free_tpu() {
  cat <<'EOF'
# TPU devices: /dev/accel* on v2-v4, /dev/vfio/* on v5e, v5p and v6e.
holders="$(sudo lsof -t /dev/accel* /dev/vfio/* 2>/dev/null | sort -u | tr '\n' ' ' || true)"
if [ -n "${holders% }" ]; then
  echo "worker $worker: killing processes still holding the TPU: $holders"
  echo "$holders" | xargs sudo kill -9 || true
  sleep 2
fi
sudo rm -f /tmp/libtpu_lockfile
EOF
}

# Sets $tpu_env to this TPU's 'tpu-env' metadata (YAML lines such as MEGASCALE_NUM_SLICES: '2';
# empty where there is none) and defines tpu_env_value KEY. jax reads the MEGASCALE_* settings
# of a multi-slice queued resource from there when the environment has none
# (jax/_src/clusters/cloud_tpu_cluster.py: get_tpu_env_value), and so does libtpu.
remote_tpu_env() {
  cat <<'EOF'
tpu_env="$(curl -sf -m 5 -H 'Metadata-Flavor: Google' \
  http://metadata.google.internal/computeMetadata/v1/instance/attributes/tpu-env || true)"
tpu_env_value() {
  printf '%s\n' "$tpu_env" | sed -n "s/^$1:[[:space:]]*//p" | head -n 1 | tr -d "\"' "
}
EOF
}

# With --slices: $worker becomes SLICE-WORKER (worker 3 of slice 1 is "1-3"), in the messages and
# the log names, since every slice numbers its workers from 0.
remote_slice_label() {
  multi_slice || return 0
  cat <<'EOF'
worker="$(tpu_env_value MEGASCALE_SLICE_ID)-$worker"
EOF
}

# The MEGASCALE_* settings join the slices of a multi-slice run. jax and libtpu take each from
# the environment first and from the TPU's tpu-env metadata second, where the queued resource
# writes them for each of its TPUs (coordinator, number of slices, this TPU's slice id): jax's
# cloud_tpu_cluster.py ("For both GCE via QueuedResources and GKE via JobSet, the Megascale
# coordinator address is set"), libtpu's "'tpu-env' (yaml) instance metadata", and
# https://github.com/AI-Hypercomputer/maxtext/issues/30 ("QueuedResources ... set up these MXLA
# flags during initialization"). So nothing is set here, and a variable inherited by the shell
# (a profile, an earlier manual export) would override the metadata: after a preemption a stale
# MEGASCALE_NUM_SLICES makes libtpu wait forever for slices that are gone
# (https://github.com/ray-project/ray/pull/62893). Every inherited one is unset, before python
# (and so jax) starts; then the metadata must agree with --slices.
remote_megascale() {
  cat <<'EOF'
for name in $(env | sed -n 's/^\(MEGASCALE_[A-Za-z0-9_]*\)=.*/\1/p'); do
  echo "worker $worker: unsetting the inherited $name=$(printenv "$name") (a stale value would override the TPU's own tpu-env metadata)"
  unset "$name"
done
num_slices="$(tpu_env_value MEGASCALE_NUM_SLICES)"
EOF
  if multi_slice; then
    cat <<EOF
if [ -z "\$num_slices" ]; then
  echo "worker \$worker: this TPU's tpu-env metadata has no MEGASCALE_NUM_SLICES: it is not a slice of a multi-slice queued resource. Create the $SLICES slices with 'launch/tpu.sh create --slices $SLICES'" >&2
  exit 1
fi
if [ "\$num_slices" != $SLICES ]; then
  echo "worker \$worker: this TPU is one of \$num_slices slices (MEGASCALE_NUM_SLICES in its tpu-env metadata), not of $SLICES: pass --slices \$num_slices" >&2
  exit 1
fi
coordinator="\$(tpu_env_value MEGASCALE_COORDINATOR_ADDRESS)"
if [ -z "\$coordinator" ] || [ -z "\$(tpu_env_value MEGASCALE_SLICE_ID)" ]; then
  echo "worker \$worker: this TPU's tpu-env metadata lacks MEGASCALE_COORDINATOR_ADDRESS or MEGASCALE_SLICE_ID: recreate the slices ('launch/tpu.sh delete', 'create --slices $SLICES')" >&2
  exit 1
fi
echo "worker \$worker: slice \$(tpu_env_value MEGASCALE_SLICE_ID) of \$num_slices, coordinator \$coordinator (MEGASCALE_* from the TPU's tpu-env metadata)"
EOF
  else
    cat <<'EOF'
if [ -n "$num_slices" ] && [ "$num_slices" != 1 ]; then
  echo "worker $worker: this TPU is slice $(tpu_env_value MEGASCALE_SLICE_ID) of a $num_slices-slice queued resource (MEGASCALE_NUM_SLICES in its tpu-env metadata): run on all slices with --slices $num_slices" >&2
  exit 1
fi
EOF
  fi
}

# The gcsfuse command of --gcsfuse: read-only, with the metadata caches of MaxText's
# tools/setup/setup_gcsfuse.sh (type and stat caches unbounded, listings and metadata cached for
# the life of the mount: the dataset does not change under a run) and a file cache on local disk
# that also keeps files read at an offset (file-cache:cache-file-for-range-read, for random
# reads). Flag names: gcsfuse's cfg/params.yaml (GoogleCloudPlatform/gcsfuse: each config-file
# key's --flag) and https://cloud.google.com/storage/docs/cloud-storage-fuse/config-file
# (file-cache:max-size-mb, file-cache:cache-file-for-range-read, cache-dir).
gcsfuse_command() {
  local cmd=(gcsfuse -o ro --implicit-dirs --type-cache-max-size-mb=-1 --stat-cache-max-size-mb=-1
    --kernel-list-cache-ttl-secs=-1 --metadata-cache-ttl-secs=-1)
  if ((GCSFUSE_CACHE_MB > 0)); then
    cmd+=("--cache-dir=$GCSFUSE_CACHE_DIR/$GCSFUSE_BUCKET"
      "--file-cache-max-size-mb=$GCSFUSE_CACHE_MB" --file-cache-cache-file-for-range-read=true)
  fi
  # shellcheck disable=SC2016  # $HOME is the worker's
  printf '%s --log-file="$HOME"/vit_jax/logs/%s %s\n' "$(quote_args "${cmd[@]}")" \
    "$(quote_args "gcsfuse-$GCSFUSE_BUCKET.log")" "$(quote_args "$GCSFUSE_BUCKET" "$GCSFUSE_MOUNT")"
}

# Mounts the data bucket read-only (installing gcsfuse first if needed), keeps a working mount,
# replaces a broken one (its gcsfuse process gone), and checks the data directory is there.
remote_gcsfuse_mount() {
  echo "gcs_bucket=$(quote_args "$GCSFUSE_BUCKET")"
  echo "gcs_mount=$(quote_args "$GCSFUSE_MOUNT")"
  echo "gcs_data_dir=$(quote_args "$GCSFUSE_DATA_DIR")"
  echo "gcs_url=$(quote_args "$GCSFUSE_URL")"
  echo "gcs_cache=$(quote_args "$GCSFUSE_CACHE_DIR/$GCSFUSE_BUCKET")"
  cat <<'EOF'
mkdir -p logs
if ! command -v gcsfuse >/dev/null 2>&1; then
  # Google's apt repository for gcsfuse, as its install instructions and MaxText's
  # setup_gcsfuse.sh set it up (gcsfuse-CODENAME, e.g. gcsfuse-jammy on Ubuntu 22.04).
  echo "worker $worker: installing gcsfuse from packages.cloud.google.com/apt"
  codename="$(lsb_release -cs 2>/dev/null || sed -n 's/^VERSION_CODENAME=//p' /etc/os-release)"
  if ! { curl -fsS https://packages.cloud.google.com/apt/doc/apt-key.gpg |
      sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null &&
    echo "deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-$codename main" |
      sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null &&
    sudo apt-get -o DPkg::Lock::Timeout=600 update -qq &&
    sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 \
      install -y -qq gcsfuse >/dev/null; }; then
    echo "worker $worker: installing gcsfuse failed (above): the worker needs packages.cloud.google.com; or pass --no-gcsfuse to read gs:// directly" >&2
    exit 1
  fi
fi
if mountpoint -q "$gcs_mount" && ! ls "$gcs_mount" >/dev/null 2>&1; then
  echo "worker $worker: $gcs_mount is a broken gcsfuse mount (its process has ended): mounting it again"
  fusermount -uz "$gcs_mount" || sudo umount -l "$gcs_mount" || true
fi
if mountpoint -q "$gcs_mount"; then
  echo "worker $worker: gs://$gcs_bucket is already mounted at $gcs_mount: kept ('launch/tpu.sh stop --unmount' unmounts it)"
else
  sudo mkdir -p "$gcs_mount" "$gcs_cache"
  sudo chown "$(id -u):$(id -g)" "$gcs_mount" "$gcs_cache"
EOF
  echo "  if ! $(gcsfuse_command); then"
  cat <<'EOF'
    account="$(curl -sf -m 5 -H 'Metadata-Flavor: Google' \
      http://metadata.google.internal/computeMetadata/v1/instance/service-accounts/default/email \
      || echo SERVICE_ACCOUNT)"
    echo "worker $worker: gcsfuse could not mount gs://$gcs_bucket at $gcs_mount (its message is above, its log in ~/vit_jax/logs/gcsfuse-$gcs_bucket.log). Usually the TPU VM's service account $account may not list the bucket (storage.objects.list) or read it (storage.objects.get): grant it 'gcloud storage buckets add-iam-policy-binding gs://$gcs_bucket --member=serviceAccount:$account --role=roles/storage.objectViewer', then rerun" >&2
    exit 1
  fi
  echo "worker $worker: mounted gs://$gcs_bucket read-only at $gcs_mount"
fi
if [ ! -d "$gcs_data_dir" ]; then
  echo "worker $worker: $gcs_data_dir does not exist: $gcs_url has no objects. Check --bucket/--data-dir, or prepare the data there first (e.g. tfds build NAME --data_dir=$gcs_url)" >&2
  exit 1
fi
EOF
}

# stop --unmount: unmounts every gcsfuse mount under $GCSFUSE_ROOT (after training stopped).
remote_gcsfuse_unmount() {
  echo "gcs_root=$(quote_args "$GCSFUSE_ROOT")"
  cat <<'EOF'
sed -n "s#^[^ ]* \($gcs_root/[^ ]*\) fuse.*#\1#p" /proc/mounts | while read -r mount; do
  fusermount -u "$mount" || sudo umount "$mount"
  echo "worker $worker: unmounted $mount"
done
EOF
}

# remote_setup_script: unpack or clone the source into ~/vit_jax and install it in a venv.
remote_setup_script() {
  cat <<'EOF'
set -eu
mkdir -p "$HOME/vit_jax"
cd "$HOME/vit_jax"
rm -f .venv/.setup-ok
EOF
  if [[ -n "${TPU_REPO:-}" ]]; then
    # `git init` + `fetch` also works in a directory that holds a previous install.
    echo "[ -d .git ] || git init --quiet"
    quote_args git fetch --quiet --depth=1 "$TPU_REPO" "${TPU_REF:-HEAD}"
    echo "git checkout --quiet --force FETCH_HEAD"
  else
    echo "tar -xzf \"\$HOME/$REMOTE_ARCHIVE\""
    echo "rm -f \"\$HOME/$REMOTE_ARCHIVE\""
  fi
  cat <<'EOF'
# vit_jax takes the newest jax, flax and orbax on Python 3.12 or 3.13 (pyproject.toml: jax >= 0.11
# needs 3.12; tensorflow-cpu has no 3.14 wheels). The TPU VM images are Ubuntu 22.04, whose python3
# is 3.10 and whose apt has no 3.12: then CPython 3.12 comes from uv (a static binary from PyPI;
# the interpreter is a python-build-standalone build) into ~/.local/share/uv/python, without root
# or apt, the same build on every worker of a pod.
usable() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] not in ((3, 12), (3, 13)))' >/dev/null 2>&1; }
apt_install() {
  # Right after boot unattended-upgrades may hold the apt lock: wait for it rather than fail.
  sudo apt-get -o DPkg::Lock::Timeout=600 update -qq &&
    sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq "$@" >/dev/null
}
# install_python: pip for the image's python3 (apt's python3-pip if it has none), uv with it,
# CPython 3.12 with uv; sets $python to it.
install_python() {
  python3 -m pip --version >/dev/null 2>&1 || apt_install python3-pip || return 1
  python3 -m pip install --user --quiet --disable-pip-version-check 'uv>=0.13,<0.14' || return 1
  "$HOME/.local/bin/uv" python install 3.12 || return 1
  python="$("$HOME/.local/bin/uv" python find --managed-python 3.12)" && usable "$python"
}
# A venv from an older setup (made by Python 3.10 or 3.11) or a broken one is made again.
if [ -e .venv ] && ! { [ -x .venv/bin/pip ] && usable .venv/bin/python; }; then
  old="$(.venv/bin/python --version 2>&1)" || old="no working python"
  echo "$(hostname): recreating ~/vit_jax/.venv (it has $old, vit_jax needs Python 3.12 or 3.13 for the newest jax)"
  rm -rf .venv
fi
if [ ! -d .venv ]; then
  python=""
  for candidate in python3.12 python3.13 python3; do
    if command -v "$candidate" >/dev/null 2>&1 && usable "$candidate"; then
      python="$candidate"
      break
    fi
  done
  if [ -z "$python" ]; then
    echo "$(hostname): vit_jax needs Python 3.12 or 3.13 for the newest jax, this image has $(python3 --version 2>&1): installing Python 3.12 with uv"
    if ! install_python; then
      echo "$(hostname): installing Python 3.12 with uv failed (above; it needs PyPI and GitHub's python-build-standalone releases, or UV_PYTHON_INSTALL_MIRROR): use a --runtime-version whose image has Python 3.12" >&2
      exit 1
    fi
  fi
  # An Ubuntu python has no ensurepip until its -venv package (python3-venv, python3.12-venv) is
  # installed; uv's has it.
  if ! "$python" -m venv .venv >/dev/null 2>&1; then
    rm -rf .venv
    case "$python" in */*) ;; *) apt_install "$python-venv" ;; esac
    "$python" -m venv .venv
  fi
  echo "$(hostname): created ~/vit_jax/.venv with $(.venv/bin/python --version 2>&1)"
fi
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -e '.[tpu]'
.venv/bin/python -c 'import vit_jax'
touch .venv/.setup-ok
echo "$(hostname): vit_jax installed in $HOME/vit_jax (.venv)"
EOF
}

# remote_run_script ARG...: start python -m vit_jax.main ARG... in the background on a worker.
remote_run_script() {
  cat <<'EOF'
set -eu
if ! cd "$HOME/vit_jax" 2>/dev/null || [ ! -f .venv/.setup-ok ]; then
  echo "$(hostname): vit_jax is not installed in ~/vit_jax: run 'launch/tpu.sh setup' first" >&2
  exit 3
fi
EOF
  remote_training_pattern
  remote_worker_number
  remote_tpu_env
  remote_slice_label
  remote_megascale
  if ((GCSFUSE)); then
    remote_gcsfuse_mount
  fi
  remote_stop_training
  remote_free_tpu
  cat <<'EOF'
mkdir -p logs
log="logs/train-$(date +%Y%m%d-%H%M%S)-worker$worker.log"
ln -sfn "${log#logs/}" logs/latest.log
# setsid + nohup: a new session, so a dropped ssh connection does not stop training.
EOF
  # shellcheck disable=SC2016  # $log is the worker's variable
  echo "PYTHONUNBUFFERED=1 setsid nohup $(quote_args .venv/bin/python -m vit_jax.main "$@")" \
    '>"$log" 2>&1 </dev/null &'
  cat <<EOF
echo "worker \$worker: started vit_jax.main (pid \$!), log ~/vit_jax/\$log"
# A bad config key or a missing dataset stops the program while it starts: report it now.
sleep $START_CHECK_SECONDS
EOF
  cat <<'EOF'
if ! pgrep -f "$pattern" >/dev/null; then
  echo "worker $worker: vit_jax.main has already exited; the end of ~/vit_jax/$log:" >&2
  tail -n 30 "$log" >&2
  exit 1
fi
EOF
}

remote_stop_script() {
  echo "set -eu"
  remote_training_pattern
  remote_worker_number
  if multi_slice; then
    remote_tpu_env
    remote_slice_label
  fi
  remote_stop_training
  cat <<'EOF'
echo "worker $worker: vit_jax.main is not running"
EOF
  if ((STOP_UNMOUNT)); then
    remote_gcsfuse_unmount
  fi
}

remote_status_script() {
  echo "set -eu"
  remote_training_pattern
  remote_worker_number
  if multi_slice; then
    remote_tpu_env
    remote_slice_label
  fi
  cat <<'EOF'
if [ ! -f "$HOME/vit_jax/.venv/.setup-ok" ]; then
  echo "worker $worker: vit_jax is not installed (run 'launch/tpu.sh setup')"
elif pids="$(pgrep -f "$pattern")"; then
  echo "worker $worker: training RUNNING (pid $(echo "$pids" | tr '\n' ' '))"
else
  echo "worker $worker: training not running"
fi
log="$HOME/vit_jax/logs/latest.log"
if [ -e "$log" ]; then
  echo "worker $worker: $(readlink "$log"): $(tail -n 1 "$log")"
fi
EOF
}

remote_logs_script() {
  cat <<'EOF'
log="$HOME/vit_jax/logs/latest.log"
if [ ! -e "$log" ]; then
  echo "$(hostname): no training log in ~/vit_jax/logs yet: start training with 'launch/tpu.sh run'" >&2
  exit 1
fi
EOF
  if ((LOG_FOLLOW)); then
    echo "exec tail -n $LOG_LINES -F \"\$log\""
  else
    echo "exec tail -n $LOG_LINES \"\$log\""
  fi
}

# ---------------------------------------------------------------------------------------------
# Local checks
# ---------------------------------------------------------------------------------------------

# check_capacity_flags: --spot / --preemptible / --queued combinations gcloud would reject late.
check_capacity_flags() {
  if is_true "${TPU_SPOT:-0}" && is_true "${TPU_PREEMPTIBLE:-0}"; then
    die "--spot and --preemptible exclude each other (Spot is the newer form of preemptible)"
  fi
  if is_true "${TPU_QUEUED:-0}" && is_true "${TPU_PREEMPTIBLE:-0}"; then
    die "queued resources take --spot, not --preemptible"
  fi
  if is_true "${TPU_RESERVED:-0}" && { is_true "${TPU_SPOT:-0}" || is_true "${TPU_PREEMPTIBLE:-0}"; }; then
    die "--reserved excludes --spot and --preemptible"
  fi
}

# check_config_file: the config file must exist in the checkout that setup copies (a typo would
# otherwise only show up on the workers).
check_config_file() {
  local file="${TPU_CONFIG%%:*}"
  if [[ -n "${TPU_REPO:-}" || "$file" == /* ]]; then
    return 0  # the workers' copy comes from elsewhere
  fi
  [[ -f "$REPO_ROOT/$file" ]] ||
    die "config file '$file' (from --config $TPU_CONFIG) not found in $REPO_ROOT: give a path relative to the project root, e.g. configs/vit.py:b16,imagenet2012"
}

# check_gcs_url WHAT VALUE: a value that starts with gs: must be a whole gs://BUCKET[/PATH] URL
# (gs:/bucket or gs:bucket would become a local directory named "gs:").
check_gcs_url() {
  if [[ "$2" == gs:* && ! "$2" =~ ^gs://[a-z0-9][-a-z0-9_.]{1,61}[a-z0-9](/.*)?$ ]]; then
    die "$1 '$2' is not a gs://BUCKET/PATH URL (a bucket name has 3 to 63 characters: lower-case letters, digits, '-', '_' and '.', starting and ending with a letter or digit)"
  fi
}

# check_bucket_region URL...: warn when a bucket is missing/unreadable or lives in another region
# than the TPU (slow input and cross-region egress charges).
check_bucket_region() {
  local url bucket bucket_location region="${TPU_ZONE%-*}" seen=" "
  for url in "$@"; do
    [[ "$url" == gs://* ]] || continue
    bucket="${url#gs://}"
    bucket="${bucket%%/*}"
    [[ "$seen" != *" $bucket "* ]] || continue
    seen+="$bucket "
    if ! bucket_location="$(gcloud storage buckets describe "gs://$bucket" '--format=value(location)' 2>/dev/null)"; then
      warn "cannot read bucket gs://$bucket (it does not exist, or you lack storage.buckets.get): training fails if the workers cannot use $url"
      continue
    fi
    bucket_location="${bucket_location,,}"
    if [[ "$bucket_location" =~ ^[a-z]+-[a-z]+[0-9]+$ && "$bucket_location" != "$region" ]]; then
      warn "bucket gs://$bucket is in $bucket_location but the TPU in $region: reading data across regions is slow and billed as egress"
    fi
  done
}

# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------

# require_ready: the TPU, or with --slices every slice, exists and is READY (which fills in
# TPU_TYPE). A dry run asks gcloud nothing; with --slices it needs TPU_TYPE (every worker is
# reached at once: the ssh --batch-size counts them).
require_ready() {
  if dry_run; then
    if multi_slice; then
      require TPU_TYPE "--type TYPE" "--dry-run does not ask the slices for their type"
      validate_type "$TPU_TYPE"
      require_multislice_type "$TPU_TYPE"
    fi
    return 0
  fi
  need_gcloud
  if multi_slice; then
    require_ready_slices
    require_multislice_type "$TPU_TYPE"
  else
    require_ready_tpu
  fi
}

cmd_create() {
  local version capacity=() hosts first_tpu
  require_location
  require TPU_TYPE "--type TYPE" "the accelerator type, e.g. v3-8 or v3-32"
  validate_type "$TPU_TYPE"
  first_tpu="$TPU_NAME"
  if multi_slice; then
    require_multislice_type "$TPU_TYPE"
    TPU_QUEUED=1  # Cloud TPU makes several slices only through a queued resource.
    first_tpu="$(node_name 0)"
  fi
  check_capacity_flags
  hosts="$(num_hosts "$TPU_TYPE")"
  version="${TPU_RUNTIME_VERSION:-$(default_runtime_version "$TPU_TYPE")}"
  is_true "${TPU_SPOT:-0}" && capacity+=(--spot)
  is_true "${TPU_PREEMPTIBLE:-0}" && capacity+=(--preemptible)
  is_true "${TPU_RESERVED:-0}" && capacity+=(--reserved)

  if ! dry_run; then
    need_gcloud
    if describe_tpu "$first_tpu"; then
      case "$TPU_STATE" in
        PREEMPTED | TERMINATED)
          die "TPU $first_tpu exists but is $TPU_STATE: delete it first ('$(hint delete)'), then create it again" ;;
      esac
      if [[ -n "$TPU_ACTUAL_TYPE" && "$TPU_ACTUAL_TYPE" != "$TPU_TYPE" ]]; then
        warn "TPU $first_tpu is a $TPU_ACTUAL_TYPE, not the $TPU_TYPE asked for: delete it or pick another --name"
      fi
      info "TPU $first_tpu already exists (${TPU_STATE:-state unknown}, ${TPU_ACTUAL_TYPE:-type unknown}): nothing to create."
      return 0
    fi
    # Checked with or without --queued: a pending request must not be doubled by a second one.
    if describe_queued_resource; then
      case "$QR_STATE" in
        FAILED | SUSPENDED)
          die "queued resource $TPU_QR_NAME exists but is $QR_STATE: delete it ('$(hint delete)'), then create again" ;;
      esac
      info "Queued resource $TPU_QR_NAME already exists (${QR_STATE:-state unknown}): nothing to create."
      info "Next: $(hint status) (wait for READY), then $(hint setup)"
      return 0
    fi
  fi

  if multi_slice; then
    # https://cloud.google.com/sdk/gcloud/reference/compute/tpus/queued-resources/create: the
    # TPUs are named NAME-0 ... NAME-(N-1) (MultisliceParams.nodeIdPrefix of the TPU API).
    run_gcloud compute tpus queued-resources create "$TPU_QR_NAME" "--node-count=$SLICES" \
      "--node-prefix=$TPU_NAME" "${LOCATION[@]}" "--accelerator-type=$TPU_TYPE" \
      "--runtime-version=$version" "${capacity[@]}" "${EXTRA_ARGS[@]}"
    if ! dry_run; then
      info "Queued resource $TPU_QR_NAME requested: $SLICES slices $(node_name 0) ... $(node_name $((SLICES - 1))) ($TPU_TYPE, $hosts worker(s) each) are created together when capacity is free (WAITING_FOR_RESOURCES -> PROVISIONING -> ACTIVE)."
    fi
    info "Next: $(hint status) (wait for ACTIVE and every slice READY), then $(hint setup)"
  elif is_true "${TPU_QUEUED:-0}"; then
    run_gcloud compute tpus queued-resources create "$TPU_QR_NAME" "--node-id=$TPU_NAME" \
      "${LOCATION[@]}" "--accelerator-type=$TPU_TYPE" "--runtime-version=$version" \
      "${capacity[@]}" "${EXTRA_ARGS[@]}"
    if ! dry_run; then
      info "Queued resource $TPU_QR_NAME requested: TPU $TPU_NAME ($TPU_TYPE, $hosts worker(s)) is created when capacity is free (WAITING_FOR_RESOURCES -> PROVISIONING -> ACTIVE)."
    fi
    # setup needs a READY TPU, which takes from minutes to days here.
    info "Next: $(hint status) (wait for READY), then $(hint setup)"
  else
    run_gcloud compute tpus tpu-vm create "$TPU_NAME" "${LOCATION[@]}" \
      "--accelerator-type=$TPU_TYPE" "--version=$version" "${capacity[@]}" "${EXTRA_ARGS[@]}"
    info "Next: $(hint setup)"
  fi
}

# archive_command OUT: sets ARCHIVE_CMD to the command that writes this checkout as a .tar.gz to
# OUT (HEAD plus uncommitted edits to tracked files) and ARCHIVE_NOTE to what it holds; warns
# about untracked files, which it leaves out. Runs only read-only git commands, also in a dry run.
archive_command() {
  local out="$1" rev untracked
  if ! git -C "$REPO_ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    warn "$REPO_ROOT is not a git checkout: copying the directory (without .git, .venv and caches)"
    ARCHIVE_CMD=(tar -C "$REPO_ROOT" --exclude=.git --exclude=.venv --exclude=__pycache__
      '--exclude=*.egg-info' -czf "$out" .)
    ARCHIVE_NOTE="the directory $REPO_ROOT"
    return 0
  fi
  untracked="$(git -C "$REPO_ROOT" ls-files --others --exclude-standard | head -n 5 | tr '\n' ' ')"
  [[ -z "$untracked" ]] || warn "untracked files are not copied (git add them to include them): $untracked"
  # `git stash create` snapshots tracked changes as a commit without touching the working tree or
  # the stash list; it prints nothing when there are none.
  rev="$(git -C "$REPO_ROOT" stash create 2>/dev/null || true)"
  if [[ -n "$rev" ]]; then
    ARCHIVE_NOTE="HEAD plus uncommitted edits to tracked files (commit $rev from 'git stash create')"
  else
    ARCHIVE_NOTE="HEAD ($(git -C "$REPO_ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no commit'); no uncommitted edits)"
  fi
  ARCHIVE_CMD=(git -C "$REPO_ROOT" archive --format=tar.gz -o "$out" "${rev:-HEAD}")
}

# run_local ARG...: run a local command, echoing it to stderr first; with --dry-run print it to
# stdout instead.
run_local() {
  if dry_run; then
    print_command "$@"
    return 0
  fi
  info "+ $(quote_args "$@")"
  "$@"
}

cmd_setup() {
  local tmp archive
  require_location
  require_ready

  if [[ -z "${TPU_REPO:-}" ]]; then
    # The archive goes through a fresh temporary directory; a dry run prints the same steps, with
    # the directory in a shell variable (see DRY_TMP).
    if dry_run; then
      # shellcheck disable=SC2016  # printed for the shell that runs the dry run's output
      printf '%s\n' 'tmp="$(mktemp -d)"'
      tmp="$DRY_TMP"
    else
      tmp="$(mktemp -d)"
      # shellcheck disable=SC2064  # expand $tmp now: it is local to this function
      trap "rm -rf '$tmp'" EXIT
    fi
    archive="$tmp/$REMOTE_ARCHIVE"
    archive_command "$archive"
    if dry_run; then
      printf '# %s\n' "$ARCHIVE_NOTE"
    else
      info "Copying $ARCHIVE_NOTE"
    fi
    run_local "${ARCHIVE_CMD[@]}"
    scp_all "$archive" "$REMOTE_ARCHIVE"
    run_local rm -rf "$tmp"
  fi
  ssh_all "$(remote_setup_script)"
  info "Next: $(hint run --config CONFIG --workdir gs://BUCKET/RUN)"
}

# check_dcn_data: a --config.mesh.dcn_data among the overrides must be the number of slices (a
# single slice: 1). Sets DCN_GIVEN when the overrides already say it.
check_dcn_data() {
  local i arg value
  DCN_GIVEN=0
  for ((i = 0; i < ${#EXTRA_ARGS[@]}; i++)); do
    arg="${EXTRA_ARGS[i]}"
    case "$arg" in
      --config.mesh.dcn_data=*) value="${arg#*=}" ;;
      --config.mesh.dcn_data) value="${EXTRA_ARGS[i + 1]:-}" ;;  # after --, as absl takes it
      *) continue ;;
    esac
    if [[ ! "$value" =~ ^[0-9]+$ ]] || ((10#$value != SLICES)); then
      if multi_slice; then
        die "--config.mesh.dcn_data=$value conflicts with --slices $SLICES: a $SLICES-slice run splits the data axis over its slices (run and preflight pass --config.mesh.dcn_data=$SLICES themselves): drop the override, or change --slices"
      fi
      die "--config.mesh.dcn_data=$value splits the data axis over $value slices, but this run is on one TPU: create and run that many with --slices $value, or drop the override"
    fi
    DCN_GIVEN=1
  done
}

# find_data_dir_override: the last --config.data.data_dir override among the extra arguments
# (--config.data.data_dir=DIR, or after -- also --config.data.data_dir DIR, as absl takes it).
# Sets DATA_OVERRIDE (the override as written) and DATA_OVERRIDE_DIR (its value); empty if none.
find_data_dir_override() {
  local i arg
  DATA_OVERRIDE=""
  DATA_OVERRIDE_DIR=""
  for ((i = 0; i < ${#EXTRA_ARGS[@]}; i++)); do
    arg="${EXTRA_ARGS[i]}"
    case "$arg" in
      --config.data.data_dir=*)
        DATA_OVERRIDE="$arg"
        DATA_OVERRIDE_DIR="${arg#*=}"
        ;;
      --config.data.data_dir)
        DATA_OVERRIDE_DIR="${EXTRA_ARGS[i + 1]:-}"
        DATA_OVERRIDE="$arg $DATA_OVERRIDE_DIR"
        ;;
    esac
  done
}

# choose_gcsfuse DATA_DIR: whether run mounts the data bucket with gcsfuse (GCSFUSE=1, with the
# settings of gcsfuse_settings) or leaves DATA_DIR as it is (GCSFUSE=0). Data in a bucket is
# mounted by default: array_record's reader asks the server for the rest of the file on every
# random read, many times the record's bytes (docs/data.md "Reading from a bucket"). TPU_GCSFUSE
# unset or empty: that default, which a --config.data.data_dir override turns off (the user's
# data_dir wins, said in one line), and a local or no data_dir leaves off silently; true
# (--gcsfuse): mount, refusing what cannot be mounted; false (--no-gcsfuse): never mount.
choose_gcsfuse() {
  local data_dir="$1"
  GCSFUSE=0
  if [[ -z "${TPU_GCSFUSE:-}" ]]; then
    [[ "$data_dir" == gs://* ]] || return 0
    if [[ -n "$DATA_OVERRIDE" ]]; then
      info "'$DATA_OVERRIDE' wins over $data_dir: no gcsfuse mount (the default for data in a bucket), vit_jax.main reads that data_dir as it is (give it as --data-dir gs://BUCKET/PATH instead to read it through the mount)"
      return 0
    fi
  elif ! is_true "$TPU_GCSFUSE"; then
    return 0
  fi
  gcsfuse_settings "$data_dir"
  GCSFUSE=1
}

# gcsfuse_settings URL: the bucket and path of the TFDS data_dir URL (gs://BUCKET/PATH) to
# mount, and the checked cache settings. Sets GCSFUSE_URL, GCSFUSE_BUCKET, GCSFUSE_MOUNT,
# GCSFUSE_DATA_DIR (the local path vit_jax.main gets), GCSFUSE_CACHE_DIR and GCSFUSE_CACHE_MB.
gcsfuse_settings() {
  local url="$1" path
  if [[ -n "${TPU_DATA_DIR:-}" && "$TPU_DATA_DIR" != gs://* ]]; then
    die "--gcsfuse mounts a Cloud Storage bucket, but --data-dir $TPU_DATA_DIR is a local path: give --data-dir gs://BUCKET/PATH (or --bucket BUCKET), or drop --gcsfuse to read $TPU_DATA_DIR as it is"
  fi
  [[ -n "$url" ]] ||
    die "--gcsfuse needs the bucket to mount: pass --bucket BUCKET (data in gs://BUCKET/tensorflow_datasets) or --data-dir gs://BUCKET/PATH"
  if [[ -n "$DATA_OVERRIDE" ]]; then
    die "'$DATA_OVERRIDE' would replace the data_dir that --gcsfuse sets (the mounted path): give the data as --data-dir gs://BUCKET/PATH instead, or drop --gcsfuse (the override then turns the mount off and vit_jax.main reads it as it is)"
  fi
  url="${url%/}"
  GCSFUSE_URL="$url"
  path="${url#gs://}"
  GCSFUSE_BUCKET="${path%%/*}"
  path="${path#"$GCSFUSE_BUCKET"}"
  GCSFUSE_MOUNT="$GCSFUSE_ROOT/$GCSFUSE_BUCKET"
  GCSFUSE_DATA_DIR="$GCSFUSE_MOUNT$path"
  GCSFUSE_CACHE_DIR="${TPU_GCSFUSE_CACHE_DIR:-$GCSFUSE_DEFAULT_CACHE_DIR}"
  GCSFUSE_CACHE_DIR="${GCSFUSE_CACHE_DIR%/}"
  [[ "$GCSFUSE_CACHE_DIR" == /?* && "$GCSFUSE_CACHE_DIR" != *[[:space:]]* ]] ||
    die "--gcsfuse-cache-dir '$GCSFUSE_CACHE_DIR' is not an absolute path without spaces on the worker (e.g. $GCSFUSE_DEFAULT_CACHE_DIR)"
  [[ "$GCSFUSE_CACHE_DIR/" != "$GCSFUSE_ROOT/"* ]] ||
    die "--gcsfuse-cache-dir $GCSFUSE_CACHE_DIR is under $GCSFUSE_ROOT, where the buckets are mounted: pick a directory on local disk, e.g. $GCSFUSE_DEFAULT_CACHE_DIR"
  GCSFUSE_CACHE_MB="${TPU_GCSFUSE_CACHE_MB:-$GCSFUSE_DEFAULT_CACHE_MB}"
  [[ "$GCSFUSE_CACHE_MB" =~ ^[0-9]+$ ]] ||
    die "--gcsfuse-cache-mb must be a size in MiB (0 turns the file cache off), got '$GCSFUSE_CACHE_MB'"
  GCSFUSE_CACHE_MB=$((10#$GCSFUSE_CACHE_MB))
}

cmd_run() {
  local hosts data_dir="${TPU_DATA_DIR:-}" arg train_args what
  require_location
  require TPU_CONFIG "--config CONFIG" "e.g. configs/vit.py:b16,imagenet2012"
  require TPU_WORKDIR "--workdir DIR" "where checkpoints, TensorBoard events and cost.json go, e.g. gs://BUCKET/b16_i1k"
  check_config_file
  for arg in "${EXTRA_ARGS[@]}"; do
    case "$arg" in
      --config | --config=* | --workdir | --workdir=*)
        die "'$arg' among the extra arguments: give the config and workdir as --config/--workdir options of $PROG only" ;;
    esac
  done
  check_dcn_data
  # TFDS data: --data-dir, else gs://BUCKET/tensorflow_datasets, read through a gcsfuse mount
  # when in a bucket (choose_gcsfuse); a --config.data.data_dir override among the extra
  # arguments wins over both (and so turns the default mount off; an explicit --gcsfuse refuses).
  if [[ -z "$data_dir" && -n "${TPU_BUCKET:-}" ]]; then
    data_dir="gs://${TPU_BUCKET#gs://}"
    data_dir="${data_dir%/}/tensorflow_datasets"
  fi
  check_gcs_url "--data-dir (or --bucket)" "$data_dir"
  find_data_dir_override
  choose_gcsfuse "$data_dir"
  # With --preflight and a known type, compile first: before gcloud or the TPU is needed.
  if is_true "${TPU_PREFLIGHT:-0}" && [[ -n "${TPU_TYPE:-}" ]]; then
    run_preflight
  fi
  if dry_run; then
    require TPU_TYPE "--type TYPE" "--dry-run does not ask the TPU for its type"
  fi
  require_ready
  validate_type "$TPU_TYPE"
  hosts="$(num_hosts "$TPU_TYPE")"
  what="a $TPU_TYPE has $hosts workers"
  if multi_slice; then
    hosts=$((hosts * SLICES))
    what="$SLICES slices of $TPU_TYPE have $hosts workers"
  fi
  if is_true "${TPU_PREFLIGHT:-0}" && [[ -z "${PREFLIGHT_DONE:-}" ]]; then
    run_preflight  # The type came from the TPU.
  fi

  check_gcs_url --workdir "$TPU_WORKDIR"
  # On a pod every worker writes its share of each checkpoint into the same directory: it has to
  # be shared storage. A local path would give each worker its own partial checkpoints.
  if [[ "$TPU_WORKDIR" != gs://* ]]; then
    if ((hosts > 1)); then
      die "--workdir $TPU_WORKDIR is not on GCS, but $what: each would write its own checkpoints on its own disk and the run could not resume. Use --workdir gs://${TPU_BUCKET:-BUCKET}/NAME"
    fi
    warn "--workdir $TPU_WORKDIR is on the TPU VM's disk: checkpoints, TensorBoard events and cost.json are lost when the TPU is deleted or preempted (use gs://BUCKET/NAME)"
  fi
  [[ -z "$DATA_OVERRIDE" ]] || data_dir=""
  check_gcs_url "--config.data.data_dir" "$DATA_OVERRIDE_DIR"
  if ((hosts > 1)) && [[ -z "$data_dir" && -z "$DATA_OVERRIDE_DIR" ]]; then
    warn "no --data-dir or --bucket: each of the $hosts workers reads TFDS data from its own ~/tensorflow_datasets (pass --data-dir gs://BUCKET/tensorflow_datasets)"
  fi
  if ! dry_run; then
    check_bucket_region "$TPU_WORKDIR" "${data_dir:-$DATA_OVERRIDE_DIR}"
  fi

  train_args=("--config=$TPU_CONFIG" "--workdir=$TPU_WORKDIR")
  if ((GCSFUSE)); then
    data_dir="$GCSFUSE_DATA_DIR"  # the bucket as the run script mounts it on every worker
  fi
  [[ -z "$data_dir" ]] || train_args+=("--config.data.data_dir=$data_dir")
  if multi_slice && ((!DCN_GIVEN)); then
    train_args+=("--config.mesh.dcn_data=$SLICES")
  fi
  train_args+=("${EXTRA_ARGS[@]}")
  ssh_all "$(remote_run_script "${train_args[@]}")"
  dry_run && return 0

  if multi_slice; then
    info "Training runs on all $hosts workers of the $SLICES slices $(node_name 0) ... $(node_name $((SLICES - 1))) (--config.mesh.dcn_data=$SLICES); logs in ~/vit_jax/logs on each worker."
    info "  follow slice 0 worker 0: $(hint logs)"
    info "  another worker:    $(hint logs --slice 1 --worker 1)"
  else
    info "Training runs on all $hosts worker(s) of $TPU_NAME; logs in ~/vit_jax/logs on each worker."
    info "  follow worker 0:   $(hint logs)"
    info "  another worker:    $(hint logs --worker 1)"
  fi
  if ((GCSFUSE)); then
    info "  data:              $GCSFUSE_URL, mounted read-only at $GCSFUSE_MOUNT on every worker (--no-gcsfuse reads gs:// directly)"
  fi
  info "  state:             $(hint status)"
  info "  stop:              $(hint stop)"
  info "  TensorBoard:       tensorboard --logdir $TPU_WORKDIR"
  info "Rerunning the same 'run' command resumes from the latest checkpoint in $TPU_WORKDIR/checkpoints."
}

# preflight_command: the local vit_jax.preflight command of the config, type and overrides.
preflight_command() {
  local python="${TPU_PREFLIGHT_PYTHON:-}"
  if [[ -z "$python" ]]; then
    python="python3"
    [[ ! -x "$REPO_ROOT/.venv/bin/python" ]] || python="$REPO_ROOT/.venv/bin/python"
  fi
  local slices=()
  if multi_slice && ((!DCN_GIVEN)); then
    slices=("--config.mesh.dcn_data=$SLICES")  # N slices of TPU_TYPE, as run gives vit_jax.main
  fi
  PREFLIGHT_CMD=("$python" -m vit_jax.preflight "--config=$TPU_CONFIG"
    "--accelerator=$TPU_TYPE" "${slices[@]}" "${EXTRA_ARGS[@]}")
}

cmd_preflight() {
  local status=0
  require TPU_CONFIG "--config CONFIG" "e.g. configs/vit.py:b16,imagenet2012"
  require TPU_TYPE "--type TYPE" "the accelerator type to compile for, e.g. v3-32"
  validate_type "$TPU_TYPE"
  DCN_GIVEN=0
  if multi_slice; then
    require_multislice_type "$TPU_TYPE"
    check_dcn_data
  fi
  check_config_file
  preflight_command
  if dry_run; then
    print_command cd "$REPO_ROOT"
    print_command "${PREFLIGHT_CMD[@]}"
    return 0
  fi
  info "+ $(quote_args "${PREFLIGHT_CMD[@]}")"
  (cd "$REPO_ROOT" && "${PREFLIGHT_CMD[@]}") || status=$?
  return "$status"
}

# run_preflight: run's --preflight; stops the run unless the step fits.
run_preflight() {
  local status=0
  cmd_preflight || status=$?
  PREFLIGHT_DONE=1
  ((status == 0)) ||
    die "pre-flight: the step of $TPU_CONFIG does not fit a $TPU_TYPE or cannot be compiled (exit $status, see above); nothing was started on the workers. Apply the overrides it prints, or run without --preflight."
}

cmd_logs() {
  local hosts
  require_location
  [[ "$LOG_WORKER" =~ ^[0-9]+$ ]] || die "--worker must be a worker number (0, 1, ...), got '$LOG_WORKER'"
  [[ "$LOG_SLICE" =~ ^[0-9]+$ ]] || die "--slice must be a slice number (0, 1, ...), got '$LOG_SLICE'"
  [[ "$LOG_LINES" =~ ^[0-9]+$ ]] || die "--lines must be a number, got '$LOG_LINES'"
  if multi_slice; then
    ((LOG_SLICE < SLICES)) || die "--slice $LOG_SLICE: --slices $SLICES has slices 0 to $((SLICES - 1))"
  elif ((LOG_SLICE != 0)); then
    die "--slice $LOG_SLICE: a single TPU has no slices to choose from: pass --slices N for a multi-slice run"
  fi
  if ! dry_run; then
    require_ready
  fi
  if [[ -n "${TPU_TYPE:-}" ]]; then
    validate_type "$TPU_TYPE"
    hosts="$(num_hosts "$TPU_TYPE")"
    ((LOG_WORKER < hosts)) || die "--worker $LOG_WORKER: a $TPU_TYPE has workers 0 to $((hosts - 1))"
  fi
  if multi_slice; then
    ssh_slices "$LOG_SLICE" "$LOG_WORKER" "$(remote_logs_script)"
  else
    ssh_worker "$LOG_WORKER" "$(remote_logs_script)"
  fi
}

# status_slices: the queued resource and each slice, then the workers when all are READY.
status_slices() {
  local k name ready=1
  if dry_run; then
    require_ready
    quote_args gcloud compute tpus queued-resources describe "$TPU_QR_NAME" "${LOCATION[@]}"
    ssh_all "$(remote_status_script)"
    return 0
  fi
  need_gcloud
  if ! describe_queued_resource; then
    info "Queued resource $TPU_QR_NAME: does not exist in zone $TPU_ZONE of project $TPU_PROJECT"
    return 1
  fi
  info "Queued resource $TPU_QR_NAME: ${QR_STATE:-state unknown}"
  for ((k = 0; k < SLICES; k++)); do
    name="$(node_name "$k")"
    if describe_tpu "$name"; then
      info "Slice $k, TPU $name: ${TPU_STATE:-state unknown}, ${TPU_ACTUAL_TYPE:-type unknown}${TPU_ACTUAL_TYPE:+, $(num_hosts "$TPU_ACTUAL_TYPE") worker(s)}"
      [[ "$TPU_STATE" == READY ]] || ready=0
      TPU_TYPE="${TPU_TYPE:-$TPU_ACTUAL_TYPE}"
    else
      info "Slice $k, TPU $name: does not exist (yet)"
      ready=0
    fi
  done
  if ((ready)) && [[ "$QR_STATE" == ACTIVE && -n "${TPU_TYPE:-}" ]]; then
    ssh_all "$(remote_status_script)"
  fi
}

cmd_status() {
  require_location
  if multi_slice; then
    status_slices
    return
  fi
  if dry_run; then
    quote_args gcloud compute tpus tpu-vm describe "$TPU_NAME" "${LOCATION[@]}"
    ssh_worker all "$(remote_status_script)"
    return 0
  fi
  need_gcloud
  if describe_queued_resource; then
    info "Queued resource $TPU_QR_NAME: ${QR_STATE:-state unknown}"
  fi
  if ! describe_tpu; then
    info "TPU $TPU_NAME: does not exist in zone $TPU_ZONE of project $TPU_PROJECT"
    [[ -n "$QR_STATE" ]] || return 1
    return 0
  fi
  info "TPU $TPU_NAME: ${TPU_STATE:-state unknown}, ${TPU_ACTUAL_TYPE:-type unknown}${TPU_ACTUAL_TYPE:+, $(num_hosts "$TPU_ACTUAL_TYPE") worker(s)}"
  if [[ "$TPU_STATE" != READY ]]; then
    return 0
  fi
  ssh_worker all "$(remote_status_script)"
}

cmd_stop() {
  require_location
  require_ready
  ssh_all "$(remote_stop_script)"
  info "The TPU is still running (and billed): '$(hint delete)' deletes it."
}

cmd_delete() {
  local qr_exists=0 tpu_exists=0 what=""
  require_location
  if dry_run; then
    # The real run deletes the queued resource when it exists, else the TPU; a dry run does not
    # ask gcloud which, so it prints the one --queued says and the other as a comment.
    local delete_qr=(gcloud compute tpus queued-resources delete "$TPU_QR_NAME" "${LOCATION[@]}" --force --quiet)
    local delete_tpu=(gcloud compute tpus tpu-vm delete "$TPU_NAME" "${LOCATION[@]}" --quiet)
    if multi_slice; then
      print_command "${delete_qr[@]}"  # Several slices always come from a queued resource.
    elif is_true "${TPU_QUEUED:-0}"; then
      print_command "${delete_qr[@]}"
      printf '# if queued resource %s does not exist (%s was created without --queued), the real delete runs this instead:\n# %s\n' \
        "$TPU_QR_NAME" "$TPU_NAME" "$(print_command "${delete_tpu[@]}")"
    else
      print_command "${delete_tpu[@]}"
      printf '# if %s was created through a queued resource (create --queued), the real delete runs this instead, which deletes the TPU with it:\n# %s\n' \
        "$TPU_NAME" "$(print_command "${delete_qr[@]}")"
    fi
    return 0
  fi
  need_gcloud
  # A TPU made through a queued resource is deleted with it (--force deletes its TPU first).
  describe_queued_resource && qr_exists=1
  if multi_slice; then
    if ((!qr_exists)); then
      info "Nothing to delete: queued resource $TPU_QR_NAME does not exist in zone $TPU_ZONE of project $TPU_PROJECT."
      return 0
    fi
    what="queued resource $TPU_QR_NAME (${QR_STATE:-state unknown}) with its $SLICES slices $(node_name 0) ... $(node_name $((SLICES - 1)))"
  else
    describe_tpu && tpu_exists=1
    if ((!qr_exists && !tpu_exists)); then
      info "Nothing to delete: neither TPU $TPU_NAME nor queued resource $TPU_QR_NAME exists in zone $TPU_ZONE of project $TPU_PROJECT."
      return 0
    fi
    ((tpu_exists)) && what="TPU $TPU_NAME (${TPU_ACTUAL_TYPE:-type unknown}, ${TPU_STATE:-state unknown})"
    ((qr_exists)) && what="${what:+$what and }queued resource $TPU_QR_NAME (${QR_STATE:-state unknown})"
  fi
  confirm "Delete $what in $TPU_ZONE, project $TPU_PROJECT? Training stops and the workers' disks go (gs:// data stays)."
  if ((qr_exists)); then
    run_gcloud compute tpus queued-resources delete "$TPU_QR_NAME" "${LOCATION[@]}" --force --quiet
  else
    run_gcloud compute tpus tpu-vm delete "$TPU_NAME" "${LOCATION[@]}" --quiet
  fi
}

main() {
  local command="${1:-}"
  case "$command" in
    -h | --help | help)
      usage
      exit 0
      ;;
    '')
      usage >&2
      exit 2
      ;;
    preflight)
      DIE_STATUS=2  # as vit_jax.preflight: 1 means "does not fit", 2 a bad setting
      shift
      ;;
    create | setup | run | logs | status | stop | delete) shift ;;
    *) die "unknown command '$command' (one of: create setup preflight run logs status stop delete; see '$PROG --help')" ;;
  esac
  parse_options "$@"
  validate_slices
  "cmd_$command"
}

main "$@"
