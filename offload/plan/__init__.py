"""tierflow.offload.plan"""
