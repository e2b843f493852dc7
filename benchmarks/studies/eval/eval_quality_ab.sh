#!/bin/bash
# A/B of eval's quality pass before and after it stopped faulting its buffers in afresh (the CLI fixes glibc's
# mmap threshold at 1 MB, memory.py): A = 95c1fbd, B = the working tree (KL in place, the baseline's cached chunk
# read into the same memory each time and written without a bytes copy, the decoder pass of each window inside
# heap_reuse). Alternating, one process at a time, from each tree's own package (python -m geminicompress).
# Usage: bash benchmarks/studies/eval/eval_quality_ab.sh STUDENT [ROUNDS] ; results appended to $R/times.txt, assembled
# into benchmarks/results/eval_quality_ab.json.
set -e
STUDENT=${1:?the second model to evaluate (a distilled student of smollm2-demo)}; ROUNDS=${2:-3}
HERE=$(cd "$(dirname "$0")/../../.." && pwd); DATA=$(cd "$HERE/../shared/data" && pwd)
R=${R:-/tmp/eval_quality_ab}; mkdir -p $R
[ -d $R/A ] || git -C "$HERE" worktree add -q $R/A 95c1fbd
for round in $(seq $ROUNDS); do for v in A B; do
  dir=$R/A; [ $v = B ] && dir=$HERE
  rm -rf $R/out_$v$round
  (cd $dir && /usr/bin/time -f "$v$round %e s wall %U user %S sys %M KB" python -m geminicompress eval smollm2-demo "$STUDENT" \
      --data $DATA/wikitext2-test.txt --max-tokens 16384 --seq-len 512 --no-latency -o $R/out_$v$round --quiet) 2>> $R/times.txt
  python -c "import json;r=json.load(open('$R/out_$v$round/report.json'));print('$v$round', [(m['peak_memory_mb'], m['quality']['perplexity'], m['quality']['kl_to_baseline'], m['quality']['top1_agreement']) for m in r['models']])" >> $R/times.txt
done; done
cat $R/times.txt
