"""tierflow.offload.gguf: a GGUF file, read as hostile input, and the model it holds.

    reader.py       read_gguf: header, metadata and tensor table, every length and offset checked
    model_file.py   open_model_file: the file's family (runtime/models/), its config, its tensors checked
    tensors.py      check_tensors: every tensor the family's map needs, of the right shape and a known type
    model_path.py   the file -m means: a path, a model name, or the bundled default
    model_names.py  a model name (ollama, Hugging Face, LM Studio) resolved to one file, or a clear error
    model_stores.py the stores on disk: ollama's manifests and blobs, the HF cache, LM Studio's folders
    model_list.py   `tierflow list`: every stored model, its size and what its header says
    split_files.py  gguf-split's `-00001-of-00003.gguf` parts: found, checked, read as one model
    vocab_file.py   a metadata-only copy for llama.cpp's tokenizer when it cannot parse the tensors
    convert.py      `tierflow convert`: requantize a model's layer matmuls to 4, 3 or 2 bits
"""
