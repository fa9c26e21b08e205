"""admission: a pure admission policy over a snapshot of cluster load, and the controller that
applies it on the router's event loop (admit, queue with a bounded wait, or reject)."""

from admission.config import (
    THRESHOLD_FIELDS,
    AdmissionConfig,
    AdmissionThresholds,
    InvalidAdmissionConfig,
    PolicyTuning,
    TenantLimit,
)
from admission.controller import (
    AdmissionController,
    AdmissionStats,
    RequestState,
    SnapshotProvider,
)
from admission.decision import (
    Admission,
    AdmissionRejected,
    Decision,
    DecisionKind,
    DuplicateRequestId,
    Reason,
)
from admission.policy import ScaledLimits, evaluate
from admission.rate_limit import BucketState, TenantRateLimiter, charged, refilled
from admission.snapshot import (
    AdmissionLedger,
    AdmissionRequest,
    ClusterSnapshot,
    DecodeWorkerLoad,
    PrefillWorkerLoad,
    TenantAllowance,
)
from admission.throughput import PrefillThroughputEstimator, ThroughputEstimate

__all__ = [
    "THRESHOLD_FIELDS",
    "Admission",
    "AdmissionConfig",
    "AdmissionController",
    "AdmissionLedger",
    "AdmissionRejected",
    "AdmissionRequest",
    "AdmissionStats",
    "AdmissionThresholds",
    "BucketState",
    "ClusterSnapshot",
    "Decision",
    "DecisionKind",
    "DecodeWorkerLoad",
    "DuplicateRequestId",
    "InvalidAdmissionConfig",
    "PolicyTuning",
    "PrefillThroughputEstimator",
    "PrefillWorkerLoad",
    "Reason",
    "RequestState",
    "ScaledLimits",
    "SnapshotProvider",
    "TenantAllowance",
    "TenantLimit",
    "TenantRateLimiter",
    "ThroughputEstimate",
    "charged",
    "evaluate",
    "refilled",
]
