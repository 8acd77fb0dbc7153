#!/usr/bin/env bash
# benchmarks/script_ab.sh over step_profile.py, printing each run's step and weight-read lines:
#
#     benchmarks/step_profile_ab.sh BEFORE AFTER OUT ROUNDS [step_profile.py flags...]
set -euo pipefail
exec "$(dirname "$0")/script_ab.sh" step_profile.py 'step |read in' "$@"
