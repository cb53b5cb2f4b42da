"""Inference backends behind one small interface (``Backend``): local torch, vLLM, SGLang."""

from gateway.backends.interface import Backend, GenerationChunk, SamplingParams, TopLogprob
from gateway.backends.router import ReplicaRouter, ReplicaStatus, RoutedStream
from gateway.backends.sglang import SGLangBackend
from gateway.backends.vllm import VLLMBackend

__all__ = [
    "Backend",
    "GenerationChunk",
    "ReplicaRouter",
    "ReplicaStatus",
    "RoutedStream",
    "SGLangBackend",
    "SamplingParams",
    "TopLogprob",
    "VLLMBackend",
]
