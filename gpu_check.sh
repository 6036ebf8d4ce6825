#!/usr/bin/env bash
# The GPU check: on a machine with CUDA, in one call of at most 8 minutes on one H100 or H200, a table of what runs
# there, a row per step (exit status, seconds, the figure that matters). Run it on a new GPU machine before a long run
# (docs/scaling.md). The tests never need a GPU; this script is not one of them (test_gpu_check.py runs its table
# logic on made-up runs).
#
#     ./gpu_check.sh              # logs and outputs in gpu_check/<date and time>/, the table in its table.md
#     ./gpu_check.sh FOLDER       # in FOLDER, which must be new or empty
#     GPU_CHECK_BUDGET=SECONDS    # the whole script's time, 480 by default
#     GPU_CHECK_WHEELS=FOLDER     # the wheels in FOLDER installed first, for a machine that reaches no registry
#
# What it runs, in three phases; "about": the seconds a row takes on one H100, from its H100 runs of 2026-11-26/27
# (docs/benchmark.md), the arithmetic in docs/scaling.md ("Before a long run on a new GPU machine"):
#   1. The README's pipeline on the bundled toy task, each stage with its defaults: sft (about 45 s; 41 measured),
#      reward_model (45; 42).
#   2. Three lanes side by side on the GPU, small runs on the toy task that leave most of it idle (none timed for
#      speed):
#      - ppo_zero3: ppo.py on every GPU with the actor under ZeRO-3, through DeepSpeed's launcher (90; 84 measured),
#        then evaluate (25; 23): the rest of the pipeline;
#      - sampler_contract: test_fast_sampling.py's checks of --sampler static on CUDA, its decode step replayed from a
#        recorded CUDA graph: its logits, its tokens' distribution and their lengths against ppo.sample's (45), then
#        ppo_fp16: --dtype fp16 --align-overflow (20);
#      - ppo_bf16_ema: --dtype bf16 --enable-ema (20); ppo_lora: LoRA adapters alone, a checkpoint every 2 iterations,
#        stopped (SIGTERM) once its first is complete (20); ppo_lora_resume: --resume from it (20).
#      The short runs have 4 iterations of 64 prompts at ZeRO-0 on one GPU.
#   3. Alone on the GPU, for their timings: benchmark.py's profile at its Pythia-1B preset with --sampler static (130),
#      then eager (85), then the two side by side (samplers): whether static is faster at the same quality.
# In all about 5 (the probe) + 90 + 115 (the longest lane) + 130 + 85 = 425 s. A row starts only if the rows it needs
# passed and the budget has its "about" left, and runs for at most its own limit or what the budget has left; a row
# cut short, not run or stopped says so in its figure. Stopped from outside (SIGTERM, SIGINT, SIGHUP), it stops the
# rows running and still prints the table and writes it. It exits non-zero unless every row passed.
set -u
cd "$(dirname "$0")"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1
export PYTHONWARNINGS=ignore::FutureWarning
python=${PYTHON:-python3}
budget=${GPU_CHECK_BUDGET:-480}
# GPU_CHECK_WHEELS: installed into gpu_check/site, first on every stage's path. Made where a registry answers, for the
# machine's Python (docs/scaling.md lists what a lent GPU machine lacks), each with
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform
#         manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl NAME==VERSION
# and DeepSpeed, source only on PyPI, by the project's environment (torch installed), its ops compiled at run time:
#     DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
    $python -m pip install -q --no-index --no-deps --no-compile --target gpu_check/site --upgrade \
        "$GPU_CHECK_WHEELS"/*.whl || exit 1
    export PYTHONPATH=$PWD/gpu_check/site${PYTHONPATH:+:$PYTHONPATH} PATH=$PWD/gpu_check/site/bin:$PATH
fi

# The number of GPUs; if any, the card and the versions of what the stages import.
probe="
import importlib.metadata, torch
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(gpus)
if gpus:
    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return 'missing'
    print(f'{torch.cuda.get_device_name()}, {torch.cuda.mem_get_info()[1] / 2**30:.0f} GiB; torch {torch.__version__}, '
          f'CUDA {torch.version.cuda}, ' + ', '.join(f'{name} {version(name)}' for name in
                                                   ['transformers', 'deepspeed', 'datasets', 'tyro', 'pytest']))"
if ! found=$($python -c "$probe" 2>/dev/null); then
    echo "gpu_check.sh: error: $python cannot import torch; activate the project's environment (README, Quick start)," \
         "or name its Python in PYTHON" >&2
    exit 1
fi
{ read -r gpus; read -r card; } <<< "$found"
if [ "$gpus" -lt 1 ]; then
    echo "gpu_check.sh: error: no CUDA GPU here (torch.cuda.is_available() is False): it checks the stages on a GPU;" \
         "on a CPU, .venv/bin/python -m pytest -q checks them" >&2
    exit 1
fi
out=${1:-gpu_check/$(date +%Y%m%d-%H%M%S)}
if [ -e "$out" ] && [ -n "$(ls -A "$out")" ]; then
    echo "gpu_check.sh: error: $out is not empty; name a new or empty folder" >&2
    exit 1
fi
mkdir -p "$out/logs" "$out/rows" || exit 1
deadline=$((SECONDS + budget - 5))  # 5 s left for the table
echo "gpu_check.sh: $gpus x $card; $budget s; logs in $out/logs"

# The table's rows, in its order.
rows=(sft reward_model ppo_zero3 evaluate sampler_contract sampler_static sampler_eager samplers ppo_bf16_ema ppo_lora
      ppo_lora_resume ppo_fp16)
running="" lanes=()  # the row this shell waits for (its timeout's pid), and the lanes of phase 2

# step NAME ABOUT_S LIMIT_S [NEEDED...] -- COMMAND...: COMMAND with its output in logs/NAME.log, then its row. It runs
# only if every NEEDED row passed and the budget has ABOUT_S left, for at most LIMIT_S or what the budget has left.
step() {
    local name=$1 about=$2 limit=$3 start=$SECONDS left status
    shift 3
    while [ "$1" != -- ]; do
        [ "$(status_of "$1")" = 0 ] || { row "$name" "not run" - "not run: $1 did not pass"; return; }
        shift
    done
    shift
    left=$((deadline - SECONDS))
    if [ "$left" -lt "$about" ] || [ "$left" -lt 1 ]; then  # (timeout 0 would never end it)
        row "$name" "not run" - "not run: the budget has $((left > 0 ? left : 0)) s left, it takes about $about s"
        return
    fi
    [ "$limit" -le "$left" ] || limit=$left
    echo "== $name (about $about s, at most $limit s): $*"
    timeout -k 10 "$limit" "$@" > "$out/logs/$name.log" 2>&1 &  # in the background: a trap runs during `wait`
    running=$! running_name=$name running_start=$SECONDS
    wait "$running"
    status=$? running=""
    case $status in
        124 | 137) row "$name" "$status" $((SECONDS - start)) "cut short at $limit s: $(figure "$name" "$status")" ;;
        *) row "$name" "$status" $((SECONDS - start)) "$(figure "$name" "$status")" ;;
    esac
}
# row NAME STATUS SECONDS FIGURE: NAME's row of the table, kept in rows/NAME (lanes write theirs side by side), printed.
row() { echo "| $1 | $2 | $3 | ${4//|//} |" | tee "$out/rows/$1"; }
status_of() { local _ name status; IFS='|' read -r _ name status _ < "$out/rows/$1" 2>/dev/null; echo $status; }
# table REASON: every row in the table's order, those never reached not run for REASON; printed and in table.md.
table() {
    {
        echo "GPU check, $(date +%Y-%m-%d), $gpus x $card:"
        echo
        echo "| step | exit status | seconds | figure |"
        echo "|---|---|---|---|"
        for name in "${rows[@]}"; do
            cat "$out/rows/$name" 2>/dev/null || echo "| $name | not run | - | not run: $1 |"
        done
    } > "$out/table.md"
    echo
    cat "$out/table.md"
}
# stopped SIGNAL: the row running here and the lanes stopped, their rows marked so; then (in the script, not a lane)
# the table, and the exit status of a process that SIGNAL ended.
stopped() {
    trap '' TERM INT HUP
    [ -z "$running" ] || kill -TERM "$running" 2>/dev/null  # timeout passes it on to the row's processes
    [ ${#lanes[@]} -eq 0 ] || kill -TERM "${lanes[@]}" 2>/dev/null
    wait
    [ -z "$running" ] || row "$running_name" stopped $((SECONDS - running_start)) "stopped from outside"
    [ -n "${in_lane:-}" ] || table "the script was stopped from outside (SIG$1)"
    exit $((128 + $(kill -l "$1")))
}
for signal in TERM INT HUP; do
    trap "stopped $signal" "$signal"
done
# lane FUNCTION: FUNCTION's steps in a background shell, which stops its row when stopped (a new shell resets traps).
lane() {
    (in_lane=1 lanes=(); trap "stopped TERM" TERM; "$@") &
    lanes+=($!)
}
free_port() { $python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

# figure NAME STATUS: the figure that matters for step NAME, read from its log or its outputs; after a failure, the
# log's last line.
figure() {
    $python - "$out" "$1" "$2" 2>/dev/null <<'PYTHON' || echo "no figure: see logs/$1.log"
import glob, json, os, re, sys
out, name, status = sys.argv[1:]
log_file = os.path.join(out, "logs", f"{name}.log")
log = open(log_file, errors="replace").read() if os.path.exists(log_file) else ""
if status != "0" or name == "sampler_contract":  # the contract's figure: pytest's last line, what passed
    lines = [line for line in log.splitlines() if line.strip()]
    print(lines[-1][:150] if lines else "no output")
    raise SystemExit
def metrics(folder):
    """Every metrics.jsonl line of the ppo.py run in FOLDER (its training_run.json names the file)."""
    record = json.load(open(os.path.join(out, folder, "training_run.json")))
    return [json.loads(line) for line in open(record["metrics_file"])]
def ppo_figure(folder):
    m = metrics(folder)[-1]
    return (f"iteration {m['iteration']}: KL {m['objective/kl']:.2f}, score {m['objective/scores']:+.2f}, "
            f"peak GPU {m['memory/max_allocated_gb']:.2f} GB allocated")
def sampler(name):  # benchmark.py's profile with --sampler NAME, and the metrics of its ppo.py run
    result = json.load(open(os.path.join(out, f"benchmark_{name}.json")))
    m = [json.loads(line) for line in open(max(glob.glob(f"runs/benchmark_profile_{name}__*/metrics.jsonl"),
                                               key=os.path.getmtime))]
    ms, profile = result["generation_ms_per_token"], result["profile"]["ppo.py"]
    return {"ms a token": ms["ppo.py"], "floor": ms["floor"], "iteration s": profile["mean_iteration"],
            "first ratio": m[0]["val/ratio"], "first approxkl": m[0]["policy/approxkl_avg"],
            "iterations": m[-1]["iteration"], "KL": m[-1]["objective/kl"]}
