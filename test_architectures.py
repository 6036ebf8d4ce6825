"""The model families people bring: tiny random GPT-2 (absolute positions), OPT (DeepSpeed-Chat's), GPT-NeoX (Pythia,
TRL's), Qwen2 and Llama (grouped-query attention, untied heads) go through all three stages; and a reward model with a
tokenizer of its own. Every model is built here from the bundled toy tokenizer, nothing is downloaded.
"""

import glob
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.processors import TemplateProcessing
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          PreTrainedTokenizerFast)

import plumbing
import ppo
from test_plumbing import TOY_DATA
from test_sft_and_reward_model import ENV, ROOT, free_port, run, run_in_process, torchrun

TOY_TOKENIZER = os.path.join(plumbing.TOY_TASK, "base_model")
# Two layers of width 32 each; what differs is what each family does with positions, heads and its LM head.
ARCHITECTURES = {
    "gpt2": dict(n_positions=128, n_embd=32, n_layer=2, n_head=2),
    "opt": dict(hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2, max_position_embeddings=128,
                word_embed_proj_dim=32),
    "gpt_neox": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=128),
    "qwen2": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=128),
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=128),
}
# Each family's tokenizer conventions, on the toy vocabulary: the BOS put before every text (OPT's is its EOS,
# Llama's a token of its own; the others put none), and the pad token (GPT-2, Pythia and Llama have none, Qwen2's is
# its EOS: stage 1 adds one).
TOKENIZER_CONVENTIONS = {"gpt2": dict(bos=None, pad=None), "opt": dict(bos="<|endoftext|>", pad="<|pad|>"),
                         "gpt_neox": dict(bos=None, pad=None), "qwen2": dict(bos=None, pad="<|endoftext|>"),
                         "llama": dict(bos="<s>", pad=None)}
# A few steps of each stage: 16 pairs in batches of 8; one PPO iteration of 8 prompts in 2 mini-batches.
STAGE_STEPS = ["--train-split", "train[:16]", "--eval-split", "test[:8]", "--per-device-train-batch-size", "8"]
PPO_STEPS = ["--total-episodes", "8", "--per-device-rollout-batch-size", "8", "--num-mini-batches", "2",
             "--per-device-train-batch-size", "2", "--max-new-tokens", "8"]


def tiny_model_folder(model_type: str, folder) -> str:
    """A random-initialised causal LM of this family with the toy tokenizer in the family's conventions, saved as a
    Hugging Face folder."""
    tokenizer = AutoTokenizer.from_pretrained(TOY_TOKENIZER)
    bos, pad = TOKENIZER_CONVENTIONS[model_type].values()
    if bos is not None:
        tokenizer.add_special_tokens({"bos_token": bos})
        tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tokenizer.bos_token_id)])
    tokenizer.pad_token = pad
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                  **ARCHITECTURES[model_type])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def run_to_the_end(script, *argv):
    assert run_in_process(script, list(argv), must_stop=False) is None


def no_runs_of(exp_name):
    """Remove what an earlier run of this experiment left in runs/."""
    for old in glob.glob(f"runs/{exp_name}__*"):
        shutil.rmtree(old)


def ppo_metrics(out, exp_name, *flags):
    """One PPO iteration, in this process; its metrics line."""
    no_runs_of(exp_name)
    run_to_the_end("ppo.py", *PPO_STEPS, "--output-dir", str(out), "--exp-name", exp_name, *flags)
    (path,) = glob.glob(f"runs/{exp_name}__*/metrics.jsonl")
    (metrics,) = [json.loads(line) for line in open(path)]
    shutil.rmtree(os.path.dirname(path))
    return metrics


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """trained(model_type): the SFT and reward model folders of this family, a few steps each, trained once."""
    folders = {}

    def train(model_type):
        if model_type not in folders:
            root = tmp_path_factory.mktemp(model_type)
            sft, rm = str(root / "sft"), str(root / "rm")
            run_to_the_end("sft.py", *STAGE_STEPS, "--model-name-or-path", tiny_model_folder(model_type, root / "base"),
                           "--output-dir", sft)
            run_to_the_end("reward_model.py", *STAGE_STEPS, "--model-name-or-path", sft, "--output-dir", rm,
                           "--normalization-samples", "8")
            folders[model_type] = (sft, rm)
        return folders[model_type]
    return train


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_three_stages_on_one_rank(model_type, trained, tmp_path):
    """SFT, reward model and PPO, a few steps each, with the family's BOS and pad conventions: every stage's folder
    loads back as this family's model with its tokenizer, and the PPO iteration's metrics are finite."""
    sft, rm = trained(model_type)
    metrics = ppo_metrics(tmp_path, f"test_arch_{model_type}", "--actor-model-name-or-path", sft,
                          "--reward-model-name-or-path", rm)
    assert all(math.isfinite(value) for value in metrics.values() if isinstance(value, float)), metrics
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "actor")  # the family's BOS kept; a pad that is not EOS
    adds_bos = TOKENIZER_CONVENTIONS[model_type]["bos"] is not None
    assert (tokenizer("a film")["input_ids"][0] == tokenizer.bos_token_id) == adds_bos
    assert tokenizer.pad_token_id not in (None, tokenizer.eos_token_id)
    for folder, model_class in [(sft, AutoModelForCausalLM), (rm, AutoModelForSequenceClassification),
                                (tmp_path / "actor", AutoModelForCausalLM),
                                (tmp_path / "critic", AutoModelForSequenceClassification)]:
        assert model_class.from_pretrained(folder).config.model_type == model_type


