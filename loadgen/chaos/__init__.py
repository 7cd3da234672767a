"""Deterministic fault-injection simulation of the real protocol (issue 27), after
FoundationDB's simulation testing and TigerBeetle's VOPR: the live drivers' protocol
around the very ``services/core`` classes, on a virtual clock, with one seed deciding
every delay, loss, duplicate, crash, pause and restart. See ``docs/chaos.md``."""
