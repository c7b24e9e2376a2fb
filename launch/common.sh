# shellcheck shell=bash
# Helpers for launch/tpu.sh, which sources this file: messages, settings and their checks,
# accelerator types, slices, and the two ways gcloud is called (run_gcloud for commands that act,
# which --dry-run prints instead; query for read-only look-ups, which --dry-run skips).

# Namerefs, ${var,,} and "${empty_array[@]}" under `set -u` need bash >= 4.4 (macOS ships 3.2).
if ((BASH_VERSINFO[0] < 4 || (BASH_VERSINFO[0] == 4 && BASH_VERSINFO[1] < 4))); then
  echo "launch/tpu.sh needs bash >= 4.4, this is ${BASH_VERSION} (on macOS: brew install bash)." >&2
  exit 2
fi

PROG="${PROG:-launch/tpu.sh}"

# ---------------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------------

info() { printf '%s\n' "$*" >&2; }
warn() { printf '%s: warning: %s\n' "$PROG" "$*" >&2; }
die() {
  printf '%s: error: %s\n' "$PROG" "$*" >&2
  exit "${DIE_STATUS:-1}"  # 2 for preflight, whose 1 means "does not fit"
}

# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------

# is_true VALUE: 1/true/yes/on are true; 0/false/no/off/empty are false; anything else is an error.
is_true() {
  case "${1,,}" in
    1 | true | yes | y | on) return 0 ;;
    0 | false | no | n | off | '') return 1 ;;
    *) die "expected a boolean (1/0, true/false, yes/no), got '$1'" ;;
  esac
}

dry_run() { is_true "${DRY_RUN:-0}"; }

# require VAR FLAG DESCRIPTION...: stop with a message that names the setting when VAR is empty.
require() {
  local var="$1" flag="$2"
  shift 2
  if [[ -z "${!var:-}" ]]; then
    die "$var is not set: pass $flag or export $var=... ($*)"
  fi
}

# require_location: name, zone and project are set and well-formed; sets LOCATION, the flags that
# every TPU command gets (so a stale `gcloud config` default never picks the project or zone), and
# the default queued resource id.
require_location() {
  require TPU_NAME "--name NAME" "the TPU VM's name"
  require TPU_ZONE "--zone ZONE" "e.g. us-central1-a; 'gcloud compute tpus locations list' lists them"
  require TPU_PROJECT "--project PROJECT" "the Google Cloud project id; see 'gcloud config get-value project'"
  [[ "$TPU_NAME" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] ||
    die "TPU_NAME '$TPU_NAME' is not a valid TPU name (lowercase letters, digits and '-', starting with a letter)"
  [[ "$TPU_ZONE" =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]] ||
    die "TPU_ZONE '$TPU_ZONE' does not look like a zone (e.g. us-central1-a, europe-west4-a): a region alone is not enough"
  LOCATION=("--zone=$TPU_ZONE" "--project=$TPU_PROJECT")
  TPU_QR_NAME="${TPU_QR_NAME:-$TPU_NAME-qr}"
}

# ---------------------------------------------------------------------------------------------
# Accelerator types
# ---------------------------------------------------------------------------------------------

# The largest slice of each generation (TensorCores for v2-v5p, chips for v5e/v6e).
declare -A MAX_TYPE_SIZE=([v2]=512 [v3]=2048 [v4]=4096 [v5p]=12288 [v5litepod]=256 [v6e]=256)

# validate_type TYPE: a generation and a size, e.g. v3-8, v3-32, v4-32, v5litepod-16, v5p-8, v6e-8.
validate_type() {
  local type="$1" gen size max
  if [[ "$type" =~ ^v5e-([0-9]+)$ ]]; then
    die "accelerator type '$type': gcloud calls TPU v5e 'v5litepod', use --type v5litepod-${BASH_REMATCH[1]}"
  fi
  if [[ ! "$type" =~ ^(v2|v3|v4|v5p|v5litepod|v6e)-([1-9][0-9]{0,5})$ ]]; then
    die "accelerator type '$type' is not GENERATION-SIZE with GENERATION one of v2, v3, v4, v5p, v5litepod, v6e (e.g. v3-8, v3-32, v4-32, v5litepod-16, v5p-8, v6e-8)"
  fi
  gen="${BASH_REMATCH[1]}"
  size="${BASH_REMATCH[2]}"
  max="${MAX_TYPE_SIZE[$gen]}"
  case "$gen" in
    v2 | v3 | v4 | v5p) ((size >= 8)) || die "accelerator type '$type': the smallest $gen slice is ${gen}-8" ;;
  esac
  ((size <= max)) || die "accelerator type '$type': the largest $gen slice is ${gen}-$max"
  case "$gen" in
    v4 | v5p)
      # 3D slices AxBxC of whole 4-chip hosts (8 TensorCores); above 64 chips every side is a
      # multiple of 4 (4x4x12 is a v4-384, 16x16x24 the v5p-12288), so a multiple of 128.
      if ((size % 8 != 0 || (size > 128 && size % 128 != 0))); then
        die "accelerator type '$type': the size must be a multiple of 8, and above 128 a multiple of 128 (e.g. ${gen}-32, ${gen}-384)"
      fi
      ;;
    *)
      (((size & (size - 1)) == 0)) ||
        die "accelerator type '$type': the size must be a power of two (e.g. ${gen}-8, ${gen}-32)"
      ;;
  esac
}

