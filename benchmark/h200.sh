#!/usr/bin/env bash
# Chapter 21's GPU runs, as they were run on an H200: bash benchmark/h200.sh PART OUT
#   PART: sampler, kernels, offline, workloads, profile, ablate, hf, moe, online, launch, serve,
#         serve1, tp2, admission, first (see below)
#   OUT:  a folder for the results (JSON + the printed text)
# Needs: flashinfer-python 0.5.3, the server's packages and pytest importable (the wheels went
# to a folder on PYTHONPATH); Q06: the random Qwen3-0.6B shape, made if missing; OFFICIAL: the
# official's python/ folder at 20fcd7f (git archive 20fcd7f python | tar -x). Correctness is
# pytest on tests/gpu/ (-m gpu), timing benchmark/gpu_bench.py; both go to the part's file.
set -uo pipefail
PART=$1 OUT=$2
Q06=${Q06:-/tmp/q06} OFFICIAL=${OFFICIAL:?the official python/ folder at 20fcd7f}
export PYTHONUNBUFFERED=1
quiet() { stdbuf -oL tr "\r" "\n" | grep --line-buffered -iv "loading weights\|capturing graphs\|it/s\]\|s/it\]"; }
[ -f "$Q06/config.json" ] || python tools/models.py random --arch qwen3 --preset 0.6b \
    --out "$Q06" --dtype bfloat16 --device cuda 2>&1 | tail -1

offline() {  # NAME ROUNDS GROUP... : one bench_offline run, its text and JSON kept
    local name=$1 rounds=$2; shift 2
    echo "# python benchmark/bench_offline.py --model q06 --rounds $rounds $* ($(date -I))" \
        > "$OUT/$name.txt"
    python benchmark/bench_offline.py --model "$Q06" --official "$OFFICIAL" --rounds "$rounds" \
        "$@" --json "$OUT/$name.json" 2>&1 | quiet | tee -a "$OUT/$name.txt"
}

serve() {  # LABEL PACKAGE_DIR NAME BENCH_ARGS... : start that server, bench it, stop it
    local label=$1 package=$2 name=$3 port=1919; shift 3
    PYTHONPATH=$package:$PYTHONPATH setsid python -m minisgl --model "$Q06" --attn fi --port $port \
        > "$OUT/server-$label.log" 2>&1 &
    local pid=$! start=$SECONDS
    until python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/v1/models')" \
        2> /dev/null; do
        sleep 2
        if ((SECONDS - start > 400)) || ! kill -0 $pid 2> /dev/null; then
            echo "server $label did not come up"; tail -5 "$OUT/server-$label.log"; return
        fi
    done
    echo "server $label ready in $((SECONDS - start)) s" | tee "$OUT/$name-$label.txt"
    python benchmark/bench_serving.py --port $port --backend chat --tokenizer "$Q06" --vocab 10000 \
        --input-len 100 1024 --output-len 100 1024 "$@" --label "$label" \
        --machine "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
        --json "$OUT/$name-$label.json" 2>&1 | quiet | tee -a "$OUT/$name-$label.txt"
    kill -TERM -- -$pid; sleep 15; pkill -9 -g $pid && echo "server $label: killed after SIGTERM" | tee -a "$OUT/$name-$label.txt"
    wait $pid; echo "server $label exit code $?" | tee -a "$OUT/$name-$label.txt"
}

case $PART in
sampler)  # chapter 6's sorted draw against the draw without a sort, and its chi-square
    { python -m pytest -m gpu -v tests/gpu/test_gpu_sampler.py
      python benchmark/gpu_bench.py sampler; } 2>&1 | tee "$OUT/ch21_sampler.txt"
    ;;
kernels)  # our kernels against torch's ops: equal, then timed (chapter 19's, as chapter 21 left them)
    { python -m pytest -m gpu -v tests/gpu/test_gpu_kernels.py
      python benchmark/gpu_bench.py kernels; } 2>&1 | tee "$OUT/ch21_kernels.txt"
    ;;
offline)  # the comparison: ours (overlap on and off) and the official, in turns in one group
    offline ch21_offline 3 --latency --group ours:fi:graph:on official:fi:graph:on \
        ours:fi:graph:off
    ;;
workloads)  # ours and the official in turns: nano-vllm's alone (its own configuration), then
    # our four on one pair of engines; batch 1 and the host profile with each. All four need
    # more than one 600 s call: W="long prefix" and W="short mixed" (with NANO=0) split them.
    # POOL: each engine's KV pool in tokens (default: room for the workload, up to 480000; two of
    # those do not fit an H100: POOL=260000)
    workload() {  # TAG WORKLOAD...
        local tag=$1; shift
        echo "# python benchmark/bench_offline.py --model q06 --rounds ${ROUNDS:-3} --latency --host-profile" \
            "--workload $* ($(date -I))" >> "$OUT/ch21_workloads.txt"
        python benchmark/bench_offline.py --model "$Q06" --official "$OFFICIAL" --rounds "${ROUNDS:-3}" \
            --latency --host-profile --workload "$@" --group ours:fi:graph:on official:fi:graph:on \
            --pool "${POOL:-0}" --json "$OUT/ch21_w_$tag.json" 2>&1 | quiet \
            | tee -a "$OUT/ch21_workloads.txt"
    }
    [ "${NANO:-1}" = 1 ] && workload nano nano
    workload ours ${W:-prefix long short mixed}
    ;;
profile)  # one more round of each, and 50 decode steps of each profiled mid-run
    offline ch21_profile 1 --profile --group ours:fi:graph:on official:fi:graph:on
    ;;
