"""``RewardModelWorker``: scores prompt + response with a sequence-classification model.

The reward model may use another tokenizer and chat template than the policy, so the worker decodes the
policy's response text and re-renders the conversation (the raw prompt messages plus the response as the
assistant turn) with its own template. A classifier without a chat template (a safety classifier, a
DeBERTa reward model) reads the plain text instead: the prompt's message contents, a newline, the
response (``input_format``). ``dummy=True`` loads nothing and scores each response by its length and its
share of distinct tokens: a stand-in whose rewards move with the responses, so a pipeline test sees them
change before a real reward model exists.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from hybridflow.algorithms import sequence_to_token_scores
from hybridflow.config import RewardModelConfig
from hybridflow.config.checks import required
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.workers.modeling import load_model, load_tokenizer


def dummy_scores(data: DataProto) -> torch.Tensor:
    """``(bs,)`` in [0, 1]: half for the response's length (its share of the response width), half for the
    share of distinct tokens in it. Deterministic, and 1.0 only for a full-width response of distinct
    tokens, so a smoke run's reward moves with what the policy writes instead of saturating at once."""
    mask, responses = data.tensors["response_mask"], data.tensors["responses"]
    lengths = mask.sum(-1)
    distinct = torch.tensor([len(set(row[:n].tolist())) for row, n in zip(responses, lengths.tolist())])
    return 0.5 * lengths.float() / mask.shape[-1] + 0.5 * distinct.float() / lengths.clamp(min=1).float()


class RewardModelWorker(Worker):
    """``config``: the ``reward_model`` section; ``policy_tokenizer_path``: to decode the policy's tokens."""

    def __init__(self, config: RewardModelConfig, policy_tokenizer_path: str, device: str = "auto") -> None:
        super().__init__(device)
        self.config, self.policy_tokenizer_path = config, policy_tokenizer_path
        self.model: PreTrainedModel | None = None  # None with reward_model.dummy

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.policy_tokenizer = load_tokenizer(self.policy_tokenizer_path)
        if self.config.dummy:
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

    def _texts(self, data: DataProto) -> list[str]:
        """What the reward model reads for each sample: the rendered conversation, or the plain text."""
        texts = []
        for i in range(len(data)):
            n_tokens = int(data.tensors["response_mask"][i].sum())
            response = str(
                self.policy_tokenizer.decode(
                    data.tensors["responses"][i, :n_tokens], skip_special_tokens=True
                )
            )  # one row of ids decodes to one string
            messages = list(data.non_tensor_batch["raw_prompt"][i])  # chat messages: the dataset made them so
            if self.chat:
                text = self.tokenizer.apply_chat_template(
                    messages + [{"role": "assistant", "content": response}], tokenize=False
                )
                texts.append(str(text))  # tokenize=False renders a string
            else:
                texts.append("\n".join(m["content"] for m in messages) + "\n" + response)
        return texts

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @torch.no_grad()
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` ``(bs, L)``: the model's scalar on the last response token."""
        mask = data.tensors["response_mask"]
        if self.config.dummy:
            return DataProto.from_dict({"rm_scores": sequence_to_token_scores(dummy_scores(data), mask)})
        if self.model is None:
            raise RuntimeError("RewardModelWorker: call init_model first")
        model, scores = self.model, []
        for start in range(0, len(data), self.config.micro_batch_size_per_gpu):
            chunk = data[start : start + self.config.micro_batch_size_per_gpu]
            # a rendered template holds its special tokens already; plain text gets the tokenizer's (BOS, CLS...)
            inputs = self.tokenizer(
                self._texts(chunk), return_tensors="pt", padding=True, add_special_tokens=not self.chat
            ).to(self.device)
            scores.append(model(**inputs).logits[:, 0].float().cpu())
        return DataProto.from_dict({"rm_scores": sequence_to_token_scores(torch.cat(scores), mask)})
