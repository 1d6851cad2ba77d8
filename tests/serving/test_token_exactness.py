"""The served rollout trains on exactly the ids the server sampled, for five chat templates: calls that
continue each other form one row (the template's tokens between them masked out), and with a template
that is not append-only every call is a row of its own."""

import pytest

from hybridflow.config.schema import RolloutConfig
from hybridflow.models.tiny import CHAT_TEMPLATE
from hybridflow.serving import ServedRollout
from hybridflow.workers.rollout import HFRollout

CHATML_LOOP = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEMPLATES = {
    "chatml": (CHAT_TEMPLATE, True),
    "llama3_like": (
        "{{ '<|endoftext|>' }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n\n' + m['content']"
        " + '<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n\n' }}{% endif %}",
        True,
    ),
    "plain_headers": (
        "{% for m in messages %}{{ '### ' + m['role'] + ':\n' + m['content'] + '<|im_end|>\n\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '### assistant:\n' }}{% endif %}",
        True,
    ),
    "default_system": (
        "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant."
        "<|im_end|>\n' }}{% endif %}" + CHATML_LOOP,
        True,
    ),
    # rewrites its first line every turn: not append-only
    "turn_counter": (
        "{{ '<|im_start|>system\nTurn ' + (messages|length|string) + '<|im_end|>\n' }}" + CHATML_LOOP,
        False,
    ),
}

AGENT = """
async def run(client, sample):
    messages, calls = list(sample["messages"]), []
    for _ in range(3):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=6, extra_body={"return_token_ids": True}
        )
        calls.append((reply.model_extra["prompt_token_ids"], reply.choices[0].model_extra["token_ids"]))
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "Say hi."}]
    return {"score": 0.5, "calls": calls}
"""


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_trained_ids_are_the_served_ids(name, taught_model, chat_prompts, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    template, append_only = TEMPLATES[name]
    tokenizer = AutoTokenizer.from_pretrained(taught_model)
    tokenizer.chat_template = template
    model = AutoModelForCausalLM.from_pretrained(taught_model)
    (tmp_path / "agent.py").write_text(AGENT)
    config = RolloutConfig()
    config.served_agent.path = str(tmp_path / "agent.py")
    response_length = 128  # room for three calls of 6 tokens and the prompts between them
    rollout = ServedRollout(
        HFRollout(model, tokenizer, config, response_length), tokenizer, config, response_length
    )
    try:
        prompts = chat_prompts(tokenizer, ["Say hi.", "Compute 12*34."])
        prompts.meta_info["n"] = 2
        out = rollout.generate_sequences(prompts)
    finally:
        rollout.close()
    metrics = out.meta_info["metrics"]
    rows_per_session = 1 if append_only else 3
    assert len(out) == 4 * rows_per_session
    assert metrics["served/truncated"] == 0
    assert metrics["served/joined_calls"] == pytest.approx(2 / 3 if append_only else 0.0)
    sessions = {}
    for r in range(len(out)):
        calls = out.non_tensor_batch["reward_extra/calls"][r]  # what the agent returned beside its score
        sessions.setdefault(id(calls), []).append(r)
        attended = out.batch["attention_mask"][r].bool()
        ids = out.batch["input_ids"][r][attended].tolist()
        trained = out.batch["responses"][r][out.batch["response_mask"][r].bool()].tolist()
        lps = out.batch["rollout_log_probs"][r][out.batch["response_mask"][r].bool()]
        last = int(out.batch["response_mask"][r].nonzero().max())  # the session's reward on its last token
        assert out.batch["rm_scores"][r].nonzero().flatten().tolist() == [last]
        assert out.batch["rm_scores"][r, last] == 0.5
        if append_only:
            last_prompt, last_ids = calls[-1]
            assert ids == last_prompt + last_ids  # the row is the last call's prompt and sample, exactly
            assert ids[: len(calls[0][0])] == calls[0][0]
            assert trained == [t for _, sampled in calls for t in sampled]  # trained on the sampled ids only
            for prompt_ids, sampled in calls[1:]:  # each later prompt extends what came before it
                assert ids[: len(prompt_ids) + len(sampled)] == prompt_ids + sampled
        else:
            k = sorted(sessions[id(calls)]).index(r)
            assert ids == calls[k][0] + calls[k][1]
            assert trained == calls[k][1]
        assert (lps < 0).all()
    assert len(sessions) == 4 and all(len(v) == rows_per_session for v in sessions.values())
