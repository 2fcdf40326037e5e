"""tierflow.offload.io"""
