"""What one weight push did: :class:`SyncStats`, returned by ``WeightPusher.push`` and filled in
by the pusher and its transport (``pipeline.weights.interface.Transport``) as the push goes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SyncStats:
    weight_version: str
    transport: str
    num_tensors: int = 0
    num_buckets: int = 0
    bytes: int = 0
    """Bytes of the full model (the weights the servers now hold)."""
    wire_bytes: int = 0
    """Bytes the sources sent (less than ``bytes`` for a delta push)."""
    delta: bool = False
    verified_buckets: int = 0
    seconds_total: float = 0.0
    seconds_gather: float = 0.0
    """Time the source ranks waited for the gather (what did not overlap a send), max over ranks."""
    seconds_send: float = 0.0
    phases: dict = field(default_factory=dict)

    @property
    def gbytes_per_s(self) -> float:
        return self.bytes / max(self.seconds_total, 1e-9) / 1e9

    def metrics(self) -> dict:
        """What the loop logs under ``sync/``."""
        return {"seconds": self.seconds_total, "gbytes_per_s": self.gbytes_per_s,
                "bytes": self.bytes, "wire_bytes": self.wire_bytes, "delta": float(self.delta),
                "verified_buckets": self.verified_buckets,
                "paused_s": float(self.phases.get("paused_s", 0.0))}
