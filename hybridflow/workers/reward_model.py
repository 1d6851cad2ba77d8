"""``RewardModelWorker``: a sequence-classification reward model that scores responses, and that trains.

Scoring (PPO's ``reward_model``): the reward model may use another tokenizer and chat template than the policy,
so the worker decodes the policy's response text and re-renders the conversation (the raw prompt messages plus
the response as the assistant turn) with its own template. A classifier without a chat template (a safety
classifier, a DeBERTa reward model) reads the plain text instead: the prompt's message contents, a newline,
the response (``input_format``). ``dummy=True`` loads nothing and scores each response by its length and its
share of distinct tokens: a stand-in whose rewards move with the responses, so a pipeline test sees them
change before a real reward model exists.

A judge (``style=generative``, ``rewards.judge``): the worker renders ``judge.prompt_template`` for each sample
and asks either the causal LM at ``model.path`` (greedy, in micro-batches; ``yes_probability`` from one forward)
or the endpoint at ``judge.base_url`` (nothing is loaded then); ``rm_scores`` get the parsed scores, the
result's ``judge_verdict`` column the raw replies, and its metrics ``reward/judge/failures``.

Training (``hybridflow rm``, ``train``: an ``RMConfig``): any causal LM with a fresh one-output score head,
trained on preference pairs with the Bradley-Terry loss (``algorithms.preference``), through the same
``TrainingEngine`` as the actor and the critic: full weights or LoRA adapters (the head always trains), DDP or
FSDP2, micro-batches of whole pairs (or of a token budget). What it reads is built by the one function
``data.offline.reward_model_tokens`` in training and in scoring, so the checkpoint's ``huggingface/`` folder
scores in PPO exactly what it was trained on; the scalar is transformers' own (the head at the last token
that is not padding), so the folder is an ``AutoModelForSequenceClassification`` that needs nothing else.
"""

from __future__ import annotations

from functools import partial
from typing import Any, TypeVar

import torch
from transformers import AutoModelForSequenceClassification, GenerationMixin, PreTrainedModel

from hybridflow.algorithms import get_offline_objective, sequence_to_token_scores
from hybridflow.config import RewardModelConfig
from hybridflow.config.checks import required
from hybridflow.config.offline import RMConfig
from hybridflow.data.offline import Sample, collate_samples, reward_model_tokens
from hybridflow.protocol import DataProto
from hybridflow.rewards.judge import EndpointJudge, Verdict, last_user_message, parse_verdict, render
from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.workers.checkpointing import load_worker_state, save_worker_state
from hybridflow.workers.engine import TrainingEngine
from hybridflow.workers.modeling import load_model, load_tokenizer
from hybridflow.workers.packing import PairBatching
from hybridflow.workers.row_layouts import trimmed
from hybridflow.workers.sharding import (
    agreed_count,
    apply_lora,
    as_hf_model,
    load_placement,
    reads_weights,
    resolve_strategy,
    shard_module,
    unwrapped,
)

T = TypeVar("T")
HEADS = ("score", "classifier")  # what transformers calls a sequence classifier's output layer


def dummy_scores(data: DataProto) -> torch.Tensor:
    """``(bs,)`` in [0, 1]: half for the response's length (its share of the response width), half for the
    share of distinct tokens in it. Deterministic, and 1.0 only for a full-width response of distinct
    tokens, so a smoke run's reward moves with what the policy writes instead of saturating at once."""
    mask, responses = data.tensors["response_mask"], data.tensors["responses"]
    lengths = mask.sum(-1)
    distinct = torch.tensor([len(set(row[:n].tolist())) for row, n in zip(responses, lengths.tolist())])
    return 0.5 * lengths.float() / mask.shape[-1] + 0.5 * distinct.float() / lengths.clamp(min=1).float()


def sequence_rewards(model: torch.nn.Module, data: DataProto) -> torch.Tensor:
    """``(bs,)``: the reward model's scalar for each sequence of ``data`` (laid out like rollouts; the
    position ids keep a left-padded row's positions right), read where transformers reads it."""
    data = trimmed(data)
    device = next(model.parameters()).device
    inputs = {k: data.tensors[k].to(device) for k in ("input_ids", "attention_mask", "position_ids")}
    return model(**inputs, use_cache=False).logits[:, 0].float()


