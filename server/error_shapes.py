"""An error in the shape of the API its request came by: ollama's on /api/, Anthropic's on
/v1/messages, OpenAI's everywhere else (the server's own routes included)."""

from tierflow.server.apis.anthropic_schema import anthropic_error
from tierflow.server.apis.ollama_schema import ollama_error
from tierflow.server.openai_schema import ApiError


def error_body(path: str, error: ApiError) -> dict:
    if path.startswith("/api/"):
        return ollama_error(error)
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return anthropic_error(error)
    return error.body()
