"""An agent written with the ``openai`` SDK, trained with GRPO: the calculator task, its own tool loop.

``run(client, sample)`` is ordinary ``openai`` code: it passes the calculator as an OpenAI function schema,
runs the tool calls the model makes and sends the results back, and returns the reward. The trainer
(``actor_rollout_ref.rollout.served_agent.path/name``) serves the policy it trains over an OpenAI-compatible
endpoint, runs ``n`` sessions of this agent per prompt, and trains on exactly the tokens the server sampled:
a tool call, its result and the answer form one row, the tool result masked out of the loss.

On the tiny model (default) the model is first taught the task's chats for a few seconds, so that it
writes tool calls at all; ``--model default`` trains the embedded SmolLM2-135M as it comes.

    python examples/09_openai_agent.py [OUT_DIR] [--model tiny|default] [--steps N]
"""

import argparse
import json
import sys
from pathlib import Path

from _setup import logged, tiny_config

from hybridflow.data import RLHFDataset
from hybridflow.data.prepare import main as prepare_data
from hybridflow.models.tiny import teach_conversations
from hybridflow.rewards.calculator import compute_score
from hybridflow.serving.openai_format import with_tools_in_system
from hybridflow.tools.calculator import calculate
from hybridflow.trainer import PPOTrainer

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression such as 123*456.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


async def run(client, sample: dict) -> dict:
    """Ask, run the calculator calls the model makes (at most two rounds), score the final answer."""
    messages, calls = list(sample["messages"]), []
    for _ in range(3):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR], max_tokens=96
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls or len(calls) >= 2:
            break
        for call in message.tool_calls:
            try:
                result = calculate(json.loads(call.function.arguments)["expression"])
                calls.append({"name": call.function.name, "error": None})
            except Exception as error:  # noqa: BLE001 - the model reads what went wrong
                result = f"Error: {error}"
                calls.append({"name": call.function.name, "error": str(error)})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = messages[-1].get("content") or ""
    info = {**sample["extra_info"], "tool_calls": [{"calls": calls}]}
    return compute_score(
        answer, sample["reward_model"]["ground_truth"], info
    )  # the row, as the file holds it


def main(out_dir: Path, model: str = "tiny", steps: int = 2) -> dict:
    out_dir = Path(out_dir)
    data = out_dir / "calc"
    if not (data / "train.parquet").exists():
        prepare_data(["calculator", str(data), "--train-size", "64", "--test-size", "32", "--seed", "0"])
    tiny = model == "tiny"
    config = tiny_config(
        out_dir,
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        f"actor_rollout_ref.rollout.served_agent.path={Path(__file__).resolve()}",
        "actor_rollout_ref.rollout.served_agent.name=run",
        "custom_reward_function.path=null",  # the agent's return value is the reward
        "data.max_prompt_length=320",
        "data.max_response_length=256",
        "data.shuffle=false",
        *(
            ["actor_rollout_ref.rollout.temperature=0.3", "actor_rollout_ref.actor.optim.lr=1e-4"]
            if tiny
            else [
                "actor_rollout_ref.model.path=default",
                "actor_rollout_ref.rollout.temperature=0.7",
                "data.train_batch_size=8",
                "actor_rollout_ref.rollout.n=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                "actor_rollout_ref.actor.optim.lr=2e-5",
                "trainer.val_before_train=true",
                f"trainer.test_freq={max(steps // 2, 1)}",
            ]
        ),
        steps=steps,
    )
    if tiny:  # a random model never calls a tool: teach it the task's chats as the server renders them
        rows = RLHFDataset(config.data.train_files, _tokenizer(config)).rows[:8]
        chats = [with_tools_in_system(_solved(row), [CALCULATOR]) for row in rows]
        teach_conversations(config.actor_rollout_ref.model.path, chats)
        config.data.val_files = None
    batches = []
    with PPOTrainer(config) as trainer:
        trainer.register_hook("after_reward", lambda trainer, step, metrics, batch: batches.append(batch))
        trainer.fit()
    rows = logged(out_dir)
    for row in rows:
        print(
            f"step {row['training/global_step']}: reward {row['critic/score/mean']:.2f}, "
            f"joined calls {row['served/joined_calls']:.2f}, samples/session {row['served/samples_per_session']:.2f}"
        )
    return {"rows": rows, "batches": batches}


def _tokenizer(config):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)


def _solved(row) -> list[dict]:
    """The prompt, a calculator call, its result and the exact answer: what the tiny model is taught."""
    a, b = row.extra_info["a"], row.extra_info["b"]
    call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}</tool_call>'
    return [
        *row.messages,
        {"role": "assistant", "content": call},
        {"role": "tool", "content": row.ground_truth},
        {"role": "assistant", "content": f"{a}*{b}={row.ground_truth}"},
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", nargs="?", default=None)
    parser.add_argument("--model", default="tiny", choices=["tiny", "default"])
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    import tempfile

    import torch

    torch.set_num_threads(1 if args.model == "tiny" else 2)
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="hybridflow-example-"))
    main(out, args.model, args.steps)
    print(f"run folder: {out / 'run'}", file=sys.stderr)