# num_hosts TYPE: how many TPU VM workers a slice has. The size counts TensorCores for v2-v5p
# (8 per host) and chips for v5e/v6e (up to 8 on a single host, 4 per host in a pod).
num_hosts() {
  local gen="${1%-*}" size="${1##*-}"
  case "$gen" in
    v5litepod | v6e) if ((size <= 8)); then echo 1; else echo $((size / 4)); fi ;;
    *) echo $(((size + 7) / 8)) ;;
  esac
}

# default_runtime_version TYPE: the TPU VM software image for a generation.
default_runtime_version() {
  case "${1%-*}" in
    v5litepod) echo v2-alpha-tpuv5-lite ;;
    v5p) echo v2-alpha-tpuv5 ;;
    v6e) echo v2-alpha-tpuv6e ;;
    *) echo tpu-ubuntu2204-base ;;
  esac
}

# ---------------------------------------------------------------------------------------------
# Slices (multi-slice: several TPU slices joined over the data-centre network, DCN)
# ---------------------------------------------------------------------------------------------

# validate_slices: TPU_SLICES, when set, is a whole number >= 2; sets SLICES (1 without it).
validate_slices() {
  SLICES=1
  [[ -n "${TPU_SLICES:-}" ]] || return 0
  [[ "$TPU_SLICES" =~ ^[0-9]+$ ]] ||
    die "--slices must be a number of slices (2 or more), got '$TPU_SLICES'"
  ((10#$TPU_SLICES >= 2)) ||
    die "--slices $TPU_SLICES: a multi-slice run has 2 or more slices; for one slice leave --slices (TPU_SLICES) out"
  SLICES=$((10#$TPU_SLICES))
}

multi_slice() { ((${SLICES:-1} > 1)); }

# require_multislice_type TYPE: Multislice exists for TPU v4 and later (Cloud TPU Multislice
# overview, https://cloud.google.com/tpu/docs/multislice-introduction).
require_multislice_type() {
  case "${1%-*}" in
    v4 | v5p | v5litepod | v6e) ;;
    *) die "--slices $SLICES: multi-slice needs TPU v4 or newer (v4, v5p, v5litepod, v6e), not a $1: pick such a --type, or one larger slice without --slices" ;;
  esac
}

# node_name K: the TPU of slice K. A multi-slice queued resource names its TPUs PREFIX-0,
# PREFIX-1, ... (the TPU API's MultisliceParams.nodeIdPrefix; `create` gives --node-prefix=NAME).
node_name() { printf '%s-%s\n' "$TPU_NAME" "$1"; }

# ---------------------------------------------------------------------------------------------
# Quoting and running commands
# ---------------------------------------------------------------------------------------------

# quote_args ARG...: one line that a POSIX shell reads back as exactly these arguments. Plain words
# stay bare; anything else is single-quoted (newlines kept, so remote scripts stay readable).
quote_args() {
  local arg out=()
  for arg in "$@"; do
    if [[ "$arg" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
      out+=("$arg")
    else
      out+=("'${arg//\'/\'\\\'\'}'")
    fi
  done
  printf '%s\n' "${out[*]}"
}

# A dry run prints the commands instead of running them. Files that the real run writes into a
# fresh temporary directory are named "$DRY_TMP/FILE" there: the printed command reads
# "$tmp"/FILE, after a line tmp="$(mktemp -d)" that the caller prints first.
DRY_TMP='@DRY_TMP@'

# print_command ARG...: the command as quote_args prints it, with $DRY_TMP as "$tmp".
print_command() {
  # shellcheck disable=SC2016  # the literal text "$tmp", for the shell that runs the output
  local line tmp_ref='"$tmp"'
  line="$(quote_args "$@")"
  printf '%s\n' "${line//"$DRY_TMP"/$tmp_ref}"
}

# run_gcloud ARG...: run `gcloud ARG...`, echoing it to stderr first; with --dry-run print it to
# stdout instead and run nothing.
run_gcloud() {
  if dry_run; then
    print_command gcloud "$@"
    return 0
  fi
  info "+ $(quote_args gcloud "$@")"
  gcloud "$@"
}

# ssh_worker WORKER SCRIPT: run a shell script on one worker (a number) or on every worker (all).
ssh_worker() {
  run_gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${LOCATION[@]}" "--worker=$1" "--command=$2"
}

# With several slices every command goes through the queued resource, whose ssh and scp reach
# the workers of all its TPUs at once (--node=all --worker=all; gcloud compute tpus
# queued-resources ssh/scp). --batch-size (default 64) is raised to every worker: a run's
# processes must all start within vit_jax.main's --distributed_timeout.
# ssh_slices SLICE WORKER SCRIPT: SLICE and WORKER are numbers or all.
ssh_slices() {
  local batch=()
  [[ "$1" != all ]] || batch=("--batch-size=$((SLICES * $(num_hosts "$TPU_TYPE")))")
  run_gcloud compute tpus queued-resources ssh "$TPU_QR_NAME" "${LOCATION[@]}" "--node=$1" \
    "--worker=$2" "${batch[@]}" "--command=$3"
}

# ssh_all SCRIPT: run a shell script on every worker of the TPU, or of every slice.
ssh_all() {
  if multi_slice; then
    ssh_slices all all "$1"
  else
    ssh_worker all "$1"
  fi
}

# scp_all FILE DEST: copy a local file to DEST (relative to the home directory) on every worker.
scp_all() {
  if multi_slice; then
    run_gcloud compute tpus queued-resources scp "$1" "$TPU_QR_NAME:$2" "${LOCATION[@]}" \
      --node=all --worker=all "--batch-size=$((SLICES * $(num_hosts "$TPU_TYPE")))"
  else
    run_gcloud compute tpus tpu-vm scp "$1" "$TPU_NAME:$2" "${LOCATION[@]}" --worker=all
  fi
}

# ---------------------------------------------------------------------------------------------
# Read-only queries (never run under --dry-run: the callers skip them)
# ---------------------------------------------------------------------------------------------

need_gcloud() {
  command -v gcloud >/dev/null 2>&1 ||
    die "gcloud not found on PATH: install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install) and run 'gcloud auth login'"
}

# query OUTVAR ARG...: run the read-only `gcloud ARG...` and store what it prints in OUTVAR.
# Returns 1 when the resource does not exist; stops on any other failure (not logged in, API not
# enabled, no permission, wrong project), so that is never mistaken for "does not exist", and
# shows gcloud's whole message: its advice ("Please run: $ gcloud auth login") is in the middle.
query() {
  local -n query_out="$1"
  shift
  local errors
  errors="$(mktemp)"
  if query_out="$(gcloud "$@" 2>"$errors")"; then
    rm -f "$errors"
    return 0
  fi
  if grep -qiE 'not[ _]?found' "$errors"; then
    rm -f "$errors"
    return 1
  fi
  # Leading blank lines dropped (trailing ones go with the command substitution).
  query_out="$(sed -e '/[^[:space:]]/,$!d' "$errors")"
  rm -f "$errors"
  die "$(quote_args gcloud "$@") failed:"$'\n'"${query_out:-(gcloud printed no error message)}"
}

# describe_tpu [NAME]: sets TPU_STATE and TPU_ACTUAL_TYPE of NAME (default TPU_NAME); returns 1
# when the TPU does not exist.
describe_tpu() {
  local out
  TPU_STATE=''
  TPU_ACTUAL_TYPE=''
  query out compute tpus tpu-vm describe "${1:-$TPU_NAME}" "${LOCATION[@]}" \
    '--format=value(state,acceleratorType)' || return 1
  read -r TPU_STATE TPU_ACTUAL_TYPE <<<"$out" || true
  TPU_ACTUAL_TYPE="${TPU_ACTUAL_TYPE##*/}"  # in case the API answers with a resource path
}

# describe_queued_resource: sets QR_STATE; returns 1 when the queued resource does not exist.
describe_queued_resource() {
  QR_STATE=''
  query QR_STATE compute tpus queued-resources describe "$TPU_QR_NAME" "${LOCATION[@]}" \
    '--format=value(state.state)'
}

# require_ready_tpu: stop unless the TPU exists and is READY; fills in TPU_TYPE from the TPU when
# unset and refuses a TPU_TYPE that does not match the real one.
require_ready_tpu() {
  if ! describe_tpu; then
    if describe_queued_resource; then
      if [[ "$QR_STATE" == ACTIVE ]]; then
        die "queued resource $TPU_QR_NAME is ACTIVE but has no TPU named $TPU_NAME: a multi-slice one (create --slices N) names its TPUs $TPU_NAME-0, $TPU_NAME-1, ...: pass --slices N (or export TPU_SLICES=N); if its TPU was deleted, '$PROG delete' and 'create' again"
      fi
      die "TPU $TPU_NAME does not exist yet: its queued resource $TPU_QR_NAME is $QR_STATE (wait for ACTIVE; '$PROG status' shows it)"
    fi
    die "TPU $TPU_NAME not found in zone $TPU_ZONE of project $TPU_PROJECT: create it first ('$PROG create ...'), or check --name/--zone/--project"
  fi
  if [[ "$TPU_STATE" != READY ]]; then
    case "$TPU_STATE" in
      PREEMPTED | TERMINATED)
        die "TPU $TPU_NAME is $TPU_STATE: its workers are gone. Recreate it ('$PROG delete', 'create', 'setup'), then 'run' with the same --workdir resumes from the last checkpoint" ;;
      *) die "TPU $TPU_NAME is ${TPU_STATE:-in an unknown state}, not READY: wait for it ('$PROG status')" ;;
    esac
  fi
  if [[ -n "$TPU_ACTUAL_TYPE" ]]; then
    if [[ -n "${TPU_TYPE:-}" && "$TPU_TYPE" != "$TPU_ACTUAL_TYPE" ]]; then
      die "TPU_TYPE is $TPU_TYPE but TPU $TPU_NAME is a $TPU_ACTUAL_TYPE: fix --type/TPU_TYPE or --name"
    fi
    TPU_TYPE="$TPU_ACTUAL_TYPE"
  fi
}

# require_ready_slices: stop unless the queued resource is ACTIVE and each of its SLICES TPUs
# exists, is READY and of one type (TPU_TYPE when set); fills in TPU_TYPE from slice 0.
require_ready_slices() {
  local k name
  if ! describe_queued_resource; then
    die "queued resource $TPU_QR_NAME not found in zone $TPU_ZONE of project $TPU_PROJECT: create the slices first ('$PROG create --slices $SLICES ...'), or check --name/--qr-name/--zone/--project"
  fi
  case "$QR_STATE" in
    ACTIVE) ;;
    FAILED | SUSPENDING | SUSPENDED)
      die "queued resource $TPU_QR_NAME is $QR_STATE: its slices are gone. Recreate them ('$PROG delete', 'create --slices $SLICES', 'setup'), then 'run' with the same --workdir resumes from the last checkpoint" ;;
    *) die "queued resource $TPU_QR_NAME is ${QR_STATE:-in an unknown state}, not ACTIVE: wait for it ('$PROG status --slices $SLICES')" ;;
  esac
  for ((k = 0; k < SLICES; k++)); do
    name="$(node_name "$k")"
    describe_tpu "$name" ||
      die "slice $k (TPU $name) of queued resource $TPU_QR_NAME not found: does it have $SLICES slices? ('gcloud compute tpus queued-resources describe $TPU_QR_NAME ${LOCATION[*]}'; --slices must be its node count)"
    [[ "$TPU_STATE" == READY ]] ||
      die "slice $k (TPU $name) is ${TPU_STATE:-in an unknown state}, not READY: wait for it ('$PROG status --slices $SLICES')"
    if [[ -n "$TPU_ACTUAL_TYPE" ]]; then
      if [[ -n "${TPU_TYPE:-}" && "$TPU_TYPE" != "$TPU_ACTUAL_TYPE" ]]; then
        die "TPU_TYPE is $TPU_TYPE but slice $k (TPU $name) is a $TPU_ACTUAL_TYPE: fix --type/TPU_TYPE"
      fi
      TPU_TYPE="$TPU_ACTUAL_TYPE"
    fi
  done
}
