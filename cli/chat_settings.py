"""What `/set`, `/save` and `/load` of `tierflow chat` read and write: the sampling settings a user
changed, and a conversation as a JSON file."""

import difflib
import json
from dataclasses import asdict
from pathlib import Path

from tierflow.errors import InvalidArgumentError
from tierflow.runtime.sampling.sampler import SamplingParams, as_count

# The settings /set changes, by the type its text is read as; each is checked by what the engine
# takes (SamplingParams, or a count for max_tokens).
SETTINGS: dict[str, type] = {"temperature": float, "top_k": int, "top_p": float, "min_p": float,
                             "repeat_penalty": float, "seed": int, "max_tokens": int}
UNSET = ("none", "default")  # `/set seed none`: back to the model's default (for seed: random)


def checked_settings(settings: dict) -> dict:
    """settings, if every name is a setting and every value one the engine accepts; else an
    InvalidArgumentError naming the first bad one."""
    if not isinstance(settings, dict):
        raise InvalidArgumentError(f"the settings must be an object, not {type(settings).__name__}")
    for name in settings:
        _check_name(name)
    SamplingParams.from_keywords({name: value for name, value in settings.items() if name != "max_tokens"})
    if "max_tokens" in settings:
        as_count("max_tokens", settings["max_tokens"])
    return dict(settings)


def with_setting(settings: dict, name: str, text: str) -> dict:
    """settings with `name` set to the value `text` spells (or unset by "none"), checked."""
    _check_name(name)
    if text.lower() in UNSET:
        return {key: value for key, value in settings.items() if key != name}
    kind = SETTINGS[name]
    try:
        value = kind(text)
    except ValueError:
        must = "an integer" if kind is int else "a number"
        raise InvalidArgumentError(f"{name} must be {must}, got {text!r}") from None
    return checked_settings(settings | {name: value})


def current_settings(settings: dict, model_defaults: dict) -> list[tuple[str, object, str]]:
    """(name, value, where it comes from) of every setting /set changes: set in this chat, the
    model file's recommendation, or tierflow's default; the values are those generation uses
    (tierflow's repeat penalty, for one, follows the temperature)."""
    chosen = model_defaults | settings
    used = asdict(SamplingParams.from_keywords({name: value for name, value in chosen.items()
                                                if name != "max_tokens"})) | settings
    def source(name: str) -> str:
        return "set" if name in settings else "model" if name in model_defaults else "tierflow"

    return [(name, used[name], source(name)) for name in SETTINGS if name in used]


def save_conversation(path: Path, system: str | None, messages: list[dict], settings: dict) -> None:
    try:
        path.write_text(json.dumps({"system": system, "messages": messages, "settings": settings},
                                   indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    except OSError as error:
        raise InvalidArgumentError(f"cannot write {path}: {error.strerror or error}") from None


def load_conversation(path: Path) -> tuple[str | None, list[dict], dict]:
    """(system prompt, messages, settings) a file /save wrote; anything else is an
    InvalidArgumentError naming the file and the problem."""
    try:
        saved = json.loads(path.read_bytes())
        if not isinstance(saved, dict):
            raise InvalidArgumentError(f"it holds a {type(saved).__name__}, not a saved conversation")
        system = saved.get("system")
        if system is not None and not isinstance(system, str):
            raise InvalidArgumentError("'system' must be a string or null")
        return system, _checked_messages(saved.get("messages")), checked_settings(saved.get("settings", {}))
    except OSError as error:
        raise InvalidArgumentError(f"cannot read {path}: {error.strerror or error}") from None
    except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, nested past the limit
        raise InvalidArgumentError(f"cannot load {path}: not a JSON file ({_one_line(error)})") from None
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"cannot load {path}: {error}") from None


def _checked_messages(messages: object) -> list[dict]:
    if not isinstance(messages, list):
        raise InvalidArgumentError("'messages' must be a list")
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and message.get("role") in ("user", "assistant")
                and isinstance(message.get("content"), str)):
            raise InvalidArgumentError(f"messages[{i}] must have a role 'user' or 'assistant' and a "
                                       f"string content")
    return [dict(message) for message in messages]


def _check_name(name: str) -> None:
    if name not in SETTINGS:
        close = difflib.get_close_matches(str(name), SETTINGS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise InvalidArgumentError(f"unknown setting {name!r}{hint}: the settings are {', '.join(SETTINGS)}")


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())[:200]
