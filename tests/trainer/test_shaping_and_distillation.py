"""Overlong reward shaping and the masking of truncated samples in a GRPO step, and on-policy distillation from
a teacher worker (its tokenizer checked at start, its reverse KL as a reward or a loss term), on tiny models."""

import json
from pathlib import Path

import pytest
import torch
from tiny_runs import reward_written, run_settings

from hybridflow import DataProto
from hybridflow.models.tiny import make_tiny_model, teach_conversations
from hybridflow.trainer import PPOTrainer, load_config
from hybridflow.trainer.shaping import without_truncated
from hybridflow.utils.errors import UserError

CONSTANT_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0
"""


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> Path:
    return reward_written(tmp_path_factory, "constant.py", CONSTANT_REWARD)


def config(data_dir: Path, model: str, reward: Path, run_dir: Path, *overrides: str):
    return load_config(
        run_settings(
            data_dir,
            model,
            run_dir,
            f"custom_reward_function.path={reward}",
            "data.max_response_length=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "algorithm.adv_estimator=grpo",
            "trainer.total_training_steps=1",
            *overrides,
        )
    )


def fit(cfg, event: str = "after_reward") -> tuple[dict, list[DataProto]]:
    """The last step's metrics and the batch at ``event`` of every step."""
    batches = []
    with PPOTrainer(cfg) as trainer:
        trainer.register_hook(event, lambda t, step, m, batch: batches.append(batch))
        trainer.fit()
    last = Path(cfg.trainer.default_local_dir, "metrics.jsonl").read_text().splitlines()[-1]
    return json.loads(last), batches


def test_the_overlong_penalty_falls_over_the_last_tokens_of_the_budget(
    data_dir, tiny_model_path, reward_file, tmp_path
):
    metrics, (batch,) = fit(
        config(
            data_dir,
            tiny_model_path,
            reward_file,
            tmp_path,
            "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.len=2",
            "reward_model.overlong_buffer.penalty_factor=0.5",
        )
    )
    lengths = batch.batch["response_mask"].sum(-1).tolist()
    # budget 4, buffer 2: 0 up to 2 tokens, -0.25 at 3, -0.5 at 4, on the score 1.0
    by_hand = [1.0 - 0.5 * max(0, length - 2) / 2 for length in lengths]
    assert batch.batch["token_level_scores"].sum(-1).tolist() == pytest.approx(by_hand)
    assert metrics["reward/overlong_frac"] == pytest.approx(
        sum(length > 2 for length in lengths) / len(lengths)
    )
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(sum(by_hand) / len(by_hand) - 1.0)


def test_truncated_samples_leave_the_loss():
    eos = 7
    batch = DataProto.from_dict(
        {
            "responses": torch.tensor([[3, 4, 5], [3, eos, 0], [3, 4, eos]]),
            "response_mask": torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]]),
        }
    )
    masked, metrics = without_truncated(batch, 3, [eos])
    assert masked.batch["response_mask"].tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert batch.batch["response_mask"][0].tolist() == [1, 1, 1]  # the batch itself is left as it was
    assert metrics["actor/truncated_masked_frac"] == pytest.approx(1 / 3)


def test_a_step_whose_samples_were_all_cut_moves_no_weight(data_dir, tiny_model_path, reward_file, tmp_path):
    """Two-token budget: the random tiny model ends almost no reply by then; with the truncated samples
    masked the policy loss has no token left, so only weight decay (off here) could move the weights."""
    cfg = config(
        data_dir,
        tiny_model_path,
        reward_file,
        tmp_path,
        "data.max_response_length=2",
        "actor_rollout_ref.actor.mask_truncated_samples=true",
        "actor_rollout_ref.actor.optim.weight_decay=0",
    )
    with PPOTrainer(cfg) as trainer:
        trainer.init_workers()
        start = {k: v.copy() for k, v in trainer.wg.actor_rollout.get_weights()[0].items()}
        batches = []
        trainer.register_hook("on_step_end", lambda t, step, m, batch: batches.append(batch))
        metrics = trainer.fit()
        end = trainer.wg.actor_rollout.get_weights()[0]
    mask, responses = batches[0].batch["response_mask"], batches[0].batch["responses"]
    cut = (mask.sum(-1) == 2) & (responses[:, 1] != trainer.tokenizer.eos_token_id)
    assert metrics["actor/truncated_masked_frac"] == pytest.approx(cut.float().mean().item())
    assert cut.all(), "a reply ended within two tokens: pick another seed for this test"
    assert all((start[k] == end[k]).all() for k in start)


# ------------------------------------------------------------------------------- on-policy distillation
def test_a_teacher_with_another_tokenizer_is_refused_at_start(
    data_dir, tiny_model_path, reward_file, tmp_path
):
    other = make_tiny_model(tmp_path / "teacher", vocab_size=512)
    cfg = config(
        data_dir, tiny_model_path, reward_file, tmp_path / "run", f"actor_rollout_ref.teacher.path={other}"
    )
    with pytest.raises(UserError, match="the teacher's tokenizer differs from the student's"):
        PPOTrainer(cfg)


