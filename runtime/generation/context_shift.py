"""A conversation that outgrows the context goes on: its oldest turns are dropped, as llama.cpp's
context shift drops the oldest tokens after its n_keep.

The one rule `tierflow chat` and the server's /v1/chat/completions share: keep the system prompt
and the first user message (the start of the context, which says what the conversation is about),
then drop the oldest turns until the prompt and room for the answer fit. A turn here runs from an
assistant message up to the next user message, so what is kept still alternates user and
assistant (some chat templates refuse anything else) and a tool call stays with its results. The
last turn holds the message to answer and is kept; if its answer is too long itself (one cut by
the end of the context), its start is cut, the newest text kept, as llama.cpp's shift keeps the
newest tokens. Generation with `context_shift=True` then shifts the KV cache rather than
prefilling the kept history again (TokenGenerator.prefill).
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

from tierflow.errors import ContextLengthError

ANSWER_SHARE = 4  # an answer gets room for max_tokens, or a quarter of the context if that is less
CUT_MARK = "…"  # starts an answer whose start was cut

Tokenize = Callable[[list[dict]], list[int]]  # a conversation's prompt ids (Engine.tokenize_chat)


@dataclass(frozen=True)
class FittedChat:
    messages: list[dict]  # what is sent to the model: the given messages less the dropped ones
    prompt_ids: list[int]  # their prompt
    dropped: range  # indices of the given messages left out (oldest turns), empty when all fit
    cut_chars: int = 0  # characters cut from the start of the last answer (CUT_MARK stands for them)

    @property
    def shifted(self) -> bool:
        return bool(self.dropped) or self.cut_chars > 0


def answer_room(context_length: int, max_tokens: int | None = None) -> int:
    """The tokens a turn keeps free for its answer."""
    share = max(1, context_length // ANSWER_SHARE)
    return share if max_tokens is None else max(1, min(max_tokens, share))


def fit_chat(messages: list[dict], tokenize_chat: Tokenize, context_length: int,
             max_tokens: int | None = None) -> FittedChat:
    """messages with the fewest oldest turns dropped that leave answer_room free; if no number
    does, all of them and the start of the last answer, as little as leaves the room (or one
    token, if even its whole text does not). Raises ContextLengthError when the kept messages
    leave no room at all."""
    def fits(fitted: FittedChat, room: int) -> bool:
        return len(fitted.prompt_ids) + room <= context_length

    room = answer_room(context_length, max_tokens)
    fitted = _drop_turns(messages, tokenize_chat, lambda fitted: fits(fitted, room))
    if not fits(fitted, room):
        fitted = _cut_last_answer(fitted, tokenize_chat, lambda fitted: fits(fitted, room))
    if not fits(fitted, 1):
        raise ContextLengthError(
            f"the conversation has {len(fitted.prompt_ids)} tokens even with its oldest turns dropped "
            f"(the system prompt, the first user message and the last turn are kept) but the context "
            f"holds {context_length} (one more is needed to generate)")
    return fitted


def _drop_turns(messages: list[dict], tokenize_chat: Tokenize, fits: Callable[[FittedChat], bool]
                ) -> FittedChat:
    """messages less the fewest oldest turns that fits them, or less all of them."""
    start, ends = _turns(messages)

    def dropping(num_turns: int) -> FittedChat:
        dropped = range(start, ends[num_turns - 1] if num_turns else start)
        kept = messages[:dropped.start] + messages[dropped.stop:]
        return FittedChat(kept, tokenize_chat(kept), dropped)

    whole = dropping(0)
    if fits(whole) or not ends:
        return whole
    # each try renders and tokenizes the conversation: a search, not a count
    return _fewest(1, len(ends), dropping, fits)


def _cut_last_answer(fitted: FittedChat, tokenize_chat: Tokenize, fits: Callable[[FittedChat], bool]
                     ) -> FittedChat:
    """fitted with the start of its last answer cut, as little as fits, or all of it (whatever
    then fits); itself if it has no answer before the message to answer."""
    answers = [i for i, message in enumerate(fitted.messages[:-1]) if message.get("role") == "assistant"]
    text = fitted.messages[answers[-1]].get("content") if answers else None
    if not isinstance(text, str) or not text:
        return fitted
    index = answers[-1]

    def cutting(num_chars: int) -> FittedChat:
        messages = list(fitted.messages)
        messages[index] = {**messages[index], "content": CUT_MARK + text[num_chars:]}
        return replace(fitted, messages=messages, prompt_ids=tokenize_chat(messages), cut_chars=num_chars)

    return _fewest(1, len(text), cutting, fits)


def _fewest(low: int, high: int, attempt: Callable[[int], FittedChat],
            fits: Callable[[FittedChat], bool]) -> FittedChat:
    """attempt(n) for the least n in [low, high] that fits (more cut, fewer tokens), else attempt(high)."""
    tried: dict[int, FittedChat] = {}

    def fitting(n: int) -> bool:
        tried[n] = tried.get(n) or attempt(n)
        return fits(tried[n])

    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if fitting(middle) else (middle + 1, high)
    return tried.get(low) or attempt(low)


def _turns(messages: list[dict]) -> tuple[int, list[int]]:
    """Where the droppable turns start (after the leading system messages and the first user
    message), and where each ends; the last turn, which holds the message to answer, is not one."""
    users = [i for i, message in enumerate(messages) if message.get("role") == "user"]
    if not users:
        return len(messages), []
    start, ends = users[0] + 1, []
    for i in range(start + 1, users[-1]):
        if messages[i].get("role") != "user" and messages[i - 1].get("role") == "user":
            ends.append(i)  # a turn ends where the next one's assistant message starts
    return start, ends
