"""``RewardModelWorker``: scores prompt + response with a sequence-classification model.

The reward model may use another tokenizer and chat template than the policy, so the worker decodes the
policy's response text and re-renders the conversation (the raw prompt messages plus the response as the
assistant turn) with its own template. ``dummy=True`` loads nothing and scores by response length (longer
is better, capped at 1): a stand-in that tests a pipeline end to end before a real reward model exists.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForSequenceClassification

from hybridflow.algorithms import sequence_to_token_scores
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.workers.modeling import load_model, load_tokenizer


class RewardModelWorker(Worker):
    """``config``: the ``reward_model`` section; ``policy_tokenizer_path``: to decode the policy's tokens."""

    def __init__(self, config: Any, policy_tokenizer_path: str, device: str = "auto") -> None:
        super().__init__(device)
        self.config, self.policy_tokenizer_path = config, policy_tokenizer_path
        self.model = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.policy_tokenizer = load_tokenizer(self.policy_tokenizer_path)
        if self.config.dummy:
            return
        path = self.config.model.path
        self.tokenizer = load_tokenizer(self.config.model.input_tokenizer or path)
        self.model = load_model(path, self.device, "auto", auto_cls=AutoModelForSequenceClassification,
                                num_labels=1).eval()
        self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def _conversations(self, data: DataProto) -> list[str]:
        texts = []
        for i in range(len(data)):
            n_tokens = int(data.batch["response_mask"][i].sum())
            response = self.policy_tokenizer.decode(data.batch["responses"][i, :n_tokens], skip_special_tokens=True)
            messages = list(data.non_tensor_batch["raw_prompt"][i])  # chat messages: the dataset made them so
            texts.append(self.tokenizer.apply_chat_template(
                messages + [{"role": "assistant", "content": response}], tokenize=False))
        return texts

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @torch.no_grad()
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` ``(bs, L)``: the model's scalar on the last response token."""
        mask = data.batch["response_mask"]
        if self.config.dummy:
            scores = (mask.sum(-1).float() / mask.shape[-1]).clamp(max=1.0)
            return DataProto.from_dict({"rm_scores": sequence_to_token_scores(scores, mask)})
        scores = []
        for start in range(0, len(data), self.config.micro_batch_size_per_gpu):
            chunk = data[start:start + self.config.micro_batch_size_per_gpu]
            inputs = self.tokenizer(self._conversations(chunk), return_tensors="pt", padding=True,
                                    add_special_tokens=False).to(self.device)
            scores.append(self.model(**inputs).logits[:, 0].float().cpu())
        return DataProto.from_dict({"rm_scores": sequence_to_token_scores(torch.cat(scores), mask)})
