"""The Qt window and its controllers: they wire widgets/ to the engine through the worker thread."""
