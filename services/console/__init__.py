"""The web console (``megha console``): read-only pages of a federation, asked of its GMs
and LMs over their gRPC APIs (see README.md)."""