if name == "sft":
    print(re.findall(r"held-out loss [\d.]+ -> [\d.]+", log)[-1])
elif name == "reward_model":
    print(re.findall(r"held-out accuracy [\d.]+", log)[-1])
elif name == "evaluate":
    ppo = json.load(open(os.path.join(out, "evaluation", "evaluation.json")))["ppo"]
    print(f"PPO over SFT: gold {ppo['gold_win_rate']:.3f}, reward model {ppo['win_rate']:.3f}; KL to SFT "
          f"{ppo['mean_kl_to_sft']:.2f}")
elif name == "ppo_lora":
    latest = open(os.path.join(out, "ppo_lora", "resume", "latest")).read().strip()
    print(f"stopped after its checkpoint {latest}; " + ppo_figure("ppo_lora"))
elif name == "ppo_lora_resume":
    resumed = re.findall(r"resumed from \S+ at iteration (\d+)", log)
    logged = [m["iteration"] for m in metrics("ppo_lora")]
    print(f"resumed at iteration {resumed[-1]}; iterations logged {logged[0]}..{logged[-1]}, each once: "
          f"{logged == list(range(1, len(logged) + 1))}; " + ppo_figure("ppo_lora"))
elif name == "ppo_bf16_ema":
    print(ppo_figure(name) + f"; actor_ema saved: {os.path.isdir(os.path.join(out, name, 'actor_ema'))}")
