"""File and data formats that the parent and its workers both read: JSON
schemas as GBNF grammars, image and audio containers told by their bytes,
GGUF headers, which chat template a model gets (and the built-in ones).

Pure Python, without the engine or the parent's dependencies: a worker in an
environment of its own imports this package beside worker/, and the parent
imports it without importing a worker module (of those, only
worker/protocol.py, the IPC contract, is the parent's to import).
"""
