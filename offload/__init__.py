"""tierflow.offload"""
