"""Generated at build time from proto/pdserve/v1/*.proto (see setup.py); never edit by hand."""
