"""Supervised (prompt, response) pairs laid out like rollouts, to mix a supervised loss into RL updates.

Each item has the same tensors a generated sample has (``input_ids``/``attention_mask``/``position_ids``
over prompt + response, ``responses`` and ``response_mask`` over the response), so the actor computes
the demonstration's log-likelihood with the very code that scores its own samples, and the loss is
masked to the response tokens. The response ends with the tokenizer's EOS so the model learns to stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from hybridflow.data.dataset import RLHFDataset, read_rows
from hybridflow.utils.errors import InputError


class SFTDataset(Dataset):
    """Demonstrations from parquet/JSONL rows with a prompt (messages or string) and a response string."""

    def __init__(
        self,
        data_files: str | Path | Sequence[str | Path],
        tokenizer,
        max_prompt_length: int = 512,
        max_response_length: int = 64,
        prompt_key: str = "prompt",
        response_key: str = "response",
        apply_chat_template: bool = True,
    ) -> None:
        self.prompts = RLHFDataset(
            data_files,
            tokenizer,
            max_prompt_length=max_prompt_length,
            prompt_key=prompt_key,
            truncation="left",
            filter_overlong_prompts=False,
            apply_chat_template=apply_chat_template,
        )
        self.max_response_length = max_response_length
        self.pad_id = tokenizer.pad_token_id
        files = [data_files] if isinstance(data_files, str | Path) else list(data_files)
        raw_rows = {str(path): read_rows(path) for path in files}
        self.responses = []
        for row in self.prompts.rows:
            response = raw_rows[row.file][row.row].get(response_key)
            if not isinstance(response, str):
                raise InputError(
                    f"{row.file}: row {row.row}: field {response_key!r} must be a string, "
                    f"got {response!r:.200}"
                )
            ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            self.responses.append(ids[:max_response_length])

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        prompt = self.prompts[idx]
        ids = self.responses[idx]
        length = self.max_response_length
        responses = torch.full((length,), self.pad_id, dtype=torch.long)
        responses[: len(ids)] = torch.as_tensor(ids)
        response_mask = torch.zeros(length, dtype=torch.long)
        response_mask[: len(ids)] = 1
        last_position = prompt["position_ids"][-1]
        return {
            "prompts": prompt["input_ids"],
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompt["input_ids"], responses]),
            "attention_mask": torch.cat([prompt["attention_mask"], response_mask]),
            "position_ids": torch.cat([prompt["position_ids"], last_position + torch.arange(1, length + 1)]),
        }
