cd "$(dirname "$0")/../../.."
PYTHONPATH=. python -u -m geminicompress tune smollm2-demo -o /tmp/tuned --force --max-drift 5% \
  --options gptq:b8g64,gptq:b4g64,gptq:b3g64 --data ../shared/data/enwiki-sample.txt --samples 32 --calib-seq-len 512 \
  --eval-data ../shared/data/wikitext2-test.txt --eval-tokens 16384 --eval-seq-len 512 2>&1 | \
  python -u -c "
import sys,time
t0=time.time()
for line in sys.stdin:
    for part in line.replace('\r','\n').split('\n'):
        if part.strip(): print(f'{time.time()-t0:8.1f} {part}', flush=True)
"
echo done
