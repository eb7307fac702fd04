#!/usr/bin/env bash
# Tensor-parallel scaling on a 4-GPU host, in one call: stages of tp_gpu_check.py, two at a
# time where they use disjoint GPUs (CUDA_VISIBLE_DEVICES), each under a time limit.
#   bash scripts/tp_scaling.sh OUT_DIR explore   # variants, profiles, correctness, all-reduce sweeps
#   bash scripts/tp_scaling.sh OUT_DIR final     # TP=1/2/4 with profiles, gpt-fast at TP=2/4 beside them
#   bash scripts/tp_scaling.sh OUT_DIR extras    # TP=1 alone, batch 32 and the 70B at TP=4, symm_mem checks
#   bash scripts/tp_scaling.sh OUT_DIR pair      # a 2-GPU host: ours at TP=2 and TP=1, each also
#                                                # with asynchronous scheduling (about 100 s)
#   bash scripts/tp_scaling.sh OUT_DIR pair_peers  # a 2-GPU host: ours at TP=2 (sync and async) beside
#                                                # gpt-fast at TP=2 and TP=1 in the same call (about 590 s)
#   bash scripts/tp_scaling.sh OUT_DIR fused     # a 4-GPU host, the fused products in the shards: their
#                                                # logits against one GPU, ours at TP=1, 2 and 4 (each also
#                                                # asynchronous), batch 32 and the 70B at TP=4, gpt-fast at
#                                                # TP=1, 2 and 4 (about 560 s; BUDGET=540 skips what would not fit)
#   bash scripts/tp_scaling.sh OUT_DIR push      # a 4-GPU host: the push all-reduce checked, swept and timed
#                                                # against torch's one-shot kernel at TP=1, 2 and 4 (about 420 s)
#   bash scripts/tp_scaling.sh OUT_DIR push_peers  # a 4-GPU host: ours with the push all-reduce at TP=1, 2
#                                                # and 4 and gpt-fast at TP=2 and 4 in one call, and the
#                                                # push all-reduce's bf16 check at TP=2 and 4 (about 560 s)
#   bash scripts/tp_scaling.sh OUT_DIR fused_rest  # a 4-GPU host: what 'fused' could not fit, the 70B and
#                                                # gpt-fast at TP=4 and TP=2, with ours at TP=4 and TP=1 as
#                                                # the same-call reference (about 470 s)
#   bash scripts/tp_scaling.sh OUT_DIR same_call   # a 4-GPU host: ours at TP=1, 2 and 4 (asynchronous, TP=4
#                                                # profiled) and gpt-fast at TP=2 and 4 in one call, then the
#                                                # 70B at TP=4 and the fused shards' check (about 620 s;
#                                                # BUDGET=585 cuts the check short)
# (BUDGET=seconds: a group that would start with fewer than 30 s left is skipped, and the
# gpt-fast groups get what is left of it.)
# Needs tinyinfer's dependencies importable (and, for gpt-fast, GPT_FAST=a checkout; for the
# gqa stages, transformers with its own regex: don't shadow it with an older regex wheel).
# Results: OUT_DIR/summary.json (every group's tp_gpu_check.json, by group), OUT_DIR/logs.txt and
# the profiles' kernel tables (the device machine returns only a few files).
out=${1:?usage: tp_scaling.sh OUT_DIR explore|final|extras|pair|pair_peers|fused|fused_rest|same_call|push|push_peers}
mode=${2:?usage: tp_scaling.sh OUT_DIR explore|final|extras|pair|pair_peers|fused|fused_rest|same_call|push|push_peers}
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
start=$SECONDS
work=$(mktemp -d)

# group GPUS LIMIT STAGE...: the stages one after another on those GPUs, output in OUT/<first stage>
# (CPUS=list: on those CPU cores only, so that stages side by side do not share cores)
group() {
  local gpus=$1 limit=$2; shift 2
  if [ -n "$BUDGET" ]; then
    local left=$((BUDGET - (SECONDS - start)))
    if [ "$left" -lt 30 ]; then echo "=== $* skipped: ${left} s left"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
  fi
  local dir="$work/$1"
  mkdir -p "$dir"
  # STAGE_LIMIT: a stage that starts a command of its own (gpt-fast under torchrun) kills it
  # before this limit ends the stage, so that it cannot run on beside the next group
  STAGE_LIMIT=$limit CUDA_VISIBLE_DEVICES=$gpus timeout -s ABRT "$limit" ${CPUS:+taskset -c "$CPUS"} \
    python3 "$here/tp_gpu_check.py" --out "$dir" "$@" > "$dir/log.txt" 2>&1
  echo "=== $* on GPUs $gpus: exit $? at $((SECONDS - start)) s"
  collect
}

