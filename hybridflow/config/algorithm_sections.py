"""The PPO config's algorithm and run-shape sections (``algorithm``, the replay buffer, asynchronous training,
the sandbox): how advantages and the KL penalty are computed, which groups are kept, how rollouts overlap
training. Part of the schema (``schema.py`` assembles the root); the same ``#:`` docs generate the shipped YAML."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

_KLBase = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
#: a trailing "+" (k1+, k3+, ...) keeps the estimate's value with k2's gradient (verl's straight-through)
KLEstimator = Literal[_KLBase, "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"]


@dataclass
class KLControlConfig:
    """The KL coefficient of the in-reward penalty: fixed, or adapted towards ``target_kl``."""

    type: Literal["fixed", "adaptive"] = "fixed"  #: fixed | adaptive KL coefficient
    kl_coef: float = 0.001  #: (initial) KL coefficient
    horizon: int = 10000  #: adaptive controller horizon
    target_kl: float = 0.1  #: adaptive controller target


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (``hybridflow.trainer.dynamic_sampling``): groups whose samples all have the same
    ``metric`` (all right, all wrong: zero advantage) are dropped and more prompts are generated until
    data.train_batch_size groups are left (the surplus of the last generation batch is dropped)."""

    enable: bool = False  #: filter zero-variance groups and refill the batch
    #: what must vary within a group: seq_reward (the sample's summed score) | acc, score or any other key the
    #: reward function returns in its dict | seq_final_reward (the same as seq_reward: the filter runs before
    #: the in-reward KL penalty, so it is refused with algorithm.use_kl_in_reward)
    metric: str = "seq_reward"
    #: most generation batches per step; then the step trains on the groups it has (logged); 0 = no limit
    #: (verl's default, which can loop forever on data the model always or never solves)
    max_num_gen_batches: int = 10


@dataclass
class AlgorithmConfig:
    """Advantage estimation and the KL penalty in the reward."""

    gamma: float = 1.0  #: discount factor
    lam: float = 1.0  #: GAE lambda
    #: registered estimator: gae | grpo | rloo | reinforce_plus_plus | remax | ... (gae, as in verl)
    adv_estimator: str = "gae"
    norm_adv_by_std_in_grpo: bool = True  #: divide GRPO advantages by the group's std
    use_kl_in_reward: bool = False  #: subtract a KL-to-reference penalty from the reward
    kl_penalty: KLEstimator = "kl"  #: KL estimator for that penalty
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)  #: the in-reward KL coefficient
    #: DAPO's dynamic sampling: drop zero-variance groups, generate more prompts
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


@dataclass
class ReplayScheduleEntry:
    """Until ``until_step`` (exclusive), sample with ``strategy`` (and ``alpha``, if given)."""

    until_step: int  #: this phase covers the steps before it
    strategy: str  #: uniform | priority
    alpha: float | None = None  #: prioritization exponent; null = replay_buffer.alpha


@dataclass
class ReplayBufferConfig:
    """Past rollouts replayed in the actor update (hybridflow extension; ``hybridflow.trainer.replay``)."""

    enable: bool = False  #: keep every step's rollouts and add replayed ones to each actor update
    capacity: int = 1024  #: most sequences kept (the oldest leave first)
    sample_size: int = 0  #: sequences replayed per update; 0 = as many as a step generates
    #: uniform | priority (priority = mean |advantage|, refreshed after each replay)
    strategy: str = "uniform"
    alpha: float = 0.6  #: prioritization exponent (0 = uniform, 1 = proportional to the priority)
    beta: float = 0.4  #: importance-sampling correction exponent (weights scale replayed advantages)
    #: list of {until_step, strategy, alpha}: used before until_step; the keys above after the last
    schedule: list[ReplayScheduleEntry] | None = None


@dataclass
class AsyncTrainingConfig:
    """Rollout and training overlapping (``hybridflow.trainer.async_rollout``): generation runs ahead of the
    trainer on weights up to ``max_staleness`` updates old."""

    #: sync = generate, then train (lock-step); one_step_off = the rollout of step k+1 runs while step k
    #: trains, on the weights of step k-1 (deterministic); fully_async = the rollout runs up to max_staleness
    #: updates ahead, and with partial_rollout each update reaches the generations in flight
    mode: Literal["sync", "one_step_off", "fully_async"] = "sync"
    #: fully_async: most weight updates between the weights a token was sampled with and the weights that
    #: train on it (0 = lock-step, as sync)
    max_staleness: int = 1
    #: fully_async: a weight update reaches generations in flight (their KV cache is recomputed under the new
    #: weights); false = a batch is generated whole by one weight version
    partial_rollout: bool = True


@dataclass
class SandboxConfig:
    """The sandbox model-written code runs in (``hybridflow.tools.sandbox``): the python tool's, and any reward
    that executes code."""

    #: run code with limits only where this machine can create no sandbox (no root, no unprivileged user
    #: namespaces, no bubblewrap): the code then runs as your own user and can read your files and kill your
    #: processes; false = refuse to start with a line saying how to enable a sandbox
    unsafe_without_isolation: bool = False
