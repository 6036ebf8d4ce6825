"""gpu_check.sh without a GPU: it refuses a CPU with one line; its table, a row that fails, one cut short, its budget
and its stop from outside, on made-up runs. The script runs as it is (a copy in a temporary folder, so that what it
writes stays there), with PYTHON naming a stand-in (fake_python) that reports one GPU and, for each stage, prints or
writes at once the figures that gpu_check.sh reads; the script's own Python code (its figures) runs in this Python. A
few seconds each. This module imports no pytest: fake_python imports it for every made-up step."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
ROWS = ["sft", "reward_model", "ppo_zero3", "evaluate", "sampler_contract", "sampler_static", "sampler_eager",
        "samplers", "ppo_bf16_ema", "ppo_lora", "ppo_lora_resume", "ppo_fp16"]
LANES = ["ppo_zero3", "evaluate", "sampler_contract", "ppo_fp16", "ppo_bf16_ema", "ppo_lora", "ppo_lora_resume"]


def fake_python(argv: list[str]) -> None:
    """What gpu_check.sh's Python does, made up: the probe reports one GPU (and PYTHONPATH); the figure's script, every
    other -c or stdin script and pip run in the real Python; a stage prints or writes, at once, what gpu_check.sh
    reads of it. A command
    line containing $FAKE_FAIL fails; one containing $FAKE_HANG prints a line and hangs, its pid in $FAKE_HANG_PID."""
    if argv[0] == "-c" and "torch.cuda" in argv[1]:
        path = f"; PYTHONPATH {os.environ['PYTHONPATH']}" if "PYTHONPATH" in os.environ else ""
        print(f"1\nFake GPU, 80 GiB; torch 2.11.0, CUDA 13.0, transformers 5.24.0, deepspeed 0.19.8{path}")
        return
    if argv[0] in ["-", "-c"] or argv[:2] == ["-m", "pip"]:
        os.execv(sys.executable, [sys.executable, *argv])
    command = " ".join(argv)
    if os.environ.get("FAKE_HANG") and os.environ["FAKE_HANG"] in command:
        print("iteration 1 of many", flush=True)
        Path(os.environ["FAKE_HANG_PID"]).write_text(str(os.getpid()))
        time.sleep(600)
    if os.environ.get("FAKE_FAIL") and os.environ["FAKE_FAIL"] in command:
        raise SystemExit("RuntimeError: made up")
    if argv[:2] == ["-m", "pytest"]:
        print("3 passed, 9 deselected in 0.01s")
        return
    if argv[:2] == ["-m", "deepspeed.launcher.runner"]:
        argv = argv[argv.index("ppo.py"):]
    flags = {flag: value for flag, value in zip(argv, [*argv[1:], "--"]) if flag.startswith("--")}
    output = flags.get("--output-dir")
    if output:
        os.makedirs(output, exist_ok=True)
    if argv[0] == "sft.py":
        print("held-out loss 2.5000 -> 1.2500, perplexity 12.18 -> 3.49")
    elif argv[0] == "reward_model.py":
        print("held-out accuracy 0.9100, loss 0.2000")
    elif argv[0] == "evaluate.py":
        Path(output, "evaluation.json").write_text(json.dumps(
            {"ppo": {"gold_win_rate": 0.86, "win_rate": 0.92, "mean_kl_to_sft": 3.1}}))
    elif argv[0] == "ppo.py":
        fake_ppo(output, int(flags.get("--total-episodes", 4096)) // 64,  # ppo.py's default
                  int(flags.get("--save-every", 0)), "--resume" in flags)
        for folder in ["actor", *(["actor_ema"] if "--enable-ema" in flags else [])]:
            os.makedirs(os.path.join(output, folder))
    elif argv[0] == "benchmark.py":
        sampler = flags["--sampler"]
        Path(flags["--output-json"]).write_text(json.dumps(
            {"generation_ms_per_token": {"ppo.py": 15.3 if sampler == "eager" else 2.9, "floor": 1.1},
             "profile": {"ppo.py": {"mean_iteration": 2.28 if sampler == "eager" else 1.35}}}))
        fake_ppo(f"runs/benchmark_profile_{sampler}__0", 4, 0, False)
    else:
        raise SystemExit(f"fake_python: no made-up run for {command}")


def fake_ppo(output: str, iterations: int, save_every: int, resume: bool) -> None:
    """ppo.py's record, metrics and checkpoints, made up: with save_every, it hangs after its first checkpoint until
    stopped, as gpu_check.sh stops it; with resume, it goes on from its latest checkpoint."""
    os.makedirs(output, exist_ok=True)
    metrics_file = os.path.join(output, "metrics.jsonl")
    first = 1
    if resume:
        first = int(Path(output, "resume", "latest").read_text().removeprefix("iteration-")) + 1
        print(f"resumed from {output}/resume/iteration-{first - 1} at iteration {first - 1}")
    else:
        Path(output, "training_run.json").write_text(json.dumps({"metrics_file": metrics_file}))
    for iteration in range(first, iterations + 1):
        with open(metrics_file, "a") as f:
            f.write(json.dumps({"iteration": iteration, "objective/kl": 0.01 * iteration, "objective/scores": 0.5,
                                "memory/max_allocated_gb": 1.25, "val/ratio": 1.0, "policy/approxkl_avg": 0.0}) + "\n")
        if save_every and iteration % save_every == 0:
            os.makedirs(os.path.join(output, "resume"), exist_ok=True)
            Path(output, "resume", "latest").write_text(f"iteration-{iteration}")
            if not resume:
                time.sleep(600)


def gpu_check(tmp_path, *, budget=480, fail="", hang="", limit_s=None) -> tuple[list[str], dict]:
    """The command and environment of gpu_check.sh (a copy in tmp_path) on fake_python, its output in tmp_path/out; with
    limit_s, a `timeout` before the real one on PATH cuts the made-up hang at limit_s seconds, not its row's limit."""
    shutil.copy(ROOT / "gpu_check.sh", tmp_path)
    fake = tmp_path / "fake_python"
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(ROOT)!r})\nimport test_gpu_check\n"
                    "test_gpu_check.fake_python(sys.argv[1:])\n")
    fake.chmod(0o755)
    env = {**{name: value for name, value in os.environ.items() if name != "PYTHONPATH"}, "PYTHON": str(fake),
           "GPU_CHECK_BUDGET": str(budget), "FAKE_FAIL": fail, "FAKE_HANG": hang,
           "FAKE_HANG_PID": str(tmp_path / "hanging.pid")}
    if limit_s:
        (tmp_path / "bin").mkdir()
        short = tmp_path / "bin" / "timeout"  # gpu_check.sh's `timeout -k KILL_AFTER LIMIT COMMAND...`
        short.write_text(f'#!/usr/bin/env bash\nlimit=$3\nshift 3\n[[ "$*" != *"$FAKE_HANG"* ]] || limit={limit_s}\n'
                         f'exec {shutil.which("timeout")} -k 1 "$limit" "$@"\n')
        short.chmod(0o755)
        env["PATH"] = f"{tmp_path / 'bin'}:{env['PATH']}"
    return ["bash", str(tmp_path / "gpu_check.sh"), str(tmp_path / "out")], env


