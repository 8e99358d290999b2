#!/usr/bin/env bash
# One background GPU job for the fast-step issue (#10 items 2, 3) and the SmolLM2 server run (#15 item 4), run on
# the lent GPU machine once the device stack is installed (started by one call, polled by later ones):
#   nohup bash benchmarks/gpu_step_job.sh > /tmp/job/log 2>&1 &
# It runs from a snapshot under /tmp/job/snap, because the device re-syncs the repo folder at every call.
#   cost   driver, Qwen3-8B shape (random weights): none / ours (adaptive) / builtin, greedy, c = 1..128 -> /tmp/job/cost
#   fixed  the same for ours-fixed at T = 0 and T = 1 (acceptance ~1 at both temperatures, so the tok/s ratio is
#          the sampled verify's cost)                                                              -> /tmp/job/cost
#   smol   driver, SmolLM2-135M-Instruct (staged at /tmp/smollm2 by gpu_stage.sh) + the shipped drafter:
#          none / ours-fixed / builtin / ours, greedy, c = 1, 8, real prompts, then none again (--bracket:
#          plain decoding's own drift, which on this host-bound target can exceed the methods' differences)
#                                                                                                 -> /tmp/job/smol
#   trace  what each width's steps really cost, with the per-step trace of our servers (SGLANG_DFLASH_STEP_TRACE,
#          benchmarks/step_trace.py): Qwen3-8B shape none / ours-k0 / ours at c = 1, 8, 32 -> /tmp/job/trace8b;
#          SmolLM2 none / ours-k0 / ours / builtin, humaneval + gsm at c = 1, 8            -> /tmp/job/tracesmol
#   smolprof  profile_step, SmolLM2 + the shipped drafter (host-bound target): PROF_METHODS at PROF_CONC   -> /tmp/job/smolprof
#   gemma  driver, Gemma-4-26B-A4B shape (random weights): GEMMA_METHODS (none,ours-fixed,builtin), greedy,
#          c = 1, 8, 32                                                                             -> /tmp/job/gemma
#   kbench the verify kernel's default configuration against SGLang's kernels, widths 16 and 1
#          (kernel_bench --sweep --defaults)                                                        -> /tmp/job/kbench
#   kerneltests  the GPU cases of tests/test_step_kernels.py, test_tree_accept.py and test_kernels.py (pytest from
#          the wheels in $WHEELS (/tmp/wheels; the starting call copies .carry/wheels there: the device stack has no
#          pytest)                                                                         -> /tmp/job/kerneltests
#   host   host_profile (py-spy from $WHEELS), SmolLM2 + DRAFTER: HOST_METHODS (none,builtin,ours-fixed), once
#          per concurrency in HOST_CONC ("1") and --max-running-requests in HOST_MAXRUN ("128"; the decode graphs
#          follow it), memory fraction HOST_MEM (0.5; lower it to share the GPU with another job)
#                                                                             -> /tmp/job/host-mr<N>[-c<C>]
#          HOST_SHAPE=<a floor shape>: that shape on the chain weights instead, HOST_METHODS (none,ours-k0) per
#          concurrency in HOST_CONC                                                    -> $JOB/host-<shape>-c<C>
#   pd     issue #49 item 3 on a two-GPU machine: the real SmolLM2 pair (smollm2 staged) as a prefill-decode pair from
#          launch/pd/serve.sh (prefill GPU 0, decode GPU 1, KV over NIXL: `gpu_stage.sh pd`; SGLang's router in front),
#          PD_METHODS (none,ours) through the router, then one server of each on GPU 0 (one-none, one-ours); greedy
#          chat prompts of the held-back sets at c = PD_CONC (1,8,32,64); every output compared with the PD pair
#          without speculation (report --baseline pd-none); server logs kept (graphs captured per server)  -> $JOB/pd
#   tau    the reference engine's held-out tau of DRAFTER on SmolLM2 in float32, T = 0 and 1 (TAU_PROMPTS, the
#          carried prompts file: /tmp/prompts7.pt)                                             -> /tmp/job/tau
#   prof   profile_step, PROF_SHAPE (qwen3-8b; any floor shape) on the chain target (DUMMY_WEIGHTS): PROF_METHODS
#          (ours-fixed,ours; ours-k<N> pins a width) at c = PROF_CONC (1,32), one server start per method
#                                                                                          -> $JOB/prof-<shape>
#   ttft   issue #34 items 1, 2, 5: Qwen3-8B shape, TTFT_METHODS (none,builtin,ours,ours-fixed) then none again
#          (--bracket), c = 1..128, each level's TTFT split into the server's own stages (queue, prefill forward;
#          --enable-metrics + bench --server-metrics)                                              -> /tmp/job/ttft
#   tree   issue #38 items 1, 2, 5: chain (ours-fixed) against draft trees (ours-tree<N>: the full block drafted, N
#          nodes verified; CUDA graphs on: tree built in the draft graph, verified by tree verify graphs):
#          SmolLM2 + DRAFTER on gsm and HumanEval at c = 1, 8 with none bracketing (TREE_SMOL_METHODS)
#                                                                                                  -> /tmp/job/tree-smol
#          then the Qwen3-8B shape's step cost, c = 1, 8, 32 (TREE_8B_METHODS)                      -> /tmp/job/tree-8b
#          each with tree_graphs.txt: per tree server, its graphed / eager tree-step counts
#          (benchmarks/tree_graph_check); `treesmol` / `tree8b` run one half. The policy choosing trees (#38 item 4):
#          methods ours-adaptive-tree<N> (driver.py)
#   treeeq issue #38: greedy equality of graphed tree steps with plain decoding (gpu_e2e, its tie analysis; bf16 with
#          an fp32 lm_head, as float32 has no sgl_kernel RMSNorm): the tiny pair and SmolLM2 + DRAFTER, methods
#          TREE_EQ_METHODS (ours-fixed,ours-tree16,ours-tree8); exit 1 of a run = a failure or no graphed tree step
#                                                                         -> /tmp/job/tree-e2e-tiny, tree-e2e-smol
#   dflash2  issue #36 item 4: ours-fixed with the Qwen3-8B-shaped drafter as DFlash and as DFlash2
#          (shapes --dflash2), c = 1, 8, 32, T = 0 and 1                          -> /tmp/job/dflash2/{dflash,dflash2}
#   floor  issue #44 item 3: the floor of one big shape (FLOOR_SHAPE: gpt-oss-20b, gemma-4-26b-a4b-it, gemma-4-31b-it,
#          llama3.1-8b-instruct, qwen3-8b, qwen3.5-35b-a3b: the preset's extra_buffer; SGLANG_DFLASH_REPLAY_SSM=0 in the
#          environment for SGLang's snapshots instead of the replay commit), random weights re-drawn like a model's
#          with the decisive chain head (DUMMY_WEIGHTS, default chain: greedy outputs no bf16 rounding flips, so
#          equality is exact; `model` for the context-dependent weights alone), one bracketed run: FLOOR_METHODS (none,ours,ours-fixed,builtin)
#          then none again, greedy, c = 1, 8, 32, 64; while the rerun is up every output that differs from plain
#          decoding's is judged on it (benchmarks/greedy_judge.py)                             -> $JOB/floor-<shape>
#          Two shapes side by side on a two-GPU machine: one job per GPU, each with its own JOB and PORT, e.g.
#          CUDA_VISIBLE_DEVICES=1 JOB=/tmp/job1 PORT=30001 PHASES=floor FLOOR_SHAPE=... bash benchmarks/gpu_step_job.sh
#   tp2, tp2gemma  issue #46 item 2: --tp-size 2 over the machine's two GPUs, Qwen3-8B / Gemma-4-31B shape (chain
#          weights, prefill graphs as the big-shape phases): TP2_METHODS (none,ours-fixed,ours,builtin) then none again
#          (--bracket, the judge), greedy, c = 1, 8, 32, 64                                     -> $JOB/tp2, $JOB/tp2gemma
#   tp2eq  greedy equality at --tp-size 2 on many prompts: TP2EQ_SHAPES (qwen3-8b,gemma-4-31b-it) x TP2EQ_METHODS
#          (none,ours,ours-fixed), 256 prompts at c = 1 and at c = 32, 64 new tokens each       -> $JOB/tp2eq-<shape>
#          (these three were gpu_breadth_job.sh's, retired 2026-11-28 with its older phases)
#   dp2    issue #46 item 2: tp2's run with --dp-size 2 instead (SGLang's two replicas, one per GPU; each has our
#          worker): TP2_METHODS then none again, greedy equality judged, c = 1, 8, 32, 64           -> $JOB/dp2
#   oracle issue #45 items 2, 3: real speedups at a stated acceptance, ORACLE_SHAPE (qwen3-8b; any floor shape) on the
#          chain target (random weights + the decisive head: the target follows its recording at every batch shape):
#          ORACLE_METHODS (none,ours-oracle,ours-fixed-oracle,builtin; ours-k<N>-oracle too), greedy,
#          c = ORACLE_CONC (1,8,32,64), none again last (--bracket: drift, and the judge of any output unlike plain's);
#          none first: its greedy outputs become the recording; the -oracle methods' drafts are that continuation cut
#          at the misses of a geometric profile of full-block tau ORACLE_TAU (6.5) (driver --oracle-profile); builtin
#          has no oracle form: its row is its random-weight step cost (the report's x-at-tau projection);
#          oracle_report.txt = each oracle server's last realised-tau / divergence line; ORACLE_DRIVER_ARGS: more
#          driver arguments (e.g. --ours-env SGLANG_DFLASH_STEP_TRACE=$JOB/trace-{pid}.jsonl: every step's width and time)
#                                                                               -> $JOB/oracle-<shape>-tau<T>
# The big-shape phases (floor, oracle, prof) keep SGLang's prefill CUDA graphs; PREFILL_GRAPHS=0 runs prefill eagerly.
# PHASES picks and orders them (default cost,fixed,smol,prof); $JOB/<phase>.done marks each finished phase,
# $JOB/results.tar.gz holds every result so far (no traces). JOB defaults to /tmp/job, PORT to 30000.
set -uo pipefail
JOB=${JOB:-/tmp/job}
SNAP=$JOB/snap
mkdir -p "$JOB" && rm -rf "$SNAP" && mkdir -p "$SNAP"
tar --exclude=./.devstack --exclude=./.stage --exclude=./.carry -cf - . | tar -C "$SNAP" -xf -
cd "$SNAP" && source benchmarks/gpu_env.sh || exit 1
SHAPE_DIR=/tmp/shape-qwen3-8b
COMMON_8B="--attention-backend triton --sampling-backend pytorch --grammar-backend none --mem-fraction-static 0.8
 --cuda-graph-max-bs-decode 128 --max-running-requests 128 --trust-remote-code --disable-prefill-cuda-graph
 --cuda-graph-bs-decode 1 2 4 8 16 32 64 128"
