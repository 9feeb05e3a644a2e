"""Serving: a scheduler that owns one Engine and a bounded queue of requests from many clients."""