ablate)  # the rungs below: FlashInfer without graphs, the torch backend, overlap on and off
    offline ch21_ablate 1 --group ours:fi:eager:on ours:fi:eager:off \
        --group ours:torch:eager:on ours:torch:eager:off
    ;;
hf)  # HF's continuous batching beside ours, on 64 requests of the same distribution
    offline ch21_hf 1 --requests 64 --group hf ours:fi:graph:on
    ;;
moe)
    [ -f /tmp/moe/config.json ] || python tools/models.py random --arch qwen3-moe \
        --preset 30b-a3b --layers 4 --out /tmp/moe --dtype bfloat16 --device cuda 2>&1 | tail -1
    { MINISGL_MOE=/tmp/moe python -m pytest -m gpu -v tests/gpu/test_gpu_moe.py
      python benchmark/gpu_bench.py moe --rounds 5; } 2>&1 | quiet | tee "$OUT/ch21_moe.txt"
    ;;
tp2)  # chapter 16 on two GPUs (issue "11 ·"): TP=2 against TP=1, the server at --tp 2, speed
    python tools/models.py tiny tiny-qwen3 tiny-llama tiny-qwen2 tiny-mistral > /dev/null
    python tools/gpu_tp.py --model "$Q06" 2>&1 | quiet | tee "$OUT/ch16_tp2.txt"
    ;;
online)  # both servers side by side, rounds in turns: 1/16/64/256 in flight, two Poisson rates
    # (PAGES: each server's KV pool, 450000 unless set; two of those do not fit an H100: 250000;
    #  below about 230000 the 256 in flight do not fit at once and online.py notes that TTFT waits)
    # (ENGINES: NAME=PYTHON_DIR ..., the first compared with the rest; ours and the official)
    # (ENGINE_ARGS: NAME=FLAG=VALUE ..., flags for one engine, e.g. s2048=--streaming-prefill-length=2048)
    # shellcheck disable=SC2046
    python benchmark/online.py --model "$Q06" \
        $(printf -- "--engine %s " ${ENGINES:-ours=$PWD/python official=$OFFICIAL}) \
        ${ENGINE_ARGS:+$(printf -- "--engine-args=%s " $ENGINE_ARGS)} \
        --num-pages "${PAGES:-450000}" --rounds 3 --concurrency 1 16 64 256 --rates 16 32 \
        --prompts-per-slot 2 --min-prompts 16 --rate-seconds 6 \
        --step-timer --deadline "${DEADLINE:-0}" \
        --out "$OUT/online" 2>&1 | quiet | tee "$OUT/ch21_online.txt"
    ;;
first)  # a lone request's first token right after 256 in flight, split into hops before, inside
    # and after the scheduler and compared request by request (first_token_pairs); each round
    # runs 256 in flight and then 40 requests one at a time, on each engine in turn
    # shellcheck disable=SC2046
    python benchmark/online.py --model "$Q06" \
        $(printf -- "--engine %s " ${ENGINES:-ours=$PWD/python official=$OFFICIAL}) \
        --num-pages "${PAGES:-450000}" --rounds 3 --concurrency 256 1 --rates \
        --prompts-per-slot 2 --min-prompts 40 --step-timer --deadline "${DEADLINE:-0}" \
        --out "$OUT/first" 2>&1 | quiet | tee "$OUT/ch21_first.txt"
    ;;
launch)  # where ours's prefill launch spends its host time under load (a diagnostic, not timed)
    python benchmark/online.py --model "$Q06" --engine ours=$PWD/python --engine official=$OFFICIAL \
        --num-pages "${PAGES:-450000}" --rounds 1 --concurrency 1 64 --rates 16 \
        --prompts-per-slot 2 --rate-seconds 6 --trace \
        --launch-profile 40 --profile 64 --out "$OUT/launch" 2>&1 | quiet | tee "$OUT/ch21_launch.txt"
    ;;
serve)  # both servers under Poisson arrivals at 8 requests/s, then all 64 at once
    for e in ours:$PWD/python official:$OFFICIAL; do
        serve "${e%%:*}" "${e#*:}" serve --num-prompts 64 --request-rates 8 inf
    done
    ;;
serve1)  # both servers one request at a time: the server's cost per step next to batch-1 offline
    for e in ours:$PWD/python official:$OFFICIAL; do
        serve "${e%%:*}" "${e#*:}" serve1 --num-prompts 8 --request-rates inf --max-concurrency 1
    done
    ;;
admission)  # chapter 22: greedy requests that stop at an EOS both engines honour (a token the
    # random weights do emit, chosen by eos_model.py), max_tokens far above where they stop; ours
    # by expected need, ours conservatively, and the official, one pool each, in turns
    # (REQUESTS, ROUNDS, POOL: 1024, 3, 150000 unless set)
    # (the EOS row's factor is probed on the draw's first 128 prompts: ~14 generations of 256)
    python benchmark/eos_model.py --model "$Q06" --out /tmp/q06eos --requests 128 \
        --input-len 100 1024 --output-len 512 1024 2>&1 | quiet | tee "$OUT/ch22_admission.txt"
    python benchmark/bench_offline.py --model /tmp/q06eos --official "$OFFICIAL" \
        --rounds "${ROUNDS:-3}" --requests "${REQUESTS:-1024}" --input-len 100 1024 \
        --output-len 512 1024 --eos --pool "${POOL:-150000}" --latency \
        --group ours:fi:graph:on ours:fi:graph:on:conservative official:fi:graph:on \
        --json "$OUT/ch22_admission.json" 2>&1 | quiet | tee -a "$OUT/ch22_admission.txt"
    ;;
esac
