"""tierflow.offload.experts"""
