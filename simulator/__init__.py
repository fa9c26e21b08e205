"""The cluster simulator: a discrete-event loop over measured profiles that calls the live
system's pure cores (admission, placement)."""