# Gather every group's results into OUT now (the call may end at its time limit at any point).
collect() {
python3 - "$work" "$out" > "$out/table.txt" <<'EOF'
import json, shutil, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
summary, logs = {}, []
for group in sorted(work.iterdir()):
    for f in sorted(group.iterdir()):
        if f.name == "tp_gpu_check.json":
            try:
                summary[group.name] = json.loads(f.read_text())
            except ValueError:  # being written by a stage that runs beside
                continue
        elif f.name.startswith("profile"):
            shutil.copy(f, out / f.name)
        elif f.suffix in (".txt", ".log"):
            logs.append(f"===== {group.name}/{f.name}\n{f.read_text()[-20000:]}")
(out / "summary.json").write_text(json.dumps(summary, indent=2))
(out / "logs.txt").write_text("\n".join(logs))
for group, data in summary.items():
    for name, value in data.items():
        if not isinstance(value, dict):
            continue
        if "error" in value:
            print(name, "ERROR", value["error"][-600:])
            continue
        lat = value.get("latency", value)
        peer = value.get("peer")
        if peer:
            print(name, f"{peer['tok_s']:.1f} tok/s (gpt-fast, prefill included) compile {peer['compile_s']:.0f} s")
        if "decode_tokens_per_s" in lat:
            print(name, f"{lat['decode_tokens_per_s']:.1f} tok/s TTFT {lat['ttft_ms']:.1f} ms",
                  {k: value[k] for k in ("exit_after_output_s", "returncode", "leaked_semaphores", "fatal", "traceback") if k in value})
        if "decode_tokens_per_s" in value.get("async", {}):
            a = value["async"]
            print(name, f"async: {a['decode_tokens_per_s']:.1f} tok/s TTFT {a['ttft_ms']:.1f} ms idle {a.get('device_idle_pct')}")
        for key in ("batch32", "profile"):
            if key in value:
                v = value[key]
                print(" ", key, {k: v[k] for k in v if not k.startswith("top")})
        if "sizes" in value:
            print(name, value["after_matmul_8kb"], [(r["bytes"], round(r["graph_us"], 1), round(r.get("one_shot_graph_us", 0), 1), round(r.get("two_shot_graph_us", 0), 1), r.get("one_shot_rel_err")) for r in value["sizes"]])
        if "greedy_tokens_identical" in value:
            print(name, {k: value[k] for k in ("prompt_logits_rel_err", "greedy_tokens_identical", "decode_logprob_max_abs_diff")})
EOF
[ $? = 0 ] || echo "collect failed" >&2
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -6
if [ "$mode" = explore ]; then
  group 0 100 8b_tp1_nccl_profile & group 2,3 100 8b_tp2_symm_mem_profile & wait
  group 0,1 90 8b_tp2_nccl & group 2,3 90 cli_tp2_symm_mem & wait
  group 0,1,2,3 90 8b_tp4_symm_mem_batch32
  group 0,1,2,3 60 gqa_tp4_symm_mem_float32 all_reduce_tp4_small all_reduce_tp2_small all_reduce_tp4_LL
  group 0,1,2,3 60 8b_tp4_nccl
elif [ "$mode" = final ]; then
  # gpt-fast at TP=2 (GPUs 0,1; its compile on cores of its own) beside ours at TP=2 and TP=1
  # (GPUs 2,3), then gpt-fast at TP=4, then ours at TP=4; gpt-fast compiles for more than 145 s
  # a size, so this takes a call of its own: about 590 s
  cores=$(nproc)
  CPUS=0-$((cores * 5 / 8 - 1)) group 0,1 240 gpt_fast_tp2 &
  (export CPUS=$((cores * 5 / 8))-$((cores - 1))
   group 2,3 90 8b_tp2_symm_mem_profile; group 2 60 8b_tp1_symm_mem_profile) &
  wait
  group 0,1,2,3 240 gpt_fast_tp4
  group 0,1,2,3 100 8b_tp4_symm_mem_profile
elif [ "$mode" = pair ]; then
  # a 2-GPU host, one stage at a time: ours at TP=2 (sync, async, the async steps profiled) and
  # TP=1 (sync, async)
  group 0,1 100 8b_tp2_symm_mem_async_profile
  group 0 70 8b_tp1_symm_mem_async
elif [ "$mode" = pair_peers ]; then
  # gpt-fast compiled for more than 220 s at TP=2 on a 2 x H100 host without finishing: a call of
  # its own, with ours at TP=2 first as the same-call reference
  group 0,1 60 8b_tp2_symm_mem_async
  group 0,1 300 gpt_fast_tp2
  group 0 230 gpt_fast_tp1
elif [ "$mode" = fused ]; then
  # gpt-fast compiles for about two minutes at every size (115-123 s at TP=1, 2 and 4 on 4 x H100:
  # ~70 s of Dynamo and Inductor over its whole decode step, ~45-50 s of the coordinate-descent
  # tuning its generate.py turns on, on a cold cache on every fresh machine): gpt-fast at TP=2 on
  # GPUs 2,3 and half the cores, beside the fused check at TP=2, ours at TP=2 and then ours at
  # TP=1 (GPU 0) beside gpt-fast at TP=1 (GPU 1) on the other half; then alone: the check at
  # TP=4, ours at TP=4 (profile, batch 32), the 70B shape, and gpt-fast at TP=4 with what is left
  cores=$(nproc)
  CPUS=$((cores / 2))-$((cores - 1)) group 2,3 250 gpt_fast_tp2 &
  (export CPUS=0-$((cores / 4 - 1))
   group 0,1 70 fused_check_tp2
   group 0,1 75 8b_tp2_symm_mem_async
   CPUS=$((cores / 4))-$((cores / 2 - 1)) group 1 160 gpt_fast_tp1 &
   group 0 60 8b_tp1_symm_mem_async
   wait) &
  wait
  group 0,1,2,3 45 fused_check_tp4
  group 0,1,2,3 130 8b_tp4_symm_mem_async_profile_batch32
  group 0,1,2,3 100 70b_tp4_symm_mem_async
  group 0,1,2,3 300 gpt_fast_tp4
elif [ "$mode" = same_call ]; then
  # gpt-fast at TP=2 (GPUs 0,1) beside ours at TP=2 then TP=1 (GPUs 2,3), on separate CPU halves;
  # then gpt-fast at TP=4 and ours at TP=4 each alone on the host, the 70B last
  cores=$(nproc)
  CPUS=0-$((cores / 2 - 1)) group 0,1 180 gpt_fast_tp2 &
  (CPUS=$((cores / 2))-$((cores - 1)) group 2,3 80 8b_tp2_symm_mem_async
   CPUS=$((cores / 2))-$((cores - 1)) group 2 70 8b_tp1_symm_mem_async) &
  wait
  group 0,1,2,3 180 gpt_fast_tp4
  group 0,1,2,3 100 8b_tp4_symm_mem_async_profile
  group 0,1,2,3 100 70b_tp4_symm_mem_async
  group 0,1,2,3 60 fused_check_tp4
elif [ "$mode" = push ]; then
  # the push all-reduce: checked against one GPU (float32 GQA and the fused bf16 shards at TP=4),
  # swept beside NCCL and torch's kernels at TP=2, then ours at TP=1, 2 and 4 (asynchronous) with
  # torch's one-shot kernel and with push, the TP=2 pairs side by side on separate CPU halves
  cores=$(nproc)
  group 0,1,2,3 90 gqa_tp4_push_float32 fused_check_tp4_push
  (CPUS=0-$((cores / 2 - 1)) group 0,1 80 8b_tp2_push_async
   CPUS=0-$((cores / 2 - 1)) group 0 70 8b_tp1_symm_mem_async) &
  (CPUS=$((cores / 2))-$((cores - 1)) group 2,3 50 all_reduce_tp2_small
   CPUS=$((cores / 2))-$((cores - 1)) group 2,3 80 8b_tp2_symm_mem_async) &
  wait
  group 0,1,2,3 100 8b_tp4_push_async_profile
  group 0,1,2,3 80 8b_tp4_symm_mem_async
elif [ "$mode" = push_peers ]; then
  # gpt-fast at TP=2 (GPUs 0,1) beside the push all-reduce's bf16 check at TP=2 and ours at TP=2
  # then TP=1 (GPUs 2,3), on separate CPU halves; then gpt-fast at TP=4 and ours at TP=4 each
  # alone on the host, and the check at TP=4 (a check loads a second model: a stage of its own)
  cores=$(nproc)
  CPUS=0-$((cores / 2 - 1)) group 0,1 195 gpt_fast_tp2 &
  (CPUS=$((cores / 2))-$((cores - 1)) group 2,3 50 fused_check_tp2_push
   CPUS=$((cores / 2))-$((cores - 1)) group 2,3 70 8b_tp2_push_async
   CPUS=$((cores / 2))-$((cores - 1)) group 2 60 8b_tp1_push_async) &
  wait
  group 0,1,2,3 215 gpt_fast_tp4
  group 0,1,2,3 75 8b_tp4_push_async
  group 0,1,2,3 45 fused_check_tp4_push
elif [ "$mode" = fused_rest ]; then
  # each alone on the host except gpt-fast at TP=2 (GPUs 0,1) beside ours at TP=1 (GPU 2)
  group 0,1,2,3 100 70b_tp4_symm_mem_async
  group 0,1,2,3 70 8b_tp4_symm_mem_async
  group 0,1,2,3 170 gpt_fast_tp4
  cores=$(nproc)
  CPUS=0-$((cores / 2 - 1)) group 0,1 170 gpt_fast_tp2 &
  CPUS=$((cores / 2))-$((cores - 1)) group 2 60 8b_tp1_symm_mem_async &
  wait
else
  # the rest of the table, each alone on the host: TP=1 (its TTFT with no neighbour), batch 32
  # at TP=4, the 70B shape at TP=4, the one-shot all-reduce against one GPU; about 420 s
  group 0 70 8b_tp1_symm_mem
  group 0,1,2,3 120 8b_tp4_symm_mem_batch32
  group 0,1,2,3 150 70b_tp4_symm_mem
  group 0,1,2,3 80 bundled_tp2_symm_mem gqa_tp4_symm_mem_float32
fi
echo "=== done in $((SECONDS - start)) s"
cat "$out/table.txt"
