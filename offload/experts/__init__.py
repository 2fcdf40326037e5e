"""tierflow.offload.experts: a mixture-of-experts model's experts through a cache.

    cache.py          ExpertCache: what the fast tier keeps within its budget, and what happened
    policy.py         which expert to evict: LRU, LFU, and the score policy (frequency, recency,
                      prediction)
    prediction.py     the next layer's experts before it routes: its router applied early, affinity
    tier.py           ExpertTier: a layer step through the cache with prediction, shared by:
    store.py            ExpertStore: experts streamed from the pack into a cache in RAM
    hybrid.py           HybridExperts: experts in RAM, a cache on the GPU, each scheduled on the
                        device that finishes the layer soonest
    routing_trace.py  recording which experts tokens used, for benchmarks/moe.py to replay
"""
