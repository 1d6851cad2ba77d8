"""``hybridflow serve --model RUN_OR_FOLDER``: any checkpoint behind an OpenAI-compatible endpoint, for an
evaluation harness, an agent or a chat.

The command loads the checkpoint (run folders are the ``runs`` room's business), builds the portable ``hf``
engine over it and hands it to ``PolicyServer``, which knows only the rollout contract. Defaults come from the
schema (``RolloutConfig``: sampling and micro-batching; ``ServedAgentConfig.batch_window_ms``), so a served
checkpoint batches as a training run's served rollout does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re

from hybridflow.config.schema import RolloutConfig, ServedAgentConfig
from hybridflow.data.images import ImagePrompts
from hybridflow.runs.trained_model import load_trained_actor
from hybridflow.serving import PolicyServer
from hybridflow.workers.rollout import HFRollout

TOKEN_ENV = "HYBRIDFLOW_SERVE_TOKEN"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridflow serve", description="Serve a checkpoint over an OpenAI-compatible HTTP endpoint."
    )
    parser.add_argument(
        "--model", required=True, help="run folder, global_step_N folder, model folder or 'default'"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind; not loopback needs --token")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    parser.add_argument("--token", default=os.environ.get(TOKEN_ENV), help=f"bearer token (or ${TOKEN_ENV})")
    parser.add_argument(
        "--served-model-name",
        "--name",
        nargs="+",
        default=None,
        help="the model name(s) requests may give, listed by /v1/models (default: the folder's name); a "
        "request naming another model gets 404 model_not_found (vLLM's flag)",
    )
    parser.add_argument("--max-tokens", type=int, default=512, help="most tokens a call may generate")
    window = ServedAgentConfig().batch_window_ms
    parser.add_argument(
        "--batch-window-ms", type=float, default=window, help=f"how long a call waits for others ({window:g})"
    )
    parser.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="a folder whose image files chat calls may name in image_url parts (a vision-language model; "
        "otherwise only data: URLs; URLs on the network are never fetched)",
    )
    return parser


def weight_version_of(folder: str) -> int:
    """The training step a checkpoint folder was saved at (``global_step_N``), else 0."""
    found = re.findall(r"global_step_(\d+)", folder)
    return int(found[-1]) if found else 0


def main(argv: list[str]) -> int:
    """Load ``--model`` and serve it until interrupted."""
    args = _parser().parse_args(argv)
    model, tokenizer = load_trained_actor(args.model)
    folder = str(model.name_or_path or args.model)
    engine = HFRollout(model, tokenizer, RolloutConfig(), args.max_tokens)
    version = weight_version_of(folder)
    text = model.config.get_text_config()  # a Hugging Face config: which fields it has depends on the model
    limit = getattr(text, "max_position_embeddings", None)
    server = PolicyServer(
        engine,
        tokenizer,
        args.served_model_name or [os.path.basename(folder.rstrip("/")) or "policy"],
        host=args.host,
        port=args.port,
        token=args.token,
        max_tokens_limit=args.max_tokens,
        max_model_len=limit,
        window_s=args.batch_window_ms / 1000,
        weight_version=lambda: version,
        processor=ImagePrompts.from_pretrained(folder, tokenizer) if os.path.isdir(folder) else None,
        allowed_local_media_path=args.allowed_local_media_path,
    )

    async def serve() -> None:
        url = await server.start()
        print(f"serving {folder} (weight version {version}) at {url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await server.stop()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0
