"""Files and vector stores: the knowledge base behind ``file_search``.

Uploaded files live on disk in the state dir, their records in the parent's
SQLite file; a vector store's chunks live in SQLite too, each with its
embedding as a float32 BLOB, searched by a bounded scan (``vectors.py``)
fused with SQLite's own full-text index. ``service.Knowledge`` is the one
object the routes and the Responses tool loop use.
"""
