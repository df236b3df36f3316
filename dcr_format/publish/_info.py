"""What a publish committed, as callers and the tools see it (importable without torch)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from dcr_format.format.schema import CommitRecord


class CommitInfo(BaseModel):
    """What one publish committed (the whole version, across every writer rank)."""

    model_config = ConfigDict(frozen=True)

    version: int
    kind: str
    step: int | None
    attempt: str
    created: str
    tensors: int
    changed_elements: int
    total_elements: int
    payload_bytes: int
    dense_bytes: int
    state_fingerprint: str
    required_features: tuple[str, ...] = ()
    """The features the version uses (its commit record's, FORMAT.md §12)."""

    @property
    def change_rate(self) -> float:
        """Changed elements over total elements."""
        return self.changed_elements / self.total_elements if self.total_elements else 0.0

    @property
    def ratio(self) -> float:
        """Payload bytes over dense bytes."""
        return self.payload_bytes / self.dense_bytes if self.dense_bytes else 0.0

    @classmethod
    def from_record(cls, record: CommitRecord) -> CommitInfo:
        """Summarise a commit record: each field is the record's or its stats' of that name."""
        fields = record.model_dump(include=set(cls.model_fields)) | record.stats.model_dump()
        return cls.model_validate(fields)
