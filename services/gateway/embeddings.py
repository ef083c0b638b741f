"""`POST /v1/embeddings`: OpenAI's embeddings API on the cluster's embedding requests.

Each input (a string or a list of token ids; one or a batch) is one prefill-only cluster
request (`AsyncClient.embed`): the served model's final-normed hidden states pooled over the
prompt (last token or mean: the scheduler's --pooling, or the body's `pooling`), L2-normalised
as OpenAI's embeddings are. `dimensions` keeps the first k components and normalises again,
OpenAI's way for Matryoshka-trained models (meaningful only for a model trained so; any other
is no better for it, so it is taken as asked). `encoding_format` float or base64 (the
little-endian float32 bytes: what the openai SDK asks for by default and decodes itself).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from zeroserve.common.embeddings import base64_vector
from zeroserve.common.errors import InvalidRequest
from zeroserve.services.gateway.completions import Route, parse_body

MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 naming it

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None  # an end-user id: used for nothing
    pooling: Literal["last", "mean"] | None = None  # ours: this request's pooling instead of the model's

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str):
            x = [x]
        elif x and isinstance(x[0], int):
            x = [x]
        if not x:
            raise InvalidRequest("input is empty; send a string, a list of strings or token ids")
        if len(x) > MAX_INPUTS:
            raise InvalidRequest(f"input holds {len(x)} items; at most {MAX_INPUTS} per request")
        for i, item in enumerate(x):
            if not item:
                raise InvalidRequest(f"input[{i}] is empty; every input needs some text or token ids")
        return list(x)


async def _create(gw, body: bytes) -> dict:
    req = parse_body(EmbeddingRequest, body)
    inputs = req.inputs()
    model = await gw.resolve_model(req.model)
    outs = await gw.client.embed(inputs, model, pooling=req.pooling, dimensions=req.dimensions,
                                 request_timeout_s=gw.cfg.request_timeout_s)
    n = sum(len(o.prompt_token_ids) for o in outs)
    enc = base64_vector if req.encoding_format == "base64" else list
    return {"object": "list", "model": model, "usage": {"prompt_tokens": n, "total_tokens": n},
            "data": [{"object": "embedding", "index": i, "embedding": enc(o.embedding)} for i, o in enumerate(outs)]}


ROUTES = {"/v1/embeddings": Route(_create)}
