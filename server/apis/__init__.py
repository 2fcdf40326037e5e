"""tierflow.server.apis: the APIs beside OpenAI's chat, each its request shapes and its routes.

    ollama_schema.py        ollama's requests, options and answers
    ollama_routes.py        /api/chat, /api/generate, /api/embed, /api/tags, /api/ps, /api/show, ...
    anthropic_schema.py     Anthropic's Messages: content blocks, answers, errors
    anthropic_routes.py     /v1/messages and /v1/messages/count_tokens
    responses_schema.py     OpenAI's Responses: input items, output items, kept conversations
    responses_routes.py     /v1/responses, whole and as its event stream
    llama_server_routes.py  /tokenize, /detokenize, /props
"""
