#!/usr/bin/env bash
# The GPU check: on a machine with CUDA, the README's pipeline on the bundled toy task (sft.py, reward_model.py, ppo.py
# on every GPU with the actor under ZeRO-3, evaluate.py), then short ppo.py runs at ZeRO-0 on the paths that only a GPU
# takes or that differ there (bf16; LoRA adapters alone, checkpointed, stopped and resumed; the EMA; fp16 with
# --align-overflow), and benchmark.py's profile at Pythia-1B's shape with each sampler, eager and static, side by side.
# About 10 minutes on one GPU with one profile (not yet timed with both). It prints one table, a row per step (exit
# status, seconds, the figure that matters), and exits non-zero if a row failed. Run it on a new GPU machine before a
# long run (docs/scaling.md). The tests never need a GPU; this script is not one of them.
#
#     ./gpu_check.sh              # logs and outputs in gpu_check/<date and time>/
#     ./gpu_check.sh FOLDER       # in FOLDER, which must be new or empty
set -u
cd "$(dirname "$0")"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1
export PYTHONWARNINGS=ignore::FutureWarning
python=${PYTHON:-python3}

count_gpus="import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
if ! gpus=$($python -c "$count_gpus" 2>/dev/null); then
    echo "gpu_check.sh: error: $python cannot import torch; activate the project's environment (README, Quick start)," \
         "or name its Python in PYTHON" >&2
    exit 1
fi
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
mkdir -p "$out/logs" || exit 1
card=$($python -c "import torch; print(torch.cuda.get_device_name(), f'{torch.cuda.mem_get_info()[1] / 2**30:.0f}'," \
       "'GiB; torch', torch.__version__, 'CUDA', torch.version.cuda)")
echo "gpu_check.sh: $gpus x $card; logs in $out/logs"

rows=() failed=0
# step NAME TIMEOUT_S COMMAND...: run COMMAND with its output in logs/NAME.log, then add its row (figure NAME reads it).
step() {
    local name=$1 limit=$2 start=$SECONDS status
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" > "$out/logs/$name.log" 2>&1
    status=$?
    [ "$status" -eq 0 ] || { failed=1; tail -n 5 "$out/logs/$name.log"; }
    rows+=("| $name | $status | $((SECONDS - start)) | $(figure "$name" "$status") |")
}
free_port() { $python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

# figure NAME STATUS: the figure that matters for step NAME, read from its log or its outputs.
figure() {
    $python - "$out" "$1" "$2" 2>/dev/null <<'PYTHON' || echo "no figure: see logs/$1.log"
import glob, json, os, re, sys
out, name, status = sys.argv[1:]
log_file = os.path.join(out, "logs", f"{name}.log")
log = open(log_file, errors="replace").read() if os.path.exists(log_file) else ""
if status != "0":
    lines = [line for line in log.splitlines() if line.strip()]
    print(("timed out" if status == "124" else lines[-1][:150] if lines else "no output").replace("|", "/"))
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
elif name == "ppo_ema":
    print(ppo_figure("ppo_ema") + f"; actor_ema saved: {os.path.isdir(os.path.join(out, 'ppo_ema', 'actor_ema'))}")
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
# The README's pipeline, each stage with its defaults.
step sft 300 $python sft.py --output-dir "$sft" --exp-name gpu_check_sft
step reward_model 300 $python reward_model.py --model-name-or-path "$sft" --output-dir "$rm" --exp-name gpu_check_rm
stages=(--actor-model-name-or-path "$sft" --reward-model-name-or-path "$rm")
step ppo_zero3 400 $python -m deepspeed.launcher.runner --num_gpus "$gpus" --master_port "$(free_port)" ppo.py \
    "${stages[@]}" --actor-zero-stage 3 --output-dir "$out/ppo_zero3" --exp-name gpu_check_ppo_zero3
step evaluate 300 $python evaluate.py --sft-model "$sft" --ppo-model "$out/ppo_zero3/actor" --reward-model "$rm" \
    --output-dir "$out/evaluation"

# Short runs at ZeRO-0 on one GPU: 8 iterations of 64 prompts each.
short=("${stages[@]}" --total-episodes 512 --sample-every 0)
step ppo_bf16 300 $python ppo.py "${short[@]}" --dtype bf16 --output-dir "$out/ppo_bf16" --exp-name gpu_check_ppo_bf16
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
step ppo_lora 360 bash -c 'stop_after_first_checkpoint "$@"' stop $python ppo.py "${lora[@]}"
step ppo_lora_resume 300 $python ppo.py "${lora[@]}" --resume
step ppo_ema 300 $python ppo.py "${short[@]}" --enable-ema --output-dir "$out/ppo_ema" --exp-name gpu_check_ppo_ema
step ppo_fp16 300 $python ppo.py "${short[@]}" --dtype fp16 --align-overflow --output-dir "$out/ppo_fp16" \
    --exp-name gpu_check_ppo_fp16
# Pythia-1B's shape with each sampler, the limit's models freed before ppo.py's load (the two do not fit 80 GB side by
# side), then the two side by side: whether --sampler static is faster at the same quality.
for sampler in eager static; do
    step "sampler_$sampler" 600 $python benchmark.py --preset pythia-1b --profile --profile-limit-apart \
        --warmup-iterations 1 --iterations 3 --sampler "$sampler" --output-json "$out/benchmark_$sampler.json"
done
rows+=("| samplers | - | - | $(figure samplers 0) |")

echo
echo "GPU check, $(date +%Y-%m-%d), $gpus x $card:"
echo
echo "| step | exit status | seconds | figure |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
exit $failed
