"""tierflow.server: the local OpenAI-compatible HTTP server and its chat page.

    routes.py             the app: routes, the request's path from body to answer, the queue
    admission.py          Admission: requests answered at once and queued, a 503 past them
    answers.py            an answer whole or as server-sent events
    openai_schema.py      the request fields honoured, refused, accepted; logprobs' shapes
    openai_embeddings.py  /v1/embeddings' request and response
    guards.py             Host, Origin, API key and JSON-body checks
    listen.py             binding the address before the load
    header_timeout.py     the time limit on a request's headers, in uvicorn's HTTP protocol
    metrics.py            /metrics and the request log
    chat.html             the chat page at /
"""
