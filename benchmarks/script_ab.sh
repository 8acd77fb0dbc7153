#!/usr/bin/env bash
# A benchmark script at an earlier commit and at this checkout, alternating: ROUNDS rounds, each
# running benchmarks/SCRIPT on both sides at 1 and then 2 threads (THREADS="1" for one) with the given flags. The
# earlier side runs from a worktree of BEFORE on PYTHONPATH (a script's own directory and
# PYTHONPATH come before the editable install) with its own kernel builds. Writes
# OUT/<script>_{BEFORE,AFTER}_{1,2}thread_round{N}.json and prints each run's log lines that
# match PATTERN (an extended regular expression). Run it with nothing else running.
#
#     benchmarks/script_ab.sh SCRIPT PATTERN BEFORE AFTER OUT ROUNDS [SCRIPT flags...]
set -euo pipefail
script=$1 pattern=$2 before_commit=$3 after=$4 out=$5 rounds=$6
shift 6
name=${script%.py}
cd "$(git rev-parse --show-toplevel)"
before=$(mktemp -d)/$before_commit
git worktree add --detach "$before" "$before_commit" > /dev/null
PYTHONPATH=$before .venv/bin/python -m workers.kernels > /dev/null
for round in $(seq "$rounds"); do
 for side in "$before_commit" "$after"; do
  if [ "$side" = "$before_commit" ]; then root=$before; else root=$PWD; fi
  for threads in ${THREADS:-1 2}; do
   PYTHONPATH=$root .venv/bin/python "$root/benchmarks/$script" --threads "$threads" "$@" \
       --out "$out/${name}_${side}_${threads}thread_round$round.json" > "$out/log.txt" 2>&1
   echo "$round $side $threads: $(grep -E "$pattern" "$out/log.txt" | tr '\n' ' ')"
  done
 done
done
rm "$out/log.txt"
git worktree remove --force "$before"
