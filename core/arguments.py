"""Checks of the public API's arguments: a wrong type or value is an InvalidArgumentError that names
the argument, never a TypeError or UnicodeEncodeError from deep inside."""

from collections.abc import Sequence
from numbers import Integral

import numpy as np

from tierflow.errors import InvalidArgumentError

TOKEN_IDS = "token ids (a sequence of ints, or a 1-D integer array)"


def token_ids(ids: object, name: str, must: str) -> list[int]:
    """ids as a list of Python ints. Integers only (numpy's too): text, bytes, floats and bools are
    refused, not read as ids."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise InvalidArgumentError(f"{name} must be {must}, not a {ids.ndim}-D {ids.dtype} array")
        return ids.tolist()
    if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes, bytearray)):
        raise InvalidArgumentError(f"{name} must be {must}, not {type(ids).__name__}")
    for position, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, Integral):
            raise InvalidArgumentError(f"{name} must be {must}: {name}[{position}] is {token!r}")
    return [int(token) for token in ids]


def utf8_encoded(name: str, encode, *args) -> list[int]:
    """encode(*args), with text that cannot be UTF-8 (a lone surrogate, as from undecodable bytes)
    an InvalidArgumentError naming `name`."""
    try:
        return encode(*args)
    except UnicodeEncodeError as error:
        raise InvalidArgumentError(f"{name} cannot be encoded as UTF-8: {error.reason} "
                                   f"({error.object[error.start:error.end]!r})") from error


def flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be True or False, got {value!r}")
    return value


def stop_strings(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, Sequence) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise InvalidArgumentError(f"stop must be a str or a sequence of str, got {stop!r}")


CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")  # OpenAI's ("developer": a new system)


def check_roles(messages: object) -> None:
    """Refuses a chat message whose role is not one of CHAT_ROLES, naming the message and the role:
    a template would render it as whatever its role names, or fail on it. Messages that are not a
    list of dicts with string roles are left to the template's renderer, which says what they must be."""
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if isinstance(role, str) and role not in CHAT_ROLES:
            raise InvalidArgumentError(f"messages[{i}] has the role {role[:64]!r}; a chat message's role "
                                       f"is one of {', '.join(CHAT_ROLES)}")


MAX_PARALLEL = 64  # sequences decoded together: past this a batch's attention dominates anyway


def check_parallel(parallel: object) -> int | str:
    """The count of sequences decoded together (Engine.load's parallel), or "auto"."""
    if parallel == "auto":
        return "auto"
    if isinstance(parallel, bool) or not isinstance(parallel, Integral) or not 1 <= parallel <= MAX_PARALLEL:
        raise InvalidArgumentError(f"parallel must be an integer from 1 to {MAX_PARALLEL} or \"auto\", "
                                   f"got {parallel!r}")
    return int(parallel)
