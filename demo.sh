#!/usr/bin/env bash
# The whole pipeline on the bundled toy task, from a fresh clone, offline, on a CPU: install into .venv, then
# SFT (stage 1), reward model (stage 2), PPO (stage 3), and the evaluation of PPO against SFT.
set -euo pipefail
cd "$(dirname "$0")"
start=$SECONDS
step() { echo; echo "== $1 ($((SECONDS - start)) s so far)"; }

step "install into .venv"
python3 -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0   # the CPU wheel first: an unpinned torch would download CUDA packages
pip install -q -r requirements.txt
export PYTHONWARNINGS=ignore::FutureWarning HF_HUB_DISABLE_PROGRESS_BARS=1

step "stage 1: supervised fine-tuning -> checkpoints/sft"
python sft.py
step "stage 2: reward model -> checkpoints/reward_model"
python reward_model.py
step "stage 3: PPO -> checkpoints/ppo/actor, with a snapshot of the actor every 16 iterations"
python ppo.py --snapshot-every 16
step "evaluation: SFT and PPO on the held-out prompts, by the reward model and by the task's gold rule"
python evaluate.py
echo; echo "demo done in $((SECONDS - start)) s"
