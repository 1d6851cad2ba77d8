"""A custom tool: the policy calls ``add`` in multi-turn rollouts, and the reward reads the conversation.

A tool is a ``BaseTool`` subclass with a name, a description, a JSON schema of its arguments and
``execute(args, instance_id) -> (text, reward, metrics)``; a YAML file lists the tools a run offers
(``actor_rollout_ref.rollout.multi_turn.tool_config_path``). A random model never writes a tool call, so
this example first teaches the tiny model the chats of its first 8 prompts, calling ``add`` (supervised steps
until every reply token is likely, about 200 of them), then runs GRPO on those prompts with the agent loop: the model writes ``<tool_call>{...}</tool_call>``, ``add`` runs, its
result is appended as a tool message (masked out of the loss), and the model answers.

    python examples/08_custom_tool.py [OUT_DIR]
"""

from pathlib import Path
from typing import ClassVar

from _setup import logged, run, tiny_config
from transformers import AutoTokenizer

from hybridflow.data import RLHFDataset
from hybridflow.models.tiny import teach_conversations
from hybridflow.tools import BaseTool, ToolError
from hybridflow.trainer import PPOTrainer


class AddTool(BaseTool):
    """Adds two integers: the whole custom tool."""

    name: ClassVar[str] = "add"
    description: ClassVar[str] = "Add two integers."
    parameters: ClassVar[dict] = {
        "type": "object",
        "required": ["a", "b"],
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    }

    def execute(self, args: dict, instance_id: str) -> tuple[str, float, dict]:
        if not all(isinstance(args.get(k), int) for k in "ab"):
            raise ToolError('add needs {"a": <integer>, "b": <integer>}')  # the model reads "Error: ..."
        return str(args["a"] + args["b"]), 0.0, {}


def used_the_tool(data_source, solution_str, ground_truth, extra_info) -> dict:
    """1 when a tool message holds the right sum, and the final answer repeats it."""
    tool_results = [m["content"] for m in extra_info["messages"] if m["role"] == "tool"]
    answer = extra_info["messages"][-1]["content"]
    return {
        "score": float(ground_truth in tool_results) + float(answer.endswith(f"={ground_truth}")),
        "tool_messages": len(tool_results),
    }


def main(out_dir: Path) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tools.yaml").write_text(f"tools:\n  - class_name: {Path(__file__).resolve()}:AddTool\n")
    config = tiny_config(
        out_dir,
        "data.max_response_length=128",
        "actor_rollout_ref.rollout.temperature=0.5",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={out_dir / 'tools.yaml'}",
        f"custom_reward_function.path={Path(__file__).resolve()}",
        "custom_reward_function.name=used_the_tool",
        "data.shuffle=false",
        steps=2,
    )
    model = config.actor_rollout_ref.model.path
    rows = RLHFDataset(config.data.train_files, AutoTokenizer.from_pretrained(model)).rows[:8]
    chats = [
        [
            *row.messages,
            {
                "role": "assistant",
                "content": '<tool_call>{"name": "add", "arguments": '
                f'{{"a": {row.extra_info["a"]}, "b": {row.extra_info["b"]}}}}}</tool_call>',
            },
            {"role": "tool", "content": row.ground_truth},
            {
                "role": "assistant",
                "content": f"{row.extra_info['a']}+{row.extra_info['b']}={row.ground_truth}",
            },
        ]
        for row in rows
    ]
    teach_conversations(model, chats)
    batches = []
    with PPOTrainer(config) as trainer:
        trainer.register_hook("after_advantage", lambda trainer, step, metrics, batch: batches.append(batch))
        trainer.fit()
    for message in batches[-1].non_tensor_batch["messages"][0][-3:]:
        print(f"{message['role']:>9}: {message['content']}")
    return {"rows": logged(out_dir), "batches": batches}


if __name__ == "__main__":
    run(main)
