"""``hybridflow doctor``'s checks of the training data: the rows parse and tokenize as the dataset feeds them,
their prompt lengths against the limit, and the batch arithmetic over the workers."""

from __future__ import annotations

from typing import Any

from hybridflow.commands.diagnosis import Check, Context
from hybridflow.config.checks import check_batch_sizes
from hybridflow.config.schema import ConfigError, DataConfig

DATASET_ROWS = 1000  # rows read per data file: enough for length percentiles, quick on any file


def check_dataset(ctx: Context) -> Check:
    """The first ``DATASET_ROWS`` rows of each training file parse and tokenize as the dataset feeds them; their
    prompt lengths against ``data.max_prompt_length``, and what would be dropped or truncated."""
    import numpy as np

    data = ctx.config.data
    read = _read_prompts(ctx)
    if isinstance(read, Check):
        return read
    lengths, image_tokens, first_text, partial = read
    if not lengths:
        return Check(
            "dataset", "fail", "no rows in data.train_files", "point data.train_files at prompt files"
        )
    limit = data.max_prompt_length
    over = sum(n > limit for n in lengths)
    ctx.prompt_tokens = min(max(lengths), limit)  # batches are trimmed to their longest prompt
    p50, p90, p99 = (int(np.percentile(lengths, q)) for q in (50, 90, 99))
    what = f"first {len(lengths)} rows" if partial else f"{len(lengths)} rows"
    detail = (
        f"{what}; prompt tokens p50 {p50}, p90 {p90}, p99 {p99}, max {max(lengths)} vs "
        f"data.max_prompt_length {limit}; first prompt {first_text[-120:]!r}"
    )
    image_info = _image_tokens(image_tokens)
    if image_info:  # counted in the prompt tokens above, as the model sees them
        detail += "; image tokens " + ", ".join(f"{k} {v}" for k, v in image_info.items())
    if not partial:  # the whole training set was read: the prompts a run would have
        ctx.train_rows = len(lengths) - (over if data.filter_overlong_prompts else 0)
    info: dict[str, Any] = {
        "rows": len(lengths),
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "max": max(lengths),
        "over": over,
    }
    if image_info:
        info["image_tokens"] = image_info
    return _length_verdict(data, lengths, over, detail, info)


def _length_verdict(
    data: DataConfig, lengths: list[int], over: int, detail: str, info: dict[str, Any]
) -> Check:
    """What the ``over`` prompts longer than ``data.max_prompt_length`` mean for a run: refused, all dropped,
    some dropped or truncated, or none."""
    raise_to = f"raise data.max_prompt_length to {max(lengths)}"
    if over and not data.filter_overlong_prompts and data.truncation == "error":
        return Check(
            "dataset",
            "fail",
            f"{detail}; {over} prompts are too long and truncation is 'error'",
            f"{raise_to}, or data.filter_overlong_prompts=true, or data.truncation=left",
            info,
        )
    if over == len(lengths) and data.filter_overlong_prompts:
        return Check(
            "dataset",
            "fail",
            f"{detail}; every prompt is longer than the limit and would be dropped",
            raise_to,
            info,
        )
    if over:
        fate = "dropped" if data.filter_overlong_prompts else f"truncated ({data.truncation})"
        return Check(
            "dataset",
            "warn",
            f"{detail}; {over} of {len(lengths)} ({over / len(lengths):.0%}) would be {fate}",
            raise_to,
            info,
        )
    return Check("dataset", "ok", detail + "; none too long", data=info)


def _read_prompts(ctx: Context) -> tuple[list[int], list[int], str, bool] | Check:
    """Each training file's first rows, parsed and tokenized (kept in ``ctx.rows``): the prompt lengths, the
    image tokens per prompt, the first prompt's text and whether a file was longer than what was read; or the
    failing verdict of a file that does not parse."""
    from hybridflow.data.dataset import encode_rows, parse_row, read_rows

    data = ctx.config.data
    lengths, image_tokens, first_text, partial = [], [], "", False
    for path in data.train_files or []:
        try:
            raw = read_rows(path)
            rows = [
                parse_row(r, path, i, i, data.prompt_key, data.image_key)
                for i, r in enumerate(raw[:DATASET_ROWS])
            ]
            texts, ids, images = encode_rows(ctx.tokenizer, ctx.processor, rows, data.apply_chat_template)
        except Exception as err:  # noqa: BLE001 - a bad row or a template error is the verdict
            return Check(
                "dataset",
                "fail",
                f"{type(err).__name__}: {err}",
                "fix the file or row named above (columns: data_source, prompt, reward_model)",
            )
        partial |= len(raw) > DATASET_ROWS
        ctx.rows += rows
        first_text = first_text or texts[0] if texts else first_text
        lengths += [len(prompt) for prompt in ids]
        image_tokens += [sum(image.num_tokens for image in row) for row in images]
    return lengths, image_tokens, first_text, partial


def _image_tokens(counts: list[int]) -> dict[str, int]:
    """p50, p90 and max of the image tokens per prompt; {} when no prompt has an image."""
    import numpy as np

    if not any(counts):
        return {}
    return {"p50": int(np.percentile(counts, 50)), "p90": int(np.percentile(counts, 90)), "max": max(counts)}


def check_batches(ctx: Context) -> Check:
    """The batch arithmetic over the workers (prompts, sequences, mini- and micro-batches or token budgets),
    and at least one full batch of training prompts."""
    cfg = ctx.config
    data, actor, n = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    workers = cfg.trainer.n_workers
    try:
        check_batch_sizes(cfg)
    except ConfigError as err:
        return Check("batch", "fail", str(err), "change the sizes named above so they divide")
    sequences = data.train_batch_size * n
    minis = data.train_batch_size // actor.ppo_mini_batch_size
    per_worker = actor.ppo_mini_batch_size * n // workers
    detail = (
        f"{data.train_batch_size} prompts x {n} = {sequences} sequences per step over {workers} worker(s); "
        f"{minis} mini-batch(es), each {per_worker} sequences per worker"
    )
    if actor.use_dynamic_bsz:
        longest = data.max_prompt_length + data.max_response_length
        detail += f" in micro-batches of up to {actor.ppo_max_token_len_per_gpu} tokens"
        if actor.ppo_max_token_len_per_gpu < longest:
            return Check(
                "batch",
                "fail",
                f"{detail}: one sequence can be {longest} tokens",
                f"raise actor_rollout_ref.actor.ppo_max_token_len_per_gpu to >= {longest}",
            )
    else:
        detail += (
            f" = {per_worker // actor.ppo_micro_batch_size_per_gpu} micro-batch(es) of "
            f"{actor.ppo_micro_batch_size_per_gpu} (gradient accumulation)"
        )
    if ctx.train_rows is not None and ctx.train_rows < data.train_batch_size:
        return Check(
            "batch",
            "fail",
            f"{detail}; only {ctx.train_rows} training prompts: not one full batch",
            f"lower data.train_batch_size to <= {ctx.train_rows}, or add data",
        )
    return Check("batch", "ok", detail)
