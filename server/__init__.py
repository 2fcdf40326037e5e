"""tierflow.server: the local HTTP server (OpenAI's, ollama's and Anthropic's APIs) and its chat page.

    routes.py               the app, OpenAI's chat, completions, embeddings and models routes, errors
    model_pool.py           the models served by name: loaded on demand, keep_alive, least recently used out
    generations.py          a request's way to a running generation, whatever its API
    admission.py            Admission: requests answered at once and queued, a 503 past them
    answers.py              an answer's parts (text, reasoning, tool calls, finish); OpenAI's events
    openai_schema.py        OpenAI's request fields honoured, refused, accepted; logprobs' shapes
    openai_embeddings.py    /v1/embeddings' request and response
    apis/                   the other APIs: ollama's, Anthropic's Messages, OpenAI's Responses, llama-server's
    error_shapes.py         each API's error body
    guards.py               Host, Origin, API key and JSON-body checks
    listen.py               binding the address before the load
    header_timeout.py       the time limit on a request's headers, in uvicorn's HTTP protocol
    metrics.py              /metrics and the request log
    chat.html               the chat page at /
"""
