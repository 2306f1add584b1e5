"""The job secret the unit tests' state servers and clients share (a launched job generates its own)."""

SECRET = b"torchpass-unit-test-secret-0123456789"
