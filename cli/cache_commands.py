"""`tierflow cache`: list and remove the packs (offload/pack/pack_cache.py)."""

import json
from datetime import datetime
from typing import Annotated, Optional

import typer
from rich.table import Table

from tierflow.cli.display import out
from tierflow.cli.options import option
from tierflow.units import format_size, parse_size

cache_app = typer.Typer(help="List and remove the packs: each model's weights in the kernels' layout, "
                        "written to the cache folder on first load.", no_args_is_help=True)


@cache_app.command("list")
def cache_list(as_json: Annotated[bool, option("--json", help="print the packs as JSON")] = False
               ) -> None:
    """Show each pack: its model file, size, last use, and whether that file is still there; and the
    temporaries that builds killed midway left (`tierflow cache prune` removes them)."""
    from tierflow.offload.pack.pack_cache import list_packs, packs_folder, stale_files, total_bytes

    packs, stale = list_packs(), stale_files()
    stale_bytes = sum(temporary.nbytes for temporary in stale)
    if as_json:
        print(json.dumps({"folder": str(packs_folder()), "total_bytes": total_bytes(packs),
                          "packs": [pack.as_dict() for pack in packs], "stale_bytes": stale_bytes,
                          "stale_temporaries": [temporary.as_dict() for temporary in stale]}))
        return
    caption = f"total {format_size(total_bytes(packs))}"
    if stale:
        caption += (f"; and {format_size(stale_bytes)} in {len(stale)} temporary file(s) left by builds that "
                    f"were killed ({', '.join(temporary.path.name for temporary in stale)}): tierflow cache "
                    f"prune removes them")
    table = Table(title=f"packs in {packs_folder()}", caption=caption)
    for column in ("pack", "model file"):
        table.add_column(column, overflow="fold")  # whole: a name is what `cache rm` takes
    for column in ("size", "last used", "model file present"):
        table.add_column(column)
    for pack in packs:
        last_used = datetime.fromtimestamp(pack.last_used_ns / 1e9).strftime("%Y-%m-%d %H:%M")
        table.add_row(pack.path.name, str(pack.source or "unknown"), format_size(pack.nbytes), last_used,
                      "yes" if pack.source_exists else "no")
    out.print(table)


@cache_app.command("rm")
def cache_rm(name_or_path: Annotated[str, typer.Argument(
        help="a pack's name (as `tierflow cache list` shows it) or path, or a model file for its pack")]
             ) -> None:
    """Remove one pack (the model file itself is never touched)."""
    from tierflow.offload.pack.pack_cache import find_pack, remove_pack

    pack = find_pack(name_or_path)
    size = pack.stat().st_size
    remove_pack(pack)
    out.print(f"removed {pack} ({format_size(size)})", soft_wrap=True)


@cache_app.command("prune")
def cache_prune(max_size: Annotated[Optional[str], option(
        "--max-size", help="what the packs may take afterwards, e.g. 20GiB (default: TIERFLOW_CACHE_MAX, "
        "else a quarter of the cache's disk)")] = None) -> None:
    """Remove the temporary files that builds killed midway left, the packs whose model file is
    gone or changed, then the least recently used ones until the rest fit --max-size."""
    from tierflow.offload.pack.pack_cache import prune

    removed = prune(None if max_size is None else parse_size(max_size))
    for temporary in removed.temporaries:
        out.print(f"removed {temporary.path.name} ({format_size(temporary.nbytes)}, left by process "
                  f"{temporary.pid}, which ended before it was done)", soft_wrap=True)
    for pack in removed.packs:
        why = "least recently used" if pack.source_exists else "model file gone"
        out.print(f"removed {pack.path.name} ({format_size(pack.nbytes)}, {why})", soft_wrap=True)
    out.print(f"freed {format_size(removed.nbytes)}")