def metrics_of(exp_name):
    """The lines of the one metrics file this experiment wrote (then removed), each with finite scores and losses."""
    (path,) = glob.glob(f"runs/{exp_name}__*/metrics.jsonl")
    metrics = [json.loads(line) for line in open(path)]
    shutil.rmtree(os.path.dirname(path))
    assert all(math.isfinite(m["objective/scores"]) and math.isfinite(m["loss/policy_avg"]) for m in metrics)
    return metrics


def test_ppo_on_two_ranks_under_torchrun_with_the_actor_under_zero3(trained, tmp_path):
    """OPT under torchrun, 2 ranks, the actor (and so the reference) partitioned by ZeRO-3: two iterations."""
    sft, rm = trained("opt")
    no_runs_of("test_torchrun_opt")
    run("ppo.py", *PPO_STEPS, "--total-episodes", "32", "--actor-zero-stage", "3", "--actor-model-name-or-path", sft,
        "--reward-model-name-or-path", rm, "--output-dir", str(tmp_path), "--exp-name", "test_torchrun_opt", ranks=2,
        launch=torchrun)
    assert [m["iteration"] for m in metrics_of("test_torchrun_opt")] == [1, 2]
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "actor").config.model_type == "opt"


def test_ppo_across_two_nodes_computes_what_two_ranks_on_one_node_do(trained, tmp_path):
    """Two nodes of one rank each, simulated on this machine as on a cluster without ssh: one deepspeed launcher per
    node (--no_ssh, its --node_rank, one hostfile, node 0's address), GPT-NeoX with the actor under ZeRO-3; and the
    same flags on 2 ranks of one node. Node 1's rank is its node's local rank 0 too: only the job's rank 0 prints and
    writes (one metrics file, each iteration once, and an output folder with the one-node run's files), and both
    compute the same metrics, since every rank takes its prompts and seeds by its global rank. (Two nodes under
    torchrun: test_launchers.py.)"""
    sft, rm = trained("gpt_neox")
    flags = [os.path.join(ROOT, "ppo.py"), *PPO_STEPS, "--total-episodes", "32", "--actor-zero-stage", "3",
             "--actor-model-name-or-path", sft, "--reward-model-name-or-path", rm]
    no_runs_of("test_two_nodes")
    no_runs_of("test_one_node")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-0 slots=1\nnode-1 slots=1\n")
    port = free_port()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh", "--node_rank",
         str(node), "--master_addr", "127.0.0.1", "--master_port", str(port), *flags, "--output-dir",
         str(tmp_path / "nodes"), "--exp-name", "test_two_nodes"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV) for node in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "iteration 2/2" in outputs[0] and "iteration 1/2" not in outputs[1] and "saved the actor" not in outputs[1]
    run(*flags, "--output-dir", str(tmp_path / "one_node"), "--exp-name", "test_one_node", ranks=2)
    across_nodes, one_node = metrics_of("test_two_nodes"), metrics_of("test_one_node")
    assert [m["iteration"] for m in across_nodes] == [m["iteration"] for m in one_node] == [1, 2]
    for nodes, node in zip(across_nodes, one_node):
        for name, value in node.items():
            if not name.startswith(("time/", "memory/", "eps")):
                assert nodes[name] == pytest.approx(value, rel=1e-5, abs=1e-6), (node["iteration"], name)
    assert sorted(os.listdir(tmp_path / "nodes")) == sorted(os.listdir(tmp_path / "one_node"))
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "nodes" / "actor").config.model_type == "gpt_neox"


