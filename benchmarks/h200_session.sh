#!/usr/bin/env bash
# The H200 runs the open issues still need, one part per device call (each well under 10 minutes):
#   bash benchmarks/h200_session.sh tests      # every gpu-marked test (about 2 min; TEST_FILES narrows it)
#   bash benchmarks/h200_session.sh bounds     # ../shared/tools/bounds_probe.py (copy it to .probe/ and carry .probe): copy and read rates
#   bash benchmarks/h200_session.sh split      # one-layer split attention + prefill routing (issue 3)
#   bash benchmarks/h200_session.sh experts    # expert phase: grouped vs loop, fraction on GPU, streaming (issue 5)
#   bash benchmarks/h200_session.sh scheduler  # calibrate + writescope bench, Qwen3 shape, batch 16, 8K-32K (issue 4)
#   bash benchmarks/h200_session.sh profile    # where a decode step goes, Qwen3 shape, 4 layers, 16 x 32K
#   bash benchmarks/h200_session.sh prefill    # prefill routing vs one region, interleaved rounds (issue 3)
#   bash benchmarks/h200_session.sh prefill-order  # chunked prefill pass after pass vs layer by layer, gpu and writescope,
#     one process, DSV2 4 x 32K under 32 GiB (benchmarks/prefill_order.py; PO_MODEL, PO_BATCH, PO_CONTEXT, PO_POLICIES, PO_ROUNDS, PO_TAG)
#   bash benchmarks/h200_session.sh text MODEL # full-size MODEL, 32 GiB budget, 4 x 32K of machine text, 256 tokens (issue 6, run 1)
#   bash benchmarks/h200_session.sh breakdown MODEL  # where its decode step goes (issue 6)
#   bash benchmarks/h200_session.sh 1m         # DeepSeek-V2-Lite, 32 GiB, 32 x 32K machine text, 256 tokens (issue 6, run 4;
#     ONEM_POLICIES="writescope:256 gpu:64" runs each POLICY:NEW_TOKENS in its own process, one after another, after an
#     untimed 8K-token warm-up process that compiles the kernels (ONEM_WARM=0: none))
#   bash benchmarks/h200_session.sh 1m-decode  # the same batch's 256 decode steps with its KV filled at random (no prefill)
#   bash benchmarks/h200_session.sh mla        # DeepSeek-V2-Lite prefill, 2 x 32K, absorbed vs expanded MLA (pick the default)
#   bash benchmarks/h200_session.sh grid MODEL # full-size decode grid under 32 GiB, random KV fill (issue 6, run 2)
#   bash benchmarks/h200_session.sh prefill-e2e MODEL  # whole-model prefill of 2K prompts, batch 1-32, routing vs one region (run 3)
#   bash benchmarks/h200_session.sh consistency  # DSV2 without a budget, 4 x 8K machine text: every policy vs resident, logits (run 6)
#   bash benchmarks/h200_session.sh peer       # DSV2 checkpoint written from the GPU, transformers' offloaded cache vs writescope (run 5)
#   bash benchmarks/h200_session.sh amx        # the AMX-marked tests (the C++ kernels' AMX paths on the host's Xeon)
#   bash benchmarks/h200_session.sh cpu-attention  # CPU attention at full scale: the kernel's paths, the flash op, a plain read; under a H2D copy
#     (CPU_ATT_FLAGS: more benchmarks/cpu_attention.py flags, e.g. "--tunings 2,12 --copy-tunings 2,12 --no-flash")
#   bash benchmarks/h200_session.sh cpu-experts    # the host-expert kernel (CPU_EXP_FLAGS: more benchmarks/cpu_experts.py flags)
#   bash benchmarks/h200_session.sh link-read  # the fused kernels' in-place read of host experts, alone and beside the CPU's
#     expert kernel and KV copies (LINK_READ_FLAGS: more benchmarks/link_read.py flags; about a minute)
#   bash benchmarks/h200_session.sh calibrate MODEL  # writescope calibrate for MODEL's KV shape (A, B, C, r(L) at 2K-128K, batch 16)
#   bash benchmarks/h200_session.sh tpot MODEL # full-size MODEL under 32 GiB, machine text, TPOT of each policy one after another
#     (TPOT_BATCH 16, TPOT_CONTEXT 32k, TPOT_NEW 24 new tokens, TPOT_POLICIES gpu,writescope, TPOT_TAG a file-name suffix,
#      TPOT_FLAGS more generate flags)
#   bash benchmarks/h200_session.sh variants MODEL  # one process, random KV: VAR_POLICIES rows such as writescope@WRITESCOPE_MICRO_BATCHES=2
#     (VAR_BATCH 16, VAR_CONTEXT 32k, VAR_STEPS 12, VAR_REPEATS 2, VAR_BUDGET 32GiB, VAR_TAG a file-name suffix)
#   bash benchmarks/h200_session.sh multi-user:MODEL  # issue 18: two request streams against writescope serve (the GPU machine has
#     no FastAPI: run benchmarks/serve_wheels.sh here first and carry .whl; this part installs them into /tmp/site)
#   bash benchmarks/h200_session.sh timeline MODEL  # a decode step laid out in time: the CPU worker's jobs, the compute stream and
#     its waits for the CPU, the link (writescope profile --timeline; TL_POLICIES comma-separated, each with its own @switches,
#     TL_BATCH 16, TL_CONTEXT 32k, TL_STEPS 3, TL_TAG a file-name suffix, TL_FLAGS more profile flags such as --no-breakdown;
#     TL_HOST=1 also profiles the main thread's Python (--host-profile: where the thread that issues the step spends it); random KV fill)
#   bash benchmarks/h200_session.sh spy MODEL  # the thread that issues a decode step, sampled by py-spy --native (benchmarks/spy_summary.py;
#     carry .probe with .probe/py-spy from py-spy's wheel; SPY_POLICY, SPY_BATCH, SPY_CONTEXT, SPY_STEPS, SPY_TAG, SPY_RATE 50 Hz: 200 slowed the step 3x in run 55)
#   bash benchmarks/h200_session.sh joint MODEL  # issue 16: writescope's per-step expert split vs --expert-stream-share 1 and 0, and gpu
#     (TPOT_BATCH default 4 here, TPOT_CONTEXT, TPOT_NEW)
# A grid or calibration with torch's flash op instead of the C++ kernel: WRITESCOPE_CPU_ATTENTION=flash (the environment passes through).
# Several parts run in one call, one after another: `bash benchmarks/h200_session.sh tests grid:deepseek-v2-lite`.
# The whole call stops by DEADLINE seconds (default 570, under the device tool's 10 minutes): each part's
# timeout is cut to what is left, and a part with under 40 s left is skipped. The grid's shape can be narrowed
# with GRID_BATCH, GRID_CONTEXT, GRID_POLICIES, GRID_STEPS (defaults below); rows are saved as they finish, and
# GRID_RESUME=FILE continues a grid an earlier call left unfinished (bench --resume: complete cells are kept);
# GRID_FLAGS adds bench flags and GRID_TAG a suffix to its file names (e.g. GRID_FLAGS="--expert-stream-share 0" GRID_TAG=_cpu_experts).
# `breakdown` takes BREAKDOWN_BATCH, BREAKDOWN_CONTEXT (Mixtral's limit is 32,768 tokens: use 32000), BREAKDOWN_POLICY,
# BREAKDOWN_FLAGS (more profile flags) and BREAKDOWN_TAG (a file-name suffix).
# `text` takes TEXT_TOKENS (prompt tokens, default 32k) and TEXT_FLAGS (more generate flags), e.g. for Mixtral
# (a 32,768-token limit): TEXT_TOKENS=32512 bash benchmarks/h200_session.sh text:mixtral-8x7b; TEXT_FLAGS="--expert-stream-share 0"
# has the CPU compute the decode's host experts instead of streaming them (the default on CUDA)
# Results go to $OUT (the device tool's folder) or benchmarks/results/new; copy what you keep into
# benchmarks/results/ with the command line above.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
out=${OUT:-benchmarks/results/new}
mkdir -p "$out"
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/writescope-cache}  # not under $out: only results come back
git log --oneline -1 2>/dev/null || true
start=$(date +%s)
deadline=${DEADLINE:-570}
left() { echo $(( deadline - ($(date +%s) - start) )); }
tmo() { local l=$(( $(left) - 5 )); (( l >= 1 )) || l=1; if (( l < $1 )); then echo "$l"; else echo "$1"; fi; }  # min(default, time left), >= 1
part() {
  local p=$1 m=${2:-}
  case "$p" in
    tests)
      timeout "$(tmo 300)" python3 -m pytest -m "gpu or amx" -v -p no:cacheprovider ${TEST_FILES:-tests} 2>&1 | tee "$out/gpu_tests_h200.log" | tail -40 ;;
    bounds)  # the host-to-GPU copy and CPU read rates of this run (../shared/tools/bounds_probe.py copied to .probe/, carried)
      timeout "$(tmo 150)" python3 .probe/bounds_probe.py 2>&1 | tee "$out/bounds_h200.log" | tail -6 ;;
    amx)
      timeout "$(tmo 200)" python3 -m pytest -m amx -v -p no:cacheprovider tests 2>&1 | tee "$out/amx_tests_h200.log" | tail -30 ;;
    cpu-attention)
      timeout "$(tmo 300)" python3 benchmarks/cpu_attention.py --out "$out/cpu_attention_h200" ${CPU_ATT_FLAGS:-} 2>&1 | tee "$out/cpu_attention_h200.log" | tail -24 ;;
    link-read)  # the in-place read of host experts under a decode step's other loads (issue 16)
      timeout "$(tmo 240)" python3 benchmarks/link_read.py --out "$out/link_read_h200" ${LINK_READ_FLAGS:-} 2>&1 | tee "$out/link_read_h200.log" | tail -14 ;;
    cpu-experts)  # the host-expert kernel's paths against torch's GEMMs (CPU_EXP_FLAGS: more benchmarks/cpu_experts.py flags, e.g. "--busy 0,1,2")
      timeout "$(tmo 300)" python3 benchmarks/cpu_experts.py --out "$out/cpu_experts_h200" ${CPU_EXP_FLAGS:-} 2>&1 | tee "$out/cpu_experts_h200.log" | tail -24 ;;
    tpot)
      for pol in ${TPOT_POLICIES:-gpu writescope}; do
        local f="$out/tpot_${m}_${TPOT_BATCH:-16}x${TPOT_CONTEXT:-32k}_${pol/:/_}${TPOT_TAG:-}"
        timeout "$(tmo 420)" python3 -m writescope.cli.main generate --model "$m" --synthetic --device cuda --vram-budget 32GiB \
          --machine-text "${TPOT_CONTEXT:-32k}" --batch "${TPOT_BATCH:-16}" --max-new-tokens "${TPOT_NEW:-24}" --ignore-eos --policy "$pol" \
          --prefill-chunk-tokens 4096 --quiet ${TPOT_FLAGS:-} --output-json "$f.json" > "$f.log" 2>&1 || echo "$pol: exit $?"
        grep -E "TPOT|decode|r\(L\)|CPU attention|placement|VRAM" "$f.log" | sed "s/^/$pol: /" | head -8
      done ;;
    variants)  # one model load, one process: the decode step under switch variants, the policies taking turns (bench POLICY@NAME=VALUE rows)
      local f="$out/variants_${m}_${VAR_BATCH:-16}x${VAR_CONTEXT:-32k}${VAR_TAG:-}"
      timeout "$(tmo 570)" python3 -m writescope.cli.main bench --model "$m" --synthetic --device cuda --vram-budget "${VAR_BUDGET:-32GiB}" \
        --kv-fill random --batch "${VAR_BATCH:-16}" --context "${VAR_CONTEXT:-32k}" --steps "${VAR_STEPS:-12}" --repeats "${VAR_REPEATS:-2}" \
        --policies "${VAR_POLICIES:-gpu,writescope,writescope@WRITESCOPE_MICRO_BATCHES=2,writescope@WRITESCOPE_PINGPONG_BUFFERS=4}" --quiet \
        --output-json "$f.json" 2>&1 | tee "$f.log" | tail -24 ;;
    spy)  # the issuing thread sampled by py-spy (native frames too; no cost per call, unlike cProfile): one bench row
      # (copy the py-spy binary of its wheel to .probe/py-spy and carry .probe; SPY_POLICY, SPY_BATCH 4, SPY_CONTEXT 32k, SPY_STEPS 24, SPY_TAG)
      local f="$out/spy_${m}_${SPY_BATCH:-4}x${SPY_CONTEXT:-32k}${SPY_TAG:-}"
      [ -x .probe/py-spy ] || { echo "spy: no .probe/py-spy (carry .probe)" >&2; return 1; }
      timeout "$(tmo 420)" .probe/py-spy record --native --rate "${SPY_RATE:-50}" --format raw --output "$f.raw" -- \
        python3 -m writescope.cli.main bench --model "$m" --synthetic --device cuda --vram-budget 32GiB --kv-fill random \
        --batch "${SPY_BATCH:-4}" --context "${SPY_CONTEXT:-32k}" --steps "${SPY_STEPS:-24}" --repeats 1 --policies "${SPY_POLICY:-writescope}" \
        --quiet --output-json "$f.json" > "$f.log" 2>&1 || echo "spy: exit $?"
      tail -3 "$f.log"
      python3 benchmarks/spy_summary.py "$f.raw" --top 25 > "$f.txt" && head -90 "$f.txt" ;;
    multi-user)  # issue 18 item 5: two concurrent streams against the server, alone and together (MU_STREAMS, MU_POLICIES)
      if ! python3 -c "import fastapi, uvicorn" 2>/dev/null; then
        ls .whl/*.whl > /dev/null 2>&1 || { echo "multi-user: no fastapi here; run benchmarks/serve_wheels.sh and carry .whl" >&2; return 1; }
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
        export PYTHONPATH="/tmp/site:${PYTHONPATH:-.}"
      fi
      timeout "$(tmo 400)" python3 benchmarks/multi_user.py --model "${m:-qwen3-30b-a3b}" --synthetic --device cuda --vram-budget 32GiB \
        --streams "${MU_STREAMS:-8x8k,4x8k}" --new-tokens "${MU_NEW:-32}" --policies "${MU_POLICIES:-gpu,static:0.25,writescope}" \
        --out "$out/multi_user_h200" 2>&1 | tee "$out/multi_user_h200.log" | tail -12 ;;
    timeline)  # where a decode step waits: writescope profile --timeline, one model load, the policies one after another
      local f="$out/timeline_${m}_${TL_BATCH:-16}x${TL_CONTEXT:-32k}${TL_TAG:-}"
      timeout "$(tmo 400)" python3 -m writescope.cli.main profile --model "$m" --synthetic --device cuda --vram-budget 32GiB \
        --kv-fill random --batch "${TL_BATCH:-16}" --context "${TL_CONTEXT:-32k}" --policy "${TL_POLICIES:-static:0.5,static:0.5@WRITESCOPE_MICRO_BATCHES=2}" \
        --steps "${TL_STEPS:-3}" --skip 2 --quiet --timeline "$f.png" ${TL_HOST:+--host-profile "$f.txt"} --output-json "$f.json" ${TL_FLAGS:-} \
        2>&1 | grep -v USDT | tee "$f.log" | grep -E "^timeline|^  step|^  per CPU|policy|decode step|^main thread under" ;;
    joint)  # issue 16: the joint roofline's per-step expert split against fixed shares, same batch, one after another
      for run in "writescope:" "writescope:--expert-stream-share 1" "writescope:--expert-stream-share 0" "gpu:"; do
        local pol=${run%%:*} flags=${run#*:} tag=${run#*:}; tag=${tag//--expert-stream-share /_share}; tag=${tag// /}
        local f="$out/joint_${m}_${TPOT_BATCH:-4}x${TPOT_CONTEXT:-32k}_${pol}${tag}"
        timeout "$(tmo 420)" python3 -m writescope.cli.main generate --model "$m" --synthetic --device cuda --vram-budget 32GiB \
          --machine-text "${TPOT_CONTEXT:-32k}" --batch "${TPOT_BATCH:-4}" --max-new-tokens "${TPOT_NEW:-24}" --ignore-eos --policy "$pol" \
          --prefill-chunk-tokens 4096 --quiet $flags --output-json "$f.json" > "$f.log" 2>&1 || echo "$run: exit $?"
        grep -E "TPOT|host experts" "$f.log" | sed "s/^/$run: /" | head -4
      done ;;
    calibrate)
      timeout "$(tmo 300)" python3 -m writescope.cli.main calibrate --model "$m" --device cuda --quiet 2>&1 | tee "$out/calibrate_${m}_h200.log" ;;
    split)
      timeout "$(tmo 570)" python3 benchmarks/split_attention.py --shares-list 0,0.25,0.3125,0.375,0.5,1 --out "$out/split_attention_h200" \
        2>&1 | tee "$out/split_attention_h200.log" | tail -30 ;;
    experts)
      timeout "$(tmo 400)" python3 benchmarks/experts.py --models qwen3-30b-a3b,deepseek-v2-lite --fractions "${EXPERT_FRACTIONS:-1,0.5,0}" \
        --out "$out/experts_h200" \
        2>&1 | tee "$out/experts_h200.log" | tail -30 ;;
    scheduler)
      timeout "$(tmo 200)" python3 -m writescope.cli.main calibrate --model qwen3-30b-a3b --device cuda --quiet | tee "$out/calibrate_h200.log"
      timeout "$(tmo 570)" python3 -m writescope.cli.main bench --model qwen3-30b-a3b --num-layers 2 --batch 16 --context 32k,16k,8k \
        --policies gpu,cpu,monolithic,writescope --sweep-static 16 --steps 16 --quiet \
        --output-json "$out/bench_qwen3_h200.json" --plot "$out/bench_qwen3_h200.png" 2>&1 | tee "$out/bench_qwen3_h200.log" | tail -8 ;;
    profile)
      for p in writescope gpu; do
        timeout "$(tmo 280)" python3 -m writescope.cli.main profile --model qwen3-30b-a3b --num-layers 4 --batch 16 --context 32k --policy "$p" \
          --quiet --output-json "$out/profile_qwen3_$p.json" 2>&1 | grep -v USDT | tee "$out/profile_qwen3_$p.log"
      done ;;
    prefill)
      timeout "$(tmo 570)" python3 benchmarks/prefill_routing.py --out "$out/prefill_routing_h200" 2>&1 | tee "$out/prefill_routing_h200.log" | tail -8 ;;
    prefill-order)  # chunked prefill pass after pass vs layer by layer, each policy, one process (PO_MODEL, PO_BATCH, PO_CONTEXT,
      # PO_POLICIES, PO_ROUNDS, PO_TAG a file-name suffix)
      timeout "$(tmo 400)" python3 benchmarks/prefill_order.py --model "${PO_MODEL:-deepseek-v2-lite}" --synthetic --device cuda \
        --vram-budget 32GiB --batch "${PO_BATCH:-4}" --context "${PO_CONTEXT:-32k}" --policies "${PO_POLICIES:-gpu,writescope}" \
        --rounds "${PO_ROUNDS:-3}" --out "$out/prefill_order_h200${PO_TAG:-}" 2>&1 | tee "$out/prefill_order_h200${PO_TAG:-}.log" | tail -14 ;;
    text)
      timeout "$(tmo 560)" python3 -m writescope.cli.main generate --model "$m" --synthetic --device cuda --vram-budget 32GiB \
        --machine-text "${TEXT_TOKENS:-32k}" --batch 4 --max-new-tokens 256 --ignore-eos --policy writescope --prefill-chunk-tokens 2048 \
        ${TEXT_FLAGS:-} --output-json "$out/text_${m}_h200.json" 2>&1 | grep -v "synthetic weights:\|calibrate:" | tee "$out/text_${m}_h200.log" | tail -30 ;;
    breakdown)
      timeout "$(tmo 330)" python3 -m writescope.cli.main profile --model "$m" --synthetic --device cuda --vram-budget 32GiB \
        --batch "${BREAKDOWN_BATCH:-4}" --context "${BREAKDOWN_CONTEXT:-32k}" --policy "${BREAKDOWN_POLICY:-writescope}" --steps 6 --quiet \
        ${BREAKDOWN_FLAGS:-} --output-json "$out/profile_${m}_h200${BREAKDOWN_TAG:-}.json" \
        2>&1 | grep -v USDT | tee "$out/profile_${m}_h200${BREAKDOWN_TAG:-}.log" | tail -30 ;;
    1m)  # ONEM_POLICIES: POLICY:NEW_TOKENS pairs, one process each (default writescope:256); ONEM_TAG a file-name suffix;
      # ONEM_BATCH sequences of 32K tokens (default 32: 1M tokens; 16 for half the time);
      # ONEM_WARM=0 skips the warm-up process (8K tokens under gpu, untimed: a fresh machine's first process compiles the
      # prefill's kernels inside its TTFT, runs 67-68: its first sequence 3-5 s slower than later processes'; gpu so that
      # it keeps no in-step A for the timed writescope run to place its prompts with)
      if [[ "${ONEM_WARM:-1}" != 0 ]]; then
        timeout "$(tmo 120)" python3 -m writescope.cli.main generate --model deepseek-v2-lite --synthetic --device cuda --vram-budget 32GiB \
          --machine-text 8k --batch 1 --max-new-tokens 2 --ignore-eos --policy gpu --prefill-chunk-tokens 2048 --quiet \
          > "$out/1m_warm${ONEM_TAG:-}.log" 2>&1 || echo "1m warm-up: exit $?"
      fi
      for run in ${ONEM_POLICIES:-writescope:256}; do
        local pol=${run%%:*} new=${run##*:} f="$out/1m_deepseek-v2-lite_h200_${run%%:*}${ONEM_TAG:-}"
        timeout "$(tmo 560)" python3 -m writescope.cli.main generate --model deepseek-v2-lite --synthetic --device cuda --vram-budget 32GiB \
          --machine-text 32k --batch "${ONEM_BATCH:-32}" --max-new-tokens "$new" --ignore-eos --policy "$pol" --prefill-chunk-tokens 2048 \
          --output-json "$f.json" 2>&1 | grep -v "^prefill:" | tee "$f.log" | tail -14 || echo "$run: exit $?"
      done ;;
    1m-decode)
      timeout "$(tmo 570)" python3 -m writescope.cli.main bench --model deepseek-v2-lite --synthetic --device cuda --vram-budget 32GiB \
        --kv-fill random --batch 32 --context 32k --policies writescope --steps 256 --quiet \
        --output-json "$out/1m_decode_deepseek-v2-lite_h200.json" 2>&1 | tee "$out/1m_decode_deepseek-v2-lite_h200.log" | tail -12 ;;
    mla)
      for mode in absorbed expanded; do
        # same expert placement in both modes (all 1,664 on the GPU at chunk 2048: writescope plan); || true: both run
        WRITESCOPE_MLA_PREFILL=$mode timeout "$(tmo 200)" python3 -m writescope.cli.main generate --model deepseek-v2-lite --synthetic \
          --device cuda --vram-budget 32GiB --machine-text 32k --batch 2 --max-new-tokens 4 --ignore-eos --policy gpu \
          --prefill-chunk-tokens 2048 --quiet --output-json "$out/mla_${mode}_h200.json" 2>&1 | tee "$out/mla_${mode}_h200.log" \
          | grep -E "VRAM budget|prefill|TTFT|peak|error" | sed "s/^/$mode: /" || true
      done ;;
    grid)  # GRID_RESUME=FILE: a saved grid JSON (from an earlier call, in the working tree) whose complete cells are kept
      local resume=""
      if [[ -n "${GRID_RESUME:-}" ]]; then cp "$GRID_RESUME" "$out/grid_${m}_h200${GRID_TAG:-}.json"; resume="--resume"; fi
      timeout "$(tmo 570)" python3 -m writescope.cli.main bench --model "$m" --synthetic --device cuda --vram-budget 32GiB --kv-fill random \
        --batch "${GRID_BATCH:-4,16}" --context "${GRID_CONTEXT:-8k,16k,32k}" \
        --policies "${GRID_POLICIES:-gpu,cpu,monolithic,writescope}" --sweep-static "${GRID_SWEEP:-4}" --steps "${GRID_STEPS:-6}" --quiet ${GRID_FLAGS:-} \
        $resume --output-json "$out/grid_${m}_h200${GRID_TAG:-}.json" --plot "$out/grid_${m}_h200${GRID_TAG:-}.png" 2>&1 | tee "$out/grid_${m}_h200${GRID_TAG:-}.log" | tail -30 ;;
    prefill-e2e)
      timeout "$(tmo 400)" python3 -m writescope.cli.main bench --model "$m" --synthetic --device cuda --vram-budget 32GiB \
        --batch 1,8,32 --context 2k --policies gpu,cpu,writescope --steps 1 --quiet \
        --output-json "$out/prefill_e2e_${m}_h200.json" 2>&1 | tee "$out/prefill_e2e_${m}_h200.log" | tail -12 ;;
    consistency)
      timeout "$(tmo 400)" python3 benchmarks/policy_consistency.py --model deepseek-v2-lite --device cuda \
        --policies resident,gpu,cpu,static:0.5,writescope,monolithic:0.5 --batch 4 --machine-text 8192 --max-new-tokens 32 \
        --out "$out/consistency_deepseek-v2-lite_h200.json" 2>&1 | tee "$out/consistency_deepseek-v2-lite_h200.log" | tail -14 ;;
    peer)
      ckpt=/tmp/writescope-dsv2  # not under $out: 31 GB
      [[ -e $ckpt/config.json ]] || timeout "$(tmo 200)" python3 -m writescope.cli.main make-checkpoint --preset deepseek-v2-lite \
        --out "$ckpt" --device cuda --quiet
      timeout "$(tmo 500)" python3 benchmarks/peer_transformers.py --checkpoint "$ckpt" --contexts "${PEER_CONTEXTS:-8k}" --batch 4 \
        --out "$out/peer_transformers_h200" 2>&1 | tee "$out/peer_transformers_h200.log" | tail -12 ;;
    *)
      echo "usage: $0 PART [PART ...]; PART: tests|split|experts|scheduler|profile|prefill|text:MODEL|breakdown:MODEL|1m|1m-decode|mla|grid:MODEL|prefill-e2e:MODEL|consistency|peer|amx|cpu-attention|cpu-experts|calibrate:MODEL|tpot:MODEL|joint:MODEL|variants:MODEL|timeline:MODEL|multi-user:MODEL|bounds" >&2; return 2 ;;
  esac
}
(( $# )) || { part usage; exit 2; }
rc=0
while (( $# )); do
  p=${1%%:*}; m=""
  if [[ $1 == *:* ]]; then m=${1#*:}
  elif [[ $p == text || $p == breakdown || $p == grid || $p == prefill-e2e || $p == calibrate || $p == tpot || $p == joint || $p == variants \
          || $p == timeline ]]; then shift; m=${1:?"$p needs a model"}; fi
  shift
  if (( $(left) < 40 )); then echo "== $p $m: skipped, $(left) s left of DEADLINE=$deadline" >&2; rc=1; continue; fi
  echo "== $p $m ($(left) s left)"
  part "$p" "$m" || rc=$?
done
exit $rc