elif name.startswith("ppo"):
    print(ppo_figure(name))
elif name.startswith("sampler_"):
    s = sampler(name.removeprefix("sampler_"))
    print(f"{s['ms a token']:.3g} ms a token (floor {s['floor']:.3g}), iteration {s['iteration s']:.3f} s; first "
          f"update: ratio {s['first ratio']:.4f}, approxkl {s['first approxkl']:.2e}; KL to the reference after "
          f"{s['iterations']} iterations {s['KL']:.4f}")
elif name == "samplers":  # static beside eager, the same seed and iterations: the default's evidence
    eager, static = sampler("eager"), sampler("static")
    print("static / eager: " + ", ".join(f"{key} {static[key]:.4g} / {eager[key]:.4g}" for key in
                                         ["ms a token", "iteration s", "first ratio", "KL"]))
PYTHON
}

checkpoints=$out/checkpoints
sft=$checkpoints/sft rm=$checkpoints/reward_model
stages=(--actor-model-name-or-path "$sft" --reward-model-name-or-path "$rm")
# Short runs at ZeRO-0 on one GPU: 4 iterations of 64 prompts each.
short=("${stages[@]}" --total-episodes 256 --sample-every 0)
# LoRA adapters alone, a checkpoint every 2 iterations: stopped (SIGTERM) once its first checkpoint is complete, then
# resumed from its latest one.
lora=("${short[@]}" --actor-lora-dim 8 --only-optimize-lora --save-every 2 --output-dir "$out/ppo_lora"
      --exp-name gpu_check_ppo_lora)