def table_rows(printed: str, tmp_path) -> dict[str, tuple[str, str, str]]:
    """The rows of the table at the end of printed, name -> (exit status, seconds, figure): one per row of ROWS, in
    its order, the same in out/table.md."""
    table = printed[printed.rindex("GPU check, "):]
    assert (tmp_path / "out" / "table.md").read_text() == table
    lines = table.splitlines()
    assert lines[0].endswith("1 x Fake GPU, 80 GiB; torch 2.11.0, CUDA 13.0, transformers 5.24.0, deepspeed 0.19.8:")
    assert lines[2:4] == ["| step | exit status | seconds | figure |", "|---|---|---|---|"]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[4:]]
    assert [name for name, *_ in rows] == ROWS
    return {name: tuple(cells) for name, *cells in rows}


def assert_gone(pid_file: Path) -> None:
    """The made-up hang's process has ended (stopped with its row)."""
    pid = int(pid_file.read_text())
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the hanging row's process {pid} still runs")


def test_gpu_check_refuses_a_cpu(tmp_path):
    """On a machine without CUDA (this one, this Python), one line, exit status 1, and no folder made. (A copy of the
    script: one that went on would find no stage to run.)"""
    shutil.copy(ROOT / "gpu_check.sh", tmp_path)
    done = subprocess.run(["bash", tmp_path / "gpu_check.sh", tmp_path / "out"], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable}, timeout=120)
    assert done.returncode == 1 and done.stdout == "" and not (tmp_path / "out").exists()
    assert done.stderr.splitlines() == [
        "gpu_check.sh: error: no CUDA GPU here (torch.cuda.is_available() is False): it checks the stages on a GPU; on "
        "a CPU, .venv/bin/python -m pytest -q checks them"]


