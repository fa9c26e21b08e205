"""loadtests: workload profiles, a Locust gRPC streaming user, a headless asyncio driver, and the
goodput report with its plots (`loadtests.bench.run_bench`, behind `pdserve bench`; see
docs/structure.md).

Importing the pure modules (workload, records, goodput) pulls in neither gRPC, Locust nor
matplotlib (the locustfile must initialise gevent before gRPC is used).
"""