COMMON_GEMMA="--attention-backend triton --sampling-backend pytorch --grammar-backend none --mem-fraction-static 0.85
 --cuda-graph-max-bs-decode 32 --max-running-requests 32 --trust-remote-code --disable-prefill-cuda-graph
 --cuda-graph-bs-decode 1 2 4 8 16 32"
COMMON_SMOL="--attention-backend triton --sampling-backend pytorch --grammar-backend none --mem-fraction-static 0.5
 --cuda-graph-max-bs-decode 128 --max-running-requests 128 --dtype bfloat16 --disable-prefill-cuda-graph"
DRAFTER=${DRAFTER:-sglang_dflash/assets/SmolLM2-135M-Instruct-DFlash-b16}  # the SmolLM2 phases' drafter
[ -d "$SHAPE_DIR" ] || python3 -m sglang_dflash.targets.shapes write qwen3-8b "$SHAPE_DIR" || exit 1

big_shape_args() {  # SHAPE MAX_BS: sets $vocab (the random prompts' ids) and $common (launch_server arguments)
  local extra=
  case $1 in gpt-oss-*) vocab=200000 ;; gemma-4-*) vocab=262000 ;; llama*) vocab=128000 ;;
    qwen3.5-*) vocab=248000; extra="--mamba-radix-cache-strategy extra_buffer" ;;  # the preset's hybrid flag
    *) vocab=151000 ;; esac
  local bs= b; for b in 1 2 4 8 16 32 64 128; do [ "$b" -le "$2" ] && bs="$bs $b"; done
  # SGLang's own prefill CUDA graphs, its default and the launch presets': without them every small prefill is an eager
  # forward, and speculation, whose requests finish at staggered times, runs ~3x more of them than plain decoding
  # (results/oracle-prefill-graphs-h200). PREFILL_GRAPHS=0: eager prefill, as the runs before 2026-11-27 22:30 UTC
  [ "${PREFILL_GRAPHS:-1}" = 1 ] || extra="$extra --disable-prefill-cuda-graph"
  common="--attention-backend triton --sampling-backend pytorch --grammar-backend none --mem-fraction-static ${FLOOR_MEM:-0.85}
 --cuda-graph-max-bs-decode $2 --max-running-requests $2 --trust-remote-code
 --cuda-graph-bs-decode $bs $extra"
}