stop_after_first_checkpoint() {  # COMMAND...: exit status 0 if it was stopped after a checkpoint and before its end
    "$@" &
    local pid=$!
    while [ ! -e "$out/ppo_lora/resume/latest" ] && kill -0 "$pid" 2>/dev/null; do
        sleep 0.1
    done
    kill -TERM "$pid" 2>/dev/null
    wait "$pid"
    [ -e "$out/ppo_lora/resume/latest" ] && [ ! -e "$out/ppo_lora/actor" ]
}
export -f stop_after_first_checkpoint
export out

# 1. The README's pipeline, each stage with its defaults.
step sft 45 120 -- $python sft.py --output-dir "$sft" --exp-name gpu_check_sft
step reward_model 45 120 sft -- $python reward_model.py --model-name-or-path "$sft" --output-dir "$rm" \
    --exp-name gpu_check_rm
# 2. Three lanes side by side: small runs, which leave most of the GPU idle.
pipeline() {
    step ppo_zero3 90 200 sft reward_model -- $python -m deepspeed.launcher.runner --num_gpus "$gpus" \
        --master_port "$(free_port)" ppo.py "${stages[@]}" --actor-zero-stage 3 --output-dir "$out/ppo_zero3" \
        --exp-name gpu_check_ppo_zero3
    step evaluate 25 90 ppo_zero3 -- $python evaluate.py --sft-model "$sft" --ppo-model "$out/ppo_zero3/actor" \
        --reward-model "$rm" --output-dir "$out/evaluation"
}
contract_and_fp16() {
    step sampler_contract 45 150 -- env FAST_SAMPLING_TEST_DEVICE=cuda $python -m pytest -q -p no:cacheprovider \
        test_fast_sampling.py -k "eager_logits or draws_from_the_policy or every_response_to_its_end"
    step ppo_fp16 20 90 sft reward_model -- $python ppo.py "${short[@]}" --dtype fp16 --align-overflow \
        --output-dir "$out/ppo_fp16" --exp-name gpu_check_ppo_fp16
}
ema_and_lora() {
    step ppo_bf16_ema 20 90 sft reward_model -- $python ppo.py "${short[@]}" --dtype bf16 --enable-ema \
        --output-dir "$out/ppo_bf16_ema" --exp-name gpu_check_ppo_bf16_ema
    step ppo_lora 20 90 sft reward_model -- bash -c 'stop_after_first_checkpoint "$@"' stop $python ppo.py "${lora[@]}"
    step ppo_lora_resume 20 90 ppo_lora -- $python ppo.py "${lora[@]}" --resume
}
lane pipeline
lane contract_and_fp16
lane ema_and_lora
wait "${lanes[@]}"
lanes=()
# 3. Pythia-1B's shape with each sampler, the limit's models freed before ppo.py's load (the two do not fit 80 GB side
# by side), static first (eager's figures exist from earlier runs), then the two side by side.
profile=(benchmark.py --preset pythia-1b --profile --profile-limit-apart --warmup-iterations 1 --iterations 2)
step sampler_static 130 240 -- $python "${profile[@]}" --sampler static --output-json "$out/benchmark_static.json"
step sampler_eager 85 180 -- $python "${profile[@]}" --sampler eager --output-json "$out/benchmark_eager.json"
step samplers 0 10 sampler_static sampler_eager -- true

table "never reached"
for name in "${rows[@]}"; do
    [ "$(status_of "$name")" = 0 ] || exit 1
done
