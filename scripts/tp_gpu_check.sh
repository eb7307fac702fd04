#!/usr/bin/env bash
# Every stage of tp_gpu_check.py, each in its own process group under a time limit, most
# important first; a stage that hangs is aborted (Python dumps its stacks) with its workers.
#   [STAGES="profile_8b_tp1:120 profile_8b_tp2:120 ..."] bash scripts/tp_gpu_check.sh OUT_DIR [SECONDS_BUDGET]
out=${1:?usage: tp_gpu_check.sh OUT_DIR [SECONDS_BUDGET]}
budget=${2:-540}
start=$SECONDS
export PYTHONPATH=. PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
for entry in ${STAGES:-bundled_tp2:120 gqa_tp4_float32:150 llama3_8b_tp1:150 llama3_8b_tp4:150 \
             llama2_70b_tp4:200 llama3_8b_tp2:150 all_reduce_tp4:60 all_reduce_tp2:60 \
             gqa_tp4_bfloat16:100 llama3_8b_tp4_no_graphs:120 gqa_tp2_float32:100}; do
  stage=${entry%%:*}
  left=$((budget - (SECONDS - start)))
  limit=$(( ${entry##*:} < left ? ${entry##*:} : left ))
  if [ "$limit" -lt 30 ]; then echo "=== $stage skipped: budget spent"; continue; fi
  echo "=== $stage (limit ${limit} s)"
  # timeout leads a new process group (the stage and its rank workers); at the limit it sends
  # SIGABRT to the whole group, and Python dumps each process's stacks
  timeout -s ABRT "$limit" python3 scripts/tp_gpu_check.py --out "$out" "$stage" > "$out/.stage.log" 2>&1 &
  group=$!
  wait "$group"
  kill -KILL -- "-$group" 2>/dev/null  # anything of this stage still left, and nothing else
  grep -v "UserWarning\|warnings.warn\|resource_tracker\|^tinyinfer: \(capturing\|torch.compile\)" "$out/.stage.log"
  rm -f "$out/.stage.log"
done
echo "=== done in $((SECONDS - start)) s"