def other_tokenizer(texts) -> PreTrainedTokenizerFast:
    """A tokenizer that shares no ids with the toy one: a smaller byte-level BPE, its special tokens at other ids."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<unk>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>", pad_token="<pad>")


def test_reward_model_with_its_own_tokenizer(tmp_path, capsys):
    """A reward model that reads other tokens scores each prompt + response as its own tokenizer writes the text: the
    same score as for that text tokenized alone, the score at the EOS where the response has one. ppo.py runs with it,
    says so, and starts the critic from the actor with a fresh value head; evaluate.py scores with it."""
    texts = [json.loads(line)["prompt"] + json.loads(line)["chosen"] for line in open(f"{TOY_DATA}/train.jsonl")]
    reward_tokenizer = other_tokenizer(texts[:2000])
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=len(reward_tokenizer), num_labels=1,
                                  pad_token_id=reward_tokenizer.pad_token_id, **ARCHITECTURES["llama"])
    config.max_position_embeddings = 256
    reward = AutoModelForSequenceClassification.from_config(config).eval()
    tokenizer = AutoTokenizer.from_pretrained(TOY_TOKENIZER, padding_side="left")
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    # Two left-padded prompts; the first response ends in EOS (then pad), the second was cut at the length limit.
    rows = [("I watched this film last night and", " the story was good."), ("We saw it, and", " the cast was bad")]
    prompts = [tokenizer(prompt)["input_ids"] for prompt, _ in rows]
    responses = [tokenizer(rows[0][1])["input_ids"] + [eos, pad], tokenizer(rows[1][1])["input_ids"]]
    R = max(map(len, responses))
    responses = [r + [pad] * (R - len(r)) for r in responses]
    P = max(map(len, prompts))
    sequences = torch.tensor([[pad] * (P - len(p)) + p + r for p, r in zip(prompts, responses)])
    attention_mask = (sequences != pad).long()
    reward_sequences, reward_mask, reward_P = plumbing.retokenized(sequences, attention_mask, P, tokenizer,
                                                                   reward_tokenizer)
    assert plumbing.retokenized(sequences, attention_mask, P, tokenizer, None) == (sequences, attention_mask, P)
    reward_tokenizer.model_max_length = 16  # shorter than these texts in its tokens: a message, not an index error
    with pytest.raises(SystemExit, match="more than its tokenizer's model_max_length 16; lower --max-prompt-len"):
        plumbing.retokenized(sequences, attention_mask, P, tokenizer, reward_tokenizer)
    reward_tokenizer.model_max_length = 256
    with torch.no_grad():
        scores = ppo.reward_scores(reward, reward_sequences, reward_mask, reward_P, mean=0.5, std=2.0)
        for i, (prompt, response) in enumerate(rows):
            alone = reward_tokenizer(prompt)["input_ids"] + reward_tokenizer(response)["input_ids"]
            alone += [reward_tokenizer.eos_token_id] if i == 0 else []  # only the first response stopped
            expected = (reward(torch.tensor([alone])).logits[0, 0] - 0.5) / 2.0
            torch.testing.assert_close(scores[i], expected, rtol=1e-5, atol=1e-5)
            assert reward_tokenizer.decode(reward_sequences[i][reward_mask[i].bool()]) == \
                prompt + response + ("</s>" if i == 0 else "")

    # ppo.py with it: the SFT model is the bundled base model (its tokenizer the toy one), the reward model the above.
    reward_folder = tmp_path / "reward"
    reward.save_pretrained(reward_folder)
    reward_tokenizer.save_pretrained(reward_folder)
    metrics = ppo_metrics(tmp_path / "ppo", "test_reward_tokenizer", "--actor-model-name-or-path", TOY_TOKENIZER,
                          "--reward-model-name-or-path", str(reward_folder))
    assert math.isfinite(metrics["objective/scores"]) and math.isfinite(metrics["loss/value_avg"])
    assert f"the critic starts from {TOY_TOKENIZER!r} with a fresh value head" in capsys.readouterr().out
    # evaluate.py scores both policies with it too.
    run_to_the_end("evaluate.py", "--sft-model", TOY_TOKENIZER, "--ppo-model", str(tmp_path / "ppo" / "actor"),
                   "--reward-model", str(reward_folder), "--split", "test[:8]", "--output-dir", str(tmp_path / "eval"))
    evaluation = json.load(open(tmp_path / "eval" / "evaluation.json"))
    assert math.isfinite(evaluation["ppo"]["mean_score"]), evaluation


def test_reward_normalization_with_a_policy_of_another_tokenizer(tmp_path):
    """reward_model.py samples the normalization's responses from a policy with another vocabulary in the policy's own
    tokens (each prompt's text tokenized for it, each response's text tokenized back for the reward model, its EOS
    kept), instead of feeding it the reward model's ids; the stored record names that policy."""
    texts = [json.loads(line)["prompt"] + json.loads(line)["chosen"] for line in open(f"{TOY_DATA}/train.jsonl")]
    policy_tokenizer = other_tokenizer(texts[:2000])
    config = AutoConfig.for_model("llama", vocab_size=len(policy_tokenizer), pad_token_id=policy_tokenizer.pad_token_id,
                                  eos_token_id=policy_tokenizer.eos_token_id, **ARCHITECTURES["llama"])
    config.max_position_embeddings = 256
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "policy")
    policy_tokenizer.save_pretrained(tmp_path / "policy")
    error = run_in_process("reward_model.py", ["--train-split", "train[:16]", "--eval-split", "test[:8]",
                                               "--per-device-train-batch-size", "8", "--model-name-or-path",
                                               TOY_TOKENIZER, "--policy-model-name-or-path", str(tmp_path / "policy"),
                                               "--normalization-samples", "8", "--output-dir", str(tmp_path / "rm")],
                           must_stop=False)
    assert error is None, error
    saved = AutoConfig.from_pretrained(tmp_path / "rm")
    assert saved.reward_normalization["policy"] == str(tmp_path / "policy") and saved.reward_std > 0
