"""tierflow.offload.pack"""
