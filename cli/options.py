"""What every command's options share."""

import typer


def option(flag: str, *aliases: str, **settings) -> typer.models.OptionInfo:
    """An option the environment can set too: --cpu-memory is also TIERFLOW_CPU_MEMORY."""
    return typer.Option(flag, *aliases, envvar="TIERFLOW_" + flag.lstrip("-").replace("-", "_").upper(),
                        **settings)
