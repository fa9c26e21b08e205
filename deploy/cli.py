"""The `pdserve` command line: make-model, up, down, status, generate, rebalance, drain, bench."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(
    help="pdserve: disaggregated prefill/decode LLM serving on Ray, NIXL and Redis.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()
err_console = Console(stderr=True)


@app.callback()
def _root() -> None:
    """pdserve: disaggregated prefill/decode LLM serving on Ray, NIXL and Redis."""


@app.command("make-model")
def make_model_cmd(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the checkpoint into.")],
    preset: Annotated[str, typer.Option(help="tiny (trained, CPU) or llama3-8b (random).")] = "tiny",
    seed: Annotated[int, typer.Option(help="Seed: same seed, same bytes.")] = 0,
    dtype: Annotated[str | None, typer.Option(help="float32, bfloat16 or float16.")] = None,
    layers: Annotated[int | None, typer.Option(help="Number of decoder layers.")] = None,
    hidden: Annotated[int | None, typer.Option(help="Hidden size.")] = None,
    intermediate: Annotated[int | None, typer.Option(help="MLP intermediate size.")] = None,
    heads: Annotated[int | None, typer.Option(help="Attention heads.")] = None,
    kv_heads: Annotated[int | None, typer.Option(help="Key/value heads (GQA).")] = None,
    vocab: Annotated[int | None, typer.Option(help="Model vocabulary size.")] = None,
    train_steps: Annotated[int | None, typer.Option(help="Training steps on the corpus.")] = None,
    device: Annotated[str, typer.Option(help="Where random weights are drawn.")] = "cpu",
) -> None:
    """Write a Llama-architecture checkpoint in Hugging Face format (no download)."""
    from deploy.make_model import make_model

    overrides = {
        k: v
        for k, v in {
            "dtype": dtype,
            "num_layers": layers,
            "hidden_size": hidden,
            "intermediate_size": intermediate,
            "num_heads": heads,
            "num_kv_heads": kv_heads,
            "vocab_size": vocab,
            "train_steps": train_steps,
        }.items()
        if v is not None
    }
    try:
        path = make_model(out_dir, preset=preset, seed=seed, device=device, **overrides)
    except ValueError as e:
        err_console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from e
    console.print(f"wrote {preset} checkpoint to [bold]{path}[/bold]")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
