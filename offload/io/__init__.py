"""tierflow.offload.io: moving weights from disk to RAM.

    disk.py          DiskFile: O_DIRECT reads into page-aligned buffers (buffered, then dropped, where
                     a file system refuses O_DIRECT)
    buffer_pool.py   BufferPool: aligned read buffers reused within a byte budget
    streamer.py      LayerStreamer: the streamed layers read ahead into a ring of buffers
    heap.py          give_back_freed_memory: the C allocator's free pages returned after a build or probe
"""
