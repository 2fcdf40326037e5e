"""Splits a GGUF file into parts as llama.cpp's gguf-split does (`--split-max-tensors`): the first part
keeps every metadata entry, each part gets split.no, split.count and split.tensors.count, and the
tensors are spread over the parts in order, their bytes copied unchanged.

    split_gguf(model_path, tmp_path / "model", 3)   # model-00001-of-00003.gguf ...
"""

from pathlib import Path

import numpy as np

from tests.support.gguf_bytes import INT32, UINT16, Typed, pack_kv
from tests.support.gguf_writing import TensorEntry, encoded_kvs, write_gguf
from tierflow.offload.gguf.reader import read_gguf


def split_gguf(source: Path, stem: Path, num_parts: int) -> list[Path]:
    """Write `source` as num_parts files `<stem>-0000i-of-0000n.gguf`; returns their paths in order."""
    with read_gguf(source) as model:
        kvs = list(encoded_kvs(source).values())
        infos = list(model.tensors.values())
        paths = []
        for index, group in enumerate(np.array_split(np.arange(len(infos)), num_parts)):
            split_kvs = [pack_kv("split.no", Typed(UINT16, index)),
                         pack_kv("split.count", Typed(UINT16, num_parts)),
                         pack_kv("split.tensors.count", Typed(INT32, len(infos)))]
            tensors = [infos[i] for i in group]
            path = stem.with_name(f"{stem.name}-{index + 1:05d}-of-{num_parts:05d}.gguf")
            write_gguf(path, (kvs if index == 0 else []) + split_kvs,
                       [TensorEntry(info.name, info.shape, info.ggml_type) for info in tensors],
                       (model.tensor_data(info.name) for info in tensors), model.alignment)
            paths.append(path)
    return paths
