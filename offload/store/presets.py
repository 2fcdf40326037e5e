"""Presets: named ways to run a model, in a TOML file a person writes (ollama's Modelfile, in a form
Python users read). A preset's name goes wherever a model name does (`-m coder`, `Engine.load("coder")`,
a server's `model`):

    # ~/.config/tierflow/presets.toml (or the file TIERFLOW_PRESETS names)
    [coder]
    model = "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF:Q4_K_M"   # a path or model name; required
    context_length = 8192
    cpu_memory = "8GiB"
    system = "You are a careful programmer."
    [coder.sampling]
    temperature = 0.2
    top_p = 0.9

Every key is checked when the file is read: an unknown key or a value of the wrong type is an error
naming the file, the preset and the key.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from tierflow.errors import InvalidArgumentError

MAX_PRESETS_BYTES = 1 << 20
# Engine.load's options a preset may set, with the types TOML gives them.
LOAD_KEYS: dict[str, tuple[type, ...]] = {
    "context_length": (int,), "cpu_memory": (str, int), "gpu_memory": (str, int), "threads": (int,),
    "kv_cache_type": (str,), "draft": (str,), "chat_template": (str,),
}
SAMPLING_KEYS: dict[str, tuple[type, ...]] = {
    "temperature": (int, float), "top_k": (int,), "top_p": (int, float), "min_p": (int, float),
    "repeat_penalty": (int, float), "presence_penalty": (int, float), "frequency_penalty": (int, float),
    "repeat_last_n": (int,), "seed": (int,),
}
TEXT_KEYS = {"model": (str,), "system": (str,), "description": (str,)}


@dataclass(frozen=True)
class Preset:
    name: str
    model: str  # a path or a model name, never another preset
    load: dict = field(default_factory=dict)  # Engine.load's keywords
    sampling: dict = field(default_factory=dict)  # a generation's defaults
    system: str | None = None  # the system message of a chat that gives none
    description: str | None = None

    def filled(self, options: dict) -> dict:
        """Engine.load's options, the preset's in place of those not given (None)."""
        return options | {key: value for key, value in self.load.items() if options.get(key) is None}


def presets_file() -> Path:
    """TIERFLOW_PRESETS, else presets.toml in tierflow's folder of XDG_CONFIG_HOME (~/.config)."""
    if os.environ.get("TIERFLOW_PRESETS"):
        return Path(os.environ["TIERFLOW_PRESETS"]).expanduser()
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config / "tierflow" / "presets.toml"


def read_presets(path: Path | None = None) -> dict[str, Preset]:
    """Every preset of the file, by name; no file is no preset."""
    path = presets_file() if path is None else path
    try:
        if path.stat().st_size > MAX_PRESETS_BYTES:
            raise InvalidArgumentError(f"the presets file {path} is larger than {MAX_PRESETS_BYTES} bytes")
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidArgumentError(f"cannot read the presets file {path}: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise InvalidArgumentError(f"the presets file {path} is not valid TOML: {error}") from None
    presets = {name: _preset(path, name, table) for name, table in document.items()}
    for preset in presets.values():
        if preset.model in presets:
            raise InvalidArgumentError(f"preset [{preset.name}] of {path} runs preset {preset.model!r}: "
                                       "give a file or a model name as its model")
    return presets


def find_preset(name: object) -> Preset | None:
    """The preset a model argument names, if it is one (an existing path never is)."""
    if not isinstance(name, str) or os.path.lexists(name):
        return None
    return read_presets().get(name)


def _preset(path: Path, name: str, table: object) -> Preset:
    where = f"preset [{name}] of {path}"
    if not isinstance(table, dict):
        raise InvalidArgumentError(f"{path}: {name} = ... must be a table, [{name}], of a model and its "
                                   "settings")
    known = {*LOAD_KEYS, *TEXT_KEYS, "sampling"}
    unknown = sorted(set(table) - known)
    if unknown:
        raise InvalidArgumentError(f"{where}: unknown key {unknown[0]!r}; a preset takes "
                                   f"{', '.join(sorted(known))}")
    if "model" not in table:
        raise InvalidArgumentError(f"{where} names no model (model = \"a path or a model name\")")
    sampling = table.get("sampling", {})
    if not isinstance(sampling, dict):
        raise InvalidArgumentError(f"{where}: sampling must be a table ([{name}.sampling])")
    bad = sorted(set(sampling) - set(SAMPLING_KEYS))
    if bad:
        raise InvalidArgumentError(f"{where}: unknown sampling key {bad[0]!r}; [{name}.sampling] takes "
                                   f"{', '.join(sorted(SAMPLING_KEYS))}")
    for key, value in table.items():
        if key != "sampling":
            _check_type(where, key, value, (LOAD_KEYS | TEXT_KEYS)[key])
    for key, value in sampling.items():
        _check_type(where, f"sampling.{key}", value, SAMPLING_KEYS[key])
    return Preset(name, table["model"], {key: table[key] for key in LOAD_KEYS if key in table},
                  dict(sampling), table.get("system"), table.get("description"))


def _check_type(where: str, key: str, value: object, types: tuple[type, ...]) -> None:
    if isinstance(value, bool) or not isinstance(value, types):
        names = " or ".join({int: "an integer", float: "a number", str: "a string"}[t] for t in types)
        raise InvalidArgumentError(f"{where}: {key} must be {names}, not {value!r}")
