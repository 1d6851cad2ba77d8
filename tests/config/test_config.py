"""PPO config: packaged YAML, verl command lines, unknown keys, types, consistency checks, defaults drift."""

import os
import re
import shlex
import warnings

import pytest
from omegaconf import OmegaConf

from hybridflow.config.schema import (
    DEFAULT_CONFIG_PATH,
    ActorConfig,
    ActorRolloutRefConfig,
    AlgorithmConfig,
    ConfigError,
    DataConfig,
    DeprecatedKeyWarning,
    IgnoredKeyWarning,
    PPOConfig,
    TrainerConfig,
    load_config,
)

TRAIN = "data.train_files=train.parquet"

VERL_QUICKSTART = (
    "data.train_files=$HOME/data/gsm8k/train.parquet data.val_files=$HOME/data/gsm8k/test.parquet "
    "data.train_batch_size=256 data.max_prompt_length=512 data.max_response_length=256 "
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct actor_rollout_ref.actor.optim.lr=1e-6 "
    "actor_rollout_ref.actor.ppo_mini_batch_size=64 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 "
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 "
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.4 "
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 critic.optim.lr=1e-5 "
    "critic.model.path=Qwen/Qwen2.5-0.5B-Instruct critic.ppo_micro_batch_size_per_gpu=4 "
    "algorithm.kl_ctrl.kl_coef=0.001 trainer.logger=console trainer.val_before_train=False "
    "trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.save_freq=10 trainer.test_freq=10 trainer.total_epochs=15"
)


def _load(*overrides: str) -> PPOConfig:
    return load_config([TRAIN, *overrides])


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        _load(*overrides)
    return str(info.value)


def test_packaged_yaml_loads_resolved():
    cfg = _load()
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert cfg.actor_rollout_ref.rollout.val_kwargs.do_sample is False
    assert cfg.trainer.logger == ["console", "file"]
    assert cfg.trainer.default_local_dir == "runs/hybridflow/run"  # interpolation resolved
    assert cfg.trainer.device == "cpu" and cfg.actor_rollout_ref.model.dtype == "fp32"  # no GPU here
    assert cfg.data.seed == 42  # from trainer.seed
    assert cfg.critic.enable is True  # gae (the default, as in verl) trains a critic
    assert cfg.critic.model.path == "default" and cfg.critic.ppo_mini_batch_size == 8
    assert cfg.data.train_files == ["train.parquet"]


def test_yaml_and_dataclass_defaults_agree():
    """One source of truth: the YAML documents the dataclass defaults; changing either alone fails here."""
    assert OmegaConf.to_container(OmegaConf.load(DEFAULT_CONFIG_PATH)) == PPOConfig().to_dict()


def test_every_yaml_key_has_a_comment():
    lines = DEFAULT_CONFIG_PATH.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if re.match(r"\s*[A-Za-z_]+:\s*[^\s#]", line):  # a key with a value (sections may go without)
            above = lines[number - 2].strip()  # a long doc sits above its key
            assert " # " in line or above.startswith("# "), (
                f"ppo_trainer.yaml line {number} has no comment: {line!r}"
            )


def test_verl_quickstart_line_parses_and_gpu_keys_warn():
    args = [os.path.expandvars(arg) for arg in shlex.split(VERL_QUICKSTART)]  # what the shell would pass
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(args)
    ignored = sorted(
        str(w.message).split(":")[1].split("=")[0].strip() for w in caught if w.category is IgnoredKeyWarning
    )
    # tensor_model_parallel_size=1 and nnodes=1 are the defaults: nothing is ignored there.
    assert ignored == ["actor_rollout_ref.rollout.gpu_memory_utilization", "trainer.n_gpus_per_node"]
    assert cfg.data.train_files == [os.path.expanduser("~/data/gsm8k/train.parquet")]
    assert cfg.data.train_batch_size == 256 and cfg.data.max_response_length == 256
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 64
    assert cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 4
    assert cfg.critic.optim.lr == 1e-5 and cfg.critic.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cfg.trainer.logger == ["console"]  # a bare name becomes a list
    assert cfg.trainer.val_before_train is False and cfg.trainer.total_epochs == 15
    assert cfg.trainer.save_freq == 10 and cfg.trainer.n_gpus_per_node == 1


