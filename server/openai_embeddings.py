"""OpenAI's embeddings request and response (`POST /v1/embeddings`): parsing, checking, building.

`input` is a text, a list of texts, a list of token ids or a list of lists of token ids; the
official client asks for `encoding_format` "base64" unless told otherwise (little-endian float32
bytes, which it decodes), and "float" gives JSON numbers. The vectors have the model's hidden
size: `dimensions` may only repeat it, since the model's vectors cannot be shortened.
"""

import base64
import json
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, Field, ValidationError, ValidatorFunctionWrapHandler, field_validator

from tierflow.server.openai_schema import STRICT, ApiError

TokenIds = Annotated[list[int], Field(fail_fast=True)]
EmbeddingInput = str | list[int]  # one input: a text or its token ids


class EmbeddingRequest(BaseModel):
    model_config = STRICT

    input: (str | Annotated[list[str], Field(fail_fast=True)] | TokenIds
            | Annotated[list[TokenIds], Field(fail_fast=True)])
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    @field_validator("input", mode="wrap")
    @classmethod
    def _one_of_the_shapes(cls, value: object, handler: ValidatorFunctionWrapHandler) -> object:
        """One message naming the shapes, rather than the first of the union's four failures."""
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("input must be a string, a list of strings, a list of token ids or a list "
                             "of lists of token ids") from None

    def inputs(self, max_inputs: int, width: int) -> list[EmbeddingInput]:
        """The inputs, one per vector asked for (checked_inputs)."""
        one = isinstance(self.input, str) or bool(self.input) and isinstance(self.input[0], int)
        return checked_inputs([self.input] if one else list(self.input), self.dimensions, max_inputs, width)


def checked_inputs(inputs: list[EmbeddingInput], dimensions: int | None, max_inputs: int,
                   width: int) -> list[EmbeddingInput]:
    """A request's inputs, one per vector: at least one, at most max_inputs; `dimensions` may only
    repeat the model's width, since its vectors cannot be shortened."""
    if dimensions is not None and dimensions != width:
        raise ApiError(400, f"dimensions is {dimensions}, but this model's embeddings have {width} and "
                       f"cannot be shortened", param="dimensions")
    if not inputs:
        raise ApiError(400, "input is empty: there is nothing to embed", param="input")
    if len(inputs) > max_inputs:
        raise ApiError(400, f"input has {len(inputs)} items; this server embeds at most {max_inputs} "
                       f"per request", param="input", code="too_many_inputs")
    return inputs


def text_chars(inputs: list[EmbeddingInput]) -> int:
    """The characters of text among the inputs (token ids are bounded by the body's size)."""
    return sum(len(item) for item in inputs if isinstance(item, str))


def embedding_response(vectors: np.ndarray, num_tokens: int, encoding_format: str, model: str) -> bytes:
    """The response body for vectors [N, E], rendered: a few MB of numbers, so that the caller
    can build it off the event loop."""
    data = [{"object": "embedding", "index": i, "embedding": _encoded(vector, encoding_format)}
            for i, vector in enumerate(vectors)]
    body = {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
    return json.dumps(body).encode()


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
