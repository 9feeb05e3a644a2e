"""The race of standard against speculative decoding: two panes and their chart."""
