"""What each sample and group of a training batch contributes, on the driver: DAPO's overlong reward shaping
(``reward_model.overlong_buffer``), its overlong filtering (``actor.mask_truncated_samples``), the reward
spread within groups, and on-policy distillation's teacher (``actor_rollout_ref.teacher``: its worker's
config, the tokenizer check at start, its log-probs and its reward).

The tensor arithmetic is in ``hybridflow.algorithms`` (``overlong_penalty``, ``truncated``, ``group_std``,
``distillation_rewards``); this module applies it to the batch a step trains.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from hybridflow.algorithms import distillation_rewards, group_std, overlong_penalty, truncated
from hybridflow.protocol import DataProto
from hybridflow.single_controller import WorkerGroup
from hybridflow.utils.errors import UserError
from hybridflow.workers.modeling import load_tokenizer


def with_overlong_penalty(
    scores: torch.Tensor, response_mask: torch.Tensor, max_length: int, buffer: Any
) -> tuple[torch.Tensor, dict[str, float]]:
    """``scores`` ``(bs, L)`` with DAPO's overlong penalty added on each response's last token
    (``buffer``: ``reward_model.overlong_buffer``), and ``reward/overlong_penalty_mean`` (per sample) and
    ``reward/overlong_frac`` (the share of samples penalised)."""
    mask = response_mask.bool()
    lengths = mask.sum(dim=-1)
    penalty = overlong_penalty(lengths, max_length, buffer.len, buffer.penalty_factor)
    last = (mask * torch.arange(1, mask.shape[-1] + 1)).argmax(dim=-1)
    shaped = scores.clone()
    shaped[torch.arange(len(scores)), last] += penalty.to(scores.dtype)
    return shaped, {
        "reward/overlong_penalty_mean": float(penalty.mean()),
        "reward/overlong_frac": float((penalty < 0).float().mean()),
    }


def without_truncated(
    batch: DataProto, max_length: int, eos_token_ids: Sequence[int]
) -> tuple[DataProto, dict[str, float]]:
    """The actor's copy of ``batch`` with the truncated samples' ``response_mask`` zeroed, so they take no
    part in the policy loss or its token count (their rewards already counted in their groups' baselines),
    and ``actor/truncated_masked_frac``."""
    cut = truncated(batch.tensors["responses"], batch.tensors["response_mask"], max_length, eos_token_ids)
    out = DataProto(
        batch=batch.tensors.clone(recurse=False),
        non_tensor_batch=dict(batch.non_tensor_batch),
        meta_info=dict(batch.meta_info),
    )
    out.tensors["response_mask"] = batch.tensors["response_mask"] * (~cut[:, None]).to(
        batch.tensors["response_mask"].dtype
    )
    return out, {"actor/truncated_masked_frac": float(cut.float().mean())}


def group_reward_metrics(batch: DataProto) -> dict[str, float]:
    """The spread of the summed scores within the batch's groups (``uid``): ``reward/group_std/mean`` and
    ``reward/zero_std_group_frac``, the share of groups whose samples all scored the same (they have zero
    advantage under a group baseline: what dynamic sampling filters)."""
    if "uid" not in batch.non_tensor_batch:
        return {}
    std = group_std(batch.non_tensor_batch["uid"], batch.tensors["token_level_scores"].sum(dim=-1))
    return {
        "reward/group_std/mean": float(std.mean()),
        "reward/zero_std_group_frac": float((std == 0).double().mean()),
    }


# ---------------------------------------------------------------------------------- on-policy distillation
def teacher_worker_config(arr: Any) -> Any:
    """The ``actor_rollout_ref`` section a teacher worker (role ``ref``) loads: the student's, with the
    teacher's model folder and no LoRA (the teacher is a plain frozen copy)."""
    teacher = arr.teacher
    model = dataclasses.replace(
        arr.model, path=teacher.path, trust_remote_code=teacher.trust_remote_code, lora_rank=0
    )
    return dataclasses.replace(arr, model=model)


def check_teacher_tokenizer(student: Any, teacher_path: str, trust_remote_code: bool) -> None:
    """Refuse a teacher whose tokenizer maps any token to another id than the student's: the reverse KL
    compares the two models' log-probs of the same token ids."""
    teacher = load_tokenizer(teacher_path, trust_remote_code)
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if mine == theirs:
        return
    differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda item: item[1])
    token = differ[0][0]
    raise UserError(
        f"actor_rollout_ref.teacher.path={teacher_path}: the teacher's tokenizer differs from the student's "
        f"({len(mine)} tokens against {len(theirs)}; token {token!r} is id {mine.get(token)} for the student, "
        f"{theirs.get(token)} for the teacher): on-policy distillation compares both models' log-probs of the "
        "same token ids, so the teacher needs the student's tokenizer"
    )


def teacher_log_probs(teacher: WorkerGroup, batch: DataProto) -> DataProto:
    """``teacher_log_prob`` ``(bs, L)``: the teacher's log-probs of the sampled response tokens."""
    out = teacher.compute_ref_log_prob(batch)
    return DataProto.from_dict({"teacher_log_prob": out.batch["ref_log_prob"]})


def with_distillation_reward(batch: DataProto, teacher: Any) -> dict[str, float]:
    """``token_level_rewards`` mixed with the reverse-KL reward in place (``teacher``: the config section;
    the student's log-probs are the sampling policy's, ``old_log_probs``); returns ``distill/*``."""
    b = batch.tensors
    rewards, metrics = distillation_rewards(
        b["token_level_rewards"],
        b["old_log_probs"],
        b["teacher_log_prob"],
        b["response_mask"],
        teacher.kl_coef,
        teacher.task_reward_coef,
    )
    b["token_level_rewards"] = rewards
    return metrics
