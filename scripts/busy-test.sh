#!/usr/bin/env bash
# The test suite on a busy machine: `make test` (PYTEST_ARGS passed through) while a CPU
# hog holds every core at normal priority, as another build or CI's shared cores do. A
# test whose verdict hangs on step timings fails here. Exits with the suite's status;
# the hog is stopped on any exit (and by a watchdog should this script be killed).
# BUSY_CPUS: hog workers (default: nproc); BUSY_HOG=loop: busy loops, not stress-ng.
set -uo pipefail
cd "$(dirname "$0")/.."
cpus=${BUSY_CPUS:-$(nproc)}
start=$(date +%s)

# stress-ng from Debian, installed here as root as .ci/run installs chromium; a busy loop
# per core where it cannot be had
hog_kind=${BUSY_HOG:-stress-ng}
if [[ $hog_kind == stress-ng ]] && ! command -v stress-ng >/dev/null && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    apt-get update -q && apt-get install -y -q stress-ng || echo "busy-test: no stress-ng" >&2
fi

# the hog runs in a process group of its own, so one signal stops every worker
hog= watchdog=
stop() {
    if [[ -n $hog ]]; then
        kill -TERM -- "-$hog" 2>/dev/null
        wait "$hog" 2>/dev/null
        hog=
    fi
    if [[ -n $watchdog ]]; then
        kill -TERM -- "-$watchdog" 2>/dev/null
        watchdog=
    fi
}
trap stop EXIT

if [[ $hog_kind == stress-ng ]] && command -v stress-ng >/dev/null; then
    how="stress-ng --cpu $cpus"
    setsid stress-ng --cpu "$cpus" --timeout 0 --quiet &
else
    how="$cpus busy loops"
    setsid bash -c 'for ((i = 0; i < $1; i++)); do (while :; do :; done) & done; wait' \
        busy "$cpus" &
fi
hog=$!
echo "busy-test: $how (process group $hog), then make test PYTEST_ARGS='${PYTEST_ARGS:-}'"

# in the background, so that a signal to this script is handled at once (bash runs a trap
# only once its foreground command is over): the suite gets TERM (a background command
# ignores INT), then the hog stops
make test PYTEST_ARGS="${PYTEST_ARGS:-}" &
suite=$!
# a SIGKILL skips the trap: this watchdog stops the suite and the hog once the script is gone
setsid bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 2; done
                kill -TERM "$3"; kill -TERM -- "-$2"' \
    watchdog "$$" "$hog" "$suite" >/dev/null 2>&1 &
watchdog=$!
interrupted() { kill -TERM "$suite" 2>/dev/null; wait "$suite"; exit "$1"; }
trap 'interrupted 130' INT
trap 'interrupted 143' TERM HUP
wait "$suite"
status=$?
stop
echo "busy-test: make test exited $status in $(( $(date +%s) - start )) s under $how"
exit "$status"
