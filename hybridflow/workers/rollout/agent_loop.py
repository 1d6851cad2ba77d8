"""Multi-turn, tool-using rollouts over any rollout engine: the agent loop behind ``generate_sequences``.

Each turn makes one batched ``engine.generate_sequences`` call for every conversation still going, finds
the Hermes tool calls in what each wrote, runs them, and appends the tool results through the chat
template; a conversation ends when the model answers without a tool call, at a turn limit, or when the
response-length budget is spent. The engine needs only the single-turn contract (left-padded
``input_ids``/``attention_mask``/``position_ids`` in; ``responses``, ``response_mask`` through the first
EOS and ``rollout_log_probs`` out; ``meta_info`` ``n`` and ``response_length`` honoured), so the
Hugging Face and vLLM engines both drive it.

A prompt's images (``image_inputs``) go with every turn's generation call: each turn's context is the
prompt (its image tokens included) and everything since, and the engine runs the vision tower on them again.

The batch that comes back looks like a single-turn one to the rest of the pipeline: ``responses`` hold
every token after the prompt (model turns and tool results), ``response_mask`` is 1 on the model's
tokens only, so losses, KL, entropy and advantages skip the tool output while the model still attends
to it (``attention_mask`` is 1 on both).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from hybridflow.config import MultiTurnConfig
from hybridflow.data.dataset import left_pad
from hybridflow.models.vision import IMAGES, ImageInput
from hybridflow.protocol import DataProto
from hybridflow.rollout import Capabilities, Rollout, attach_responses
from hybridflow.rollout.chat_template import Messages, TemplateDelta
from hybridflow.tools import BaseTool, ToolCall, ToolError, parse_tool_calls

SAMPLING_OVERRIDES = ("do_sample", "temperature", "top_p", "top_k")


@dataclass
class Conversation:
    """One sample's growing response: tokens after the prompt, which of them the model wrote, its log-probs."""

    prompt_ids: list[int]
    messages: Messages
    images: tuple[ImageInput, ...] = ()  # the prompt's images, shown to the model in every turn
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    pending: list[ToolCall] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_errors: int = 0
    tool_reward: float = 0.0
    done: bool = False
    truncated: bool = False

    def append(self, ids: list[int], from_model: bool, log_probs: list[float] | None = None) -> None:
        """Tokens after the ones so far: the model's (trained on) or a tool's and the template's."""
        self.ids += ids
        self.mask += [int(from_model)] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)

    def finish(self, truncated: bool = False) -> None:
        """End the conversation (``truncated``: a limit ended it, not the model)."""
        self.done, self.truncated = True, truncated


