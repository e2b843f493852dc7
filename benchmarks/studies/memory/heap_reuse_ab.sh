#!/bin/bash
# A/B of memory.heap_reuse() around eval's quality pass, distill's plan (walk, repair) and its training loop, in
# the CLI (which fixes glibc's mmap threshold at 1 MB). Run at 2507562 with a temporary switch: GC_HEAP=1 wrapped
# eval/quality/scoring.py's score_windows loop, distill/stage.py's planned_student call and distill/train.py's
# _steps loop in heap_reuse(); GC_HEAP unset left them as they were. The distill parts landed (heap_reuse always);
# the eval part did not (it raised eval's reported peak memory). Results: benchmarks/results/heap_reuse_ab.json.
# Needs /work/runs/greedy_synth96 (the student of benchmarks/results/student24_greedy_synth96_recipe.yaml).
. /work/venv/bin/activate; cd /work/main
R=/work/runs/ab; mkdir -p $R
for round in 1 2; do for heap in "" 1; do
  tag=r${round}_h${heap:-0}
  /usr/bin/time -f "$tag eval %e s wall %U user %S sys %M KB" env GC_HEAP=$heap geminicompress eval smollm2-demo /work/runs/greedy_synth96 --data ../shared/data/wikitext2-test.txt --max-tokens 16384 --seq-len 512 --no-latency -o $R/eval_$tag --quiet 2>> $R/times.txt
  grep "greedy_synth96" $R/eval_$tag/report.md | head -1 >> $R/times.txt
  rm -rf $R/plan_$tag
  /usr/bin/time -f "$tag plan %e s wall %U user %S sys %M KB" env GC_HEAP=$heap geminicompress distill --teacher smollm2-demo --student-layers 24 --train-tokens 8192 --data ../shared/data/enwiki-sample.txt -o $R/plan_$tag --quiet 2>> $R/times.txt
  python -c "import json;r=json.load(open('$R/plan_$tag/report.json'))['stages'][0]['result'];print('$tag', {k:r.get(k) for k in ('tokens','seconds','tokens_per_second','final_ppl')}, json.load(open('$R/plan_$tag/plan.json'))['student_ppl'])" >> $R/times.txt
done; done
