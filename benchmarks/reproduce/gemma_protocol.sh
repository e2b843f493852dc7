#!/usr/bin/env bash
# Gemma 3 270M at the protocol, BOS-led (data/windows.py): every method's output, then one eval of all of them.
#
#   bash benchmarks/reproduce/gemma_protocol.sh MODEL WORK [ROWS]
# MODEL: the float directory built from the pip GGUF (docs/install.md); WORK: where the outputs go;
# ROWS: which outputs to make (default: all), e.g. "rtn gptq gptq-text awq". Each row that exists is kept.
# Calibration: 32 x 512 windows of enwiki-sample.txt, seed 0; eval: the first 16,384 WikiText-2 test tokens in
# 512-token windows (BOS + 511 text tokens each), KL to the float model, no latency (quality only).
# Writes WORK/eval/report.json and WORK/eval/report.md (the table of every row).
set -euo pipefail
MODEL=${1:?MODEL}; WORK=${2:?WORK}; ROWS=${3:-"rtn gptq gptq-text awq int8 w8a8 gptq-ftw1 magnitude wanda sparsegpt"}
DATA=$(cd "$(dirname "$0")/../../.." && pwd)/shared/data
CAL=(--data "$DATA/enwiki-sample.txt" --samples 32 --calib-seq-len 512 --seed 0 --threads 2 --quiet --no-verify)
mkdir -p "$WORK"
make_row() {
  local row=$1; shift
  [ -d "$WORK/$row" ] && return 0
  echo "== $row: $*" >&2
  /usr/bin/time -f "$row %e s %M KB" geminicompress "$@" -o "$WORK/$row" "${CAL[@]}"
}
for row in $ROWS; do
  case $row in
    rtn)       make_row rtn quantize "$MODEL" --method rtn --bits 4 --group-size 64 ;;
    gptq)      make_row gptq quantize "$MODEL" --method gptq --bits 4 --group-size 64 ;;
    gptq-text) make_row gptq-text quantize "$MODEL" --method gptq --bits 4 --group-size 64 --frame text ;;
    gptq-ftw1) make_row gptq-ftw1 quantize "$MODEL" --method gptq --bits 4 --group-size 64 --first-token-weight 1 ;;
    awq)       make_row awq quantize "$MODEL" --method awq --bits 4 --group-size 64 ;;
    int8)      make_row int8 quantize "$MODEL" --method int8 ;;
    w8a8)      make_row w8a8 quantize "$MODEL" --method w8a8 ;;
    magnitude) make_row magnitude prune "$MODEL" --sparsity 0.4 ;;
    wanda)     make_row wanda prune "$MODEL" --method wanda --sparsity 0.4 ;;
    sparsegpt) make_row sparsegpt prune "$MODEL" --method sparsegpt --sparsity 0.4 ;;
    *) echo "unknown row $row" >&2; exit 2 ;;
  esac
done
models=(); for row in $ROWS; do models+=("$WORK/$row"); done
geminicompress eval "$MODEL" "${models[@]}" -o "$WORK/eval" --force --data "$DATA/wikitext2-test.txt" \
  --max-tokens 16384 --seq-len 512 --no-latency --threads 2