def test_gpu_only_keys_outside_the_schema_are_dropped_with_a_warning():
    with pytest.warns(
        IgnoredKeyWarning,
        match=r"ignored on this backend: actor_rollout_ref\.model\.use_liger = True",
    ):
        cfg = _load("+actor_rollout_ref.model.use_liger=true")
    assert "use_liger" not in cfg.to_dict()["actor_rollout_ref"]["model"]


def test_sequence_parallel_sizes_are_typed_the_reference_follows_the_actor_and_must_divide_the_workers():
    four = ["trainer.n_workers=4", "trainer.backend=ray"]
    four += [f"{r}.ppo_micro_batch_size_per_gpu=2" for r in ("actor_rollout_ref.actor", "critic")]
    cfg = _load(
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "critic.ulysses_sequence_parallel_size=4",
        *four,
    )
    assert cfg.actor_rollout_ref.ref.ulysses_sequence_parallel_size == 2  # null: the actor's
    assert cfg.critic.ulysses_sequence_parallel_size == 4
    assert _error("actor_rollout_ref.ref.ulysses_sequence_parallel_size=3", *four) == (
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size=3 does not divide trainer.n_workers (4): each "
        "sequence is split over a group of that many workers"
    )
    assert "must be >= 1" in _error("critic.ulysses_sequence_parallel_size=0")


def test_sharding_and_lora_keys_are_typed_and_ref_and_critic_follow_the_actor():
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredKeyWarning)
        cfg = _load(
            "actor_rollout_ref.actor.strategy=fsdp2",
            "actor_rollout_ref.actor.fsdp_config.param_offload=true",
            "critic.model.fsdp_config.fsdp_size=2",
            "trainer.n_workers=2",
            "trainer.backend=ray",
            "actor_rollout_ref.model.lora_rank=8",
            "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
            "actor_rollout_ref.actor.checkpoint.save_lora_only=true",
        )
    arr = cfg.actor_rollout_ref
    assert arr.actor.fsdp_config.param_offload is True and cfg.critic.model.fsdp_config.fsdp_size == 2
    assert arr.ref.strategy == cfg.critic.strategy == "fsdp2"  # auto follows the actor
    assert arr.model.lora_rank == 8 and arr.model.target_modules == ["q_proj", "v_proj"]
    assert "single runs on one worker" in _error(
        "critic.strategy=single", "trainer.n_workers=2", "trainer.backend=ray"
    )
    assert "does not divide trainer.n_workers (2)" in _error(
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=3", "trainer.n_workers=2", "trainer.backend=ray"
    )
    # token budgets with FSDP2 on several workers: the ranks agree on a micro-batch count (tests/workers)
    budgets = _load(
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "critic.use_dynamic_bsz=true",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
        "trainer.n_workers=2",
        "trainer.backend=ray",
    )
    assert budgets.critic.strategy == "fsdp2" and budgets.actor_rollout_ref.actor.use_dynamic_bsz


def test_vllm_keys_do_not_warn_when_vllm_is_used(monkeypatch):
    monkeypatch.setattr("hybridflow.config.checks.cuda_available", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredKeyWarning)
        cfg = _load(
            "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.4"
        )
    assert cfg.trainer.device == "cuda" and cfg.actor_rollout_ref.model.dtype == "bf16"


def test_vllm_on_cpu_reads_its_engine_keys_and_warns_for_the_gpu_only_ones():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", IgnoredKeyWarning)
        cfg = _load(
            "actor_rollout_ref.rollout.name=vllm",
            "trainer.device=cpu",
            "data.max_prompt_length=100",
            "data.max_response_length=28",
            "actor_rollout_ref.rollout.max_num_seqs=64",
            "actor_rollout_ref.rollout.free_cache_engine=false",
        )
    ignored = [str(w.message) for w in caught if issubclass(w.category, IgnoredKeyWarning)]
    assert len(ignored) == 1 and "actor_rollout_ref.rollout.free_cache_engine = False" in ignored[0]
    rollout = cfg.actor_rollout_ref.rollout
    assert (rollout.max_num_seqs, rollout.max_model_len, rollout.dtype, rollout.seed) == (64, 128, "fp32", 42)


def test_vllm_engine_keys_warn_with_the_hf_rollout():
    with pytest.warns(
        IgnoredKeyWarning, match=r"actor_rollout_ref\.rollout\.max_num_seqs = 64 \(a vLLM engine key"
    ):
        _load("actor_rollout_ref.rollout.max_num_seqs=64")


