"""An expert tier fed by hand, for tests of what ExpertTier does around its cache: reads (payloads:
futures) complete at once, except those of the experts in `held`, which the test completes itself;
an expert the cache does not hold would be read from disk."""

from concurrent.futures import Future

from tierflow.offload.experts.expert_cache import ExpertCache
from tierflow.offload.experts.tier import ExpertTier
from tierflow.runtime.models.config import ModelConfig, RopeScaling


class HandRead(Future):
    nbytes = 8  # what the cache counts


class HandReadTier(ExpertTier):
    def __init__(self):
        config = ModelConfig(arch="qwen3moe", name="hand", num_layers=2, hidden_size=8, ffn_size=8,
                             num_heads=1, num_kv_heads=1, head_dim=8, vocab_size=8, context_length=8,
                             rms_norm_eps=1e-6, rope_theta=1e4, rope_dim=8, rope_scaling=RopeScaling(),
                             tied_embeddings=True, num_experts=4, experts_used=3, expert_ffn_size=8)
        self.reads: dict[int, HandRead] = {}
        self.held: set[int] = set()
        super().__init__(config, ExpertCache(64, lambda key: 8, self._read, "lru"))
        self.prefetch = False

    def _read(self, key) -> HandRead:
        read = self.reads[key[1]] = HandRead()
        if key[1] not in self.held:
            read.set_result(f"expert {key[1]}")
        return read

    def _route(self, layer_idx, expert_tokens):
        return list(expert_tokens), iter(())

    def _weights(self, read: Future):
        return read.result()

    def _arrived(self, read: Future) -> bool:
        return read.done()

    def _on_disk(self, layer_idx: int, expert_id: int) -> bool:
        return (layer_idx, expert_id) not in self.cache
