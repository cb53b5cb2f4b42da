"""Settings of the trainer sink (plain pydantic models, filled by the composition root)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["AssemblySettings", "BatchingSettings", "LiveSourceSettings"]


class BatchingSettings(BaseModel):
    """How trajectories are grouped into batches (``trainer_sink.batching``)."""

    model_config = ConfigDict(frozen=True)

    policy: Literal["count", "tokens", "groups"] = Field(
        "count", description="count: batch_size samples; tokens: up to token_budget; groups: GRPO"
    )
    batch_size: int = Field(
        8, ge=1, description="count: samples per batch; groups: groups per batch"
    )
    token_budget: int = Field(
        65_536, ge=1, description="tokens: the most tokens (sum of input lengths) in one batch"
    )
    group_size: int = Field(4, ge=1, description="groups: samples per GRPO group (n)")
    group_timeout_s: float = Field(
        300.0, gt=0, description="groups: an incomplete group is handled after this long"
    )
    incomplete_groups: Literal["drop", "release"] = Field(
        "drop", description="groups: what happens to a group still incomplete at its timeout"
    )
    drop_uniform_groups: bool = Field(
        False, description="groups: drop groups whose rewards are all equal (no GRPO signal)"
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="a sample whose oldest generated token is more than this many weight "
        "versions behind the trainer's is stale; unset: no bound",
    )
    stale: Literal["drop", "flag"] = Field(
        "drop", description="drop stale samples, or keep them with stale=True"
    )
    keep_side_calls: bool = Field(
        False,
        description="keep samples of side requests (metadata side=true: compaction, auxiliary, "
        "side_reply, count_tokens) in the batches; by default they are dropped (side_call), "
        "the shards keep them",
    )
    dedup_window: int = Field(
        65_536,
        ge=1,
        description="trajectory ids (and sessions of finished groups) remembered after release "
        "to drop redeliveries; ids still held are always known",
    )


class AssemblySettings(BaseModel):
    """How a batch of trajectories becomes tensors (``trainer_sink.assembly``)."""

    model_config = ConfigDict(frozen=True)

    layout: Literal["padded", "jagged"] = Field("padded", description="padded (verl) or jagged")
    pad_token_id: int = Field(0, description="padding id in prompts / responses / input_ids")
    max_prompt_len: int | None = Field(
        None, ge=1, description="fixed prompt length P (left-padded); unset: the batch's longest"
    )
    max_response_len: int | None = Field(
        None, ge=1, description="fixed response length R (right-padded); unset: the batch's longest"
    )
    truncate: bool = Field(
        True,
        description="over a fixed length: cut (prompt from the left, response from the right) "
        "and set truncated=True; false: a BatchError",
    )
    multi_modal_inputs: bool = Field(
        True,
        description="give each sample an empty multi_modal_inputs dict, which verl's trainer "
        "reads for every sample",
    )
    reuse_memory: bool = Field(
        True,
        description="padded: write a batch into the memory of earlier batches nothing refers "
        "to any more (trainer_sink.buffers) instead of fresh pages; false: allocate each batch",
    )


class LiveSourceSettings(BaseModel):
    """The live source: a durable pull consumer on TRAJ."""

    model_config = ConfigDict(frozen=True)

    durable: str = Field("sink", description="durable consumer on TRAJ, one per training job")
    fetch_batch: int = Field(64, ge=1, description="most trajectories per fetch")
    fetch_max_bytes: int = Field(16 * 1024 * 1024, ge=1, description="bytes per fetch at most")
    max_ack_pending: int = Field(
        4096, ge=1, description="trajectories delivered and not committed (flow control)"
    )
    ack_wait_s: float = Field(
        600.0, gt=0, description="an uncommitted trajectory is redelivered after this"
    )
    ack_timeout_s: float = Field(5.0, gt=0, description="wait for JetStream to confirm a commit")

    @model_validator(mode="after")
    def _fetch_fits(self) -> LiveSourceSettings:
        if self.fetch_batch > self.max_ack_pending:
            raise ValueError("fetch_batch must be <= max_ack_pending")
        return self