@pytest.mark.parametrize(
    ("override", "nearest"),
    [
        ("actor_rollout_ref.actor.optim.learning_rate=1e-5", "actor_rollout_ref.actor.optim.lr"),
        ("trainer.train_batch_size=4", "data.train_batch_size"),
        ("actor_rollout_ref.actr.optim.lr=1e-5", "actor_rollout_ref.actor.optim.lr"),
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        ),
        ("actor_rollout_ref.rollout.temprature=0.5", "actor_rollout_ref.rollout.temperature"),
    ],
)
def test_unknown_key_names_the_nearest(override, nearest):
    key = override.split("=")[0]
    assert f"unknown config key '{key}'" in _error(override)
    assert f"did you mean '{nearest}'?" in _error(override)


def test_add_key_only_inside_free_form_dicts():
    cfg = _load("+trainer.ray_kwargs.num_cpus=2", "+trainer.ray_kwargs.runtime_env.env_vars.A=x")
    assert cfg.trainer.ray_kwargs == {"num_cpus": 2, "runtime_env": {"env_vars": {"A": "x"}}}
    assert "add it with +trainer.ray_kwargs.num_cpus=" in _error("trainer.ray_kwargs.num_cpus=2")
    assert "already exists; drop the '+'" in _error("+trainer.seed=3")
    assert "unknown config key 'trainer.sed'" in _error("+trainer.sed=3")
    assert _load("++trainer.seed=3", "++trainer.ray_kwargs.x=1").trainer.seed == 3


def test_delete_key_of_free_form_dict():
    cfg = _load(
        "+trainer.ray_kwargs.num_cpus=2", "+trainer.ray_kwargs.num_gpus=0", "~trainer.ray_kwargs.num_cpus"
    )
    assert cfg.trainer.ray_kwargs == {"num_gpus": 0}
    assert "cannot be deleted" in _error("~trainer.seed")


def test_override_values_are_parsed_as_yaml():
    cfg = _load(
        "data.val_files=[a.parquet,b.parquet]",
        "actor_rollout_ref.rollout.micro_batch_size=null",
        "actor_rollout_ref.actor.optim.betas=[0.8, 0.95]",
        "trainer.experiment_name=2024",
        "critic.model.path=${trainer.project_name}/critic",
    )
    assert cfg.data.val_files == ["a.parquet", "b.parquet"]
    assert cfg.actor_rollout_ref.rollout.micro_batch_size is None
    assert cfg.actor_rollout_ref.actor.optim.betas == [0.8, 0.95]
    assert cfg.trainer.experiment_name == "2024" and cfg.trainer.default_local_dir == "runs/hybridflow/2024"
    assert cfg.critic.model.path == "hybridflow/critic"
    assert "cannot parse override" in _error("just_a_word")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "actor_rollout_ref.actor.optim.lr=abc",
            "actor_rollout_ref.actor.optim.lr must be float, got 'abc' (str)",
        ),
        ("data.train_batch_size=1.5", "data.train_batch_size must be int, got 1.5 (float)"),
        ("data.shuffle=1", "data.shuffle must be bool, got 1 (int)"),
        ("data.train_batch_size=null", "data.train_batch_size must be int, got null"),
        ("data.truncation=cut", "data.truncation must be one of 'error', 'left', 'right', got 'cut'"),
        ("trainer.logger=[console,tensorbord]", "trainer.logger[1] must be one of 'console', 'file'"),
        ("actor_rollout_ref.actor=3", "actor_rollout_ref.actor must be a mapping, got 3 (int)"),
    ],
)
def test_wrong_type_names_key_and_expected_type(override, message):
    assert message in _error(override)


def test_int_is_accepted_for_float():
    assert _load("actor_rollout_ref.actor.optim.lr=1").actor_rollout_ref.actor.optim.lr == 1.0


def test_mini_batch_larger_than_train_batch():
    assert _error("data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16") == (
        "actor_rollout_ref.actor.ppo_mini_batch_size (16) is larger than data.train_batch_size (8): "
        "a mini-batch is a slice of one step's prompts"
    )


def test_train_batch_not_a_multiple_of_mini_batch():
    message = _error("data.train_batch_size=12", "actor_rollout_ref.actor.ppo_mini_batch_size=8")
    assert (
        "data.train_batch_size (12) is not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size (8)"
        in message
    )
    assert "12 = 1 * 8 + 4" in message


def test_sequences_must_divide_across_workers():
    message = _error(
        "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=4",
        "trainer.n_workers=3",
        "trainer.backend=ray",
    )
    assert message == (
        "data.train_batch_size * actor_rollout_ref.rollout.n = 8 * 4 = 32 sequences do not "
        "divide evenly across trainer.n_workers (3)"
    )


