"""tierflow.offload.gguf"""
