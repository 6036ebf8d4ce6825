"""The trained stages that test_ppo.py and test_ppo_loop.py start PPO from, trained once per test session."""

import atexit
import os
import shutil
import tempfile

# Every stage the tests run, here or in a process of its own, finds a lock where DeepSpeed would build its CPU op
# deepspeed_shm_comm: the lock a build killed half-way leaves, on which a run that builds the op waits forever in
# silence. None does (plumbing.init_distributed): the suite finishing is the test. Set before anything copies the
# environment (test_sft_and_reward_model.ENV, when a test module imports it).
EXTENSIONS = tempfile.mkdtemp(prefix="torch_extensions_")
os.makedirs(os.path.join(EXTENSIONS, "deepspeed_shm_comm"))
open(os.path.join(EXTENSIONS, "deepspeed_shm_comm", "lock"), "w").close()
os.environ["TORCH_EXTENSIONS_DIR"] = EXTENSIONS
atexit.register(shutil.rmtree, EXTENSIONS, ignore_errors=True)

# The tests run in a working folder of their own, as a user runs the stages from a folder of theirs: what a stage
# writes where it runs (runs/, checkpoints/, benchmark.json) goes with it, and the checkout stays as it was found. The
# tests name each script by its path in the checkout (test_sft_and_reward_model.run), the toy task as plumbing.TOY_TASK.
WORKING_FOLDER = tempfile.mkdtemp(prefix="ppo_rlhf_tests_")
os.chdir(WORKING_FOLDER)
atexit.register(shutil.rmtree, WORKING_FOLDER, ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

# A run compiles fast_sampling.decode_step once; the suite compiles it for many samplers in one process (bf16 and
# fp32, five model families, ZeRO-3, the benchmark's limit), more than the 8 versions of one function dynamo keeps.
torch._dynamo.config.recompile_limit = 64


@pytest.fixture(scope="session")
def stages(tmp_path_factory):
    """SFT and reward model checkpoints, a few steps each, as ppo.py's flags."""
    from test_sft_and_reward_model import FEW_STEPS, run  # here: the math's tests alone load no stage
    root = tmp_path_factory.mktemp("stages")
    run("sft.py", *FEW_STEPS, "--output-dir", str(root / "sft"), here=True)
    run("reward_model.py", *FEW_STEPS, "--model-name-or-path", str(root / "sft"), "--output-dir", str(root / "rm"),
        "--normalization-samples", "64", here=True)
    return ["--actor-model-name-or-path", str(root / "sft"), "--reward-model-name-or-path", str(root / "rm")]