@pytest.mark.parametrize("signal", ["reward", "loss"])
def test_a_teacher_equal_to_the_student_gives_no_signal(
    data_dir, tiny_model_path, reward_file, tmp_path, signal
):
    """The reverse KL of a model against itself is 0 at every token: no reward (with task_reward_coef 0 the
    advantages are all zero), no loss."""
    metrics, (batch,) = fit(
        config(
            data_dir,
            tiny_model_path,
            reward_file,
            tmp_path,
            f"actor_rollout_ref.teacher.path={tiny_model_path}",
            f"actor_rollout_ref.teacher.signal={signal}",
            "actor_rollout_ref.teacher.task_reward_coef=0",
        ),
        "after_advantage",
    )
    assert metrics["distill/reverse_kl"] == pytest.approx(0.0, abs=1e-6)
    assert torch.equal(batch.batch["teacher_log_prob"] != 0, batch.batch["response_mask"].bool())
    if signal == "reward":
        assert batch.batch["token_level_rewards"].abs().max() < 1e-6
        assert metrics["critic/advantages/max"] == metrics["critic/advantages/min"] == 0.0
    else:
        assert metrics["actor/distill_loss"] == pytest.approx(0.0, abs=1e-9)


@pytest.fixture(scope="module")
def opd_task(tmp_path_factory) -> tuple[str, str, Path]:
    """A small task (greet back), a tiny teacher that answers "hi" (every reply token at p >= 0.99), a student
    that has started to (p >= 0.2: it samples the answer now and then, as a base model distilled from its own
    fine-tuned teacher does), and the task's prompts."""
    folder = tmp_path_factory.mktemp("opd")
    questions = [f"Greet me, number {i}." for i in range(8)]
    rows = [
        {
            "data_source": "greet",
            "prompt": [{"role": "user", "content": q}],
            "reward_model": {"ground_truth": "hi"},
        }
        for q in questions
    ]
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    chats = [[{"role": "user", "content": q}, {"role": "assistant", "content": "hi"}] for q in questions]
    teacher = teach_conversations(make_tiny_model(folder / "teacher"), chats)
    student = teach_conversations(make_tiny_model(folder / "student"), chats, min_prob=0.2)
    return teacher, student, folder


@pytest.mark.learning
@pytest.mark.parametrize(
    ("signal", "estimator", "lr", "bound"),
    # measured on this machine's CPU: the reward signal took the reverse KL from 2.6 to 0.3 in 30 steps, the
    # loss term (per token, no credit to later tokens) from 2.6 to 1.3 at a larger rate
    [("reward", "reinforce_plus_plus", "2e-3", 0.4), ("loss", "grpo", "3e-3", 0.75)],
)
def test_the_student_moves_towards_the_teacher(opd_task, reward_file, tmp_path, signal, estimator, lr, bound):
    """The task reward is off (task_reward_coef 0): only the teacher's reverse KL trains the student."""
    teacher, student, folder = opd_task
    cfg = load_config(
        [
            f"custom_reward_function.path={reward_file}",
            f"data.train_files={folder / 'train.jsonl'}",
            f"actor_rollout_ref.model.path={student}",
            f"trainer.default_local_dir={tmp_path}",
            f"actor_rollout_ref.teacher.path={teacher}",
            f"actor_rollout_ref.teacher.signal={signal}",
            "actor_rollout_ref.teacher.task_reward_coef=0",
            f"algorithm.adv_estimator={estimator}",
            "data.max_prompt_length=32",
            "data.max_response_length=3",
            "data.train_batch_size=8",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
            f"actor_rollout_ref.actor.optim.lr={lr}",
            "trainer.total_training_steps=30",
            "trainer.logger=[file]",
        ]
    )
    with PPOTrainer(cfg) as trainer:
        trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kl = [row["distill/reverse_kl"] for row in rows]
    early, late = sum(kl[:5]) / 5, sum(kl[-5:]) / 5
    assert late < bound * early, f"the reverse KL went from {early:.2f} to {late:.2f}: {kl}"


# ------------------------------------------------------------------------------- entropy control
@pytest.mark.parametrize(
    ("loss", "keys", "share"),
    [
        ("clip_cov", ["clip_cov_ratio=0.5", "clip_cov_lb=-1e9", "clip_cov_ub=1e9"], 0.5),
        ("kl_cov", ["kl_cov_ratio=0.25", "ppo_kl_coef=1.0"], 0.25),
    ],
)
def test_the_covariance_losses_act_on_the_configured_share_of_tokens(
    data_dir, tiny_model_path, tmp_path, loss, keys, share
):
    """Clip-Cov and KL-Cov from the config: with bounds that admit every token, the share of tokens they
    select is the configured ratio of the batch's response tokens (one micro-batch, rounded down)."""
    reward = tmp_path / "digits.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)\n"
    )
    policy = "actor_rollout_ref.actor.policy_loss"
    metrics, (batch,) = fit(
        config(
            data_dir,
            tiny_model_path,
            reward,
            tmp_path / "run",
            f"{policy}.loss_mode={loss}",
            *(f"{policy}.{key}" for key in keys),
        ),
        "on_step_end",
    )
    tokens = int(batch.batch["response_mask"].sum())
    assert metrics["actor/pg_clipfrac"] == pytest.approx(int(share * tokens) / tokens)
