"""Training shared by the peers and the coordinator: the inner AdamW loop (inner.py), error feedback (feedback.py),
the commitments to a lease's inner state (commitments.py), and what the trainer needs around a device
(device_io.py) and a peer's torch.distributed group (group.py). Below both peer/ and coordinator/, above models/
and transport/ (tests/test_layering.py)."""
