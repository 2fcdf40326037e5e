"""tierflow.offload.experts: a mixture-of-experts model's experts through a cache.

    cache.py          ExpertCache: what the fast tier keeps within its budget, and what happened
    policy.py         which expert to evict: LRU, LFU, and the score policy (frequency, recency,
                      prediction)
    prediction.py     the next layer's experts before it routes: its router applied early, affinity
    tier.py           ExpertTier: a layer step through the cache with prediction, shared by:
    store.py            StreamedExperts: experts read from the pack into a cache in RAM;
                        ExpertStore: computing them on the CPU
    hybrid.py           HybridExperts: a cache on the GPU over experts in RAM (or over a
                        StreamedExperts: three tiers), each scheduled on the
                        device that finishes the layer soonest
    routing_trace.py  recording which experts tokens used, kept beside the pack for the planner's
                      hit rates and for benchmarks/moe.py to replay
"""
