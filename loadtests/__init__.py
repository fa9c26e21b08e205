"""loadtests: workload profiles, a Locust gRPC streaming user, a headless asyncio driver, and the
goodput report with its plots (`loadtests.bench.run_bench`, behind `pdserve bench`).

Only the pure modules are re-exported here, so importing the package pulls in neither gRPC,
Locust nor matplotlib (the locustfile must initialise gevent before gRPC is used).
"""

from loadtests.goodput import (
    SLO,
    GoodputReport,
    LatencyStats,
    SLOError,
    max_rate_meeting,
    parse_slo,
    percentile,
    summarize,
)
from loadtests.records import RequestRecord, StreamTimer, read_records, write_records
from loadtests.workload import (
    PlannedRequest,
    Profile,
    ProfileError,
    generate,
    load_profile,
    profile_names,
)

__all__ = [
    "SLO",
    "GoodputReport",
    "LatencyStats",
    "PlannedRequest",
    "Profile",
    "ProfileError",
    "RequestRecord",
    "SLOError",
    "StreamTimer",
    "generate",
    "load_profile",
    "max_rate_meeting",
    "parse_slo",
    "percentile",
    "profile_names",
    "read_records",
    "summarize",
    "write_records",
]
