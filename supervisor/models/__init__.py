"""The model library: files, GGUF headers, memory fit and placement, the demo model."""
