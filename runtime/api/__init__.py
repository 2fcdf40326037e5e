"""tierflow.runtime.api: what a user calls. A request enters here and leaves as text.

    engine.py       Engine: load, generate, stream, chat, score, embed (sync, streaming, async, cancellable);
                    light to import: its heavy collaborators load with the first model
    streams.py      a generation as an object: Stream, AsyncStream (made and run on the engine's threads)
    embeddings.py   engine.embed: pooled hidden states, several inputs in one pass
    model_info.py   what `tierflow info` shows
"""
