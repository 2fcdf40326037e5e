"""What a generation measured (GenerationStats), and how a long prompt's prefill reports progress.

Apart from the token loop that fills them in, so that the API's result types import without torch.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

# Told (prompt tokens in the cache, prompt tokens) as a prefill starts and after each chunk: what a
# long prompt's progress is shown with.
PrefillProgress = Callable[[int, int], None]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt prefix reused from the previous call's KV cache
    generated_tokens: int = 0
    decode_steps: int = 0  # decode passes (a verify pass counts once); the first token is the prefill's
    drafted_tokens: int = 0  # speculative guesses the target verified
    accepted_tokens: int = 0  # of those, the ones it agreed with (each a token without a pass)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0  # of decode_seconds, spent by the draft proposing
    verify_seconds: float = 0.0  # of decode_seconds, spent by the target verifying guesses
    # of draft_seconds, those during which the streamed target's layers were being read (the draft
    # then costs nothing: the next verify pass waits for those reads either way)
    draft_hidden_seconds: float = 0.0
    # per tier (gpu, cpu, disk): the most bytes of weights (and, on the GPU, KV cache) held during
    # the generation, as TieredWeights.peak_bytes_by_tier measures them
    peak_weight_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def prefill_tokens_per_s(self) -> float:
        computed = self.prompt_tokens - self.cached_prompt_tokens
        return computed / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens each decode pass of the target gave (1 without speculation)."""
        return (self.decode_steps + self.accepted_tokens) / self.decode_steps if self.decode_steps else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decoded = self.decode_steps + self.accepted_tokens
        return decoded / self.decode_seconds if self.decode_seconds else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "decode_steps": self.decode_steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "draft_hidden_seconds": round(self.draft_hidden_seconds, 4),
            "tokens_per_pass": round(self.tokens_per_pass, 3),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 2),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "peak_weight_bytes": dict(self.peak_weight_bytes),
        }