class AgentLoop(Rollout):
    """``generate_sequences`` with tools; ``config`` is ``rollout.multi_turn`` (``max_assistant_turns``,
    ``max_user_turns``, ``format``), ``tools`` maps the names the model calls to tool objects.

    A rollout mode over ``engine``: reseeding and the weights go to the engine (an engine with weights of its
    own still gets every update); it does not follow weights while it generates (a turn's tools run between
    engine calls, so a partial rollout has no step to swap them at)."""

    def __init__(
        self,
        engine: Rollout,
        tokenizer: PreTrainedTokenizerBase,
        config: MultiTurnConfig,
        response_length: int,
        tools: dict[str, BaseTool],
    ) -> None:
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.response_length, self.tools = response_length, tools
        self.eos_token_ids = list(engine.eos_token_ids)  # the ids that end a turn
        self.capabilities = Capabilities(own_weights=engine.capabilities.own_weights)
        self.template = TemplateDelta(tokenizer, [t.schema for t in tools.values()], tokenizer.eos_token_id)

    def reseed(self, step: int) -> None:
        """The engine's: the turns of a step draw on from it."""
        self.engine.reseed(step)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """The engine's (an engine with weights of its own still gets every update)."""
        return self.engine.update_weights(weights)

    # ------------------------------------------------------------------ the loop

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """In: as the engine's (``raw_prompt`` messages needed too); ``meta_info`` ``n`` and sampling keys.
        Out: ``bs * n`` rows, interleaved: ``prompts (bs*n, P)``, ``responses``, ``response_mask``,
        ``rollout_log_probs`` ``(bs*n, L)``, ``input_ids``/``attention_mask``/``position_ids`` ``(bs*n, P+L)``,
        non-tensor ``messages``, ``tool_calls``, ``num_turns``, ``tool_rewards``; ``meta_info["metrics"]``."""
        if "raw_prompt" not in prompts.non_tensor_batch:
            raise KeyError(
                "multi-turn rollouts need non_tensor_batch['raw_prompt'] (the chat messages), as "
                f"RLHFDataset provides; the batch has {sorted(prompts.non_tensor_batch)}"
            )
        rows = prompts.repeat(int(prompts.meta_info.get("n", 1)), interleave=True)
        mask = rows.tensors["attention_mask"].bool()
        images = rows.non_tensor_batch.get(IMAGES, [()] * len(rows))
        conversations = [
            Conversation(ids[m].tolist(), copy.deepcopy(list(messages)), tuple(pictures))
            for ids, m, messages, pictures in zip(
                rows.tensors["input_ids"], mask, rows.non_tensor_batch["raw_prompt"], images
            )
        ]
        sampling = {k: prompts.meta_info[k] for k in SAMPLING_OVERRIDES if k in prompts.meta_info}
        for tool in self.tools.values():
            for c in conversations:
                tool.create(c.instance_id)
        try:
            while live := [c for c in conversations if not c.done]:
                self._model_turn(live, sampling)
                self._tool_turn([c for c in live if not c.done])
        finally:
            for tool in self.tools.values():
                for c in conversations:
                    tool.release(c.instance_id)
        return self._to_batch(rows, conversations)

    def _model_turn(self, live: list[Conversation], sampling: dict[str, Any]) -> None:
        """One batched generation for every live conversation, cut to each one's remaining budget."""
        budget = max(self.response_length - len(c.ids) for c in live)
        contexts = [c.prompt_ids + c.ids for c in live]
        width = max(map(len, contexts))
        padded = [left_pad(ids, width, self.tokenizer.pad_token_id) for ids in contexts]
        images = {IMAGES: [c.images for c in live]} if any(c.images for c in live) else {}
        batch = DataProto.from_dict(
            {k: torch.stack([p[k] for p in padded]) for k in padded[0]},
            images,
            meta_info={**sampling, "n": 1, "response_length": budget},
        )
        out = self.engine.generate_sequences(batch)
        lengths = out.tensors["response_mask"].sum(-1).tolist()
        for c, ids, lps, length in zip(
            live, out.tensors["responses"], out.tensors["rollout_log_probs"], lengths
        ):
            keep = min(int(length), self.response_length - len(c.ids))
            tokens = ids[:keep].tolist()
            c.append(tokens, from_model=True, log_probs=lps[:keep].tolist())
            c.assistant_turns += 1
            ended = bool(tokens) and tokens[-1] in self.eos_token_ids
            text = str(self.tokenizer.decode(tokens[:-1] if ended else tokens, skip_special_tokens=False))
            c.messages.append({"role": "assistant", "content": text})
            c.pending = parse_tool_calls(text, self.config.format)
            if c.pending:
                c.tool_calls.append(
                    {"turn": c.assistant_turns, "calls": [call.as_dict() for call in c.pending]}
                )
            if not ended:
                c.finish(truncated=True)  # the budget ran out mid-turn
            elif not c.pending:
                c.finish()  # a final answer
            elif (
                c.assistant_turns >= self.config.max_assistant_turns
                or c.user_turns >= self.config.max_user_turns
            ):
                c.finish(truncated=True)  # it wants tools, but a turn limit says stop

    def _tool_turn(self, waiting: list[Conversation]) -> None:
        """Run every call of every waiting conversation (in threads: sandboxed tools mostly wait), then
        append the results as tool messages."""
        jobs = [(c, call) for c in waiting for call in c.pending]
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(jobs)))) as pool:
            results = list(pool.map(lambda job: self._call(*job), jobs))
        replies: dict[int, Messages] = {id(c): [] for c in waiting}
        for (c, _), (text, reward, failed) in zip(jobs, results):
            replies[id(c)].append({"role": "tool", "content": text})
            c.tool_reward += reward
            c.tool_errors += failed
        for c in waiting:
            delta = self.template.after_assistant(c.messages, replies[id(c)])
            c.messages += replies[id(c)]
            c.user_turns += 1
            if len(c.ids) + len(delta) >= self.response_length:
                c.finish(truncated=True)  # no room left for the model to read the results and answer
            else:
                c.append(delta, from_model=False)

    def _call(self, conversation: Conversation, call: ToolCall) -> tuple[str, float, bool]:
        """(text for the model, reward, failed); a failing tool never stops the rollout."""
        if call.error is not None:
            return f"Error: {call.error}", 0.0, True
        tool = self.tools.get(call.name) if call.name is not None else None
        if tool is None:
            return f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(self.tools))}", 0.0, True
        try:
            text, reward, _ = tool.execute(call.arguments, conversation.instance_id)
        except ToolError as err:
            return f"Error: {err}", 0.0, True
        except Exception as err:  # noqa: BLE001 - a broken tool is reported to the model, not fatal
            return f"Error: tool {call.name} failed: {type(err).__name__}: {err}", 0.0, True
        return str(text), float(reward), False

    # ------------------------------------------------------------------ the batch
    def _to_batch(self, rows: DataProto, conversations: list[Conversation]) -> DataProto:
        n, length, pad = len(conversations), self.response_length, self.tokenizer.pad_token_id
        responses = torch.full((n, length), pad, dtype=torch.long)
        response_mask = torch.zeros((n, length), dtype=torch.long)
        attention = torch.zeros((n, length), dtype=torch.long)
        log_probs = torch.zeros((n, length), dtype=torch.float32)
        for i, c in enumerate(conversations):
            k = len(c.ids)
            responses[i, :k] = torch.tensor(c.ids, dtype=torch.long)
            response_mask[i, :k] = torch.tensor(c.mask, dtype=torch.long)
            attention[i, :k] = 1
            log_probs[i, :k] = torch.tensor(c.log_probs, dtype=torch.float32)
        rows = attach_responses(rows, responses, response_mask, log_probs, attended=attention)
        columns: dict[str, list[Any]] = {
            "messages": [c.messages for c in conversations],
            "tool_calls": [c.tool_calls for c in conversations],
            "num_turns": [c.assistant_turns for c in conversations],
            "tool_rewards": [c.tool_reward for c in conversations],
        }
        for key, values in columns.items():
            rows.non_tensor_batch[key] = np.empty(n, dtype=object)
            for i, value in enumerate(values):  # element by element: lists stay single elements
                rows.non_tensor_batch[key][i] = value
        rows.meta_info["metrics"] = agent_metrics(conversations)
        return rows


def agent_metrics(conversations: list[Conversation]) -> dict[str, float]:
    """Per-conversation means: assistant turns, well-formed tool calls, failed calls; share truncated."""
    n = max(len(conversations), 1)
    calls = [call for c in conversations for turn in c.tool_calls for call in turn["calls"]]
    return {
        "agent/turns/mean": sum(c.assistant_turns for c in conversations) / n,
        "agent/tool_calls/mean": sum(call["error"] is None for call in calls) / n,
        "agent/tool_errors": sum(c.tool_errors for c in conversations) / n,
        "agent/truncated": sum(c.truncated for c in conversations) / n,
    }
