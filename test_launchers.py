"""The launchers: the stages under torchrun as under deepspeed, and across two nodes, simulated on this machine by two
torchrun launchers of one rank each (node ranks 0 and 1, node 0's address), as a cluster without SSH starts them.

Each node has its own local rank 0, so what must happen once (one-time lines, the output folder, its lock, the logs)
must follow the job's rank 0; and a run across nodes must compute exactly what the same ranks compute on one node.
PPO across two nodes (the deepspeed launcher's own start, --no_ssh) against the same run on one node is
test_architectures.test_ppo_across_two_nodes_computes_what_two_ranks_on_one_node_do. That on_rank_0
follows the job's rank 0, not each node's, and that a lock of another host is never taken over, is shown in-process
by test_plumbing.py.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import plumbing
import sft
from test_architectures import no_runs_of
from test_plumbing import BASE_MODEL, TOY_DATA
from test_sft_and_reward_model import (ENV, ROOT, check_reward_model_folder, check_sft_folder, free_port,
                                       processes_with, run, torchrun)

# One or two optimizer steps on 2 ranks. At --max-seq-len 32, SFT drops 4 of these 32 train rows (prompt, response
# and EOS longer than 32 tokens): a line that only the job's rank 0 prints.
FEWER_STEPS = ["--train-split", "train[:32]", "--eval-split", "test[:16]", "--per-device-train-batch-size", "8"]
UNEVEN_EVAL = ["--eval-split", "test[:17]"]  # shares of 9 and 8 rows on 2 ranks (7 and 6 where SFT drops 4)


def two_nodes(script, *flags, log_dir):
    """`script flags` across two nodes of one rank each, simulated here: one torchrun per node, started together, each
    with its node rank and node 0's address and port. Returns what each node printed. If one node fails, the other
    would wait for it (in a collective, then in torchrun's exit barrier, minutes): its launcher is killed, and its
    rank stops by itself once its launcher is gone (watch_launcher)."""
    port, logs, nodes = free_port(), [log_dir / f"node_{node}.log" for node in (0, 1)], []
    for node, log in enumerate(logs):
        with open(log, "w") as output:
            nodes.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                 "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                 os.path.join(ROOT, script), *flags],
                stdout=output, stderr=subprocess.STDOUT, env=ENV))
    deadline = time.time() + 300
    while any(node.poll() is None for node in nodes) and time.time() < deadline:
        if any(node.poll() for node in nodes):  # one failed
            break
        time.sleep(0.2)
    for node in nodes:
        node.kill()
        node.wait()
    outputs = [log.read_text() for log in logs]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    return outputs


def held_out_loss(model_path: str, split: str, max_seq_len: int) -> float:
    """sft.py's held-out loss, the mean cross-entropy per response token, of a model over a split of the toy task,
    each row alone."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = sft.tokenize_demonstrations(plumbing.load_split(TOY_DATA, split, ["prompt", "chosen"]), tokenizer,
                                       sft.Args(max_seq_len=max_seq_len), split)
    model, loss, tokens = AutoModelForCausalLM.from_pretrained(model_path), 0.0, 0
    with torch.no_grad():
        for row in rows:
            labels = torch.tensor(row["labels"][1:])
            logits = model(torch.tensor([row["input_ids"]])).logits[0, :-1]
            loss += torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
            tokens += (labels != -100).sum().item()
    return loss / tokens


def test_sft_across_two_nodes_and_the_reward_model_under_torchrun(tmp_path):
    """SFT across two simulated nodes under ZeRO-3 with --offload (weights and the optimizer's step in CPU memory, as
    a 24 GB GPU runs it), then the reward model under ZeRO-3 on 2 ranks of one node under torchrun (which sets only
    the environment: no --local_rank), a few steps each. Node 1's rank is its node's local rank 0, not the job's rank
    0: it prints none of rank 0's lines (the dropped rows, the losses, the save); had it claimed the output folder
    too, the lock would have stopped one of them. The held-out split comes in shares that make two evaluation
    batches on one rank and one on the other (13 rows of SFT in batches of 6, 17 pairs in batches of 8): under ZeRO-3
    the second rank must run a forward pass with the first (plumbing.rank_share), or both wait forever; and the loss
    is still that of every row once."""
    no_runs_of("test_launchers_sft")
    no_runs_of("test_launchers_rm")
    node_0, node_1 = two_nodes("sft.py", *FEWER_STEPS, *UNEVEN_EVAL, "--per-device-eval-batch-size", "6",
                               "--max-seq-len", "32", "--zero-stage", "3", "--offload", "--output-dir",
                               str(tmp_path / "sft"), "--exp-name", "test_launchers_sft", log_dir=tmp_path)
    for line in ["dropped 4 of 32 rows of split 'train[:32]'", "dropped 4 of 17 rows of split 'test[:17]'",
                 "held-out loss before training", "saved the SFT model"]:
        assert line in node_0 and line not in node_1, line
    start_loss = float(re.search(r"held-out loss before training ([\d.]+)", node_0)[1])
    assert start_loss == pytest.approx(held_out_loss(BASE_MODEL, "test[:17]", 32), abs=1e-4)
    check_sft_folder(str(tmp_path / "sft"))
    reward_model = run("reward_model.py", *FEWER_STEPS, *UNEVEN_EVAL, "--per-device-eval-batch-size", "8",
                       "--model-name-or-path", str(tmp_path / "sft"), "--zero-stage", "3", "--normalization-samples",
                       "16", "--output-dir", str(tmp_path / "rm"), "--exp-name", "test_launchers_rm", ranks=2,
                       launch=torchrun)
    assert "reward normalization: on 16 responses" in reward_model.stdout
    check_reward_model_folder(str(tmp_path / "rm"))
    assert not (tmp_path / "rm" / ".lock").exists()  # plumbing.end_run ran the exit handlers before leaving
    no_runs_of("test_launchers_sft")
    no_runs_of("test_launchers_rm")


def test_a_rank_waiting_for_the_other_node_stops_with_its_launcher(tmp_path):
    """Node 0 started alone, as with a node that never comes up (deepspeed --no_ssh, node rank 0 of 2): its rank waits
    in the set-up for its peer, up to the process group's half-hour timeout. Its launcher killed meanwhile, the rank
    must stop within seconds (watch_launcher), not wait on as an orphan."""
    hostfile, log, out, port = tmp_path / "hostfile", tmp_path / "node_0.log", tmp_path / "sft", free_port()
    hostfile.write_text("node-0 slots=1\nnode-1 slots=1\n")
    with open(log, "w") as output:
        node_0 = subprocess.Popen(
            [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh", "--node_rank",
             "0", "--master_addr", "127.0.0.1", "--master_port", str(port), os.path.join(ROOT, "sft.py"),
             "--output-dir", str(out)],
            stdout=output, stderr=subprocess.STDOUT, env=ENV)
    deadline = time.time() + 120
    while time.time() < deadline:  # until rank 0 listens on the port: it has begun to wait for rank 1
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", int(port))) == 0:
                break
        time.sleep(0.2)
    node_0.kill()
    node_0.wait()
    killed = time.time()
    while processes_with(str(out)) and time.time() < killed + 15:
        time.sleep(0.2)
    left = processes_with(str(out))
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left and "the launcher that started this rank is gone" in log.read_text(), log.read_text()[-3000:]
