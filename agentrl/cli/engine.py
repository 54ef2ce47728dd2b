"""`agentrl engine ...`: serve a local model over SGLang-compatible HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import typer

from agentrl.engine.server import serve
from agentrl.models.tiny import tiny_model_dir

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Inference engines.")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@app.command("serve")
def serve_cmd(
    model: str = typer.Option(..., "--model", help="Model directory (transformers format)."),
    port: int = typer.Option(30000, "--port"),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address; loopback unless you mean it."),
    device: str = typer.Option("cpu", "--device"),
    logprob_mode: str = typer.Option(
        "processed",
        "--logprob-mode",
        help="'processed': log-probs of softmax(logits/T), as SGLang; 'original': of softmax(logits).",
    ),
    cpu_threads: int = typer.Option(
        None, "--cpu-threads", help="Intra-op threads for generation (default: 1 for small models on CPU)."
    ),
    tp_size: int = typer.Option(
        1,
        "--tp-size",
        help="Simulated tensor-parallel size: tensor updates need one payload per rank, and a weight-update "
        "group gets one member per rank (the model itself stays one copy).",
    ),
    served_model_name: str = typer.Option(
        None, "--served-model-name", help="The model's name in /v1/models (default: the directory's name)."
    ),
    api_key: str = typer.Option(
        None,
        "--api-key",
        help="SGLang's --api-key: every request but /health* and /metrics* needs 'Authorization: Bearer "
        "KEY'. On a command line the key is visible to `ps`: start the server through "
        "`python -m agentrl.cluster.launch --key-file PATH -- ...` instead.",
    ),
    enable_lora: bool = typer.Option(
        False, "--enable-lora", help="Serve LoRA adapters (SGLang's flag): /load_lora_adapter, lora_path."
    ),
    max_lora_rank: int = typer.Option(None, "--max-lora-rank", help="Refuse adapters of a higher rank."),
    max_loaded_loras: int = typer.Option(
        None, "--max-loaded-loras", help="At most this many adapters loaded."
    ),
    lora_paths: list[str] = typer.Option(
        None, "--lora-paths", help="NAME=PATH adapters loaded at start (implies --enable-lora), as SGLang's."
    ),
    enable_return_routed_experts: bool = typer.Option(
        False, "--enable-return-routed-experts", help="Answer return_routed_experts (R3), as SGLang's flag."
    ),
    request_log: bool = typer.Option(
        True,
        "--request-log/--no-request-log",
        help="One INFO line per request (method, path, status, latency; never a prompt), whatever "
        "`agentrl --log-level` says for the rest.",
    ),
) -> None:
    """Serve MODEL with SGLang's /generate, its OpenAI-compatible /v1/models and /v1/chat/completions,
    and its control-plane endpoints (see agentrl.engine.server).

    Exits with status 1 after an error that would kill a real SGLang server (the reason is printed)."""

    logging.basicConfig(format=LOG_FORMAT)  # a no-op under `agentrl`, which configured logging
    if request_log:
        logging.getLogger("agentrl.engine.server").setLevel(logging.INFO)

    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ModuleNotFoundError as exc:
        typer.echo(
            f"`agentrl engine serve` needs {exc.name!r}, which is not installed: pip install -e '.[local]'",
            err=True,
        )
        raise typer.Exit(2) from None
    dead = None
    with contextlib.suppress(KeyboardInterrupt):
        dead = asyncio.run(
            serve(
                model,
                host=host,
                port=port,
                device=device,
                logprob_mode=logprob_mode,
                cpu_threads=cpu_threads,
                tp_size=tp_size,
                served_model_name=served_model_name,
                api_key=api_key,
                enable_lora=enable_lora,
                max_lora_rank=max_lora_rank,
                max_loaded_loras=max_loaded_loras,
                lora_paths=_lora_paths(lora_paths or []),
                enable_return_routed_experts=enable_return_routed_experts,
            )
        )
    if dead is not None:
        raise typer.Exit(1)


def _lora_paths(values: list[str]) -> dict[str, str]:
    out = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise typer.BadParameter(f"--lora-paths {value!r}: give NAME=PATH")
        out[name] = path
    return out


@app.command("tiny")
def tiny_cmd(
    seed: int = typer.Option(0, "--seed"),
    cache_dir: str = typer.Option(None, "--cache-dir", help="Defaults to $AGENTRL_CACHE/tiny."),
) -> None:
    """Build (once) the tiny GLM-family test model and print its directory."""

    typer.echo(str(tiny_model_dir(cache_dir, seed=seed)))
