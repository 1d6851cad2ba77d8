"""The agent loop: masks hand-checked on a scripted conversation, real tiny-model generation with a tool,
turn and budget limits, chat-template checks, and a GRPO step of the trainer on multi-turn rollouts."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.config.schema import MultiTurnConfig, RolloutConfig
from hybridflow.models.default import default_model_path
from hybridflow.models.tiny import make_tiny_model, make_tiny_tokenizer, teach_conversations
from hybridflow.protocol import DataProto
from hybridflow.rollout import Rollout
from hybridflow.rollout.chat_template import TemplateDelta
from hybridflow.tools import CalculatorTool, PythonTool
from hybridflow.utils.errors import UserError
from hybridflow.workers.modeling import response_log_probs
from hybridflow.workers.rollout import AgentLoop, HFRollout


def call(expression: str, name: str = "calculator") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


QUESTION = [{"role": "user", "content": "Compute 12*34."}]
TOOL_CHAT = [
    *QUESTION,
    {"role": "assistant", "content": call("12*34")},
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "12*34=408"},
]
L = 128  # response budget: the tiny tokenizer spends 65 tokens on a tool call's JSON
PLAIN_CHAT = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def taught_model(tmp_path_factory):
    """The tiny model taught a calculator chat and a plain one (every reply token at p >= 0.99, ~75 steps)."""
    folder = make_tiny_model(tmp_path_factory.mktemp("tool-model"))
    return teach_conversations(folder, [TOOL_CHAT, PLAIN_CHAT])


def prompts(tokenizer, chats: list[list[dict]], width: int = 48, **meta) -> DataProto:
    from hybridflow.data.dataset import left_pad

    rows = [
        left_pad(
            tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False),
            width,
            tokenizer.pad_token_id,
        )
        for c in chats
    ]
    return DataProto.from_dict(
        {k: torch.stack([r[k] for r in rows]) for k in rows[0]}, {"raw_prompt": chats}, meta_info=meta
    )


class ScriptedEngine(Rollout):
    """The rollout contract with replies given as text, turn by turn, for masks checked by hand (a model
    cannot be made to write a chosen text otherwise). Log-prob of the j-th token of a reply: -(j+1)/100."""

    def __init__(self, tokenizer, turns: list[list[str]]) -> None:
        self.tokenizer, self.turns, self.calls = tokenizer, list(turns), []
        self.eos_token_ids = [tokenizer.eos_token_id]

    def generate_sequences(self, batch: DataProto) -> DataProto:
        self.calls.append(batch)
        length = batch.meta_info["response_length"]
        replies = self.turns.pop(0)
        assert len(replies) == len(batch)
        responses = torch.full((len(batch), length), self.tokenizer.pad_token_id)
        mask = torch.zeros((len(batch), length), dtype=torch.long)
        for i, text in enumerate(replies):
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][:length]
            responses[i, : len(ids)], mask[i, : len(ids)] = torch.tensor(ids), 1
        log_probs = -(torch.arange(length) + 1.0).expand(len(batch), -1) / 100 * mask
        return DataProto.from_dict(
            {"responses": responses, "response_mask": mask, "rollout_log_probs": log_probs}
        )


def loop(engine, tokenizer, response_length=L, tools=None, **limits) -> AgentLoop:
    return AgentLoop(
        engine,
        tokenizer,
        MultiTurnConfig(enable=True, **limits),
        response_length,
        {"calculator": CalculatorTool()} if tools is None else tools,
    )


def test_masks_on_a_scripted_conversation(tokenizer):
    eos = tokenizer.eos_token
    engine = ScriptedEngine(tokenizer, [[call("12*34") + eos, "hi" + eos], ["12*34=408" + eos]])
    out = loop(engine, tokenizer).generate_sequences(prompts(tokenizer, [QUESTION, PLAIN_CHAT[:1]]))
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    turn1, tool, turn2 = (
        ids(call("12*34") + eos),
        ids("\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"),
        ids("12*34=408" + eos),
    )
    k = len(turn1) + len(tool) + len(turn2)
    row = out.batch["responses"][0]
    assert row[:k].tolist() == turn1 + tool + turn2 and (row[k:] == tokenizer.pad_token_id).all()
    assert out.batch["response_mask"][0].tolist() == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2) + [
        0
    ] * (L - k)
    assert out.batch["attention_mask"][0, -L:].tolist() == [1] * k + [0] * (L - k)
    expected_lp = (
        [-(j + 1) / 100 for j in range(len(turn1))]
        + [0.0] * len(tool)
        + [-(j + 1) / 100 for j in range(len(turn2))]
        + [0.0] * (L - k)
    )
    assert out.batch["rollout_log_probs"][0].tolist() == pytest.approx(expected_lp)
    assert out.batch["response_mask"][1].tolist() == [1] * len(ids("hi" + eos)) + [0] * (
        L - len(ids("hi" + eos))
    )
    # the second turn saw exactly what the chat template renders for the conversation so far
    second_context = engine.calls[1].batch["input_ids"][0][engine.calls[1].batch["attention_mask"][0].bool()]
    rendered = tokenizer.apply_chat_template(
        out.non_tensor_batch["messages"][0][:3], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert second_context.tolist() == rendered
    assert [len(c) for c in engine.calls] == [2, 1]  # one batched call per turn, live conversations only
    assert out.non_tensor_batch["messages"][0][2:] == [
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": "12*34=408"},
    ]
    assert out.non_tensor_batch["num_turns"].tolist() == [2, 1]
    assert out.meta_info["metrics"] == {
        "agent/turns/mean": 1.5,
        "agent/tool_calls/mean": 0.5,
        "agent/tool_errors": 0.0,
        "agent/truncated": 0.0,
    }


def test_several_calls_in_one_turn_and_malformed_ones_become_error_messages(tokenizer):
    eos = tokenizer.eos_token
    reply = call("2+3") + '<tool_call>{"name": "calculator", "arguments": }</tool_call>' + call("1", "search")
    engine = ScriptedEngine(tokenizer, [[reply + eos], ["5" + eos]])
    out = loop(engine, tokenizer, response_length=256).generate_sequences(
        prompts(tokenizer, [QUESTION], width=24)
    )
    tools = [m["content"] for m in out.non_tensor_batch["messages"][0] if m["role"] == "tool"]
    assert tools[0] == "5"
    assert tools[1].startswith("Error: the tool call is not valid JSON")
    assert tools[2] == "Error: unknown tool 'search'; available: calculator"
    calls = out.non_tensor_batch["tool_calls"][0][0]["calls"]
    assert [c["name"] for c in calls] == ["calculator", None, "search"]
    assert out.meta_info["metrics"]["agent/tool_errors"] == 2.0
    assert (
        out.meta_info["metrics"]["agent/tool_calls/mean"] == 2.0
    )  # well-formed calls (the unknown tool too)


def test_turn_and_budget_limits(tokenizer):
    eos = tokenizer.eos_token
    engine = ScriptedEngine(tokenizer, [[call("1+1") + eos]])
    out = loop(engine, tokenizer, max_assistant_turns=1).generate_sequences(prompts(tokenizer, [QUESTION]))
    assert out.meta_info["metrics"]["agent/truncated"] == 1.0 and len(engine.calls) == 1
    assert out.batch["response_mask"].sum() == len(
        tokenizer(call("1+1") + eos)["input_ids"]
    )  # no tool tokens

    engine = ScriptedEngine(tokenizer, [[call("1+1") + eos]])
    out = loop(engine, tokenizer, max_user_turns=0).generate_sequences(prompts(tokenizer, [QUESTION]))
    assert (
        out.meta_info["metrics"]["agent/truncated"] == 1.0 and len(out.non_tensor_batch["messages"][0]) == 2
    )

    engine = ScriptedEngine(tokenizer, [[call("1+1") + eos]])  # the reply is longer than the 10-token budget
    out = loop(engine, tokenizer, response_length=10).generate_sequences(prompts(tokenizer, [QUESTION]))
    assert (
        out.batch["response_mask"][0].tolist() == [1] * 10
        and out.meta_info["metrics"]["agent/truncated"] == 1.0
    )
    assert out.non_tensor_batch["tool_calls"][0][0]["calls"][0]["error"].endswith(
        "without a closing </tool_call>"
    )


@pytest.mark.learning
def test_real_generation_runs_the_tool_and_log_probs_match_the_trainers(taught_model):
    tokenizer = AutoTokenizer.from_pretrained(taught_model)
    model = AutoModelForCausalLM.from_pretrained(taught_model)
    engine = HFRollout(model, tokenizer, RolloutConfig(), response_length=L)
    batch = prompts(tokenizer, [QUESTION, PLAIN_CHAT[:1]], n=2, temperature=0.5, do_sample=True)
    torch.manual_seed(0)
    out = loop(engine, tokenizer).generate_sequences(batch)
    assert len(out) == 4 and out.non_tensor_batch["raw_prompt"][1] == QUESTION  # interleaved samples
    for i in (0, 1):
        assert (
            out.non_tensor_batch["messages"][i][1:] == TOOL_CHAT[1:]
        )  # the calculator's "408" came from the tool
    assert out.meta_info["metrics"]["agent/turns/mean"] == 1.5
    assert out.meta_info["metrics"]["agent/tool_calls/mean"] == 0.5
    # the assembled batch (prompt, model turns, tool tokens) gives the trainer the rollout's log-probs
    mask = out.batch["response_mask"].bool()
    log_probs, _ = response_log_probs(model.eval(), out, temperature=0.5)
    assert (out.batch["rollout_log_probs"][~mask] == 0).all()
    assert torch.allclose(log_probs[mask], out.batch["rollout_log_probs"][mask], atol=1e-4)
    assert (~mask[0] & out.batch["attention_mask"][0, -L:].bool()).sum() > 5  # tool tokens, masked out


def test_chat_templates_of_the_tiny_and_the_default_model_are_append_only(tokenizer):
    assert TemplateDelta(tokenizer).turn_end == "\n"
    smollm2 = AutoTokenizer.from_pretrained(default_model_path())
    delta = TemplateDelta(smollm2)
    assert (
        smollm2.decode(delta.after_assistant(TOOL_CHAT[:2], [TOOL_CHAT[2]]))
        == "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_rewrites_past_turns_is_refused(tokenizer):
    rewriting = (
        make_tiny_tokenizer()
    )  # keeps only the last assistant turn, as reasoning templates drop old thoughts
    rewriting.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    with pytest.raises(UserError, match="not append-only: adding a 'tool' message after 2"):
        TemplateDelta(rewriting)


@pytest.mark.learning
def test_reward_function_sees_the_conversation_in_a_grpo_step(taught_model, tmp_path):
    from hybridflow.trainer import PPOTrainer, load_config

    rows = [{"data_source": "calc", "prompt": QUESTION, "reward_model": {"ground_truth": "408"}}] * 4
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "tools.yaml").write_text("tools:\n  - class_name: calculator\n")
    (tmp_path / "reward.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    tool = [m['content'] for m in extra_info['messages'] if m['role'] == 'tool']\n"
        "    return {'score': float(tool == [ground_truth]), 'turns': len(extra_info['tool_calls'])}\n"
    )
    config = load_config(
        [
            f"data.train_files={tmp_path / 'train.jsonl'}",
            f"actor_rollout_ref.model.path={taught_model}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.total_training_steps=1",
            f"custom_reward_function.path={tmp_path / 'reward.py'}",
            "custom_reward_function.name=score",
            "algorithm.adv_estimator=grpo",
            "data.max_prompt_length=32",
            f"data.max_response_length={L}",
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.optim.lr=1e-4",
            "trainer.logger=[file]",
            "trainer.val_before_train=false",
            "actor_rollout_ref.rollout.temperature=0.5",  # as the loop test: the taught calls, not sampling luck
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
        ]
    )
    with PPOTrainer(config) as trainer:
        metrics = trainer.fit()
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["agent/turns/mean"] >= 1.5 and logged["agent/tool_errors"] == 0
    assert metrics["reward_extra/turns/mean"] == logged["agent/tool_calls/mean"]  # the reward saw the calls
    assert metrics["critic/score/mean"] > 0.5  # the tool's "408" reached the reward function
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))


def test_hostile_python_becomes_an_error_message_and_the_conversation_goes_on(tokenizer):
    eos = tokenizer.eos_token
    hostile = '<tool_call>{"name": "python", "arguments": {"code": "while True:\\n    pass"}}</tool_call>'
    engine = ScriptedEngine(tokenizer, [[hostile + eos], ["sorry" + eos]])
    tools = {"python": PythonTool({"timeout_s": 1, "cpu_s": 5})}
    out = loop(engine, tokenizer, response_length=256, tools=tools).generate_sequences(
        prompts(tokenizer, [QUESTION])
    )
    messages = out.non_tensor_batch["messages"][0]
    assert messages[-2] == {"role": "tool", "content": "Error: timed out after 1 s (wall clock)"}
    assert messages[-1] == {"role": "assistant", "content": "sorry"}
    assert (
        out.meta_info["metrics"]["agent/tool_errors"] == 1.0
        and out.meta_info["metrics"]["agent/turns/mean"] == 2
    )
