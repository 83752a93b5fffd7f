# Shared by the GPU job scripts (sourced): a clock for their log lines and the checks they make first.
started=$(date +%s)

# Print a log line stamped with the time of day and the seconds since the job started.
stamp() { echo "[$(date +%H:%M:%S), $(( $(date +%s) - started )) s] $*"; }

# Exit 2 unless torch sees a CUDA device; $1 says what the script does on it.
require_cuda() {
  if ! python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    echo "no CUDA device: this script $1 on a GPU" >&2
    exit 2
  fi
}

# Exit 2 unless $1 is a number of training minutes in (0, 8].
check_train_minutes() {
  if ! awk -v m="$1" 'BEGIN { exit !(m + 0 == m && m > 0 && m <= 8) }'; then
    echo "TRAIN_MINUTES must be a number in (0, 8], got '$1'" >&2
    exit 2
  fi
}
