"""``PPOTrainer``: the driver. ``fit()`` reads like the algorithm, one screen per step.

The trainer only talks to worker groups (``generate_sequences``, ``compute_log_prob``,
``compute_ref_log_prob``, ``compute_values``, ``update_critic``, ``update_actor``), so the same loop runs on
a ``LocalWorkerGroup`` in this process and on a ``RayWorkerGroup`` across machines. Advantages are computed
here, on the driver, by any estimator registered in ``hybridflow.algorithms``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from hybridflow.algorithms import apply_kl_penalty, compute_advantage, get_kl_controller
from hybridflow.config.checks import ConfigError, required
from hybridflow.config.schema import PPOConfig
from hybridflow.data import PromptLoader, RLHFDataset
from hybridflow.data.images import thumbnail
from hybridflow.data.sft import SFTDataset
from hybridflow.models.vision import IMAGES
from hybridflow.protocol import DataProto
from hybridflow.rewards import CodeScorer, RewardManager, RuleScorers, load_custom_reward_function
from hybridflow.rollout import rollout_scores
from hybridflow.runs.tracking import Tracking
from hybridflow.tools import load_tools
from hybridflow.trainer.async_rollout import PromptStream, stale_tokens
from hybridflow.trainer.dynamic_sampling import GroupFilter
from hybridflow.trainer.loop import RunLoop, endless
from hybridflow.trainer.metrics import (
    StepTimings,
    compute_data_metrics,
    compute_throughput_metrics,
    reduce_metrics,
    timer,
    validation_metrics,
)
from hybridflow.trainer.replay import ActorReplay
from hybridflow.trainer.rollouts import Rollouts, build_rollouts
from hybridflow.trainer.shaping import (
    check_teacher_tokenizer,
    group_reward_metrics,
    teacher_log_probs,
    with_distillation_reward,
    with_overlong_penalty,
    without_truncated,
)
from hybridflow.trainer.two_stage_reward import TwoStageRewardFn
from hybridflow.trainer.weight_transport import weight_transport
from hybridflow.trainer.worker_groups import WorkerGroups, build_worker_groups
from hybridflow.workers.modeling import load_image_prompts, load_tokenizer

logger = logging.getLogger(__name__)


class PPOTrainer(RunLoop):
    """PPO-family training (GRPO, RLOO, REINFORCE++, ReMax, PPO with a critic...) from one config.

    Everything is built from ``config`` unless given: ``worker_groups`` (e.g. your own Ray groups),
    ``reward_fn`` (``DataProto -> {"reward_tensor", "reward_extra_info"}``, like ``RewardManager``). The run
    around the steps (lock, tracker, resume, cadence, hooks) is ``RunLoop``'s."""

    def __init__(
        self,
        config: PPOConfig,
        *,
        worker_groups: WorkerGroups | None = None,
        reward_fn: Callable[..., Any] | None = None,
        val_reward_fn: Callable[..., Any] | None = None,
    ) -> None:
        self.config = config = config.validate()  # resolved and checked
        super().__init__(config.trainer, config.to_dict(), worker_groups)
        model = config.actor_rollout_ref.model
        model_path = required(model.path, "actor_rollout_ref.model.path")
        self.tokenizer = load_tokenizer(model_path, model.trust_remote_code)
        # a vision-language model's image processing (None for a text model): the datasets read images with it
        self.processor = load_image_prompts(model_path, self.tokenizer, model.trust_remote_code)
        teacher = config.actor_rollout_ref.teacher
        if teacher.path:  # refused before any worker loads a model
            check_teacher_tokenizer(self.tokenizer, teacher.path, teacher.trust_remote_code)
        data = config.data
        self.train_loader = PromptLoader(  # dynamic sampling draws data.gen_batch_size prompts at a time
            self._dataset(required(data.train_files, "data.train_files")),
            data.gen_batch_size or data.train_batch_size,
            shuffle=data.shuffle,
            seed=required(data.seed, "data.seed"),
        )
        self.val_dataset = self._dataset(data.val_files) if data.val_files else None
        self.sft_loader = self._sft_loader(data) if data.sft.files else None
        steps = len(self.train_loader) * config.trainer.total_epochs
        self.total_steps = config.trainer.total_training_steps or steps
        for optim in (config.actor_rollout_ref.actor.optim, config.critic.optim):
            optim.total_training_steps = self.total_steps
        if config.custom_reward_function.path:
            score_fn = load_custom_reward_function(
                config.custom_reward_function.path, config.custom_reward_function.name
            )
        else:
            score_fn = self._rule_scorers()
        self.reward_fn: Callable[..., Any] = reward_fn or RewardManager(self.tokenizer, score_fn)
        self.val_reward_fn = val_reward_fn or self.reward_fn
        if (
            config.reward_model.two_stage.enable
        ):  # the scorer above ranks; the reward model re-scores the best
            self.reward_fn = TwoStageRewardFn.from_config(
                config.reward_model.two_stage,
                cheap=self.reward_fn,
                expensive=self._reward_model_scores,
            )
        self.replay = (
            ActorReplay.from_config(config, self.tokenizer.pad_token_id)
            if config.replay_buffer.enable
            else None
        )
        alg = config.algorithm
        self.kl_ctrl = get_kl_controller(
            alg.kl_ctrl.type, alg.kl_ctrl.kl_coef, alg.kl_ctrl.target_kl, alg.kl_ctrl.horizon
        )
        self._sft_batches = endless(self.sft_loader) if self.sft_loader else None
        # where the samples come from (async_training.mode): init_workers builds it; batches() the stream
        self._rollouts: Rollouts | None = None
        self.stream: PromptStream | None = None

    def _reward_model_scores(self, data: DataProto) -> torch.Tensor:
        """The reward model's ``rm_scores`` of ``data`` (a two-stage reward's expensive scorer)."""
        group = self.groups.reward_model
        if group is None:  # validate() refuses a two-stage reward without one
            raise ConfigError("reward_model.two_stage.enable needs reward_model.enable=true")
        scores: torch.Tensor = group.compute_rm_score(data).tensors["rm_scores"]
        return scores

    def _rule_scorers(self) -> RuleScorers:
        """The built-in scorers with ``reward_model.code``'s settings; every code row of the data is read and
        the sandbox checked now, so a malformed test or a machine without one fails before training."""
        unsafe = self.config.sandbox.unsafe_without_isolation
        rules = RuleScorers(CodeScorer(self.config.reward_model.code, allow_unsafe=unsafe))
        datasets = [self.train_loader.dataset] + ([self.val_dataset] if self.val_dataset else [])
        rules.check_rows(
            (f"{row.file}: row {row.row}", row.data_source, row.ground_truth)
            for d in datasets
            for row in d.rows
        )
        return rules

    def _dataset(self, files: list[str]) -> RLHFDataset:
        d, multi_turn = self.config.data, self.config.actor_rollout_ref.rollout.multi_turn
        # templates that know tools (Qwen2.5's) describe them in the prompt; others ignore the argument
        kwargs = {}
        if multi_turn.enable and multi_turn.tool_config_path:
            tools = load_tools(multi_turn.tool_config_path, self.config.sandbox.unsafe_without_isolation)
            kwargs["tools"] = [tool.schema for tool in tools.values()]
        return RLHFDataset(
            files,
            self.tokenizer,
            max_prompt_length=d.max_prompt_length,
            prompt_key=d.prompt_key,
            truncation=d.truncation,
            filter_overlong_prompts=d.filter_overlong_prompts,
            apply_chat_template=d.apply_chat_template,
            chat_template_kwargs=kwargs,
            processor=self.processor,
            image_key=d.image_key,
        )

    def _sft_loader(self, data: Any) -> PromptLoader[SFTDataset]:
        sft = SFTDataset(
            data.sft.files,
            self.tokenizer,
            max_prompt_length=data.max_prompt_length,
            max_response_length=data.max_response_length,
            prompt_key=data.sft.prompt_key,
            response_key=data.sft.response_key,
            apply_chat_template=data.apply_chat_template,
        )
        return PromptLoader(sft, data.sft.batch_size, shuffle=True, seed=data.seed)

    # ------------------------------------------------------------------ workers
    def init_workers(self) -> None:
        if self.wg is None:  # a two-stage reward calls the reward model from the driver, so it stays here
            two_stage = self.config.reward_model.two_stage.enable
            self.wg = build_worker_groups(
                self.config,
                reward_fn=None if two_stage else self.reward_fn,
                overlapping=self.config.async_training.mode != "sync",
            )
        own = (
            self.groups.rollout
        )  # a rollout worker of its own: sent the weights directly by the actor on Ray
        actor = self.groups.actor_rollout
        weights = None if own is None else weight_transport(self.config.trainer.backend, actor, own)
        alg, refill = self.config.algorithm, None
        if alg.filter_groups.enable:  # dynamic sampling: whoever generates scores and refills the batch
            size = self.config.data.train_batch_size
            refill = GroupFilter(alg.filter_groups, size, self.tokenizer.pad_token_id, self.compute_reward)
        self._rollouts = build_rollouts(self.config, self.groups.generator, weights, refill)

    @property
    def rollouts(self) -> Rollouts:
        """Where the samples come from (``async_training.mode``); a RuntimeError before ``init_workers()``."""
        if self._rollouts is None:
            raise RuntimeError("PPOTrainer has no rollouts yet: call init_workers() first")
        return self._rollouts

    def sync_rollout_weights(self, version: int) -> dict[str, float]:
        """Send the actor's weights (``version``: the steps they have trained) to a rollout worker of its own
        (``trainer.placement=split``, or an asynchronous run): on Ray from the actor's rank 0 to the rollout
        workers over a process group of their own, never through the driver; a rollout in the actor's process
        syncs itself inside ``update_actor``. Returns what the sync cost (``weight_sync/*``)."""
        return self.rollouts.post_weights(version)

    def close(self) -> None:
        if self._rollouts is not None:
            self._rollouts.stop()
        super().close()

    # ------------------------------------------------------------------ where the samples come from
    def start_rollouts(self) -> None:
        """Open the stream of training prompts at ``global_step`` and start where the samples come from (an
        asynchronous run's producer begins generating ahead): ``_train`` calls it once, and stops it after."""
        self.stream = stream = PromptStream(self.train_loader, self.global_step)
        self.rollouts.start(stream, self.global_step, self.total_steps)

    def batches(self) -> Iterator[DataProto]:
        """The prompts of each step, from the stream ``start_rollouts`` opened (taking one starts nothing)."""
        stream = self.stream
        if stream is None:
            raise RuntimeError("PPOTrainer.batches() needs start_rollouts() first (fit() calls it)")
        return iter(lambda: stream.take(self.global_step), None)

    def data_position(self) -> dict[str, Any]:
        """The loader's position after the last *trained* batch (the producer may have drawn further)."""
        return self.stream.trained_state if self.stream else self.train_loader.state_dict()

    def _train(self, tracker: Tracking) -> dict[str, float]:
        self.start_rollouts()
        try:
            return super()._train(tracker)
        finally:  # an asynchronous run's producer stops with the run, also when a step raises
            self.rollouts.stop()

    # ------------------------------------------------------------------ one step, stage by stage
    def compute_reward(self, batch: DataProto, metrics: dict[str, float] | None = None) -> DataProto:
        """``token_level_scores``: the rollout's own when it scored its samples (a served agent's return values),
        else the reward model's (or judge's) when there is one, plus ``reward_model.rule_weight`` x the
        rule/custom scorer's, else the rule/custom scorer's (with ``reward_model.two_stage``, the reward
        model's only on each group's best rows). The ``metrics`` a ``reward_fn`` or the judge returns (e.g.
        ``reward/stage2_calls``, ``reward/judge/failures``) go into ``metrics``."""
        rm, metrics = self.config.reward_model, {} if metrics is None else metrics
        own = rollout_scores(batch)
        extra: dict[str, Any] = {}  # the scorer's extra columns (a rollout's own are the batch's already)
        if own is not None:
            scores = own["reward_tensor"]
        elif self.groups.reward_model is not None and not rm.two_stage.enable:
            scored = self.groups.reward_model.compute_rm_score(batch)
            metrics.update(reduce_metrics(scored.meta_info.pop("metrics", {})))
            batch = batch.union(scored)
            scores = rm.model_weight * batch.tensors["rm_scores"]
            if rm.rule_weight:
                result = self._rule_reward(batch, metrics)
                scores = scores + rm.rule_weight * result["reward_tensor"]
                extra = result.get("reward_extra_info", {})
        else:
            result = self._rule_reward(batch, metrics)
            scores, extra = result["reward_tensor"], result.get("reward_extra_info", {})
        if rm.overlong_buffer.enable:  # DAPO's shaping, whichever scorer scored
            scores, shaped = with_overlong_penalty(
                scores,
                batch.tensors["response_mask"],
                self.config.data.max_response_length,
                rm.overlong_buffer,
            )
            metrics.update(shaped)
        batch.tensors["token_level_scores"] = scores
        return batch.union(
            DataProto.from_dict(non_tensors={f"reward_extra/{k}": v for k, v in extra.items()})
        )

    def _rule_reward(self, batch: DataProto, metrics: dict[str, float]) -> dict[str, Any]:
        """The rule/custom scorer's result, from the reward worker when there is one, else here."""
        worker = self.groups.reward
        result: dict[str, Any] = (
            worker.compute_reward(batch) if worker else self.reward_fn(batch, return_dict=True)
        )
        metrics.update(result.get("metrics", {}))
        return result

    def _needs_old_log_prob(self) -> bool:
        """A separate old-policy pass is only needed when the policy changes before the data is used up
        (replayed rows are used up steps later)."""
        actor, d = self.config.actor_rollout_ref.actor, self.config.data
        teacher = self.config.actor_rollout_ref.teacher
        return (
            actor.ppo_epochs > 1
            or actor.ppo_mini_batch_size < d.train_batch_size
            or self.config.algorithm.use_kl_in_reward
            or self.replay is not None
            or (teacher.path is not None and teacher.signal == "reward")  # the student's log-probs
        )

    def train_step(
        self, batch: DataProto, metrics: dict[str, float], timings: StepTimings | None = None
    ) -> DataProto:
        """One PPO iteration on a batch of prompts; returns the batch with everything computed.
        ``timings`` receives each stage's seconds and wall-clock span (the run report's timeline)."""
        cfg, wg, t = self.config, self.groups, StepTimings() if timings is None else timings
        critic = wg.critic
        use_critic = critic is not None
        with timer("step", t):
            with timer("gen", t):  # sync: generated now; async: the oldest batch the producer finished
                batch.meta_info["n"] = cfg.actor_rollout_ref.rollout.n
                batch = self.rollouts.take(self.global_step, batch, metrics, t)
                metrics.update(
                    reduce_metrics(batch.meta_info.pop("metrics", {}))
                )  # agent/* of multi-turn rollouts
            self.hooks.emit("after_generate", self, self.global_step, metrics, batch)
            with timer("reward", t):
                if "token_level_scores" not in batch.tensors.keys():  # dynamic sampling scored it already
                    batch = self.compute_reward(batch, metrics)
            self.hooks.emit("after_reward", self, self.global_step, metrics, batch)
            if stale_tokens(batch, self.global_step).any():  # PPO's old policy is the one that sampled
                batch.tensors["old_log_probs"] = batch.tensors["rollout_log_probs"]
            elif self._needs_old_log_prob():
                with timer("old_log_prob", t):
                    batch = self._union_with_metrics(batch, wg.actor_rollout.compute_log_prob(batch), metrics)
            if wg.ref is not None:
                with timer("ref", t):
                    batch = batch.union(wg.ref.compute_ref_log_prob(batch))
            if wg.teacher is not None:
                with timer("teacher", t):
                    batch = batch.union(teacher_log_probs(wg.teacher, batch))
            if critic is not None:
                with timer("values", t):
                    batch = batch.union(critic.compute_values(batch))
            with timer("adv", t):
                batch = self._advantages(batch, metrics)
            self.hooks.emit("after_advantage", self, self.global_step, metrics, batch)
            if critic is not None:
                with timer("update_critic", t):
                    metrics.update(reduce_metrics(critic.update_critic(batch).meta_info["metrics"]))
            if self.global_step >= cfg.trainer.critic_warmup:
                with timer("update_actor", t):
                    self._update_actor(batch, metrics)
                if self.replay:
                    with timer("replay_priorities", t):
                        self.replay.update_priorities(wg.actor_rollout, metrics)
            if wg.rollout is not None:
                with timer("sync_weights", t):
                    metrics.update(self.sync_rollout_weights(self.global_step + 1))
        metrics.update(compute_data_metrics(batch, use_critic))
        metrics.update(group_reward_metrics(batch))
        metrics.update({f"timing_s/{k}": v for k, v in t.items()})
        metrics.update(compute_throughput_metrics(batch, t, wg.actor_rollout.world_size))
        return batch

    def _advantages(self, batch: DataProto, metrics: dict[str, float]) -> DataProto:
        """Token rewards (the scores, less the in-reward KL penalty; plus the teacher's signal as a reward),
        then the configured estimator's advantages."""
        cfg = self.config
        if cfg.algorithm.use_kl_in_reward:
            batch, kl_metrics = apply_kl_penalty(batch, self.kl_ctrl, cfg.algorithm.kl_penalty)
            metrics.update(kl_metrics)
        else:
            batch.tensors["token_level_rewards"] = batch.tensors["token_level_scores"]
        teacher = cfg.actor_rollout_ref.teacher
        if self.groups.teacher is not None and teacher.signal == "reward":
            metrics.update(with_distillation_reward(batch, teacher))
        return compute_advantage(
            batch,
            cfg.algorithm.adv_estimator,
            gamma=cfg.algorithm.gamma,
            lam=cfg.algorithm.lam,
            norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
            config=cfg.algorithm,  # what an estimator written for verl reads as its config
        )

    def _update_actor(self, batch: DataProto, metrics: dict[str, float]) -> None:
        """The policy update on this step's rows (with replayed ones, without truncated ones where the config
        says so) and the next supervised batch of a mixed run."""
        cfg = self.config
        sft = self._next_sft_batch()
        rows = self.replay.mix(batch, self.global_step, metrics) if self.replay else batch
        if cfg.actor_rollout_ref.actor.mask_truncated_samples:
            rows, masked = without_truncated(
                rows, cfg.data.max_response_length, [self.tokenizer.eos_token_id]
            )
            metrics.update(masked)
        out = self.groups.actor_rollout.update_actor(rows, sft)
        metrics.update(reduce_metrics(out.meta_info["metrics"]))

    def _union_with_metrics(self, batch: DataProto, out: DataProto, metrics: dict[str, float]) -> DataProto:
        metrics.update(reduce_metrics(out.meta_info.pop("metrics", {})))
        return batch.union(out)

    def _next_sft_batch(self) -> DataProto | None:
        sft = self.config.data.sft
        if self._sft_batches is None or self.global_step % sft.every_n_steps:
            return None
        batch = next(self._sft_batches)
        batch.meta_info["loss_coef"] = sft.loss_coef
        return batch

    # ------------------------------------------------------------------ validation
    @property
    def has_validation(self) -> bool:
        return self.val_dataset is not None

    def validate(self, tracker: Tracking | None = None) -> dict[str, float]:
        """Generate on the validation set with ``rollout.val_kwargs``; ``val/<source>/...`` metrics.
        The ``trainer.log_val_generations`` samples shown also go to ``tracker`` (``val_generations.jsonl``)."""
        if self.val_dataset is None:
            return {}
        kw = self.config.actor_rollout_ref.rollout.val_kwargs
        size = self.config.data.val_batch_size or len(self.val_dataset)
        rows, agent, verdicts = [], [], []
        for batch in PromptLoader(self.val_dataset, size, shuffle=False, drop_last=False):
            batch.meta_info.update(
                n=kw.n, temperature=kw.temperature, top_p=kw.top_p, top_k=kw.top_k, do_sample=kw.do_sample
            )
            out = self.rollouts.generate_now(batch, self.global_step)
            agent.append(reduce_metrics(out.meta_info.pop("metrics", {})))
            result = rollout_scores(out) or self.val_reward_fn(out, return_dict=True)
            verdicts.append(self._judge_validation(out, result))
            rows.append((out, result))
        metrics = validation_metrics(rows, kw.n)
        metrics.update({f"val/{k}": reduce_metrics({k: [m[k] for m in agent]})[k] for k in agent[0]})
        samples = self._show_generations(
            rows[0][0], rows[0][1]["reward_tensor"], self.config.trainer.log_val_generations, verdicts[0]
        )
        if tracker is not None and samples:
            tracker.log_records("val_generations", samples, step=self.global_step)
        return metrics

    def _judge_validation(self, out: DataProto, result: dict[str, Any]) -> list[str] | None:
        """With a judge (``reward_model.style=generative``) validation asks it too: its scores become the
        ``judge`` extra (``val/<source>/judge/mean@n``) and its raw verdicts go with the logged samples."""
        if self.groups.reward_model is None or self.config.reward_model.style != "generative":
            return None
        judged = self.groups.reward_model.compute_rm_score(out)
        result.setdefault("reward_extra_info", {})["judge"] = judged.batch["rm_scores"].sum(-1).tolist()
        return list(judged.non_tensor_batch["judge_verdict"])

    def _show_generations(
        self, batch: DataProto, rewards: torch.Tensor, count: int, verdicts: list[str] | None = None
    ) -> list[dict[str, Any]]:
        """Print the first ``count`` validation samples (question, answer, score): a look at what the
        numbers mean (``trainer.log_val_generations``). Returns them as ``{"index", "prompt", "response",
        "score"}`` records, with ``images`` (thumbnails as ``data:`` URLs, for the report) when the prompt has
        some, and the judge's raw ``verdict`` when a judge scored them."""
        samples = []
        for i in range(min(count, len(batch))):
            question = batch.non_tensor_batch["raw_prompt"][i][-1]["content"]
            length = int(batch.tensors["response_mask"][i].sum())
            answer = self.tokenizer.decode(batch.tensors["responses"][i, :length], skip_special_tokens=True)
            score = rewards[i].sum().item()
            judged = f" | judge: {verdicts[i]!r}" if verdicts else ""
            tqdm.write(
                f"[val step {self.global_step}] score {score:.3g} | {question!r} -> {answer!r}{judged}"
            )
            sample = {"index": i, "prompt": question, "response": answer, "score": score}
            if IMAGES in batch.non_tensor_batch and len(batch.non_tensor_batch[IMAGES][i]):
                sample["images"] = [thumbnail(image) for image in batch.non_tensor_batch[IMAGES][i]]
            if verdicts:
                sample["verdict"] = verdicts[i]
            samples.append(sample)
        return samples

    # ------------------------------------------------------------------ checkpoints
    def save_state(self, folder: Path) -> dict[str, Any]:
        self.groups.actor_rollout.save_checkpoint(str(folder / "actor"))
        if self.groups.critic is not None:
            self.groups.critic.save_checkpoint(str(folder / "critic"))
        return {
            "sft_loader": self.sft_loader.state_dict() if self.sft_loader else None,
            "kl_coef": self.kl_ctrl.value,
            "replay": self.replay.state_dict() if self.replay else None,
        }

    def load_state(self, folder: Path, state: dict[str, Any]) -> None:
        self.groups.actor_rollout.load_checkpoint(str(folder / "actor"))
        if self.groups.rollout is not None:
            self.sync_rollout_weights(state["global_step"])
        if self.groups.critic is not None:
            self.groups.critic.load_checkpoint(str(folder / "critic"))
        if self.sft_loader and state["sft_loader"]:
            self.sft_loader.load_state_dict(state["sft_loader"])
        self._restore_kl_coef(state["kl_coef"])
        if self.replay and state.get("replay"):
            self.replay.load_state_dict(state["replay"])

    def step_metrics(self) -> dict[str, float]:
        return {"training/kl_coef": self.kl_ctrl.value}

    def _restore_kl_coef(self, saved: float) -> None:
        """An adaptive coefficient is state and comes back; a fixed one is a setting, and a changed
        ``algorithm.kl_ctrl.kl_coef`` applies from the resumed step on (logged), as optimiser settings do."""
        kl = self.config.algorithm.kl_ctrl
        if kl.type == "fixed" and saved != kl.kl_coef:
            logger.warning(
                "resuming with algorithm.kl_ctrl.kl_coef %s instead of the checkpoint's %s: applied "
                "from this step on",
                kl.kl_coef,
                saved,
            )
        else:
            self.kl_ctrl.value = saved
