"""tierflow.offload.pack: the packed model file, in the kernels' layout, built once per model.

    layout.py   one walk over a family's tensor map that sizes every extent's arrays from the
                header alone (the planner's bytes) or, with a decoder, also writes them
    writer.py   build_pack / open_pack: the file (extents, manifest, trailer), atomic, rebuilt when
                stale or damaged; pack_sizes for the planner
    built.py    BuiltPack: the same extents built in RAM at load, for a plan that reads nothing
                from disk (no pack written)
    cache.py    the packs folder: a pack per source file (by device, inode and sampled content),
                use records, the size cap (TIERFLOW_CACHE_MAX) with LRU eviction, the disk check
                before a build; listing, removal and pruning for `tierflow cache`
    reader.py   PackedFile: the manifest, and Weights viewing an extent's bytes in RAM or on a device
    temporaries.py  files written as NAME.<pid>.tmp, then renamed: locked while written, removed on
                SIGTERM; those of processes that are gone found and removed (stale_temporaries)
"""
