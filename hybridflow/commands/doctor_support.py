"""``hybridflow doctor``'s check of the model against the paths the config asks for: the model's line of the
support matrix (``hybridflow.workers.support``), read from the model built on the meta device (its config
only, no weights), and a failure where the config asks for a path that refuses this model."""

from __future__ import annotations

from hybridflow.commands.diagnosis import Check, Context
from hybridflow.config.schema import PPOConfig
from hybridflow.workers.support import Cell, support_line


def _asked(cfg: PPOConfig) -> dict[str, str]:
    """The matrix's paths the config asks for, each with the key that asks."""
    arr = cfg.actor_rollout_ref
    asked = {}
    sizes = {
        "actor_rollout_ref.actor": arr.actor.ulysses_sequence_parallel_size,
        "critic": cfg.critic.ulysses_sequence_parallel_size,
    }
    for section, size in sizes.items():
        if size > 1:
            asked["ulysses sequence parallelism"] = f"{section}.ulysses_sequence_parallel_size={size}"
    if arr.rollout.name == "vllm":
        asked["vllm rollout"] = "actor_rollout_ref.rollout.name=vllm"
    if arr.model.use_remove_padding:
        asked["padding-free rows (use_remove_padding)"] = "actor_rollout_ref.model.use_remove_padding=true"
    if arr.actor.router_replay.mode != "disabled":
        asked["router replay (R2, R3), load-balancing loss"] = (
            f"actor_rollout_ref.actor.router_replay.mode={arr.actor.router_replay.mode}"
        )
    return asked


def check_support(ctx: Context) -> Check:
    """Every path's verdict on the model; ``fail`` where a key asks for a path that refuses it, ``warn``
    where one falls back or cannot be checked here."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from hybridflow.models.vision import vision_family
    from hybridflow.workers.modeling import parameters_on_meta

    hf_config = ctx.hf_config
    auto = AutoModelForImageTextToText if vision_family(hf_config) is not None else AutoModelForCausalLM
    trust = ctx.config.actor_rollout_ref.model.trust_remote_code
    with parameters_on_meta():
        model = auto.from_config(hf_config, trust_remote_code=trust)
    line = support_line(model)
    detail = f"{hf_config.model_type}: " + "; ".join(str(cell) for cell in line)
    cells: dict[str, Cell] = {cell.path: cell for cell in line}
    asked = {key: cells[path] for path, key in _asked(ctx.config).items()}
    refused = [f"{key}: {cell.note}" for key, cell in asked.items() if cell.verdict == "refused"]
    if refused:
        return Check("support", "fail", detail, f"{refused[0]}; set that key back for this model")
    loose = [f"{key}: {cell.verdict} ({cell.note})" for key, cell in asked.items() if cell.verdict != "exact"]
    if loose:
        return Check("support", "warn", detail, loose[0])
    return Check("support", "ok", detail)
