#!/usr/bin/env bash
# A decode step at an earlier commit and at this checkout, alternating: ROUNDS rounds, each
# running benchmarks/step_profile.py on both sides at 1 and then 2 threads with the given
# flags. The earlier side runs from a worktree of BEFORE on PYTHONPATH (a script's own
# directory and PYTHONPATH come before the editable install) with its own kernel builds.
# Writes OUT/step_profile_{BEFORE,AFTER}_{1,2}thread_round{N}.json and prints each run's step
# lines. Run it with nothing else running.
#
#     benchmarks/step_profile_ab.sh BEFORE AFTER OUT ROUNDS [step_profile.py flags...]
set -euo pipefail
before_commit=$1 after=$2 out=$3 rounds=$4
shift 4
cd "$(git rev-parse --show-toplevel)"
before=$(mktemp -d)/$before_commit
git worktree add --detach "$before" "$before_commit" > /dev/null
PYTHONPATH=$before .venv/bin/python -m workers.kernels > /dev/null
for round in $(seq "$rounds"); do
 for side in "$before_commit" "$after"; do
  if [ "$side" = "$before_commit" ]; then root=$before; else root=$PWD; fi
  for threads in 1 2; do
   PYTHONPATH=$root .venv/bin/python "$root/benchmarks/step_profile.py" --threads "$threads" "$@" \
       --out "$out/step_profile_${side}_${threads}thread_round$round.json" > "$out/log.txt" 2>&1
   echo "$round $side $threads: $(grep -E 'step |read in' "$out/log.txt" | tr '\n' ' ')"
  done
 done
done
rm "$out/log.txt"
git worktree remove --force "$before"
