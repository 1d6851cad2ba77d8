#!/usr/bin/env bash
# Run the tests that assert learned behaviour (`pytest -m learning`) under each float-kernel choice torch can
# make on this CPU and at 1 and 2 threads, and print which setting passed. Usage:
#   scripts/test_portable.sh [PYTEST_ARGS...]      (PY=python to use, default .venv/bin/python)
# Why: such a test passes or fails on what a few training steps taught, and the float kernels (the CPU's own,
# forced to AVX2 or to the plain `default` ones with ATEN_CPU_CAPABILITY) and the thread count (reduction
# orders) change every rounding. A test taught for a fixed step count once passed on an AVX-512 machine and
# failed on every AVX2 one; each learning test must hold with margin under all of these settings.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
# `with_kernels FORCED CMD...`: CMD with ATEN_CPU_CAPABILITY=FORCED, or unset when FORCED is empty (the CPU's own)
with_kernels() {
    if [ -n "$1" ]; then ATEN_CPU_CAPABILITY="$1" "${@:2}"; else env -u ATEN_CPU_CAPABILITY "${@:2}"; fi
}
capability() { with_kernels "$1" "$PY" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())'; }
own="$(capability '')"
logs="$(mktemp -d "${TMPDIR:-/tmp}/hybridflow-portable-XXXXXX")"
rows=()
failed=0
start_all=$SECONDS
# Passive OpenMP waiting: the same arithmetic, but a second thread that waits sleeps instead of spinning, which
# made the 2-thread runs many times slower whenever other processes kept the cores busy.
export OMP_WAIT_POLICY=PASSIVE
for threads in 1 2; do
    for forced in "" avx2 default; do
        kernels="$(capability "$forced")"
        if [ -n "$forced" ] && [ "$kernels" = "$own" ]; then
            [ "$threads" = 1 ] && rows+=("$(printf '%-9s %-8s %-7s %s' "$forced" "-" "skipped" "(this CPU's own)")")
            continue
        fi
        log="$logs/${kernels}-t${threads}.log"
        start=$SECONDS
        OMP_NUM_THREADS="$threads" with_kernels "$forced" "$PY" -m pytest -q -p no:cacheprovider -m learning "$@" \
            >"$log" 2>&1
        status=$?
        summary="$(grep -E '(passed|failed|error).* in [0-9.]+s' "$log" | tail -1 | tr -d '=' | xargs)"
        result=passed
        if [ "$status" -ne 0 ]; then
            result=FAILED
            failed=1
        fi
        rows+=("$(printf '%-9s %-8s %-7s %s' "$kernels" "$threads" "$result" "${summary:-no summary} ($((SECONDS - start)) s)")")
        echo "${rows[-1]}"  # progress, as each setting ends
    done
done
printf '\n%-9s %-8s %-7s %s\n' kernels threads result "pytest -m learning"
printf '%s\n' "${rows[@]}"
echo "total $((SECONDS - start_all)) s; logs in $logs"
exit $failed
