"""The commands that bring models in and take them out: pull, rm, show."""

from typing import Annotated

import typer
from rich.table import Table

from tierflow.cli.display import out, progress_bar
from tierflow.cli.options import option
from tierflow.units import format_size


def pull(name: Annotated[str, typer.Argument(
        help="Org/Model[:QUANT] (Q4_K_M when none is given), hf.co/Org/Model:QUANT or Org/Model/file.gguf")]
         ) -> None:
    """Download a model's GGUF file(s) from Hugging Face (HF_ENDPOINT, HF_TOKEN) into the Hugging Face
    cache, where -m Org/Model finds it; a cut download resumes where it stopped."""
    from tierflow.offload.store.pull import pull as pull_model

    with progress_bar(f"pulling {name}") as progress:
        pulled = pull_model(name, progress=progress)
    size = format_size(sum(file.size for file in pulled.files))
    how = "downloaded" if pulled.downloaded_bytes else "already here"
    out.print(f"{pulled.name}: {size} ({how}) at {pulled.path}", soft_wrap=True)


def pull_missing(model: str) -> None:
    """Pulls a Hugging Face name (or a preset's) that no store holds, as a load would, with a progress
    bar: `serve` does it for every model it serves before it starts."""
    from tierflow.offload.store.model_path import find_or_pull
    from tierflow.offload.store.model_stores import RepoName
    from tierflow.offload.store.presets import find_preset

    preset = find_preset(model)
    model = model if preset is None else preset.model
    if RepoName.parse(model) is not None:
        with progress_bar(f"pulling {model}") as progress:
            find_or_pull(model, progress)


def rm(name: Annotated[str, typer.Argument(help="a model in the Hugging Face cache, as `tierflow list` "
                                                "names it")]) -> None:
    """Remove a model from the Hugging Face cache, with its packs. ollama's and LM Studio's models are
    theirs to remove: tierflow never deletes them."""
    from tierflow.offload.store.removal import remove_model

    removed = remove_model(name)
    out.print(f"removed {removed.name}: {format_size(removed.nbytes)} freed"
              + (f", {len(removed.packs)} pack(s)" if removed.packs else ""), soft_wrap=True)
    for kept in removed.kept:
        out.print(f"kept {kept}: an ollama manifest names it", soft_wrap=True)


def show(model: Annotated[str, typer.Argument(help="a file, a model name or a preset")],
         template: Annotated[bool, option("--template", help="print the whole chat template")] = False
         ) -> None:
    """Show what a model is (architecture, parameters, quant, context, capabilities, license,
    recommended sampling, chat template) from its header, and a preset's settings."""
    from tierflow.offload.store.presets import find_preset
    from tierflow.runtime.api.model_info import model_card

    preset = find_preset(model)
    card = model_card(preset.model if preset else model)
    if template:
        print(card.chat_template or "")
        return
    table = Table(title=model, show_header=False)
    template_line = (card.chat_template or "none (chats in ChatML)").strip().splitlines()[0][:80]
    rows = (("file", card.path), ("architecture", card.arch),
            ("parameters", f"{card.parameter_size} ({card.num_parameters:,})"),
            ("quantization", card.quant_label), ("context length", card.context_length),
            ("file size", format_size(card.file_bytes)), ("capabilities", ", ".join(card.capabilities)),
            ("license", card.license or "not given"),
            ("recommended sampling", _settings(card.sampling) or "none (tierflow's defaults apply)"),
            ("chat template", template_line + (" ... (--template prints it)" if card.chat_template else "")))
    for key, value in rows:
        table.add_row(key, str(value))
    if preset is not None:
        table.add_row("preset", f"{preset.name}: {preset.model}")
        for key, value in (("load", _settings(preset.load)), ("sampling", _settings(preset.sampling)),
                           ("system", preset.system)):
            if value:
                table.add_row(f"preset {key}", value)
    out.print(table)


def _settings(values: dict) -> str:
    return ", ".join(f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"
                     for name, value in values.items())