def test_mini_batch_sequences_must_split_into_micro_batches():
    # 8 prompts * 4 responses = 32 sequences per mini-batch; 2 workers * 3 per micro-batch = 6 does not divide.
    message = _error(
        "actor_rollout_ref.rollout.n=4",
        "trainer.n_workers=2",
        "trainer.backend=ray",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
    )
    assert (
        "actor_rollout_ref.actor.ppo_mini_batch_size * actor_rollout_ref.rollout.n = 8 * 4 = 32 sequences "
        "per mini-batch is not divisible by actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu * "
        "trainer.n_workers = 3 * 2 = 6"
    ) in message
    assert (
        _load(
            "actor_rollout_ref.rollout.n=4",
            "trainer.n_workers=2",
            "trainer.backend=ray",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        ).trainer.n_workers
        == 2
    )


def test_critic_batch_checks_only_when_the_critic_is_on():
    assert (
        _load("algorithm.adv_estimator=grpo", "critic.ppo_micro_batch_size_per_gpu=3").critic.enable is False
    )
    message = _error("critic.ppo_micro_batch_size_per_gpu=3")  # gae, the default, trains a critic
    assert "critic.ppo_mini_batch_size * actor_rollout_ref.rollout.n = 8 * 1 = 8" in message
    assert "critic.ppo_micro_batch_size_per_gpu * trainer.n_workers = 3 * 1 = 3" in message
    assert "needs a value model" in _error("algorithm.adv_estimator=gae", "critic.enable=false")


def test_registry_names_are_checked():
    assert "algorithm.adv_estimator: unknown advantage estimator 'gpro'" in _error(
        "algorithm.adv_estimator=gpro"
    )
    assert "rloo" in _error("algorithm.adv_estimator=gpro")  # the known names are listed
    assert "actor_rollout_ref.actor.policy_loss.loss_mode: unknown policy loss 'clip'" in _error(
        "actor_rollout_ref.actor.policy_loss.loss_mode=clip"
    )
    assert _load("algorithm.adv_estimator=rloo").algorithm.adv_estimator == "rloo"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.gamma=1.5"], "algorithm.gamma must be in [0, 1], got 1.5"),
        (["actor_rollout_ref.rollout.top_p=0"], "actor_rollout_ref.rollout.top_p must be in (0, 1], got 0.0"),
        (["trainer.save_freq=0"], "trainer.save_freq must be -1 (never) or >= 1, got 0"),
        (
            ["actor_rollout_ref.actor.optim.betas=[0.9]"],
            "actor_rollout_ref.actor.optim.betas must be two numbers",
        ),
        (
            ["trainer.resume_mode=resume_path"],
            "trainer.resume_mode 'resume_path' needs trainer.resume_from_path",
        ),
        (["trainer.resume_from_path=/x"], "set trainer.resume_mode=resume_path"),
        (["reward_model.enable=true"], "reward_model.enable=true needs reward_model.model.path"),
        (["trainer.device=cuda"], "trainer.device is 'cuda' but torch.cuda.is_available() is false"),
        (
            ["replay_buffer.schedule=[{until_step: 5, strategy: a}, {until_step: 5, strategy: b}]"],
            "until_step values must strictly increase, got [5, 5]",
        ),
        (["replay_buffer.schedule=[{strategy: a}]"], "replay_buffer.schedule[0].until_step is required"),
    ],
)
def test_value_checks(overrides, message):
    assert message in _error(*overrides)


def test_train_files_are_required():
    with pytest.raises(ConfigError, match="data.train_files is required"):
        load_config([])


def test_user_yaml_merges_over_defaults(tmp_path):
    user = tmp_path / "mine.yaml"
    user.write_text(
        "data:\n  train_files: ~/prompts.parquet\n  train_batch_size: 4\n"
        "actor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 2\n    ppo_micro_batch_size_per_gpu: 2\n    optim:\n      lr: 3e-6\n"
        "algorithm:\n  adv_estimator: grpo\n"
        "trainer:\n  experiment_name: mine\n  logger: [console, tensorboard]\n"
    )
    cfg = load_config(["trainer.seed=7"], config_path=user)
    assert cfg.data.train_files == [os.path.expanduser("~/prompts.parquet")]
    assert cfg.actor_rollout_ref.actor.optim.lr == 3e-6
    assert cfg.actor_rollout_ref.actor.optim.weight_decay == 0.01  # untouched defaults stay
    assert cfg.data.max_prompt_length == 512
    assert cfg.trainer.default_local_dir == "runs/hybridflow/mine" and cfg.trainer.seed == 7

    user.write_text("trainer:\n  experiment_nam: typo\n")
    with pytest.raises(
        ConfigError,
        match=rf"unknown config key 'trainer.experiment_nam' in config file {user}; "
        r"did you mean 'trainer.experiment_name'\?",
    ):
        load_config([TRAIN], config_path=user)