wait_smollm2() {  # the SmolLM2 phases start once gpu_stage.sh has converted the target and DRAFTER is there
  for _ in $(seq 120); do [ -e /tmp/smollm2/model.safetensors ] && [ -e "$DRAFTER/config.json" ] && break; sleep 5; done
}

run_8b() {  # METHODS TEMPERATURES: gpu_cost_run.sh into $JOB/cost (its report covers every method run so far)
  OUT= RUN=$JOB/cost SHAPE=qwen3-8b METHODS="$1" TEMPERATURES="$2" ROUNDS=2 DEADLINE_S=1500 COMMON_ARGS="$COMMON_8B" \
    bash benchmarks/gpu_cost_run.sh
}

for phase in $(echo "${PHASES:-cost,fixed,smol,prof}" | tr , ' '); do
  echo "=== $phase $(date -u +%T)"
  case $phase in
    kerneltests)
      mkdir -p $JOB/kerneltests /tmp/pytest_site
      # the device stack's own pytest where it has one (ours over it broke its plugin registry: 2026-11-26)
      python3 -c "import pytest" 2>/dev/null ||
        python3 -m pip install -q --no-index --no-deps --target /tmp/pytest_site "${WHEELS:-/tmp/wheels}"/*.whl
      PYTHONPATH=/tmp/pytest_site:$PYTHONPATH python3 -m pytest -q -p no:cacheprovider tests/test_step_kernels.py tests/test_kernel_warmup.py \
        tests/test_tree_accept.py tests/test_kernels.py tests/test_oracle_drafts.py -k "gpu" > $JOB/kerneltests/pytest.log 2>&1
      echo "kernel tests exit $?" >> $JOB/kerneltests/pytest.log ;;
    cost) run_8b "${COST_METHODS:-none,ours,builtin}" 0 ;;
    ttft)
      OUT= RUN=$JOB/ttft SHAPE=qwen3-8b METHODS="${TTFT_METHODS:-none,builtin,ours,ours-fixed}" TEMPERATURES=0 ROUNDS=2 \
        DEADLINE_S=1800 COMMON_ARGS="$COMMON_8B --enable-metrics" DRIVER_ARGS="--bracket" BENCH_ARGS="--server-metrics" \
        bash benchmarks/gpu_cost_run.sh ;;
    tree|treesmol|tree8b)
      if [ "$phase" != tree8b ]; then
        wait_smollm2
        python3 -m benchmarks.driver --target /tmp/smollm2 --draft "$DRAFTER" \
          --methods "${TREE_SMOL_METHODS:-none,ours-fixed,ours-tree16,ours-tree8}" --bracket --out $JOB/tree-smol \
          --wait-s 200 --common-args "$COMMON_SMOL" \
          --title "SmolLM2-135M-Instruct + shipped drafter: chain vs tree, H100" \
          -- --datasets gsm,humaneval --temperatures 0 --concurrency 1,8 --max-new-tokens 192 --rounds 1 \
          --min-convs 16 --warmup 2 --no-progress
        python3 -m benchmarks.report $JOB/tree-smol --title "SmolLM2-135M-Instruct + shipped drafter: chain vs tree, H100"
        python3 -m benchmarks.tree_graph_check $JOB/tree-smol/*.server.log > $JOB/tree-smol/tree_graphs.txt 2>&1
        cat $JOB/tree-smol/tree_graphs.txt
      fi
      if [ "$phase" != treesmol ]; then
        OUT= RUN=$JOB/tree-8b SHAPE=qwen3-8b METHODS="${TREE_8B_METHODS:-none,ours-fixed,ours-tree16,ours-tree8}" \
          TEMPERATURES=0 CONCURRENCY=1,8,32 ROUNDS=2 DEADLINE_S=1500 COMMON_ARGS="$COMMON_8B" \
          bash benchmarks/gpu_cost_run.sh
        python3 -m benchmarks.tree_graph_check $JOB/tree-8b/*.server.log > $JOB/tree-8b/tree_graphs.txt 2>&1
        cat $JOB/tree-8b/tree_graphs.txt
      fi ;;
    treeeq)
      e2e_args="--attention-backend triton --mem-fraction-static 0.25 --cuda-graph-max-bs-decode 32
 --grammar-backend none --sampling-backend pytorch --dtype bfloat16 --enable-fp32-lm-head --disable-prefill-cuda-graph"
      mkdir -p $JOB/tree-e2e-tiny $JOB/tree-e2e-smol
      python3 -m benchmarks.gpu_e2e --build-tiny /tmp/tiny-pair --out $JOB/tree-e2e-tiny --wait-s 300 --tie-tol 0.05 \
        --methods "${TREE_EQ_METHODS:-ours-fixed,ours-tree16,ours-tree8}" --server-args "$e2e_args" \
        > $JOB/tree-e2e-tiny/e2e.log 2>&1
      echo "tiny tree e2e exit $?" | tee -a $JOB/tree-e2e-tiny/e2e.log
      wait_smollm2
      python3 -m benchmarks.gpu_e2e --target /tmp/smollm2 --draft "$DRAFTER" --chat --prompts 32 --max-new-tokens 96 \
        --tie-tol 0.25 --wait-s 300 --methods "${TREE_EQ_METHODS:-ours-fixed,ours-tree16,ours-tree8}" \
        --server-args "$e2e_args" > $JOB/tree-e2e-smol/e2e.log 2>&1
      echo "smollm2 tree e2e exit $?" | tee -a $JOB/tree-e2e-smol/e2e.log
      python3 -m benchmarks.tree_graph_check $JOB/tree-e2e-tiny/*.log $JOB/tree-e2e-smol/*.log ;;
    dflash2)
      [ -d /tmp/shape-qwen3-8b-dflash2 ] || python3 -m sglang_dflash.targets.shapes write qwen3-8b \
        /tmp/shape-qwen3-8b-dflash2 --dflash2 || exit 1
      for variant in qwen3-8b qwen3-8b-dflash2; do
        OUT= RUN=$JOB/dflash2/$variant SHAPE=$variant METHODS=ours-fixed TEMPERATURES=0,1 CONCURRENCY=1,8,32 ROUNDS=2 \
          DEADLINE_S=900 COMMON_ARGS="$COMMON_8B" bash benchmarks/gpu_cost_run.sh
      done ;;
    gemma)
      OUT= RUN=$JOB/gemma SHAPE=gemma-4-26b-a4b-it METHODS="${GEMMA_METHODS:-none,ours-fixed,builtin}" TEMPERATURES=0 \
        CONCURRENCY=1,8,32 ROUNDS=2 DEADLINE_S=1500 COMMON_ARGS="$COMMON_GEMMA" bash benchmarks/gpu_cost_run.sh ;;
    floor)
      shape=${FLOOR_SHAPE:-gpt-oss-20b}
      big_shape_args "$shape" 64
      OUT= RUN=$JOB/floor-$shape SHAPE=$shape METHODS="${FLOOR_METHODS:-none,ours,ours-fixed,builtin}" TEMPERATURES=0 \
        CONCURRENCY=${FLOOR_CONC:-1,8,32,64} ROUNDS=2 DEADLINE_S=2400 RANDOM_VOCAB=$vocab COMMON_ARGS="$common" \
        DRIVER_ARGS="--bracket --port ${PORT:-30000} --dummy-weights ${DUMMY_WEIGHTS:-chain}" bash benchmarks/gpu_cost_run.sh ;;
    tp2|tp2gemma|dp2)
      shape=qwen3-8b; [ "$phase" = tp2gemma ] && shape=gemma-4-31b-it
      parallel="--tp-size 2"; [ "$phase" = dp2 ] && parallel="--dp-size 2"
      big_shape_args "$shape" 64
      OUT= RUN=$JOB/$phase SHAPE=$shape METHODS="${TP2_METHODS:-none,ours-fixed,ours,builtin}" TEMPERATURES=0 \
        CONCURRENCY=1,8,32,64 ROUNDS=2 DEADLINE_S=2400 RANDOM_VOCAB=$vocab COMMON_ARGS="$common $parallel" \
        DRIVER_ARGS="--bracket --port ${PORT:-30000} --dummy-weights ${DUMMY_WEIGHTS:-chain}" bash benchmarks/gpu_cost_run.sh ;;
    tp2eq)
      for shape in $(echo "${TP2EQ_SHAPES:-qwen3-8b,gemma-4-31b-it}" | tr , ' '); do
        big_shape_args "$shape" 32
        [ -d "/tmp/shape-$shape" ] || python3 -m sglang_dflash.targets.shapes write "$shape" "/tmp/shape-$shape"
        python3 -m benchmarks.driver --target "/tmp/shape-$shape/target" --draft "/tmp/shape-$shape/draft" --dummy \
          --dummy-weights "${DUMMY_WEIGHTS:-chain}" --methods "${TP2EQ_METHODS:-none,ours,ours-fixed}" \
          --out "$JOB/tp2eq-$shape" --wait-s 400 --port "${PORT:-30000}" --common-args "$common --tp-size 2" \
          --title "$shape at --tp-size 2: greedy equality" -- --datasets random --temperatures 0 --concurrency 1,32 \
          --max-new-tokens 64 --ignore-eos --random-input-len 128 --random-vocab "$vocab" --rounds 1 --min-convs 256 \
          --no-progress
        python3 -m benchmarks.report "$JOB/tp2eq-$shape" --title "$shape at --tp-size 2: greedy equality" >/dev/null
      done ;;
    oracle)
      shape=${ORACLE_SHAPE:-qwen3-8b}
      big_shape_args "$shape" "$(echo "${ORACLE_CONC:-1,8,32,64}" | tr , '\n' | sort -n | tail -n 1)"
      run=$JOB/oracle-$shape-tau${ORACLE_TAU:-6.5}
      OUT= RUN=$run SHAPE=$shape METHODS="${ORACLE_METHODS:-none,ours-oracle,ours-fixed-oracle,builtin}" \
        TEMPERATURES=0 CONCURRENCY=${ORACLE_CONC:-1,8,32,64} ROUNDS=2 DEADLINE_S=2400 RANDOM_VOCAB=$vocab \
        COMMON_ARGS="$common" DRIVER_ARGS="--oracle-profile tau:${ORACLE_TAU:-6.5},seed:0 --bracket \
 --port ${PORT:-30000} --dummy-weights chain ${ORACLE_DRIVER_ARGS:-}" bash benchmarks/gpu_cost_run.sh
      for log in $run/*oracle*.server.log; do
        echo "$log: $(grep -h 'sglang-dflash oracle drafts:' "$log" | tail -n 1)"
      done > $run/oracle_report.txt
      cat $run/oracle_report.txt ;;
    kbench)
      mkdir -p $JOB/kbench
      python3 -m benchmarks.kernel_bench --sweep --defaults --widths 16,1 --json $JOB/kbench/defaults.json \
        > $JOB/kbench/defaults.txt 2>&1 ;;
    fixed) run_8b ours-fixed 0,1 ;;  # T = 1 at the same acceptance (~1) as greedy: the sampled verify's cost
    prof)
      shape=${PROF_SHAPE:-qwen3-8b}
      big_shape_args "$shape" "$(echo "${PROF_CONC:-1,32}" | tr , '\n' | sort -n | tail -n 1)"
      [ -d "/tmp/shape-$shape" ] || python3 -m sglang_dflash.targets.shapes write "$shape" "/tmp/shape-$shape" || exit 1
      python3 -m benchmarks.profile_step --target "/tmp/shape-$shape/target" --draft "/tmp/shape-$shape/draft" \
        --dummy --dummy-weights "${DUMMY_WEIGHTS:-chain}" --vocab "$vocab" \
        --methods "${PROF_METHODS:-ours-fixed,ours}" --concurrency "${PROF_CONC:-1,32}" \
        --steps "${PROF_STEPS:-20}" --warmup-s 10 --out $JOB/prof-$shape --wait-s 300 --common-args "$common" ;;
    host)
      mkdir -p /tmp/pyspy_site
      python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy_site "${WHEELS:-/tmp/wheels}"/py_spy-*.whl
      if [ -n "${HOST_SHAPE:-}" ]; then  # a big shape on random weights (chain): whose Python a host-bound step waits for
        big_shape_args "$HOST_SHAPE" "$(echo "${HOST_CONC:-1}" | tr ' ' '\n' | sort -n | tail -n 1)"
        [ -d "/tmp/shape-$HOST_SHAPE" ] || python3 -m sglang_dflash.targets.shapes write "$HOST_SHAPE" "/tmp/shape-$HOST_SHAPE"
        for conc in ${HOST_CONC:-1}; do
          python3 -m benchmarks.host_profile --target "/tmp/shape-$HOST_SHAPE/target" \
            --draft "/tmp/shape-$HOST_SHAPE/draft" --dummy --dummy-weights "${DUMMY_WEIGHTS:-chain}" \
            --py-spy /tmp/pyspy_site/bin/py-spy --methods "${HOST_METHODS:-none,ours-k0}" --concurrency "$conc" \
            --vocab "$vocab" --seconds "${HOST_S:-20}" --out "$JOB/host-$HOST_SHAPE-c$conc" --wait-s 400 \
            --port "${PORT:-30000}" --common-args "$common"
        done
      else
        wait_smollm2
        for mr in ${HOST_MAXRUN:-128}; do
          common=$(echo "$COMMON_SMOL" | sed \
            -e "s/--mem-fraction-static [0-9.]*/--mem-fraction-static ${HOST_MEM:-0.5}/" \
            -e "s/--cuda-graph-max-bs-decode [0-9]*/--cuda-graph-max-bs-decode $mr/" \
            -e "s/--max-running-requests [0-9]*/--max-running-requests $mr/")
          for conc in ${HOST_CONC:-1}; do
            dir=$JOB/host-mr$mr; [ "${HOST_CONC:-1}" = 1 ] || dir=$dir-c$conc
            python3 -m benchmarks.host_profile --target /tmp/smollm2 --draft "$DRAFTER" \
              --py-spy /tmp/pyspy_site/bin/py-spy --methods "${HOST_METHODS:-none,builtin,ours-fixed}" \
              --concurrency "$conc" --vocab 49000 \
              --seconds "${HOST_S:-20}" --out "$dir" --wait-s 300 --common-args "$common"
          done
        done
      fi ;;
    tau)
      wait_smollm2
      mkdir -p $JOB/tau
      python3 -m sglang_dflash.train eval --target smollm2 --hf-dir /tmp/smollm2 --drafter "$DRAFTER" \
        --prompts "${TAU_PROMPTS:-/tmp/prompts7.pt}" --device cuda --dtype float32 --n-eval 32 --eval-new-tokens 128 \
        --temperatures 0 1 --eval-batch 32 --out $JOB/tau/tau.json --results-dir $JOB/tau/drafters \
        > $JOB/tau/tau.log 2>&1 ;;
    smolprof)
      wait_smollm2
      python3 -m benchmarks.profile_step --target /tmp/smollm2 --draft "$DRAFTER" \
        --methods "${PROF_METHODS:-none,ours-k0,ours-fixed}" --concurrency "${PROF_CONC:-1,8}" --vocab 49000 \
        --steps "${PROF_STEPS:-40}" --warmup-s 8 --out $JOB/smolprof --wait-s 200 --common-args "$COMMON_SMOL" ;;
    pd)
      wait_smollm2
      run=$JOB/pd; mkdir -p $run
      pd_bench=(--datasets "${PD_DATASETS:-humaneval,mtbench,gsm}" --temperatures 0 --concurrency "${PD_CONC:-1,8,32,64}"
                --max-new-tokens 128 --rounds 1 --min-convs 64 --level-warmup 32 --tokenizer /tmp/smollm2 --no-progress)
      for name in $(echo "${PD_METHODS:-none,ours}" | sed 's/[^,]*/pd-&/g' | tr , ' ') one-none one-ours; do
        case $name in  # a pair behind the router on $PORT, or one server (the preset's own command) on GPU 0
          one-*) cmd=(bash launch/smollm2-135m.sh --method "${name#one-}" --port "${PORT:-30000}") ;;
          pd-*) cmd=(env PD_BACKEND=nixl bash launch/pd/serve.sh smollm2-135m --method "${name#pd-}"
                     --port "${PORT:-30000}") ;;
        esac
        TARGET_PATH=/tmp/smollm2 DRAFT_PATH=$DRAFTER setsid "${cmd[@]}" > "$run/$name.server.log" 2>&1 &
        pid=$!
        for _ in $(seq 90); do curl -sf "http://127.0.0.1:${PORT:-30000}/health" > /dev/null && break; sleep 5; done
        python3 -m benchmarks.bench --url "http://127.0.0.1:${PORT:-30000}" --method "$name" --out "$run" "${pd_bench[@]}" \
          || echo "[pd] $name: bench failed (server log $run/$name.server.log)"
        kill -- -"$pid" 2>/dev/null; sleep 10; kill -9 -- -"$pid" 2>/dev/null
      done
      python3 -m benchmarks.report "$run" --baseline pd-none \
        --title "SmolLM2-135M-Instruct + shipped drafter as a prefill-decode pair (NIXL, 2 GPUs)" ;;
    smol)
      wait_smollm2
      python3 -m benchmarks.driver --target /tmp/smollm2 --draft "$DRAFTER" \
        --methods "${SMOL_METHODS:-none,ours-fixed,builtin,ours}" --bracket --out $JOB/smol --wait-s 200 \
        --common-args "$COMMON_SMOL" --title "SmolLM2-135M-Instruct + shipped drafter, H100" -- \
        --datasets "${SMOL_DATASETS:-humaneval,mtbench,gsm}" --temperatures 0 --concurrency "${SMOL_CONC:-1,8}" \
        --max-new-tokens 192 --rounds 1 --min-convs "${SMOL_CONVS:-16}" --warmup 2 --no-progress
      python3 -m benchmarks.report $JOB/smol --title "SmolLM2-135M-Instruct + shipped drafter, H100" ;;
    trace)
      mkdir -p $JOB/trace8b $JOB/tracesmol
      SGLANG_DFLASH_STEP_TRACE=$JOB/trace8b/trace-{pid}.jsonl OUT= RUN=$JOB/trace8b SHAPE=qwen3-8b \
        METHODS=${TRACE_8B_METHODS:-none,ours-k0,ours} TEMPERATURES=0 CONCURRENCY=1,8,32 ROUNDS=2 DEADLINE_S=900 \
        COMMON_ARGS="$COMMON_8B" bash benchmarks/gpu_cost_run.sh
      for f in $JOB/trace8b/trace-*.jsonl; do python3 -m benchmarks.step_trace "$f" --json "${f%.jsonl}.summary.json"; done
      wait_smollm2
      SGLANG_DFLASH_STEP_TRACE=$JOB/tracesmol/trace-{pid}.jsonl python3 -m benchmarks.driver --target /tmp/smollm2 \
        --draft "$DRAFTER" --methods ${TRACE_SMOL_METHODS:-none,ours-k0,ours,builtin} \
        --out $JOB/tracesmol --wait-s 200 --common-args "$COMMON_SMOL" --title "SmolLM2-135M-Instruct, step trace, H100" -- \
        --datasets humaneval,gsm --temperatures 0 --concurrency 1,8 --max-new-tokens 192 --rounds 1 --min-convs 16 \
        --warmup 2 --no-progress
      for f in $JOB/tracesmol/trace-*.jsonl; do python3 -m benchmarks.step_trace "$f" --json "${f%.jsonl}.summary.json"; done ;;
  esac
  touch "$JOB/$phase.done"
  # results so far, for the polling call to bring back (at most 8 files per call)
  done_dirs=$(cd $JOB && ls -d floor-* oracle-* prof-* tp2 tp2gemma dp2 tp2eq-* pd tree-smol tree-8b tree-e2e-tiny \
    tree-e2e-smol ttft dflash2 cost gemma kbench smol trace8b tracesmol smolprof prof kerneltests tau host-* 2>/dev/null)
  tar czf $JOB/results.tar.gz --exclude=traces -C $JOB $done_dirs 2>/dev/null
done
echo "=== all done $(date -u +%T)"
