"""What serving the policy over HTTP costs: per-call overhead and the throughput of concurrent sessions.

1. Per-call overhead: the same greedy call (one prompt, ``--overhead-tokens`` new tokens) as a direct
   ``HFRollout.generate_sequences`` and through the server with the ``openai`` client (one connection kept
   alive), alternating; overhead = p50 served - p50 direct, and p50 of (served - the engine time the server
   measured for that call). Measured with the batching window at 0, 2 and 10 ms, and with no engine at all
   (what the server, HTTP and the client cost).
2. Throughput: 32 sessions, each one chat call on its own prompt, sent at once by ``openai.AsyncOpenAI``
   clients, against one batched ``generate_sequences`` of the same 32 prompts. Greedy, so both generate
   exactly the same tokens; the ratio is the direct call's time over the sessions' time.

    .venv/bin/python bench/serve.py [--model tiny|default|PATH] [--out bench/results/serve.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.config.schema import RolloutConfig
from hybridflow.data.dataset import left_pad
from hybridflow.models import make_tiny_model, resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.rollout import Rollout
from hybridflow.serving import PolicyServer
from hybridflow.workers.rollout import HFRollout

QUESTIONS = [f"Compute {10 + i}+{20 + 2 * i}. Reply in the form A+B=<answer>." for i in range(32)]


def batch_of(rows: list[list[int]], pad: int, tokens: int) -> DataProto:
    width = max(map(len, rows))
    padded = [left_pad(r, width, pad) for r in rows]
    return DataProto.from_dict(
        {k: torch.stack([p[k] for p in padded]) for k in padded[0]},
        meta_info={"n": 1, "do_sample": False, "response_length": tokens},
    )


class InstantEngine(Rollout):
    """The rollout contract with no model: ``response_length`` copies of one token. Served through it, a
    call costs only what the server, HTTP and the client add."""

    def __init__(self, eos_token_id: int) -> None:
        self.eos_token_ids = [eos_token_id]

    def generate_sequences(self, batch: DataProto) -> DataProto:
        rows, length = len(batch), batch.meta_info["response_length"]
        return DataProto.from_dict(
            {
                "responses": torch.full((rows, length), 5),
                "response_mask": torch.ones(rows, length, dtype=torch.long),
                "rollout_log_probs": torch.zeros(rows, length),
            }
        )


def p50_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def overhead(engine, tokenizer, prompt: list[int], tokens: int, calls: int, window_ms: float) -> dict:
    """Direct and served calls alternate (the machine's load drifts); the served call's overhead is also
    taken against the engine time the server itself measured for that very call."""
    import openai

    server = PolicyServer(engine, tokenizer, "policy", max_tokens_limit=512, window_s=window_ms / 1000)
    url = server.start_in_thread()
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    direct, served, own = [], [], []
    try:
        for _ in range(calls + 3):
            start = time.perf_counter()
            engine.generate_sequences(batch_of([prompt], tokenizer.pad_token_id, tokens))
            direct.append(time.perf_counter() - start)
            start = time.perf_counter()
            client.completions.create(model="policy", prompt=prompt, max_tokens=tokens, temperature=0)
            served.append(time.perf_counter() - start)
            own.append(served[-1] - server.batcher.last_engine_s)
    finally:
        client.close()
        server.stop_thread()
    direct, served, own = direct[3:], served[3:], own[3:]  # warm-up calls left out
    return {
        "window_ms": window_ms,
        "direct_p50_ms": p50_ms(direct),
        "served_p50_ms": p50_ms(served),
        "overhead_p50_ms": p50_ms(served) - p50_ms(direct),
        "overhead_vs_own_engine_time_p50_ms": p50_ms(own),
    }


def throughput(
    engine, tokenizer, prompts: list[list[int]], tokens: int, window_ms: float, repeats: int
) -> dict:
    """Rounds of 32 sessions (one ``AsyncOpenAI`` client each, sharing one connection pool, as the served
    rollout does) alternate with the one batched call."""
    import openai

    server = PolicyServer(engine, tokenizer, "policy", max_tokens_limit=512, window_s=window_ms / 1000)
    base = server.start_in_thread().removesuffix("/v1")

    async def sessions() -> int:
        http = openai.DefaultAsyncHttpxClient()
        clients = [
            openai.AsyncOpenAI(
                base_url=f"{base}/sessions/b{i}/v1", api_key="x", max_retries=0, http_client=http
            )
            for i in range(len(prompts))
        ]
        try:
            replies = await asyncio.gather(
                *(
                    c.completions.create(model="policy", prompt=p, max_tokens=tokens, temperature=0)
                    for c, p in zip(clients, prompts)
                )
            )
        finally:
            await http.aclose()
        return sum(r.usage.completion_tokens for r in replies)

    direct, served, batch_rows = [], [], []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            out = engine.generate_sequences(batch_of(prompts, tokenizer.pad_token_id, tokens))
            direct.append(time.perf_counter() - start)
            before = len(server.batcher.batch_sizes)
            start = time.perf_counter()
            served_tokens = asyncio.run(sessions())
            served.append(time.perf_counter() - start)
            batch_rows.append(server.batcher.batch_sizes[before:])
    finally:
        server.stop_thread()
    generated = int(out.batch["response_mask"].sum())
    assert served_tokens == generated, (served_tokens, generated)  # the same work, greedy
    return {
        "window_ms": window_ms,
        "sessions": len(prompts),
        "new_tokens": tokens,
        "generated_tokens": generated,
        "direct_s": statistics.median(direct),
        "sessions_s": statistics.median(served),
        "ratio": statistics.median(direct) / statistics.median(served),
        "engine_calls_per_round": [len(r) for r in batch_rows],
        "batch_rows": batch_rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="tiny", help="tiny (built here), default (SmolLM2-135M) or a folder"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/serve.json"))
    parser.add_argument("--calls", type=int, default=50, help="calls per overhead measurement")
    parser.add_argument("--overhead-tokens", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per session in the throughput run")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    path = args.model
    if path == "tiny":
        path = make_tiny_model(
            Path(tempfile.mkdtemp(prefix="serve-bench-")) / "model", hidden_size=256, num_layers=4
        )
    path = resolve_model_path(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = HFRollout(model, tokenizer, RolloutConfig(), 512)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
        )
        for q in QUESTIONS
    ]
    results = {
        "model": args.model,
        "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "overhead": [
            {
                **overhead(
                    InstantEngine(tokenizer.eos_token_id),
                    tokenizer,
                    prompts[0],
                    args.overhead_tokens,
                    args.calls,
                    0.0,
                ),
                "engine": "none (InstantEngine)",
            },
            *[
                overhead(engine, tokenizer, prompts[0], args.overhead_tokens, args.calls, w)
                for w in (0.0, 2.0, 10.0)
            ],
        ],
        "throughput": [
            throughput(engine, tokenizer, prompts, args.tokens, w, args.repeats) for w in (0.0, 2.0, 10.0)
        ],
    }
    print(f"model {args.model}, {results['torch_threads']} torch threads")
    print(
        "| engine | window | direct p50 ms | served p50 ms | difference | served - its own engine time, p50 ms |"
    )
    print("|---|---|---|---|---|---|")
    for r in results["overhead"]:
        print(
            f"| {r.get('engine', args.model)} | {r['window_ms']:g} ms | {r['direct_p50_ms']:.2f} | {r['served_p50_ms']:.2f} | "
            f"{r['overhead_p50_ms']:.2f} | {r['overhead_vs_own_engine_time_p50_ms']:.2f} |"
        )
    print("\n| batching window | 32 sessions s | one batched call s | ratio | engine calls per round |")
    print("|---|---|---|---|---|")
    for r in results["throughput"]:
        print(
            f"| {r['window_ms']:g} ms | {r['sessions_s']:.2f} | {r['direct_s']:.2f} | {r['ratio']:.2f} | {r['engine_calls_per_round']} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