def test_python_construction_resolve_and_round_trip():
    cfg = PPOConfig(
        data=DataConfig(train_files=["a.parquet"], train_batch_size=4),
        actor_rollout_ref=ActorRolloutRefConfig(
            actor=ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2)
        ),
        algorithm=AlgorithmConfig(adv_estimator="grpo"),
        trainer=TrainerConfig(experiment_name="py"),
    )
    cfg.validate()
    resolved = cfg.resolve()
    assert cfg.trainer.default_local_dir.startswith("runs/${")  # resolve() returns a copy
    assert resolved.trainer.default_local_dir == "runs/hybridflow/py"
    assert resolved.critic.ppo_mini_batch_size == 2 and resolved.data.seed == 42
    assert resolved.critic.enable is False and resolved.trainer.device == "cpu"
    assert resolved.resolve() == resolved
    assert PPOConfig.from_dict(resolved.to_dict()) == resolved
    partial = PPOConfig.from_dict({"data": {"train_files": "x.parquet"}, "algorithm": {"gamma": 0.99}})
    assert partial.data.train_files == ["x.parquet"] and partial.algorithm.gamma == 0.99
    assert partial.data.train_batch_size == 8
    with pytest.raises(ConfigError, match="did you mean 'algorithm.gamma'"):
        PPOConfig.from_dict({"algorithm": {"gama": 0.99}})
    assert PPOConfig.from_overrides([TRAIN, "algorithm.lam=0.9"]).algorithm.lam == 0.9


@pytest.mark.parametrize(
    "override",
    [
        "trainer.balance_batch=true",
        "reward_model.launch_reward_fn_async=true",
        "actor_rollout_ref.hybrid_engine=false",
    ],
)
def test_verl_keys_without_an_alternative_here_warn_when_changed(override):
    key = override.split("=")[0]
    with pytest.warns(IgnoredKeyWarning, match=rf"ignored on this backend: {re.escape(key)} = "):
        _load(override)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        # the cases a new user hit: a wrong guess (test_freq, val_only) or none at all
        (
            "trainer.output_dir=out",
            "did you mean 'trainer.default_local_dir'? ('output_dir' is another library's name",
        ),
        ("trainer.save_total_limit=2", "did you mean 'trainer.max_ckpt_to_keep'?"),
        ("trainer.exp_name=x", "did you mean 'trainer.experiment_name'?"),
        ("exp_name=x", "did you mean 'trainer.experiment_name'?"),
        ("trainer.learning_rate=1e-5", "did you mean 'actor_rollout_ref.actor.optim.lr'?"),
        ("critic.optim.learning_rate=1e-5", "did you mean 'critic.optim.lr'?"),  # the sibling, not the alias
        ("num_generations=4", "did you mean 'actor_rollout_ref.rollout.n'?"),
        ("trainer.max_steps=10", "did you mean 'trainer.total_training_steps'?"),
    ],
)
def test_names_from_other_libraries_map_to_the_hybridflow_key(override, expected):
    assert expected in _error(override)


@pytest.mark.parametrize(
    "override", ["trainer.checkpoint_dir=x", "trainer.foo_bar=1", "data.column=x", "lr=1e-5"]
)
def test_no_suggestion_rather_than_a_wrong_one(override):
    message = _error(override)
    assert (
        message.startswith(f"unknown config key '{override.split('=')[0]}'") and "did you mean" not in message
    )
    if override == "lr=1e-5":  # no guess, but where it lives
        assert message.endswith(
            "'lr' is a key of several sections: actor_rollout_ref.actor.optim.lr, critic.optim.lr"
        )


