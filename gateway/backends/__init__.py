"""Inference backends behind one small interface (``Backend``): local torch, vLLM, SGLang.

- ``interface``: the port: ``Backend``, ``Prompt``, ``SamplingParams``, ``GenerationChunk``.
- ``local`` (+ ``sampler``, its token sampling and processed log-probs): a Hugging Face model
  in this process (imported on demand: it needs torch).
- ``remote``: the HTTP backends' base (``RemoteBackend``: admit, POST, read the stream or the
  whole response, map transport errors); ``vllm`` (+ ``vllm_reader``) and ``sglang`` supply
  only their request body and their reader of the server's JSON (``payload``: checked fields).
- ``transport``: the keep-alive HTTP/1.1 client they send through; ``served_model``: what a
  server serves (``/v1/models``); ``probe``: what a replica's log-probs are.
- ``router``: replicas behind one ``Backend`` (``ReplicaRouter``); ``policy_watch``: weight
  versions from the log.
"""

from gateway.backends.interface import Backend, GenerationChunk, Prompt, SamplingParams, TopLogprob
from gateway.backends.remote import RemoteBackend, RemoteOptions
from gateway.backends.router import ReplicaRouter, ReplicaStatus, RoutedStream
from gateway.backends.sglang import SGLangBackend
from gateway.backends.vllm import VLLMBackend

__all__ = [
    "Backend",
    "GenerationChunk",
    "Prompt",
    "RemoteBackend",
    "RemoteOptions",
    "ReplicaRouter",
    "ReplicaStatus",
    "RoutedStream",
    "SGLangBackend",
    "SamplingParams",
    "TopLogprob",
    "VLLMBackend",
]
