"""tierflow.offload.gguf: a GGUF file, read as hostile input, and the model it holds.

    reader.py       read_gguf: header, metadata and tensor table, every length and offset checked
    model_file.py   open_model_file: the file's family (runtime/models/), its config, its tensors checked
    tensors.py      check_tensors: every tensor the family's map needs, of the right shape and a known type
    split_files.py  gguf-split's `-00001-of-00003.gguf` parts: found, checked, read as one model
    vocab_file.py   a metadata-only copy for llama.cpp's tokenizer when it cannot parse the tensors
    convert.py      `tierflow convert`: requantize a model's layer matmuls to 4, 3 or 2 bits
"""
