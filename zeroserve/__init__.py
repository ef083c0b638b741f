"""zeroserve public API."""

from zeroserve.common.errors import (
    ClusterUnavailable,
    InvalidRequest,
    ModelLoadError,
    Overloaded,
    RequestTimeout,
    ZeroserveError,
)
from zeroserve.common.outputs import CompletionOutput, EmbeddingOutput, Logprob, RequestOutput
from zeroserve.common.sampling_params import SamplingParams

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EmbeddingOutput", "Logprob", "Client", "AsyncClient",
    "ZeroserveError", "InvalidRequest", "Overloaded", "RequestTimeout", "ClusterUnavailable", "ModelLoadError",
]


def __getattr__(name):  # import heavy parts (torch) only when used
    if name == "LLM":
        from zeroserve.llm import LLM

        return LLM
    if name == "AsyncClient":
        from zeroserve.client import AsyncClient

        return AsyncClient
    if name == "Client":
        from zeroserve.sync_client import Client

        return Client
    raise AttributeError(name)
