"""Tune: the sweep's plots, on screen and as a PNG."""
