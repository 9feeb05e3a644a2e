"""The model store: sources, the packaged pair, GGUF, conversion cache, device and dtype."""