def _first_tokens(tokenizer: Any, word: str) -> list[int]:
    """The first token of ``word`` as a reply would begin with it, in its usual spellings (yes, Yes, YES)."""
    spellings = dict.fromkeys((word, word.capitalize(), word.upper(), word.lower()))
    return sorted({tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in spellings})


def _body_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """LoRA's targets without the head: ``["all-linear"]`` means every linear layer of the body here (peft's
    own ``all-linear`` spares only a causal LM's output layer, and would put adapters on the score head)."""
    if list(targets) != ["all-linear"]:
        return list(targets)
    linear = (n for n, part in model.named_modules() if isinstance(part, torch.nn.Linear))
    return sorted({name.split(".")[-1] for name in linear if name.split(".")[0] not in HEADS})


class RewardModelWorker(Worker):
    """``config``: the ``reward_model`` section; ``policy_tokenizer_path``: to decode the policy's tokens;
    ``train``: an ``RMConfig`` to train a reward model from ``train.model.partial_pretrain`` instead."""

    def __init__(
        self,
        config: RewardModelConfig,
        policy_tokenizer_path: str | None = None,
        device: str = "auto",
        train: RMConfig | None = None,
        seed: int = 42,
    ) -> None:
        super().__init__(device)
        self.config, self.policy_tokenizer_path = config, policy_tokenizer_path
        self.train, self.seed = train, seed
        self.model: PreTrainedModel | None = None  # the scoring, judging or trained model (none: dummy)
        self._engine: TrainingEngine | None = None
        self.endpoint: EndpointJudge | None = None

    @property
    def loaded(self) -> PreTrainedModel:
        """``model``, where one must be loaded."""
        return _built(self.model, "model (init_model loads one; reward_model.dummy has none)")

    @property
    def engine(self) -> TrainingEngine:
        return _built(self._engine, "training engine (it is built with train=RMConfig)")

    @property
    def trained(self) -> RMConfig:
        """The reward-model training settings (``train``)."""
        return _built(self.train, "training settings (train=RMConfig)")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        if self.train is not None:
            self._init_training(self.train)
            return
        self.policy_tokenizer = load_tokenizer(
            required(self.policy_tokenizer_path, "actor_rollout_ref.model.path")
        )
        if self.config.dummy:
            return
        if self.config.style == "generative":
            self._init_judge()
            return
        path = required(self.config.model.path, "reward_model.model.path")
        self.tokenizer = load_tokenizer(self.config.model.input_tokenizer or path)
        self.model = model = load_model(
            path, self.device, "auto", auto_cls=AutoModelForSequenceClassification, num_labels=1
        ).eval()
        model.config.pad_token_id = self.tokenizer.pad_token_id
        has_template = bool(self.tokenizer.chat_template)
        self.chat = self.config.input_format == "chat" or (
            self.config.input_format == "auto" and has_template
        )
        if self.chat and not has_template:
            raise ValueError(
                f"reward_model.input_format=chat, but the tokenizer of {path} has no chat template; "
                "set reward_model.input_format=plain (or auto) to score the plain prompt + response text"
            )

    def _init_training(self, train: RMConfig) -> None:
        """The starting model with a fresh score head (the same on every rank), LoRA, FSDP2, the engine."""
        torch.manual_seed(self.seed)
        self.init_process_group()
        m = train.model
        self.tokenizer = load_tokenizer(m.partial_pretrain, m.trust_remote_code)
        strategy = resolve_strategy(m.strategy, self.world_size, "model.strategy")
        module = load_model(
            m.partial_pretrain,
            *load_placement(strategy, m.dtype, self.device),
            auto_cls=AutoModelForSequenceClassification,
            num_labels=1,
            trust_remote_code=m.trust_remote_code,
            new_head="the reward model's score head",
            disable_dropout=m.disable_dropout,
            gradient_checkpointing=m.enable_gradient_checkpointing,
            on_meta=not reads_weights(strategy, m.lora_rank),
        )
        module.config.pad_token_id = self.tokenizer.pad_token_id
        trained: torch.nn.Module = module
        if m.lora_rank > 0:  # adapters on the body; the fresh head trains in full, or nothing could learn
            trained = apply_lora(
                module, m.lora_rank, m.lora_alpha, _body_targets(module, m.target_modules), None
            )
            for name, parameter in unwrapped(trained).named_parameters():
                if name.split(".")[0] in HEADS:
                    parameter.requires_grad_(True)
        sharded = shard_module(trained, m.fsdp_config, self.device) if strategy == "fsdp2" else trained
        self.model = as_hf_model(sharded)
        self._engine = TrainingEngine(
            self.loaded,
            train.optim,
            train.optim.clip_grad,
            "rm",
            self.world_size,
            m.fsdp_config.optimizer_offload,
        )

    # ---------------------------------------------------------------- a judge
    def _init_judge(self) -> None:
        """An endpoint client, or the causal LM at ``model.path`` with the token ids ``yes_probability`` reads."""
        judge = self.config.judge
        if judge.base_url:
            self.endpoint = EndpointJudge(judge)
            return
        path = required(self.config.model.path, "reward_model.model.path")
        self.tokenizer = load_tokenizer(self.config.model.input_tokenizer or path)
        self.model = load_model(path, self.device, "auto").eval()
        self.answer_ids = [
            _first_tokens(self.tokenizer, words[0]) for words in (judge.yes_words, judge.no_words)
        ]

    def _judge_prompts(self, data: DataProto) -> list[str]:
        prompts = []
        for i in range(len(data)):
            n_tokens = int(data.tensors["response_mask"][i].sum())
            response = str(  # one row of ids decodes to one string
                self.policy_tokenizer.decode(
                    data.tensors["responses"][i, :n_tokens], skip_special_tokens=True
                )
            )
            question = last_user_message(data.non_tensor_batch["raw_prompt"][i])
            truth = (
                data.non_tensor_batch["ground_truth"][i] if "ground_truth" in data.non_tensor_batch else None
            )
            prompts.append(render(self.config.judge.prompt_template, question, response, truth))
        return prompts

    def _local_judge(self, prompts: list[str]) -> list[Verdict]:
        """The worker's causal LM on each prompt (its chat template, a generation prompt): greedy replies
        parsed, or the yes token's probability against the no token's from the next-token distribution."""
        judge, verdicts = self.config.judge, []
        for start in range(0, len(prompts), judge.micro_batch_size_per_gpu):
            chunk = [
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
                )
                for p in prompts[start : start + judge.micro_batch_size_per_gpu]
            ]
            inputs = self.tokenizer(
                chunk, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
            ).to(self.device)
            if judge.parser == "yes_probability":
                positions = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
                probs = self.loaded(**inputs, position_ids=positions).logits[:, -1].float().softmax(-1)
                yes, no = (probs[:, ids].sum(-1) for ids in self.answer_ids)
                verdicts += [
                    Verdict(float(p), f"p(yes)={float(p):.4f}") for p in yes / (yes + no).clamp(min=1e-12)
                ]
                continue
            model = self.loaded
            if not isinstance(model, GenerationMixin):
                raise TypeError(f"a judge model generates; {type(model).__name__} cannot")
            out = model.generate(
                **inputs,
                max_new_tokens=judge.max_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
            )
            for text in self.tokenizer.batch_decode(
                out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True
            ):
                score = parse_verdict(text, judge)
                verdicts.append(
                    Verdict(judge.failure_score, text, True) if score is None else Verdict(score, text)
                )
        return verdicts

    def _judged(self, data: DataProto) -> DataProto:
        prompts = self._judge_prompts(data)
        verdicts = self.endpoint.judge(prompts) if self.endpoint is not None else self._local_judge(prompts)
        scores = torch.tensor([v.score for v in verdicts], dtype=torch.float32)
        failures = float(sum(v.failed for v in verdicts))
        return DataProto.from_dict(
            {"rm_scores": sequence_to_token_scores(scores, data.tensors["response_mask"])},
            non_tensors={"judge_verdict": [v.text for v in verdicts]},
            meta_info={
                "metrics": {
                    "reward/judge/failures": [failures],
                    "reward/judge/score_mean": [float(scores.mean())],
                }
            },
        )

    # ---------------------------------------------------------------- scoring
    def _inputs(self, data: DataProto) -> DataProto:
        """What the reward model reads for each sample (``reward_model_tokens``), laid out as a batch."""
        samples = []
        for i in range(len(data)):
            n_tokens = int(data.tensors["response_mask"][i].sum())
            response = str(
                self.policy_tokenizer.decode(
                    data.tensors["responses"][i, :n_tokens], skip_special_tokens=True
                )
            )  # one row of ids decodes to one string
            messages = list(data.non_tensor_batch["raw_prompt"][i])  # chat messages: the dataset made them so
            prompt: str | list[dict[str, Any]]
            completion: str | list[dict[str, Any]]
            if self.chat:
                prompt, completion = messages, [{"role": "assistant", "content": response}]
            else:
                prompt, completion = "\n".join(m["content"] for m in messages), response
            ids = reward_model_tokens(self.tokenizer, prompt, completion)
            samples.append(Sample([], ids, [1] * len(ids)))
        return collate_samples(samples, self.tokenizer.pad_token_id)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @torch.no_grad()
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` ``(bs, L)``: the model's scalar on the last response token."""
        mask = data.tensors["response_mask"]
        if self.config.dummy:
            return DataProto.from_dict({"rm_scores": sequence_to_token_scores(dummy_scores(data), mask)})
        if self.config.style == "generative":
            return self._judged(data)
        scores, reward_model = [], self.config
        for start in range(0, len(data), reward_model.micro_batch_size_per_gpu):
            chunk = data[start : start + reward_model.micro_batch_size_per_gpu]
            scores.append(sequence_rewards(self.loaded, self._inputs(chunk)).cpu())
        return DataProto.from_dict({"rm_scores": sequence_to_token_scores(torch.cat(scores), mask)})

    # ---------------------------------------------------------------- training
    def _batching(self) -> PairBatching:
        d = self.trained.data
        return PairBatching(
            d.micro_batch_size_per_gpu, d.max_token_len_per_gpu if d.use_dynamic_bsz else None
        )

    def _loss(self, micro: DataProto, spec: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        return get_offline_objective("rm").fn(sequence_rewards(self.loaded, micro), micro.tensors, spec)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_reward_model(self, data: DataProto) -> DataProto:
        """One optimiser step over this rank's shard of interleaved pairs (``data.meta_info["offline"]``: the
        loss settings); metrics (``loss``, ``rewards/*``, ``rm/grad_norm``, ``rm/lr``) in ``meta_info``."""
        self.loaded.train()
        loss = partial(self._loss, spec=data.meta_info["offline"])
        metrics = self.engine.update(
            data, len(data), self._batching(), loss, "seq-mean-token-sum", seed=self.seed
        )
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def evaluate_reward_model(self, data: DataProto) -> DataProto:
        """The loss and pair metrics on held-out pairs, without updating (averaged over pairs)."""
        self.loaded.eval()
        spec, batching = data.meta_info["offline"], self._batching()
        sums: dict[str, float] = {}
        pairs = 0.0
        with torch.no_grad():
            for micro, real in batching.split(data, agreed_count(batching, data, self.loaded)):
                metrics = self._loss(micro, spec)[1]  # a filler's forward keeps sharded ranks in step
                weight = len(micro) / 2 if real else 0.0
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + weight * value
                pairs += weight
        self.loaded.train()
        return DataProto(meta_info={"metrics": {k: [v / max(pairs, 1e-8)] for k, v in sums.items()}})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """``path/huggingface``: an ``AutoModelForSequenceClassification`` folder (LoRA merged), plus the
        optimiser state (``workers.checkpointing``)."""
        save_worker_state(path, self.loaded, self.tokenizer, self.engine, self.rank)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        load_worker_state(path, self.loaded, self.engine, self.rank)


def _built(part: T | None, what: str) -> T:
    """A part of the worker that ``init_model`` builds for its mode; a RuntimeError naming it when it has none."""
    if part is None:
        raise RuntimeError(f"RewardModelWorker has no {what}")
    return part