def test_ppo_config_takes_a_flat_convenience_form():
    cfg = PPOConfig(
        train_files="a.parquet",
        adv_estimator="grpo",
        n=4,
        temperature=0.7,
        **{"critic.optim.lr": 3e-5},
        trainer=TrainerConfig(experiment_name="flat"),
    )
    assert cfg.data.train_files == ["a.parquet"]  # typed like an override: a bare path becomes a list
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.actor_rollout_ref.rollout.temperature == 0.7  # rollout's, not val_kwargs'
    assert cfg.actor_rollout_ref.rollout.val_kwargs.temperature == 0.0
    assert cfg.critic.optim.lr == 3e-5 and cfg.trainer.experiment_name == "flat"
    assert PPOConfig(actor=ActorConfig(ppo_epochs=2)).actor_rollout_ref.actor.ppo_epochs == 2


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        (
            {"lr": 1e-5},
            "PPOConfig got lr=, which exists in actor_rollout_ref.actor.optim or critic.optim: pass it "
            "inside its section",
        ),
        (
            {"learning_rate": 1e-5},
            "'learning_rate' is another library's name; hybridflow's key is "
            "'actor_rollout_ref.actor.optim.lr'",
        ),
        ({"model": {}}, "PPOConfig got model=, which exists in actor_rollout_ref or critic or reward_model"),
        ({"n": "four"}, "actor_rollout_ref.rollout.n must be int, got 'four' (str)"),
        ({"temprature": 0.5}, "PPOConfig got an unknown keyword temprature=; did you mean temperature=?"),
    ],
)
def test_ppo_config_keyword_errors_say_where_it_belongs(keywords, message):
    with pytest.raises(ConfigError) as info:
        PPOConfig(**keywords)
    assert message in str(info.value)


def test_section_classes_are_importable_from_hybridflow():
    import hybridflow
    from hybridflow.config import DataConfig as FromConfig
    from hybridflow.config import OptimConfig

    assert hybridflow.DataConfig is FromConfig is DataConfig and hybridflow.OptimConfig is OptimConfig
    assert hybridflow.PPOConfig is PPOConfig


def test_n_workers_is_refused_on_the_local_backend():
    """It used to be ignored there while the batch checks divided by it."""
    assert _error("trainer.n_workers=2") == (
        "trainer.n_workers=2 needs trainer.backend=ray: the local backend "
        "runs one worker in this process; set trainer.backend=ray for "
        "data-parallel workers"
    )


def test_token_budget_keys_are_read_and_lift_the_micro_batch_divisibility_rule():
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredKeyWarning)  # implemented now, no longer ignored
        cfg = _load(
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
            "actor_rollout_ref.model.share_prompt_prefix=false",
        )
    actor = cfg.actor_rollout_ref.actor
    assert actor.use_dynamic_bsz and actor.ppo_max_token_len_per_gpu == 2048
    assert cfg.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz
    assert not cfg.actor_rollout_ref.model.share_prompt_prefix
    assert "ppo_micro_batch_size_per_gpu" in _error("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3")
    assert "must be >= 1" in _error("actor_rollout_ref.actor.ppo_max_token_len_per_gpu=0")


def test_the_sandbox_opt_out_moved_to_its_own_section_and_its_old_name_still_works(tmp_path):
    """The python tool and code-executing rewards share ``sandbox.unsafe_without_isolation``; the old key
    under the rollout's multi-turn section sets it, from an override or a file, with a warning naming it."""
    old = "actor_rollout_ref.rollout.multi_turn.unsafe_python_tool_without_isolation"
    assert _load().sandbox.unsafe_without_isolation is False
    assert _load("sandbox.unsafe_without_isolation=true").sandbox.unsafe_without_isolation is True
    with pytest.warns(
        DeprecatedKeyWarning,
        match=rf"{re.escape(old)} \(in override .*\) is deprecated: it moved to sandbox\.unsafe_without_isolation",
    ):
        cfg = _load(f"{old}=true")
    assert cfg.sandbox.unsafe_without_isolation is True
    assert (
        "unsafe_python_tool_without_isolation"
        not in cfg.to_dict()["actor_rollout_ref"]["rollout"]["multi_turn"]
    )
    (tmp_path / "old.yaml").write_text(
        "actor_rollout_ref:\n  rollout:\n    multi_turn:\n      enable: true\n      unsafe_python_tool_without_isolation: true\n"
    )
    with pytest.warns(DeprecatedKeyWarning, match=r"\(in config file .*old\.yaml\) is deprecated"):
        cfg = load_config([TRAIN], config_path=tmp_path / "old.yaml")
    assert cfg.sandbox.unsafe_without_isolation is True and cfg.actor_rollout_ref.rollout.multi_turn.enable
