"""tierflow.offload.tiers"""