def test_gpu_check_installs_carried_wheels_first(tmp_path):
    """GPU_CHECK_WHEELS=FOLDER: its wheels installed into gpu_check/site before the probe, which finds that folder
    first on its PYTHONPATH, as every stage will (a made-up wheel; a budget of 1 s: no stage runs)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "made_up-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("made_up.py", "")
        wheel.writestr("made_up-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: made-up\nVersion: 1.0\n")
        wheel.writestr("made_up-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr("made_up-1.0.dist-info/RECORD", "")
    command, env = gpu_check(tmp_path, budget=1)
    done = subprocess.run(command, capture_output=True, text=True, env={**env, "GPU_CHECK_WHEELS": str(wheels)},
                          timeout=120)
    site = tmp_path / "gpu_check" / "site"
    assert done.stdout.splitlines()[0].startswith(
        f"gpu_check.sh: 1 x Fake GPU, 80 GiB; torch 2.11.0, CUDA 13.0, transformers 5.24.0, deepspeed 0.19.8; "
        f"PYTHONPATH {site}"), done.stdout + done.stderr
    assert (site / "made_up.py").exists()


def test_gpu_check_table_with_a_failed_row_and_one_cut_short(tmp_path):
    """Every row passes on made-up runs but two: ppo_lora fails (its figure: its log's last line), so its resume does
    not run; ppo_fp16 hangs and is cut short at its limit (made 3 s here), its process ended. The figures are read
    from each made-up run's log or outputs; the script exits 1."""
    command, env = gpu_check(tmp_path, fail="--only-optimize-lora", hang="--dtype fp16", limit_s=3)
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    rows = table_rows(done.stdout, tmp_path)
    assert rows["sft"][::2] == ("0", "held-out loss 2.5000 -> 1.2500")
    assert rows["reward_model"][::2] == ("0", "held-out accuracy 0.9100")
    assert rows["ppo_zero3"][::2] == ("0", "iteration 64: KL 0.64, score +0.50, peak GPU 1.25 GB allocated")
    assert rows["evaluate"][::2] == ("0", "PPO over SFT: gold 0.860, reward model 0.920; KL to SFT 3.10")
    assert rows["sampler_contract"][::2] == ("0", "3 passed, 9 deselected in 0.01s")
    assert rows["sampler_static"][::2] == ("0", "2.9 ms a token (floor 1.1), iteration 1.350 s; first update: "
                                                "ratio 1.0000, approxkl 0.00e+00; KL to the reference after 4 "
                                                "iterations 0.0400")
    assert rows["sampler_eager"][::2] == ("0", "15.3 ms a token (floor 1.1), iteration 2.280 s; first update: "
                                               "ratio 1.0000, approxkl 0.00e+00; KL to the reference after 4 "
                                               "iterations 0.0400")
    assert rows["samplers"][::2] == ("0", "static / eager: ms a token 2.9 / 15.3, iteration s 1.35 / 2.28, first "
                                          "ratio 1 / 1, KL 0.04 / 0.04")
    assert rows["ppo_bf16_ema"][::2] == ("0", "iteration 4: KL 0.04, score +0.50, peak GPU 1.25 GB allocated; "
                                              "actor_ema saved: True")
    assert rows["ppo_lora"][::2] == ("1", "RuntimeError: made up")
    assert rows["ppo_lora_resume"] == ("not run", "-", "not run: ppo_lora did not pass")
    assert rows["ppo_fp16"][0] == "124" and 2 <= int(rows["ppo_fp16"][1]) <= 8
    assert rows["ppo_fp16"][2] == "cut short at 90 s: iteration 1 of many"
    assert_gone(tmp_path / "hanging.pid")
    with open(tmp_path / "out" / "logs" / "ppo_fp16.log") as log:
        assert log.read() == "iteration 1 of many\n"


def test_gpu_check_stops_and_resumes_lora(tmp_path):
    """ppo_lora is stopped once its first checkpoint is complete (the made-up run would wait for that), and its resume
    logs each iteration once."""
    command, env = gpu_check(tmp_path)
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = table_rows(done.stdout, tmp_path)
    assert all(status == "0" for status, _, _ in rows.values()), rows
    assert rows["ppo_lora"][2] == ("stopped after its checkpoint iteration-2; iteration 2: KL 0.02, score +0.50, "
                                   "peak GPU 1.25 GB allocated")
    assert rows["ppo_lora_resume"][2] == ("resumed at iteration 2; iterations logged 1..4, each once: True; "
                                          "iteration 4: KL 0.04, score +0.50, peak GPU 1.25 GB allocated")


def test_gpu_check_budget_skips_what_it_cannot_fit(tmp_path):
    """With a budget of 100 s, rows that take longer than what is left are not run, said with the seconds left and
    needed; every row that runs is limited to what is left (the made-up rows take no time)."""
    command, env = gpu_check(tmp_path, budget=100)
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    rows = table_rows(done.stdout, tmp_path)
    started = dict(re.findall(r"^== (\w+) \(about \d+ s, at most (\d+) s\)", done.stdout, re.M))
    assert all(rows[name][0] == "0" and int(seconds) <= 95 for name, seconds in started.items()), started
    skipped = set()
    for name, (status, seconds, figure) in rows.items():
        if name in started:
            continue
        assert (status, seconds) == ("not run", "-"), (name, rows[name])
        if budget := re.fullmatch(r"not run: the budget has (\d+) s left, it takes about (\d+) s", figure):
            left, about = map(int, budget.groups())
            assert left < about, (name, figure)
            skipped.add(name)
        else:  # after a row the budget skipped
            assert re.fullmatch(r"not run: (\w+) did not pass", figure)[1] not in started, (name, figure)
    assert started and skipped, (started, skipped)


def test_gpu_check_stopped_from_outside_in_its_own_shell(tmp_path):
    """SIGINT while sft runs in the script's own shell: sft stopped, the rest not run, the table printed and written."""
    check_stopped_from_outside(tmp_path, "sft.py", signal.SIGINT)


def test_gpu_check_stopped_from_outside_in_a_lane(tmp_path):
    """SIGTERM while ppo_zero3 runs in a lane of phase 2, once the other two lanes are done: ppo_zero3 stopped,
    evaluate and the profiles not run, the table printed and written."""
    check_stopped_from_outside(tmp_path, "ppo_zero3", signal.SIGTERM)


def check_stopped_from_outside(tmp_path, hang: str, stop: signal.Signals) -> None:
    """Stopped from outside (stop) while the row whose command contains hang runs, gpu_check.sh stops that row, marks
    it stopped, prints and writes the table with every row it never reached not run, and exits as the signal would
    end it (128 + the signal's number)."""
    command, env = gpu_check(tmp_path, hang=hang)
    with open(tmp_path / "printed", "w+") as printed:
        script = subprocess.Popen(command, stdout=printed, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            awaited = ["| ppo_fp16 |", "| ppo_lora_resume |"] if hang == "ppo_zero3" else []
            for _ in range(300):  # the hang, and the lanes beside it, done
                printed.seek(0)
                text = printed.read()
                if (tmp_path / "hanging.pid").exists() and all(line in text for line in awaited):
                    break
                time.sleep(0.1)
            else:
                raise AssertionError("the made-up hang did not start:\n" + text)
            script.send_signal(stop)
            assert script.wait(timeout=30) == 128 + stop
        finally:
            script.kill()
        printed.seek(0)
        text = printed.read()
    rows = table_rows(text, tmp_path)
    stopped = ROWS.index(hang.removesuffix(".py"))
    done = ROWS[:stopped] + ([name for name in LANES if name not in ["ppo_zero3", "evaluate"]] if stopped else [])
    assert rows[ROWS[stopped]][0] == "stopped" and rows[ROWS[stopped]][2] == "stopped from outside", text
    for name in ROWS:
        if name in done:
            assert rows[name][0] == "0", (name, text)
        elif name != ROWS[stopped]:
            assert rows[name] == ("not run", "-", f"not run: the script was stopped from outside ({stop.name})"), (
                name, text)
    assert_gone(tmp_path / "hanging.pid")
