#!/usr/bin/env bash
# Batch-1 decode of tinyinfer (through Engine.step(), `tinyinfer bench latency`) and of gpt-fast
# (scripts/peer_gpt_fast.py) on one GPU, in one call, same card: each run a separate process
# under its own time limit, most important first, until the budget is spent.
#   bash scripts/gpu_vs_gpt_fast.sh GPT_FAST_CHECKOUT OUT_DIR [SECONDS_BUDGET]
# RUNS="name:limit ..." picks runs; a name is tinyinfer_PRESET_WEIGHTS or gptfast_PRESET_WEIGHTS,
# WEIGHTS one of bf16, int8, int4, int8head, int4head (the LM head quantized too).
# TINYINFER_FLAGS adds options to every tinyinfer run (e.g. --async-scheduling).
# Every result lands in OUT_DIR/NAME.json; OUT_DIR/summary.json gathers them. gpt-fast's rate is
# its own: new tokens over the wall time of whole generate calls (prefill included), so it sits
# beside tinyinfer's "request tok/s"; tinyinfer's "decode tok/s" is one over its median TPOT.
peer=${1:?usage: gpu_vs_gpt_fast.sh GPT_FAST_CHECKOUT OUT_DIR [SECONDS_BUDGET]}
out=${2:?usage: gpu_vs_gpt_fast.sh GPT_FAST_CHECKOUT OUT_DIR [SECONDS_BUDGET]}
budget=${3:-560}
start=$SECONDS
export PYTHONUNBUFFERED=1
common="--prompt-tokens 128 --max-tokens 128"
for entry in ${RUNS:-tinyinfer_llama-3-8b_bf16:100 gptfast_llama-3-8b_bf16:120 \
             tinyinfer_llama-3-8b_int4head:100 gptfast_llama-3-8b_int4:120 \
             tinyinfer_llama-3-8b_int8head:100 gptfast_llama-3-8b_int8:120 \
             tinyinfer_llama-3.2-1b_bf16:80 gptfast_llama-3.2-1b_bf16:110 tinyinfer_llama-3.2-1b_int4head:80}; do
  name=${entry%%:*}
  IFS=_ read -r engine preset weights <<< "$name"
  left=$((budget - (SECONDS - start)))
  limit=$(( ${entry##*:} < left ? ${entry##*:} : left ))
  if [ "$limit" -lt 30 ]; then echo "=== $name skipped: budget spent"; continue; fi
  echo "=== $name (limit ${limit} s)"
  case $weights in
    bf16) quant=none; flags="" ;;
    int8*) quant=int8; flags="--quantize int8" ;;
    int4*) quant=int4; flags="--quantize int4-g128" ;;
  esac
  [ "${weights%head}" != "$weights" ] && flags="$flags --quantize-head"
  if [ "$engine" = tinyinfer ]; then
    timeout "$limit" python3 -m tinyinfer bench latency --preset "$preset" --runner torch $common \
      $flags ${TINYINFER_FLAGS:-} --json "$out/$name.json" 2>&1 | grep -v "UserWarning\|warnings.warn\|^tinyinfer: "
  else
    timeout "$limit" python3 scripts/peer_gpt_fast.py --gpt-fast "$peer" --preset "$preset" \
      --quantize "$quant" $common --json "$out/$name.json" 2>&1 | grep "^gpt-fast\|Error"
  fi
done
python3 - "$out" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*_*.json"))}
(out / "summary.json").write_text(json.dumps(runs, indent=2))
print("run                                   decode tok/s  request tok/s  roofline %")
for name, result in runs.items():
    row = result[0] if isinstance(result, list) else result
    decode = row.get("decode_tokens_per_s")  # gpt-fast times whole generate calls only
    request = row.get("request_tokens_per_s", row.get("tok_s"))
    print(f"{name:36s} {decode or float('nan'):13.1f} {request:14.1f} {row.get('roofline_pct') or float('nan'):11.1f}")
EOF
echo "=== done in $((SECONDS - start)) s"
