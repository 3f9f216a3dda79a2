"""Files and vector stores: the knowledge base behind ``file_search``.

Uploaded files live on disk in the state dir, their records in the parent's
SQLite file; a vector store's chunks live in SQLite too, each with its
embedding as a float32 BLOB, searched by a bounded scan (``vectors.py``)
fused with SQLite's own full-text index. ``service.Knowledge`` is the one
object the routes and the Responses tool loop use.

For ``file_search`` in the tool loop: ``app[KNOWLEDGE].search(scope,
vector_store_ids, query, max_num_results, filters)`` (``scope`` is
``request_scope(request)``) returns ``SearchResult``s, best first; each
one's ``to_call_result()`` is an item of a ``file_search_call``'s
``results``, and its ``file_id`` and ``filename`` make a ``file_citation``.
It raises ``ApiError``s naming the field (404 for a store the key cannot
see, 409 naming ``file_search_embedding_model`` when no model serves it).
"""
