"""What the suites share: the in-script CPU cluster, the A/B client and rounds of the router
suites, CUDA timing, the titled-step log and the one table printer."""
