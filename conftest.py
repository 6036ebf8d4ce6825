"""The trained stages that test_ppo.py and test_ppo_loop.py start PPO from, trained once per test session."""

import pytest
import torch

from test_sft_and_reward_model import FEW_STEPS, run

# A run compiles ppo.decode_step once; the suite compiles it for many samplers in one process (bf16 and fp32, five
# model families, ZeRO-3, the benchmark's limit), more than the 8 versions of one function dynamo keeps by default.
torch._dynamo.config.recompile_limit = 64


@pytest.fixture(scope="session")
def stages(tmp_path_factory):
    """SFT and reward model checkpoints, a few steps each, as ppo.py's flags."""
    root = tmp_path_factory.mktemp("stages")
    run("sft.py", *FEW_STEPS, "--output-dir", str(root / "sft"), here=True)
    run("reward_model.py", *FEW_STEPS, "--model-name-or-path", str(root / "sft"), "--output-dir", str(root / "rm"),
        "--normalization-samples", "64", here=True)
    return ["--actor-model-name-or-path", str(root / "sft"), "--reward-model-name-or-path", str(root / "rm")]
