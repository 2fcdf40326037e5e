"""tierflow.offload.store: the models on this disk by name, and how they come and go.

    model_path.py   the file -m means: a path, a model name, or the bundled default
    model_names.py  a model name (ollama, Hugging Face, LM Studio) resolved to one file, or a clear error
    model_stores.py the stores on disk: ollama's manifests and blobs, the HF cache, LM Studio's folders
    model_list.py   `tierflow list`: every stored model, its size and what its header says
"""
