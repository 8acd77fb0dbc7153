# What made this folder's files, in this order, with nothing else running: a decode step on
# the Q4_1 weights (as stored; bf16 activations) at d34a96c (before) and 1686283 (the int8 weight
# kernel prefetching 4 KiB ahead), alternating, three rounds, one and two threads. The before
# side runs from a worktree of d34a96c on PYTHONPATH.
set -e
cd "$(git rev-parse --show-toplevel)"
out=benchmarks/results/xeon-amx/int8-prefetch-1686283
before=$(mktemp -d)/d34a96c
git worktree add --detach $before d34a96c > /dev/null
PYTHONPATH=$before .venv/bin/python -m workers.kernels > /dev/null  # its own kernel builds
for round in 1 2 3; do
 for side in d34a96c 1686283; do
  if [ $side = d34a96c ]; then root=$before; else root=$PWD; fi
  for threads in 1 2; do
   PYTHONPATH=$root .venv/bin/python $root/benchmarks/step_profile.py --quantization gguf --threads $threads \
       --batches 1,16 --out $out/step_profile_${side}_${threads}thread_round$round.json > $out/log.txt 2>&1
   echo "$round $side $threads: $(grep -E 'step |read in' $out/log.txt | tr '\n' ' ')"
  done
 done
done
rm $out/log.txt
git worktree remove --force $before
